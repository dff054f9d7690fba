"""Level 2: one consumer's documents of one source.

The consumer opens its slice of the source's global chunk order (``data/order.py``) k chunks at a
time, draws documents from the open chunks at random into a shuffle buffer of B documents, and emits
a random buffered document at each request. Local randomness (which open chunk, which buffer slot) is
seeded from (seed, source, consumer) on the ``RNG_LEVEL2`` stream.

Exactly-once per source-epoch, whatever the sizes: a consumer never opens a chunk of a later
source-epoch while it still holds (open chunks or buffer) documents of an earlier one. A source whose
epoch gives this consumer fewer than k chunks or B documents therefore holds only what one epoch
gives (the effective k and B: ``data.plan.effective_streams``), the buffer drains at the epoch's end
instead of wrapping into the next epoch, and no buffer holds two copies of a document. A stream also
passes over a buffered document that is already in the batch being packed (an earlier epoch's read
still in a row), so a micro-batch holds a document twice only when every source offers nothing else.

The whole state is addresses and small integers (``cursor``, data/cursor.py); ``restore`` re-reads the
open chunks' remaining rows and the buffered documents by address, so restoring costs O(buffer),
never a replay from the start.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import numpy as np

from data.config import DataConfig
from data.cursor import DamagedCursor, SourceCursor
from data.manifest import Chunk
from data.order import RNG_LEVEL2, ChunkOrder, element, source_key
from data.reader import LazyChunk, ShardReader
from data.types import Doc


class SourceStream:
    """One consumer's documents of one source: its slice of the chunk order, k open chunks, a buffer."""

    def __init__(self, index: int, name: str, chunks: list[Chunk], reader: ShardReader, cfg: DataConfig,
                 consumer: int, num_consumers: int):
        self.index, self.name, self.chunks, self.reader = index, name, chunks, reader
        self.seed, self.k, self.buffer_size = cfg.seed, cfg.open_shards, cfg.buffer_size
        self.consumer, self.num_consumers = consumer, num_consumers
        self.rng = np.random.Generator(np.random.PCG64([cfg.seed, source_key(name), consumer, RNG_LEVEL2]))
        self.taken = 0  # chunks of this consumer's slice opened so far
        self.open: list[list] = []  # [global element g, docs consumed, LazyChunk]
        self.buffer: list[Doc] = []
        self.addrs = np.zeros((0, 3), dtype=np.int32)  # (shard, row, epoch) per buffer slot, for the cursor
        self.epoch_counts: Counter[int] = Counter()  # buffered documents per source-epoch (the barrier)
        self.chunk_at = ChunkOrder(cfg.seed, name, chunks)
        """Element g of the infinite chunk sequence -> (epoch, chunk) (level 1)."""

    def _load(self, g: int, skip: int = 0) -> LazyChunk:
        """Element g's chunk minus its first ``skip`` documents, read lazily (data/reader.py)."""
        return self.reader.open_chunk(self.index, self.chunk_at(g)[1], skip)

    def _epoch(self, g: int) -> int:
        return g // len(self.chunks)

    def _oldest_epoch(self) -> int | None:
        """The oldest source-epoch still held (open chunks or buffer); None when nothing is held."""
        held = [self._epoch(g) for g, _, _ in self.open] + list(self.epoch_counts)
        return min(held) if held else None

    def _fill_open(self) -> None:
        """Open the next chunks of the slice, up to k, but never one of a later source-epoch while this
        consumer still holds documents of an earlier one (the epoch barrier).

        The barrier is what makes exactly-once per source-epoch hold for a source smaller than what
        the consumers' buffers and open chunks ask for: without it a buffer of B documents over a
        slice of fewer than B fills by wrapping into later epochs, and holds copies of one document.
        It caps the effective open chunks and buffer at what one epoch gives this consumer, and it
        changes nothing while a consumer stays inside one epoch.
        """
        while len(self.open) < self.k:
            g = element(self.consumer, self.taken, self.num_consumers)
            oldest = self._oldest_epoch()
            if oldest is not None and oldest < self._epoch(g):
                return
            self.taken += 1
            lazy = self._load(g)
            if lazy.left:  # a chunk can be empty after a row filter
                self.open.append([g, 0, lazy])

    # -- level 2 -------------------------------------------------------------------------------
    def _pull(self) -> Doc | None:
        """Next document from the open chunks, chosen with probability proportional to what is left;
        None while the epoch barrier holds the next chunk back (the buffer then drains)."""
        self._fill_open()
        if not self.open:
            return None
        remaining = [lazy.left for _, _, lazy in self.open]
        r = int(self.rng.integers(sum(remaining)))
        for j, left in enumerate(remaining):
            if r < left:
                break
            r -= left
        entry = self.open[j]
        row, text = entry[2].take()
        entry[1] += 1
        if not entry[2].left:
            self.open.pop(j)
        return Doc(self.index, entry[2].shard, row, self._epoch(entry[0]), None, text)

    def _tokenized(self, doc: Doc) -> Doc:
        """A buffered document holds its text; it is tokenized when it leaves the buffer, so filling or
        restoring a buffer of B documents costs decoding only, and a buffer holds text, not tokens."""
        if doc.tokens is None:
            doc.tokens, doc.text = self.reader.encode(doc.text), None
        return doc

    def _top_up(self) -> None:
        """Fill the buffer to B (or as far as the epoch barrier allows)."""
        if len(self.buffer) >= self.buffer_size:
            return
        grown = False
        while len(self.buffer) < self.buffer_size:
            doc = self._pull()
            if doc is None:
                break
            self.buffer.append(doc)
            self.epoch_counts[doc.epoch] += 1
            grown = True
        if grown:
            self.addrs = np.array([(d.shard, d.row, d.epoch) for d in self.buffer], dtype=np.int32).reshape(-1, 3)

    def _slot(self, exclude: set | None) -> int | None:
        """A random buffer slot; if its document is in ``exclude`` (already in this batch), the next
        slot that is not, or None when every buffered document is. One draw either way, so the order
        is unchanged wherever nothing conflicts (which needs two source-epochs in flight)."""
        n = len(self.buffer)
        i = int(self.rng.integers(n))
        if not exclude:
            return i
        for j in range(i, i + n):
            d = self.buffer[j % n]
            if (d.source, d.shard, d.row) not in exclude:
                return j % n
        return None

    def next_doc(self, exclude: set | None = None) -> Doc | None:
        """Emit a random buffered document and refill its slot (the buffer stays at B once full).

        ``exclude`` holds (source, shard, row) of documents already in the batch being packed: they
        are passed over, and None comes back when only they are buffered (the mixer then picks
        another source for this row).
        """
        self._top_up()
        i = self._slot(exclude)
        if i is None:
            return None
        doc = self.buffer[i]
        self._forget(doc.epoch)
        new = None if len(self.buffer) > self.buffer_size else self._pull()
        if new is None:
            # An elastic resume pooled more than B documents here, or the epoch barrier holds the next
            # chunk back: the buffer shrinks (it fills up again once the next epoch may open).
            self.buffer.pop(i)
            self.addrs = np.delete(self.addrs, i, axis=0)
            return self._tokenized(doc)
        self.buffer[i] = new
        self.epoch_counts[new.epoch] += 1
        self.addrs[i] = (new.shard, new.row, new.epoch)
        return self._tokenized(doc)

    def _forget(self, epoch: int) -> None:
        self.epoch_counts[epoch] -= 1
        if not self.epoch_counts[epoch]:
            del self.epoch_counts[epoch]

    # -- cursor --------------------------------------------------------------------------------
    def cursor(self) -> SourceCursor:
        """The state, cheaply (a copy of the buffer's address array; packed when serialised)."""
        return SourceCursor(self.taken, tuple((g, used) for g, used, _ in self.open), self.addrs.copy(),
                            self.rng.bit_generator.state)

    def check_addresses(self, addrs: np.ndarray, field: Callable[[int], str]) -> None:
        """Refuse an address ``(shard, row, ...)`` of ``addrs`` outside this source's training chunks: an edited
        cursor whose buffer points at another source's (or a held-out) document would train it in this
        source's slots. One line naming the source, the cursor field (``field(i)`` for address i) and the
        document."""
        starts = np.array([(c.shard << 32) | c.start for c in self.chunks], dtype=np.int64)
        stops = np.array([(c.shard << 32) | c.stop for c in self.chunks], dtype=np.int64)
        order = np.argsort(starts)
        starts, stops = starts[order], stops[order]
        keys = (addrs[:, 0].astype(np.int64) << 32) | addrs[:, 1].astype(np.int64)
        at = np.searchsorted(starts, keys, side="right") - 1
        outside = np.flatnonzero((at < 0) | (keys >= stops[np.maximum(at, 0)]))
        if outside.size:
            i = int(outside[0])
            shard, row = int(addrs[i, 0]), int(addrs[i, 1])
            doc = self.reader.manifest.doc_id(shard, row) if shard < len(self.reader.manifest.shards) else "no file"
            raise DamagedCursor(f"data cursor (consumer {self.consumer} of {self.num_consumers}): {field(i)} = shard "
                                f"{shard} row {row} ({doc}) is not in the training chunks of source '{self.name}'")

    def restore(self, cursor: SourceCursor) -> None:
        self.taken = cursor.taken
        self.open = []
        for g, used in cursor.open:
            lazy = self._load(g, skip=used)  # nothing before `used` is tokenized
            if lazy.left:  # an elastic resume hands over unopened chunks, which a row filter may leave empty
                self.open.append([g, used, lazy])
        self.addrs = cursor.addresses()
        texts = self.reader.read_texts(self.index, [(int(s), int(r)) for s, r, _ in self.addrs])
        self.buffer = [Doc(self.index, int(s), int(r), int(e), None, t) for (s, r, e), t in zip(self.addrs, texts)]
        self.epoch_counts = Counter(d.epoch for d in self.buffer)
        self.rng.bit_generator.state = cursor.rng
