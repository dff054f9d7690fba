"""Checkpoints, in one module: write, verify, find, fall back.

1. **Write** (:class:`AtomicCheckpointIO`, :class:`FinalCheckpoint`, :func:`link_checkpoint`): torch.save to
   a temporary file, fsync, rename over the target, then the sidecar ``NAME.sha256``; each step's
   checkpoint is written once, ``last.ckpt`` at a step file is a hard link to it, and a separate file at
   the final step. :func:`remove_stale_temp_files` clears what a killed write left.
2. **Verify**, the same way for every reader: ``train fit``'s resume (:func:`resolve_checkpoint`, and the
   CLI's read of the checkpoint's hparams), ``scripts/evaluate.py``, ``scripts/export_hf.py`` and the
   ablation report (:func:`read_checkpoint`). In order:

   a. **What the file is**: an empty file, a parquet or text file, a folder that is not a sharded
      checkpoint, a truncated file, a saved tensor, a pickle that holds objects other than tensors and
      plain types (never unpickled: ``weights_only=True`` always) are each named as what they are.
   b. **The sidecar** ``NAME.sha256`` (``sha256sum -c`` format). A wrong digest or a malformed sidecar
      is an error; a missing one is a warning naming the file (a run from before checksums, or a kill
      between the rename and the sidecar), and the file is then only opened. Sharded (FSDP) checkpoint
      folders have no sidecar: their shards are written by every rank through torch.distributed.checkpoint.
   c. **The structure**: a Lightning checkpoint holds ``state_dict`` and ``global_step``; the data cursor
      files it names exist and are range-checked (:func:`cursor_problem`).

3. **Find**: ``last`` is the checkpoint of the highest step *recorded inside* the ``last*.ckpt`` files
   (file times say nothing after a copy or a restore); without any ``last*.ckpt``, the step files.
4. **Fall back** (:func:`resolve_checkpoint`, what ``--ckpt_path`` means): ``last`` where the run has no
   checkpoint is refused; ``last_or_new`` starts such a run at step 0 (the SLURM requeue's choice: its
   first launch has nothing to resume); an unusable file is refused in one line, or with
   ``run.ckpt_fallback`` the newest valid checkpoint beside it is used.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import re
import shutil
import time
from pathlib import Path

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from data import files
from data.errors import ConfigError
from train import lightning_internals as internals

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


# -- 1. write ---------------------------------------------------------------------------------------


def _temporary(path: Path) -> Path:
    """Where a checkpoint is written before its rename: ``.NAME.tmpPID`` beside it (what
    :func:`remove_stale_temp_files` clears after a kill)."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


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


def read_checksum(path: Path) -> str | None:
    """The digest the sidecar of checkpoint ``path`` records; None without a (well-formed) sidecar."""
    try:
        words = checksum_path(path).read_text().split()
    except OSError:
        return None
    return words[0].lower() if words and len(words[0]) == 64 else None


def _write_checksum(path: Path, digest: str) -> None:
    """Atomically, after ``path`` is in place. A failure leaves the checkpoint unverified, not lost."""
    try:
        files.write_text(checksum_path(path), f"{digest}  {path.name}\n")
    except OSError as e:
        log.warning("could not write %s (%s); %s is intact but its checksum cannot be verified on resume",
                    checksum_path(path), e, path)


def link_checkpoint(src: Path, dst: Path) -> None:
    """``dst`` becomes the file ``src`` (a hard link; a copy where the filesystem has none), replaced
    atomically through a temporary like AtomicCheckpointIO's writes; ``src``'s checksum goes with it."""
    try:
        with files.atomic_path(dst, fsync=False, tmp=_temporary(dst)) as tmp:
            try:
                os.link(src, tmp)
            except OSError:
                shutil.copyfile(src, tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
            checksum_path(dst).unlink(missing_ok=True)  # never an old checksum beside the new file
    except OSError as e:  # out of space or inodes: the copy (a link needs an inode too) failed
        raise files.write_error(dst, e, f"resume with --ckpt_path {src}",
                                f"{src} holds the same state and is intact") from e
    digest = read_checksum(src)
    if digest is not None:
        _write_checksum(dst, digest)


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to a temporary file in the same folder, fsync, then rename over the target.

    A kill (or a full disk) during the write leaves the previous checkpoint intact, never a
    truncated ``last.ckpt``. Each file gets a sidecar ``NAME.sha256``: hashed from the page cache after
    the fsync (about 0.7 s/GB on this CPU, ~3 s for the 350M run's 4.3 GB), written atomically after the
    rename; the old sidecar is removed before the rename, so a kill in between leaves a checkpoint
    without a checksum, never a wrong one. Every reader verifies it (section 2). Removing a
    checkpoint (``keep_last_k``) removes its sidecar.
    """

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:  # a stale temporary of this pid, or a link left there, is removed first: never written through
            with files.atomic_path(path, fsync=False, tmp=_temporary(path)) as tmp:
                with open(tmp, "xb") as f:
                    torch.save(checkpoint, f)  # a real file: torch's fast path (a hashing wrapper cost 4x the re-read)
                    f.flush()
                    os.fsync(f.fileno())
                digest = file_sha256(tmp)  # from the page cache, just written
                checksum_path(path).unlink(missing_ok=True)
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as RuntimeError (its zip writer)
            raise files.write_error(f"checkpoint {path}", e, "resume with --ckpt_path last", "the previous "
                                    "checkpoint is intact and the partial file was removed") from e
        _write_checksum(path, digest)

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        checksum_path(Path(path)).unlink(missing_ok=True)


class FinalCheckpoint(internals.CheckpointHooks):
    """ModelCheckpoint that writes each checkpoint once, and ``last.ckpt`` at the final step too.

    Lightning writes ``last.ckpt`` at the end of training only when it wrote no checkpoint during the
    run: a 308-step run with checkpoints every 50 steps ended with ``last.ckpt`` at step 300, so the
    exported (or evaluated, or ablation-compared) model missed the end of the anneal and the LR
    decay. A run stopped early by a signal is left to StopOnSignal, which wrote its own checkpoint.

    With ``save_last=True`` Lightning serializes the step file and then ``last.ckpt`` again, the same
    state twice (for the 350M run ~4.3 GB of weights and AdamW moments, on the training's critical
    path). Here ``last.ckpt`` at the step of a step file is a hard link to it, put in place with a
    rename (atomic, as every checkpoint write); the step file is written with the callback state
    that ``last.ckpt`` holds, so the two names are interchangeable for a resume.

    After each save, removal (``keep_last_k``) or link, global rank 0 deletes the data cursor folders
    (train/cursor_files.py) that no checkpoint in ``dirpath`` references any more.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._cursor_refs: dict = {}  # checkpoint name and stat -> the cursor folder it references

    def save_step_file(self, trainer, monitor_candidates) -> None:
        if self.save_last is True:  # the state the step file saves is then the one last.ckpt holds
            self.last_model_path = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
        super().save_step_file(trainer, monitor_candidates)
        self._remove_unreferenced_cursors(trainer)

    def save_last_file(self, trainer, monitor_candidates) -> None:
        self._save_or_link_last(trainer, monitor_candidates)
        self._remove_unreferenced_cursors(trainer)

    def _save_or_link_last(self, trainer, monitor_candidates) -> None:
        src = self.last_saved_path
        last = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
        if not (self.save_last is True and src and self.last_saved_step == trainer.global_step
                and os.path.basename(src) != os.path.basename(last) and "://" not in src):
            return super().save_last_file(trainer, monitor_candidates)
        # rank 0 decides for all ranks: a sharded checkpoint is a folder, and other nodes may not see it
        if not trainer.strategy.broadcast(os.path.isfile(src) if trainer.is_global_zero else None, src=0):
            return super().save_last_file(trainer, monitor_candidates)
        self.last_model_path = last
        if trainer.is_global_zero:
            link_checkpoint(Path(src), Path(last))
        trainer.strategy.barrier()

    def _remove_unreferenced_cursors(self, trainer) -> None:
        """Here rather than in AtomicCheckpointIO: sharded FSDP checkpoints do not go through it."""
        if trainer.is_global_zero and self.dirpath and "://" not in str(self.dirpath):
            from train.cursor_files import remove_unreferenced

            remove_unreferenced(self.dirpath, self._cursor_refs)

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)  # last.ckpt when nothing was saved during the run
        finished = trainer.max_steps is not None and trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
        if self.save_last and finished and self.last_saved_step != trainer.global_step:
            self.save_last_file(trainer, self.monitor_candidates(trainer))

    @property
    def state_key(self) -> str:
        # ModelCheckpoint's key: checkpoints stay interchangeable with it (keep_last_k and last.ckpt's
        # path are restored on resume, so last.ckpt is overwritten instead of a new last-v1.ckpt)
        return super().state_key.replace(type(self).__qualname__, "ModelCheckpoint", 1)


def remove_stale_temp_files(ckpt_dir: Path) -> list[Path]:
    """Half-written ``.NAME.tmpPID`` files of a save that was killed (AtomicCheckpointIO); they can be
    as large as a checkpoint. Called before training starts, when no save can be in progress.

    Also the temporaries of checksum sidecars, and sidecars whose checkpoint is gone (a kill between
    keep_last_k's removal of a file and of its sidecar)."""
    stale = []
    if ckpt_dir.is_dir():
        stale = sorted(ckpt_dir.glob(".*.ckpt.tmp*")) + sorted(ckpt_dir.glob(f".*.ckpt{CHECKSUM_SUFFIX}.*.tmp"))
        stale += [p for p in sorted(ckpt_dir.glob(f"*.ckpt{CHECKSUM_SUFFIX}"))
                  if not p.with_name(p.name[: -len(CHECKSUM_SUFFIX)]).exists()]
    for p in stale:
        p.unlink(missing_ok=True)
        log.warning("removed %s, left by a checkpoint write that did not finish", p)
    return stale


# -- 2. verify: the sidecar -------------------------------------------------------------------------


def sidecar_digest(path: Path) -> str | None:
    """The digest ``NAME.sha256`` records; None without a sidecar. ValueError when it is malformed."""
    side = checksum_path(path)
    try:
        text = side.read_text(encoding="ascii")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"its sidecar {side.name} is unreadable ({type(e).__name__})") from None
    words = text.split()
    if not words or not re.fullmatch(r"[0-9a-fA-F]{64}", words[0]):
        raise ValueError(f"its sidecar {side.name} is malformed ({text[:40]!r}, not the 64 hex digits sha256sum "
                         "writes)")
    return words[0].lower()


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


def checksum_problem(path: Path) -> str | None:
    """None when ``path`` matches its sidecar or has none (see :func:`has_sidecar`); else what is wrong."""
    try:
        want = sidecar_digest(path)
        if want is None:
            return None
        got = _digest(path)
    except ValueError as e:
        return str(e)
    except OSError as e:
        return f"{type(e).__name__}: {e}"[:300]
    if got == want:
        return None
    return (f"sha256 {got[:16]}... does not match {checksum_path(path).name} ({want[:16]}...): "
            "bits changed after the write (disk, copy or memory error)")


def has_sidecar(path: Path) -> bool:
    return Path(path).is_dir() or checksum_path(path).exists()


def warn_unverified(path: Path) -> None:
    """The warning for a checkpoint file without a sidecar (it is used, only opened); once per file."""
    if has_sidecar(path):
        return
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_mtime_ns)
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("checkpoint %s has no sidecar %s: its bytes cannot be verified (written before checksums, "
                    "or a kill between its rename and the sidecar); used as it opens", path,
                    checksum_path(path).name)


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


def load_file(path: Path, lightning: bool = True) -> tuple[dict | None, str | None]:
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
        return None, problem if problem.startswith("truncated") else checksum_problem(path) or problem
    problem = checksum_problem(path)  # what opens may still hold flipped bits (a tensor, a zip member)
    if problem is not None:
        return None, problem
    if not isinstance(obj, dict):
        return None, f"holds a bare {type(obj).__name__}, not a checkpoint (a dict of weights and state)"
    if lightning and ("state_dict" not in obj or "global_step" not in obj):
        return None, "not a Lightning checkpoint (no state_dict / global_step)"
    return obj, None


# -- 2. verify: the structure, the cursors ----------------------------------------------------------


def checkpoint_problem(path: Path, cursor_ranks: list[int] | None = None, cursors: bool = True) -> str | None:
    """None if ``path`` (a file or a sharded folder) opens as a checkpoint, else what is wrong.

    ``cursors``: check the data cursor files it names -- every one present, those of ``cursor_ranks``
    (default: every rank) read and range-checked (see :func:`resolve_checkpoint` for why the CLI passes
    fewer). Readers that only take the weights (evaluate, export) pass False.
    """
    path = Path(path)
    if path.is_dir():
        return _sharded_checkpoint_problem(path, cursor_ranks if cursors else None, cursors)
    ckpt, problem = load_file(path)
    if problem is not None:
        return problem
    return cursor_problem(ckpt, path, cursor_ranks) if cursors else None


def _sharded_checkpoint_problem(path: Path, cursor_ranks: list[int] | None, cursors: bool) -> str | None:
    """A sharded folder: its ``.metadata`` index and Lightning's ``meta.pt`` (step, loops, the data
    state naming the cursor files, which lie beside the folder)."""
    if not (path / ".metadata").is_file():
        return _folder_problem(path)
    try:
        meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        return f"meta.pt: {load_problem(e)}"
    if not isinstance(meta, dict) or "global_step" not in meta:
        return "meta.pt holds no global_step"
    return cursor_problem(meta, path, cursor_ranks) if cursors else None


def cursor_problem(ckpt: dict, path: Path, ranks: list[int] | None) -> str | None:
    """The data cursors a checkpoint names: every rank's file present, those of ``ranks`` (None: all)
    range-checked and against its step (data/cursor.py). A missing or damaged cursor is refused here,
    naming the file or the field, instead of crashing a DataLoader worker later."""
    from data.cursor import ConsumerCursor, check_order_state
    from train.cursor_files import cursor_files, load_checkpoint_cursors

    state = ckpt.get("WellMixedData")
    if not isinstance(state, dict) or (state.get("cursors") is None and state.get("cursor_dir") is None):
        return None  # another datamodule, or an older fresh data order (run.allow_changed_data)
    missing = [f for f in cursor_files(path, state) if not f.is_file()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return f"data cursor file {missing[0]}{more} missing (a checkpoint moved without its cursors/ folder?)"
    try:
        cursors = load_checkpoint_cursors(path, state, ranks)
    except ConfigError as e:
        return str(e)
    if any(isinstance(c, dict) and not ConsumerCursor.is_current(c)
           for rank in cursors if isinstance(rank, list) for c in rank):
        return None  # another version of the data path: the datamodule's own error says what to do
    if not cursors:
        return None
    try:
        check_order_state({**state, "cursors": cursors}, ranks=ranks)
    except ConfigError as e:
        return str(e)
    return None


# -- 2. verify: the readers' entry point -------------------------------------------------------------


def read_checkpoint(path: str | Path, what: str, way_out: str, lightning: bool = True) -> dict:
    """The checkpoint at ``path``, verified as every reader does (the weights stay memory-mapped):
    a missing sidecar is a warning naming the file; anything else wrong raises :class:`CheckpointError`
    ``<what> <path>: <problem>; <way_out>``."""
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
        raise CheckpointError(f"{what} {path}: {problem}; {way_out}")
    warn_unverified(path)
    return ckpt


# -- 3. find the checkpoint to resume from -------------------------------------------------------------


def recorded_step(path: Path) -> int | None:
    """The ``global_step`` a checkpoint (file or sharded folder) records; None when it does not open."""
    try:
        if path.is_dir():
            meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
        else:
            meta = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        step = meta.get("global_step") if isinstance(meta, dict) else None
    except Exception:  # noqa: BLE001 -- unreadable: the caller names it
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
    lasts = sorted(ckpt_dir.glob("last*.ckpt")) if ckpt_dir.is_dir() else []
    steps = {p: recorded_step(p) for p in lasts}
    unreadable = [p for p in _by_step(lasts) if steps[p] is None]
    if unreadable or not lasts:
        return unreadable[0] if unreadable else None
    best = max(lasts, key=lambda p: (steps[p], p.name == "last.ckpt", p.name))
    if len(lasts) > 1:
        log.warning("%s: %s records the highest step of %s (%d); using it", label, best.name,
                    ", ".join(p.name for p in lasts), steps[best])
    return best



def _newest_step_file(ckpt_dir: Path, mode: str, cursor_ranks: list[int] | None, cursors: bool) -> str:
    """``--ckpt_path last`` without a ``last*.ckpt``: the step file of the highest recorded step that loads.

    A kill between a step file's rename and its ``last.ckpt`` link (or a deleted ``last.ckpt``) leaves
    step files only; starting from step 0 would retrain the run and rewrite its order log. A run dir
    whose files all fail to load is an error.
    """
    skipped = []
    for path in _by_step(list(ckpt_dir.glob("*.ckpt"))):
        problem = checkpoint_problem(path, cursor_ranks, cursors)
        if problem is None:
            log.warning("--ckpt_path %s: no last.ckpt in %s; resuming from the newest loadable step file %s%s",
                        mode, ckpt_dir, path, f" (unusable, skipped: {', '.join(skipped)})" if skipped else "")
            warn_unverified(path)
            return str(path)
        skipped.append(f"{path.name}: {problem}")
    raise CheckpointError(
        f"--ckpt_path {mode}: {ckpt_dir} holds checkpoint files but none loads ({'; '.join(skipped)}); "
        "restore a checkpoint, or move them away to start from step 0 deliberately"
    )


# -- 4. fall back: what --ckpt_path means ---------------------------------------------------------------


def _no_checkpoint(ckpt_dir: Path, mode: str) -> None:
    if mode == LAST_OR_NEW:
        log.warning("--ckpt_path last_or_new: no checkpoint in %s yet; starting from step 0", ckpt_dir)
        return None
    raise CheckpointError(
        f"--ckpt_path last: {ckpt_dir.parent} has no checkpoint to resume ({ckpt_dir} holds no *.ckpt); to start "
        f"a new run there leave out --ckpt_path, or pass --ckpt_path last_or_new (resume if there is one)"
    )


def resolve_checkpoint(ckpt_path: str | None, ckpt_dir: Path, fallback: bool,
                       cursor_ranks: list[int] | None = None, cursors: bool = True) -> str | None:
    """The checkpoint ``--ckpt_path`` means, verified; None to start from step 0.

    ``last``: :func:`find_last`, or without any ``last*.ckpt`` the newest step file that loads
    (:func:`_newest_step_file`); no checkpoint at all is an error. ``last_or_new``: the same, but no
    checkpoint starts from step 0. ``best``/``hpc``/``registry`` are refused (this CLI writes none).
    An unusable file raises :class:`CheckpointError` naming it, unless ``fallback``: then the newest valid
    checkpoint beside it is used, and logged.

    ``cursor_ranks``: whose data cursor files are read and range-checked (default: all; every file's
    presence is always checked). Every rank resolves the checkpoint on its own, before the ranks can
    talk, so each must decide from the same facts or a fallback could pick different checkpoints on
    different ranks. The CLI passes ``[]`` on several ranks (presence only, the same answer everywhere;
    each rank then range-checks its own file when it loads it, an error naming the file) rather than
    have every rank read every rank's cursors here, which this layout exists to avoid. ``cursors=False``
    (``train validate``, which reads no data state): the cursor files are not looked at.
    """
    if ckpt_path is None:
        return None
    if ckpt_path in REFUSED_NAMES:
        raise CheckpointError(f"--ckpt_path {ckpt_path}: this CLI writes no {ckpt_path!r} checkpoint; use "
                              "--ckpt_path last (the newest of --run.dir), last_or_new, or a checkpoint file")
    if ckpt_path in (LAST, LAST_OR_NEW):
        path = find_last(ckpt_dir, f"--ckpt_path {ckpt_path}")
        if path is None:
            files = list(ckpt_dir.glob("*.ckpt")) if ckpt_dir.is_dir() else []
            if not files:
                return _no_checkpoint(ckpt_dir, ckpt_path)
            return _newest_step_file(ckpt_dir, ckpt_path, cursor_ranks, cursors)
    else:
        path = Path(ckpt_path)
        if not path.exists():  # a file, or a sharded FSDP checkpoint's folder
            raise CheckpointError(f"--ckpt_path {path}: no such file or folder; name a checkpoint file, or use "
                                  "--ckpt_path last (the newest of --run.dir)")
    problem = checkpoint_problem(path, cursor_ranks, cursors)
    if problem is None:
        warn_unverified(path)
        return str(path)
    where = path.parent
    if not fallback:
        raise CheckpointError(f"--ckpt_path {path}: {problem}; resume from another file with --ckpt_path FILE, "
                              f"or pass --run.ckpt_fallback true to use the newest valid checkpoint in {where}")
    for other in _by_step(list(where.glob("*.ckpt"))):
        if other != path and checkpoint_problem(other, cursor_ranks, cursors) is None:
            log.warning("checkpoint %s is unusable (%s); falling back to %s (run.ckpt_fallback)", path, problem, other)
            warn_unverified(other)
            return str(other)
    raise CheckpointError(f"--ckpt_path {path}: {problem}; and {where} holds no valid checkpoint to fall back to")


def requested_hparams(ckpt_path: str | None, ckpt_dir: Path, fallback: bool) -> dict:
    """What ``--ckpt_path`` asks for, checked when the command line is parsed, before anything is built
    or written: a name this CLI writes no checkpoint for, ``last`` in a run without any, a path that
    does not exist or is no checkpoint are refused here. For a file, its ``hyper_parameters``, verified
    as every reader does (with ``fallback`` an unusable file gives ``{}``: :func:`resolve_checkpoint`
    falls back when the run starts)."""
    if ckpt_path is None or ckpt_path == LAST_OR_NEW:
        return {}
    if ckpt_path == LAST or ckpt_path in REFUSED_NAMES:
        if ckpt_path in REFUSED_NAMES or not (ckpt_dir.is_dir() and any(ckpt_dir.glob("*.ckpt"))):
            resolve_checkpoint(ckpt_path, ckpt_dir, fallback)  # raises the refusal
        return {}
    path = Path(ckpt_path)
    if path.is_dir() and not (path / ".metadata").is_file():
        raise CheckpointError(f"--ckpt_path {path}: {_folder_problem(path)}")
    if path.is_dir():
        return {}
    way_out = "resume from another file with --ckpt_path FILE, or pass --run.ckpt_fallback true"
    try:
        hparams = read_checkpoint(path, "--ckpt_path", way_out).get("hyper_parameters")
    except CheckpointError:
        if fallback and path.exists():
            return {}
        raise
    return hparams if isinstance(hparams, dict) else {}
