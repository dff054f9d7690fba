"""Forker tasks on the optimizer seam (train/optim.py), each changing only YAML: Muon (for the 2-D hidden
matrices, AdamW for the rest) trains the tiny model, and a SIGKILL + ``--ckpt_path last`` resume ends with
the uninterrupted run's weights and optimizer state, bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from training_runs import TINY, Run, assert_same_order, order_log, run_to_end


def _equal(a, b, where: str = "") -> None:
    """Nested dicts/lists of tensors and plain values, equal bitwise (torch.equal) leaf by leaf."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.slow
def test_muon_trains_the_tiny_model_and_resumes_bitwise(workdir, env):
    muon = workdir / "muon.yaml"
    muon.write_text("model:\n  optim: {name: muon}\n  lr: {peak: 1.0e-2}\n")
    args = TINY + ["--config", str(muon)]
    ref_dir, run_dir = workdir / "muon_ref", workdir / "muon_killed"
    run_to_end(workdir, ref_dir, args, env, "muon_ref")
    ref = order_log(ref_dir)
    losses = [ln["loss"] for ln in ref[0]]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses  # it trains (16 steps, 3.2M parameters)

    run = Run(workdir, run_dir, args, env, "muon_killed")
    run.signal_when(lambda: run.lines_done() >= 8 and (run_dir / "checkpoints" / "step0000006.ckpt").exists())
    assert run.wait() == -9, run.log()
    run_to_end(workdir, run_dir, args + ["--ckpt_path", "last"], env, "muon_resumed")
    assert_same_order(ref, order_log(run_dir))

    def load(d: Path) -> dict:
        return torch.load(d / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)

    a, b = load(ref_dir), load(run_dir)
    assert a["global_step"] == b["global_step"] == len(ref[0])
    _equal(a["state_dict"], b["state_dict"], "state_dict")
    _equal(a["optimizer_states"], b["optimizer_states"], "optimizer_states")
    state = a["optimizer_states"][0]["state"].values()
    assert any("momentum_buffer" in s for s in state) and any("exp_avg" in s for s in state)  # both parts ran
    first = torch.load(ref_dir / "checkpoints" / "step0000003.ckpt", map_location="cpu", weights_only=True)
    w1 = next(k for k in a["state_dict"] if k.endswith("blocks.0.mlp.w1.weight"))  # a Muon matrix moved
    assert not torch.equal(first["state_dict"][w1], a["state_dict"][w1])


@pytest.mark.slow
def test_a_cosine_lr_from_yaml_trains_and_logs_the_pure_function(workdir, env):
    """``model.lr.shape: cosine`` in a YAML file, nothing else changed: the run trains to its end, and the LR
    it logs (metrics.csv ``train/lr``) and writes into the order log is LRConfig.build's value at every step
    (a cosine from the end of the warmup, not the default wsd's stable phase)."""
    import csv

    from data.schedules import LRConfig

    cosine = workdir / "cosine.yaml"
    cosine.write_text("model:\n  lr: {shape: cosine, peak: 1.0e-2, min: 1.0e-4, warmup_steps: 3}\n")
    run_dir = workdir / "cosine"
    run_to_end(workdir, run_dir, TINY + ["--config", str(cosine)], env, "cosine")
    lines = order_log(run_dir)[0]
    n = len(lines)
    anneal = next(ln["step"] for ln in lines if ln["weights"] != lines[0]["weights"])  # data.schedule's, unchanged
    lr = LRConfig(shape="cosine", peak=1e-2, min=1e-4, warmup_steps=3).build(n, anneal)
    assert lr.decay_start == 3 and [ln["lr"] for ln in lines] == [lr(s) for s in range(n)]
    with open(run_dir / "csv" / "metrics.csv") as f:
        logged = {int(r["step"]): float(r["train/lr"]) for r in csv.DictReader(f) if r.get("train/lr")}
    assert sorted(logged) == list(range(n))
    assert all(logged[s] == pytest.approx(lr(s), rel=1e-6) for s in range(n))
    assert lr(4) < 1e-2 and lines[-1]["lr"] == 1e-4  # decaying right after the warmup, to min
