"""Checkpoints, in one module: write, verify, find, fall back (docs/checkpoints.md says what each step
checks and refuses).

1. **Write** (train/checkpoint_io.py): the sidecar ``NAME.sha256``, then the file's atomic rename (a
   replaced name's sidecar holds the old and the new digest in between).
2. **Verify**, the same way for every reader (``train fit``'s resume: :func:`resolve_checkpoint`,
   :func:`requested_hparams`; the evaluation, export and ablation tools: :func:`read_checkpoint`): what
   the file is (never unpickled beyond ``weights_only=True``), its sidecar (:func:`sidecar_digests` alone
   reads it; a missing one is an error unless ``--run.allow_unverified_ckpt true``), its structure and
   the data cursor files it names (:func:`cursor_problem`). :func:`open_checkpoint` is the one place that
   opens a checkpoint for its small entries (a sharded folder: its ``meta.pt``).
3. **Find**: ``last`` is the highest step *recorded inside* the ``last*.ckpt`` files (file times say
   nothing after a copy), else the step files.
4. **Fall back** (:func:`resolve_checkpoint`, what ``--ckpt_path`` means): ``last``, ``last_or_new``,
   ``run.ckpt_fallback``; ``best``/``hpc``/``registry`` are refused (this CLI writes none).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import re
import time
from pathlib import Path

import torch

from data.cursor import DamagedCursor
from data.errors import ConfigError
from train import cursor_files

log = logging.getLogger("wellmixed")

LAST, LAST_OR_NEW = "last", "last_or_new"
REFUSED_NAMES = ("best", "hpc", "registry")
"""``--ckpt_path`` names Lightning resolves itself, none of which this CLI writes."""
_ZIP, _PARQUET = b"PK\x03\x04", b"PAR1"
_DIGESTS: dict[tuple, str] = {}
"""sha256 per (path, inode, size, mtime): the CLI reads a checkpoint's hparams before it resolves it."""
_WARNED: set[tuple] = set()


class CheckpointError(ConfigError):
    """A checkpoint a reader refuses: one line naming the file, what is wrong and what to do."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


CHECKSUM_SUFFIX = ".sha256"
_HASH_BLOCK = 16 << 20  # 16 MB reads when verifying


def checksum_path(path: Path) -> Path:
    """The sidecar ``NAME.sha256`` beside checkpoint ``NAME`` (``sha256sum -c`` reads it)."""
    path = Path(path)
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def file_sha256(path: Path, block: int = _HASH_BLOCK) -> str:
    """sha256 of a file, streamed in 16 MB blocks (memory stays flat for a multi-GB checkpoint)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


# -- 2. verify: the sidecar -------------------------------------------------------------------------


def sidecar_digests(path: Path) -> list[str]:
    """The digests ``NAME.sha256`` records, the newest first: one, or two while the writer replaces ``NAME``
    (train/checkpoint_io.py: either file verifies); [] without a sidecar. ValueError when it is malformed."""
    side = checksum_path(path)
    try:
        text = side.read_text(encoding="ascii")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"its sidecar {side.name} is unreadable ({type(e).__name__})") from None
    digests = [line.split()[0] for line in text.splitlines() if line.strip()]
    if not digests or not all(re.fullmatch(r"[0-9a-fA-F]{64}", d) for d in digests):
        raise ValueError(f"its sidecar {side.name} is malformed ({text[:40]!r}, not the 64 hex digits sha256sum "
                         "writes)")
    return [d.lower() for d in digests]


def content_sha256(path: Path) -> str:
    """A checkpoint's sha256: its sidecar's one digest (every reader verifies the file against it), else the file
    hashed (no sidecar, or two digests while a replacement was interrupted)."""
    digests = sidecar_digests(path)
    return digests[0] if len(digests) == 1 else file_sha256(path)


def _digest(path: Path) -> str:
    """sha256 of ``path``, remembered for a file last changed over a second before it was hashed: a
    later change then gets a later mtime, so a remembered digest never stands for other bytes."""
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _DIGESTS:
        return _DIGESTS[key]
    started = time.time()
    digest = file_sha256(path)
    if started - st.st_mtime > 1.0:
        _DIGESTS[key] = digest
    return digest


NO_SIDECAR = "no sidecar"
ALLOW_UNVERIFIED = "--run.allow_unverified_ckpt true"


def checksum_problem(path: Path, unverified_ok: bool = False) -> str | None:
    """None when ``path`` matches its sidecar, else what is wrong. A missing sidecar is a problem too
    (the bytes cannot be told from flipped ones), unless ``unverified_ok``: then a warning, once per file."""
    try:
        wants = sidecar_digests(path)
        if not wants:
            return _unverified(path, unverified_ok)
        got = _digest(path)
    except ValueError as e:
        return str(e)
    except OSError as e:
        return f"{type(e).__name__}: {e}"[:300]
    if got in wants:
        return None
    return (f"sha256 {got[:16]}... does not match {checksum_path(path).name} ({wants[0][:16]}...): "
            "bits changed after the write (disk, copy or memory error)")


def _unverified(path: Path, ok: bool) -> str | None:
    problem = (f"{NO_SIDECAR} {checksum_path(path).name}, so its bytes cannot be verified (written before "
               "checksums, or a kill between its rename and the sidecar)")
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_mtime_ns)
    if ok and key not in _WARNED:
        _WARNED.add(key)
        log.warning("checkpoint %s: %s; used as it opens (%s)", path, problem, ALLOW_UNVERIFIED)
    return None if ok else problem


def _way_out(path: Path, problem: str, way_out: str, flag: bool = False) -> str:
    """What to do after ``problem``: for a file without a sidecar, how to accept it (``flag``: train fit's
    flag; else writing the sidecar, which every reader then checks), else ``way_out``."""
    if not problem.startswith(NO_SIDECAR):
        return way_out
    if flag:
        return f"if you trust it, pass {ALLOW_UNVERIFIED}, or resume from another file with --ckpt_path FILE"
    return f"if you trust it, write its sidecar (in {path.parent}: sha256sum {path.name} > {path.name}.sha256)"


# -- 2. verify: what a file is ----------------------------------------------------------------------


def file_problem(path: Path, pickle_ok: bool = False) -> str | None:
    """What a file that is not torch's zip format is, from its first bytes; None for the zip format
    (``pickle_ok``: also for a pickle, torch's legacy format, which only a trusting reader unpickles)."""
    with open(path, "rb") as f:
        head = f.read(512)
    if not head:
        return "an empty file (0 bytes), not a checkpoint"
    if head.startswith(_ZIP):
        return None
    if head.startswith(_PARQUET):
        return "a parquet file, not a checkpoint"
    if head[:1] == b"\x80":
        return None if pickle_ok else "a plain pickle (not torch's zip format), not a checkpoint this code writes"
    try:
        head.decode("utf-8")
        return "a text file (YAML? a config?), not a checkpoint"
    except UnicodeDecodeError:
        return f"not a checkpoint (unknown format, first bytes {head[:8]!r})"


def load_problem(e: BaseException) -> str:
    """torch.load's failure as one line of our own; torch's advice to load with ``weights_only=False``
    (which runs whatever the pickle says) is never passed on."""
    text = str(e)
    found = re.search(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.]+)", text)  # torch's two phrasings
    if found:
        return (f"holds objects other than tensors and plain types ({found.group(1)}): refused (unpickling it "
                "could run code)")
    if isinstance(e, pickle.UnpicklingError) or "Weights only load failed" in text:
        return "corrupt (its pickled structure cannot be read)"
    if "central directory" in text or "failed reading zip archive" in text:
        return "truncated or corrupt (its zip index cannot be read)"
    if isinstance(e, EOFError):
        return "truncated (ends in the middle of its data)"
    first = re.split(r"(?<=\.)\s", text.strip(), maxsplit=1)[0] if text.strip() else ""
    return f"corrupt ({type(e).__name__}: {first[:200]})"


def _folder_problem(path: Path) -> str:
    """What a folder that is not a sharded checkpoint is."""
    entries = list(path.iterdir())
    if not entries:
        return "an empty directory, not a checkpoint"
    if (path / "checkpoints").is_dir():
        return "a run directory, not a checkpoint: name a file in its checkpoints/, or resume it with " \
               f"--run.dir {path} --ckpt_path last"
    ckpts = sorted(p.name for p in entries if p.name.endswith(".ckpt"))
    if ckpts:
        more = ", ..." if len(ckpts) > 3 else ""
        return f"a folder of {len(ckpts)} checkpoint(s) ({', '.join(ckpts[:3])}{more}), not one: name one of them"
    if (path / "meta.pt").exists() or any(p.suffix == ".distcp" for p in entries):
        return "a sharded checkpoint folder without its .metadata index (incomplete write?)"
    return "a directory, not a checkpoint (no .metadata index of a sharded checkpoint)"


def load_file(path: Path, lightning: bool = True, unverified_ok: bool = False) -> tuple[dict | None, str | None]:
    """(the checkpoint, None) or (None, what is wrong): format, sidecar, structure. mmap: tensors stay
    on disk, so this costs milliseconds besides the hash even for a multi-GB checkpoint. ``lightning``:
    require ``state_dict`` and ``global_step`` (else any dict, e.g. a bare state dict for the export)."""
    try:
        problem = file_problem(path)
    except OSError as e:
        problem = f"{type(e).__name__}: {e}"[:300]
    if problem is not None:
        return None, problem
    try:  # weights_only: never unpickles anything but tensors and plain types
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 -- any failure to load means "not usable"
        problem = load_problem(e)  # a truncated file is named so; else a failing sidecar is the better reason
        mismatch = None if problem.startswith("truncated") else checksum_problem(path)
        return None, mismatch if mismatch and not mismatch.startswith(NO_SIDECAR) else problem
    problem = _structure(obj, lightning) or checksum_problem(path, unverified_ok)  # opens: may hold flipped bits
    return (None, problem) if problem else (obj, None)


def _structure(obj, lightning: bool) -> str | None:
    if not isinstance(obj, dict):
        return f"holds a bare {type(obj).__name__}, not a checkpoint (a dict of weights and state)"
    if lightning and ("state_dict" not in obj or "global_step" not in obj):
        return "not a Lightning checkpoint (no state_dict / global_step)"
    return None


def open_checkpoint(path: str | Path) -> dict:
    """The small entries of a checkpoint (step, hparams, data state): a file, memory-mapped (the weights
    are not read), or a sharded folder's ``meta.pt``. Not verified (see :func:`checkpoint_problem`);
    raises whatever torch raises for an unreadable file."""
    path = Path(path)
    return torch.load(entries_file(path), map_location="cpu", weights_only=True, mmap=not path.is_dir())


def entries_file(path: Path) -> Path:
    """The file that holds a checkpoint's small entries: the checkpoint file, or a sharded folder's
    ``meta.pt`` (Lightning's: step, loops, hparams, the data state; the weights are in the shards)."""
    return path / "meta.pt" if path.is_dir() else path


def saved_hparams(path: str | Path) -> dict | None:
    """A checkpoint's ``hyper_parameters``; None when it has none (a sharded folder may keep them elsewhere)."""
    try:
        ckpt = open_checkpoint(path)
    except Exception:  # noqa: BLE001 -- verified already
        return None
    hparams = ckpt.get("hyper_parameters") if isinstance(ckpt, dict) else None
    return hparams if isinstance(hparams, dict) else None


# -- 2. verify: the structure, the cursors ----------------------------------------------------------


def checkpoint_problem(path: Path, cursor_ranks: list[int] | None = None, cursors: bool = True,
                       unverified_ok: bool = False) -> str | None:
    """None if ``path`` (a file or a sharded folder) opens as a checkpoint, else what is wrong.

    ``cursors``: check the data cursor files it names -- every one present, those of ``cursor_ranks``
    (default: every rank) read and range-checked (see :func:`resolve_checkpoint` for why the CLI passes
    fewer). Readers that only take the weights (evaluate, export) pass False.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / ".metadata").is_file():
            return _folder_problem(path)
        try:
            ckpt = open_checkpoint(path)
        except Exception as e:  # noqa: BLE001
            return f"meta.pt: {load_problem(e)}"
        problem = None if isinstance(ckpt, dict) and "global_step" in ckpt else "meta.pt holds no global_step"
    else:
        ckpt, problem = load_file(path, unverified_ok=unverified_ok)
    if problem is not None or not cursors:
        return problem
    return cursor_problem(ckpt, path, cursor_ranks)


def cursor_problem(ckpt: dict, path: Path, ranks: list[int] | None) -> str | None:
    """The data cursors a checkpoint names (train/cursor_files.py ``check_checkpoint_cursors``): a missing or
    damaged cursor is refused here, naming the file or the field (without its own way out: the caller says
    what to do), instead of crashing a DataLoader worker later."""
    state = ckpt.get("WellMixedData")
    if not isinstance(state, dict) or (state.get("cursors") is None and state.get("cursor_dir") is None):
        return None  # another datamodule, or an older fresh data order (run.allow_changed_data)
    try:
        cursor_files.check_checkpoint_cursors(path, state, ranks)
    except DamagedCursor as e:
        return e.problem
    except ConfigError as e:
        return str(e)
    return None


# -- 2. verify: the readers' entry point -------------------------------------------------------------


def read_checkpoint(path: str | Path, what: str, way_out: str, lightning: bool = True) -> dict:
    """The checkpoint at ``path``, verified as every reader does (the weights stay memory-mapped); anything
    wrong raises :class:`CheckpointError` ``<what> <path>: <problem>; <way_out>``."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{what} {path}: no such file; {way_out}")
    if path.is_dir():
        problem = "a sharded checkpoint folder (FSDP): this reader takes one file; convert it with `python -m " \
                  "lightning.pytorch.utilities.consolidate_checkpoint FOLDER`" if (path / ".metadata").is_file() \
            else _folder_problem(path)
        raise CheckpointError(f"{what} {path}: {problem}")
    ckpt, problem = load_file(path, lightning)
    if problem is not None:
        raise CheckpointError(f"{what} {path}: {problem}; {_way_out(path, problem, way_out)}")
    return ckpt


# -- 3. find the checkpoint to resume from -------------------------------------------------------------


def recorded_step(path: Path) -> int | None:
    """The ``global_step`` a checkpoint (file or sharded folder) records; None when it does not open."""
    try:
        step = open_checkpoint(path).get("global_step")
    except Exception:  # noqa: BLE001 -- unreadable (or not a dict): the caller names it
        return None
    return int(step) if isinstance(step, int) else None


def _name_step(path: Path) -> int:
    """The step in a ``stepNNNNNNN.ckpt`` name (FinalCheckpoint's), -1 for other names."""
    digits = path.stem[4:].split("-")[0]
    return int(digits) if path.stem.startswith("step") and digits.isdigit() else -1


def _by_step(paths: list[Path]) -> list[Path]:
    """Highest step recorded inside first (one that does not open: the step in its name, so that it is
    named where it would have stood); on a tie ``last.ckpt``, then the name. Never the file times."""
    steps = {p: recorded_step(p) for p in paths}
    return sorted(paths, key=lambda p: (_name_step(p) if steps[p] is None else steps[p], p.name == "last.ckpt",
                                        p.name), reverse=True)


def find_last(ckpt_dir: Path, label: str = "--ckpt_path last") -> Path | None:
    """The ``last*.ckpt`` of the highest recorded step (one that does not open is returned first, so that
    it is named rather than passed over: it may be the newest); None when there is none. ``label``:
    who asks, in the note logged when there are several."""
    lasts = _by_step(list(ckpt_dir.glob("last*.ckpt")))
    unreadable = [p for p in lasts if recorded_step(p) is None]
    if unreadable or len(lasts) < 2:
        return (unreadable or lasts or [None])[0]
    log.warning("%s: %s records the highest step of %s (%d); using it", label, lasts[0].name,
                ", ".join(sorted(p.name for p in lasts)), recorded_step(lasts[0]))
    return lasts[0]


def _first_valid(paths: list[Path], problem_of) -> tuple[Path | None, list[str]]:
    """The first of ``paths`` without a problem, and what was wrong with those before it."""
    skipped = []
    for path in paths:
        problem = problem_of(path)
        if problem is None:
            return path, skipped
        skipped.append(f"{path.name}: {problem}")
    return None, skipped


# -- 4. fall back: what --ckpt_path means ---------------------------------------------------------------


def _without_last(ckpt_dir: Path, mode: str, problem_of) -> str | None:
    """``--ckpt_path last``/``last_or_new`` without a ``last*.ckpt``: the step file of the highest recorded
    step that loads (a kill between a step file's rename and its ``last.ckpt`` link, or a deleted
    ``last.ckpt``: starting from step 0 would retrain the run and rewrite its order log). No checkpoint
    at all starts ``last_or_new`` at step 0, and is an error for ``last``; so is a folder whose files all
    fail to load."""
    paths = _by_step(list(ckpt_dir.glob("*.ckpt")))
    if not paths and mode == LAST_OR_NEW:
        log.warning("--ckpt_path last_or_new: no checkpoint in %s yet; starting from step 0", ckpt_dir)
        return None
    if not paths:
        raise CheckpointError(
            f"--ckpt_path last: {ckpt_dir.parent} has no checkpoint to resume ({ckpt_dir} holds no *.ckpt); to "
            "start a new run there leave out --ckpt_path, or pass --ckpt_path last_or_new (resume if there is one)")
    path, skipped = _first_valid(paths, problem_of)
    if path is None:
        raise CheckpointError(
            f"--ckpt_path {mode}: {ckpt_dir} holds checkpoint files but none loads ({'; '.join(skipped)}); "
            "restore a checkpoint, or move them away to start from step 0 deliberately")
    log.warning("--ckpt_path %s: no last.ckpt in %s; resuming from the newest loadable step file %s%s",
                mode, ckpt_dir, path, f" (unusable, skipped: {', '.join(skipped)})" if skipped else "")
    return str(path)


def resolve_checkpoint(ckpt_path: str | None, ckpt_dir: Path, fallback: bool, cursor_ranks: list[int] | None = None,
                       cursors: bool = True, unverified_ok: bool = False) -> str | None:
    """The checkpoint ``--ckpt_path`` means, verified (section 4 of the module doc); None to start from step
    0. An unusable file raises :class:`CheckpointError` naming it, unless ``fallback``: then the newest valid
    checkpoint beside it is used, logged. ``unverified_ok`` (``run.allow_unverified_ckpt``): a file without
    a sidecar is used, with a warning.

    ``cursor_ranks``: whose data cursor files are read and range-checked (default: all; every file's
    presence is always checked). Every rank resolves the checkpoint before the ranks can talk, so each
    must decide from the same facts or a fallback could pick different checkpoints: the CLI passes ``[]``
    on several ranks (each rank range-checks its own file when it loads it) rather than have every rank
    read every rank's cursors. ``cursors=False`` (``train validate``): the cursor files are not looked at.
    """
    problem_of = functools.partial(checkpoint_problem, cursor_ranks=cursor_ranks, cursors=cursors,
                                   unverified_ok=unverified_ok)
    path = _named_path(ckpt_path, ckpt_dir)
    if path is None:
        return None if ckpt_path is None else _without_last(ckpt_dir, ckpt_path, problem_of)
    problem = problem_of(path)
    if problem is None:
        return str(path)
    if not fallback:
        raise CheckpointError(f"--ckpt_path {path}: {problem}; " + _way_out(
            path, problem, "resume from another file with --ckpt_path FILE, or pass --run.ckpt_fallback true to "
            f"use the newest valid checkpoint in {path.parent}", flag=True))
    other, _ = _first_valid([p for p in _by_step(list(path.parent.glob("*.ckpt"))) if p != path], problem_of)
    if other is None:
        raise CheckpointError(f"--ckpt_path {path}: {problem}; and {path.parent} holds no valid checkpoint to "
                              "fall back to")
    log.warning("checkpoint %s is unusable (%s); falling back to %s (run.ckpt_fallback)", path, problem, other)
    return str(other)


def _named_path(ckpt_path: str | None, ckpt_dir: Path) -> Path | None:
    """The file (or sharded folder) ``--ckpt_path`` names: ``last*.ckpt`` for ``last``/``last_or_new``
    (None without one), the path itself (refused when it does not exist), None for no ``--ckpt_path``."""
    if ckpt_path in REFUSED_NAMES:
        raise CheckpointError(f"--ckpt_path {ckpt_path}: this CLI writes no {ckpt_path!r} checkpoint; use "
                              "--ckpt_path last (the newest of --run.dir), last_or_new, or a checkpoint file")
    if ckpt_path is None or ckpt_path in (LAST, LAST_OR_NEW):
        return None if ckpt_path is None else find_last(ckpt_dir, f"--ckpt_path {ckpt_path}")
    if not Path(ckpt_path).exists():  # a file, or a sharded FSDP checkpoint's folder
        raise CheckpointError(f"--ckpt_path {ckpt_path}: no such file or folder; name a checkpoint file, or use "
                              "--ckpt_path last (the newest of --run.dir)")
    return Path(ckpt_path)


def requested_hparams(ckpt_path: str | None, ckpt_dir: Path, fallback: bool, unverified_ok: bool = False) -> dict:
    """What ``--ckpt_path`` asks for, checked when the command line is parsed, before anything is built
    or written: a name this CLI writes no checkpoint for, ``last`` in a run without any, a path that
    does not exist or is no checkpoint are refused here, as :func:`resolve_checkpoint` refuses them (its
    cursor files are checked when the run starts; with ``fallback`` so is a file, to fall back from it).
    Returns the checkpoint's ``hyper_parameters`` ({} when not read)."""
    if ckpt_path in (None, LAST_OR_NEW) or (ckpt_path == LAST and any(ckpt_dir.glob("*.ckpt"))):
        return {}
    path = _named_path(ckpt_path, ckpt_dir)
    if fallback and path is not None and path.is_file():
        return {}
    verified = resolve_checkpoint(ckpt_path, ckpt_dir, False, cursors=False, unverified_ok=unverified_ok)
    return saved_hparams(verified) or {}


# -- the data cursor folders no checkpoint references --------------------------------------------------


def remove_unreferenced(ckpt_dir: str | os.PathLike, cache: dict | None = None) -> list[Path]:
    """Delete the cursor step directories (train/cursor_files.py) that no ``*.ckpt`` in ``ckpt_dir``
    references, never the newest. If any checkpoint cannot be read, nothing is removed (its references
    are unknown; logged). ``cache`` (kept by the caller between calls) maps a checkpoint's name and stat
    to its reference, so a run that keeps every checkpoint does not re-open all of them at each save."""
    cache = {} if cache is None else cache
    keep = set()
    for ckpt in sorted(Path(ckpt_dir).glob("*.ckpt")):
        try:
            st = entries_file(ckpt).stat()
            key = (ckpt.name, st.st_ino, st.st_size, st.st_mtime_ns)
            if key not in cache:
                state = open_checkpoint(ckpt).get("WellMixedData")
                cache[key] = state.get("cursor_dir") if isinstance(state, dict) else None
        except Exception as e:  # noqa: BLE001 -- a corrupt or half-copied checkpoint: leave everything
            log.warning("data cursor clean-up skipped: %s is unreadable (%s: %s), so which cursor directory it "
                        "references is unknown", ckpt, type(e).__name__, str(e).strip()[:200])
            return []
        keep.add(Path(cache[key] or ".").name)
    return cursor_files.remove_step_dirs(Path(ckpt_dir), keep)
