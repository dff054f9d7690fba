"""Run an ablation pair: both arms (scheduled and fixed mixture), for one or more seeds, then the report.

    python ablations/run.py --pair demo                                  # CPU, 3 seeds x 2 arms: ~53 min on 2 cores
    python ablations/run.py --pair demo --seeds 1234 5678 --out runs/ablation-demo-2seeds
    python ablations/run.py --pair 350m_2b --slurm                      # a SLURM job array, one task per run
    python ablations/run.py --pair demo --dry-run -- --trainer.precision 32-true   # print the commands

Seed s of one arm is paired with seed s of the other (same init, data seed and held-out set). Every
run is ``python -m train fit`` with the pair's configs stacked plus ``--seed_everything S --data.seed S
--data.order_log true --run.dir OUT/<arm>-seed<S>`` and the wandb group/name; the configs and the
overrides after ``--`` are resolved and their data config checked as ``train fit`` does before
anything runs (the per-run keys are refused after ``--``). Runs go one after another, a finished one
is skipped and the others resume (``--ckpt_path last_or_new``); then ``ablations/report.py OUT``.
``--slurm`` writes ``OUT/jobs.json`` and submits ``ablations/ablation.sbatch``, one array task per run
(``--task-args``: its arguments now). ablations/README.md has the details.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ablations.cleanup import prune_finished_run
from ablations.outcomes import BRANCHED_FROM, WALL_SECONDS, is_complete
from data.errors import ConfigError, one_line_errors
from data.files import write_text

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("scheduled", "fixed")
SBATCH = "ablations/ablation.sbatch"
DEFAULT_NUM_SEEDS = 3


@dataclass(frozen=True)
class Pair:
    """An ablation pair: the fixed arm is the scheduled arm plus one more config diff (its mixture)."""

    base: str
    scheduled: str
    fixed: str

    def configs(self, arm: str) -> list[str]:
        """The ``--config`` files of ``arm``, applied in this order (later files override earlier ones)."""
        return [self.base, self.scheduled] + ([self.fixed] if arm == "fixed" else [])


PAIRS = {
    "demo": Pair("configs/demo.yaml", "ablations/demo_scheduled.yaml", "ablations/demo_fixed.yaml"),
    "350m_2b": Pair("configs/pretrain_350m_20b.yaml", "ablations/350m_2b_scheduled.yaml",
                    "ablations/350m_2b_fixed.yaml"),
}


@dataclass
class Job:
    arm: str
    seed: int
    run_dir: str
    args: list[str]
    """Arguments of ``python -m train fit`` (without ``--ckpt_path``: ``last_or_new`` is added to local runs;
    the SLURM launcher adds its own)."""
    start: str | None = None
    """A decay branch's stable checkpoint (ablations/branch.py): its ``--ckpt_path`` while the run directory
    holds no checkpoint of its own."""


OWN_KEYS = ("--seed_everything", "--data.seed", "--run.dir", "--ckpt_path")
"""Set per run by this runner: in the overrides after ``--`` they would relabel every run (seed S's run
trained with another seed), so they are refused."""


def resolve_arms(pair: Pair, extra: list[str]) -> dict:
    """Each arm's configuration as ``python -m train fit`` resolves it (train/config.py): the pair's stacked
    configs plus the overrides after ``--``; a bad key or value is refused here, before any run starts."""
    from train.config import data_config, resolve_config

    for flag in extra:
        if flag.split("=")[0] in OWN_KEYS:
            raise ConfigError(f"{flag.split('=')[0]} is set per run by ablations/run.py; use --seeds / --out "
                              "instead of passing it after --")
    arms = {arm: resolve_config([a for c in pair.configs(arm) for a in ("--config", str(ROOT / c))] + extra)
            for arm in ARMS}
    for cfg in arms.values():
        data_config(cfg)  # the data config checked as train fit checks it (sources, schedule, weights)
    return arms


def config_seed(pair: Pair, extra: list[str] | None = None) -> int:
    """``data.seed`` as the pair's stacked configs (and overrides) set it."""
    return int(resolve_arms(pair, extra or [])["scheduled"].data.seed)


def default_seeds(pair: Pair, n: int = DEFAULT_NUM_SEEDS, extra: list[str] | None = None) -> list[int]:
    """``n`` seeds from the configs' ``data.seed`` S: S, S+1, ..., S+n-1."""
    if n < 1:
        raise ConfigError(f"--num-seeds must be at least 1, got {n}")
    first = config_seed(pair, extra)
    return [first + i for i in range(n)]


def plan_jobs(pair: Pair, seeds: list[int], out: Path, name: str, extra: list[str]) -> list[Job]:
    """One job per (seed, arm), seed-major: both arms of a seed finish before the next seed starts."""
    jobs = []
    for seed in seeds:
        for arm in ARMS:
            run_dir = out / f"{arm}-seed{seed}"
            args = [a for c in pair.configs(arm) for a in ("--config", c)] + [
                "--seed_everything", str(seed), "--data.seed", str(seed), "--data.order_log", "true",
                "--run.dir", str(run_dir), "--run.wandb_group", name, "--run.wandb_name", f"{name}/{arm}-seed{seed}",
                *extra,
            ]
            jobs.append(Job(arm, seed, str(run_dir), args))
    return jobs


def record_start(job: Job, todo: list[str]) -> None:
    """Before a job's first start from ``job.start``: which checkpoint it is, by path and sha256."""
    if job.start and todo[-2:] == ["--ckpt_path", job.start]:
        from train.checkpoint import content_sha256

        run_dir = ROOT / job.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text(run_dir / BRANCHED_FROM, json.dumps({"checkpoint": job.start,
                                                        "sha256": content_sha256(ROOT / job.start)}))


def task_args(job: Job, resume: bool = True) -> list[str] | None:
    """The job's ``python -m train fit`` arguments now: None when it is finished; with ``resume``,
    ``--ckpt_path last_or_new`` (train/checkpoint.py: the newest valid checkpoint when the run has one,
    whether ``last.ckpt`` or only step files, else step 0)."""
    if is_complete(ROOT / job.run_dir):  # relative to the repository root, where training runs
        return None
    if job.start and not any((ROOT / job.run_dir / "checkpoints").glob("*.ckpt")):
        return job.args + ["--ckpt_path", job.start]
    return job.args + ["--ckpt_path", "last_or_new"] if resume else job.args


def sbatch_command(jobs_file: Path, n_jobs: int, name: str, sbatch_args: list[str]) -> list[str]:
    return ["sbatch", f"--array=0-{n_jobs - 1}", f"--job-name={name}", *sbatch_args, SBATCH, str(jobs_file)]


def repo_relative(path: Path) -> Path:
    """``path`` (from the caller's directory) relative to the repository root, where runs start."""
    path = Path(path).resolve()
    return Path(os.path.relpath(path, ROOT)) if path.is_relative_to(ROOT) else path


def split_extra(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--task-args"]:  # called by ablations/ablation.sbatch in each array task
        return print_task_args(Path(argv[1]), int(argv[2]))
    own, extra = split_extra(argv)
    args = parser().parse_args(own)
    out, name, jobs = jobs_from_args(args, extra)
    if args.slurm:
        return submit_array(jobs, out, name, args)
    failed = run_here(jobs, args.dry_run)
    if failed or args.dry_run or args.no_report:
        return failed
    from ablations.report import main as report_main

    return report_main([str(ROOT / out), *shlex.split(args.report_args)])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", required=True, choices=sorted(PAIRS))
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="the seeds, explicitly (default: --num-seeds seeds from the configs' data.seed)")
    p.add_argument("--num-seeds", type=int, default=DEFAULT_NUM_SEEDS,
                   help=f"seeds per arm when --seeds is not given (default {DEFAULT_NUM_SEEDS}; the rule needs 2+)")
    p.add_argument("--out", type=Path, default=None, help="default: runs/ablation-<pair>")
    p.add_argument("--name", default=None, help="ablation name, the wandb group (default: OUT's folder name)")
    p.add_argument("--slurm", action="store_true", help="submit a SLURM job array instead of running here")
    p.add_argument("--sbatch-args", default="",
                   help='extra sbatch flags, given with "=": --sbatch-args="--partition=gpu --time=24:00:00"')
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--no-report", action="store_true", help="do not write OUT/report.md after the runs")
    p.add_argument("--report-args", default="",
                   help='flags for ablations/report.py, given with "=": --report-args="--token-rtol 0.05"')
    return p


def jobs_from_args(args: argparse.Namespace, extra: list[str]) -> tuple[Path, str, list[Job]]:
    """The ablation folder (relative to the repository root), its name and its jobs; the seeds and the
    overrides after ``--`` are checked before anything runs."""
    pair = PAIRS[args.pair]
    out = repo_relative(args.out or ROOT / "runs" / f"ablation-{args.pair}")
    name = args.name or out.name
    seeds = args.seeds or default_seeds(pair, args.num_seeds, extra)
    if args.seeds:
        resolve_arms(pair, extra)  # the overrides checked before anything runs
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds repeats a seed: {seeds}")
    return out, name, plan_jobs(pair, seeds, out, name, extra)


def submit_array(jobs: list[Job], out: Path, name: str, args: argparse.Namespace) -> int:
    """Writes ``OUT/jobs.json`` and submits the SLURM array (with ``--dry-run``: prints the commands only);
    sbatch's exit status."""
    jobs_file = out / "jobs.json"
    cmd = sbatch_command(jobs_file, len(jobs), name, shlex.split(args.sbatch_args))
    if not args.dry_run:
        (ROOT / out).mkdir(parents=True, exist_ok=True)
        (ROOT / "logs").mkdir(exist_ok=True)  # the sbatch --output folder; SLURM does not create it
        (ROOT / jobs_file).write_text(json.dumps([asdict(j) for j in jobs], indent=1))
    print(shlex.join(cmd))
    for i, job in enumerate(jobs):
        print(f"  task {i}: {shlex.join(['python', '-m', 'train', 'fit', *job.args])}")
    if args.dry_run:
        return 0
    proc = subprocess.run(cmd, cwd=ROOT)
    if proc.returncode == 0:
        print(f"when the array has finished: python ablations/report.py {out}")
    return proc.returncode


def run_here(jobs: list[Job], dry_run: bool) -> int:
    """Runs the unfinished jobs one after another (with ``dry_run``: prints their commands); the exit
    status of the first that fails, else 0."""
    for job in jobs:
        todo = task_args(job)
        label = f"[{Path(job.run_dir).name}]"
        if todo is None:
            print(f"{label} {job.run_dir} is complete: skipped", flush=True)
            continue
        cmd = [sys.executable, "-m", "train", "fit", *todo]
        print(f"{label} {shlex.join(cmd)}", flush=True)
        if dry_run:
            continue
        record_start(job, todo)
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT)
        wall = ROOT / job.run_dir / WALL_SECONDS  # summed over the invocations that trained this run
        spent = time.monotonic() - started + (float(wall.read_text()) if wall.is_file() else 0.0)
        if wall.parent.is_dir():
            write_text(wall, f"{spent:.1f}\n")
        if proc.returncode != 0:
            print(f"{label} failed with exit code {proc.returncode}; re-run the same command to resume",
                  file=sys.stderr)
            return proc.returncode
        prune_finished_run(ROOT / job.run_dir)  # the report reads last.ckpt and the logs only
    return 0


def print_task_args(jobs_file: Path, index: int) -> int:
    """Prints array task ``index``'s training arguments, shell-quoted; nothing when it is complete.

    Without ``--ckpt_path``: the launcher resumes from the run's newest checkpoint itself.
    """
    job = Job(**json.loads((ROOT / jobs_file).read_text())[index])
    todo = task_args(job, resume=False)
    if todo is not None:
        record_start(job, todo)
        print(shlex.join(todo))
    else:
        print(f"{job.run_dir} is complete: nothing to do", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
