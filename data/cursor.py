"""The data cursor's codec: a consumer's state as plain JSON, a few bytes per buffered document.

A cursor is addresses and small integers (chunk elements, rows consumed, buffered document
addresses, RNG states, row leftovers), never tokens: restoring re-reads them by address. Buffers of
(shard, row, epoch) triples are stored as zlib + base64 text, valid in JSON and in a weights-only
checkpoint. ``CURSOR_VERSION`` changes whenever the meaning of a field does; older cursors are refused.

Every integer of a cursor is range-checked when it is loaded (:func:`check_version`, which every load
path calls): a damaged or hand-edited cursor (``taken: -5``) is a ``ConfigError`` naming the field,
not a crash steps later. :func:`check_order_state` checks a whole order state (``OrderSimulator`` /
checkpoint layout: a top-level step and its consumers) for a step the consumers do not agree with.
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
    """Refuse a cursor this code cannot continue exactly, saying what to do; then :func:`check_ranges`."""
    version = cursor.get("version") if isinstance(cursor, dict) else None
    if version != CURSOR_VERSION:
        raise ConfigError(
            f"data cursor version {version} is not {CURSOR_VERSION}: it was written by another version of the "
            "data path (1: before the epoch barrier and bounded commitment), whose order this one cannot "
            "continue exactly; resume with the code that wrote it, or start the data order afresh"
        )
    check_ranges(cursor)


_DAMAGED = "the cursor is damaged or was edited: resume from another checkpoint (or cursor file)"


def _int(value) -> int | None:
    """``value`` as an int (Python, numpy or 0-d torch integer), None if it is not one."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    return None


def _bad(who: str, field: str, value, rule: str) -> ConfigError:
    return ConfigError(f"{who}: {field} = {value!r} is out of range ({rule}); {_DAMAGED}")


def check_ranges(cursor: dict) -> None:
    """Every integer of one consumer's cursor within its range, else a ConfigError naming the field."""
    n = _int(cursor.get("num_consumers"))
    c = _int(cursor.get("consumer"))
    who = f"data cursor (consumer {cursor.get('consumer')!r} of {cursor.get('num_consumers')!r})"

    def need(field: str, value, lo: int = 0, hi: int | None = None) -> int:
        v = _int(value)
        if v is None or v < lo or (hi is not None and v >= hi):
            raise _bad(who, field, value, "an integer >= %d%s" % (lo, "" if hi is None else f" and < {hi}"))
        return v

    try:
        n = need("num_consumers", n if n is not None else cursor.get("num_consumers"), lo=1)
        need("consumer", c if c is not None else cursor.get("consumer"), hi=n)
        need("next_step", cursor["next_step"])
        sources = cursor["sources"]
        for name, st in sources.items():
            need(f"sources.{name}.taken", st["taken"])
            for i, pair in enumerate(st["open"]):
                if len(pair) != 2:
                    raise _bad(who, f"sources.{name}.open[{i}]", pair, "[chunk, rows used]")
                need(f"sources.{name}.open[{i}][0] (chunk)", pair[0])
                need(f"sources.{name}.open[{i}][1] (rows used)", pair[1])
            addrs = buffer_addrs(st["buffer"])
            if addrs.size and addrs.min() < 0:
                i, j = np.argwhere(addrs < 0)[0]
                raise _bad(who, f"sources.{name}.buffer[{i}][{j}] ({('shard', 'row', 'epoch')[j]})",
                           int(addrs[i, j]), "an integer >= 0")
        mixer = cursor["mixer"]
        counts = {}
        for key in ("emitted", "committed"):
            values = list(mixer[key])
            if len(values) != len(sources):
                raise _bad(who, f"mixer.{key}", values, f"one count per source ({len(sources)})")
            counts[key] = [need(f"mixer.{key}[{i}]", v) for i, v in enumerate(values)]
        for i, (e, k) in enumerate(zip(counts["emitted"], counts["committed"])):
            if k < e:
                raise _bad(who, f"mixer.committed[{i}]", k, f">= mixer.emitted[{i}] = {e}")
        for key in ("rows", "pending", "continuations"):
            for i, addr in enumerate(cursor.get(key, [])):
                if addr is None and key == "rows":
                    continue
                if addr is None or len(addr) != 5:
                    raise _bad(who, f"{key}[{i}]", addr, "[source, shard, row, epoch, offset]")
                need(f"{key}[{i}][0] (source)", addr[0], hi=len(sources))
                for j, part in enumerate(("shard", "row", "epoch", "offset"), start=1):
                    need(f"{key}[{i}][{j}] ({part})", addr[j])
    except (KeyError, TypeError, AttributeError, ValueError, zlib.error) as e:  # zlib: a damaged packed buffer
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{who}: malformed ({type(e).__name__}: {e}); {_DAMAGED}") from None


def check_order_state(state: dict, ranks: list[int] | None = None) -> None:
    """A whole order state (``OrderSimulator.state_dict()``, or a checkpoint's ``step``/``next_step`` and
    ``cursors``): every consumer range-checked, and each one's ``next_step`` the first step it owns at or
    after the top-level step (worker w of W owns steps w, w + W, ...). A top-level step the consumers do
    not agree with is a ConfigError naming both, instead of an AssertionError steps later.

    With ``ranks``, the consumers are the rows of those ranks only (a checkpoint's per-rank cursor files,
    train/cursor_files.py): errors name the real rank, and ``world_size`` is not compared with the rows."""
    step = _int(state.get("step", state.get("next_step")))
    if step is None or step < 0:
        raise _bad("data order state", "step", state.get("step", state.get("next_step")), "an integer >= 0")
    consumers = state.get("consumers", state.get("cursors"))
    if not isinstance(consumers, list) or not consumers or not all(isinstance(r, list) and r for r in consumers):
        raise ConfigError(f"data order state: consumers must be [rank][worker] cursors; {_DAMAGED}")
    workers = len(consumers[0])
    if ranks is not None and len(ranks) != len(consumers):
        raise ConfigError(f"data order state: cursors of {len(consumers)} rank(s) given for ranks {ranks}")
    keys = {"num_workers": workers} if ranks is not None else {"world_size": len(consumers), "num_workers": workers}
    for key, want in keys.items():
        if key in state and _int(state[key]) != want:
            raise ConfigError(f"data order state: {key} = {state[key]!r} but the cursors are {len(consumers)} "
                              f"rank(s) x {workers} worker(s); {_DAMAGED}")
    for rank, row in zip(ranks if ranks is not None else range(len(consumers)), consumers):
        if len(row) != workers:
            raise ConfigError(f"data order state: rank {rank} has {len(row)} cursors, rank 0 {workers}; {_DAMAGED}")
        for w, cur in enumerate(row):
            if cur is None:  # a worker that never produced a batch
                continue
            check_version(cur)
            nxt = _int(cur["next_step"])
            want = step + (w - step) % workers
            if nxt != want:
                raise ConfigError(
                    f"data order state: step = {step}, but the cursor of rank {rank} worker {w} continues at step "
                    f"{nxt} (it must be {want}, the first step >= {step} that worker {w} of {workers} owns); "
                    f"{_DAMAGED}")


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
