"""Which files each source reads: its globs' files, each file once, and the document-ID stem of each.

A file is the file, not its spelling (:func:`~data.files.file_identity`, device and inode). The globs of
one source that meet on a file -- overlapping globs, a relative and an absolute path, a folder reached
through a symbolic link, a hard link -- read it once, under the first of its spellings, so a redundant
glob changes nothing. A file two sources claim is refused before compute, naming both sources' globs,
unless every source reading it has a filter: the mapping report (data/mapping.py) then keeps their
values apart. A source whose globs match nothing, and an unverified global-shuffle output
(data/shuffled.py), are refused here too.
"""

from __future__ import annotations

import os
from pathlib import Path

from data.config import DataConfig, SourceConfig, no_match_reason
from data.errors import ConfigError
from data.files import file_identity, first_spellings
from data.shuffled import shuffle_problems


def list_files(cfg: DataConfig) -> dict[str, list[str]]:
    """Each source's files (sorted), each file once under one spelling; the refusals of the module docstring."""
    files_per_source = {name: src.files() for name, src in cfg.sources.items()}
    empty = [f"data.sources.{name}.paths {cfg.sources[name].paths}: {no_match_reason(cfg.sources[name].paths)}"
             for name, files in files_per_source.items() if not files]
    if empty:
        raise ConfigError("no input files:\n  " + "\n  ".join(empty))
    files_per_source = _one_claim_per_file(cfg, files_per_source)
    incomplete = shuffle_problems(sorted({p for files in files_per_source.values() for p in files}))
    if incomplete:
        raise ConfigError("\n".join(incomplete))
    return files_per_source


def _one_claim_per_file(cfg: DataConfig, files_per_source: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each file once per source, under the first of its spellings (in sorted order) across all sources."""
    spelling = first_spellings(sorted({p for files in files_per_source.values() for p in files}))
    out = {name: sorted({spelling[p] for p in files}) for name, files in files_per_source.items()}
    claims: dict[str, list[str]] = {}
    for name, files in out.items():
        for path in files:
            claims.setdefault(path, []).append(name)
    _refuse_double_claims(cfg, {p: names for p, names in claims.items() if len(names) > 1})
    return out


def _refuse_double_claims(cfg: DataConfig, claims: dict[str, list[str]]) -> None:
    """Refuse the files two sources read where one of them takes every row (no filter), naming both globs."""
    twice = [(p, names) for p, names in claims.items() if any(cfg.sources[n].filter is None for n in names)]
    if not twice:
        return
    path, names = twice[0]
    who = " and ".join(f"data.sources.{n}.paths {_glob_of(cfg, n, path)!r}" for n in names)
    more = f" (and {len(twice) - 1} more file(s))" if len(twice) > 1 else ""
    raise ConfigError(f"{who} both claim {path}{more}: its documents would be trained once per source; narrow the "
                      "globs so that each file belongs to one source (or give every source reading it a filter)")


def _glob_of(cfg: DataConfig, name: str, path: str) -> str:
    """The first of source ``name``'s globs that matches ``path``'s file (for naming a claim)."""
    target = file_identity(path)
    return next(g for g in cfg.sources[name].paths
                if any(file_identity(p) == target for p in SourceConfig(paths=[g]).files()))


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
