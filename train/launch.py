"""SLURM launch helpers for ``scripts/slurm/train.sbatch``: a master port, the rank layout, the dry run.

::
    python -m train.launch port                                  # a free MASTER_PORT for this job
    python -m train.launch dry-run [--simulate 4x8] -- --config CONFIG [overrides ...]
    srun python -m train.launch dry-run --task -- --config CONFIG [overrides ...]   # one line per task
    srun python -m train.launch check                            # each task's layout and rendezvous, or why not
    srun python -m train.launch fit --config CONFIG [overrides ...]   # check, then ``python -m train fit``

What each does and why (the port range and probe step, the rank layout, the rendezvous address, the
checks every task makes before training): docs/slurm.md. :func:`master_port` derives ``MASTER_PORT``
from the job id, where Lightning's own choice collides between jobs sharing a node;
:func:`slurm_task_env` writes a simulated task's ``SLURM_*`` variables and :func:`rank_info` reads them
back through Lightning's own class; :func:`expand_nodelist` is the one reader of a Slurm node list;
:func:`check_task` refuses, on every task, a job whose tasks, rendezvous address or port would hang or
train the wrong data slices, and :func:`checked_fit` bounds the wait for the rendezvous. The dry run
parses the config exactly as ``python -m train fit`` does but instantiates only the data (no model, no
trainer, no GPU): it runs on a login node and prints each rank's consumers and the first chunks they open.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from data.errors import ConfigError
from train.early_signals import install_early_handlers

if TYPE_CHECKING:
    from data.types import TrainingContext

PORT_BASE = 20000
PORT_SPAN = 10000
PORT_STRIDE = 1009  # prime, coprime with PORT_SPAN: the probes visit every port of the range
SCONTROL_TIMEOUT_S = 30.0
RENDEZVOUS_TIMEOUT_VAR = "WELLMIXED_RENDEZVOUS_TIMEOUT"
RENDEZVOUS_TIMEOUT_S = 900.0
"""How long after its launch a rank of a multi-rank job may take to meet the others (torch's process group
formed): the start-up on a real cluster (imports, config, cached manifest, checkpoint verified, model built:
minutes), with room."""


# -- master port -------------------------------------------------------------------------------
def derived_port(job_id: int, array_job_id: int | None = None, array_task_id: int | None = None) -> int:
    """The first port to try: from the array job id + task id for an array task, else the job id."""
    key = array_job_id + array_task_id if array_job_id is not None and array_task_id is not None else job_id
    return PORT_BASE + key % PORT_SPAN


def port_is_free(port: int, host: str = "", reuse_addr: bool = False) -> bool:
    """Whether ``port`` can be bound on this host now; without ``reuse_addr`` a port in TIME_WAIT counts as
    taken too, with it (as torch's rendezvous store binds) only a port another socket holds."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if reuse_addr:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def master_port(env: dict | None = None, tries: int = 200) -> int:
    """A MASTER_PORT for the job in ``env`` (default os.environ) that is free on this host now.

    Between this check and rank 0's bind another process could take the port; the derivation keeps
    that unlikely (jobs started close together get different ports), it does not rule it out."""
    env = os.environ if env is None else env

    def _int(name: str) -> int | None:
        v = env.get(name)
        return int(v) if v is not None and v.isdigit() else None

    job = _int("SLURM_JOB_ID") or os.getpid()
    first = derived_port(job, _int("SLURM_ARRAY_JOB_ID"), _int("SLURM_ARRAY_TASK_ID"))
    for port in probe_ports(first, tries):
        if port_is_free(port):
            return port
    raise RuntimeError(f"no free port in {tries} tries from {first}")


def probe_ports(first: int, tries: int) -> list[int]:
    """``first``, then steps of PORT_STRIDE (wrapping in the range), not ``first + 1``: the port of the job
    submitted right after, which may be starting on the same node (docs/slurm.md)."""
    return [PORT_BASE + (first - PORT_BASE + i * PORT_STRIDE) % PORT_SPAN for i in range(tries)]


# -- rank layout -------------------------------------------------------------------------------
def expand_nodelist(nodelist: str, scontrol: str | None = None) -> list[str]:
    """The hosts of a Slurm node list, in Slurm's order: ``n[1-2],m3,gpu[01,03-04]`` -> n1 n2 m3 gpu01 gpu03
    gpu04. With ``scontrol`` (its path) the site's own ``scontrol show hostnames`` decides; without, Slurm's
    rules here: comma-separated names, each any text around bracket groups (``node[1-2]-ib``), several groups
    a cartesian product with the first outermost (``rack[1-2]-n[01-02]`` -> rack1-n01 rack1-n02 rack2-n01
    rack2-n02), a group a comma list of numbers and ranges, zero padded as the range's first number. One
    ConfigError line for a malformed list or an ``scontrol`` that fails or hangs."""
    if scontrol is not None:
        cmd = f"scontrol show hostnames {nodelist}"
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=SCONTROL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"`{cmd}` did not answer in {SCONTROL_TIMEOUT_S:.0f} s (slurmctld or the Slurm "
                              "configuration unreachable?): export MASTER_ADDR=<first node>, or fix the Slurm "
                              "client configuration") from None
        if out.returncode != 0 or not out.stdout.split():  # Slurm 22.05 exits 0 on an invalid list, printing nothing
            raise ConfigError(f"`{cmd}` failed ({out.returncode}: {' '.join(out.stderr.split())[:200]}): "
                              "export MASTER_ADDR=<first node> or fix the Slurm client configuration")
        return out.stdout.split()
    if re.search(r"[\[\]]", re.sub(r"\[[^\[\]]*\]", "", nodelist)):
        raise ConfigError(f"node list {nodelist!r}: an unbalanced or nested bracket; Slurm's form is "
                          "prefix[1-3,07]suffix, names separated by commas")
    hosts = []
    for name in re.findall(r"(?:[^,\s\[\]]|\[[^\[\]]*\])+", nodelist):  # commas outside brackets separate
        parts = re.split(r"\[([^\[\]]*)\]", name)  # text, group, text, group, ..., text
        expanded = [""]
        for i, part in enumerate(parts):
            if i % 2 == 0:
                expanded = [h + part for h in expanded]
                continue
            numbers = []
            for item in part.split(","):
                lo, _, hi = item.partition("-")
                hi = hi or lo
                if not (lo.isdigit() and hi.isdigit() and int(lo) <= int(hi)):
                    raise ConfigError(f"node list {nodelist!r}: {item!r} in [{part}] is not a number or a rising "
                                      "range lo-hi; Slurm's form is prefix[1-3,07]suffix")
                numbers += [f"{n:0{len(lo)}d}" for n in range(int(lo), int(hi) + 1)]
            expanded = [h + n for h in expanded for n in numbers]
        hosts += expanded
    return hosts


def simulated_nodelist(nodes: int) -> str:
    width = max(2, len(str(nodes - 1)))
    return f"node[{0:0{width}d}-{nodes - 1:0{width}d}]" if nodes > 1 else f"node{0:0{width}d}"


def slurm_task_env(nodes: int, tasks_per_node: int, global_rank: int, job_id: int = 4242,
                   nodelist: str | None = None, job_name: str = "wellmixed") -> dict[str, str]:
    """The SLURM variables srun sets for task ``global_rank`` of an ``nodes x tasks_per_node`` job
    (block distribution: consecutive ranks fill a node first)."""
    nodelist = nodelist or simulated_nodelist(nodes)
    world = nodes * tasks_per_node
    if not 0 <= global_rank < world:
        raise ValueError(f"rank {global_rank} outside a world of {world}")
    return {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOBID": str(job_id),
        "SLURM_JOB_NAME": job_name,
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist,
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NTASKS": str(world),
        "SLURM_NPROCS": str(world),
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
        "SLURM_TASKS_PER_NODE": f"{tasks_per_node}(x{nodes})" if nodes > 1 else str(tasks_per_node),
        "SLURM_PROCID": str(global_rank),
        "SLURM_LOCALID": str(global_rank % tasks_per_node),
        "SLURM_NODEID": str(global_rank // tasks_per_node),
        "SLURM_STEP_NUM_TASKS": str(world),
        "SLURM_STEP_NUM_NODES": str(nodes),
    }


@contextlib.contextmanager
def patched_environ(env: dict[str, str]) -> Iterator[None]:
    """os.environ with ``env`` applied and every other SLURM_* / MASTER_* variable removed; restored after."""
    saved = dict(os.environ)
    for k in list(os.environ):
        if k.startswith("SLURM_") or k in ("MASTER_ADDR", "MASTER_PORT"):
            del os.environ[k]
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@dataclass(frozen=True)
class RankInfo:
    global_rank: int
    local_rank: int
    node_rank: int
    world_size: int
    main_address: str
    main_port: int


def rank_info() -> RankInfo:
    """What Lightning's SLURMEnvironment makes of the current environment (as inside a task)."""

    from lightning.fabric.plugins.environments import SLURMEnvironment

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "srun is available but not used": expected in a simulation
        env = SLURMEnvironment(auto_requeue=False)
    return RankInfo(env.global_rank(), env.local_rank(), env.node_rank(), env.world_size(),
                    env.main_address, env.main_port)


def consumer_ids(rank: int, num_workers: int) -> list[int]:
    """The consumers (global order slices) rank ``rank`` runs: one per DataLoader worker."""
    workers = max(1, num_workers)
    return [rank * workers + w for w in range(workers)]


# -- every task's layout and rendezvous, checked before training -----------------------------------
def first_node(nodelist: str, path: str | None = None) -> str:
    """Rank 0's node: the first host of the job's node list, as ``scontrol show hostnames`` expands it
    (``scontrol`` looked up on ``path``, default PATH)."""
    if not nodelist.strip():
        raise ConfigError("SLURM_JOB_NODELIST is not set, so rank 0's node is unknown: run under srun in a Slurm "
                          "job, or export MASTER_ADDR=<first node>")
    scontrol = shutil.which("scontrol", path=path)
    if scontrol is None:
        raise ConfigError(f"scontrol is not on PATH, so rank 0's node cannot be read from SLURM_JOB_NODELIST "
                          f"{nodelist!r}: put Slurm's bin directory on PATH, or export MASTER_ADDR=<first node>")
    return expand_nodelist(nodelist, scontrol)[0]


def _slurm_ints(env, *names: str) -> list[int]:
    """The whole numbers ``names`` hold in ``env``; one ConfigError line naming each one unset or not a number."""
    missing = [n for n in names if not env.get(n)]
    bad = [f"{n}={env[n]!r}" for n in names if env.get(n) and not env[n].isdigit()]
    if missing or bad:
        raise ConfigError("; ".join(([f"{', '.join(missing)} not set"] if missing else [])
                                    + ([f"{', '.join(bad)} not a whole number"] if bad else []))
                          + ": run under srun in a job submitted with --nodes and --ntasks-per-node")
    return [int(env[n]) for n in names]


def check_task(env: dict | None = None) -> str:
    """This task's one-line layout, after setting ``MASTER_ADDR`` in ``env`` (default os.environ);
    ConfigError, naming the host and rank, for a layout Lightning would get wrong or a rendezvous
    address the other nodes cannot reach."""
    env = os.environ if env is None else env
    nodes, per_node, tasks, rank, node, local = _slurm_ints(
        env, "SLURM_NNODES", "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_NODEID", "SLURM_LOCALID")
    where = f"rank {rank} on {socket.gethostname()}"
    if tasks != nodes * per_node:
        raise ConfigError(f"{where}: world size disagrees: SLURM_NTASKS is {tasks}, but Lightning counts "
                          f"SLURM_NNODES {nodes} x SLURM_NTASKS_PER_NODE {per_node} = {nodes * per_node} ranks and "
                          "would wait for the missing ones; submit --nodes N --ntasks-per-node G without --ntasks")
    if rank != node * per_node + local:
        raise ConfigError(f"{where}: SLURM_PROCID {rank} is not node {node} x {per_node} tasks per node + local "
                          f"rank {local}: tasks are not placed in blocks; use --distribution=block (the default)")
    try:
        addr = env.get("MASTER_ADDR") or first_node(env.get("SLURM_JOB_NODELIST", ""), env.get("PATH"))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    try:
        ip = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"{where}: the rendezvous address {addr!r} (MASTER_ADDR, default: the job's first node) "
                          f"does not resolve here ({e}): fix the node's name resolution or export MASTER_ADDR "
                          "as an address every node reaches") from None
    if nodes > 1 and ipaddress.ip_address(ip.split("%")[0]).is_loopback:
        raise ConfigError(f"{where}: the rendezvous address {addr} is loopback ({ip}) in a {nodes}-node job: each "
                          "node would form its own world; export MASTER_ADDR as an address every node reaches")
    port = env.get("MASTER_PORT", "")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"{where}: MASTER_PORT={port!r} is not a port number (1-65535): unset it (train.sbatch "
                          "derives a free one) or export a free port")
    if rank == 0 and port and not port_is_free(int(port), reuse_addr=True):
        raise ConfigError(f"{where}: MASTER_PORT {port} is in use on {socket.gethostname()}, where rank 0 opens the "
                          f"rendezvous ({addr}:{port}); another process holds it (`ss -ltnp 'sport = :{port}'`): "
                          "unset MASTER_PORT (train.sbatch derives a free one) or export a free port")
    rendezvous_timeout(env)
    env["MASTER_ADDR"] = addr
    return (f"rank {rank} of {tasks}: node {node} local {local} on {socket.gethostname()}; "
            f"rendezvous {addr} ({ip}):{env.get('MASTER_PORT', '?')}")


def rendezvous_timeout(env) -> float:
    """Seconds from a rank's launch to the rendezvous (``WELLMIXED_RENDEZVOUS_TIMEOUT``, default
    RENDEZVOUS_TIMEOUT_S); ConfigError for a value that is not a positive number."""
    text = env.get(RENDEZVOUS_TIMEOUT_VAR) or str(RENDEZVOUS_TIMEOUT_S)
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ConfigError(f"{RENDEZVOUS_TIMEOUT_VAR}={text!r} is not a positive number of seconds: unset it "
                          f"(default {RENDEZVOUS_TIMEOUT_S:.0f}) or export e.g. 1800")
    return seconds


def print_check() -> bool:
    """:func:`check_task`'s line on stdout, or its refusal as one ``error:`` line on stderr (False)."""
    try:
        print(check_task(), flush=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return False
    return True


def checked_fit(argv: list[str]) -> int:
    """``python -m train fit ARGV`` in this process, after :func:`check_task` passed."""
    install_early_handlers()  # a signal during the check is a flag, as in `python -m train`
    if not print_check():
        return 2
    if int(os.environ["SLURM_NTASKS"]) > 1:
        # A rank whose peer never comes waits in torch's rendezvous: a client of a port another process holds
        # forever, rank 0 for a dead rank until the process-group timeout (30 min). Bounded here, from the launch.
        timeout_s = rendezvous_timeout(os.environ)
        where = f"rank {os.environ['SLURM_PROCID']} on {socket.gethostname()}"
        rendezvous = f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '?')}"

        def watch() -> None:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                dist = sys.modules.get("torch.distributed")
                if getattr(dist, "is_initialized", lambda: False)():  # None or still importing: not yet
                    return
                time.sleep(1.0)
            print(f"error: {where}: no rendezvous at {rendezvous} (MASTER_ADDR:MASTER_PORT) within {timeout_s:.0f} s "
                  "of the launch: a rank failed before it (see its error line), another process holds the port, or "
                  f"the port is blocked between the nodes; {RENDEZVOUS_TIMEOUT_VAR} sets the wait", file=sys.stderr,
                  flush=True)
            os._exit(2)  # before the rendezvous: no DataLoader worker, nothing written

        threading.Thread(target=watch, name="rendezvous-watch", daemon=True).start()
    from train.__main__ import main as train_main

    sys.argv = [sys.argv[0], "fit", *argv]  # exactly `python -m train fit ARGV` from here on
    return train_main()


# -- a rank that stops answering ------------------------------------------------------------------
EXIT_PEER_LOST = 75
"""Exit code of a rank whose collective failed because other ranks stopped answering (EX_TEMPFAIL):
scripts/slurm/train.sbatch requeues the job on it."""
PEER_ANSWER_S = 5.0
"""How long a rank whose collective failed waits for the other survivors to say so (through the store)."""
GLOO_PEER_ERRORS = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer",
                    "timeout caused pair closure")
"""What gloo's error says when a peer stopped answering (a timeout) or its process ended (a closed socket)."""


def report_lost_peers(error: BaseException, grace_s: float = PEER_ANSWER_S) -> bool:
    """After ``error``: True when it is a collective that failed because ranks stopped answering, and the
    lowest surviving rank has printed one ``error:`` line naming the silent ranks and their nodes.

    Gloo's own message names neither the rank nor the node. Every rank whose collective failed says so in
    the rendezvous store (rank 0's TCPStore, which outlives the process group's broken connections) and
    waits ``grace_s`` for the others: a rank that never says so is lost. Its node is the job's node list
    (``SLURM_JOB_NODELIST``) at index rank // ``SLURM_NTASKS_PER_NODE``. A store whose node does not answer
    means rank 0 (its node) is the lost one; a store that refuses or resets the connection means rank 0's
    process has ended (a survivor whose collective failed later than rank 0's grace), so nothing more is
    printed. False for any other error, and when every rank answered."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    if not (isinstance(error, RuntimeError) and dist.is_available() and dist.is_initialized()
            and any(s in str(error) for s in GLOO_PEER_ERRORS)):
        return False
    rank, world, host = dist.get_rank(), dist.get_world_size(), socket.gethostname()
    cause = str(error).splitlines()[0].split("] ", 1)[-1]  # without gloo's source location
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=grace_s))
        store.set(f"wellmixed/failed/{rank}", host)
        deadline = time.monotonic() + grace_s
        while True:
            alive = [r for r in range(world) if store.check([f"wellmixed/failed/{r}"])]
            if len(alive) == world or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except RuntimeError as e:  # DistStoreError, DistNetworkError: rank 0's store is gone
        if any(s in str(e) for s in ("Connection reset by peer", "Connection refused", "Broken pipe")):
            return True  # rank 0's process has ended (its node answers): after its own line, or with its own error
        print(f"error: rank {rank} on {host}: a collective failed ({cause}) and the rendezvous store on rank 0 "
              f"({os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}) does not answer "
              f"({str(e).splitlines()[0]}): rank 0's node is unreachable or its process ended; this job ends "
              f"(exit {EXIT_PEER_LOST}: train.sbatch requeues it)", file=sys.stderr, flush=True)
        return True
    lost = [r for r in range(world) if r not in alive]
    if not lost:
        return False
    if rank == min(alive):
        per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "")
        nodes = ""
        if per_node.isdigit() and os.environ.get("SLURM_JOB_NODELIST"):
            hosts = expand_nodelist(os.environ["SLURM_JOB_NODELIST"])
            names = sorted({hosts[r // int(per_node)] for r in lost if r // int(per_node) < len(hosts)})
            nodes = f" on {', '.join(names)}"
        print(f"error: rank {rank} on {host}: rank(s) {', '.join(map(str, lost))}{nodes} stopped answering: "
              f"{cause} (run.collective_timeout_s); their node is unreachable or their processes ended. This job "
              f"ends (exit {EXIT_PEER_LOST}: train.sbatch requeues it and it resumes from the newest complete "
              "checkpoint)", file=sys.stderr, flush=True)
    return True


# -- the config, parsed as `python -m train fit` parses it --------------------------------------
def parse_run_config(args: list[str]):
    """(data module, trainer namespace, run config) from CLI arguments, instantiating only the data:
    train/config.py's resolve_config, the parser ``python -m train fit`` uses."""
    from train.config import data_config, resolve_config
    from train.datamodule import WellMixedData

    config = resolve_config(args)
    return WellMixedData(data_config(config)), config.trainer, config.run


class SliceTable:
    """First chunks per source of any consumer, from the manifest and the chunk permutations."""

    def __init__(self, manifest, cfg, num_consumers: int):
        from data.order import ChunkOrder

        self.manifest, self.num_consumers = manifest, num_consumers
        self.orders = [ChunkOrder(cfg.seed, name, info.chunks) for name, info in manifest.sources.items()]

    def elements(self, source: int, consumer: int, n: int) -> list[tuple[int, int, object]]:
        """(element g, epoch, chunk) of the first ``n`` elements ``consumer`` opens in ``source``."""
        from data.order import element

        chunk_at = self.orders[source]
        out = []
        for t in range(n):
            g = element(consumer, t, self.num_consumers)
            epoch, chunk = chunk_at(g)
            out.append((g, epoch, chunk))
        return out

    def describe(self, consumer: int, n: int) -> str:
        parts = []
        for s, order in enumerate(self.orders):
            chunks = []
            for g, epoch, c in self.elements(s, consumer, n):
                where = f"{self.manifest.shards[c.shard].stem}:{c.start}-{c.stop}"
                chunks.append(where + (f"@epoch{epoch}" if epoch else ""))
            parts.append(f"{order.name} " + " ".join(chunks))
        return "; ".join(parts)


def rank_lines(info: RankInfo, hosts: list[str], workers: int, table: SliceTable, chunks: int) -> list[str]:
    host = hosts[info.node_rank] if info.node_rank < len(hosts) else "?"
    cons = consumer_ids(info.global_rank, workers)
    head = (f"rank {info.global_rank:>5} node {info.node_rank} ({host}) local {info.local_rank}: "
            f"consumers {cons[0]}..{cons[-1]} of {table.num_consumers}")
    return [head] + [f"    consumer {c}: {table.describe(c, chunks)}" for c in cons]


def _rank_selection(spec: str, world: int) -> list[int]:
    if spec == "all":
        return list(range(world))
    if spec == "none":
        return []
    if spec == "auto":
        return list(range(world)) if world <= 16 else list(range(8)) + list(range(world - 8, world))
    return sorted({int(x) for x in spec.split(",") if x.strip()})


@dataclass(frozen=True)
class _Job:
    """The Slurm job a dry run describes: the real one (from ``SLURM_*``) or a simulated N x G."""

    nodes: int
    per_node: int
    nodelist: str
    job_id: int
    env: dict[str, str]  # its SLURM_* variables (rank 0's when simulated)
    simulated: bool

    @property
    def world(self) -> int:
        return self.nodes * self.per_node


def _dry_run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.launch dry-run",
                                description="Resolved nodes, world size and per-rank data slices; no training.")
    p.add_argument("--simulate", metavar="NxG", help="a job of N nodes x G tasks per node (no Slurm needed)")
    p.add_argument("--task", action="store_true", help="print only this srun task's rank (run under srun)")
    p.add_argument("--ranks", default="auto", help="ranks to print: auto (all up to 16, else the first and last 8), "
                                                   "all, none, or a list 0,1,511")
    p.add_argument("--chunks", type=int, default=1, help="first chunks per source and consumer to print")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- --config CONFIG [overrides ...]")
    return p


def _job(p: argparse.ArgumentParser, simulate: str | None) -> _Job:
    """The job from ``--simulate NxG`` or the Slurm environment (ConfigError naming a variable that is unset
    or not a number). Usage errors exit through ``p.error``."""
    if simulate:
        m = re.fullmatch(r"([1-9]\d*)x([1-9]\d*)", simulate)
        if not m:
            p.error(f"--simulate {simulate}: takes NxG, N nodes x G tasks per node, each at least 1 (e.g. 4x8)")
        nodes, per_node = int(m.group(1)), int(m.group(2))
        nodelist, job_id = simulated_nodelist(nodes), 4242
        return _Job(nodes, per_node, nodelist, job_id, slurm_task_env(nodes, per_node, 0, job_id, nodelist), True)
    if "SLURM_JOB_ID" not in os.environ:
        p.error("not inside a Slurm job: pass --simulate NxG (e.g. 4x8)")
    if not os.environ.get("SLURM_NTASKS_PER_NODE"):
        raise ConfigError("SLURM_NTASKS_PER_NODE is not set: submit with --ntasks-per-node (one task per GPU); "
                          "Lightning refuses --ntasks alone")
    nodes, per_node, job_id = _slurm_ints(os.environ, "SLURM_NNODES", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_ID")
    if not os.environ.get("SLURM_JOB_NODELIST"):
        raise ConfigError("SLURM_JOB_NODELIST is not set: run the dry run inside the job's allocation (sbatch or "
                          "salloc), or pass --simulate NxG")
    return _Job(nodes, per_node, os.environ["SLURM_JOB_NODELIST"], job_id,
                {k: v for k, v in os.environ.items() if k.startswith("SLURM_")}, False)


def dry_run(argv: list[str]) -> int:
    p = _dry_run_parser()
    a = p.parse_args(argv)
    train_args = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args

    from train.model import ModelConfigError

    try:
        job = _job(p, a.simulate)
        hosts = expand_nodelist(job.nodelist, None if job.simulated else shutil.which("scontrol"))
        if len(hosts) != job.nodes:
            raise ConfigError(f"SLURM_JOB_NODELIST {job.nodelist!r} names {len(hosts)} host(s) ({' '.join(hosts[:8])}"
                              f"{' ...' if len(hosts) > 8 else ''}) but SLURM_NNODES is {job.nodes}: run the dry run "
                              "inside one job's allocation, with its own variables")
        dm, trainer, run = parse_run_config(train_args + ["--trainer.num_nodes", str(job.nodes),
                                                          "--trainer.devices", str(job.per_node)])
        data = dm.prepare(trainer.accumulate_grad_batches or 1)
    except (ConfigError, ModelConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    workers = max(1, data.num_workers)
    table = SliceTable(data.manifest, data.config, job.world * workers)
    chunks = max(1, a.chunks)

    if a.task:  # this srun task: its host and rendezvous, then its rank and slice as Lightning sees them
        if not print_check():
            return 2
        info = rank_info()
        print("\n".join(rank_lines(info, hosts, workers, table, chunks)), flush=True)
        return 0 if info.world_size == job.world else 1

    lines, ok = _job_summary(job, hosts, data, trainer, run, workers)
    print("\n".join(lines))
    _print_rank_slices(job, _rank_selection(a.ranks, job.world), hosts, workers, table, chunks)
    return 0 if ok else 2


def _job_summary(job: _Job, hosts: list[str], data: TrainingContext, trainer, run,
                 workers: int) -> tuple[list[str], bool]:
    """The job's resolved shape, batch arithmetic and notes; False when training would refuse it."""
    world, nodes, per_node = job.world, job.nodes, job.per_node
    accumulate = trainer.accumulate_grad_batches or 1
    name = "simulated" if job.simulated else os.environ.get("SLURM_JOB_NAME", "simulated")
    lines = [
        f"dry run: job {job.job_id} ({name})",
        f"  nodes       {nodes}: {' '.join(hosts[:16])}{' ...' if len(hosts) > 16 else ''}",
        f"  world size  {world} = {nodes} nodes x {per_node} tasks per node "
        f"(--trainer.num_nodes {nodes} --trainer.devices {per_node}, strategy {trainer.strategy}, "
        f"accelerator {trainer.accelerator})",
        f"  rendezvous  MASTER_ADDR {os.environ.get('MASTER_ADDR', hosts[0] if hosts else '?')} "
        f"MASTER_PORT {os.environ.get('MASTER_PORT', '(derived at launch)')}",
        f"  run dir     {run.dir}",
        f"  data        {workers} DataLoader worker(s) per rank -> {world * workers} consumers; "
        f"rank r runs consumers r*{workers} .. r*{workers}+{workers - 1}",
    ]
    want = data.schedule.config.global_batch_size
    batch_size = data.config.batch_size
    got = batch_size * world * accumulate
    ok = got == want
    lines.append(
        f"  batch       data.batch_size {batch_size} x {world} ranks x {accumulate} accumulation = {got} "
        f"(data.schedule.global_batch_size {want}: {'ok' if ok else 'MISMATCH: training would refuse to start'})"
    )
    lines.append(f"  steps       {data.schedule.total_steps} optimizer steps")
    for source, info in data.manifest.sources.items():
        n = len(info.chunks)
        if n < world * workers:
            lines.append(
                f"  note        {source}: {n} chunks < {world * workers} consumers: consumers >= {n} start in a later "
                f"epoch of {source} (still each document once per epoch); raise data.min_chunks_per_source to "
                "spread the first epoch over every consumer"
            )
    return lines, ok


def _print_rank_slices(job: _Job, ranks: list[int], hosts: list[str], workers: int, table: SliceTable,
                       chunks: int) -> None:
    """Each selected rank's consumers and their first chunks, as that srun task would see them ('...' for gaps)."""
    selection = [r for r in ranks if 0 <= r < job.world]
    if selection:
        print(f"per-rank data slices (first {chunks} chunk(s) per source of each consumer, <shard>:<rows>):")
    shown = -1
    for r in selection:
        if r != shown + 1 and shown >= 0:
            print("  ...")
        with patched_environ({**job.env, **slurm_task_env(job.nodes, job.per_node, r, job.job_id, job.nodelist,
                                                           job.env.get("SLURM_JOB_NAME", "wellmixed"))}):
            info = rank_info()
        print("\n".join(rank_lines(info, hosts, workers, table, chunks)))
        shown = r


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "port":
        print(master_port())
        return 0
    if cmd == "fit":
        return checked_fit(rest)
    if cmd == "check":
        return 0 if print_check() else 2
    if cmd == "dry-run":
        logging.basicConfig(level=logging.WARNING)
        return dry_run(rest)
    print(f"unknown command {cmd!r} (port, check, fit, dry-run)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
