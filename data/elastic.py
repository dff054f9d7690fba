"""Elastic resume: a checkpoint's data cursors re-cut for a different number of consumers.

A resume with other ranks x workers (or another micro-batch or accumulation) cannot replay the
identical order: the global order was sliced by consumer. It can keep *exactly-once*: because a
cursor holds addresses, not data (data/stream.py), the work every old consumer still owed can be
pooled and dealt to the new consumers, which then continue with the new slicing. Pure functions over
cursors (data/cursor.py) and the manifest's chunk counts -- no file is read here.

What an old consumer ``c`` of ``C`` still owes, per source::

    open chunk remainders     [g, used]           (element g of the chunk sequence, `used` docs taken)
    untaken slice elements    [g, 0]              g = c (mod C) with n_c <= g < F
    buffered documents        (shard, row, epoch)

and per consumer, the batch rows' leftovers ``[source, shard, row, epoch, offset]`` (documents a row
is in the middle of; ``offset`` is the next input token). ``n_c = c + taken_c * C`` is consumer c's
next element; the *frontier* ``F`` is the largest ``n_c`` rounded up to a multiple of the new ``C'``,
so that new consumer ``c'`` continues at elements ``F + c', F + c' + C', ...`` (``taken = F / C'``).
Every element below F is then either consumed, open, or pending -- nothing falls between the old
slicing and the new one, and nothing is owned twice.

The pooled work is dealt round-robin in a fixed order (old consumer, then position), so every rank
computes the same new cursors from the same checkpoint. A new consumer drains it before its own
slice without special cases in the stream: pending chunks are just more open chunks (the stream
draws from all of them until fewer than k are left), a pooled buffer larger than B shrinks back to B
as documents leave it, and leftovers beyond the new rows wait in the cursor's ``pending`` list until
a row needs a document.

The mixer's counters are pooled too (totals split evenly), so the token shares continue close to
their targets; a new consumer's in-flight estimate is approximate (leftover lengths are not known
without reading them), which only affects which source the next few documents come from.

A *replicate* of a decay branch (``data.replicate``, :func:`reseed`) keeps the layout and every
consumer's work and counters, and re-seeds its random streams from (seed, source, consumer, replicate,
step): the same pending work drawn in another order, exactly-once and the token targets untouched.
Within a replicate every arm re-seeds alike, so the arms still draw each source in the same order.
"""

from __future__ import annotations

import dataclasses
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from data.cursor import ConsumerCursor, LeftoverAddress, MixerCursor, SourceCursor, as_cursor, pack_ints
from data.errors import ConfigError
from data.manifest import Manifest
from data.order import RNG_LEVEL2, RNG_MIXER, RNG_REPLICATE, source_key


def redistribute_source(states: list[SourceCursor | None], n_new: int, name: str, seed: int, resume_step: int,
                        wanted: set[int] | None = None) -> list[SourceCursor | None]:
    """One source's stream cursors of C old consumers -> cursors of ``n_new`` consumers (see module doc).

    ``states[c]`` is consumer c's ``SourceStream.cursor()``, None for a consumer that never produced a
    batch (it owes its whole slice so far). With ``wanted``, only those new consumers' cursors are
    built (packing the buffers is most of the cost); the others are None.
    """
    n_old = len(states)
    taken = [0 if st is None else st.taken for st in states]
    frontier = max(c + t * n_old for c, t in enumerate(taken))
    frontier = math.ceil(frontier / n_new) * n_new  # new consumer c' continues at F + c'
    chunks = _owed_chunks(states, taken, frontier)
    buffered = _pooled_buffers(states)
    out = []
    for c in range(n_new):
        if wanted is not None and c not in wanted:
            out.append(None)
            continue
        rng = np.random.PCG64([seed, source_key(name), c, RNG_LEVEL2, resume_step])  # fresh, deterministic
        out.append(SourceCursor(taken=frontier // n_new, open=tuple(chunks[c::n_new]),
                                buffer=pack_ints(buffered[c::n_new]), rng=rng.state))
    return out


def _owed_chunks(states: list[SourceCursor | None], taken: list[int], frontier: int) -> list[tuple[int, int]]:
    """Every chunk element below the frontier not yet finished: the open remainders first (documents
    already under way), then the untaken elements of each old consumer's slice."""
    n_old = len(states)
    chunks = [(g, used) for st in states if st is not None for g, used in st.open]
    for c, t in enumerate(taken):
        chunks += [(g, 0) for g in range(c + t * n_old, frontier, n_old)]
    return chunks


def _pooled_buffers(states: list[SourceCursor | None]) -> np.ndarray:
    """Every old consumer's buffered addresses, in consumer order, as one [n, 3] array.

    One array, not Python tuples: 82M addresses at 2,048 consumers x 4 sources x 10,000. zlib and base64
    release the GIL, so the unpacking runs on all cores (most of a one-rank re-cut)."""
    with ThreadPoolExecutor(min(32, os.cpu_count() or 1)) as pool:
        arrays = list(pool.map(SourceCursor.addresses, [st for st in states if st is not None]))
    return np.concatenate(arrays) if arrays else np.zeros((0, 3), dtype=np.int32)


def reseed(cursor: ConsumerCursor | None, replicate: int, resume_step: int) -> ConsumerCursor | None:
    """Consumer ``cursor`` of replicate ``replicate`` (see the module doc); replicate 0: the cursor itself."""
    if cursor is None or replicate == 0:
        return cursor

    def state(*words: int) -> dict:
        return np.random.PCG64([cursor.seed, *words, RNG_REPLICATE, replicate, resume_step]).state

    c = cursor.consumer
    sources = {n: dataclasses.replace(sc, rng=state(source_key(n), c, RNG_LEVEL2)) for n, sc in cursor.sources.items()}
    mixer = dataclasses.replace(cursor.mixer, rng=state(c, RNG_MIXER))
    return dataclasses.replace(cursor, sources=sources, mixer=mixer)


def _split(total: np.ndarray, n: int, i: int) -> np.ndarray:
    """Share i of n of an integer vector, the remainder going to the first shares (sums back exactly)."""
    return total // n + (i < total % n)


def redistribute(cursors: list[list[ConsumerCursor | dict | None]], manifest: Manifest, *, seed: int,
                 world_size: int, num_workers: int, batch_size: int, resume_step: int,
                 ranks: list[int] | None = None) -> list[list[ConsumerCursor | None]]:
    """Cursors ``[rank][worker]`` of the old layout (typed or serialised) -> cursors of the new one.

    ``resume_step`` is the next data step (micro-batch index) in the *new* run's units; new worker w
    of every rank gets the first step >= resume_step that it owns (steps w, w + W, ...), matching the
    DataModule's rotation of DataLoader workers on resume. With ``ranks``, only those ranks' cursors
    are built (a rank needs its own: the re-cut at 2,048 consumers then packs 4 cursors, not 2,048);
    the other ranks' entries are lists of None.
    """
    old, fingerprint = _checked_old_cursors(cursors, seed, manifest)
    workers = max(1, num_workers)
    n_new = world_size * workers
    wanted = None if ranks is None else {r * workers + w for r in ranks for w in range(workers)}
    per_source = _per_source(old, manifest, n_new, seed, resume_step, wanted)
    # Row leftovers: a consumer's own rows first, then what an earlier elastic resume left pending.
    # Documents handed back between steps (bounded commitment) are leftovers like any other.
    leftovers = [row for c in old if c is not None for row in c.leftovers()]
    mixers = _PooledMixer(old, len(manifest.source_names))
    new: list[list[ConsumerCursor | None]] = [[None] * workers for _ in range(world_size)]
    for c in range(n_new) if wanted is None else sorted(wanted):  # a new consumer's share depends on c alone
        new[c // workers][c % workers] = ConsumerCursor(
            fingerprint=fingerprint, seed=seed, consumer=c, num_consumers=n_new,
            next_step=resume_step + (c % workers - resume_step) % workers,
            sources={name: states[c] for name, states in per_source.items()},
            mixer=mixers.share(c, n_new, seed, resume_step),
            **_dealt_rows(leftovers[c::n_new], batch_size),
        )
    return new


def _per_source(old: list[ConsumerCursor | None], manifest: Manifest, n_new: int, seed: int, resume_step: int,
                wanted: set[int] | None) -> dict[str, list[SourceCursor | None]]:
    return {name: redistribute_source([None if c is None else c.sources[name] for c in old], n_new, name, seed,
                                      resume_step, wanted) for name in manifest.source_names}


def _checked_old_cursors(cursors: list[list[ConsumerCursor | dict | None]], seed: int,
                         manifest: Manifest) -> tuple[list[ConsumerCursor | None], str]:
    """The old cursors in consumer order, each read (checked) and claiming its own place, all of one seed
    and corpus; and that corpus fingerprint."""
    flat = [cur for rank in cursors for cur in rank]
    n_old, old, fingerprint = len(flat), [], None
    for i, raw in enumerate(flat):
        cur = as_cursor(raw)
        old.append(cur)
        if cur is None:
            continue
        if (cur.consumer, cur.num_consumers) != (i, n_old):
            raise ConfigError(f"data cursor {i} of {n_old} claims to be consumer {cur.consumer} of {cur.num_consumers}")
        fingerprint = cur.fingerprint if fingerprint is None else fingerprint
        if cur.seed != seed or cur.fingerprint != fingerprint:
            raise ConfigError("data cursors of one checkpoint disagree on seed or corpus fingerprint")
    return old, manifest.fingerprint() if fingerprint is None else fingerprint


class _PooledMixer:
    """The old consumers' mixer counters summed, to be split evenly over the new consumers."""

    def __init__(self, old: list[ConsumerCursor | None], n_sources: int):
        zeros = [0] * n_sources
        self.emitted = np.sum([c.mixer.emitted if c else zeros for c in old], axis=0).astype(np.int64)
        committed = np.sum([c.mixer.committed if c else zeros for c in old], axis=0).astype(np.int64)
        self.target = np.sum([c.mixer.target if c else zeros for c in old], axis=0).astype(np.float64)
        self.in_flight = committed - self.emitted

    def share(self, c: int, n_new: int, seed: int, resume_step: int) -> MixerCursor:
        """New consumer c's counters, and a fresh mixer RNG."""
        em = _split(self.emitted, n_new, c)
        return MixerCursor(emitted=tuple(em.tolist()),
                           committed=tuple((em + _split(self.in_flight, n_new, c)).tolist()),
                           target=tuple((self.target / n_new).tolist()),
                           rng=np.random.PCG64([seed, c, RNG_MIXER, resume_step]).state)


def _dealt_rows(mine: list[LeftoverAddress], batch_size: int) -> dict:
    """A new consumer's share of the leftovers: into its rows first, the rest pending (see module doc)."""
    return {"rows": tuple(mine[:batch_size]) + (None,) * max(0, batch_size - len(mine)),
            "pending": tuple(mine[batch_size:])}


def redistribute_simulator_state(state: dict, manifest: Manifest, *, seed: int, world_size: int, num_workers: int,
                                 batch_size: int) -> dict:
    """An ``OrderSimulator.state_dict()`` re-cut for a simulator of another layout (same step)."""
    return {
        "step": state["step"],
        "world_size": world_size,
        "num_workers": max(1, num_workers),
        "consumers": [[None if c is None else c.to_dict() for c in rank]
                      for rank in redistribute(state["consumers"], manifest, seed=seed, world_size=world_size,
                                               num_workers=num_workers, batch_size=batch_size,
                                               resume_step=state["step"])],
    }
