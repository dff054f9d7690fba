"""Faults inside a training run, with in-process runs of ``train fit`` (the CLI's main) on the tiny model:

- non-finite losses and gradients (train/module.py ``on_nonfinite``): a skipped step changes no weight, no
  checkpoint holds a non-finite weight, and the logs keep NaN as NaN (a module subclass injects the fault);
- a full disk (or no inodes left) while the run writes: one ``error:`` line naming the file, exit 2;
- a damaged data cursor file of one DDP rank: one ``error:`` line for the whole run (a subprocess on 2 ranks);
- DDP ranks holding different weights at a checkpoint (one rank's weight nudged by a test-only callback,
  :class:`NudgeRank1`): one ``error:`` line naming the ranks, exit 3, no checkpoint written.
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import shutil
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from training_runs import DDP, TINY, Run, copy_checkpoint

from train.module import PretrainModule

SHORT = ["--data.schedule.train_tokens", "500", "--data.num_workers", "0", "--run.ckpt_every_n_steps", "1"]


class Faulty(PretrainModule):
    """NaN at the optimizer steps of ``FAULTS``: in the loss of the step's first micro-batch (``"loss"``), or,
    the loss finite, in the gradient of one weight (``"grad"``). Snapshots the weights at each step's start."""

    FAULTS: dict[int, str] = {}
    seen: dict = {}

    def _token_losses(self, batch):
        losses = super()._token_losses(batch)
        if self.FAULTS.get(self.global_step) == "loss" and self._first_time("loss"):
            return losses * float("nan")
        return losses

    def on_after_backward(self):
        if self.FAULTS.get(self.global_step) == "grad" and self._first_time("grad"):
            self.model.tok_emb.weight.grad[0, 0] = float("nan")

    def _first_time(self, what: str) -> bool:
        key = (what, self.global_step)
        first = key not in self.seen
        self.seen[key] = True
        return first

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.setdefault(self.global_step, [p.detach().clone() for p in self.parameters()])


def _fit(workdir, run_dir, monkeypatch, capsys, faults: dict[int, str], *extra: str) -> tuple[int, str]:
    import train.cli

    Faulty.FAULTS, Faulty.seen = faults, {}
    monkeypatch.setattr(train.cli, "PretrainModule", Faulty)
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    monkeypatch.chdir(workdir)
    rc = train.cli.main(["fit", *TINY, *SHORT, *extra, "--run.dir", str(run_dir)])
    return rc, capsys.readouterr().err


def _checkpoints_finite(run_dir) -> list[str]:
    bad = []
    for path in sorted((run_dir / "checkpoints").glob("*.ckpt")):
        state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
        if not all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()):
            bad.append(path.name)
    return bad


@pytest.mark.slow
def test_skip_takes_no_optimizer_step_and_logs_nan_as_nan(workdir, tmp_path, monkeypatch, capsys):
    """Accumulation 2 and gradient clipping; a NaN loss in step 1's first micro-batch, a NaN gradient (the
    loss finite) in step 2's. Before: the NaN gradient was applied (only the loss was checked, and under
    accumulation the next micro-batch reset the skip), the run ended rc 0 with an all-NaN last.ckpt, and
    the order log recorded the NaN loss as 0.0."""
    run_dir = tmp_path / "run"
    rc, err = _fit(workdir, run_dir, monkeypatch, capsys, {1: "loss", 2: "grad"}, "--model.on_nonfinite", "skip",
                   "--data.batch_size", "2", "--trainer.accumulate_grad_batches", "2",
                   "--trainer.gradient_clip_val", "1.0")
    assert rc == 0, err[-3000:]
    weights = Faulty.seen
    assert not all(torch.equal(a, b) for a, b in zip(weights[0], weights[1])), "step 0 trained"
    for step in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(weights[step], weights[step + 1])), f"skipped step {step} trained"
    assert _checkpoints_finite(run_dir) == []
    lines = [json.loads(ln) for ln in (run_dir / "order_log" / "rank0.jsonl").read_text().splitlines()]
    losses = [ln["loss"] for ln in lines]
    assert [math.isnan(x) for x in losses[:6]] == [False, False, True, False, False, False], losses
    from train.rundir import read_metrics, series

    assert math.isnan(dict(series(read_metrics(run_dir), "train/loss"))[1])
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["skipped_steps"] == 2


@pytest.mark.slow
def test_a_nonfinite_gradient_stops_before_the_update_and_no_checkpoint_holds_nan(workdir, tmp_path, monkeypatch,
                                                                                  capsys):
    """Before: with a finite loss the NaN gradient was applied, a checkpoint with NaN weights was written, and
    the run stopped one step later on the NaN loss (so --ckpt_path last failed again)."""
    run_dir = tmp_path / "run"
    rc, err = _fit(workdir, run_dir, monkeypatch, capsys, {1: "grad"})
    assert rc == 3, err[-3000:]
    assert "error: non-finite gradient at step 1 (the loss was finite)" in err
    assert "Traceback" not in err
    assert _checkpoints_finite(run_dir) == []


def test_a_checkpoint_of_nonfinite_weights_is_refused_before_it_is_written():
    from types import SimpleNamespace


    module = PretrainModule(model=str(TINY[TINY.index("--model.model") + 1]))
    module._trainer = SimpleNamespace(global_step=7, strategy=SimpleNamespace(reduce=lambda t, reduce_op: t))
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint == {"skipped_steps": 0}
    with torch.no_grad():
        next(module.parameters())[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"^the weights hold non-finite values at step 7: no checkpoint "
                                                 r"written \(the last one written stands\)"):
        module.on_save_checkpoint({})


def test_ranks_that_hold_different_weights_are_named_before_the_checkpoint_is_written(caplog):
    """Two ranks as one all-gather sees them (DDP replicas): equal sums pass and are logged; one bit of one
    tensor flipped on rank 1 stops the save with one line naming the ranks and the tensor."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy

    from train.module import WeightsDiffer

    class TwoRanks(DDPStrategy):  # no process group: reduce is the identity, all_gather stacks rank 1's sums
        def all_gather(self, tensor, group=None, sync_grads=False):
            return torch.stack([tensor, self.rank1(tensor.clone())])

    module = PretrainModule(model=str(TINY[TINY.index("--model.model") + 1]))
    strategy = TwoRanks()
    module._trainer = SimpleNamespace(global_step=6, global_rank=0, world_size=2, strategy=strategy)
    strategy.rank1 = lambda sums: sums
    with caplog.at_level("INFO", logger="train.module"):
        module.on_save_checkpoint({})
    assert "step 6: the weights of 2 ranks agree (checksum " in caplog.text

    def flip(sums):  # what one flipped low bit of a block weight on rank 1 does to its sums
        sums[3] += 1
        return sums

    strategy.rank1 = flip
    with pytest.raises(WeightsDiffer, match=r"^the ranks hold different weights at step 6 \(rank 0; rank 1: one set "
                                            r"each; the first tensor that differs: model.blocks.0.attn.wk.weight\): "
                                            r"no checkpoint written"):
        module.on_save_checkpoint({})


class NudgeRank1(L.Callback):
    """Test-only, given as ``--trainer.callbacks+ test_training_faults.NudgeRank1``: rank 1's first weight one
    ulp up after step 3, just before that step's checkpoint (checkpoint callbacks run last). DDP never
    re-syncs weights, so from there on the two replicas differ."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 3:
            with torch.no_grad():
                w = next(pl_module.parameters()).view(-1)
                w[0] = torch.nextafter(w[0], torch.tensor(1.0))


@pytest.mark.slow
def test_ranks_holding_different_weights_stop_the_run_at_the_checkpoint(workdir, env, tmp_path):
    """Before: nothing compared the ranks' weights; the run went on with two models and rank 0's was saved."""
    tests = Path(__file__).resolve().parents[1]
    env = {**env, "PYTHONPATH": os.pathsep.join([str(tests / "integration"), str(tests), env.get("PYTHONPATH", "")])}
    run_dir = tmp_path / "run"
    run = Run(workdir, run_dir, TINY + DDP + ["--trainer.max_steps", "5", "--trainer.callbacks+",
                                              "test_training_faults.NudgeRank1"], env, "nudged")
    rc = run.wait(timeout=300)
    out = run.log(tail=10**6)
    errors = {ln for ln in out.splitlines() if ln.startswith("error:")}
    assert rc == 3, out[-3000:]
    assert errors == {"error: the ranks hold different weights at step 3 (rank 0; rank 1: one set each; the first "
                      "tensor that differs: model.tok_emb.weight): no checkpoint written (the last one written "
                      "stands, and every rank loads it alike). Resume from it with --ckpt_path last"}, out[-3000:]
    assert not list((run_dir / "checkpoints").glob("*.ckpt")), "a checkpoint of two different models was written"


def _no_space(*a, **kw):
    raise OSError(errno.ENOSPC, "No space left on device")


def _full_while_saving_weights(monkeypatch):
    """torch.save of a checkpoint file fails as torch's zip writer reports a full disk (cursor files, which
    are serialised in memory first, are written)."""
    real_save = torch.save

    def save(obj, f, *a, **kw):
        if isinstance(f, io.BytesIO):
            return real_save(obj, f, *a, **kw)
        f.write(b"PK\x03\x04")
        raise RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(torch, "save", save)


def _no_inode_for_the_last_link(monkeypatch):
    monkeypatch.setattr(os, "link", _no_space)
    monkeypatch.setattr(shutil, "copyfile", _no_space)


def _no_inode_for_the_launch_config(monkeypatch):
    """Creating config-001.yaml needs an inode (before: a raw OSError traceback from train/loggers.py)."""
    from train import loggers

    monkeypatch.setattr(loggers, "open", _no_space, raising=False)


@pytest.mark.slow
@pytest.mark.parametrize("fault", [_full_while_saving_weights, _no_inode_for_the_last_link,
                                   _no_inode_for_the_launch_config])
def test_a_full_disk_while_training_is_one_line_and_exit_2(workdir, tmp_path, monkeypatch, capsys, fault):
    """Before: the "could not write checkpoint ... (disk full?)" line came last of three chained tracebacks,
    and no inode left for last.ckpt's hard link (and its copy fallback) was a raw OSError traceback."""
    fault(monkeypatch)
    run_dir = tmp_path / "run"
    rc, err = _fit(workdir, run_dir, monkeypatch, capsys, {})
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and "Traceback" not in err, err[-3000:]
    ckpts = run_dir / "checkpoints"
    if fault is _no_inode_for_the_last_link:
        want = (f"error: could not write {ckpts / 'last.ckpt'}: No space left on device (disk full or out of "
                f"inodes?); {ckpts / 'step0000001.ckpt'} holds the same state and is intact; free space (or inodes), "
                f"then resume with --ckpt_path {ckpts / 'step0000001.ckpt'}")
    elif fault is _no_inode_for_the_launch_config:
        want = (f"error: could not write {run_dir / 'config-001.yaml'}: No space left on device (disk full or out of "
                "inodes?); nothing was trained or changed in the run directory; free space (or inodes), then launch "
                "again")
    else:  # the run's first checkpoint: there is no previous one to resume (before: "the previous ... is intact")
        want = (f"error: could not write checkpoint {ckpts / 'step0000001.ckpt'}: [enforce fail at "
                "inline_container.cc:783] . PytorchStreamWriter failed writing file data/0: file write failed (disk "
                "full or out of inodes?); this was the run's first checkpoint, so there is none to resume; the "
                "partial file was removed; free space (or inodes), then start again with --ckpt_path last_or_new")
    assert errors == [want], err[-3000:]


@pytest.mark.slow
def test_a_damaged_cursor_file_of_rank_1_is_one_line_and_every_rank_exits(workdir, env, ref_ddp, tmp_path):
    """Before: rank 1 printed its error and exited, and rank 0 died in its next collective with a gloo
    "Connection closed by peer" traceback."""
    ref_dir, _ = ref_ddp
    ckpt = copy_checkpoint(ref_dir / "checkpoints" / "step0000009.ckpt", tmp_path / "run" / "checkpoints")
    cursor_dir = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)["WellMixedData"]["cursor_dir"]
    damaged = ckpt.parent / cursor_dir / "rank00001.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    run = Run(workdir, tmp_path / "run", TINY + DDP + ["--ckpt_path", str(ckpt)], env, "damaged")
    rc = run.wait(timeout=240)
    out = run.log(tail=10**6)
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert rc == 2, out[-3000:]
    assert len(errors) == 1 and f"data cursor file {damaged} (rank 1 of checkpoint {ckpt})" in errors[0], out[-3000:]
    assert errors[0].endswith("resume from an earlier checkpoint with --ckpt_path FILE (on several ranks "
                              "--run.ckpt_fallback checks only that the cursor files exist)")
    assert "Traceback" not in out and "Connection closed" not in out, out[-3000:]
