"""Helpers for tests that train in a subprocess and interrupt it: tiny runs, real signals, order logs.

Each run is ``python -m train fit`` on configs/demo.yaml with the tiny model and a schedule of ~20
steps of 4 x 16..32 tokens (seconds on 2 CPU cores), fp32 on CPU so that losses compare bitwise,
order logs on. The process starts in its own session, so a signal can go to the whole group (the
DataLoader workers and, with DDP, the other rank) as a cluster sends it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "--config", str(ROOT / "configs" / "demo.yaml"),
    "--model.model", str(ROOT / "configs" / "model" / "tiny.yaml"),
    "--trainer.precision", "32-true",
    "--run.wandb", "false",
    "--data.order_log", "true",
    "--data.schedule.train_tokens", "1800",  # 16 steps
    # Short sequences: a step's cost is the 100K-vocabulary head over its tokens, and these runs test
    # the order, not the model (tokens per step halved from 4 x 32..64 took ~4 s of CPU off each run).
    "--data.schedule.seq_len.start", "16",
    "--data.schedule.seq_len.end", "32",
    "--data.schedule.seq_len.multiple", "16",
    "--data.schedule.seq_len.warmup_steps", "4",
    "--data.schedule.lr.warmup_steps", "3",
    "--data.schedule.anneal_start", "0.5",  # a long anneal: a kill can land in its middle
    "--data.val_tokens_per_source", "0",
    "--run.val_every_n_steps", "1000",
    "--run.ckpt_every_n_steps", "3",
    "--run.keep_last_k", "-1",
    "--data.buffer_size", "4",  # below every source's size: no source wraps in a run, so a repeated piece is a bug
    "--data.open_shards", "2",
    "--data.num_workers", "2",
]
# A run long enough for the loss to fall and the schedules to play out: 34 steps of 4 x 16..32 tokens,
# held-out loss every 10 steps (tests/integration/test_train.py, the demo ablation in
# tests/integration/test_ablations.py).
SMALL = [
    "--model.model", str(ROOT / "configs" / "model" / "tiny.yaml"),
    "--trainer.precision", "32-true",
    "--run.wandb", "false",
    "--data.schedule.train_tokens", "4000",
    "--data.schedule.seq_len.start", "16",
    "--data.schedule.seq_len.end", "32",
    "--data.schedule.seq_len.multiple", "16",
    "--data.schedule.seq_len.warmup_steps", "4",
    "--data.schedule.lr.warmup_steps", "3",
    "--data.schedule.lr.peak", "1e-2",
    "--data.val_tokens_per_source", "256",
    "--data.buffer_size", "64",
    "--run.val_every_n_steps", "10",
]
DDP = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp", "--data.batch_size", "2"]


class Run:
    """One training process (and its children) writing into ``run_dir``."""

    def __init__(self, workdir: Path, run_dir: Path, args: list[str], env: dict, tag: str = "run"):
        self.run_dir, self.tag = run_dir, tag
        self.log_path = run_dir.parent / f"{run_dir.name}.{tag}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "train", "fit", *args, "--run.dir", str(run_dir)],
                                     cwd=workdir, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def lines_done(self, rank: int = 0) -> int:
        try:
            with open(self.run_dir / "order_log" / f"rank{rank}.jsonl") as f:
                return sum(1 for ln in f if ln.endswith("\n"))
        except FileNotFoundError:
            return 0

    def signal_when(self, condition: Callable[[], bool], sig: int = signal.SIGKILL, group: bool = True,
                    timeout: float = 300) -> None:
        """Send ``sig`` (to the whole process group by default) as soon as ``condition()`` holds."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.tag} ended (rc {self.proc.returncode}) before the signal:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"{self.tag}: condition not met in {timeout} s:\n{self.log()}")
            time.sleep(0.005)
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 300) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        if rc == -signal.SIGKILL:
            self._reap_group()
        self._log.close()
        return rc

    def _reap_group(self) -> None:
        """After a SIGKILL of the group nothing should be left; make sure of it (a DDP rank or a worker)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def log(self, tail: int = 6000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()[-tail:]


def run_to_end(workdir: Path, run_dir: Path, args: list[str], env: dict, tag: str = "run", expect_rc: int = 0) -> Run:
    run = Run(workdir, run_dir, args, env, tag)
    rc = run.wait()
    assert rc == expect_rc, f"{tag}: rc {rc}, expected {expect_rc}:\n{run.log()}"
    return run


def order_log(run_dir: Path) -> dict[int, list[dict]]:
    """rank -> the order-log lines of that rank, in file order."""
    out = {}
    for path in sorted((run_dir / "order_log").glob("rank*.jsonl")):
        out[int(path.stem[4:])] = [json.loads(ln) for ln in path.read_text().splitlines() if ln]
    return out


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Optimizer steps of the step checkpoints present (``stepNNNNNNN.ckpt``), ascending."""
    return sorted(int(p.stem[4:]) for p in (run_dir / "checkpoints").glob("step*.ckpt"))


def global_step_of(path: Path) -> int:
    import torch

    return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])


def copy_checkpoint(path: Path, ckpt_dir: Path) -> Path:
    """A checkpoint file copied into another run's ``checkpoints/``, with its sidecar and the data cursor
    folder it references (train/cursor_files.py): the copy resumes like the original."""
    import shutil

    import torch

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, ckpt_dir / path.name)
    sidecar = path.with_name(path.name + ".sha256")
    if sidecar.exists():  # a checkpoint without its sidecar is refused (train/checkpoint.py)
        shutil.copy(sidecar, ckpt_dir / sidecar.name)
    cursor_dir = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["WellMixedData"]["cursor_dir"]
    shutil.copytree(path.parent / cursor_dir, ckpt_dir / cursor_dir)
    return ckpt_dir / path.name


def assert_same_order(ref: dict[int, list[dict]], got: dict[int, list[dict]], first_step: int = 0) -> None:
    """Every rank's lines identical: pieces, loss (bitwise: JSON keeps a float's exact repr), lr,
    sequence length, mixture weights, token counts -- and one line per step from ``first_step``, none
    missing or doubled."""
    assert sorted(got) == sorted(ref), f"ranks {sorted(got)} != {sorted(ref)}"
    for rank, lines in ref.items():
        mine = got[rank]
        steps = [ln["step"] for ln in mine]
        assert steps == list(range(first_step, first_step + len(lines))), f"rank {rank}: steps {steps}"
        for a, b in zip(lines, mine):
            if a != b:
                diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
                raise AssertionError(f"rank {rank} step {a['step']} differs from the uninterrupted run: {diff}")


def run_env(cache_dir: Path) -> dict:
    env = dict(os.environ)
    env.update(WELLMIXED_CACHE=str(cache_dir), WANDB_MODE="offline", WANDB_SILENT="true", PYTHONHASHSEED="0")
    return env


def make_workdir(tmp: Path, demo_corpus: Path) -> Path:
    """A working directory where configs/demo.yaml's relative ``demo_corpus/...`` globs resolve."""
    tmp.mkdir(parents=True, exist_ok=True)
    link = tmp / "demo_corpus"
    if not link.exists():
        link.symlink_to(demo_corpus, target_is_directory=True)
    return tmp


def owed_docs(stream, epoch: int) -> list[tuple[int, int]]:
    """Documents of ``epoch`` a consumer still owes: buffered, left in open chunks, or in the
    elements of its own slice it has not taken yet."""
    out = [(d.shard, d.row) for d in stream.buffer if d.epoch == epoch]
    for g, _, lazy in stream.open:  # a LazyChunk: its rows not taken yet
        if g // len(stream.chunks) == epoch:
            out += [(lazy.shard, int(r)) for r in lazy.rows[lazy.pos:]]
    n = len(stream.chunks)
    g = stream.consumer + stream.taken * stream.num_consumers
    while g < (epoch + 1) * n:
        e, chunk = stream.chunk_at(g)
        if e == epoch:
            out += [(chunk.shard, r) for r in range(chunk.start, chunk.stop)]
        g += stream.num_consumers
    return out


def all_loggers() -> dict:
    return {"": logging.getLogger(), **{n: lg for n, lg in logging.Logger.manager.loggerDict.items()
                                        if isinstance(lg, logging.Logger)}}


def fit_in_process(args: list[str], capsys) -> tuple[int, str, str]:
    """``python -m train fit ARGS`` in this process: (exit code, stdout, stderr)."""
    from train.cli import main

    saved, sys.argv = sys.argv, sys.argv[:1]
    for log in all_loggers().values():  # handlers bound to an earlier test's captured (closed) stderr
        log.handlers[:] = [h for h in log.handlers if not getattr(getattr(h, "stream", None), "closed", False)]
    handlers = {name: list(log.handlers) for name, log in all_loggers().items()}
    try:
        rc = main(["fit", *args])
    except SystemExit as e:
        rc = e.code
    finally:
        sys.argv = saved
        for name, log in all_loggers().items():  # main's handlers write to this test's captured stderr
            log.handlers[:] = handlers.get(name, [])
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_same_weights(ref: Path, got: Path) -> None:
    """Two checkpoint files hold bitwise the same model weights and optimizer state (every tensor
    ``torch.equal``, every other value ``==``) at the same step: what a resume must reproduce."""
    import torch

    a, b = (torch.load(p, map_location="cpu", weights_only=True) for p in (ref, got))
    assert a["global_step"] == b["global_step"], (a["global_step"], b["global_step"])

    def differ(x, y, path: str) -> list[str]:
        if isinstance(x, torch.Tensor):
            same = isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)
            return [] if same else [f"{path}: {int((x != y).sum()) if x.shape == y.shape else 'shape'} of {x.numel()}"]
        if isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys():
            return [d for k in x for d in differ(x[k], y[k], f"{path}.{k}")]
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y):
            return [d for i, (u, v) in enumerate(zip(x, y)) for d in differ(u, v, f"{path}[{i}]")]
        return [] if x == y else [f"{path}: {x!r} != {y!r}"]

    off = differ(a["state_dict"], b["state_dict"], "state_dict") + \
        differ(a["optimizer_states"], b["optimizer_states"], "optimizer_states")
    assert not off, f"{got} differs from {ref} (elements differing): " + "; ".join(off[:12])
