"""Per-rank data cursor files: each rank writes and reads its own; the checkpoint holds a small index.

A packed cursor is ~318 KB per consumer at the real shape (data/cursor.py), too much to gather on one
rank, so when a checkpoint is written (``WellMixedData.state_dict``, called on every rank) each rank
writes its own DataLoader workers' cursors beside the checkpoints (docs/checkpoints.md)::

    <checkpoint dir>/step0000123.ckpt           WellMixedData: {"cursor_dir": "cursors/step0000123", ...}
    <checkpoint dir>/cursors/step0000123/rank00000.pt   rank 0's cursors, one per worker
                                        /rank00001.pt   rank 1's ...

- **Written once.** Global rank 0 claims the step directory (``mkdir``; a taken name gets ``-v1``, ...)
  and broadcasts it; each file is written atomically and every rank's is in place (a barrier) before
  rank 0 writes the checkpoint that names them.
- **Verified.** Each file's sha256 is gathered into the checkpoint's data state as ``cursor_sha256`` and
  checked before unpickling (a checkpoint written before digests loads its files unverified, warned).
- **Cleaned up** by :func:`remove_step_dirs`: the step directories no checkpoint references, never the
  newest.
- The inline layout ``"cursors": [rank][worker]`` (older checkpoints; the DataModule without a checkpoint
  directory) is read too: :func:`load_checkpoint_cursors` is the one place that knows both.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
import shutil
from os import PathLike
from pathlib import Path
from typing import Any

import torch

from data import files
from data.cursor import ConsumerCursor, DamagedCursor, read_order_state
from data.errors import ConfigError

log = logging.getLogger(__name__)

CURSOR_ROOT = "cursors"
"""The folder under the checkpoint directory that holds one step directory per checkpoint."""
_STEP_DIR = re.compile(r"^step(\d+)(?:-v(\d+))?$")
_EARLIER = "resume from an earlier checkpoint with --ckpt_path FILE (or --run.ckpt_fallback true)"
EARLIER_SEVERAL_RANKS = ("resume from an earlier checkpoint with --ckpt_path FILE (on several ranks "
                         "--run.ckpt_fallback checks only that the cursor files exist)")
"""The way out where each rank reads its own file: the fallback's check did not read it (train/checkpoint.py)."""
_NO_CHECKPOINT = "no checkpoint was written for this step, the previous ones are intact"


def claim_step_dir(ckpt_dir: str | PathLike, step: int) -> str:
    """Create ``cursors/stepNNNNNNN`` (``-vK`` when taken) under ``ckpt_dir``; its path relative to it.

    Global rank 0 only; the others get the name by broadcast. ``mkdir`` is the claim, so a directory an
    existing checkpoint references is never written into again."""
    root = Path(ckpt_dir) / CURSOR_ROOT
    files.refuse_link(root, "the data cursor folder")
    version = 0
    try:
        root.mkdir(parents=True, exist_ok=True)
        while True:
            name = f"step{step:07d}" + (f"-v{version}" if version else "")
            try:
                (root / name).mkdir()
                return f"{CURSOR_ROOT}/{name}"
            except FileExistsError:
                version += 1
    except OSError as e:
        raise files.write_error(root / f"step{step:07d}", e, "resume with --ckpt_path last", _NO_CHECKPOINT) from e


def rank_file(step_dir: str | PathLike, rank: int) -> Path:
    return Path(step_dir) / f"rank{rank:05d}.pt"


def check_checkpoint_cursors(ckpt_path: str | PathLike, state: dict[str, Any], ranks: list[int] | None = None) -> None:
    """The cursors a checkpoint's data state names: every rank's file present; those of ``ranks`` (None: all)
    read, verified and range-checked against its step (data/cursor.py ``read_order_state``). A cursor of
    another version of the data path is left to the datamodule, whose error says what to do."""
    missing = [f for f in cursor_files(ckpt_path, state) if not f.is_file()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise DamagedCursor(f"data cursor file {missing[0]}{more} missing (a checkpoint moved without its cursors/ "
                            "folder?)", f"copy it back, or {_EARLIER}")
    rows = load_checkpoint_cursors(ckpt_path, state, ranks)
    if rows and _all_current(rows):
        read_order_state({**state, "cursors": rows}, ranks=ranks)


def _all_current(rows: list) -> bool:
    """Whether every serialised cursor is of this data path's version (None: a worker that never produced one)."""
    return all(not isinstance(c, dict) or ConsumerCursor.is_current(c)
               for rank in rows if isinstance(rank, list) for c in rank)


def way_out_on_several_ranks(message: str) -> str:
    """``message`` with the way out that holds when several ranks each read their own file."""
    return message.replace(_EARLIER, EARLIER_SEVERAL_RANKS)


def save_rank_cursors(step_dir: str | PathLike, rank: int, cursors: list[dict | None], next_step: int) -> str:
    """One rank's cursors (one per DataLoader worker), atomically; the sha256 of the bytes written.
    ``rank`` and ``next_step`` are stored with them, so a file of another rank or checkpoint put in its
    place is recognised on load."""
    buf = io.BytesIO()
    torch.save({"rank": rank, "next_step": next_step, "cursors": cursors}, buf)
    data = buf.getvalue()
    try:
        files.write_bytes(rank_file(step_dir, rank), data)
    except OSError as e:
        raise files.write_error(rank_file(step_dir, rank), e, "resume with --ckpt_path last", _NO_CHECKPOINT) from e
    return hashlib.sha256(data).hexdigest()


def gather_digests(strategy, digest: str, world_size: int) -> list[str]:
    """Every rank's cursor-file digest, in rank order, on every rank (an all-gather of 32 bytes per rank)."""
    if world_size == 1:
        return [digest]
    mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.int32, device=strategy.root_device)
    rows = strategy.all_gather(mine).reshape(world_size, 32).cpu()
    return [bytes(row.tolist()).hex() for row in rows]


def cursor_files(ckpt_path: str | PathLike, state: dict[str, Any]) -> list[Path]:
    """Every rank file a checkpoint's data state references (empty when its cursors are inline)."""
    if state.get("cursor_dir") is None:
        return []
    step_dir = Path(ckpt_path).parent / state["cursor_dir"]
    return [rank_file(step_dir, r) for r in range(int(state["world_size"]))]


def load_checkpoint_cursors(ckpt_path: str | PathLike | None, state: dict[str, Any],
                            ranks: list[int] | None = None) -> list[list[dict | None]]:
    """The serialised cursors ``[rank][worker]`` of the checkpoint at ``ckpt_path`` (a ``.ckpt`` file or a
    sharded checkpoint folder) whose WellMixedData state is ``state``: one row per rank in ``ranks``
    (default: every rank of the checkpoint), in that order. Only those ranks' files are read; a missing,
    unreadable or mismatched one is a ConfigError naming it. Returned serialised: data/cursor.py
    ``read_order_state`` is the callers' step, so a cursor of another version gets the data path's message."""
    ranks = list(range(int(state["world_size"]))) if ranks is None else list(ranks)
    if state.get("cursor_dir") is None:  # inline: an older checkpoint, or library use without a checkpoint dir
        inline = state.get("cursors")
        if not isinstance(inline, list):
            raise ConfigError(f"checkpoint {ckpt_path}: its data state holds neither cursors nor a cursor_dir")
        return [inline[r] for r in ranks]
    if ckpt_path is None:
        raise ConfigError(f"the data state names per-rank cursor files ({state['cursor_dir']}) but not the "
                          "checkpoint they lie beside: load it through Trainer.fit(ckpt_path=...)")
    step_dir = Path(ckpt_path).parent / state["cursor_dir"]
    digests = _recorded_digests(ckpt_path, state)
    return [_read_rank_file(rank_file(step_dir, rank), rank, ckpt_path, state, digests) for rank in ranks]


def _read_rank_file(path: Path, rank: int, ckpt_path, state: dict[str, Any], digests: list[str] | None) -> list:
    """One rank's cursors from its file: present, matching its digest, loadable, of this rank and step."""
    what = f"data cursor file {path} (rank {rank} of checkpoint {ckpt_path})"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DamagedCursor(f"{what} is missing (a checkpoint moved without its {CURSOR_ROOT}/ folder, or a "
                            "partial copy?)", f"copy it back, or {_EARLIER}") from None
    except OSError as e:
        raise DamagedCursor(f"{what} is unreadable ({e.strerror or e})", _EARLIER) from None
    _verify(raw, digests, rank, what, path)
    try:
        data = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- any failure to load means "not usable"
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DamagedCursor(f"{what} is unreadable ({type(e).__name__}: {first[:200]})", _EARLIER) from None
    found = (data.get("rank"), data.get("next_step")) if isinstance(data, dict) else type(data).__name__
    if found != (rank, state["next_step"]) or not isinstance(data.get("cursors"), list):
        raise DamagedCursor(f"{what} does not belong to it (rank, next step {found}, expected "
                            f"{(rank, state['next_step'])})", _EARLIER)
    return data["cursors"]


def _recorded_digests(ckpt_path, state: dict[str, Any]) -> list[str] | None:
    """The per-rank sha256 digests the checkpoint records; None for a checkpoint written before them."""
    digests = state.get("cursor_sha256")
    if digests is None:
        return None
    world = int(state["world_size"])
    if (not isinstance(digests, list) or len(digests) != world
            or not all(isinstance(d, str) and len(d) == 64 for d in digests)):
        raise DamagedCursor(f"checkpoint {ckpt_path}: its data state's cursor_sha256 is malformed (not {world} "
                            "sha256 digests)", _EARLIER)
    return digests


_unverified_warned: set[str] = set()


def _verify(raw: bytes, digests: list[str] | None, rank: int, what: str, path: Path) -> None:
    """The file's bytes against the digest its checkpoint records (a warning, once per file, without one)."""
    if digests is None:
        if str(path) not in _unverified_warned:
            _unverified_warned.add(str(path))
            log.warning("%s is not verified: its checkpoint records no cursor digests (written by an older "
                        "version); a damaged file would be used as it is", what)
        return
    got = hashlib.sha256(raw).hexdigest()
    if got != digests[rank]:
        raise DamagedCursor(f"{what} does not match the sha256 its checkpoint records ({got[:16]}... vs "
                            f"{digests[rank][:16]}...): changed after it was written (an edit, a disk or copy "
                            "error)", _EARLIER)


def _step_dir_order(path: Path) -> tuple[int, int]:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)), int(m.group(2) or 0)


def remove_step_dirs(ckpt_dir: Path, keep: set[str]) -> list[Path]:
    """Delete the step directories under ``ckpt_dir/cursors`` not named in ``keep`` (the ``cursor_dir`` names
    the checkpoints reference: train/checkpoint.py ``remove_unreferenced`` reads them), never the newest
    (highest step, then version: it may belong to a checkpoint being written). Global rank 0 only, when
    no save is in progress. Returns the directories removed."""
    root = ckpt_dir / CURSOR_ROOT
    if root.is_symlink() or not root.is_dir():  # never delete through a link (claim_step_dir refuses one)
        return []
    dirs = sorted(filter(_is_step_dir, root.iterdir()), key=_step_dir_order)
    removed = [d for d in dirs[:-1] if d.name not in keep]
    for d in removed:
        shutil.rmtree(d, ignore_errors=True)
    log.debug("removed %d data cursor folder(s) no checkpoint references: %s", len(removed),
              ", ".join(d.name for d in removed))
    return removed


def _is_step_dir(path: Path) -> bool:
    return path.is_dir() and _STEP_DIR.match(path.name) is not None
