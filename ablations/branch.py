"""Decay branches: the anneal ablation from one stable-phase checkpoint, the data order continued.

    python ablations/branch.py --from runs/demo --train-stable --arms ablations/demo_branch_arms.yaml \
        -- --config configs/demo.yaml
    python ablations/branch.py --from runs/pretrain_350m_20b --arms ablations/350m_branch_arms.yaml --slurm

The stable run (``--from``; ``--train-stable`` trains it to the anneal start S with the configs after
``--``) is trained once; every arm x replicate resumes its checkpoint at or before S with
``--run.branch true`` (train/resume.py ``check_branch``: the mixture from S on is the one change) in
its own ``OUT/<arm>-rep<R>``; replicate r runs ``data.num_workers`` W + r (an elastic re-cut of the
stable run's pending work); ``control`` keeps the stable weights. Everything is checked before the
first step and before anything is written; the same command continues an OUT's arms. Then
``ablations/report.py OUT``. ablations/README.md ("Decay branches") says what carries over and why.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from ablations.branch_report import CONTROL, start_losses
from ablations.report import main as report_main
from ablations.run import ROOT, Job, repo_relative, run_here, split_extra, submit_array
from data.errors import ConfigError, one_line_errors
from data.files import write_json, write_text
from data.manifest import build_manifest
from data.plan import implied_epochs
from data.schedules import ScheduleConfig, validate_sources
from train.checkpoint import read_checkpoint, recorded_step
from train.config import data_config, resolve_config
from train.resume import check_resume
from train.rundir import RunDir

ARM_NAME = re.compile(r"^[A-Za-z0-9_.]+$")
OWN_KEYS = ("--run.dir", "--ckpt_path", "--run.branch", "--data.schedule.mixture", "--data.num_workers")


@dataclass
class Plan:
    """``OUT/branch.json``, what the ablation trains (the same command continues it): the stable run, its
    checkpoint and ``step`` (at or before ``anneal_start``), each arm's weights from the anneal start on
    (``control`` first), ``data.num_workers`` per replicate, tokens per source in the corpus, tokens
    trained before ``step`` (once, for every arm), and the stable run's last held-out losses before it."""

    stable_run: str
    checkpoint: str
    step: int
    anneal_start: int
    total_steps: int
    arms: dict[str, dict[str, float]]
    workers: list[int]
    available: dict[str, int]
    stable_tokens: int
    total_tokens: int
    extra: list[str]
    start: dict[str, tuple[int, float]]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ablations.branch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", type=Path, required=True, help="the stable run's directory")
    p.add_argument("--at", default="anneal", choices=["anneal"], help="the branch point: the anneal start S")
    p.add_argument("--arms", type=Path, default=None, help="YAML: arms: [{name, weights}] (default: the run's anneal)")
    p.add_argument("--replicates", type=int, default=3, help="replicates per arm (the rule needs 2+)")
    p.add_argument("--train-stable", action="store_true",
                   help="train the stable run to S first (its configs after --), or continue it there")
    p.add_argument("--out", type=Path, default=None, help="the ablation folder (default runs/branch-<RUN_DIR name>)")
    p.add_argument("--slurm", action="store_true", help="submit a SLURM job array instead of running here")
    p.add_argument("--sbatch-args", default="", help='extra sbatch flags, given with "="')
    p.add_argument("--dry-run", action="store_true", help="check everything, print the commands, run nothing")
    p.add_argument("--no-report", action="store_true")
    p.add_argument("--report-args", default="", help='flags for ablations/report.py, given with "="')
    return p


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    own, extra = split_extra(sys.argv[1:] if argv is None else list(argv))
    args = parser().parse_args(own)
    source = check_args(args, extra)
    if args.train_stable:
        failed = train_stable(source, extra, args.dry_run)
        if failed or args.dry_run and not (ROOT / source / "config.yaml").is_file():
            return failed
    plan = make_plan(source, args.arms, args.replicates, [] if args.train_stable else extra)
    return run_plan(plan, repo_relative(args.out or ROOT / "runs" / f"branch-{source.name}"), args)


def check_args(args: argparse.Namespace, extra: list[str]) -> Path:
    """The flags checked (with --train-stable the stable run may set its mixture and workers); the run's dir."""
    if args.replicates < 1:
        raise ConfigError(f"--replicates must be at least 1, got {args.replicates} (the decision needs 2+)")
    bad = [f.split("=")[0] for f in extra if f.split("=")[0] in OWN_KEYS[:3 if args.train_stable else None]]
    if bad:
        raise ConfigError(f"{bad[0]} is set by ablations.branch (--from, --arms, --replicates); remove it")
    if args.train_stable and args.slurm:
        raise ConfigError("--train-stable trains here; on SLURM train the stable phase first: sbatch "
                          "scripts/slurm/train.sbatch CONFIG --trainer.max_steps S (S: the anneal start)")
    return repo_relative(args.source)


def run_plan(plan: Plan, out: Path, args: argparse.Namespace) -> int:
    """Claims OUT, then runs the arms here and writes the report, or submits a SLURM array (or prints)."""
    jobs = plan_jobs(plan, out)
    if not args.dry_run:
        claim(out, plan)
    if args.slurm:
        return submit_array(jobs, out, out.name, args)
    failed = run_here(jobs, args.dry_run)
    if failed or args.dry_run or args.no_report:
        return failed
    return report_main([str(ROOT / out), *shlex.split(args.report_args)])


def train_stable(source: Path, extra: list[str], dry_run: bool) -> int:
    """Trains the stable run to the anneal start S (``--trainer.max_steps S``) unless it has a checkpoint there."""
    s = data_config(resolve_config(extra + ["--run.dir", str(source)])).schedule.build().anneal_step  # checked
    if stable_checkpoints(source, s)[0]:
        return 0
    cmd = [sys.executable, "-m", "train", "fit", *extra, "--run.dir", str(source), "--data.order_log", "true",
           "--trainer.max_steps", str(s), "--ckpt_path", "last_or_new"]
    print(f"[stable to step {s}] {shlex.join(cmd)}", flush=True)
    return 0 if dry_run else subprocess.run(cmd, cwd=ROOT).returncode


def stable_checkpoints(run_dir: Path, s: int) -> tuple[list[tuple[int, Path]], list[int]]:
    """The run's checkpoints at or before step ``s`` (newest first), and the steps of those after it."""
    ckpts = sorted((RunDir(ROOT / run_dir).checkpoints).glob("*.ckpt"))
    steps = [(recorded_step(p), p) for p in ckpts]
    before = sorted(((st, p) for st, p in steps if st is not None and st <= s), key=lambda x: (-x[0], x[1].name))
    return before, sorted(st for st, _ in steps if st is not None and st > s)


def make_plan(source: Path, arms_file: Path | None, replicates: int, extra: list[str]) -> Plan:
    """Everything checked, nothing written: the stable checkpoint, the arms, their implied epochs."""
    if not (ROOT / source / "config.yaml").is_file():
        raise ConfigError(f"--from {source}: no config.yaml (not a train fit run directory); train the stable "
                          "phase with --train-stable -- --config CONFIG")
    cfg = resolve_config(stable_config(source) + extra)
    data = data_config(cfg)
    schedule = data.schedule.build()
    s = schedule.anneal_step
    if schedule.phase_boundaries[-1][1] != s or len(schedule.phase_boundaries) < 2:
        raise ConfigError(f"--from {source}: its mixture has no phase starting at the anneal start (step {s}); "
                          "a branch replaces the phase that starts there")
    if data.val_tokens_per_source <= 0:
        raise ConfigError(f"--from {source}: data.val_tokens_per_source is 0; the arms are compared on held-out "
                          "loss per source: give the branches one (-- --data.val_tokens_per_source 4096)")
    ckpt, step = pick_checkpoint(source, s)
    manifest = build_manifest(data)
    check_checkpoint(ckpt, cfg, data, manifest.fingerprint())
    available = {n: int(info.stream_tokens) for n, info in manifest.sources.items()}
    arms = {CONTROL: dict(zip(schedule.sources, schedule.phase_weights[-2].tolist())), **load_arms(arms_file, schedule)}
    for name, weights in arms.items():
        check_arm(name, arm_mixture(data.schedule, weights), data, available, arms_file)
    return Plan(str(source), str(repo_relative(ckpt)), step, s, schedule.total_steps, arms,
                [max(1, data.num_workers) + r for r in range(replicates)], available,
                sum(schedule.tokens_at(t) for t in range(step)), schedule.total_tokens, extra,
                start_losses(ROOT / source, step))


def stable_config(source: Path) -> list[str]:
    """``--config`` with the stable run's saved config, less the keys of ``fit`` alone (``ckpt_path``)."""
    saved = yaml.safe_load((ROOT / source / "config.yaml").read_text())
    return ["--config", yaml.safe_dump({k: v for k, v in saved.items() if k not in ("ckpt_path", "weights_only")},
                                         sort_keys=False)]


def pick_checkpoint(source: Path, s: int) -> tuple[Path, int]:
    before, after = stable_checkpoints(source, s)
    if before:
        return before[0][1], before[0][0]
    if after:
        raise ConfigError(f"--from {source}: its checkpoints are at steps {after}, after the anneal start (step {s}): "
                          "already annealing; a branch needs one at or before it (retrain it with --train-stable)")
    raise ConfigError(f"--from {source}: no checkpoint at or before the anneal start (step {s}); train the "
                      "stable phase with --train-stable")


def check_checkpoint(ckpt: Path, cfg, data, fingerprint: str) -> None:
    """The checkpoint is of this model (train/resume.py's rule), corpus and seed (its data state)."""
    loaded = read_checkpoint(ckpt, "stable checkpoint", "choose another --from")
    check_resume(str(ckpt), loaded.get("hyper_parameters"), cfg.model.as_dict())
    state = loaded.get("WellMixedData") or {}
    if state.get("seed") != data.seed:
        raise ConfigError(f"stable checkpoint {ckpt}: data.seed {state.get('seed')}, the branch asks "
                          f"{data.seed}: a branch continues the stable run's data order; give its seed")
    if state.get("fingerprint") != fingerprint:
        raise ConfigError(f"stable checkpoint {ckpt}: trained on another corpus (fingerprint "
                          f"{state.get('fingerprint')}, this one {fingerprint}); branch with the stable run's corpus")


def load_arms(path: Path | None, schedule) -> dict[str, dict[str, float]]:
    """The arms of ``--arms`` (default: the run's own phase at the anneal start), names checked."""
    if path is None:
        name = schedule.phase_boundaries[-1][0]
        return {name: dict(zip(schedule.sources, schedule.phase_weights[-1].tolist()))}
    entries = (yaml.safe_load(Path(path).read_text()) or {}).get("arms")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"--arms {path}: expected `arms: [{{name: N, weights: {{source: share}}}}, ...]`")
    out: dict[str, dict[str, float]] = {}
    for i, entry in enumerate(entries):
        name, weights = arm_entry(path, i, entry if isinstance(entry, dict) else {})
        if name in out:
            raise ConfigError(f"--arms {path}: arms[{i}].name {name!r} is given twice; rename one")
        out[name] = weights
    return out


def arm_entry(path: Path, i: int, entry: dict) -> tuple[str, dict[str, float]]:
    """One ``{name, weights}`` of the arms file; ``weights`` may name a YAML file (holding ``weights:``)."""
    name, weights = entry.get("name"), entry.get("weights")
    if not isinstance(name, str) or not ARM_NAME.match(name) or name == CONTROL:
        raise ConfigError(f"--arms {path}: arms[{i}].name {name!r}: give a name of letters, digits, _ and . "
                          f"(`{CONTROL}` is the stable weights, added by itself)")
    if isinstance(weights, str):
        loaded = yaml.safe_load((Path(path).parent / weights).read_text()) or {}
        weights = loaded.get("weights", loaded)
    if not isinstance(weights, dict):
        raise ConfigError(f"--arms {path}: arms[{i}] ({name}).weights: give {{source: share, ...}} or a file")
    return name, {str(k): float(v) for k, v in weights.items()}


def arm_mixture(schedule: ScheduleConfig, weights: dict[str, float]) -> dict:
    """The run's mixture with its last phase (the one from the anneal start) given ``weights``."""
    mixture = asdict(schedule.mixture)
    mixture["phases"][-1]["weights"] = dict(weights)
    return mixture


def check_arm(name: str, mixture: dict, data, available: dict[str, int], arms_file: Path | None) -> None:
    """The arm's whole schedule builds (weights summing to 1, known sources) and no source's implied
    epochs exceed ``data.max_epochs``; one line naming the arm."""
    where = f"--arms {arms_file}: arm {name!r}" if arms_file else f"arm {name!r}"
    try:
        sched = ScheduleConfig.from_dict({**asdict(data.schedule), "mixture": mixture}).build()
        validate_sources(sched, list(available))
    except ConfigError as e:
        raise ConfigError(f"{where}: {str(e).splitlines()[0]}") from None
    over = {s: e for s, e in implied_epochs(sched, available).items() if e > data.max_epochs}
    if over:
        raise ConfigError(f"{where}: implied epochs " + ", ".join(f"{s} {e:.2f}" for s, e in over.items())
                          + f" exceed data.max_epochs {data.max_epochs:g}; lower their weights")


def plan_jobs(plan: Plan, out: Path) -> list[Job]:
    """One job per (replicate, arm), replicate-major: every arm of a replicate before the next one.
    Each starts from the stable checkpoint while its run directory holds none (``Job.start``)."""
    jobs = []
    for r, workers in enumerate(plan.workers):
        for arm in plan.arms:
            run_dir = out / f"{arm}-rep{r}"
            args = ["--config", str(Path(plan.stable_run) / "config.yaml"), *plan.extra,
                    "--data.schedule.mixture", str(out / "arms" / f"{arm}.yaml"), "--data.num_workers", str(workers),
                    "--run.branch", "true", "--data.order_log", "true", "--trainer.max_steps", "-1",
                    "--run.dir", str(run_dir), "--run.wandb_group", out.name,
                    "--run.wandb_name", f"{out.name}/{arm}-rep{r}"]
            jobs.append(Job(arm, r, str(run_dir), args, start=plan.checkpoint))
    return jobs


def claim(out: Path, plan: Plan) -> bool:
    """Writes ``OUT/branch.json`` and the arms' mixtures; an OUT holding another plan (or other runs) is
    refused: the same command continues its arms, never overwrites them."""
    root = ROOT / out
    plan_file = root / "branch.json"
    if plan_file.is_file():
        if json.loads(plan_file.read_text()) != json.loads(json.dumps(asdict(plan))):
            raise ConfigError(f"--out {out} already holds a branch ablation with another plan ({plan_file}): "
                              "continue it with its own --from/--arms/--replicates, or choose another --out")
        return True
    if root.is_dir() and any(root.iterdir()):
        raise ConfigError(f"--out {out} is not empty and holds no branch.json: choose another --out")
    base = data_config(resolve_config(stable_config(Path(plan.stable_run)) + plan.extra)).schedule
    (root / "arms").mkdir(parents=True, exist_ok=True)
    for arm, weights in plan.arms.items():
        write_text(root / "arms" / f"{arm}.yaml", yaml.safe_dump(arm_mixture(base, weights), sort_keys=False))
    write_json(plan_file, asdict(plan), indent=1)
    return True


if __name__ == "__main__":
    sys.exit(main())
