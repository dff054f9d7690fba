"""The data cursor's codec: a consumer's state as plain JSON, a few bytes per buffered document.

A cursor is addresses and small integers (chunk elements, rows consumed, buffered document
addresses, RNG states, row leftovers), never tokens: restoring re-reads them by address. Buffers of
(shard, row, epoch) triples are stored as zlib + base64 text, valid in JSON and in a weights-only
checkpoint. ``CURSOR_VERSION`` changes whenever the meaning of a field does; older cursors are refused.
"""

from __future__ import annotations

import base64
import zlib

import numpy as np

from data.errors import ConfigError

CURSOR_VERSION = 2
"""2: the epoch barrier in the stream (data/stream.py) and bounded commitment (rows hand their
documents back between steps: ``continuations``). A version-1 cursor describes an order this code no
longer produces, so it is refused rather than continued inexactly."""


def check_version(cursor: dict) -> None:
    """Refuse a cursor this code cannot continue exactly, saying what to do."""
    version = cursor.get("version")
    if version != CURSOR_VERSION:
        raise ConfigError(
            f"data cursor version {version} is not {CURSOR_VERSION}: it was written by another version of the "
            "data path (1: before the epoch barrier and bounded commitment), whose order this one cannot "
            "continue exactly; resume with the code that wrote it, or start the data order afresh"
        )


def pack_ints(a: np.ndarray) -> str:
    """int32 array -> compact text (zlib + base64)."""
    return base64.b64encode(zlib.compress(np.ascontiguousarray(a, dtype="<i4").tobytes(), 1)).decode()


def unpack_ints(s: str) -> np.ndarray:
    """The inverse of :func:`pack_ints` (a read-only int32 array)."""
    return np.frombuffer(zlib.decompress(base64.b64decode(s)), dtype="<i4")


def buffer_addrs(buf: str | np.ndarray | list) -> np.ndarray:
    """A source's buffered document addresses, packed or not, as a writable [n, 3] int32 array."""
    a = unpack_ints(buf) if isinstance(buf, str) else np.asarray(buf, dtype=np.int32)
    return a.reshape(-1, 3).copy()


def pack_cursor(snapshot: dict) -> dict:
    """A consumer snapshot with its buffers compacted."""
    out = dict(snapshot)
    # (a DataLoader turns the snapshot's arrays into tensors on the way: np.asarray takes both)
    out["sources"] = {
        name: {**st, "buffer": st["buffer"] if isinstance(st["buffer"], str) else pack_ints(np.asarray(st["buffer"]))}
        for name, st in snapshot["sources"].items()
    }
    return out
