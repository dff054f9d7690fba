"""scripts/slurm/train.sbatch against a real Slurm: a one-node cluster on localhost, started by the test.

Slurm and munge come from Debian's packages (installed here if missing: needs root and apt; a failure
is an error, never a skip). The fixture writes a minimal slurm.conf into a temporary folder, starts
munged, slurmctld and slurmd on free ports, and stops every daemon it started (by pid file) when the
module ends, also after a failure.

Three jobs run at once, each 2 tasks (gloo DDP on CPU, the tiny model, ~21 steps):

- a dry run (``DRY_RUN=1``): every srun task prints the rank Lightning resolves and its data slice;
- the reference: uninterrupted; its order logs show the two ranks read disjoint documents;
- the preempted job: ``scancel --signal=USR1 --batch`` once it has trained a few steps -- the
  delivery ``#SBATCH --signal=B:USR1@180`` makes before the time limit. The batch shell forwards the
  signal, the ranks checkpoint at the next step and exit, the script runs ``scontrol requeue``; Slurm
  starts the requeued job by itself once the old incarnation's job credential has expired (here
  ``cred_expire=10``: the default holds a requeued job back ~2 minutes, and forcing an earlier start
  with ``scontrol update StartTime=now`` fails the job with "Job credential revoked"), and the resumed
  run's order logs must equal the reference, line for line (document pieces, losses bitwise, lr,
  sequence lengths).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from training_runs import TINY, assert_same_order, make_workdir, order_log

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo"]
# 2 tasks x 1 CPU each; three jobs share the node (declared CPUs: see LocalSlurm.start)
JOB_OPTS = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", "--mem=0", "--time=15"]
TRAIN_ARGS = TINY[2:] + ["--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--data.batch_size", "2"]
CONFIG = TINY[1]
CRED_EXPIRE = 10  # seconds; Slurm's minimum is 5
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _which(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for d in ("/usr/sbin", "/usr/bin", "/sbin")
                                       if (p := Path(d) / name).is_file()), None)


def ensure_slurm_installed() -> None:
    missing = [b for b in BINARIES if _which(b) is None]
    if not missing:
        return
    why = f"Slurm/munge binaries missing ({', '.join(missing)}); installing {' '.join(PACKAGES)} from Debian's packages"
    if os.geteuid() != 0:
        pytest.fail(f"{why} needs root: run as root, or `sudo apt-get install {' '.join(PACKAGES)}` first")
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    """munged + slurmctld + slurmd for this host, all state under one temporary folder."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.pidfiles = {"slurmd": root / "slurmd.pid", "slurmctld": root / "slurmctld.pid",
                         "munged": root / "munge" / "munged.pid"}
        self.started: dict[str, int] = {}

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r, 0o755)
        os.chmod(r / "munge", 0o755)  # munged refuses a socket folder that only its owner can enter
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        socket_path = r / "munge" / "munge.socket.2"
        self._daemon("munged", [_which("munged"), f"--key-file={key}", f"--socket={socket_path}",
                                f"--pid-file={self.pidfiles['munged']}", f"--log-file={r / 'munge' / 'munged.log'}",
                                f"--seed-file={r / 'munge' / 'munge.seed'}"])
        host = socket.gethostname()
        self.conf.write_text("\n".join([
            "ClusterName=wmtest",
            # job ids (and so the derived master ports) differ from one test session to the next
            f"FirstJobId={random.randrange(10_000, 1_000_000)}",
            f"SlurmctldHost={host}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            # a requeued job may start again once its old credential expired: CRED_EXPIRE + 1 s
            # (Slurm's default is 120 s; starting it earlier kills it, "Job credential revoked")
            f"AuthInfo=socket={socket_path},cred_expire={CRED_EXPIRE}",
            "CredType=cred/munge",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={self.pidfiles['slurmctld']}",
            f"SlurmdPidFile={self.pidfiles['slurmd']}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "ReturnToService=2",
            # 6 schedulable CPUs (whatever the machine has): three 2-task jobs run side by side
            "SlurmdParameters=config_overrides",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs=6 RealMemory=4000 State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")
        self._daemon("slurmctld", [_which("slurmctld"), "-f", str(self.conf)])
        self._daemon("slurmd", [_which("slurmd"), "-f", str(self.conf)])
        deadline = time.monotonic() + 60
        while True:
            out = self.cmd("sinfo", "-h", "-o", "%t", check=False).stdout.strip()
            if out in ("idle", "mix", "alloc"):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the local Slurm node did not come up (sinfo: {out!r}):\n{self.logs()}")
            time.sleep(0.3)

    def _daemon(self, name: str, cmd: list[str]) -> None:
        proc = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise AssertionError(f"{name} did not start ({proc.returncode}): {proc.stderr}\n{self.logs()}")
        pidfile = self.pidfiles[name]
        deadline = time.monotonic() + 20
        while not (pidfile.exists() and pidfile.read_text().strip()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}: no pid file {pidfile}\n{self.logs()}")
            time.sleep(0.05)
        self.started[name] = int(pidfile.read_text().split()[0])

    def stop(self) -> None:
        """Cancel every job of this cluster, then end the daemons this fixture started, by pid."""
        if "slurmctld" in self.started:
            ids = self.cmd("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if ids:
                self.cmd("scancel", *ids, check=False)
                deadline = time.monotonic() + 30
                while self.cmd("squeue", "-h", "-o", "%i", check=False).stdout.strip() and time.monotonic() < deadline:
                    time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.started.pop(name, None)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 15
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            if Path(f"/proc/{pid}").exists():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # -- clients ---------------------------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        """The test's environment without any outer job's SLURM_* variables, pointed at this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
        env.update(extra)
        return env

    def cmd(self, *args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(args), env=env or self.env(), capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr}\n{self.logs()}")
        return proc

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
            time.sleep(0.2)

    def job_logs(self, job_id: int) -> str:
        """Every slurmctld and slurmd log line that names ``job_id`` (JobId=N, job N, StepId=N.*)."""
        out = []
        for p in (self.root / "log" / "slurmctld.log", self.root / "log" / "slurmd.log"):
            if p.exists():
                lines = [ln for ln in p.read_text().splitlines() if str(job_id) in ln]
                out.append(f"--- {p.name} (lines naming {job_id})\n" + "\n".join(lines[-80:]))
        return "\n".join(out)

    def logs(self, tail: int = 1500) -> str:
        out = []
        for p in (
            self.root / "log" / "slurmctld.log",
            self.root / "log" / "slurmd.log",
            self.root / "munge" / "munged.log",
        ):
            if p.exists():
                out.append(f"--- {p.name}\n{p.read_text()[-tail:]}")
        return "\n".join(out)


@pytest.fixture(scope="module")
def slurm():
    if os.geteuid() != 0:
        pytest.fail("tests/integration/test_slurm.py starts munged, slurmctld and slurmd itself (SlurmUser=root): "
                    "run the suite as root, as CI does")
    ensure_slurm_installed()
    # Not pytest's tmp_path: munge's socket path must stay short and its folders world-traversable.
    root = Path(tempfile.mkdtemp(prefix="wm-slurm-"))
    cluster = LocalSlurm(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _lines(run_dir: Path, rank: int = 0) -> int:
    try:
        with open(run_dir / "order_log" / f"rank{rank}.jsonl") as f:
            return sum(1 for ln in f if ln.endswith("\n"))
    except FileNotFoundError:
        return 0


@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory, demo_corpus, cache_dir):
    """Submit the dry run, the reference and the job to preempt; preempt it; wait for all three."""
    work = make_workdir(tmp_path_factory.mktemp("slurm"), demo_corpus)
    (work / "logs").mkdir()
    t0 = time.monotonic()
    submitted = {}
    for name, extra in (("dry", {"DRY_RUN": "1"}), ("ref", {}), ("pre", {})):
        env = slurm.env(
            REPO=str(ROOT),
            PY=sys.executable,
            RUN_NAME=name,
            WELLMIXED_CACHE=str(cache_dir),
            WANDB_MODE="offline",
            WANDB_SILENT="true",
            PYTHONHASHSEED="0",
            **extra,
        )
        job_id = slurm.sbatch(f"--job-name=wm-{name}", f"--chdir={work}", f"--output={work}/logs/%x-%j.out",
                              *JOB_OPTS, str(SBATCH), CONFIG, *TRAIN_ARGS, env=env)
        submitted[name] = (job_id, work / "logs" / f"wm-{name}-{job_id}.out")
    pre_id, pre_log = submitted["pre"]
    pre_dir = work / "runs" / "pre"

    # preempt once a few steps are trained: the signal the time limit would send (B: the batch shell)
    deadline = time.monotonic() + 180
    while _lines(pre_dir) < 3:
        state = slurm.job(pre_id).get("JobState")
        if state in FINAL or time.monotonic() > deadline:
            raise AssertionError(f"job to preempt: {state} before 3 steps:\n"
                                 f"{pre_log.read_text()[-4000:] if pre_log.exists() else ''}\n{slurm.logs()}")
        time.sleep(0.05)
    slurm.cmd("scancel", "--signal=USR1", "--batch", str(pre_id))
    signalled_at = _lines(pre_dir)
    info = slurm.wait_for(pre_id, lambda j: j.get("JobState") == "PENDING" and j.get("Restarts") == "1",
                          "requeue after SIGUSR1", 120, pre_log)
    requeued_begin = info.get("StartTime")  # Slurm's hold-back: the credential lifetime

    done = {}
    for name, (job_id, log) in submitted.items():
        done[name] = slurm.wait_for(job_id, lambda j: j.get("JobState") in FINAL, "completion", 300, log)
    return {
        "work": work, "submitted": submitted, "done": done, "signalled_at": signalled_at,
        "daemon_logs": {name: slurm.job_logs(job_id) for name, (job_id, _) in submitted.items()},
        "requeued_begin": requeued_begin, "seconds": time.monotonic() - t0,
    }


def _log(jobs, name: str) -> str:
    return jobs["submitted"][name][1].read_text()


def _assert_completed(jobs, name: str) -> None:
    info = jobs["done"][name]
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", \
        f"{name}: {info['JobState']} {info['ExitCode']}:\n{_log(jobs, name)[-5000:]}\n{jobs['daemon_logs'][name]}"


def test_dry_run_prints_nodes_world_size_and_slices_per_srun_task(jobs):
    _assert_completed(jobs, "dry")
    out = _log(jobs, "dry")
    host = socket.gethostname()
    assert f"nodes       1: {host}" in out
    assert "world size  2 = 1 nodes x 2 tasks per node" in out
    assert "global_batch_size 4: ok" in out
    # each task's block, as Lightning's SLURMEnvironment resolved it inside that task (srun --label)
    assert f"0: rank     0 node 0 ({host}) local 0: consumers 0..1 of 4" in out
    assert f"1: rank     1 node 0 ({host}) local 1: consumers 2..3 of 4" in out
    for c in range(4):
        assert f"consumer {c}: web " in out
    assert not (jobs["work"] / "runs" / "dry").exists()  # nothing trained, nothing written


def test_two_ranks_read_disjoint_documents(jobs):
    _assert_completed(jobs, "ref")
    logs = order_log(jobs["work"] / "runs" / "ref")
    assert sorted(logs) == [0, 1] and len(logs[0]) == len(logs[1]) > 15
    docs = {r: {p[0] for line in lines for p in line["pieces"]} for r, lines in logs.items()}
    assert docs[0] and docs[1] and not docs[0] & docs[1], sorted(docs[0] & docs[1])[:10]
    out = _log(jobs, "ref")
    assert "world size 2" in out and "distributed_backend=gloo" in out


def test_preempted_job_requeues_and_resumes_exactly(jobs):
    _assert_completed(jobs, "pre")
    _assert_completed(jobs, "ref")
    info = jobs["done"]["pre"]
    assert info["Restarts"] == "1", info
    out = _log(jobs, "pre")
    assert "SIGUSR1 received" in out and "requeueing job" in out, out[-5000:]
    assert "(restart 1)" in out and "--ckpt_path last" in out, out[-5000:]
    step = next(int(ln.split("checkpoint of step ")[1].split()[0]) for ln in out.splitlines()
                if "checkpoint of step " in ln)
    assert jobs["signalled_at"] <= step < 21, (jobs["signalled_at"], step)  # stopped mid-run, at a step boundary
    ckpts = jobs["work"] / "runs" / "pre" / "checkpoints"
    assert not list(ckpts.glob("hpc_ckpt*")), "Lightning's own SLURM requeue checkpoint must not be used"
    ref = order_log(jobs["work"] / "runs" / "ref")
    got = order_log(jobs["work"] / "runs" / "pre")
    assert_same_order(ref, got)  # every step once, pieces and losses identical to the uninterrupted run


def test_jobs_sharing_a_node_get_distinct_master_ports(jobs):
    ports = {}
    for name in ("ref", "pre"):
        for ln in _log(jobs, name).splitlines():
            if "rendezvous " in ln:
                ports.setdefault(name, []).append(int(ln.split("rendezvous ")[1].split(";")[0].rsplit(":", 1)[1]))
    # ref and pre ran at the same time on the same node; pre ran twice (before and after the requeue)
    assert ports["ref"][0] != ports["pre"][0], ports
    assert all(20000 <= p < 30000 for ps in ports.values() for p in ps), ports
