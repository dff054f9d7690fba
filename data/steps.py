"""The schedules as the data path sees them: per data step (micro-batch), picklable for workers."""

from __future__ import annotations

from typing import Callable

import numpy as np

from data.config import DataConfig
from data.schedules import build_schedule


class StepSchedule:
    """Mixture weights, sequence length and LR as functions of the data step (the micro-batch index).

    With gradient accumulation A, micro-batch m belongs to optimizer step m // A: the schedules are
    keyed on optimizer steps (units in names: a schedule step is an optimizer step). Picklable, so
    DataLoader workers get a copy.
    """

    def __init__(self, names: list[str], schedule=None, weights: dict[str, float] | None = None,
                 seq_len: int = 2048, accumulate: int = 1):
        self.names, self.schedule, self.accumulate = names, schedule, max(1, accumulate)
        self.fixed_weights = None if weights is None else np.array([weights[n] for n in names], dtype=np.float64)
        self.fixed_seq_len = seq_len

    @classmethod
    def from_config(cls, cfg: DataConfig, accumulate: int = 1, schedule=None) -> "StepSchedule":
        names = list(cfg.sources)
        if schedule is None and cfg.schedule is not None:
            schedule = build_schedule(cfg.schedule, sources=names)
        if schedule is not None:
            return cls(names, schedule=schedule, accumulate=accumulate)
        return cls(names, weights=cfg.weights, seq_len=cfg.seq_len, accumulate=accumulate)

    def weights(self, step: int) -> np.ndarray:
        if self.schedule is None:
            return self.fixed_weights
        ws = self.schedule.mixture_weights(step // self.accumulate)
        return np.array([ws[n] for n in self.names], dtype=np.float64)

    def seq_len(self, step: int) -> int:
        if self.schedule is None:
            return self.fixed_seq_len
        return self.schedule.max_seq_len(step // self.accumulate)

    @property
    def lr(self) -> Callable[[int], float] | None:
        if self.schedule is None:
            return None
        return lambda step: self.schedule.lr(step // self.accumulate)

    @property
    def total_steps(self) -> int | None:
        return None if self.schedule is None else self.schedule.total_steps * self.accumulate
