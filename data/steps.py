"""The schedules as the data path sees them: per data step (micro-batch), picklable for workers."""

from __future__ import annotations

import numpy as np

from data.config import DataConfig
from data.schedules import Schedule, build_schedule


class StepSchedule:
    """Mixture weights and sequence length as functions of the data step (the micro-batch index).

    With gradient accumulation A, micro-batch m belongs to optimizer step m // A: the schedules are
    keyed on optimizer steps (units in names: a schedule step is an optimizer step), and the built
    schedule is held as :attr:`by_optimizer_step`. Picklable, so DataLoader workers get a copy.
    """

    def __init__(self, names: list[str], schedule: Schedule, accumulate: int = 1):
        self.names, self.by_optimizer_step, self.accumulate = names, schedule, max(1, accumulate)

    @classmethod
    def from_config(cls, cfg: DataConfig, accumulate: int = 1, schedule: Schedule | None = None) -> "StepSchedule":
        """``schedule``: an already built ``cfg.schedule`` (built here when not given)."""
        names = list(cfg.sources)
        if schedule is None:
            schedule = build_schedule(cfg.schedule, sources=names)
        return cls(names, schedule=schedule, accumulate=accumulate)

    def weights(self, step: int) -> np.ndarray:
        ws = self.by_optimizer_step.mixture_weights(step // self.accumulate)
        return np.array([ws[n] for n in self.names], dtype=np.float64)

    def seq_len(self, step: int) -> int:
        return self.by_optimizer_step.max_seq_len(step // self.accumulate)

    @property
    def total_steps(self) -> int:
        return self.by_optimizer_step.total_steps * self.accumulate
