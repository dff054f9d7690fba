"""The training loop on the demo corpus with the tiny model: logging, loss, checkpoints with cursors."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from training_runs import SMALL

ROOT = Path(__file__).resolve().parents[2]

TINY = ["--config", str(ROOT / "configs/demo.yaml"), *SMALL, "--data.order_log", "true",
        "--run.ckpt_every_n_steps", "5", "--data.num_workers", "2"]


def sources_args(corpus: Path) -> list[str]:
    sources = {s: {"paths": [str(corpus / s / "*.parquet")]} for s in ("web", "code", "books", "curated")}
    return ["--data.sources", json.dumps(sources)]


def run_train(run_dir: Path, corpus: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "train", "fit", *TINY, *sources_args(corpus), "--run.dir", str(run_dir), *extra]
    env = {**os.environ, "WELLMIXED_CACHE": str(run_dir.parent / "cache")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def read_csv(run_dir: Path) -> list[dict]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def read_log(run_dir: Path, rank: int = 0) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "order_log" / f"rank{rank}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_run(demo_corpus, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("train") / "run"
    run_train(run_dir, demo_corpus)
    return run_dir


@pytest.mark.slow
def test_run_reaches_the_budget_and_loss_falls(tiny_run):
    log = read_log(tiny_run)
    steps = [x["step"] for x in log]
    assert steps == list(range(len(steps))) and len(steps) > 30
    first = sum(x["loss"] for x in log[:3]) / 3
    last = sum(x["loss"] for x in log[-3:]) / 3
    assert last < first - 2.0, (first, last)  # from ~11.5 (uniform over 100k) well into the unigram range
    rows = read_csv(tiny_run)
    val = [(int(r["step"]), float(r["val/loss"])) for r in rows if r.get("val/loss")]
    assert val[0][0] == 0 and val[-1][1] < val[0][1] - 2.0  # held-out loss at the start, and it falls


@pytest.mark.slow
def test_logged_shares_equal_the_batch_tokens(tiny_run):
    """train/share/<source> is the batch's realised token share; train/target/<source> the step's weight."""
    log = {x["step"]: x for x in read_log(tiny_run)}
    rows = [r for r in read_csv(tiny_run) if r.get("train/loss")]
    assert len(rows) == len(log)
    for r in rows:
        line = log[int(r["step"])]
        total = sum(line["source_tokens"].values())
        for s, n in line["source_tokens"].items():
            assert float(r[f"train/share/{s}"]) == pytest.approx(n / total, abs=1e-6)
            assert float(r[f"train/target/{s}"]) == pytest.approx(line["weights"][s], abs=1e-6)
        assert float(r["train/seq_len"]) == line["seq_len"]
        assert float(r["train/lr"]) == pytest.approx(line["lr"], rel=1e-6)


@pytest.mark.slow
def test_schedule_reaches_the_anneal_and_lr_decays_to_min(tiny_run):
    log = read_log(tiny_run)
    assert log[0]["seq_len"] == 16 and log[-1]["seq_len"] == 32
    assert log[0]["weights"]["curated"] == pytest.approx(0.08) and log[-1]["weights"]["curated"] == pytest.approx(0.35)
    assert log[-1]["lr"] == 0.0


@pytest.mark.slow
def test_checkpoint_holds_every_worker_cursor(tiny_run):
    ckpt = torch.load(tiny_run / "checkpoints" / "last.ckpt", weights_only=True)  # plain types only
    state = ckpt["WellMixedData"]
    assert state["next_step"] == ckpt["global_step"]
    assert state["world_size"] == 1 and state["num_workers"] == 2
    cursors = state["cursors"][0]
    assert len(cursors) == 2
    # worker w produced steps w, w+2, ...: after the last trained step, their next steps are the
    # two steps following it -- the cursors are of trained batches, not of prefetched ones
    nexts = sorted(c["next_step"] for c in cursors)
    assert nexts == [ckpt["global_step"], ckpt["global_step"] + 1]
    assert len(json.dumps(state)) < 200_000


@pytest.mark.slow
def test_fresh_run_refuses_a_directory_with_checkpoints(tiny_run, demo_corpus):
    proc = run_train(tiny_run, demo_corpus, check=False)
    assert proc.returncode == 2 and "--ckpt_path last" in proc.stderr


@pytest.mark.slow
def test_bad_config_fails_before_compute(demo_corpus, tmp_path):
    proc = run_train(tmp_path / "run", demo_corpus, "--data.schedule.seq_len.end", "1024",
                     "--data.schedule.train_tokens", "400000", check=False)
    assert proc.returncode == 2 and "max_seq_len" in proc.stderr  # the tiny model's context is 128
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_per_source_loss_is_a_token_weighted_mean():
    from train.module import PretrainModule

    m = PretrainModule(model=str(ROOT / "configs/model/tiny.yaml"))
    m.source_names = ["a", "b", "c"]
    tok = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    src = torch.tensor([[0, 0, 1], [1, 1, 0]])
    sums, counts = m._per_source(tok, src)
    assert sums.tolist() == [1 + 2 + 6, 3 + 4 + 5, 0] and counts.tolist() == [3, 3, 0]


@pytest.mark.slow
def test_wandb_runs_offline_without_an_account(demo_corpus, tmp_path, monkeypatch):
    """No API key, no WANDB_MODE: the run must not prompt or hang, and leaves an offline run to sync."""
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "train", "fit", *TINY, *sources_args(demo_corpus), "--run.dir", str(run_dir),
           "--run.wandb", "true", "--trainer.max_steps", "2"]
    env = {**os.environ, "WELLMIXED_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path)}  # no ~/.netrc
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list((run_dir / "wandb").glob("offline-run-*")), "no offline wandb run written"


def test_wandb_keys_group_per_source_losses(monkeypatch):
    from lightning.pytorch.loggers import WandbLogger

    from train.callbacks import wandb_logger

    seen = {}
    monkeypatch.setattr(WandbLogger, "log_metrics", lambda self, m, step=None: seen.update(m))  # the parent's sink
    wandb_logger(offline=True, save_dir="/tmp").log_metrics(
        {"train/loss": 1.0, "train/loss/web": 2.0, "val/loss/code": 3.0, "train/lr": 0.1})
    assert seen == {"train/loss": 1.0, "train_loss_by_source/web": 2.0, "val_loss_by_source/code": 3.0, "train/lr": 0.1}
