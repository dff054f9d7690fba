"""train/launch.py with real processes: an ``scontrol`` that hangs or refuses the node list, and
``python -m train.launch fit`` on two local ranks of a simulated 1 x 2 Slurm job (gloo on CPU): a
MASTER_PORT another process holds is one line on rank 0 before the rendezvous, and rank 1 does not wait
in torch's rendezvous forever (docs/slurm.md, step 5)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
from training_runs import DDP, TINY

from data.errors import ConfigError
from train import launch
from train.launch import RENDEZVOUS_TIMEOUT_VAR, check_task, slurm_task_env


@pytest.mark.parametrize("script, match", [
    ("exec sleep 60", r"`scontrol show hostnames node\[00-01\]` did not answer in 1 s \(slurmctld or the Slurm "
                      r"configuration unreachable\?\): export MASTER_ADDR=<first node>"),
    # Slurm 22.05 on an invalid list: "Invalid hostlist: ..." on stderr, nothing on stdout, exit status 0
    ("echo 'Invalid hostlist: node[00-01]' >&2", r"`scontrol show hostnames node\[00-01\]` failed \(0: Invalid "
                                                 r"hostlist: node\[00-01\]\): export MASTER_ADDR=<first node>"),
])
def test_an_scontrol_that_hangs_or_fails_is_one_line(tmp_path, monkeypatch, script, match):
    """Before: a hanging scontrol raised TimeoutExpired (a traceback) after 30 s."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\n{script}\n")
    scontrol.chmod(0o755)
    monkeypatch.setattr(launch, "SCONTROL_TIMEOUT_S", 1.0)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"^rank 3 on [^:]*: " + match):
        check_task({"PATH": str(tmp_path), **slurm_task_env(2, 2, 3)})
    assert time.monotonic() - started < 10


def _start_ranks(workdir, env, port: int, timeout_s: int, tag: str) -> list[subprocess.Popen]:
    base = {k: v for k, v in env.items()
            if not k.startswith("SLURM_") and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    procs = []
    for rank in (0, 1):
        rank_env = {**base, **slurm_task_env(1, 2, rank, job_name="wellmixed-test"), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), RENDEZVOUS_TIMEOUT_VAR: str(timeout_s)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "train.launch", "fit", *TINY, *DDP, "--run.dir", str(workdir / tag)],
            cwd=workdir, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True))
    return procs


@pytest.mark.slow
def test_a_taken_master_port_is_one_line_and_no_rank_waits_forever(workdir, env):
    """Before: rank 0 a DistNetworkError traceback (EADDRINUSE); rank 1, whose rendezvous client reached
    the process holding the port, waited until it was killed (torch's client ignores its timeout there)."""
    host = socket.gethostname()
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        started = time.monotonic()
        procs = _start_ranks(workdir, env, port, 40, "taken_port")
        try:
            outs = [p.communicate(timeout=40 + 120)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
        elapsed = time.monotonic() - started
    assert [p.returncode for p in procs] == [2, 2], outs
    assert "Traceback" not in outs[0] + outs[1], outs
    assert outs[0].strip().splitlines() == [
        f"error: rank 0 on {host}: MASTER_PORT {port} is in use on {host}, where rank 0 opens the rendezvous "
        f"(127.0.0.1:{port}); another process holds it (`ss -ltnp 'sport = :{port}'`): unset MASTER_PORT "
        "(train.sbatch derives a free one) or export a free port"], outs[0]
    assert outs[1].strip().splitlines()[-1] == (
        f"error: rank 1 on {host}: no rendezvous at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) within 40 s of the "
        "launch: a rank failed before it (see its error line), another process holds the port, or the port is "
        f"blocked between the nodes; {RENDEZVOUS_TIMEOUT_VAR} sets the wait"), outs[1]
    assert 40 <= elapsed < 40 + 120
    assert not (workdir / "taken_port" / "checkpoints").exists()


@pytest.mark.slow
def test_two_ranks_that_meet_train_past_the_rendezvous_wait(workdir, env):
    """The wait ends at the rendezvous: a healthy job runs on after it (here its 16 steps)."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    procs = _start_ranks(workdir, env, port, 600, "healthy")
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
    assert (workdir / "healthy" / "checkpoints" / "last.ckpt").is_file()
