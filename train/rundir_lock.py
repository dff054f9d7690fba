"""One run per run directory: an ``fcntl`` lock on ``<run dir>/.run.lock``, held for the process's life.

Two jobs in one run dir (a job submitted twice, a requeue racing a job still shutting down) would
interleave their logs and checkpoints. The kernel releases an ``flock`` when the holder dies, however it
dies, so a dead run never keeps the directory; the file's content (pid, host, start time) only serves
the error message. Where ``flock`` is per host (some NFS/FUSE mounts) two hosts can both "hold" it
(docs/faults.md).
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import time
from pathlib import Path

from data import files
from data.errors import ConfigError

LOCK_NAME = ".run.lock"

_held: dict[str, int] = {}  # resolved run dir -> open descriptor (kept open: closing it releases the lock)


def acquire_run_dir(run_dir: str | Path) -> Path:
    """Lock ``run_dir`` for this process (idempotent); ConfigError when another live process holds it.

    Also the first write into the run dir, so a directory that cannot be written is reported here,
    before any compute, instead of as a traceback from a logger or the first checkpoint.
    """
    run_dir = Path(run_dir)
    key = str(run_dir.resolve())
    if key in _held:
        return run_dir / LOCK_NAME
    path = run_dir / LOCK_NAME
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        files.refuse_link(path, "run.dir: the lock file")
        # O_NOFOLLOW: a link planted at the lock's name fails here instead of truncating its target
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if path.is_symlink():  # made between the check and the open
            files.refuse_link(path, "run.dir: the lock file")
        raise ConfigError(
            f"run.dir: cannot write {run_dir} ({e.strerror or e}); make it writable (check permissions, "
            "quota, a read-only mount) or choose another --run.dir"
        ) from None
    _refuse_shared(fd, path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _read_holder(fd)
        os.close(fd)
        raise ConfigError(
            f"run.dir: {run_dir} is in use by another run ({holder}); two runs in one directory mix their "
            "logs and checkpoints. Wait for that run to end (or stop it), or choose another --run.dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
             .encode())
    _held[key] = fd
    return path


def _refuse_shared(fd: int, path: Path) -> None:
    """The lock file is rewritten (truncated) by its holder: refuse one that is not a plain file of its own
    (a hard link to another file, a FIFO, a device), whose other name would lose its bytes."""
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
        return
    os.close(fd)
    what = "has another name (a hard link)" if stat.S_ISREG(st.st_mode) else "is not a regular file"
    raise ConfigError(f"run.dir: the lock file {path} {what}; a run rewrites this file itself: remove it (the "
                      "other name keeps its bytes), or choose another --run.dir")


def release_run_dir(run_dir: str | Path) -> None:
    """Give the lock up before the process ends (tests; a process that ends releases it anyway)."""
    fd = _held.pop(str(Path(run_dir).resolve()), None)
    if fd is not None:
        os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "holder unknown"
