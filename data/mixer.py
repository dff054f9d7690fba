"""Choosing the source of the next document, by *tokens* (a code file and a book differ 100x).

- ``deficit`` (default): every emitted token adds ``w_s(step)`` of a token to each source's target;
  the next document comes from the source furthest below its target. Deterministic, and the
  cumulative token error stays within about one document per source, so per-batch histograms are
  flat instead of multinomial (Megatron's blended datasets use the same argmax(w*n - c) rule on
  samples; i.i.d. draws drift like sqrt(n)).
- ``random``: the seed article's ``rng.choices``: draw a source per document with probability
  proportional to w_s / (mean tokens per document of s), so token shares match only in expectation.

Tokens count when they are *emitted* into a sequence, not when a document is chosen: with
row-parallel packing a long document is emitted over many steps, and counting it up front would make
the long-run shares drift.
"""

from __future__ import annotations

import numpy as np


class Mixer:
    def __init__(self, n_sources: int, selector: str, avg_doc_tokens: list[float], seed: tuple[int, int]):
        if selector not in ("deficit", "random"):
            raise ValueError(f"data.selector must be 'deficit' or 'random', got {selector!r}")
        self.selector = selector
        self.inv_len = 1.0 / np.asarray(avg_doc_tokens, dtype=np.float64)
        self.emitted = np.zeros(n_sources, dtype=np.int64)
        self.target = np.zeros(n_sources, dtype=np.float64)
        self.rng = np.random.Generator(np.random.PCG64([*seed, 11]))

    def choose(self, weights: np.ndarray) -> int:
        """Index of the source the next document comes from, given this step's weights."""
        if self.selector == "random":
            p = weights * self.inv_len
            return int(self.rng.choice(len(p), p=p / p.sum()))
        deficit = self.target - self.emitted
        deficit[weights <= 0] = -np.inf  # a source weighted 0 at this step is never chosen
        return int(np.argmax(deficit))

    def emit(self, source: int, n_tokens: int, weights: np.ndarray) -> None:
        """n_tokens of ``source`` entered a sequence at a step with these target weights."""
        self.emitted[source] += n_tokens
        self.target += weights * n_tokens

    def state_dict(self) -> dict:
        return {
            "emitted": self.emitted.tolist(),
            "target": self.target.tolist(),  # floats round-trip exactly through repr/JSON
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        self.emitted = np.asarray(state["emitted"], dtype=np.int64)
        self.target = np.asarray(state["target"], dtype=np.float64)
        self.rng.bit_generator.state = state["rng"]
