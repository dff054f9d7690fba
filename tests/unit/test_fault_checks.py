"""Fault checks that need no training run: the run-dir lock, checkpoint resolution, config messages."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from scripts_in_process import load_script

from data.cursor import buffer_addrs
from data.errors import ConfigError
from train.checkpoint import resolve_checkpoint
from train.checkpoint_io import AtomicCheckpointIO
from train.rundir_lock import LOCK_NAME, acquire_run_dir, release_run_dir

ROOT = Path(__file__).resolve().parents[2]

HOLDER = """
import sys, time
from train.rundir_lock import acquire_run_dir
acquire_run_dir(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


# -- one run per run dir -------------------------------------------------------------------------------


def test_second_run_in_a_held_run_dir_is_refused_and_a_dead_holder_keeps_nothing(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True,
                              env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError) as info:
            acquire_run_dir(run_dir)
        msg = str(info.value)
        assert msg.startswith(f"run.dir: {run_dir} is in use by another run (pid {holder.pid} on ")
        assert msg.endswith("Wait for that run to end (or stop it), or choose another --run.dir")
    finally:
        holder.send_signal(signal.SIGKILL)  # the OOM killer's way: no clean-up code runs
        holder.wait()
    try:
        assert acquire_run_dir(run_dir) == run_dir / LOCK_NAME  # the kernel released the dead holder's lock
        assert f"pid {os.getpid()} " in (run_dir / LOCK_NAME).read_text()
    finally:
        release_run_dir(run_dir)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_run_dir_is_a_named_error(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match=rf"^run.dir: cannot write {parent / 'run'} \(Permission denied\); "
                                              "make it writable"):
            acquire_run_dir(parent / "run")
    finally:
        parent.chmod(0o755)


def test_run_dir_that_cannot_be_created_is_a_named_error(tmp_path):
    """Also as root (where permissions do not stop a write): a regular file where a folder should be."""
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=rf"^run.dir: cannot write {tmp_path / 'file' / 'run'} \(Not a directory\)"):
        acquire_run_dir(tmp_path / "file" / "run")


# -- which checkpoint a resume starts from ---------------------------------------------------------------


def _save(path: Path, step: int, mtime: float) -> None:
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(2) * step}, "global_step": step}, path)
    os.utime(path, (mtime, mtime))


def test_last_without_last_ckpt_resumes_from_the_newest_loadable_step_file(tmp_path, caplog):
    """A kill between a step file's rename and its last.ckpt link (or a deleted last.ckpt): resume from
    the newest step file that loads, by step number (not mtime), never from step 0."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    now = time.time()
    _save(ckpts / "step0000003.ckpt", 3, now)
    _save(ckpts / "step0000006.ckpt", 6, now - 100)  # an older mtime (a copy, a restore): the step decides
    _save(ckpts / "step0000009.ckpt", 9, now)
    (ckpts / "step0000009.ckpt").write_bytes(b"half")  # the newest one is damaged
    with caplog.at_level("WARNING"):
        assert resolve_checkpoint("last", ckpts, fallback=False) == str(ckpts / "step0000006.ckpt")
    assert "no last.ckpt" in caplog.text and "step0000006.ckpt" in caplog.text and "step0000009.ckpt" in caplog.text

    for p in ckpts.glob("step*.ckpt"):
        p.write_bytes(b"junk")
    with pytest.raises(ConfigError, match=r"--ckpt_path last: .* holds checkpoint files but none loads"):
        resolve_checkpoint("last", ckpts, fallback=False)


# -- config errors of `train fit`: one line each, all at once, exit 2 ----------------------------------------

PHASES = ("[{name: stable, weights: {web: 0.6, code: 0.18, books: 0.12, curated: 0.08}}, {name: anneal, start: anneal, "
          "weights: {web: -0.35, code: 0.20, books: 0.10, curated: 0.35, math: 0.7}}]")
CONFIG_ERRORS = [
    (["--data.schedule.anneal_start", "1.5", "--data.schedule.seq_len.start", "512",
      "--data.schedule.mixture.phases", PHASES], [
        "error: data.schedule.seq_len.start: 512 is above schedule.seq_len.end (256); the warmup goes from start "
        "up to end",
        "error: data.schedule.anneal_start: 1.5 must be in (0, 1]: the fraction of the run where the anneal (and "
        "by default the LR decay) starts (e.g. 0.9; 1 = none)",
        "error: data.schedule.mixture.phases[0].weights: weights sum to 0.98, must sum to 1 (±1e-06); rescale them",
        "error: data.schedule.mixture.phases[1].weights.web: weight -0.35 is negative; weights are token shares "
        "(0 leaves a source out)",
        "error: data.schedule.mixture.phases[1].weights: names sources ['books', 'code', 'curated', 'math', 'web'], "
        "but schedule.mixture.phases[0] names ['books', 'code', 'curated', 'web']; every phase must name the same "
        "sources (0 is allowed)",
    ]),
    (["--data.schedule.anneal_start", "0"], [
        "error: data.schedule.anneal_start: 0.0 must be in (0, 1]: the fraction of the run where the anneal (and "
        "by default the LR decay) starts (e.g. 0.9; 1 = none)"]),
    (["--data.schedule.anneal_start", "1"], [
        "error: data.schedule.mixture.phases[1].start: 'anneal' needs schedule.anneal_start < 1 (got 1.0)"]),
    (["--data.schedule.train_tokens", "100"], [
        "error: data.schedule.train_tokens: 100 tokens is below one batch (schedule.global_batch_size x "
        "seq_len.start = 512); raise the budget"]),
    (["--data.schedule.train_tokens", "3000", "--data.schedule.seq_len.warmup_steps", "0",
      "--model.lr.warmup_steps", "0", "--model.lr.decay_start", "0.6", "--data.schedule.mixture.weights",
      "{web: 0.62, code: 0.18, books: 0.12, curated: 0.08}", "--data.schedule.mixture.phases", "[]"], [
        "error: model.lr.decay_start: the LR decay from step 2 is under 2 of the 3 steps of "
        "data.schedule.train_tokens; raise the budget or start the decay earlier"]),
    (["--model.lr.warmup_steps", "400"], [
        "error: model.lr.warmup_steps: 400 is not below the 308 total steps of data.schedule.train_tokens"]),
    (["--model.lr.shape", "step", "--model.lr.decay_start", "1.5"], [
        "error: model.lr.shape: 'step' is not one of wsd, cosine, linear",
        "error: model.lr.decay_start: 1.5 must be a fraction of the run in [0, 1]"]),
    (["--data.schedule.mixture.phases",
      "[{name: stable, weights: {web: 0.62, code: 0.18, books: 0.12, math: 0.08}}, "
      "{name: anneal, start: anneal, weights: {web: 0.35, code: 0.20, books: 0.10, math: 0.35}}]"], [
        "error: data.schedule.mixture.phases[*].weights: source 'math' is not in the corpus (it has "
        "['books', 'code', 'curated', 'web'])"]),
]


@pytest.mark.parametrize(("args", "want"), CONFIG_ERRORS, ids=[str(i) for i in range(len(CONFIG_ERRORS))])
def test_train_fit_config_errors_are_named_lines_not_a_traceback(args, want, tmp_path, capsys, monkeypatch):
    """Before: an 82-line jsonargparse traceback ending in "Does not validate against any of the Union
    subtypes" (ScheduleConfig validated itself while jsonargparse type-checked it), one error a run."""
    from train.cli import main

    monkeypatch.setattr(sys, "argv", sys.argv[:1])  # LightningCLI warns when both args and sys.argv are given
    rc = main(["fit", "--config", str(ROOT / "configs" / "demo.yaml"), "--run.wandb", "false",
               "--run.dir", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == want, err
    assert "Traceback" not in err and "Union" not in err
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_schedule_changes_name_every_changed_key_and_the_override_lets_them_pass(caplog):
    from data.schedules import ScheduleConfig, fixed_schedule
    from train.resume import check_schedule_unchanged, schedule_changes, schedule_fingerprint

    d = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())["data"]["schedule"]
    old = schedule_fingerprint(ScheduleConfig.from_dict(d))
    d["train_tokens"], d["mixture"]["phases"][1]["weights"]["web"] = 600_000, 0.3
    new = schedule_fingerprint(ScheduleConfig.from_dict(d))
    want = ["data.schedule.mixture.phases[1].weights.web: 0.35 -> 0.3", "data.schedule.train_tokens: 300000 -> 600000"]
    assert schedule_changes(old, new) == want
    assert schedule_changes(None, new) == [] and schedule_changes(new, new) == []  # an older checkpoint: no check
    fixed = [schedule_fingerprint(fixed_schedule(w, 128)) for w in ({"web": 1.0}, {"web": 0.5, "code": 0.5})]
    assert schedule_changes(*fixed) == ["data.schedule.mixture.weights.code: None -> 0.5",
                                        "data.schedule.mixture.weights.web: 1.0 -> 0.5"]
    with pytest.raises(ConfigError, match=r"^--ckpt_path: the checkpoint \(step 7\) was trained with another "
                                          r"schedule: data.schedule.mixture.*--run.allow_changed_schedule true"):
        check_schedule_unchanged(old, new, allow=False, step=7)
    with caplog.at_level("WARNING"):
        check_schedule_unchanged(old, new, allow=True, step=7)
    assert "changed schedule (run.allow_changed_schedule): " + "; ".join(want) in caplog.text


def test_error_lines_prefix_each_problem_and_keep_continuations():
    from data.errors import error_lines

    got = error_lines(ConfigError("a: x; fix\nb: y; fix\n  detail of b"))
    assert got == "error: a: x; fix\nerror: b: y; fix\n  detail of b"


# -- checkpoint checksums ------------------------------------------------------------------------------


def _flip_tensor_byte(path: Path, marker: bytes) -> None:
    """Flip one bit inside a tensor's bytes (a zip member's data): the index and the pickle stay intact."""
    data = bytearray(path.read_bytes())
    at = data.index(marker) + 5
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_bit_flip_inside_a_tensor_is_corrupt_like_a_truncated_file(tmp_path):
    """Before: torch's zip reader keeps no checksum, so a flipped bit inside a tensor (a corrupt zip member
    of last.ckpt) passed the pre-check and loaded silently (or failed inside Lightning's load)."""
    import hashlib

    from train.checkpoint import checksum_path
    from train.checkpoint_io import link_checkpoint

    ckpts = tmp_path / "checkpoints"
    io = AtomicCheckpointIO()
    marker = bytes(range(7, 247))  # recognisable tensor bytes
    for step in (3, 6):
        w = torch.frombuffer(bytearray(marker * 64), dtype=torch.uint8).clone()
        io.save_checkpoint({"state_dict": {"w": w}, "global_step": step}, ckpts / f"step{step:07d}.ckpt")
        os.utime(ckpts / f"step{step:07d}.ckpt", (step, step))
    link_checkpoint(ckpts / "step0000006.ckpt", ckpts / "last.ckpt")
    last = ckpts / "last.ckpt"
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "last.ckpt", "last.ckpt.sha256", "step0000003.ckpt", "step0000003.ckpt.sha256", "step0000006.ckpt",
        "step0000006.ckpt.sha256"]
    digest = hashlib.sha256(last.read_bytes()).hexdigest()
    assert checksum_path(last).read_text() == f"{digest}  last.ckpt\n"  # `sha256sum -c` format
    assert resolve_checkpoint("last", ckpts, fallback=False) == str(last)

    os.unlink(last)  # break the hard link: only last.ckpt is damaged
    shutil.copyfile(ckpts / "step0000006.ckpt", last)
    os.utime(last, (7, 7))
    _flip_tensor_byte(last, marker)
    assert torch.load(last, weights_only=True)["global_step"] == 6  # the attack: it loads, with wrong weights
    with pytest.raises(ConfigError) as info:
        resolve_checkpoint("last", ckpts, fallback=False)
    flipped = hashlib.sha256(last.read_bytes()).hexdigest()
    assert str(info.value).startswith(
        f"--ckpt_path {last}: sha256 {flipped[:16]}"
        f"... does not match last.ckpt.sha256 ({digest[:16]}...): bits changed after the write")
    assert "--run.ckpt_fallback true" in str(info.value)
    assert resolve_checkpoint("last", ckpts, fallback=True) == str(ckpts / "step0000006.ckpt")

    checksum_path(last).unlink()  # no sidecar: the flipped byte cannot be seen, so it is refused unless allowed
    with pytest.raises(ConfigError) as info:
        resolve_checkpoint("last", ckpts, fallback=False)
    assert str(info.value) == (
        f"--ckpt_path {last}: no sidecar last.ckpt.sha256, so its bytes cannot be verified (written before "
        "checksums, or a kill between its rename and the sidecar); if you trust it, pass "
        "--run.allow_unverified_ckpt true, or resume from another file with --ckpt_path FILE")
    assert resolve_checkpoint("last", ckpts, fallback=True) == str(ckpts / "step0000006.ckpt")
    assert resolve_checkpoint("last", ckpts, fallback=False, unverified_ok=True) == str(last)


def test_checksum_sidecars_follow_the_checkpoint_life(tmp_path):
    """keep_last_k's removal takes the sidecar along; a kill's leftovers (sidecar temporaries, sidecars of
    removed files) go at the next start; a rewrite never leaves the old checksum beside the new file."""
    from train.checkpoint import checksum_path, file_sha256, sidecar_digests
    from train.checkpoint_io import remove_stale_temp_files

    io = AtomicCheckpointIO()
    a, b = tmp_path / "step0000003.ckpt", tmp_path / "step0000006.ckpt"
    io.save_checkpoint({"state_dict": {}, "global_step": 3}, a)
    io.save_checkpoint({"state_dict": {}, "global_step": 6}, b)
    io.remove_checkpoint(a)
    assert not a.exists() and not checksum_path(a).exists()
    io.save_checkpoint({"state_dict": {"x": torch.ones(3)}, "global_step": 6}, b)  # rewritten in place
    assert sidecar_digests(b) == [file_sha256(b)]
    (tmp_path / ".step0000006.ckpt.sha256.123.4.tmp").write_text("half")
    (tmp_path / "step0000009.ckpt.sha256").write_text("0" * 64)  # its checkpoint is gone
    removed = remove_stale_temp_files(tmp_path)
    assert sorted(p.name for p in removed) == [".step0000006.ckpt.sha256.123.4.tmp", "step0000009.ckpt.sha256"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step0000006.ckpt", "step0000006.ckpt.sha256"]


class _Killed(BaseException):
    """A SIGKILL at this moment: the write goes no further (only its temporary is cleaned up, which a kill
    leaves to the next start's remove_stale_temp_files)."""


def _kill_before(n: int, monkeypatch, write) -> bool:
    """Run ``write()`` stopped just before its ``n``-th rename, link or unlink (from 0): every state a kill
    can leave on disk, one ``n`` each. False when the write finished first."""
    real = {name: getattr(os, name) for name in ("replace", "link", "unlink")}
    calls = []

    def op(name):
        def call(*args, **kwargs):
            calls.append(name)
            if len(calls) - 1 == n:
                raise _Killed
            return real[name](*args, **kwargs)
        return call

    with monkeypatch.context() as m:
        for name in real:
            m.setattr(os, name, op(name))
        try:
            write()
        except _Killed:
            return True
    return False


@pytest.mark.parametrize("how", ["link", "save"])
def test_a_kill_at_any_moment_of_replacing_last_leaves_a_last_that_verifies(tmp_path, monkeypatch, how):
    """last.ckpt replaced by a hard link of the newest step file (link) or by a fresh save (a stop at a step
    without a step file): killed between any two renames, links or unlinks, ``--ckpt_path last`` resumes
    (the old or the new state) without a flag. Before: the old sidecar was removed before the rename and
    the new one written after it, so a kill in between (3 of 12 moments of a run's saves) left last.ckpt
    refused as unverified, although it was a hard link of a step file whose sidecar existed."""
    from train.checkpoint import checksum_path, file_sha256, recorded_step
    from train.checkpoint_io import link_checkpoint

    io = AtomicCheckpointIO()
    moments = 0
    for n in range(100):
        ckpts = tmp_path / f"kill{n}"
        last = ckpts / "last.ckpt"
        for step in (3, 6):
            io.save_checkpoint({"state_dict": {"w": torch.full((64,), step)}, "global_step": step},
                               ckpts / f"step{step:07d}.ckpt")
        link_checkpoint(ckpts / "step0000003.ckpt", last)
        io.remove_checkpoint(ckpts / "step0000003.ckpt")  # keep_last_k: last.ckpt's old file has no other name
        if how == "link":
            killed = _kill_before(n, monkeypatch, lambda: link_checkpoint(ckpts / "step0000006.ckpt", last))
        else:
            killed = _kill_before(n, monkeypatch, lambda: io.save_checkpoint(
                {"state_dict": {"w": torch.full((64,), 7)}, "global_step": 7}, last))
        assert resolve_checkpoint("last", ckpts, fallback=False) == str(last), (how, n)
        assert recorded_step(last) in ((3, 6) if how == "link" else (3, 7)), (how, n)
        if not killed:
            assert checksum_path(last).read_text() == f"{file_sha256(last)}  last.ckpt\n"  # sha256sum -c reads it
            break
        moments += 1
    assert moments >= 4, moments  # the kills landed before, inside and after the sidecar's and the file's renames


# -- cursor files: every integer range-checked on load --------------------------------------------------------


@pytest.fixture
def order_state(demo_corpus, tmp_path):
    """A real dump_order-style cursor (2 ranks x 2 workers, 7 steps into the demo corpus), as JSON gives it."""
    import json

    from data.config import DataConfig, SourceConfig
    from data.manifest import build_manifest
    from data.schedules import fixed_schedule
    from data.simulate import OrderSimulator

    names = ("web", "code", "books", "curated")
    cfg = DataConfig(sources={n: SourceConfig(paths=[str(demo_corpus / n / "*.parquet")]) for n in names},
                     schedule=fixed_schedule({n: 0.25 for n in names}, 64), manifest_cache=str(tmp_path / "cache"),
                     batch_size=2, buffer_size=16, open_shards=2)
    m = build_manifest(cfg)
    sim = OrderSimulator(m, cfg, 2, 2)
    list(sim.order_lines(7))
    return (lambda: OrderSimulator(m, cfg, 2, 2)), json.loads(json.dumps(sim.state_dict()))


CURSOR_ATTACKS = [
    (lambda c: c["sources"]["web"].__setitem__("taken", -5), r"sources\.web\.taken = -5 is out of range "
                                                             r"\(an integer >= 0\)"),
    (lambda c: c.__setitem__("next_step", -1), r"next_step = -1 is out of range"),
    (lambda c: c.__setitem__("consumer", 7), r"consumer = 7 is out of range \(an integer >= 0 and < 4\)"),
    (lambda c: c["sources"]["code"].__setitem__("open", [[3, -2]]), r"sources\.code\.open\[0\]\[1\] \(rows used\) "
                                                                    r"= -2 is out of range"),
    (lambda c: c["mixer"]["emitted"].__setitem__(0, -3), r"mixer\.emitted\[0\] = -3 is out of range"),
    (lambda c: c["mixer"]["committed"].__setitem__(1, c["mixer"]["emitted"][1] - 1),
     r"mixer\.committed\[1\] = -?\d+ is out of range \(>= mixer\.emitted\[1\]"),
    (lambda c: c.__setitem__("rows", [[9, 0, 0, 0, 0]]), r"rows\[0\]\[0\] \(source\) = 9 is out of range "
                                                         r"\(an integer >= 0 and < 4\)"),
    (lambda c: c["sources"]["books"].__setitem__("taken", "3"), r"sources\.books\.taken = '3' is out of range"),
    (lambda c: c.__delitem__("mixer"), r"malformed \(KeyError: 'mixer'\)"),
    (lambda c: c["mixer"]["target"].pop(), r"mixer\.target = \[.*\] is out of range \(one value per source \(4\)\)"),
    (lambda c: c["sources"]["web"].__setitem__("rng", 3), r"sources\.web\.rng = 3 is out of range \(a PCG64 state\)"),
    (lambda c: c.__delitem__("fingerprint"), r"malformed \(KeyError: 'fingerprint'\)"),
    (lambda c: c.__setitem__("continuations", [[0, 1, 2, 3]]), r"continuations\[0\] = \[0, 1, 2, 3\] is out of range"),
    # before: accepted; a NaN target changed the order, a string seed read "saved with seed 1234, not 1234"
    (lambda c: c["mixer"]["target"].__setitem__(1, float("nan")), r"mixer\.target = \[[\d.]+, nan, .*\] is out of "
                                                                   r"range \(token targets, finite and >= 0\)"),
    (lambda c: c.__setitem__("seed", str(c["seed"])), r"seed = '\d+' is out of range \(an integer >= 0\)"),
    (lambda c: c.__setitem__("fingerprint", 5), r"fingerprint = 5 is out of range \(the corpus fingerprint, a "
                                                r"string\)"),
    # before: accepted; books documents trained in web's slots (an address of another source's chunks)
    (lambda c: c["sources"]["web"].__setitem__("buffer", c["sources"]["books"]["buffer"]),
     r"sources\.web\.buffer\[0\] = shard \d+ row \d+ \(books\S*:\d+\) is not in the training chunks of source 'web'"),
    (lambda c: c["rows"].__setitem__(0, [0, *map(int, buffer_addrs(c["sources"]["code"]["buffer"])[0, :2]), 0, 0]),
     r"rows\[0\] = shard \d+ row \d+ \(\S+:\d+\) is not in the training chunks of source 'web'"),
]


@pytest.mark.parametrize(("attack", "want"), CURSOR_ATTACKS, ids=[str(i) for i in range(len(CURSOR_ATTACKS))])
def test_cursor_integers_are_range_checked_on_load(order_state, attack, want):
    """Before: ``taken: -5`` was accepted and crashed later. Now each field is named on load, for the
    dump_order cursor (OrderSimulator.load_state_dict) and the checkpoint's (ConsumerStream's)."""
    import copy

    fresh, state = order_state
    bad = copy.deepcopy(state)
    attack(bad["consumers"][0][0])
    with pytest.raises(ConfigError, match=r"^data cursor \(consumer [-\d']+ of \d\): " + want +
                       r".*the cursor is damaged or was edited: resume from another checkpoint \(or cursor file\)$"):
        fresh().load_state_dict(bad)
    fresh().load_state_dict(copy.deepcopy(state))  # the untouched cursor loads


def test_a_step_the_consumers_disagree_with_is_named_not_an_assertion(order_state):
    """Before: a top-level ``step`` edited in a cursor file loaded, then failed an ``assert`` in the
    simulator's loop. read_order_state names the step and the consumer that disagrees."""
    from data.cursor import read_order_state

    _, state = order_state
    read_order_state(state)
    read_order_state({"next_step": state["step"], "cursors": state["consumers"], "num_workers": 2})  # ckpt layout
    for step, worker, want in ((9, 0, 10), (5, 0, 6)):  # at step 7 the workers continue at 8 and 7
        with pytest.raises(ConfigError, match=rf"^data order state: step = {step}, but the cursor of rank 0 worker "
                                              rf"{worker} continues at step \d+ \(it must be {want}, the first step "
                                              rf">= {step} that worker {worker} of 2 owns\); the cursor is damaged"):
            read_order_state({**state, "step": step})
    with pytest.raises(ConfigError, match=r"step = -1 is out of range"):
        read_order_state({**state, "step": -1})
    with pytest.raises(ConfigError, match=r"num_workers = 3 but the cursors are 2 rank\(s\) x 2 worker\(s\)"):
        read_order_state({**state, "num_workers": 3})
    fresh, _ = order_state
    with pytest.raises(ConfigError, match=r"^data order state: step = 9"):  # dump_order --resume-from's path
        fresh().load_state_dict({**state, "step": 9})


def test_a_checkpoint_with_a_damaged_cursor_is_refused_before_lightning_loads_it(order_state, tmp_path):
    """The checkpoint's data cursors go through the same checks in the resume pre-check (train/checkpoint.py):
    an edited ``taken`` or ``next_step`` names the file and the field (or falls back), no worker crash."""
    import copy

    from train.checkpoint import checkpoint_problem

    _, state = order_state
    io = AtomicCheckpointIO()

    def save(dm_state: dict) -> Path:
        path = tmp_path / "last.ckpt"
        io.save_checkpoint({"state_dict": {}, "global_step": 7, "WellMixedData": dm_state}, path)
        return path

    good = {"next_step": 7, "cursors": state["consumers"], "num_workers": 2, "world_size": 2}
    assert checkpoint_problem(save(good)) is None
    assert checkpoint_problem(save({**good, "next_step": 9})).startswith(
        "data order state: step = 9, but the cursor of rank 0 worker 0 continues at step 8")
    bad = copy.deepcopy(good)
    bad["cursors"][1][0]["sources"]["web"]["taken"] = -5
    path = save(bad)
    assert checkpoint_problem(path).startswith("data cursor (consumer 2 of 4): sources.web.taken = -5 is out of range")
    with pytest.raises(ConfigError, match=rf"^--ckpt_path {path}: data cursor \(consumer 2 of 4\): "
                                          r"sources.web.taken = -5 is out of range .*--run.ckpt_fallback true"):
        resolve_checkpoint(str(path), tmp_path, fallback=False)
    old = copy.deepcopy(bad)
    for rank in old["cursors"]:
        for cur in rank:
            cur["version"] = 1
    assert checkpoint_problem(save(old)) is None  # another version: the datamodule's own error says what to do


def test_a_checkpoint_whose_cursor_files_are_missing_or_damaged_is_refused(order_state, tmp_path):
    """Per-rank cursor files (train/cursor_files.py): every file the checkpoint names must be present;
    those range-checked are named with the field. On several ranks the CLI checks presence only
    (``cursor_ranks=[]``: the same answer on every rank, so a fallback picks one checkpoint for all)."""
    import copy

    from train.checkpoint import checkpoint_problem
    from train.cursor_files import claim_step_dir, save_rank_cursors

    _, state = order_state
    ckpts = tmp_path / "checkpoints"
    damaged = copy.deepcopy(state["consumers"])
    damaged[1][0]["sources"]["web"]["taken"] = -5  # rank 1's file
    io = AtomicCheckpointIO()
    for name, consumers in (("step0000007.ckpt", state["consumers"]), ("last.ckpt", damaged)):
        rel = claim_step_dir(ckpts, 7)  # the second save of step 7 gets its own folder (step0000007-v1)
        for rank, row in enumerate(consumers):
            save_rank_cursors(ckpts / rel, rank, row, 7)
        dm_state = {"next_step": 7, "cursor_dir": rel, "num_workers": 2, "world_size": 2}
        io.save_checkpoint({"state_dict": {}, "global_step": 7, "WellMixedData": dm_state}, ckpts / name)
    last = ckpts / "last.ckpt"
    assert checkpoint_problem(last).startswith("data cursor (consumer 2 of 4): sources.web.taken = -5 is out of")
    assert checkpoint_problem(last, cursor_ranks=[0]) is None  # rank 0 reads its own file only
    assert checkpoint_problem(last, cursor_ranks=[]) is None
    (ckpts / "cursors" / "step0000007-v1" / "rank00001.pt").unlink()
    want = f"data cursor file {ckpts / 'cursors' / 'step0000007-v1' / 'rank00001.pt'} missing"
    assert checkpoint_problem(last, cursor_ranks=[]).startswith(want)
    with pytest.raises(ConfigError, match=rf"^--ckpt_path {last}: {want} .*--run.ckpt_fallback"):
        resolve_checkpoint(str(last), ckpts, fallback=False, cursor_ranks=[])
    assert resolve_checkpoint(str(last), ckpts, fallback=True, cursor_ranks=[]) == str(ckpts / "step0000007.ckpt")
    assert resolve_checkpoint("last", ckpts, fallback=False, cursors=False) == str(last)  # `train validate`


def test_a_fatal_error_in_a_cli_process_is_followed_by_an_exit_within_the_limit(monkeypatch, capsys):
    """The watchdog armed after a fatal error: if the process is still alive FATAL_EXIT_AFTER_S later,
    it prints the error and every thread's stack, and exits 1. Unarmed in library use."""
    import threading

    from train import signals

    exits = []
    fired = threading.Event()

    def fake_exit(code):
        exits.append(code)
        fired.set()

    monkeypatch.setattr(signals.os, "_exit", fake_exit)
    signals.disarm_fatal_exit()
    signals.arm_fatal_exit(FileNotFoundError("metrics.csv"))  # library use: nothing armed
    assert not signals._ARMED.is_set()
    monkeypatch.setattr(signals, "FATAL_EXIT_AFTER_S", 0.2)
    signals.arm_fatal_exit(FileNotFoundError("metrics.csv"))
    assert fired.wait(10) and exits == [1]
    err = capsys.readouterr().err
    assert "fatal FileNotFoundError: metrics.csv" in err and "did not end within 0 s" in err
    assert "Thread MainThread:" in err  # where every thread waited
    signals.FATAL_EXIT_AFTER_S = 60.0
    signals.arm_fatal_exit(RuntimeError("again"))
    signals.disarm_fatal_exit()  # what the test suite does after each test: nothing fires later
    assert signals.FATAL_EXIT_AFTER_S is None and not signals._ARMED.is_set() and not signals._TIMER


# -- --ckpt_path: what it names, found by the step inside, refused in one line ------------------------------


def test_last_is_the_highest_step_recorded_inside_not_the_newest_file(tmp_path, caplog):
    """A stale last-v1.ckpt (step 1, from an early SIGTERM) and last.ckpt (step 16), copied without their
    mtimes so that the stale one looks newer: before, --ckpt_path last resumed the finished run from step 1."""
    ckpts = tmp_path / "checkpoints"
    now = time.time()
    _save(ckpts / "last.ckpt", 16, now - 3600)
    _save(ckpts / "last-v1.ckpt", 1, now)
    with caplog.at_level("WARNING"):
        assert resolve_checkpoint("last", ckpts, fallback=False) == str(ckpts / "last.ckpt")
    assert "--ckpt_path last: last.ckpt records the highest step of last-v1.ckpt, last.ckpt (16)" in caplog.text
    _save(ckpts / "last-v1.ckpt", 17, now - 7200)  # the other way round: the higher step wins, whatever its time
    assert resolve_checkpoint("last", ckpts, fallback=False) == str(ckpts / "last-v1.ckpt")
    _save(ckpts / "last-v1.ckpt", 16, now)  # a tie: the plain name
    assert resolve_checkpoint("last_or_new", ckpts, fallback=False) == str(ckpts / "last.ckpt")
    (ckpts / "last-v1.ckpt").write_bytes(b"half")  # one that does not open is named, not passed over
    with pytest.raises(ConfigError, match=r"--ckpt_path .*last-v1.ckpt: .*--run.ckpt_fallback true"):
        resolve_checkpoint("last", ckpts, fallback=False)
    assert resolve_checkpoint("last", ckpts, fallback=True) == str(ckpts / "last.ckpt")


class _Payload:
    def __init__(self, marker: Path, shell: bool = False):
        self.marker, self.shell = marker, shell

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",)) if self.shell else (Path.touch, (self.marker,))


def _not_checkpoints(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (path, the words its refusal must hold)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "other_dir").mkdir()
    (tmp_path / "other_dir" / "notes.txt").write_text("x")
    (tmp_path / "ckpt_dir").mkdir()
    _save(tmp_path / "ckpt_dir" / "step0000003.ckpt", 3, time.time())
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "half_sharded").mkdir()
    (tmp_path / "half_sharded" / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "empty.ckpt").write_bytes(b"")
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "shard.parquet")
    (tmp_path / "config.yaml").write_text("model:\n  d_model: 32\n")
    torch.save(torch.ones(3), tmp_path / "tensor.pt")
    torch.save({"state_dict": {}, "global_step": 1, "x": _Payload(tmp_path / "pwned")}, tmp_path / "crafted.ckpt")
    torch.save({"state_dict": {}, "global_step": 1, "x": _Payload(tmp_path / "pwned", shell=True)},
               tmp_path / "shell.ckpt")
    return {
        "empty_dir": (tmp_path / "empty_dir", "an empty directory, not a checkpoint"),
        "other_dir": (tmp_path / "other_dir", "a directory, not a checkpoint (no .metadata index"),
        "ckpt_dir": (tmp_path / "ckpt_dir", "a folder of 1 checkpoint(s) (step0000003.ckpt), not one: name one"),
        "run_dir": (tmp_path / "run", f"a run directory, not a checkpoint: name a file in its checkpoints/, or "
                                      f"resume it with --run.dir {tmp_path / 'run'} --ckpt_path last"),
        "half_sharded": (tmp_path / "half_sharded", "a sharded checkpoint folder without its .metadata index"),
        "empty_file": (tmp_path / "empty.ckpt", "an empty file (0 bytes), not a checkpoint"),
        "parquet": (tmp_path / "shard.parquet", "a parquet file, not a checkpoint"),
        "yaml": (tmp_path / "config.yaml", "a text file (YAML? a config?), not a checkpoint"),
        "tensor": (tmp_path / "tensor.pt", "holds a bare Tensor, not a checkpoint"),
        "crafted_pickle": (tmp_path / "crafted.ckpt", "holds objects other than tensors and plain types "
                                                      "(getattr): refused (unpickling it could run code)"),
        "shell_pickle": (tmp_path / "shell.ckpt", f"holds objects other than tensors and plain types "
                                                  f"({os.system.__module__}.system): refused"),
    }


def test_a_ckpt_path_that_is_not_a_checkpoint_is_named_for_what_it_is(tmp_path):
    """Before: every folder was "a sharded checkpoint without its .metadata index"; an empty file, a saved
    tensor and best gave EOFError / AttributeError / ValueError tracebacks, and torch's text advised the
    unsafe weights_only=False. A crafted pickle is refused without running its payload."""
    from train.checkpoint import requested_hparams

    for name, (path, want) in _not_checkpoints(tmp_path).items():
        with pytest.raises(ConfigError) as info:
            requested_hparams(str(path), tmp_path / "run" / "checkpoints", fallback=False)
        msg = str(info.value)
        assert msg.startswith(f"--ckpt_path {path}: {want}"), (name, msg)
        assert "\n" not in msg and "weights_only" not in msg and "--trust" not in msg, (name, msg)
    assert not (tmp_path / "pwned").exists()
    for name in ("best", "hpc", "registry"):
        with pytest.raises(ConfigError, match=rf"^--ckpt_path {name}: this CLI writes no '{name}' checkpoint; "
                                              "use --ckpt_path last"):
            requested_hparams(name, tmp_path / "run" / "checkpoints", fallback=False)


def test_export_suggests_trust_checkpoint_only_for_pickled_objects(tmp_path):
    """Before: export_hf.py on a folder or a truncated file suggested --trust-checkpoint."""
    main = load_script("export_hf").main

    cases = _not_checkpoints(tmp_path)
    _save(tmp_path / "whole.ckpt", 3, time.time())
    data = (tmp_path / "whole.ckpt").read_bytes()
    (tmp_path / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    for path in (cases["other_dir"][0], cases["empty_dir"][0], tmp_path / "truncated.ckpt"):
        with pytest.raises(ConfigError) as info:
            from train.tools.export import load_checkpoint

            load_checkpoint(path)
        assert "--trust-checkpoint" not in str(info.value) and str(path) in str(info.value), str(info.value)
    with pytest.raises(ConfigError, match=r"refused \(unpickling it could run code\).*--trust-checkpoint"):
        from train.tools.export import load_checkpoint

        load_checkpoint(cases["crafted_pickle"][0])
    assert main([str(tmp_path / "truncated.ckpt"), "--out", str(tmp_path / "hf")]) == 2
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "hf").exists()


def test_ckpt_path_last_without_a_checkpoint_is_refused_and_last_or_new_starts_fresh(tmp_path, capsys,
                                                                                      monkeypatch):
    """Before: --ckpt_path last in a run dir without checkpoints (the README's resume line after a demo
    that wrote elsewhere) retrained from step 0 behind one warning. Refused before anything is written."""
    from train.checkpoint import requested_hparams
    from train.cli import main

    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    run = tmp_path / "run"
    rc = main(["fit", "--config", str(ROOT / "configs" / "demo.yaml"), "--run.wandb", "false", "--run.dir", str(run),
               "--ckpt_path", "last"])
    err = capsys.readouterr().err
    assert rc == 2 and [ln for ln in err.splitlines() if ln.startswith("error:")] == [
        f"error: --ckpt_path last: {run} has no checkpoint to resume ({run / 'checkpoints'} holds no *.ckpt); "
        "to start a new run there leave out --ckpt_path, or pass --ckpt_path last_or_new (resume if there is one)"]
    assert not run.exists()
    assert requested_hparams("last_or_new", run / "checkpoints", fallback=False) == {}
    assert resolve_checkpoint("last_or_new", run / "checkpoints", fallback=False) is None


def test_a_malformed_sidecar_is_an_error_and_a_file_changed_after_its_check_is_checked_again(tmp_path, caplog):
    """Before: a malformed sidecar counted as none (the file was only opened) and a missing one said nothing."""
    from train.checkpoint import checkpoint_problem, checksum_path

    path = tmp_path / "last.ckpt"
    marker = bytes(range(7, 247))
    w = torch.frombuffer(bytearray(marker * 8), dtype=torch.uint8).clone()
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": w}, "global_step": 3}, path)
    assert checkpoint_problem(path) is None
    _flip_tensor_byte(path, marker)  # at once, in place: same inode and size
    assert "does not match last.ckpt.sha256" in checkpoint_problem(path)
    for bad in ("", "deadbeef  last.ckpt\n", "x" * 64 + "  last.ckpt\n"):
        checksum_path(path).write_text(bad)
        assert checkpoint_problem(path).startswith("its sidecar last.ckpt.sha256 is malformed ("), bad
    checksum_path(path).unlink()
    assert checkpoint_problem(path).startswith("no sidecar last.ckpt.sha256, so its bytes cannot be verified")
    with caplog.at_level("WARNING"):
        assert resolve_checkpoint(str(path), tmp_path, fallback=False, unverified_ok=True) == str(path)
    assert (f"checkpoint {path}: no sidecar last.ckpt.sha256, so its bytes cannot be verified" in caplog.text
            and "--run.allow_unverified_ckpt true" in caplog.text)
