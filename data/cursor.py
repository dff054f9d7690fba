"""The data cursor: one consumer's state as small frozen dataclasses, and their serialised form.

A cursor is addresses and small integers (chunk elements, rows consumed, buffered document
addresses, RNG states, row leftovers), never tokens: restoring re-reads them by address.

- :class:`ConsumerCursor` is one consumer's state (data/packer.py ``ConsumerStream.cursor()``), made of
  one :class:`SourceCursor` per source (data/stream.py), a :class:`MixerCursor` (data/mixer.py) and the
  :class:`LeftoverAddress` of each document a row is in the middle of, an elastic resume left
  pending, or bounded commitment handed back between steps.
- ``to_dict()`` is the serialised form, plain JSON types, what a checkpoint's cursor files and a
  ``dump_order.py`` cursor file hold. Buffers of (shard, row, epoch) triples are zlib + base64 text,
  valid in JSON and in a weights-only checkpoint; a live cursor keeps its buffers as arrays until then.
- ``ConsumerCursor.from_dict()`` is the one way in: it refuses another ``CURSOR_VERSION`` and
  range-checks every integer, so a damaged or hand-edited cursor (``taken: -5``) is a ``ConfigError``
  naming the field, not a crash steps later. ``from_dict(d).to_dict() == d`` for every cursor this code
  writes (same keys, order and types: a re-saved cursor file has the same bytes).
- :func:`read_order_state` reads a whole order state (``OrderSimulator`` / checkpoint layout: a
  top-level step and its consumers) and refuses a step the consumers do not agree with.

No other module reads a cursor's keys.
"""

from __future__ import annotations

import base64
import copy
import math
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from data.errors import ConfigError

CURSOR_VERSION = 2
"""2: the epoch barrier in the stream (data/stream.py) and bounded commitment (rows hand their
documents back between steps: ``continuations``). A version-1 cursor describes an order this code no
longer produces, so it is refused rather than continued inexactly."""

_DAMAGED = "the cursor is damaged or was edited: resume from another checkpoint (or cursor file)"


class DamagedCursor(ConfigError):
    """A cursor (or a cursor file) refused: ``problem``, then one way out. A caller that gives its own way
    out (train/checkpoint.py's resume check) shows ``problem`` alone, so the line says what to do once."""

    def __init__(self, problem: str, way_out: str = _DAMAGED):
        self.problem = problem
        super().__init__(f"{problem}; {way_out}")


_LEFTOVER_KEYS = ("rows", "pending", "continuations")


@dataclass(frozen=True)
class LeftoverAddress:
    """A document a batch row is in the middle of: its address and ``offset``, the next input token."""

    source: int
    shard: int
    row: int
    epoch: int
    offset: int

    def to_list(self) -> list[int]:
        return [self.source, self.shard, self.row, self.epoch, self.offset]


@dataclass(frozen=True, eq=False)
class SourceCursor:
    """One consumer's stream of one source (data/stream.py): its slice, open chunks and buffer."""

    taken: int
    """Chunks of this consumer's slice opened so far."""
    open: tuple[tuple[int, int], ...]
    """(element g of the chunk sequence, documents already taken from it) per open chunk."""
    buffer: str | np.ndarray
    """The buffered documents' (shard, row, epoch): packed text, or an [n, 3] array until serialised."""
    rng: dict
    """The stream's PCG64 state (which open chunk, which buffer slot)."""

    def addresses(self) -> np.ndarray:
        """The buffered documents' addresses as a writable [n, 3] int32 array."""
        return buffer_addrs(self.buffer)

    def to_dict(self) -> dict:
        buffer = self.buffer if isinstance(self.buffer, str) else pack_ints(np.asarray(self.buffer))
        return {"taken": self.taken, "open": [[g, used] for g, used in self.open], "buffer": buffer,
                "rng": copy.deepcopy(self.rng)}


@dataclass(frozen=True)
class MixerCursor:
    """The mixer's counters per source, in manifest order (data/mixer.py), and its RNG state."""

    emitted: tuple[int, ...]
    committed: tuple[int, ...]
    """Emitted plus chosen but not yet emitted (in flight in the rows); never below ``emitted``."""
    target: tuple[float, ...]
    rng: dict

    def to_dict(self) -> dict:
        return {"emitted": list(self.emitted), "committed": list(self.committed),
                "target": list(self.target),  # floats round-trip exactly through repr/JSON
                "rng": copy.deepcopy(self.rng)}


@dataclass(frozen=True, eq=False)
class ConsumerCursor:
    """One consumer's whole state after a batch: what it continues from, exactly (compare with to_dict())."""

    version: ClassVar[int] = CURSOR_VERSION
    fingerprint: str
    """The manifest's fingerprint (corpus, filters, chunking) the order belongs to."""
    seed: int
    consumer: int
    num_consumers: int
    next_step: int
    """The next data step (micro-batch) this consumer produces."""
    sources: dict[str, SourceCursor]
    """Per source name, in manifest order."""
    mixer: MixerCursor
    rows: tuple[LeftoverAddress | None, ...]
    """Per batch row, the document it is in the middle of (None: it starts a new one)."""
    pending: tuple[LeftoverAddress, ...] = ()
    """Leftovers an elastic resume could not fit into the rows, taken before any new choice."""
    continuations: tuple[LeftoverAddress, ...] = ()
    """Bounded commitment: documents under way, handed back to their sources between steps, oldest first."""

    def to(self, *_args, **_kwargs) -> ConsumerCursor:
        """Itself. A batch carries its cursor, and Lightning moves a batch to the device by calling
        ``.to(device)`` on every value that has one: the cursor stays on the host, as addresses."""
        return self

    def leftovers(self) -> list[LeftoverAddress]:
        """Every document in flight: the rows', then the pending ones, then the handed-back ones."""
        return [r for r in self.rows if r is not None] + list(self.pending) + list(self.continuations)

    def to_dict(self) -> dict:
        """The serialised form (buffers packed): what cursor files and checkpoints hold."""
        out = {
            "version": CURSOR_VERSION,
            "fingerprint": self.fingerprint,
            "seed": self.seed,
            "consumer": self.consumer,
            "num_consumers": self.num_consumers,
            "next_step": self.next_step,
            "sources": {name: st.to_dict() for name, st in self.sources.items()},
            "mixer": self.mixer.to_dict(),
            "rows": [None if r is None else r.to_list() for r in self.rows],
        }
        if self.pending:
            out["pending"] = [r.to_list() for r in self.pending]
        if self.continuations:
            out["continuations"] = [r.to_list() for r in self.continuations]
        return out

    @classmethod
    def from_dict(cls, d: Any) -> ConsumerCursor:
        """A serialised cursor, checked: another version, a field out of range or a malformed one is a
        ConfigError naming the field and what to do."""
        version = d.get("version") if isinstance(d, dict) else None
        if version != CURSOR_VERSION:
            raise ConfigError(
                f"data cursor version {version} is not {CURSOR_VERSION}: it was written by another version of the "
                "data path (1: before the epoch barrier and bounded commitment), whose order this one cannot "
                "continue exactly; resume with the code that wrote it, or start the data order afresh"
            )
        return _Reader(d).cursor()

    @staticmethod
    def is_current(d: Any) -> bool:
        """Whether a serialised cursor claims this code's ``CURSOR_VERSION`` (nothing else is checked)."""
        return isinstance(d, dict) and d.get("version") == CURSOR_VERSION


def as_cursor(c: ConsumerCursor | dict | None) -> ConsumerCursor | None:
    """A cursor, typed: a serialised one is read with :meth:`ConsumerCursor.from_dict` (checked)."""
    return c if c is None or isinstance(c, ConsumerCursor) else ConsumerCursor.from_dict(c)


def _int(value) -> int | None:
    """``value`` as an int (Python, numpy or 0-d torch integer), None if it is not one."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    return None


def _bad(who: str, field: str, value, rule: str) -> ConfigError:
    return DamagedCursor(f"{who}: {field} = {value!r} is out of range ({rule})")


class _Reader:
    """One serialised cursor read field by field, each integer range-checked, into a ConsumerCursor."""

    def __init__(self, d: dict):
        self.d = d
        self.who = f"data cursor (consumer {d.get('consumer')!r} of {d.get('num_consumers')!r})"

    def need(self, field: str, value, lo: int = 0, hi: int | None = None) -> int:
        v = _int(value)
        if v is None or v < lo or (hi is not None and v >= hi):
            raise _bad(self.who, field, value, "an integer >= %d%s" % (lo, "" if hi is None else f" and < {hi}"))
        return v

    def cursor(self) -> ConsumerCursor:
        d = self.d
        try:
            n = self.need("num_consumers", d.get("num_consumers"), lo=1)
            consumer = self.need("consumer", d.get("consumer"), hi=n)
            next_step = self.need("next_step", d["next_step"])
            sources = {name: self.source(name, st) for name, st in d["sources"].items()}
            mixer = self.mixer(d["mixer"], len(sources))
            leftovers = {key: self.leftovers(key, d[key] if key == "rows" else d.get(key, []), len(sources))
                         for key in _LEFTOVER_KEYS}
            seed, fingerprint = self.need("seed", d["seed"]), d["fingerprint"]
            if not isinstance(fingerprint, str):
                raise _bad(self.who, "fingerprint", fingerprint, "the corpus fingerprint, a string")
        except (KeyError, TypeError, AttributeError, ValueError, zlib.error) as e:  # zlib: a damaged packed buffer
            if isinstance(e, ConfigError):
                raise
            raise DamagedCursor(f"{self.who}: malformed ({type(e).__name__}: {e})") from None
        return ConsumerCursor(fingerprint=fingerprint, seed=seed, consumer=consumer, num_consumers=n,
                              next_step=next_step, sources=sources, mixer=mixer, **leftovers)

    def source(self, name: str, st: dict) -> SourceCursor:
        taken = self.need(f"sources.{name}.taken", st["taken"])
        pairs = []
        for i, pair in enumerate(st["open"]):
            if len(pair) != 2:
                raise _bad(self.who, f"sources.{name}.open[{i}]", pair, "[chunk, rows used]")
            pairs.append((self.need(f"sources.{name}.open[{i}][0] (chunk)", pair[0]),
                          self.need(f"sources.{name}.open[{i}][1] (rows used)", pair[1])))
        buffer = st["buffer"]
        addrs = buffer_addrs(buffer)
        if addrs.size and addrs.min() < 0:
            i, j = np.argwhere(addrs < 0)[0]
            raise _bad(self.who, f"sources.{name}.buffer[{i}][{j}] ({('shard', 'row', 'epoch')[j]})",
                       int(addrs[i, j]), "an integer >= 0")
        if not isinstance(st["rng"], dict):
            raise _bad(self.who, f"sources.{name}.rng", st["rng"], "a PCG64 state")
        return SourceCursor(taken, tuple(pairs), buffer if isinstance(buffer, str) else addrs, st["rng"])

    def mixer(self, mixer: dict, n_sources: int) -> MixerCursor:
        emitted = self.counts("mixer.emitted", mixer["emitted"], n_sources)
        committed = self.counts("mixer.committed", mixer["committed"], n_sources)
        for i, (e, k) in enumerate(zip(emitted, committed)):
            if k < e:
                raise _bad(self.who, f"mixer.committed[{i}]", k, f">= mixer.emitted[{i}] = {e}")
        target = [float(t) for t in mixer["target"]]
        if len(target) != n_sources:
            raise _bad(self.who, "mixer.target", target, f"one value per source ({n_sources})")
        if not all(math.isfinite(t) and t >= 0 for t in target):
            raise _bad(self.who, "mixer.target", target, "token targets, finite and >= 0")
        if not isinstance(mixer["rng"], dict):
            raise _bad(self.who, "mixer.rng", mixer["rng"], "a PCG64 state")
        return MixerCursor(tuple(emitted), tuple(committed), tuple(target), mixer["rng"])

    def counts(self, field: str, values, n_sources: int) -> list[int]:
        values = list(values)
        if len(values) != n_sources:
            raise _bad(self.who, field, values, f"one count per source ({n_sources})")
        return [self.need(f"{field}[{i}]", v) for i, v in enumerate(values)]

    def leftovers(self, key: str, addrs: list, n_sources: int) -> tuple[LeftoverAddress | None, ...]:
        out: list[LeftoverAddress | None] = []
        for i, addr in enumerate(addrs):
            if addr is None and key == "rows":
                out.append(None)
                continue
            if addr is None or len(addr) != 5:
                raise _bad(self.who, f"{key}[{i}]", addr, "[source, shard, row, epoch, offset]")
            source = self.need(f"{key}[{i}][0] (source)", addr[0], hi=n_sources)
            rest = [self.need(f"{key}[{i}][{j}] ({part})", addr[j])
                    for j, part in enumerate(("shard", "row", "epoch", "offset"), start=1)]
            out.append(LeftoverAddress(source, *rest))
        return tuple(out)


def read_order_state(state: dict, ranks: list[int] | None = None) -> list[list[ConsumerCursor | None]]:
    """A whole order state (``OrderSimulator.state_dict()``, or a checkpoint's ``step``/``next_step`` and
    ``cursors``), read: every consumer's cursor checked (:meth:`ConsumerCursor.from_dict`), and each one's
    ``next_step`` the first step it owns at or after the top-level step (worker w of W owns steps w, w + W,
    ...). A top-level step the consumers do not agree with is a ConfigError naming both, instead of an
    AssertionError steps later. Returns the cursors ``[rank][worker]`` (None: a worker that never
    produced a batch).

    With ``ranks``, the consumers are the rows of those ranks only (a checkpoint's per-rank cursor files,
    train/cursor_files.py): errors name the real rank, and ``world_size`` is not compared with the rows."""
    raw_step = state.get("step", state.get("next_step"))
    step = _int(raw_step)
    if step is None or step < 0:
        raise _bad("data order state", "step", raw_step, "an integer >= 0")
    consumers = state.get("consumers", state.get("cursors"))
    if not _rows_of_cursors(consumers):
        raise DamagedCursor("data order state: consumers must be [rank][worker] cursors")
    workers = len(consumers[0])
    if ranks is not None and len(ranks) != len(consumers):
        raise ConfigError(f"data order state: cursors of {len(consumers)} rank(s) given for ranks {ranks}")
    _check_layout(state, len(consumers), workers, ranks is None)
    return [_read_rank(row, step, rank, workers) for rank, row in zip(ranks or range(len(consumers)), consumers)]


def _rows_of_cursors(consumers) -> bool:
    return isinstance(consumers, list) and bool(consumers) and all(isinstance(r, list) and r for r in consumers)


def _check_layout(state: dict, n_ranks: int, workers: int, all_ranks: bool) -> None:
    """The state's ``num_workers`` (and with every rank's row, ``world_size``) against its cursors."""
    keys = {"world_size": n_ranks, "num_workers": workers} if all_ranks else {"num_workers": workers}
    for key, want in keys.items():
        if key in state and _int(state[key]) != want:
            raise DamagedCursor(f"data order state: {key} = {state[key]!r} but the cursors are {n_ranks} "
                                f"rank(s) x {workers} worker(s)")


def _read_rank(row: list, step: int, rank: int, workers: int) -> list[ConsumerCursor | None]:
    if len(row) != workers:
        raise DamagedCursor(f"data order state: rank {rank} has {len(row)} cursors, rank 0 {workers}")
    return [None if cur is None else _agreeing(cur, step, rank, w, workers) for w, cur in enumerate(row)]


def _agreeing(d: Any, step: int, rank: int, w: int, workers: int) -> ConsumerCursor:
    cur = as_cursor(d)
    want = step + (w - step) % workers
    if cur.next_step != want:
        raise DamagedCursor(
            f"data order state: step = {step}, but the cursor of rank {rank} worker {w} continues at step "
            f"{cur.next_step} (it must be {want}, the first step >= {step} that worker {w} of {workers} owns)")
    return cur


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
