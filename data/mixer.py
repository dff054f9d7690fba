"""Choosing the source of the next document, by *tokens* (a code file and a book differ 100x).

- ``deficit`` (default): every emitted token adds ``w_s(step)`` of a token to each source's target;
  the next document comes from the source whose *committed* tokens (emitted + still in flight in
  the batch rows) are furthest below its target, relative to its weight. Deterministic, and the
  cumulative token error stays within about one document per source, so per-batch histograms are
  flat instead of multinomial (Megatron's blended datasets use the same argmax(w*n - c) rule on
  samples; i.i.d. draws drift like sqrt(n)).
- ``random``: the seed article's ``rng.choices``: draw a source per document with probability
  proportional to w_s / (mean tokens per document of s), so token shares match only in expectation.

What a choice commits is bounded (``data.commit: sequence``, the default; :class:`MixingPolicy`): a
row takes at most one sequence of a document per choice, then the document is handed back to its
source's queue, which offers it (pieces in order) the next time the source is chosen, so a 200k-token
book no longer pins a batch row for hundreds of steps and the long-run shares follow the target
whatever the document lengths.
``data.commit: document`` keeps the older rule (a row continues its document to the end) for
comparison (tests/unit/test_long_docs.py).

Targets grow when tokens are *emitted* into a sequence, not when a document is chosen: with
row-parallel packing a long document is emitted over many steps. But the choice must see the tokens
already in flight, or every row that needs a document while a source is behind picks that source,
and B long documents overshoot it together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from data.cursor import MixerCursor
from data.order import RNG_MIXER
from data.types import Leftover

if TYPE_CHECKING:
    from data.stream import SourceStream


class Mixer:
    def __init__(self, n_sources: int, selector: str, avg_doc_tokens: list[float], seed: tuple[int, int]):
        if selector not in ("deficit", "random"):
            raise ValueError(f"data.selector must be 'deficit' or 'random', got {selector!r}")
        self.selector = selector
        self.inv_len = 1.0 / np.asarray(avg_doc_tokens, dtype=np.float64)
        self.emitted = np.zeros(n_sources, dtype=np.int64)
        self.committed = np.zeros(n_sources, dtype=np.int64)  # emitted + chosen but not yet emitted
        self.target = np.zeros(n_sources, dtype=np.float64)
        self.rng = np.random.Generator(np.random.PCG64([*seed, RNG_MIXER]))

    def choose(self, weights: np.ndarray, skip: set[int] | None = None) -> int | None:
        """Index of the source the next document comes from, given this step's weights; sources in
        ``skip`` (nothing left to give this row) are passed over, and None comes back when all are."""
        if skip:
            weights = weights.copy()
            weights[list(skip)] = 0.0
            if not (weights > 0).any():
                return None
        if self.selector == "random":
            p = weights * self.inv_len
            return int(self.rng.choice(len(p), p=p / p.sum()))
        # Project the target over the tokens already in flight (they will be emitted at about this
        # step's weights); in steady state this is argmax(w_s * committed_total - committed_s).
        in_flight = self.committed.sum() - self.emitted.sum()
        deficit = self.target + weights * in_flight - self.committed
        # Measured in units of the source's own weight ("how many tokens of the whole mix behind"),
        # this is stride scheduling: sources interleave in proportion instead of a 62% source
        # having to fall a whole curated document behind before curated gets a turn.
        active = weights > 0  # a source weighted 0 at this step is never chosen
        lag = np.full(len(weights), -np.inf)
        lag[active] = deficit[active] / weights[active]
        return int(np.argmax(lag))

    def commit(self, source: int, n_tokens: int) -> None:
        """n_tokens of ``source`` were chosen and will be emitted: a whole document (EOT included) with
        ``data.commit: document``, the piece placed in a row with ``data.commit: sequence``."""
        self.committed[source] += n_tokens

    def emit(self, source: int, n_tokens: int, weights: np.ndarray) -> None:
        """n_tokens of ``source`` entered a sequence at a step with these target weights."""
        self.emitted[source] += n_tokens
        self.target += weights * n_tokens

    def cursor(self) -> MixerCursor:
        return MixerCursor(tuple(self.emitted.tolist()), tuple(self.committed.tolist()), tuple(self.target.tolist()),
                           self.rng.bit_generator.state)

    def restore(self, cursor: MixerCursor) -> None:
        self.emitted = np.asarray(cursor.emitted, dtype=np.int64)
        self.committed = np.asarray(cursor.committed, dtype=np.int64)
        self.target = np.asarray(cursor.target, dtype=np.float64)
        self.rng.bit_generator.state = cursor.rng


class MixingPolicy:
    """What a batch row continues with when its document ends: the choice of source (the
    :class:`Mixer`), bounded commitment, and the leftovers an elastic resume left pending.

    Per micro-batch the packer (data/packer.py) calls :meth:`begin`, then :meth:`next_piece` whenever a
    row needs a document and :meth:`placed` for every piece it emits, then :meth:`end`.
    """

    def __init__(self, sources: list[SourceStream], mixer: Mixer, bounded: bool):
        self.sources, self.mixer, self.bounded = sources, mixer, bounded
        self.pending: list[Leftover] = []  # leftovers an elastic resume could not fit into the rows
        self.continuations: list[Leftover] = []  # (bounded commitment) documents under way, oldest first
        self.in_batch: set[tuple[int, int, int]] = set()  # (source, shard, row) of the batch being packed

    def begin(self, rows: list[Leftover | None]) -> list[Leftover | None]:
        """A new micro-batch over these rows: the rows it starts from (bounded commitment hands every
        row's document back first), and the documents already in it noted."""
        rows = self._release(rows)
        self.in_batch = {(r.doc.source, r.doc.shard, r.doc.row) for r in rows + self.continuations if r}
        return rows

    def end(self, rows: list[Leftover | None]) -> list[Leftover | None]:
        """The micro-batch is packed: the rows carried into the next one."""
        return self._release(rows)

    def _release(self, rows: list[Leftover | None]) -> list[Leftover | None]:
        """Bounded commitment: the documents the rows are in the middle of go back to their sources'
        queue (row order), so no row holds a document across a step without a new choice."""
        if not self.bounded:
            return rows
        self.continuations += [r for r in rows if r is not None] + self.pending
        self.pending = []
        return [None] * len(rows)

    def next_piece(self, weights: np.ndarray) -> Leftover:
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

    def placed(self, source: int, n_tokens: int, weights: np.ndarray) -> None:
        """n_tokens of ``source`` entered a sequence at a step with these target weights (bounded
        commitment commits them as they are placed, not when the document is chosen)."""
        if self.bounded:
            self.mixer.commit(source, n_tokens)
        self.mixer.emit(source, n_tokens, weights)
