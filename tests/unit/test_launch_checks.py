"""train/launch.py check_task: what every srun task checks before training (fast; the real thing on a
two-node cluster is tests/integration/test_slurm.py)."""

from __future__ import annotations

import socket

import pytest

from data.errors import ConfigError
from train.launch import check_task, slurm_task_env


def _env(nodes=2, per_node=2, rank=3, **extra) -> dict:
    return {"PATH": "/nonexistent", **slurm_task_env(nodes, per_node, rank), **extra}


def test_master_addr_is_kept_and_the_line_names_rank_node_and_address():
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT="23001", nodes=1, rank=1,
               SLURM_LAUNCH_NODE_IPADDR="10.9.9.9")  # the submit node: never rank 0's address
    line = check_task(env)
    assert line == f"rank 1 of 2: node 0 local 1 on {socket.gethostname()}; rendezvous 127.0.0.1 (127.0.0.1):23001"
    assert env["MASTER_ADDR"] == "127.0.0.1"


def test_without_scontrol_the_first_node_is_not_guessed():
    with pytest.raises(ConfigError, match=r"^rank 3 on .*: scontrol is not on PATH, so rank 0's node cannot be "
                                          r"read from SLURM_JOB_NODELIST 'node\[00-01\]'"):
        check_task(_env())


@pytest.mark.parametrize("env, match", [
    (_env(SLURM_NTASKS="3"), r"rank 3 on .*: world size disagrees: SLURM_NTASKS is 3, but Lightning counts "
                             r"SLURM_NNODES 2 x SLURM_NTASKS_PER_NODE 2 = 4 ranks"),
    (_env(SLURM_NODEID="0"), r"rank 3 on .*: SLURM_PROCID 3 is not node 0 x 2 tasks per node \+ local rank 1"),
    (_env(MASTER_ADDR="localhost"), r"rendezvous address localhost is loopback \(127\.0\.0\.1\) in a 2-node job"),
    (_env(MASTER_ADDR="no-such-node.invalid"), r"rendezvous address 'no-such-node.invalid' .* does not resolve"),
    ({"PATH": "/nonexistent"}, r"^SLURM_NNODES, SLURM_NTASKS_PER_NODE, SLURM_NTASKS, SLURM_PROCID, SLURM_NODEID, "
                               r"SLURM_LOCALID not set: run under srun"),
])
def test_a_layout_lightning_would_count_wrong_is_refused(env, match):
    with pytest.raises(ConfigError, match=match):
        check_task(env)
    assert "MASTER_ADDR" not in env or env["MASTER_ADDR"] in ("localhost", "no-such-node.invalid")


def _fake_scontrol(tmp_path, script: str) -> str:
    """A PATH whose ``scontrol`` is ``script`` (a shell script body), as a broken or misconfigured client."""
    (tmp_path / "scontrol").write_text(f"#!/bin/sh\n{script}\n")
    (tmp_path / "scontrol").chmod(0o755)
    return str(tmp_path)


def test_a_failing_scontrol_show_hostnames_is_refused_naming_the_command(tmp_path):
    env = _env(PATH=_fake_scontrol(tmp_path, 'echo "scontrol: error: Unable to contact slurm controller" >&2; exit 1'))
    with pytest.raises(ConfigError, match=r"^rank 3 on .*: `scontrol show hostnames node\[00-01\]` failed \(1: "
                                          r"scontrol: error: Unable to contact slurm controller\): export MASTER_ADDR"):
        check_task(env)
    assert "MASTER_ADDR" not in env


def test_an_unresolvable_first_node_without_master_addr_is_refused(tmp_path):
    env = _env(PATH=_fake_scontrol(tmp_path, 'echo no-such-node.invalid; echo node01'))
    with pytest.raises(ConfigError, match=r"^rank 3 on .*: the rendezvous address 'no-such-node.invalid' "
                                          r"\(MASTER_ADDR, default: the job's first node\) does not resolve here"):
        check_task(env)
    assert "MASTER_ADDR" not in env
