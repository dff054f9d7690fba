"""The global order, simulated: R ranks x W workers in one process, no model.

This is what ``scripts/dump_order.py`` runs, and what the tests use to check the properties of the
order (determinism, disjoint slices, coverage, exact cursor). A training run produces the same
lines from its real DataLoader workers (``data.order_log: true``).

Order-dump line, one per (step, rank), ranks in order within a step::

    {"step": s, "rank": r, "seq_len": L, "pieces": [[doc_id, first_token_offset, n_tokens], ...],
     "source_tokens": {"web": n, ...}, "weights": {"web": w, ...}, "lr": x}

``pieces`` are the document pieces of the rank's micro-batch, row after row, covering the input
tokens; a document's tokens are its cl100k tokens followed by one EOT.
"""

from __future__ import annotations

import json
from typing import Callable, Iterator

import numpy as np

from data.config import DataConfig
from data.cursor import read_order_state
from data.elastic import reseed
from data.errors import ConfigError
from data.manifest import Manifest
from data.packer import ConsumerStream
from data.schedules import LRConfig
from data.steps import StepSchedule
from data.types import TrainBatch


class OrderSimulator:
    """All consumers of a job, stepping in lock-step the way the DataLoaders would deliver."""

    def __init__(self, manifest: Manifest, cfg: DataConfig, world_size: int, num_workers: int, schedule=None,
                 lr: LRConfig = LRConfig(warmup_steps=0)):  # noqa: B008 -- frozen
        """``lr``: the run's ``model.lr``, for each line's ``lr`` (the default: no warmup, which fits any schedule)."""
        if world_size < 1 or num_workers < 0:
            raise ConfigError(f"--world-size must be >= 1 and --num-workers >= 0 (got {world_size}, {num_workers})")
        self.manifest, self.cfg = manifest, cfg
        self.world_size, self.workers = world_size, max(1, num_workers)
        self.steps = StepSchedule.from_config(cfg, schedule=schedule)
        self.lr_at = lr.build(self.steps.total_steps, self.steps.by_optimizer_step.anneal_step)
        fp = manifest.fingerprint()
        self.consumers = [
            [ConsumerStream(manifest, cfg, r, world_size, w, self.workers, self.steps.weights, self.steps.seq_len, fp)
             for w in range(self.workers)]
            for r in range(world_size)
        ]
        self.step = 0

    def batches(self, steps: int) -> Iterator[tuple[int, int, TrainBatch[np.ndarray]]]:
        """(step, rank, batch) for steps [self.step, steps), ranks in order within a step."""
        while self.step < steps:
            for rank in range(self.world_size):
                batch = self.consumers[rank][self.step % self.workers].next_batch()
                assert batch["step"] == self.step, (batch["step"], self.step)
                yield self.step, rank, batch
            self.step += 1

    def order_lines(self, steps: int) -> Iterator[dict]:
        names = self.manifest.source_names
        for step, rank, batch in self.batches(steps):
            yield order_line(batch, names, self.lr_at)

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "world_size": self.world_size,
            "num_workers": self.workers,
            "replicate": self.cfg.replicate,
            "consumers": [[c.state_dict() for c in rank] for rank in self.consumers],
        }

    def load_state_dict(self, state: dict) -> None:
        cursors = read_order_state(state)  # every integer in range, the step the consumers agree on: named errors
        if (state["world_size"], state["num_workers"]) != (self.world_size, self.workers):
            raise ConfigError(
                f"cursor was saved with --world-size {state['world_size']} --num-workers {state['num_workers']}; "
                f"resume with the same values (got {self.world_size}, {self.workers})"
            )
        fp = cursors[0][0].fingerprint
        if fp != self.manifest.fingerprint():
            raise ConfigError(
                f"cursor was saved for another corpus/config (fingerprint {fp}, now {self.manifest.fingerprint()}); "
                "resume with the same corpus, filters and chunking"
            )
        for rank, row in zip(self.consumers, cursors):
            for consumer, cursor in zip(rank, row):
                if cursor.seed != self.cfg.seed:
                    raise ConfigError(
                        f"cursor was saved with seed {cursor.seed}, not {self.cfg.seed}; use --seed {cursor.seed}"
                    )
                consumer.restore(reseed(cursor, self.cfg.replicate, state["step"])
                                 if self.cfg.replicate not in (0, state.get("replicate", 0)) else cursor)
        self.step = state["step"]


def order_line(batch: TrainBatch, source_names: list[str], lr_at: Callable[[int], float]) -> dict:
    step = batch["step"]
    return {
        "step": step,
        "rank": batch["rank"],
        "seq_len": int(batch["input_ids"].shape[1]),
        "pieces": batch["pieces"],
        "source_tokens": {n: int(t) for n, t in zip(source_names, batch["source_tokens"])},
        "weights": {n: round(float(w), 6) for n, w in zip(source_names, batch["weights"])},
        "lr": float(lr_at(step)),
    }


def dumps(line: dict) -> str:
    return json.dumps(line, separators=(",", ":"))
