"""Faults inside a training run, with in-process runs of ``train fit`` (the CLI's main) on the tiny model:

- non-finite losses and gradients (train/module.py ``on_nonfinite``): a skipped step changes no weight, no
  checkpoint holds a non-finite weight, and the logs keep NaN as NaN (a module subclass injects the fault);
- a full disk (or no inodes left) while the run writes: one ``error:`` line naming the file, exit 2;
- a damaged data cursor file of one DDP rank: one ``error:`` line for the whole run (a subprocess on 2 ranks).
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import sys

import pytest
import torch
from training_runs import DDP, TINY, Run, copy_checkpoint

from train.module import PretrainModule

SHORT = ["--data.schedule.train_tokens", "500", "--data.num_workers", "0", "--run.ckpt_every_n_steps", "1"]


class Faulty(PretrainModule):
    """NaN at optimizer step ``AT``: the loss of its first micro-batch (``WHAT = "loss"``) or, the loss
    finite, the gradient of one weight (``"grad"``). Snapshots the weights around that step."""

    AT, WHAT = 1, "loss"
    seen: dict = {}

    def _token_losses(self, batch):
        losses = super()._token_losses(batch)
        if self.WHAT == "loss" and self.global_step == self.AT and not self._injected():
            return losses * float("nan")
        return losses

    def on_after_backward(self):
        if self.WHAT == "grad" and self.global_step == self.AT and not self._injected():
            self.model.tok_emb.weight.grad[0, 0] = float("nan")

    def _injected(self) -> bool:
        done = self.seen.get("injected", False)
        self.seen["injected"] = True
        return done

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == self.AT and "before" not in self.seen:
            self.seen["before"] = [p.detach().clone() for p in self.parameters()]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step == self.AT + 1 and "after" not in self.seen:
            self.seen["after"] = [p.detach().clone() for p in self.parameters()]


def _fit(workdir, run_dir, monkeypatch, capsys, what: str, *extra: str) -> tuple[int, str]:
    import train.cli

    Faulty.WHAT, Faulty.seen = what, {}
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


CASES = {
    "nan_loss": ("loss", []),
    "nan_grad_accumulated_clipped": ("grad", ["--data.batch_size", "2", "--trainer.accumulate_grad_batches", "2",
                                              "--trainer.gradient_clip_val", "1.0"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_skip_takes_no_optimizer_step_and_logs_nan_as_nan(workdir, tmp_path, monkeypatch, capsys, case):
    """Before: a NaN gradient at step 1 was applied (the loss was finite, only the loss was checked; under
    accumulation the skip flag of one micro-batch was reset by the next), the run ended rc 0 with an all-NaN
    last.ckpt, and the order log recorded the NaN loss as 0.0."""
    what, extra = CASES[case]
    run_dir = tmp_path / "run"
    rc, err = _fit(workdir, run_dir, monkeypatch, capsys, what, "--model.on_nonfinite", "skip", *extra)
    assert rc == 0, err[-3000:]
    before, after = Faulty.seen["before"], Faulty.seen["after"]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a skipped step changed the weights"
    assert _checkpoints_finite(run_dir) == []
    lines = [json.loads(ln) for ln in (run_dir / "order_log" / "rank0.jsonl").read_text().splitlines()]
    accumulate = 2 if extra else 1
    losses = [ln["loss"] for ln in lines if ln["step"] // accumulate == Faulty.AT]
    if what == "loss":
        assert math.isnan(losses[0]) and not any(math.isnan(x) for x in losses[1:]), losses
        from train.rundir import read_metrics, series

        assert [v for s, v in series(read_metrics(run_dir), "train/loss") if s == Faulty.AT][0] != 0.0
        assert math.isnan([v for s, v in series(read_metrics(run_dir), "train/loss") if s == Faulty.AT][0])
    else:
        assert not any(math.isnan(x) for x in losses)
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["skipped_steps"] == 1


@pytest.mark.slow
def test_a_nonfinite_gradient_stops_before_the_update_and_no_checkpoint_holds_nan(workdir, tmp_path, monkeypatch,
                                                                                  capsys):
    """Before: with a finite loss the NaN gradient was applied, a checkpoint with NaN weights was written, and
    the run stopped one step later on the NaN loss (so --ckpt_path last failed again)."""
    run_dir = tmp_path / "run"
    rc, err = _fit(workdir, run_dir, monkeypatch, capsys, "grad")
    assert rc == 3, err[-3000:]
    assert f"error: non-finite gradient at step {Faulty.AT} (the loss was finite)" in err
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


@pytest.mark.slow
def test_out_of_inodes_at_the_last_checkpoint_link_is_one_line_and_exit_2(workdir, tmp_path, monkeypatch, capsys):
    """Before: a raw OSError traceback from the hard link (and its copy fallback) of last.ckpt."""
    def no_inode(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "link", no_inode)
    monkeypatch.setattr(shutil, "copyfile", no_inode)
    run_dir = tmp_path / "run"
    rc, err = _fit(workdir, run_dir, monkeypatch, capsys, "none")
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and "Traceback" not in err, err[-3000:]
    assert errors == [f"error: could not write {run_dir / 'checkpoints' / 'last.ckpt'}: No space left on device "
                      f"(disk full or out of inodes?); {run_dir / 'checkpoints' / 'step0000001.ckpt'} holds the same "
                      f"state and is intact; free space (or inodes), then resume with --ckpt_path "
                      f"{run_dir / 'checkpoints' / 'step0000001.ckpt'}"], err[-3000:]


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
    assert "--ckpt_path FILE" in errors[0]
    assert "Traceback" not in out and "Connection closed" not in out, out[-3000:]
