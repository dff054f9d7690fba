"""ThroughputCallback with a fake clock: the logged MFU is what the arithmetic says, at every step.

Issue 15: the callback passed cumulative FLOPs where Lightning's Throughput expects FLOPs since the
last update, so a steady 50% read 550% at step 20 (MFU grew with the step); and under gradient
accumulation it fed the unchanged ``global_step`` and crashed one micro-batch after the first step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from train.callbacks import ThroughputCallback

B, L, FLOPS_PER_TOKEN = 4, 8, 1.0e6


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeModel:
    def flops_per_token(self, seq_len: int) -> float:
        return FLOPS_PER_TOKEN


def make(world: int, accumulate: int, peak: float | None, log_every: int = 1, step: int = 0, tokens_per_step: int = 0):
    clock = Clock()
    logged: list[tuple[int, dict]] = []
    schedule = SimpleNamespace(tokens_at=lambda s: tokens_per_step)
    trainer = SimpleNamespace(world_size=world, global_step=step, accumulate_grad_batches=accumulate,
                              strategy=SimpleNamespace(root_device=torch.device("cpu")), precision="bf16-mixed",
                              datamodule=SimpleNamespace(context=lambda: SimpleNamespace(schedule=schedule)))
    module = SimpleNamespace(model=FakeModel())
    module.log_dict = lambda d, **kw: logged.append((trainer.global_step, dict(d)))
    cb = ThroughputCallback(peak, log_every_n_steps=log_every, clock=clock)
    cb.on_train_start(trainer, module)
    return cb, trainer, module, clock, logged


def train(cb, trainer, module, clock, steps: int, seconds_per_step: float = 1.0, first_step_extra: float = 0.0):
    """``steps`` optimizer steps of ``accumulate`` micro-batches; Lightning advances global_step at the
    optimizer step, before the last micro-batch's on_train_batch_end."""
    batch = {"input_ids": torch.zeros(B, L, dtype=torch.long)}
    for i in range(steps):
        for m in range(trainer.accumulate_grad_batches):
            clock.t += seconds_per_step / trainer.accumulate_grad_batches + (first_step_extra if i == m == 0 else 0)
            if m == trainer.accumulate_grad_batches - 1:
                trainer.global_step += 1
            cb.on_train_batch_end(trainer, module, {"loss": torch.tensor(1.0)}, batch, 0)


@pytest.mark.parametrize("world,accumulate", [(1, 1), (1, 4), (8, 2)])
def test_mfu_is_fifty_percent_where_the_arithmetic_says_so(world, accumulate):
    tokens_per_step = B * L * accumulate  # per rank
    flops_per_sec = tokens_per_step * FLOPS_PER_TOKEN  # one step per second
    cb, trainer, module, clock, logged = make(world, accumulate, peak=2 * flops_per_sec)
    train(cb, trainer, module, clock, 25, first_step_extra=100.0)  # compilation in the first step
    rates = [(s, m) for s, m in logged if "perf/mfu" in m]
    assert [s for s, _ in rates] == list(range(2, 26))  # step 1 is the baseline; no crash under accumulation
    for step, m in rates:
        assert m["perf/mfu"] == pytest.approx(0.5), step
        assert m["perf/tflops_per_sec"] == pytest.approx(flops_per_sec / 1e12)
        assert m["perf/tokens_per_sec"] == pytest.approx(tokens_per_step * world)
    assert logged[-1][1]["perf/tokens_seen"] == 25 * tokens_per_step * world


def test_intervals_longer_than_a_step_and_a_slower_interval():
    cb, trainer, module, clock, logged = make(1, 2, peak=2 * B * L * 2 * FLOPS_PER_TOKEN, log_every=5)
    train(cb, trainer, module, clock, 10)
    train(cb, trainer, module, clock, 5, seconds_per_step=2.0)  # half the speed: MFU halves, per interval
    mfu = {s: m["perf/mfu"] for s, m in logged if "perf/mfu" in m}
    assert mfu == pytest.approx({5: 0.5, 10: 0.5, 15: 0.25})


def test_resume_counts_tokens_before_and_starts_a_fresh_interval():
    cb, trainer, module, clock, logged = make(2, 2, peak=None, step=100, tokens_per_step=1000)
    train(cb, trainer, module, clock, 3)
    assert [s for s, _ in logged] == [101, 102, 103]
    assert "perf/tokens_per_sec" not in logged[0][1]  # the baseline: no interval spans the restart
    assert logged[-1][1]["perf/tokens_seen"] == 100 * 1000 + 3 * B * L * 2 * 2
    assert all("perf/mfu" not in m for _, m in logged)  # no known peak (CPU): no MFU, not a made-up one
    assert logged[-1][1]["perf/tokens_per_sec"] == pytest.approx(B * L * 2 * 2)
