"""Checkpoint writes (train/checkpoint.py section 1; reading and verifying is train/checkpoint.py's):
atomic with a sidecar (:class:`AtomicCheckpointIO`), once per step with ``last.ckpt`` a hard link
(:class:`FinalCheckpoint`), and :func:`remove_stale_temp_files` for what a killed write left.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from data import files
from train import lightning_internals as internals
from train.checkpoint import CHECKSUM_SUFFIX, checksum_path, file_sha256, remove_unreferenced, sidecar_digests

log = logging.getLogger("wellmixed")


def _temporary(path: Path) -> Path:
    """Where a checkpoint is written before its rename: ``.NAME.tmpPID`` beside it (what
    :func:`remove_stale_temp_files` clears after a kill)."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def _sidecar_before_rename(path: Path, digest: str) -> bool:
    """Before ``path``'s rename its sidecar records ``digest``, so that whichever file a kill leaves at
    ``path`` verifies: a new name's sidecar is then final (True); a name being replaced keeps its old
    file's digest on a second line until the sidecar is rewritten after the rename (False). An old file
    without a valid sidecar loses it: a kill then leaves no checksum, never a wrong one."""
    replacing = path.exists() or path.is_symlink()
    try:
        old = sidecar_digests(path) if replacing else []
    except ValueError:
        old = []
    if replacing and not old:
        checksum_path(path).unlink(missing_ok=True)
        return False
    files.write_text(checksum_path(path), "".join(f"{d}  {path.name}\n" for d in dict.fromkeys([digest, *old])))
    return not old


def _write_checksum(path: Path, digest: str) -> None:
    """Atomically, after ``path`` is in place. A failure leaves the checkpoint unverified, not lost."""
    try:
        files.write_text(checksum_path(path), f"{digest}  {path.name}\n")
    except OSError as e:
        log.warning("could not write %s (%s); %s is intact; if a resume refuses it as unverified, write its sidecar "
                    "(sha256sum) or pass --run.allow_unverified_ckpt true", checksum_path(path), e, path)


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
            try:
                digests = sidecar_digests(src)
            except ValueError:  # a malformed sidecar is not carried over: dst is refused as unverified, as src is
                digests = []
            digest = digests[0] if len(digests) == 1 else None
            new_name = digest is not None and _sidecar_before_rename(dst, digest)
            if digest is None:
                checksum_path(dst).unlink(missing_ok=True)  # never an old checksum beside the new file
    except OSError as e:  # out of space or inodes: the copy (a link needs an inode too) failed
        raise files.write_error(dst, e, f"resume with --ckpt_path {src}",
                                f"{src} holds the same state and is intact") from e
    if digest is not None and not new_name:
        _write_checksum(dst, digest)


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to a temporary file in the same folder, fsync, then rename over the target: a kill (or
    a full disk) during the write leaves the previous checkpoint intact. The sidecar ``NAME.sha256`` is
    hashed from the page cache after the fsync (~0.7 s/GB here) and written atomically before the rename:
    final for a new name (a step file), for a replaced name (``last.ckpt``) with the old file's digest on a
    second line until it is rewritten after the rename, so a kill at any moment leaves a file that verifies
    (:func:`_sidecar_before_rename`). ``keep_last_k``'s removal of a checkpoint removes its sidecar."""

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
                new_name = _sidecar_before_rename(path, digest)
        except (OSError, RuntimeError) as e:
            raise _save_error(path, e) from e
        if not new_name:
            _write_checksum(path, digest)

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        checksum_path(Path(path)).unlink(missing_ok=True)


def _save_error(path: Path, e: Exception) -> files.WriteError:
    """A failed checkpoint write, in one line. torch's zip writer reports a short write (a full disk or
    quota: ``unexpected pos 704 vs 598``, ``file write failed``) as a RuntimeError without errno; a
    permission problem fails at the open, with one. What is kept depends on whether this is the run's
    first checkpoint."""
    if isinstance(e, RuntimeError) and ("inline_container" in str(e) or "PytorchStreamWriter" in str(e)):
        e = OSError(errno.ENOSPC, str(e).strip().splitlines()[0])
    if path.exists() or any(p != path for p in path.parent.glob("*.ckpt")):
        return files.write_error(f"checkpoint {path}", e, "resume with --ckpt_path last",
                                 "the previous checkpoint is intact and the partial file was removed")
    return files.write_error(f"checkpoint {path}", e, "start again with --ckpt_path last_or_new",
                             "this was the run's first checkpoint, so there is none to resume; the partial "
                             "file was removed")


class FinalCheckpoint(internals.CheckpointHooks):
    """ModelCheckpoint that writes each checkpoint once, and ``last.ckpt`` at the final step too
    (Lightning's writes it at the end only when it wrote none during the run, missing the end of the
    anneal; a run stopped by a signal is left to StopOnSignal). ``last.ckpt`` at a step file's step is a
    hard link to it, not a second serialization of the same state (~4.3 GB for the 350M run, on the
    critical path). After each save, removal or link, global rank 0 deletes the data cursor folders no
    checkpoint in ``dirpath`` references (train/checkpoint.py ``remove_unreferenced``)."""

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
    """Half-written ``.NAME.tmpPID`` files of a killed save (AtomicCheckpointIO; as large as a checkpoint),
    the temporaries of checksum sidecars, and sidecars whose checkpoint is gone (a kill between keep_last_k's
    removal of a file and of its sidecar). Called before training starts, when no save can be in progress."""
    stale = []
    if ckpt_dir.is_dir():
        stale = sorted(ckpt_dir.glob(".*.ckpt.tmp*")) + sorted(ckpt_dir.glob(f".*.ckpt{CHECKSUM_SUFFIX}.*.tmp"))
        stale += [p for p in sorted(ckpt_dir.glob(f"*.ckpt{CHECKSUM_SUFFIX}"))
                  if not p.with_name(p.name[: -len(CHECKSUM_SUFFIX)]).exists()]
    for p in stale:
        p.unlink(missing_ok=True)
        log.warning("removed %s, left by a checkpoint write that did not finish", p)
    return stale
