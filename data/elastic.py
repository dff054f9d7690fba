"""Elastic resume: a checkpoint's data cursors re-cut for a different number of consumers.

A resume with other ranks x workers (or another micro-batch or accumulation) cannot replay the
identical order: the global order was sliced by consumer. It can keep *exactly-once*: because a
cursor holds addresses, not data (data/stream.py), the work every old consumer still owed can be
pooled and dealt to the new consumers, which then continue with the new slicing. Pure functions over
packed cursors and the manifest's chunk counts -- no file is read here.

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
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from data.cursor import CURSOR_VERSION, buffer_addrs, check_version, pack_ints
from data.errors import ConfigError
from data.manifest import Manifest
from data.order import RNG_LEVEL2, source_key


def redistribute_source(states: list[dict | None], n_new: int, name: str, seed: int, resume_step: int,
                        wanted: set[int] | None = None) -> list[dict | None]:
    """One source's stream states of C old consumers -> states of ``n_new`` consumers (see module doc).

    ``states[c]`` is consumer c's ``SourceStream.snapshot()`` (or its packed form), None for a consumer
    that never produced a batch (it owes its whole slice so far). With ``wanted``, only those new
    consumers' states are built (packing the buffers is most of the cost); the others are None.
    """
    n_old = len(states)
    taken = [0 if st is None else int(st["taken"]) for st in states]
    frontier = max(c + t * n_old for c, t in enumerate(taken))
    frontier = math.ceil(frontier / n_new) * n_new  # new consumer c' continues at F + c'

    chunks: list[list[int]] = []  # open remainders first (documents already under way), then untaken
    for st in states:
        if st is not None:
            chunks += [[int(g), int(used)] for g, used in st["open"]]
    for c, t in enumerate(taken):
        chunks += [[g, 0] for g in range(c + t * n_old, frontier, n_old)]
    # one [n, 3] array (82M addresses at 2,048 consumers x 4 sources x 10,000: no Python tuples)
    # (zlib and base64 release the GIL: the unpacking runs on all cores, most of a one-rank re-cut)
    with ThreadPoolExecutor(min(32, os.cpu_count() or 1)) as pool:
        arrays = list(pool.map(buffer_addrs, [st["buffer"] for st in states if st is not None]))
    buffered = np.concatenate(arrays) if arrays else np.zeros((0, 3), dtype=np.int32)

    out = []
    for c in range(n_new):
        if wanted is not None and c not in wanted:
            out.append(None)
            continue
        rng = np.random.PCG64([seed, source_key(name), c, RNG_LEVEL2, resume_step])  # fresh, deterministic
        out.append({
            "taken": frontier // n_new,
            "open": chunks[c::n_new],
            "buffer": pack_ints(buffered[c::n_new]),
            "rng": rng.state,
        })
    return out


def _split(total: np.ndarray, n: int, i: int) -> np.ndarray:
    """Share i of n of an integer vector, the remainder going to the first shares (sums back exactly)."""
    return total // n + (i < total % n)


def redistribute(cursors: list[list[dict | None]], manifest: Manifest, *, seed: int, world_size: int,
                 num_workers: int, batch_size: int, resume_step: int,
                 ranks: list[int] | None = None) -> list[list[dict | None]]:
    """Packed cursors ``[rank][worker]`` of the old layout -> packed cursors of the new one.

    ``resume_step`` is the next data step (micro-batch index) in the *new* run's units; new worker w
    of every rank gets the first step >= resume_step that it owns (steps w, w + W, ...), matching the
    DataModule's rotation of DataLoader workers on resume. With ``ranks``, only those ranks' cursors
    are built (a rank needs its own: the re-cut at 2,048 consumers then packs 4 cursors, not 2,048);
    the other ranks' entries are lists of None.
    """
    old = [cur for rank in cursors for cur in rank]
    n_old, workers = len(old), max(1, num_workers)
    n_new = world_size * workers
    fingerprint = next((c["fingerprint"] for c in old if c is not None), manifest.fingerprint())
    for i, cur in enumerate(old):
        if cur is None:
            continue
        check_version(cur)
        if (cur["consumer"], cur["num_consumers"]) != (i, n_old):
            raise ConfigError(
                f"data cursor {i} of {n_old} claims to be consumer {cur['consumer']} of {cur['num_consumers']}"
            )
        if cur["seed"] != seed or cur["fingerprint"] != fingerprint:
            raise ConfigError("data cursors of one checkpoint disagree on seed or corpus fingerprint")

    names = manifest.source_names
    wanted = None if ranks is None else {r * workers + w for r in ranks for w in range(workers)}
    per_source = {
        name: redistribute_source(
            [None if c is None else c["sources"][name] for c in old], n_new, name, seed, resume_step, wanted
        )
        for name in names
    }

    # Row leftovers: a consumer's own rows first, then what an earlier elastic resume left pending.
    # Documents handed back between steps (bounded commitment) are leftovers like any other.
    leftovers = [row for c in old if c is not None
                 for row in c["rows"] + c.get("pending", []) + c.get("continuations", []) if row is not None]
    n_src = len(names)
    zeros = [0] * n_src
    emitted = np.sum([c["mixer"]["emitted"] if c else zeros for c in old], axis=0).astype(np.int64)
    committed = np.sum([c["mixer"]["committed"] if c else zeros for c in old], axis=0).astype(np.int64)
    target = np.sum([c["mixer"]["target"] if c else zeros for c in old], axis=0).astype(np.float64)
    in_flight = committed - emitted

    new: list[list[dict]] = []
    for rank in range(world_size):
        row_of_rank = []
        for worker in range(workers):
            c = rank * workers + worker
            if wanted is not None and c not in wanted:
                row_of_rank.append(None)
                continue
            mine = leftovers[c::n_new]
            em = _split(emitted, n_new, c)
            rows = mine[:batch_size] + [None] * max(0, batch_size - len(mine))
            cursor = {
                "version": CURSOR_VERSION,
                "fingerprint": fingerprint,
                "seed": seed,
                "consumer": c,
                "num_consumers": n_new,
                "next_step": resume_step + (worker - resume_step) % workers,
                "sources": {name: per_source[name][c] for name in names},
                "mixer": {
                    "emitted": em.tolist(),
                    "committed": (em + _split(in_flight, n_new, c)).tolist(),
                    "target": (target / n_new).tolist(),
                    "rng": np.random.PCG64([seed, c, 11, resume_step]).state,
                },
                "rows": rows,
            }
            if len(mine) > batch_size:
                cursor["pending"] = mine[batch_size:]
            row_of_rank.append(cursor)
        new.append(row_of_rank)
    return new


def redistribute_simulator_state(state: dict, manifest: Manifest, *, seed: int, world_size: int, num_workers: int,
                                 batch_size: int) -> dict:
    """An ``OrderSimulator.state_dict()`` re-cut for a simulator of another layout (same step)."""
    return {
        "step": state["step"],
        "world_size": world_size,
        "num_workers": max(1, num_workers),
        "consumers": redistribute(state["consumers"], manifest, seed=seed, world_size=world_size,
                                  num_workers=num_workers, batch_size=batch_size, resume_step=state["step"]),
    }
