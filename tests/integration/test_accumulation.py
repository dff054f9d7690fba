"""Gradient accumulation as a first-class case: training, per-source logs, the order log, exact and
elastic resume -- with real processes (tests/training_runs.py), the tiny model and a few steps.

Accumulation is how a 1-GPU user reaches the real run's global batch (configs/presets/1gpu.yaml: 16
x 16). Before issue 15 no test used it, and a run crashed one micro-batch after the first optimizer
step (the throughput callback fed Lightning's Throughput the unchanged ``global_step``).
"""

from __future__ import annotations

import csv
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
from training_runs import TINY, Run, assert_same_order, copy_checkpoint, global_step_of, order_log, run_to_end

ACC2 = TINY + ["--data.batch_size", "2", "--trainer.accumulate_grad_batches", "2"]  # 2 x 1 rank x 2 = 4
CKPT_EVERY = 3  # TINY's run.ckpt_every_n_steps, in optimizer steps


def metrics_by_step(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> the last non-empty value of each metric logged at that step (metrics.csv)."""
    out: dict[int, dict[str, float]] = defaultdict(dict)
    with open(run_dir / "csv" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            out[int(row["step"])].update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return out


@pytest.fixture(scope="module")
def ref_acc2(workdir, env):
    """The uninterrupted run at micro-batch 2 x accumulation 2."""
    run_dir = workdir / "ref_acc2"
    run_to_end(workdir, run_dir, ACC2, env, "ref_acc2")
    return run_dir, order_log(run_dir)


@pytest.mark.slow
def test_accumulation_trains_and_logs_whole_steps(ref_acc2):
    """One order-log line per micro-batch (data step), two per optimizer step with that step's LR; the
    logged train/loss is the mean over the step's two micro-batches (not the last one alone), per-source
    losses and throughput are logged."""
    run_dir, ref = ref_acc2
    lines = ref[0]
    n_steps = global_step_of(run_dir / "checkpoints" / "last.ckpt")
    assert [ln["step"] for ln in lines] == list(range(2 * n_steps))
    assert all(len(ln["pieces"]) >= 2 for ln in lines)  # 2 rows per micro-batch
    metrics = metrics_by_step(run_dir)
    for s in range(1, n_steps):
        a, b = lines[2 * s], lines[2 * s + 1]
        assert a["lr"] == b["lr"] and a["seq_len"] == b["seq_len"]
        logged = metrics[s]
        assert logged["train/lr"] == pytest.approx(a["lr"], rel=1e-6, abs=1e-9)
        # equal tokens per micro-batch: the step's loss is the mean of its two lines
        assert logged["train/loss"] == pytest.approx((a["loss"] + b["loss"]) / 2, rel=1e-5)
        assert any(k.startswith("train/loss/") for k in logged)
        tokens = sum(a["source_tokens"].values()) + sum(b["source_tokens"].values())
        for name in a["source_tokens"]:
            share = (a["source_tokens"][name] + b["source_tokens"][name]) / tokens
            assert logged[f"train/share/{name}"] == pytest.approx(share, abs=1e-6)
        if s >= 2:  # the first completed step after start is the throughput baseline
            assert logged["perf/tokens_per_sec"] > 0 and logged["perf/tflops_per_sec"] > 0
        assert "perf/mfu" not in logged  # no known peak on CPU
    lrs = [ln["lr"] for ln in lines]
    assert lrs[-1] < lrs[len(lrs) // 2]  # the decay played out over optimizer steps, not micro-batches


@pytest.mark.slow
def test_sigkill_and_exact_resume_with_accumulation(workdir, env, ref_acc2, kill_rng):
    """SIGKILL a few micro-batches past a checkpoint (mid optimizer step, sometimes), resume: the order
    log equals the uninterrupted run's line for line, bitwise losses included."""
    _, ref = ref_acc2
    seed, rng = kill_rng
    ckpt = 2 * CKPT_EVERY  # optimizer step 6 = data step 12
    kill_at = 2 * ckpt + rng.randint(1, 3)
    run_dir = workdir / "killed_acc2"
    run = Run(workdir, run_dir, ACC2, env, "killed")
    run.signal_when(lambda: run.lines_done() >= kill_at and (run_dir / "checkpoints" / f"step{ckpt:07d}.ckpt").exists())
    assert run.wait() == -9, run.log()
    done, resumed_from = run.lines_done(), global_step_of(run_dir / "checkpoints" / "last.ckpt")
    assert 2 * resumed_from < done, (seed, done, resumed_from)  # stale lines to drop
    run_to_end(workdir, run_dir, ACC2 + ["--ckpt_path", "last"], env, "resumed")
    assert_same_order(ref, order_log(run_dir))


@pytest.mark.slow
def test_elastic_resume_4x1_to_2x2_drops_stale_lines_in_the_checkpoints_units(workdir, env, ref_single):
    """A checkpoint of micro-batch 4 x accumulation 1 at step 9 resumed as 2 x 2 (same global batch),
    with the old run's complete order log beside it (as after a kill late in the run). The log keeps the
    old lines 0..8 only -- stale-line dropping uses the checkpoint's units (9 x 1), not 9 x the new
    accumulation, which kept lines 9..17 -- then continues at data step 18 with the schedules of the
    uninterrupted run at the same optimizer step, every document continuing where it stopped."""
    ref_dir, ref = ref_single
    at = 9
    run_dir = workdir / "elastic_acc"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(ref_dir / "order_log", run_dir / "order_log")
    ckpt = run_dir / "checkpoints" / f"step{at:07d}.ckpt"
    copy_checkpoint(ref_dir / "checkpoints" / ckpt.name, ckpt.parent)
    run = run_to_end(workdir, run_dir, ACC2 + ["--ckpt_path", str(ckpt)], env, "elastic")
    assert "elastic resume at step 9" in run.log(tail=10**6)
    lines = order_log(run_dir)[0]
    assert lines[:at] == ref[0][:at]
    after = lines[at:]
    n = len(ref[0])
    assert [ln["step"] for ln in after] == list(range(2 * at, 2 * n))
    for ln in after:
        want = ref[0][ln["step"] // 2]
        assert (ln["seq_len"], ln["weights"], ln["lr"]) == (want["seq_len"], want["weights"], want["lr"])
    at_offset: dict[str, int] = {}
    for ln in lines:  # no token skipped or repeated across the layout change
        for doc, off, k in ln["pieces"]:
            assert off == at_offset.get(doc, 0), (ln["step"], doc, off, at_offset.get(doc, 0))
            at_offset[doc] = off + k
