"""Mixing and packing: all sources of one consumer, packed into the micro-batches of its steps.

::

    mixer: picks the source of each next document by tokens (data/mixer.py)
    packer: row-parallel packing into sequences of seq_len(step) + 1 tokens (each row of the batch
            continues its own document), EOT after every document

A rank with W DataLoader workers delivers step s from worker s mod W, so the consumer (rank, worker)
produces steps worker, worker+W, ... and knows each batch's global step: that is what the schedules
(mixture weights, sequence length) are evaluated at.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from data.config import DataConfig
from data.cursor import CURSOR_VERSION, check_version, pack_cursor
from data.errors import ConfigError
from data.manifest import Manifest
from data.mixer import Mixer
from data.reader import ShardReader
from data.stream import SourceStream
from data.types import Doc, Leftover, TrainBatch


class ConsumerStream:
    """All sources of one consumer, mixed and packed into micro-batches, one per global step it owns."""

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
        self.bounded = cfg.commit == "sequence"
        self.continuations: list[Leftover] = []  # (bounded commitment) documents under way, oldest first
        self.in_batch: set[tuple[int, int, int]] = set()  # (source, shard, row) of the batch being packed
        self.next_step = worker

    def _next_piece(self, weights: np.ndarray) -> Leftover:
        """What a row continues with: an elastic leftover, or the mixer's choice of source, then that
        source's oldest document under way (bounded commitment) or its next document."""
        if self.pending:
            return self.pending.pop(0)
        skip: set[int] = set()
        while True:
            s = self.mixer.choose(weights, skip)
            if s is None:  # every source offers only documents already in this batch: allow one twice
                s = self.mixer.choose(weights)
                doc = self.sources[s].next_doc()
                break
            if self.bounded:
                for j, cont in enumerate(self.continuations):
                    if cont.doc.source == s:
                        return self.continuations.pop(j)
            doc = self.sources[s].next_doc(self.in_batch)
            if doc is not None:
                break
            skip.add(s)
        if not self.bounded:
            self.mixer.commit(doc.source, len(doc.tokens))
        self.in_batch.add((doc.source, doc.shard, doc.row))
        return Leftover(doc, 0)

    def _release_rows(self) -> None:
        """Bounded commitment: the documents the rows are in the middle of go back to their sources'
        queue (row order), so no row holds a document across a step without a new choice."""
        self.continuations += [r for r in self.rows if r is not None] + self.pending
        self.rows = [None] * len(self.rows)
        self.pending = []

    def next_batch(self) -> TrainBatch:
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
        if self.bounded:
            self._release_rows()
        self.in_batch = {(r.doc.source, r.doc.shard, r.doc.row) for r in self.rows + self.continuations if r}
        for b in range(B):
            n, d = 0, 0
            cur = self.rows[b]
            while True:
                if cur is None:
                    cur = self._next_piece(weights)
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
                    if self.bounded:
                        self.mixer.commit(doc.source, emitted)
                    self.mixer.emit(doc.source, emitted, weights)
                n += take
                if n == L + 1:
                    # The last token taken is the next row's first input: stay on this document.
                    cur = Leftover(doc, off + take - 1)
                    break
                cur, d = None, d + 1
            self.rows[b] = cur
        if self.bounded:
            self._release_rows()
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
        rows = [None if r is None else _addr(r) for r in self.rows]
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
            out["pending"] = [_addr(r) for r in self.pending]
        if self.continuations:
            out["continuations"] = [_addr(r) for r in self.continuations]
        return out

    def load_state_dict(self, state: dict) -> None:
        check_version(state)
        if (state["consumer"], state["num_consumers"]) != (self.consumer, self.num_consumers):
            raise ConfigError(
                f"data cursor belongs to consumer {state['consumer']} of {state['num_consumers']}, "
                f"not {self.consumer} of {self.num_consumers}"
            )
        self.next_step = state["next_step"]
        for s in self.sources:
            s.load_state_dict(state["sources"][s.name])
        self.mixer.load_state_dict(state["mixer"])
        rows, pending, conts = state["rows"], state.get("pending", []), state.get("continuations", [])
        read = iter(self._leftovers([r for r in rows if r is not None] + pending + conts))
        self.rows = [None if r is None else next(read) for r in rows]
        self.pending = [next(read) for _ in pending]
        self.continuations = [next(read) for _ in conts]

    def _leftovers(self, addrs: list[list]) -> list[Leftover]:
        """Leftovers re-read by address, one read_docs per source (a row group is scanned once)."""
        by_source: dict[int, list[int]] = {}
        for i, (src, *_rest) in enumerate(addrs):
            by_source.setdefault(int(src), []).append(i)
        out: list[Leftover | None] = [None] * len(addrs)
        for src, idx in by_source.items():
            tokens = self.reader.read_docs(src, [(int(addrs[i][1]), int(addrs[i][2])) for i in idx])
            for i, toks in zip(idx, tokens):
                _, shard, row, epoch, offset = (int(x) for x in addrs[i])
                out[i] = Leftover(Doc(src, shard, row, epoch, toks), offset)
        return out


def _addr(r: Leftover) -> list[int]:
    """A leftover as the cursor stores it: [source, shard, row, epoch, offset]."""
    return [r.doc.source, r.doc.shard, r.doc.row, r.doc.epoch, r.offset]
