"""Level 1: the global order of each source's chunks. Pure functions of (seed, source, epoch).

::

    per source: infinite chunk sequence = perm(seed, source, epoch 0) ++ perm(seed, source, epoch 1) ++ ...
        consumer c of C owns elements c, c+C, c+2C, ...

Every permutation is seeded from (seed, source, epoch) only, never from the rank: each consumer takes
a disjoint slice of one global order, so every chunk is read exactly once per source-epoch across
the whole job. Local randomness (level 2, the mixer) uses the named RNG streams below.
"""

from __future__ import annotations

import zlib

import numpy as np

from data.manifest import Chunk

# Named RNG streams: the last word of a PCG64 seed sequence, so that two uses of (seed, source,
# consumer) never share random numbers. Changing one changes every order: they are part of the format.
RNG_LEVEL2 = 7  # which open chunk, which buffer slot (data/stream.py, data/elastic.py)
RNG_MIXER = 11  # the mixer's random choices (data/mixer.py)
RNG_REPLICATE = 13  # a branch replicate's re-seeded streams (data/elastic.py reseed)


def source_key(name: str) -> int:
    """A source's seed word: stable across configs that add or reorder sources."""
    return zlib.crc32(name.encode())


def chunk_permutation(seed: int, source: str, epoch: int, n_chunks: int) -> np.ndarray:
    """The order of a source's chunks in one epoch (the same on every rank)."""
    return np.random.default_rng([seed, source_key(source), epoch]).permutation(n_chunks)


def element(consumer: int, taken: int, num_consumers: int) -> int:
    """The global element a consumer opens as its ``taken``-th chunk (its slice: c, c+C, c+2C, ...)."""
    return consumer + taken * num_consumers


class ChunkOrder:
    """Element g of a source's infinite chunk sequence -> (epoch, chunk), caching a few epochs."""

    def __init__(self, seed: int, name: str, chunks: list[Chunk]):
        self.seed, self.name, self.chunks = seed, name, chunks
        self._perms: dict[int, np.ndarray] = {}

    def __call__(self, g: int) -> tuple[int, Chunk]:
        epoch, i = divmod(g, len(self.chunks))
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            perm = self._perms[epoch] = chunk_permutation(self.seed, self.name, epoch, len(self.chunks))
        return epoch, self.chunks[perm[i]]
