"""scripts/slurm/train.sbatch on a real two-node Slurm cluster on this machine (scripts/slurm/local_cluster.sh).

The fixture installs Debian's Slurm and munge packages if missing (needs root and apt; a failure is an
error, never a skip), brings the cluster up once for the module -- slurmctld and two slurmd, each
node in its own network and UTS namespace (hostnames node1 and node2, addresses 10.213.0.11 and .12
on a bridge inside the controller's namespace) -- and tears it down at the end, also after a
failure. Every job is the script itself with ``--nodes 2 --ntasks-per-node 2`` (4 ranks, gloo DDP on
CPU, the tiny model, 2 DataLoader workers each); the rendezvous crosses from node2 to node1.

Jobs, submitted together and watched by one fixture (one reference run serves every comparison):

- ``dry``: ``DRY_RUN=1``: each srun task prints its host, node rank, global rank and data slice;
- ``ref``: uninterrupted; its order logs show 4 disjoint slices; the port derived from its job id is taken
  on node1 when it starts, so it must probe on;
- ``fault``: its own time limit (``--time=5 --signal=B:USR1@270``, nothing sent by the test) signals the
  batch shell, which forwards it: checkpoint at a step boundary on both nodes, the script requeues it (its
  limit is then raised); once resumed and 2 steps past its next checkpoint, node2 vanishes: its link is
  cut, then every process on it SIGKILLed (slurmd included), and nobody marks it DOWN. Within
  ``run.collective_timeout_s`` rank 0 names ranks 2 and 3 on node2; Slurm finds node2 dead
  (SlurmdTimeout) and requeues the job (``--requeue``); node2 comes back and the job resumes from the
  newest complete checkpoint. Its order logs and final checkpoint equal the reference's, bitwise;
- ``elastic`` (once ``ref`` has ended): a new run on node1 alone (2 ranks) from the reference's
  4-rank checkpoint of step 6: every document piece continues exactly once;
- refusals, each failing in the check step before any training: ``scontrol`` missing from PATH, a
  MASTER_ADDR that does not resolve, a loopback MASTER_ADDR in a 2-node job, and ``--ntasks 3`` with
  ``--ntasks-per-node 2`` on 2 nodes (Lightning would count 4 ranks): one error line on every task.

A session killed outright (SIGKILL) skips the teardown: ``bash scripts/slurm/local_cluster.sh down
/tmp/wm-slurm-XXXXXX`` (the folder named by the session) ends what it left.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
from training_runs import (
    TINY,
    assert_same_order,
    assert_same_weights,
    checkpoint_steps,
    copy_checkpoint,
    make_workdir,
    order_log,
)

from data.config import DataConfig, SourceConfig
from data.manifest import build_manifest
from data.schedules import fixed_schedule
from train.cursor_files import load_checkpoint_cursors
from train.launch import PEER_ANSWER_S, derived_port, probe_ports

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
CLUSTER = ROOT / "scripts" / "slurm" / "local_cluster.sh"
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "iproute2", "util-linux"]
BINARIES = ["munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo",
            "ip", "nsenter", "unshare", "setsid"]
JOB = ["--cpus-per-task=1", "--gpus-per-node=0", "--mem=0", "--time=15"]
COLLECTIVE_TIMEOUT = 20  # run.collective_timeout_s of the jobs: below the test cluster's SlurmdTimeout (30 s)
TWO_NODES = ["--nodes=2", "--ntasks-per-node=2", *JOB]
TRAIN_ARGS = TINY[2:] + ["--trainer.accelerator", "cpu", "--trainer.strategy", "ddp",
                         "--run.collective_timeout_s", str(COLLECTIVE_TIMEOUT)]
CONFIG = TINY[1]
NODE1_ADDR = "10.213.0.11"  # scripts/slurm/local_cluster.sh
ELASTIC_AT = 6
OUTER_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                    "LOCAL_WORLD_SIZE")
"""torch.distributed's variables: an outer job's (the session's own torchrun, a CI runner's) must not reach the jobs."""
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _which(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for d in ("/usr/sbin", "/usr/bin", "/sbin")
                                       if (p := Path(d) / name).is_file()), None)


def ensure_slurm_installed() -> None:
    missing = [b for b in BINARIES if _which(b) is None]
    if not missing:
        return
    why = f"binaries missing ({', '.join(missing)}); installing {' '.join(PACKAGES)} from Debian's packages"
    if shutil.which("apt-get") is None:
        pytest.fail(f"{why} needs apt-get (Debian/Ubuntu); install Slurm and munge by other means first")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"],
                ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            pytest.fail(
                f"{why}: `{' '.join(cmd)}` failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            )
    still = [b for b in BINARIES if _which(b) is None]
    if still:
        pytest.fail(f"after installing {' '.join(PACKAGES)}: still missing {still}")


class Cluster:
    """The two-node cluster of scripts/slurm/local_cluster.sh, state under ``root``; clients run on
    the controller (``local_cluster.sh exec``)."""

    def __init__(self, root: Path):
        self.root = root

    def script(self, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(["bash", str(CLUSTER), args[0], str(self.root), *args[1:]], env=env or self.env(),
                              capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"`local_cluster.sh {' '.join(args)}` failed ({proc.returncode}): "
                                 f"{proc.stdout}{proc.stderr}\n{self.logs()}")
        return proc

    def env(self, **extra: str) -> dict[str, str]:
        """The test's environment without any outer job's SLURM_* variables or rendezvous (MASTER_ADDR, RANK, ...)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in OUTER_RENDEZVOUS}
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
        env.update(extra)
        return env

    def cmd(self, *args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
        return self.script("exec", *args, env=env, check=check)

    def sbatch(self, *args: str, env: dict) -> int:
        return int(self.cmd("sbatch", "--parsable", *args, env=env).stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        out = self.cmd("scontrol", "-o", "show", "job", str(job_id)).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait_for(self, job_id: int, condition, what: str, timeout: float, log: Path | None = None) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if condition(info):
                return info
            if info.get("JobState") in FINAL or time.monotonic() > deadline:
                tail = log.read_text()[-5000:] if log is not None and log.exists() else "(no job log)"
                raise AssertionError(f"job {job_id}: {what} did not happen (JobState {info.get('JobState')}, "
                                     f"Restarts {info.get('Restarts')}):\n{tail}\n{self.logs()}")
            time.sleep(0.5)

    def on_node(self, n: int, *cmd: str) -> subprocess.Popen:
        """A process in node ``n``'s network namespace (stdout piped; ``down`` ends it at the latest)."""
        tag = dict(ln.split("=", 1) for ln in (self.root / "cluster.env").read_text().split())["TAG"]
        return subprocess.Popen(["ip", "netns", "exec", f"wm{tag}-node{n}", *cmd], stdout=subprocess.PIPE, text=True,
                                env=self.env())

    def logs(self, tail: int = 1500) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-tail:]}" for p in sorted((self.root / "log").glob("*")))


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.fail("tests/integration/test_slurm.py creates network namespaces and starts munged, slurmctld and "
                    "slurmd itself (SlurmUser=root): run the suite as root, as CI does")
    ensure_slurm_installed()
    # Not pytest's tmp_path: munge's socket path must stay short and its folders world-traversable.
    root = Path(tempfile.mkdtemp(prefix="wm-slurm-"))
    c = Cluster(root)
    try:
        c.script("up")
        yield c
    finally:
        c.script("down", check=False)
        shutil.rmtree(root, ignore_errors=True)


def _lines(run_dir: Path, rank: int = 0) -> int:
    try:
        with open(run_dir / "order_log" / f"rank{rank}.jsonl") as f:
            return sum(1 for ln in f if ln.endswith("\n"))
    except FileNotFoundError:
        return 0


def _path_without_scontrol(tmp: Path) -> str:
    """A PATH with every program of /usr/bin but scontrol (links), then /usr/sbin and /sbin."""
    farm = tmp / "bin-without-scontrol"
    farm.mkdir()
    for p in Path("/usr/bin").iterdir():
        if p.name != "scontrol":
            (farm / p.name).symlink_to(p)
    return f"{farm}:/usr/sbin:/sbin"


class Jobs:
    """Submits the module's jobs and drives the faults; every job's id, log and final state."""

    def __init__(self, slurm: Cluster, work: Path, cache_dir: Path):
        self.slurm, self.work, self.cache_dir = slurm, work, cache_dir
        self.submitted: dict[str, tuple[int, Path]] = {}
        self.done: dict[str, dict] = {}
        self.events: dict[str, int] = {}

    def submit(self, name: str, opts: list[str], args: list[str], **extra: str) -> int:
        env = self.slurm.env(REPO=str(ROOT), PY=sys.executable, RUN_NAME=name, WELLMIXED_CACHE=str(self.cache_dir),
                             WANDB_MODE="offline", WANDB_SILENT="true", PYTHONHASHSEED="0", **extra)
        job_id = self.slurm.sbatch(f"--job-name=wm-{name}", f"--chdir={self.work}",
                                   f"--output={self.work}/logs/%x-%j.out", *opts, str(SBATCH), CONFIG, *args, env=env)
        self.submitted[name] = (job_id, self.work / "logs" / f"wm-{name}-{job_id}.out")
        return job_id

    def submit_with_its_port_taken(self, name: str, opts: list[str], args: list[str]) -> subprocess.Popen:
        """Submitted held; the port derived from its job id is taken on node1 (where the batch script picks
        it) by a listening socket, then the job is released: it must probe on to the next port."""
        job_id = self.submit(name, ["--hold", *opts], args)
        port = derived_port(job_id)
        holder = self.slurm.on_node(1, sys.executable, "-c", "import socket, sys, time; s = socket.socket(); "
                                    f"s.bind(('', {port})); s.listen(); print('held', flush=True); time.sleep(3600)")
        assert holder.stdout.readline().strip() == "held", holder.communicate()
        self.events["held_port"] = port
        self.slurm.cmd("scontrol", "release", str(job_id))
        return holder

    def run_dir(self, name: str) -> Path:
        return self.work / "runs" / name

    def wait_done(self, name: str, timeout: float = 400) -> dict:
        job_id, log = self.submitted[name]
        self.done[name] = self.slurm.wait_for(job_id, lambda j: j.get("JobState") in FINAL, "completion", timeout, log)
        return self.done[name]

    def _until(self, name: str, condition, what: str, timeout: float = 300) -> None:
        job_id, log = self.submitted[name]
        deadline = time.monotonic() + timeout
        for i in itertools.count():
            if condition():
                return
            if i % 20 == 0:  # the job's state once a second (each look is a client command)
                state = self.slurm.job(job_id).get("JobState")
                if state in FINAL or time.monotonic() > deadline:
                    raise AssertionError(f"{name}: {state} before {what}:\n"
                                         f"{log.read_text()[-4000:] if log.exists() else ''}\n{self.slurm.logs()}")
            time.sleep(0.05)

    def reach_time_limit(self, name: str) -> None:
        """The job's own time limit signals it (``--signal=B:USR1@...``, nothing sent by the test); once the
        script has requeued it, its limit is raised so that the next run is not signalled again."""
        job_id, log = self.submitted[name]
        self.slurm.wait_for(job_id, lambda j: j.get("Restarts") == "1", "requeue after the time limit's signal",
                            240, log)
        self.slurm.cmd("scontrol", "update", f"jobid={job_id}", "TimeLimit=15")

    def vanish_node2(self, name: str) -> None:
        """Once the resumed job is 2 steps past a new checkpoint: node2's link is cut, then every process on it
        is killed (slurmd included); nobody tells Slurm. The survivors' collective times out and names the
        lost ranks; Slurm finds node2 dead (SlurmdTimeout) and requeues the job; node2 comes back."""
        job_id, log = self.submitted[name]
        run_dir = self.run_dir(name)
        first = self._checkpoint_step(run_dir)
        self._until(name, lambda: max(checkpoint_steps(run_dir), default=-1) > first
                    and _lines(run_dir) >= max(checkpoint_steps(run_dir)) + 2, "a checkpoint after the requeue")
        self.events["last_ckpt_before_cut"] = max(checkpoint_steps(run_dir))
        self.slurm.script("cut-link", "2")
        t0 = time.monotonic()
        self.slurm.script("kill-node", "2")  # SIGKILL; their sockets close, but no packet leaves the node
        self._until(name, lambda: "stopped answering" in log.read_text(), "the survivors' line",
                    COLLECTIVE_TIMEOUT + 60)
        self.events["detected_s"] = round(time.monotonic() - t0, 1)
        self.slurm.wait_for(job_id, lambda j: j.get("Restarts") == "2", "requeue after node2 vanished", 180, log)
        self.events["requeued_s"] = round(time.monotonic() - t0, 1)
        self.events["newest_ckpt_at_requeue"] = max(checkpoint_steps(run_dir))
        # srun's kill of the old step (the survivors exited 75) waits in slurmctld's retry queue for node2 and is
        # delivered once node2 is back, about 60 s later: it would kill the new run's step of the same id there.
        # Held until that queue is empty (a real cluster's dead node stays DOWN, so the job starts elsewhere).
        self.slurm.cmd("scontrol", "hold", str(job_id))
        self.slurm.script("restore-link", "2")
        self.slurm.script("start-node", "2")
        deadline = time.monotonic() + 150
        while "Agent queue size:     0" not in self.slurm.cmd("sdiag").stdout and time.monotonic() < deadline:
            time.sleep(1)
        self.events["held_s"] = round(time.monotonic() - t0 - self.events["requeued_s"], 1)
        self.slurm.cmd("scontrol", "release", str(job_id))
        self._until(name, lambda: log.read_text().count("resumed at step ") == 2, "the resume after node2 came back")
        self.events["release_to_resume_s"] = round(time.monotonic() - t0 - self.events["requeued_s"]
                                                   - self.events["held_s"], 1)

    def _checkpoint_step(self, run_dir: Path) -> int:
        """The step of the USR1 checkpoint (the step trained last before the stop)."""
        log = self.submitted["fault"][1].read_text()
        return next(int(ln.split("checkpoint of step ")[1].split()[0]) for ln in log.splitlines()
                    if "checkpoint of step " in ln)


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory, demo_corpus, cache_dir):
    work = make_workdir(tmp_path_factory.mktemp("slurm"), demo_corpus)
    (work / "logs").mkdir()
    t0 = time.monotonic()
    j = Jobs(cluster, work, cache_dir)
    four = TRAIN_ARGS + ["--data.batch_size", "1"]  # 4 ranks x 1 = the demo's global batch of 4
    holder = j.submit_with_its_port_taken("ref", TWO_NODES, four)
    # the time limit's signal for real: --time 5 minutes, warned 270 s before; slurmctld looks every 30 s, so it
    # comes 30 to 60 s after the start (a signal during the start-up is kept: the first step checkpoints)
    j.submit("fault", [*TWO_NODES, "--time=5", "--signal=B:USR1@270"], four)
    j.submit("dry", TWO_NODES, four, DRY_RUN="1")
    j.submit("no-scontrol", [*TWO_NODES, f"--export=ALL,PATH={_path_without_scontrol(work)}"], four)
    j.submit("unresolvable", TWO_NODES, four, MASTER_ADDR="no-such-node.invalid")
    j.submit("loopback", TWO_NODES, four, MASTER_ADDR="localhost")
    j.submit("ntasks", ["--nodes=2", "--ntasks=3", "--ntasks-per-node=2", *JOB], four)
    j.reach_time_limit("fault")
    j.wait_done("ref")
    holder.kill()
    ckpt = j.run_dir("elastic") / "checkpoints" / f"step{ELASTIC_AT:07d}.ckpt"
    copy_checkpoint(j.run_dir("ref") / "checkpoints" / ckpt.name, ckpt.parent)
    j.submit("elastic", ["--nodes=1", "--ntasks-per-node=2", "--nodelist=node1", *JOB],
             TRAIN_ARGS + ["--data.batch_size", "2", "--ckpt_path", str(ckpt)])
    for name in ("dry", "no-scontrol", "unresolvable", "loopback", "ntasks"):
        j.wait_done(name)
    j.vanish_node2("fault")
    for name in ("fault", "elastic"):
        j.wait_done(name)
    j.events["seconds"] = int(time.monotonic() - t0)
    print(f"test_slurm: all jobs done in {j.events['seconds']} s; {j.events}")
    return j


def _log(jobs: Jobs, name: str) -> str:
    return jobs.submitted[name][1].read_text()


def _assert_completed(jobs: Jobs, name: str) -> None:
    info = jobs.done[name]
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", \
        f"{name}: {info['JobState']} {info['ExitCode']}:\n{_log(jobs, name)[-5000:]}"


def _checksums(out: str) -> dict[int, str]:
    """step -> the checksum of the weights that all 4 ranks agreed on at that checkpoint (train/module.py)."""
    return {int(m[1]): m[2] for m in re.finditer(r"step (\d+): the weights of 4 ranks agree \(checksum (\w+)\)", out)}


def _pieces(lines: list[dict]) -> list[tuple[str, int]]:
    return [(p[0], p[1]) for ln in lines for p in ln["pieces"]]


def test_dry_run_prints_each_tasks_host_ranks_and_slice(jobs):
    _assert_completed(jobs, "dry")
    out = _log(jobs, "dry")
    assert "nodes       2: node1 node2" in out
    assert "world size  4 = 2 nodes x 2 tasks per node" in out
    assert "global_batch_size 4: ok" in out
    # each task's block, as that task resolved it on its own host (srun --label)
    for rank in range(4):
        node, local = divmod(rank, 2)
        assert f"{rank}: rank {rank} of 4: node {node} local {local} on node{node + 1}; " \
               f"rendezvous node1 ({NODE1_ADDR})" in out, out[-4000:]
        assert f"{rank}: rank     {rank} node {node} (node{node + 1}) local {local}: " \
               f"consumers {2 * rank}..{2 * rank + 1} of 8" in out, out[-4000:]
    for c in range(8):
        assert f"consumer {c}: web " in out
    assert not jobs.run_dir("dry").exists()  # nothing trained, nothing written


def test_four_ranks_on_two_hosts_read_disjoint_slices(jobs):
    _assert_completed(jobs, "ref")
    logs = order_log(jobs.run_dir("ref"))
    assert sorted(logs) == [0, 1, 2, 3] and len({len(v) for v in logs.values()}) == 1 and len(logs[0]) > 15
    pieces = Counter(p for lines in logs.values() for p in _pieces(lines))
    assert max(pieces.values()) == 1, [p for p, n in pieces.items() if n > 1][:10]  # exactly once
    docs = {r: {p[0] for line in lines for p in line["pieces"]} for r, lines in logs.items()}
    for a in range(4):
        for b in range(a + 1, 4):
            assert docs[a] and not docs[a] & docs[b], (a, b, sorted(docs[a] & docs[b])[:5])
    out = _log(jobs, "ref")
    # ranks 2 and 3 run on node2 and meet rank 0 at node1's address (not the submit host's)
    for rank in range(4):
        node = rank // 2
        assert f"{rank}: rank {rank} of 4: node {node} local {rank % 2} on node{node + 1}; " \
               f"rendezvous node1 ({NODE1_ADDR})" in out, out[-4000:]
    for rank in range(4):  # printed by each rank as it joins the process group (not the script's banner)
        assert f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/4" in out, out[-4000:]
    assert "All distributed processes registered. Starting with 4 processes" in out
    # the 4 ranks hold the same weights at every checkpoint (compared across ranks, not only rank 0's file)
    steps = checkpoint_steps(jobs.run_dir("ref"))
    assert set(steps) <= set(_checksums(out)) and len(steps) >= 5, (steps, _checksums(out))


def test_time_limit_signal_then_a_vanished_node_resume_from_the_newest_checkpoint_exactly(jobs):
    """Two faults in one job, each followed by a resume on both nodes. The time limit's own signal (nothing
    sent by the test): checkpoint at a step boundary, the script requeues. Then node2 vanishes (link cut,
    processes killed, nobody tells Slurm): within the collective timeout the survivors end with one line
    naming ranks 2 and 3 on node2, Slurm requeues the job, and it resumes from the newest complete checkpoint.
    The order logs equal the reference line for line on all 4 ranks (losses bitwise), and so do the final
    checkpoint's weights and optimizer state (train/parallel.py fix_bucket_layout)."""
    _assert_completed(jobs, "fault")
    _assert_completed(jobs, "ref")
    info, ev = jobs.done["fault"], jobs.events
    assert info["Restarts"] == "2", info
    out = _log(jobs, "fault")
    assert "SIGUSR1 received: forwarded to the ranks" in out and "requeueing job" in out, out[-5000:]
    assert "every rank checkpoints at its next step boundary" not in out  # a promise a dead node breaks
    assert "(restart 1)" in out and "(restart 2)" in out and "--ckpt_path last_or_new" in out, out[-5000:]
    step = jobs._checkpoint_step(jobs.run_dir("fault"))
    assert 1 <= step < 16, step  # stopped mid-run, at a step boundary
    lost = [ln for ln in out.splitlines() if ln.startswith("error:")]  # the ranks' own lines (not srun's)
    assert len(lost) == 1 and lost[0].startswith("error: rank 0 on node1: rank(s) 2, 3 on node2 stopped answering: "
                                                 f"Timed out waiting {COLLECTIVE_TIMEOUT * 1000}ms"), lost
    assert ev["detected_s"] <= COLLECTIVE_TIMEOUT + PEER_ANSWER_S + 15, ev
    # resumed from the newest complete checkpoint: the one the job had when node2 vanished
    resumed = [int(ln.split("resumed at step ")[1].split()[0]) for ln in out.splitlines() if "resumed at step " in ln]
    assert resumed == [step, ev["last_ckpt_before_cut"]] and ev["newest_ckpt_at_requeue"] == resumed[1], (resumed, ev)
    assert resumed[1] > step, ev
    ckpts = jobs.run_dir("fault") / "checkpoints"
    assert not list(ckpts.glob("hpc_ckpt*")), "Lightning's own SLURM requeue checkpoint must not be used"
    # exactly once and bitwise: every order-log line (pieces, losses, lr) and the final weights and Adam state
    assert_same_order(order_log(jobs.run_dir("ref")), order_log(jobs.run_dir("fault")))
    assert_same_weights(jobs.run_dir("ref") / "checkpoints" / "last.ckpt", ckpts / "last.ckpt")
    ref_sums, sums = _checksums(_log(jobs, "ref")), _checksums(out)  # every checkpoint: ranks agree, as in ref
    assert {st: sums[st] for st in ref_sums if st in sums} == {st: ref_sums[st] for st in sums if st in ref_sums}
    assert set(checkpoint_steps(jobs.run_dir("fault"))) <= set(sums), (sums, checkpoint_steps(jobs.run_dir("fault")))


def test_a_taken_derived_port_is_skipped_and_jobs_sharing_nodes_get_distinct_ports(jobs):
    ports = {}
    for name in ("ref", "fault"):
        for ln in _log(jobs, name).splitlines():
            if ln.startswith("[train.sbatch") and "rendezvous " in ln:
                ports.setdefault(name, []).append(int(ln.split("rendezvous ")[1].split(";")[0].rsplit(":", 1)[1]))
    # ref's derived port was held on node1 by another process: the next probe (+1009), and ref trained on it
    _assert_completed(jobs, "ref")
    held = jobs.events["held_port"]
    assert held == derived_port(jobs.submitted["ref"][0]) and ports["ref"] == [probe_ports(held, 2)[1]], ports
    # ref and fault ran at the same time on the same nodes; fault ran three times
    assert len(ports["fault"]) == 3 and ports["ref"][0] not in ports["fault"], ports
    assert all(20000 <= p < 30000 for ps in ports.values() for p in ps), ports


def test_the_jobs_environment_drops_an_outer_jobs_slurm_and_rendezvous_variables(monkeypatch):
    for k, v in {"SLURM_JOB_ID": "7", "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29500", "RANK": "3",
                 "WORLD_SIZE": "8", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    env = Cluster(Path("/nonexistent")).env(MASTER_ADDR="no-such-node.invalid")
    assert not {"SLURM_JOB_ID", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"} & set(env)
    assert env["MASTER_ADDR"] == "no-such-node.invalid"  # what a job is given on purpose stays


def _in_flight(ckpt: Path, demo_corpus: Path, cache_dir: Path, pending: bool = False) -> set[tuple[str, int]]:
    """(doc id, token offset) of every document a checkpoint's cursors hold in the middle: in a row of
    the packer, handed back between steps, or (``pending``) waiting for its source's turn."""
    import torch

    names = ("web", "code", "books", "curated")
    m = build_manifest(DataConfig(sources={s: SourceConfig(paths=[str(demo_corpus / s / "*.parquet")])
                                              for s in names},
                                     schedule=fixed_schedule(dict.fromkeys(names, 0.25), 128),
                                     manifest_cache=str(cache_dir)))
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["WellMixedData"]
    keys = ("rows", "continuations") + (("pending",) if pending else ())
    return {(m.doc_id(shard, row), off) for rank in load_checkpoint_cursors(ckpt, state) for cur in rank
            for key in keys for (src, shard, row, epoch, off) in filter(None, cur.get(key, []))}


def test_restart_on_one_node_from_the_four_rank_checkpoint_reads_each_piece_once(jobs, demo_corpus, cache_dir):
    _assert_completed(jobs, "elastic")
    out = _log(jobs, "elastic")
    assert "1 node(s) [node1] x 2 task(s) = world size 2" in out and f"elastic resume at step {ELASTIC_AT}" in out
    ref = order_log(jobs.run_dir("ref"))
    after = order_log(jobs.run_dir("elastic"))
    assert sorted(after) == [0, 1]
    for lines in after.values():
        assert [ln["step"] for ln in lines] == list(range(ELASTIC_AT, len(ref[0])))
        for ln in lines:  # schedules: the same values at the same step as the uninterrupted run
            want = ref[0][ln["step"]]
            assert (ln["seq_len"], ln["weights"], ln["lr"]) == (want["seq_len"], want["weights"], want["lr"])
    before = [ref[r][s] for s in range(ELASTIC_AT) for r in range(4)]
    later = [after[r][i] for i in range(len(after[0])) for r in (0, 1)]
    seen = Counter(_pieces(before + later))
    assert max(seen.values()) == 1, [p for p, n in seen.items() if n > 1][:10]
    at: dict[str, int] = {}  # in order, each document continues where it stopped: no token skipped or repeated
    for ln in before + later:
        for doc, off, n in ln["pieces"]:
            assert off == at.get(doc, 0), (ln["step"], ln["rank"], doc, off, at.get(doc, 0))
            at[doc] = off + n
    # every document the 4 old consumers held in the middle is continued once, or still waits in the end
    ckpts = jobs.run_dir("elastic") / "checkpoints"
    leftovers = _in_flight(ckpts / f"step{ELASTIC_AT:07d}.ckpt", demo_corpus, cache_dir)
    waiting = _in_flight(ckpts / "last.ckpt", demo_corpus, cache_dir, pending=True)
    continued = Counter(_pieces(later))
    assert len(leftovers) >= 4, leftovers
    for piece in leftovers:
        assert continued[piece] + (piece in waiting) == 1, f"{piece} of the 4-rank layout not continued exactly once"


@pytest.mark.parametrize("name, line", [
    ("no-scontrol", "scontrol is not on PATH, so rank 0's node cannot be read from SLURM_JOB_NODELIST"),
    ("unresolvable", "the rendezvous address 'no-such-node.invalid' (MASTER_ADDR, default: the job's first "
                     "node) does not resolve here"),
    ("loopback", "the rendezvous address localhost is loopback (127.0.0.1) in a 2-node job: each node would "
                 "form its own world"),
    ("ntasks", "world size disagrees: SLURM_NTASKS is 3, but Lightning counts SLURM_NNODES 2 x "
               "SLURM_NTASKS_PER_NODE 2 = 4 ranks"),
])
def test_a_layout_or_rendezvous_problem_is_one_line_on_every_task_and_nothing_trains(jobs, name, line):
    info = jobs.done[name]
    out = _log(jobs, name)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", (info["JobState"], info["ExitCode"], out)
    tasks = 3 if name == "ntasks" else 4
    for task in range(tasks):
        node = 1 if task < 2 else 2
        mine = [ln for ln in out.splitlines() if ln.startswith(f"{task}: error: ")]
        assert len(mine) == 1 and line in mine[0], (task, out)
        assert f"error: rank {task} on node{node}: " in mine[0], mine
    assert "refused: see the error lines above" in out, out
    assert not (jobs.run_dir(name) / "order_log").exists() and "Seed set" not in out  # no rank started training
