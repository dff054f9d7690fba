"""Packing: one consumer's documents into the micro-batches of its steps, row-parallel.

::

    choosing: the source of each next document, bounded commitment (data/mixer.py MixingPolicy)
    packing:  each row of the batch continues its own document into sequences of seq_len(step) + 1
              tokens, EOT after every document (:class:`RowPacker`)
    cursor:   the whole state, addresses only (data/cursor.py ConsumerCursor)

A rank with W DataLoader workers delivers step s from worker s mod W, so the consumer (rank, worker)
produces steps worker, worker+W, ... and knows each batch's global step: that is what the schedules
(mixture weights, sequence length) are evaluated at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from data.config import DataConfig
from data.cursor import ConsumerCursor, LeftoverAddress
from data.errors import ConfigError
from data.manifest import Manifest
from data.mixer import Mixer, MixingPolicy
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
        self.policy = MixingPolicy(self.sources, self.mixer, bounded=cfg.commit == "sequence")
        self.packer = RowPacker(cfg.batch_size, len(self.sources), manifest.doc_id)
        self.next_step = worker

    def next_batch(self) -> TrainBatch[np.ndarray]:
        """The micro-batch of step ``self.next_step``: B rows of seq_len inputs and targets."""
        step = self.next_step
        weights = np.asarray(self.weights_at(step), dtype=np.float64)
        policy, packer = self.policy, self.packer
        packer.rows = policy.begin(packer.rows)
        rows = packer.pack(int(self.seq_len_at(step)), lambda: policy.next_piece(weights),
                           lambda source, n: policy.placed(source, n, weights))
        packer.rows = policy.end(packer.rows)
        self.next_step += self.workers
        return {
            "step": step,
            "rank": self.rank,
            "worker": self.worker,
            "input_ids": rows.tokens[:, :-1],
            "targets": rows.tokens[:, 1:],
            "target_source": rows.source[:, 1:],
            "doc_index": rows.doc_index[:, :-1],
            "pieces": rows.pieces,
            "source_tokens": rows.source_tokens,
            "weights": weights,
            "cursor": self.cursor(),  # cheap; its buffers are packed only when a checkpoint is written
        }

    # -- cursor --------------------------------------------------------------------------------
    def cursor(self) -> ConsumerCursor:
        """The state after the last batch (see data/cursor.py)."""
        return ConsumerCursor(
            fingerprint=self.fingerprint,
            seed=self.cfg.seed,
            consumer=self.consumer,
            num_consumers=self.num_consumers,
            next_step=self.next_step,
            sources={s.name: s.cursor() for s in self.sources},
            mixer=self.mixer.cursor(),
            rows=tuple(None if r is None else _address(r) for r in self.packer.rows),
            pending=tuple(_address(r) for r in self.policy.pending),
            continuations=tuple(_address(r) for r in self.policy.continuations),
        )

    def state_dict(self) -> dict:
        """The serialised cursor (``ConsumerCursor.to_dict``)."""
        return self.cursor().to_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from a serialised cursor, checked (``ConsumerCursor.from_dict``)."""
        self.restore(ConsumerCursor.from_dict(state))

    def restore(self, cursor: ConsumerCursor) -> None:
        if (cursor.consumer, cursor.num_consumers) != (self.consumer, self.num_consumers):
            raise ConfigError(
                f"data cursor belongs to consumer {cursor.consumer} of {cursor.num_consumers}, "
                f"not {self.consumer} of {self.num_consumers}"
            )
        if len(cursor.rows) != len(self.packer.rows):
            raise ConfigError(f"data cursor holds {len(cursor.rows)} batch rows, but data.batch_size is "
                              f"{len(self.packer.rows)}: resume with the batch size it was saved with")
        for s in self.sources:  # every address in its source's chunks, before anything is read
            s.check_addresses(cursor.sources[s.name].addresses(), lambda i: f"sources.{s.name}.buffer[{i}]")
        for key in ("rows", "pending", "continuations"):
            for i, a in enumerate(getattr(cursor, key)):
                if a is not None:
                    self.sources[a.source].check_addresses(np.array([[a.shard, a.row]]), lambda _: f"{key}[{i}]")
        self.next_step = cursor.next_step
        for s in self.sources:
            s.restore(cursor.sources[s.name])
        self.mixer.restore(cursor.mixer)
        read = iter(self._leftovers(cursor.leftovers()))
        self.packer.rows = [None if r is None else next(read) for r in cursor.rows]
        self.policy.pending = [next(read) for _ in cursor.pending]
        self.policy.continuations = [next(read) for _ in cursor.continuations]

    def _leftovers(self, addrs: list[LeftoverAddress]) -> list[Leftover]:
        """Leftovers re-read by address, one read_docs per source (a row group is scanned once)."""
        by_source: dict[int, list[int]] = {}
        for i, a in enumerate(addrs):
            by_source.setdefault(a.source, []).append(i)
        out: list[Leftover | None] = [None] * len(addrs)
        for src, idx in by_source.items():
            tokens = self.reader.read_docs(src, [(addrs[i].shard, addrs[i].row) for i in idx])
            for i, toks in zip(idx, tokens):
                a = addrs[i]
                out[i] = Leftover(Doc(src, a.shard, a.row, a.epoch, toks), a.offset)
        return out


def _address(r: Leftover) -> LeftoverAddress:
    return LeftoverAddress(r.doc.source, r.doc.shard, r.doc.row, r.doc.epoch, r.offset)


@dataclass
class PackedRows:
    """One micro-batch's rows, L + 1 tokens each (inputs are the first L, targets the last L)."""

    tokens: np.ndarray  # [B, L + 1] int64
    source: np.ndarray  # [B, L + 1] int8: the source of each token
    doc_index: np.ndarray  # [B, L + 1] int32: the document's index within its row
    pieces: list[list[int]]  # [doc_id, first_token_offset, n_tokens] covering the inputs, row after row
    source_tokens: np.ndarray  # input tokens per source


class RowPacker:
    """B rows, each continuing its own document (``rows[b]``: the one it is in the middle of)."""

    def __init__(self, batch_size: int, n_sources: int, doc_id: Callable[[int, int], int]):
        self.rows: list[Leftover | None] = [None] * batch_size
        self.n_sources, self.doc_id = n_sources, doc_id

    def pack(self, L: int, next_piece: Callable[[], Leftover], placed: Callable[[int, int], None]) -> PackedRows:
        """Fill every row with L + 1 tokens; ``next_piece()`` gives what a row continues with when its
        document ends, ``placed(source, n)`` hears of every n input tokens emitted."""
        B = len(self.rows)
        out = PackedRows(np.empty((B, L + 1), dtype=np.int64), np.empty((B, L + 1), dtype=np.int8),
                         np.empty((B, L + 1), dtype=np.int32), [], np.zeros(self.n_sources, dtype=np.int64))
        for b in range(B):
            n, d = 0, 0
            cur = self.rows[b]
            while True:
                if cur is None:
                    cur = next_piece()
                doc, off = cur.doc, cur.offset
                take = min(len(doc.tokens) - off, L + 1 - n)
                out.tokens[b, n:n + take] = doc.tokens[off:off + take]
                out.source[b, n:n + take] = doc.source
                out.doc_index[b, n:n + take] = d
                # Inputs are the first L tokens; the (L+1)-th is only a target (it is the next row's
                # first input), so only tokens placed before position L count as emitted here.
                emitted = min(take, L - n)
                if emitted > 0:
                    out.pieces.append([self.doc_id(doc.shard, doc.row), off, emitted])
                    out.source_tokens[doc.source] += emitted
                    placed(doc.source, emitted)
                n += take
                if n == L + 1:
                    # The last token taken is the next row's first input: stay on this document.
                    cur = Leftover(doc, off + take - 1)
                    break
                cur, d = None, d + 1
            self.rows[b] = cur
        return out
