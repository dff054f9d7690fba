"""train/launch.py check_task: what every srun task checks before training (fast; the real thing on a
two-node cluster is tests/integration/test_slurm.py)."""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import pytest

from data.errors import ConfigError
from train.launch import check_task, dry_run, expand_nodelist, simulated_nodelist, slurm_task_env

ROOT = Path(__file__).resolve().parents[2]


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


# -- the node list: one parser, Slurm's forms -----------------------------------------------------------
# expected lists as `scontrol show hostnames` (Slurm 22.05, Debian's slurm-client) prints them; the suffix
# forms (node[1-2]-ib, x[1-2]y[3-4]z) it refuses as "Invalid hostlist" expand as the bracket rules say
@pytest.mark.parametrize("nodelist, hosts", [
    ("node[1-2]-ib", "node1-ib node2-ib"),
    ("rack[1-2]-n[01-02]", "rack1-n01 rack1-n02 rack2-n01 rack2-n02"),
    ("r[1-3]-n[1,3]", "r1-n1 r1-n3 r2-n1 r2-n3 r3-n1 r3-n3"),
    ("n[1-2][3-4]", "n13 n14 n23 n24"),
    ("x[1-2]y[3-4]z", "x1y3z x1y4z x2y3z x2y4z"),
    ("n[1-2],m3,gpu[01,03-04]", "n1 n2 m3 gpu01 gpu03 gpu04"),
    ("gpu[01-03,07],login2", "gpu01 gpu02 gpu03 gpu07 login2"),
    ("a[8-11]", "a8 a9 a10 a11"),
    ("a[08-11]", "a08 a09 a10 a11"),
    ("n[001-3]", "n001 n002 n003"),
    ("n[1-003]", "n1 n2 n3"),
    ("a,,b", "a b"),
    ("n[1-2],", "n1 n2"),
    ("node07", "node07"),
    (simulated_nodelist(64), " ".join(f"node{i:02d}" for i in range(64))),
])
def test_node_lists_expand_as_slurm_expands_them(nodelist, hosts):
    """Before: node[1-2]-ib -> node1 node2 -ib, rack[1-2]-n[01-02] -> rack1 rack2 -n01 -n02."""
    assert expand_nodelist(nodelist) == hosts.split()


@pytest.mark.parametrize("nodelist, match", [
    ("n[1-2", "an unbalanced or nested bracket"),
    ("n1]", "an unbalanced or nested bracket"),
    ("n[[1-2]]", "an unbalanced or nested bracket"),
    ("n[2-1]", r"'2-1' in \[2-1\] is not a number or a rising range lo-hi"),
    ("n[a-b]", r"'a-b' in \[a-b\] is not a number"),
    ("n[1-2-3]", r"'1-2-3' in \[1-2-3\] is not a number"),
    ("n[]", r"'' in \[\] is not a number"),
])
def test_a_malformed_node_list_is_one_line(nodelist, match):
    with pytest.raises(ConfigError, match=rf"^node list '{re.escape(nodelist)}': .*{match}.*prefix\[1-3,07\]suffix"):
        expand_nodelist(nodelist)


def _slurm_env(monkeypatch, **env) -> None:
    """A Slurm job's variables (rank 0's of 2 x 2 on node[1-2]-ib) in os.environ, no scontrol on PATH."""
    for k in list(os.environ):
        if k.startswith("SLURM_") or k in ("MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(k)
    for k, v in {**slurm_task_env(2, 2, 0, nodelist="node[1-2]-ib"), "PATH": "/nonexistent", **env}.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)


def test_dry_run_in_a_job_without_scontrol_names_slurms_hosts(monkeypatch, capsys, demo_corpus, cache_dir):
    """Before: "nodes 2: node1 node2 -ib", rank 2 on "node2" (the per-task check would refuse rightly)."""
    monkeypatch.setenv("WELLMIXED_CACHE", str(cache_dir))
    _slurm_env(monkeypatch)
    sources = {s: {"paths": [str(demo_corpus / s / "*.parquet")]} for s in ("web", "code", "books", "curated")}
    rc = dry_run(["--", "--config", str(ROOT / "configs/demo.yaml"), "--data.sources", json.dumps(sources),
                  "--data.batch_size", "1", "--data.schedule.global_batch_size", "4"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "  nodes       2: node1-ib node2-ib\n" in out
    assert "MASTER_ADDR node1-ib " in out
    assert "rank     2 node 1 (node2-ib) local 0: consumers" in out


@pytest.mark.parametrize("env, line", [
    ({"SLURM_NNODES": "two"}, "error: SLURM_NNODES='two' not a whole number: run under srun in a job submitted "
                              "with --nodes and --ntasks-per-node"),
    ({"SLURM_NTASKS_PER_NODE": ""}, "error: SLURM_NTASKS_PER_NODE is not set: submit with --ntasks-per-node (one "
                                    "task per GPU); Lightning refuses --ntasks alone"),
    ({"SLURM_JOB_NODELIST": None}, "error: SLURM_JOB_NODELIST is not set: run the dry run inside the job's "
                                   "allocation (sbatch or salloc), or pass --simulate NxG"),
    ({"SLURM_NNODES": "3"}, "error: SLURM_JOB_NODELIST 'node[1-2]-ib' names 2 host(s) (node1-ib node2-ib) but "
                            "SLURM_NNODES is 3: run the dry run inside one job's allocation, with its own variables"),
    ({"SLURM_JOB_NODELIST": "node[1-2"}, "error: node list 'node[1-2': an unbalanced or nested bracket; Slurm's form "
                                         "is prefix[1-3,07]suffix, names separated by commas"),
])
def test_dry_run_refuses_a_broken_slurm_environment_in_one_line(monkeypatch, capsys, env, line):
    """Before: ValueError (int('two'), int('')) and KeyError tracebacks; a node count that disagrees passed."""
    _slurm_env(monkeypatch, **env)
    assert dry_run(["--", "--config", str(ROOT / "configs/demo.yaml")]) == 2
    out, err = capsys.readouterr()
    assert err == line + "\n" and out == ""


@pytest.mark.parametrize("spec", ["0x2", "2x0", "x2", "2x"])
def test_dry_run_simulate_needs_a_node_and_a_task(capsys, spec):
    """Before: --simulate 0x2 -> ValueError traceback ("rank 0 outside a world of 0")."""
    with pytest.raises(SystemExit) as info:
        dry_run(["--simulate", spec, "--", "--config", str(ROOT / "configs/demo.yaml")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].endswith(f"error: --simulate {spec}: takes NxG, N nodes x G tasks per node, each at "
                                         "least 1 (e.g. 4x8)")


def test_check_names_a_broken_variable_and_a_missing_node_list():
    with pytest.raises(ConfigError, match=r"^SLURM_NNODES='two' not a whole number: run under srun"):
        check_task(_env(SLURM_NNODES="two"))
    env = _env()
    del env["SLURM_JOB_NODELIST"]
    with pytest.raises(ConfigError, match=r"^rank 3 on .*: SLURM_JOB_NODELIST is not set, so rank 0's node is unknown"):
        check_task(env)


# -- the rendezvous port -------------------------------------------------------------------------------
def test_rank_0_refuses_a_master_port_another_process_holds():
    """Before: the check passed; rank 0 then failed in torch's rendezvous with a DistNetworkError traceback.
    Only rank 0 checks (it opens the rendezvous on its own node); a free port passes."""
    host = socket.gethostname()
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError) as info:
            check_task(_env(nodes=1, rank=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
        assert str(info.value) == (
            f"rank 0 on {host}: MASTER_PORT {port} is in use on {host}, where rank 0 opens the rendezvous "
            f"(127.0.0.1:{port}); another process holds it (`ss -ltnp 'sport = :{port}'`): unset MASTER_PORT "
            "(train.sbatch derives a free one) or export a free port")
        assert check_task(_env(nodes=1, rank=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    assert check_task(_env(nodes=1, rank=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))


@pytest.mark.parametrize("extra, match", [
    ({"MASTER_PORT": "http"}, r"MASTER_PORT='http' is not a port number \(1-65535\)"),
    ({"MASTER_PORT": "70000"}, r"MASTER_PORT='70000' is not a port number"),
    ({"WELLMIXED_RENDEZVOUS_TIMEOUT": "soon"}, r"^WELLMIXED_RENDEZVOUS_TIMEOUT='soon' is not a positive number of "
                                               r"seconds: unset it \(default 900\)"),
    ({"WELLMIXED_RENDEZVOUS_TIMEOUT": "-5"}, r"^WELLMIXED_RENDEZVOUS_TIMEOUT='-5' is not a positive number"),
])
def test_rendezvous_settings_that_are_not_numbers_are_one_line(extra, match):
    with pytest.raises(ConfigError, match=match):
        check_task(_env(nodes=1, rank=1, MASTER_ADDR="127.0.0.1", **extra))


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
