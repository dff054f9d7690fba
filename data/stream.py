"""Level 2: one consumer's documents of one source.

The consumer opens its slice of the source's global chunk order (``data/order.py``) k chunks at a
time, draws documents from the open chunks at random into a shuffle buffer of B documents, and emits
a random buffered document at each request. Local randomness (which open chunk, which buffer slot) is
seeded from (seed, source, consumer) on the ``RNG_LEVEL2`` stream.

The whole state is addresses and small integers (``snapshot``); ``load_state_dict`` re-reads the
open chunks' remaining rows and the buffered documents by address, so restoring costs O(buffer),
never a replay from the start.
"""

from __future__ import annotations

import numpy as np

from data.config import DataConfig
from data.cursor import buffer_addrs
from data.manifest import Chunk
from data.order import RNG_LEVEL2, ChunkOrder, element, source_key
from data.reader import ShardReader
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
        self.open: list[list] = []  # [global element g, docs consumed, docs: list[Doc]]
        self.buffer: list[Doc] = []
        self.addrs = np.zeros((0, 3), dtype=np.int32)  # (shard, row, epoch) per buffer slot, for the cursor
        self.chunk_at = ChunkOrder(cfg.seed, name, chunks)
        """Element g of the infinite chunk sequence -> (epoch, chunk) (level 1)."""

    def _load(self, g: int, skip: int = 0) -> list[Doc]:
        epoch, chunk = self.chunk_at(g)
        rows, tokens = self.reader.read_chunk(self.index, chunk, skip)
        return [Doc(self.index, chunk.shard, r, epoch, t) for r, t in zip(rows, tokens)]

    def _fill_open(self) -> None:
        while len(self.open) < self.k:
            g = element(self.consumer, self.taken, self.num_consumers)
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
        self.addrs = buffer_addrs(state["buffer"])
        tokens = self.reader.read_docs(self.index, [(int(s), int(r)) for s, r, _ in self.addrs])
        self.buffer = [Doc(self.index, int(s), int(r), int(e), t) for (s, r, e), t in zip(self.addrs, tokens)]
        self.rng.bit_generator.state = state["rng"]
