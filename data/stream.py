"""The two-level stream of one consumer (= one DataLoader worker of one rank).

::

    per source: infinite chunk sequence = perm(seed, source, epoch 0) ++ perm(seed, source, epoch 1) ++ ...
        consumer c of C owns elements c, c+C, c+2C, ...           (level 1: the global shard order)
        k of its chunks open at once, docs drawn at random  ->  shuffle buffer of B documents (level 2)
    mixer: picks the source of each next document by tokens (data/mixer.py)
    packer: row-parallel packing into sequences of seq_len(step) + 1 tokens (each row of the batch
            continues its own document), EOT after every document

Every permutation is seeded from (seed, source, epoch) only, never from the rank: each consumer takes
a disjoint slice of one global order, so every document is read exactly once per source-epoch across
the whole job -- also when a source has fewer chunks than consumers (its elements then simply fall
into later epochs for the later consumers). Local randomness (which open chunk, which buffer slot)
is seeded from (seed, source, consumer).

The whole state is addresses and small integers (``state_dict``); ``load_state_dict`` re-reads the
open chunks' remaining rows, the buffered documents and the rows' leftovers by address, so restoring
costs O(buffer), never a replay from the start.
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from data.config import DataConfig
from data.manifest import Chunk, Manifest
from data.mixer import Mixer
from data.reader import ShardReader

CURSOR_VERSION = 1


@dataclass
class Doc:
    source: int
    shard: int
    row: int
    epoch: int  # the source-epoch this read belongs to
    tokens: np.ndarray  # uint32 token ids, EOT last


def _source_key(name: str) -> int:
    return zlib.crc32(name.encode())  # stable across configs that add or reorder sources


def chunk_permutation(seed: int, source: str, epoch: int, n_chunks: int) -> np.ndarray:
    """Level 1: the global order of a source's chunks in one epoch (same on every rank)."""
    return np.random.default_rng([seed, _source_key(source), epoch]).permutation(n_chunks)


class SourceStream:
    """One consumer's documents of one source: its slice of the chunk order, k open chunks, a buffer."""

    def __init__(self, index: int, name: str, chunks: list[Chunk], reader: ShardReader, cfg: DataConfig,
                 consumer: int, num_consumers: int):
        self.index, self.name, self.chunks, self.reader = index, name, chunks, reader
        self.seed, self.k, self.buffer_size = cfg.seed, cfg.open_shards, cfg.buffer_size
        self.consumer, self.num_consumers = consumer, num_consumers
        self.rng = np.random.Generator(np.random.PCG64([cfg.seed, _source_key(name), consumer, 7]))
        self.taken = 0  # chunks of this consumer's slice opened so far
        self.open: list[list] = []  # [global element g, docs consumed, docs: list[Doc]]
        self.buffer: list[Doc] = []
        self.addrs = np.zeros((0, 3), dtype=np.int32)  # (shard, row, epoch) per buffer slot, for the cursor
        self._perms: dict[int, np.ndarray] = {}

    # -- level 1 -------------------------------------------------------------------------------
    def chunk_at(self, g: int) -> tuple[int, Chunk]:
        """Element g of the infinite chunk sequence -> (epoch, chunk)."""
        epoch, i = divmod(g, len(self.chunks))
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            perm = self._perms[epoch] = chunk_permutation(self.seed, self.name, epoch, len(self.chunks))
        return epoch, self.chunks[perm[i]]

    def _load(self, g: int, skip: int = 0) -> list[Doc]:
        epoch, chunk = self.chunk_at(g)
        rows, tokens = self.reader.read_chunk(self.index, chunk, skip)
        return [Doc(self.index, chunk.shard, r, epoch, t) for r, t in zip(rows, tokens)]

    def _fill_open(self) -> None:
        while len(self.open) < self.k:
            g = self.consumer + self.taken * self.num_consumers
            self.taken += 1
            docs = self._load(g)
            if docs:  # a chunk can be empty after a row filter
                self.open.append([g, 0, docs])

    # -- level 2 -------------------------------------------------------------------------------
    def _pull(self) -> Doc:
        """Next document from the open chunks, chosen with probability proportional to what is left."""
        self._fill_open()
        remaining = [len(docs) - used for _, used, docs in self.open]
        r = int(self.rng.integers(sum(remaining)))
        for j, left in enumerate(remaining):
            if r < left:
                break
            r -= left
        entry = self.open[j]
        doc = entry[2][entry[1]]
        entry[1] += 1
        if entry[1] == len(entry[2]):
            self.open.pop(j)
        return doc

    def next_doc(self) -> Doc:
        """Emit a random buffered document and refill its slot (the buffer stays at B once full)."""
        if len(self.buffer) < self.buffer_size:
            while len(self.buffer) < self.buffer_size:
                self.buffer.append(self._pull())
            self.addrs = np.array([(d.shard, d.row, d.epoch) for d in self.buffer], dtype=np.int32)
        i = int(self.rng.integers(len(self.buffer)))
        doc = self.buffer[i]
        if len(self.buffer) > self.buffer_size:
            # An elastic resume (data/elastic.py) pooled more than B documents here: drain back to B.
            self.buffer.pop(i)
            self.addrs = np.delete(self.addrs, i, axis=0)
            return doc
        new = self.buffer[i] = self._pull()
        self.addrs[i] = (new.shard, new.row, new.epoch)
        return doc

    # -- cursor --------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The state, cheaply (a copy of the buffer's address array); ``pack_cursor`` compacts it."""
        return {
            "taken": self.taken,
            "open": [[g, used] for g, used, _ in self.open],
            "buffer": self.addrs.copy(),
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        self.taken = state["taken"]
        self.open = []
        for g, used in state["open"]:
            docs = self._load(g, skip=used)
            if docs:  # an elastic resume hands over unopened chunks, which a row filter may leave empty
                self.open.append([g, used, [None] * used + docs])  # keep `used` as an index
        buf = state["buffer"]
        self.addrs = (_unpack_ints(buf) if isinstance(buf, str) else np.asarray(buf, dtype=np.int32)).reshape(-1, 3).copy()
        tokens = self.reader.read_docs(self.index, [(int(s), int(r)) for s, r, _ in self.addrs])
        self.buffer = [Doc(self.index, int(s), int(r), int(e), t) for (s, r, e), t in zip(self.addrs, tokens)]
        self.rng.bit_generator.state = state["rng"]


def pack_cursor(snapshot: dict) -> dict:
    """A consumer snapshot with its buffers compacted: plain JSON, a few bytes per buffered document."""
    out = dict(snapshot)
    # (a DataLoader turns the snapshot's arrays into tensors on the way: np.asarray takes both)
    out["sources"] = {name: {**st, "buffer": st["buffer"] if isinstance(st["buffer"], str) else _pack_ints(np.asarray(st["buffer"]))}
                      for name, st in snapshot["sources"].items()}
    return out


def _pack_ints(a: np.ndarray) -> str:
    """int32 array -> compact text (zlib + base64), valid in JSON and in a weights-only checkpoint."""
    return base64.b64encode(zlib.compress(np.ascontiguousarray(a, dtype="<i4").tobytes(), 1)).decode()


def _unpack_ints(s: str) -> np.ndarray:
    return np.frombuffer(zlib.decompress(base64.b64decode(s)), dtype="<i4")


@dataclass
class Leftover:
    """The document a batch row is in the middle of, and how many of its tokens it already emitted."""

    doc: Doc
    offset: int


class ConsumerStream:
    """All sources of one consumer, mixed and packed into micro-batches, one per global step it owns.

    A rank with W DataLoader workers delivers step s from worker s mod W, so the consumer
    (rank, worker) produces steps worker, worker+W, ... and knows each batch's global step: that is
    what the schedules (mixture weights, sequence length) are evaluated at.
    """

    def __init__(self, manifest: Manifest, cfg: DataConfig, rank: int, world_size: int, worker: int,
                 num_workers: int, weights_at: Callable[[int], np.ndarray], seq_len_at: Callable[[int], int],
                 fingerprint: str | None = None):
        workers = max(1, num_workers)
        self.manifest, self.cfg = manifest, cfg
        self.rank, self.worker, self.workers = rank, worker, workers
        self.consumer = rank * workers + worker
        self.num_consumers = world_size * workers
        self.weights_at, self.seq_len_at = weights_at, seq_len_at
        self.fingerprint = fingerprint or manifest.fingerprint()
        self.reader = ShardReader(manifest, cfg)
        self.sources = [
            SourceStream(i, name, info.chunks, self.reader, cfg, self.consumer, self.num_consumers)
            for i, (name, info) in enumerate(manifest.sources.items())
        ]
        avg_doc_tokens = [max(1.0, info.tokens / max(1, info.docs)) for info in manifest.sources.values()]
        self.mixer = Mixer(len(self.sources), cfg.selector, avg_doc_tokens, seed=(cfg.seed, self.consumer))
        self.rows: list[Leftover | None] = [None] * cfg.batch_size
        self.pending: list[Leftover] = []  # leftovers an elastic resume could not fit into the rows
        self.next_step = worker

    def _next_doc(self, weights: np.ndarray) -> Doc:
        doc = self.sources[self.mixer.choose(weights)].next_doc()
        self.mixer.commit(doc.source, len(doc.tokens))
        return doc

    def next_batch(self) -> dict:
        """The micro-batch of step ``self.next_step``: B rows of seq_len inputs and targets."""
        step = self.next_step
        L = int(self.seq_len_at(step))
        weights = np.asarray(self.weights_at(step), dtype=np.float64)
        B = len(self.rows)
        tokens = np.empty((B, L + 1), dtype=np.int64)
        source = np.empty((B, L + 1), dtype=np.int8)
        doc_index = np.empty((B, L + 1), dtype=np.int32)
        pieces: list[list] = []
        source_tokens = np.zeros(len(self.sources), dtype=np.int64)
        for b in range(B):
            n, d = 0, 0
            cur = self.rows[b]
            while True:
                if cur is None:
                    cur = self.pending.pop(0) if self.pending else Leftover(self._next_doc(weights), 0)
                doc, off = cur.doc, cur.offset
                take = min(len(doc.tokens) - off, L + 1 - n)
                tokens[b, n:n + take] = doc.tokens[off:off + take]
                source[b, n:n + take] = doc.source
                doc_index[b, n:n + take] = d
                # Inputs are the first L tokens; the (L+1)-th is only a target (it is the next row's
                # first input), so only tokens placed before position L count as emitted here.
                emitted = min(take, L - n)
                if emitted > 0:
                    pieces.append([self.manifest.doc_id(doc.shard, doc.row), off, emitted])
                    source_tokens[doc.source] += emitted
                    self.mixer.emit(doc.source, emitted, weights)
                n += take
                if n == L + 1:
                    # The last token taken is the next row's first input: stay on this document.
                    cur = Leftover(doc, off + take - 1)
                    break
                cur, d = None, d + 1
            self.rows[b] = cur
        self.next_step += self.workers
        return {
            "step": step,
            "rank": self.rank,
            "worker": self.worker,
            "input_ids": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "target_source": source[:, 1:],
            "doc_index": doc_index[:, :-1],
            "pieces": pieces,
            "source_tokens": source_tokens,
            "weights": weights,
            "cursor": self.snapshot(),  # cheap; packed only when a checkpoint is written
        }

    # -- cursor --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return pack_cursor(self.snapshot())

    def snapshot(self) -> dict:
        rows = [None if r is None else [r.doc.source, r.doc.shard, r.doc.row, r.doc.epoch, r.offset] for r in self.rows]
        out = {
            "version": CURSOR_VERSION,
            "fingerprint": self.fingerprint,
            "seed": self.cfg.seed,
            "consumer": self.consumer,
            "num_consumers": self.num_consumers,
            "next_step": self.next_step,
            "sources": {s.name: s.snapshot() for s in self.sources},
            "mixer": self.mixer.state_dict(),
            "rows": rows,
        }
        if self.pending:
            out["pending"] = [[r.doc.source, r.doc.shard, r.doc.row, r.doc.epoch, r.offset] for r in self.pending]
        return out

    def load_state_dict(self, state: dict) -> None:
        from data.errors import ConfigError

        if state.get("version") != CURSOR_VERSION:
            raise ConfigError(f"data cursor version {state.get('version')} is not {CURSOR_VERSION}")
        if (state["consumer"], state["num_consumers"]) != (self.consumer, self.num_consumers):
            raise ConfigError(
                f"data cursor belongs to consumer {state['consumer']} of {state['num_consumers']}, "
                f"not {self.consumer} of {self.num_consumers}"
            )
        self.next_step = state["next_step"]
        for s in self.sources:
            s.load_state_dict(state["sources"][s.name])
        self.mixer.load_state_dict(state["mixer"])
        self.rows = [None if r is None else self._leftover(r) for r in state["rows"]]
        self.pending = [self._leftover(r) for r in state.get("pending", [])]

    def _leftover(self, r: list) -> Leftover:
        src, shard, row, epoch, offset = r
        (toks,) = self.reader.read_docs(src, [(shard, row)])
        return Leftover(Doc(src, shard, row, epoch, toks), offset)
