"""Which files each source reads: its globs' files, each file once, and the document-ID stem of each.

A file is its bytes, not its spelling. The same file (:func:`~data.files.file_identity`, device and inode)
reached by globs of one source that meet on it -- overlapping globs, a relative and an absolute path, a
folder reached through a symbolic link, a hard link -- is read once, under the first of its spellings, so
a redundant glob changes nothing. A byte-identical copy (another inode: a copied file, another name or
folder; :func:`~data.files.byte_copies`) is the same file too: read once, as the first file with its bytes
in sorted order, with one warning naming both paths. A file (or a copy of it) two sources claim is refused
before compute, naming both sources' globs, unless every source reading it has a filter: the mapping
report (data/mapping.py) then keeps their values apart. A glob that matches nothing (:func:`glob_each`,
which scripts/global_shuffle.py shares) and an unverified global-shuffle output (data/shuffled.py) are
refused here too.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from data.config import DataConfig, SourceConfig, no_match_reason
from data.errors import ConfigError
from data.files import byte_copies, first_spellings
from data.shuffled import shuffle_problems

log = logging.getLogger(__name__)


def list_files(cfg: DataConfig) -> dict[str, list[str]]:
    """Each source's files (sorted), each file once under one spelling; the refusals of the module docstring."""
    matched = glob_each({f"data.sources.{name}.paths": src.paths for name, src in cfg.sources.items()})
    files_per_source = _one_claim_per_file(cfg, dict(zip(cfg.sources, matched.values())))
    incomplete = shuffle_problems(sorted({p for files in files_per_source.values() for p in files}))
    if incomplete:
        raise ConfigError("\n".join(incomplete))
    return files_per_source


def glob_each(globs: dict[str, list[str]]) -> dict[str, dict[str, list[str]]]:
    """Per key (the config key or flag that gives the globs), each glob's files (``~``, ``$VAR`` and ``**`` as
    :meth:`SourceConfig.files` expands them). Every glob must match a file: one that matches nothing beside
    globs that match (a typo folder, a wrong extension, an unset variable) would read less than asked with
    no word, so each such glob is a line of one ConfigError, naming the key and the glob."""
    matched = {key: {g: SourceConfig(paths=[g]).files() for g in patterns} for key, patterns in globs.items()}
    empty = [f"{key} {g!r}: {no_match_reason([g])}; every glob must match a file: fix the glob or remove it"
             for key, by_glob in matched.items() for g, files in by_glob.items() if not files]
    if empty:
        raise ConfigError("\n".join(empty))
    return matched


def _one_claim_per_file(cfg: DataConfig, matched: dict[str, dict[str, list[str]]]) -> dict[str, list[str]]:
    """Each source's files (``matched``: source -> glob -> files), each file once: under the first of its
    spellings (in sorted order) across all sources, a byte-identical copy as the first file with its bytes."""
    spelling = first_spellings(sorted({p for by_glob in matched.values() for files in by_glob.values() for p in files}))
    copies = byte_copies(sorted(set(spelling.values())))
    first = {p: copies.get(s, s) for p, s in spelling.items()}
    claims: dict[str, dict[str, tuple[str, str]]] = {}  # file -> source -> (its glob, the path it matched)
    for name, by_glob in matched.items():
        for g, files in by_glob.items():
            for path in files:
                claims.setdefault(first[path], {}).setdefault(name, (g, spelling[path]))
    _refuse_double_claims(cfg, {p: by for p, by in claims.items() if len(by) > 1})
    for copy, kept in copies.items():
        log.warning("%s has the same bytes as %s: its documents are read once, as %s's", copy, kept, kept)
    return {name: sorted({first[p] for files in by_glob.values() for p in files}) for name, by_glob in matched.items()}


def _refuse_double_claims(cfg: DataConfig, claims: dict[str, dict[str, tuple[str, str]]]) -> None:
    """Refuse the files two sources read where one of them takes every row (no filter), naming both globs
    (and both paths, where one source reads a byte-identical copy)."""
    twice = [(p, by) for p, by in claims.items() if any(cfg.sources[n].filter is None for n in by)]
    if not twice:
        return
    path, by = twice[0]
    who = " and ".join(f"data.sources.{n}.paths {g!r}" for n, (g, _) in by.items())
    paths = sorted({p for _, p in by.values()})
    what = path if len(paths) == 1 else f"{paths[0]} and its byte-identical copy {' and '.join(paths[1:])}"
    more = f" (and {len(twice) - 1} more file(s))" if len(twice) > 1 else ""
    raise ConfigError(f"{who} both claim {what}{more}: its documents would be trained once per source; narrow the "
                      "globs so that each file belongs to one source (or give every source reading it a filter)")


def doc_id_stems(paths: list[str]) -> dict[str, str]:
    """File stem as the doc-ID prefix; qualified by the parent folder(s) where stems collide."""
    by_stem: dict[str, list[str]] = {}
    for p in paths:
        by_stem.setdefault(Path(p).stem, []).append(p)
    out = {}
    for stem, group in by_stem.items():
        if len(group) == 1:
            out[group[0]] = stem
            continue
        common = os.path.commonpath([os.path.abspath(p) for p in group])
        for p in group:
            out[p] = str(Path(os.path.relpath(os.path.abspath(p), common)).with_suffix(""))
    return out
