"""Atomic file writes (the one implementation every writer of outputs, caches and logs uses), and what
identifies a file a run reads: the file itself (:func:`file_identity`), its bytes (:func:`file_digest`) and
the byte-identical copies among files (:func:`byte_copies`).

A reader (another rank, a resumed run, a user's tool) never sees half a file: each write goes to a
temp file in the same directory (same filesystem, so the rename is atomic), is flushed and fsynced,
then renamed over the destination. On any error the temp file is removed and the destination is
untouched. Temp names start with ``.`` and end in ``.tmp`` so that clean-up code can recognise them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from data.errors import ConfigError


def temp_path(path: str | os.PathLike) -> Path:
    """The temp name beside ``path`` a writer of this process and thread uses."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident() % 10**6}.tmp")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, fsync: bool = True, tmp: str | os.PathLike | None = None) -> Iterator[Path]:
    """Yield a temp path to write (``tmp``, default :func:`temp_path`); on success it replaces ``path``.

    For writers that need a path rather than bytes: a parquet writer, ``fig.savefig`` (give it the
    format: the temp name ends in ``.tmp``), ``torch.save``, a hard link."""
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else temp_path(path)
    with contextlib.suppress(FileNotFoundError):  # a stale temp (or a link planted there) is not written through
        os.unlink(tmp)
    try:
        yield tmp
        publish(tmp, path, fsync)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def publish(tmp: str | os.PathLike, path: str | os.PathLike, fsync: bool = False) -> None:
    """Rename a finished temp file (or a folder filled in full) over ``path``: readers see all of it or none.

    The one rename of the repository (tests/unit/test_one_place.py): a writer that cannot wrap its
    write in :func:`atomic_path` (a file written across several calls) names its temp with
    :func:`temp_path` and publishes it here."""
    if fsync:
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def write_bytes(path: str | os.PathLike, data: bytes, fsync: bool = True) -> None:
    with atomic_path(path, fsync) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str, fsync: bool = True) -> None:
    with atomic_path(path, fsync) as tmp:
        tmp.write_text(text)


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 1, fsync: bool = True) -> None:
    write_text(path, json.dumps(obj, indent=indent) + "\n", fsync)


class LinkRefused(ConfigError):
    """A file the run writes itself is a symbolic link: never written through (it would overwrite the target)."""


def refuse_link(path: str | os.PathLike, what: str = "") -> None:
    """Raise :class:`LinkRefused` when ``path`` is a symbolic link (a missing path or a plain file is fine).

    For the files a run creates and rewrites in its own directory: writing through a planted or leftover
    link truncates whatever it points to (a checkpoint, a file outside the run)."""
    path = Path(path)
    if path.is_symlink():
        raise LinkRefused(f"{what or path.name} {path} is a symbolic link (to {os.readlink(path)}); a run writes "
                          "this file itself and never through a link: remove the link (the file it points to is "
                          "untouched), or choose another --run.dir")


def open_append(path: str | os.PathLike) -> IO[str]:
    """``open(path, "a")`` that refuses a symbolic link at ``path`` (``O_NOFOLLOW``; :class:`LinkRefused`)."""
    refuse_link(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if Path(path).is_symlink():  # created between the check and the open
            refuse_link(path)
        raise e
    return os.fdopen(fd, "a")


class WriteError(ConfigError):
    """A file the run writes could not be written (a full disk, no inodes left, a quota, permissions): one
    line naming the file and what to do, like every refusal, instead of an OSError traceback."""


def write_error(path: str | os.PathLike, e: BaseException, then: str, kept: str = "") -> WriteError:
    """One line for a failed write of ``path``: ``could not write PATH: <reason>; [KEPT; ]<remedy>, then THEN``.

    The remedy follows the cause: a full disk or quota (``free space (or inodes)``), a folder that vanished
    under the run (the run directory moved or removed while training), anything else (permissions ...)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    reason = getattr(e, "strerror", None) or first
    code = getattr(e, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT) or "write failed" in reason:  # torch's zip writer says "write failed"
        reason, remedy = f"{reason} (disk full or out of inodes?)", "free space (or inodes)"
    elif code == errno.ENOENT:
        reason, remedy = f"{reason} (its folder is gone: was the run directory moved or removed while the run " \
                         "was writing?)", "restore the run directory"
    else:
        remedy = "make the file and its folder writable"
    return WriteError(f"could not write {path}: {reason}; {kept + '; ' if kept else ''}{remedy}, then {then}")


def file_identity(path: str | os.PathLike) -> tuple[int, int]:
    """The file itself, whatever its spelling: (device, inode). A relative and an absolute path, a path
    through a symbolic link and a hard link of one file all give the same identity."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def first_spellings(paths: list[str]) -> dict[str, str]:
    """Each of ``paths`` -> the first of them that is the same file (:func:`file_identity`); a path that
    cannot be opened (a dangling link a glob matched) is a :class:`ConfigError` naming it."""
    first: dict[tuple[int, int], str] = {}
    out = {}
    for path in paths:
        try:
            out[path] = first.setdefault(file_identity(path), path)
        except OSError as e:
            raise ConfigError(f"{path}: matched by a glob but cannot be opened ({e.strerror}: a broken symbolic "
                              "link?); restore it, remove it, or narrow the glob") from None
    return out


def byte_copies(paths: list[str]) -> dict[str, str]:
    """The byte-identical copies among ``paths`` (distinct files, e.g. :func:`first_spellings`' values): each
    copy -> the first of ``paths`` with the same bytes. Candidates share size and footer hash
    (:func:`file_digest`, a read of the file's tail); only they are read in full (sha256) to confirm, so a
    corpus without copies is never hashed whole."""
    candidates: dict[str, list[str]] = {}
    with ThreadPoolExecutor(max(1, min(len(paths), 32))) as pool:  # tail reads: threads hide a network FS's latency
        digests = list(pool.map(file_digest, paths))
    for path, digest in zip(paths, digests):
        if digest != "unreadable":  # not parquet: the manifest's scan names it
            candidates.setdefault(digest, []).append(path)
    out = {}
    for group in (g for g in candidates.values() if len(g) > 1):  # a file without a candidate is never read
        first: dict[str, str] = {}
        for path in group:
            with open(path, "rb") as f:
                kept = first.setdefault(hashlib.file_digest(f, "sha256").hexdigest(), path)
            if kept != path:
                out[path] = kept
    return out


def file_digest(path: str | os.PathLike) -> str:
    """The file's size and a hash of its parquet footer, read from the file's tail (no data read).

    The footer holds the row count and every column chunk's offsets, compressed and uncompressed sizes
    and statistics, so a rewrite that changes any text changes it (short of an edit that keeps every
    page's size and every min/max). An unreadable tail gives ``"unreadable"``."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < 12:
                return "unreadable"
            f.seek(size - 8)
            tail = f.read(8)
            n = int.from_bytes(tail[:4], "little")
            if tail[4:] != b"PAR1" or n + 12 > size:
                return "unreadable"
            f.seek(size - 8 - n)
            return f"{size}:{hashlib.sha256(f.read(n)).hexdigest()[:16]}"
    except OSError:
        return "unreadable"
