"""Decay branches: the anneal ablation from one stable-phase checkpoint, the data order continued.

    python ablations/branch.py --from runs/demo --train-stable --arms ablations/demo_branch_arms.yaml \
        -- --config configs/demo.yaml
    python ablations/branch.py --from runs/pretrain_350m_20b --arms ablations/350m_branch_arms.yaml --slurm

The stable run (``--from``; ``--train-stable`` trains it to the anneal start S with the configs after
``--``) is trained once, to S: when its newest checkpoint at or before S is earlier, the steps up to S
are trained once into ``OUT/stable-to-S`` (never once per arm). Every arm x replicate resumes the
checkpoint at S, pinned by its sha256, with ``--run.branch true`` (train/resume.py ``check_branch``:
the mixture from S on is the one change) in its own ``OUT/<arm>-rep<R>``; replicate r runs
``data.replicate r``: the stable run's pending work drawn in another order, re-seeded from r
(data/elastic.py ``reseed``; replicate 0 is the stable run's own continuation); ``control`` keeps the
stable weights. Everything (arms, overrides, checkpoint) is checked before the first step and before
anything is written, ``--dry-run`` included; the same command continues an OUT's arms, and more
replicates or another arm extend it. Then ``ablations/report.py OUT``. ablations/README.md ("Decay
branches") says what carries over and why.
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
from train.checkpoint import checkpoint_problem, content_sha256, read_checkpoint, recorded_step
from train.config import data_config, resolve_config
from train.resume import check_data_settings, check_resume, data_settings, schedule_changes, schedule_fingerprint
from train.rundir import RunDir

ARM_NAME = re.compile(r"^[A-Za-z0-9_.]+$")
OWN_KEYS = ("--run.dir", "--ckpt_path", "--run.branch", "--data.schedule.mixture", "--data.num_workers",
            "--data.replicate")


@dataclass
class Plan:
    """``OUT/branch.json``, what the ablation trains (the same command continues it; more replicates or another
    arm extend it): the stable run, its checkpoint, ``step`` and sha256, the folder that trains it on to
    ``anneal_start`` once when ``step`` is earlier (``bridge``), each arm's weights from the anneal start on
    (``control`` first), ``data.num_workers`` per replicate (the stable run's), tokens per source in the
    corpus, tokens trained before the anneal start (once, for every arm), and the stable run's last held-out
    losses before it."""

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
    checkpoint_sha256: str = ""
    bridge: str | None = None

    def branch_checkpoint(self) -> str:
        """What every arm resumes: the stable checkpoint at S, or the bridge's at S."""
        return str(Path(self.bridge) / "checkpoints" / "last.ckpt") if self.bridge else self.checkpoint


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
    out = repo_relative(args.out or ROOT / "runs" / f"branch-{source.name}")
    if (ROOT / out).exists() and not (ROOT / out).is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder: choose another --out")
    if args.train_stable:
        cfg = resolve_config(extra + ["--run.dir", str(source)])
        check_relative_globs(data_config(cfg), "the configs after --")
        arms_and_corpus(data_config(cfg), args.arms)  # the arms checked before the stable phase trains
        failed = train_stable(source, extra, data_config(cfg).schedule.build().anneal_step, args.dry_run)
        if failed or args.dry_run and not (ROOT / source / "config.yaml").is_file():
            return failed
    plan = make_plan(source, args.arms, args.replicates, [] if args.train_stable else extra, out)
    return run_plan(plan, out, args)


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


def check_relative_globs(data, where: str) -> None:
    """Every run of an ablation starts in the repository root: a relative corpus glob read from another
    directory would be checked on one corpus and trained on another."""
    if Path.cwd().resolve() == ROOT:
        return
    for name, src in data.sources.items():
        rel = [g for g in src.paths if not Path(os.path.expandvars(g)).is_absolute()]
        if rel:
            raise ConfigError(f"{where}: data.sources.{name}.paths {rel[0]!r} is relative, and the runs of an "
                              f"ablation start in the repository root ({ROOT}), not here ({Path.cwd()}): give "
                              "absolute paths, or run from the repository root")


def run_plan(plan: Plan, out: Path, args: argparse.Namespace) -> int:
    """Claims OUT, then trains the bridge to S (if any) and the arms here and writes the report, or submits a
    SLURM array (or prints)."""
    jobs = plan_jobs(plan, out)
    if not args.dry_run:
        claim(out, plan)
    if args.slurm:
        if plan.bridge:
            raise ConfigError(f"--from {plan.stable_run}: its checkpoint is at step {plan.step}, before the anneal "
                              f"start {plan.anneal_start}; on SLURM train the stable phase to S first: sbatch "
                              f"scripts/slurm/train.sbatch CONFIG --trainer.max_steps {plan.anneal_start}")
        return submit_array(jobs, out, out.name, args)
    failed = run_here(jobs, args.dry_run)
    if failed or args.dry_run or args.no_report:
        return failed
    return report_main([str(ROOT / out), *shlex.split(args.report_args)])


def train_stable(source: Path, extra: list[str], s: int, dry_run: bool) -> int:
    """Trains the stable run to the anneal start S (``--trainer.max_steps S``) unless it has a checkpoint there;
    a run already past S is never resumed (it would only stop again)."""
    before, after = stable_checkpoints(source, s)
    if before and before[0][0] == s:
        return 0
    if after:
        raise ConfigError(f"--from {source}: it is past the anneal start (checkpoints at steps {after}) and has "
                          f"none at step {s}: --train-stable cannot train it back to S; give the stable phase "
                          "another --from directory (--train-stable trains it there)")
    cmd = [sys.executable, "-m", "train", "fit", *extra, "--run.dir", str(source), "--data.order_log", "true",
           "--trainer.max_steps", str(s), "--ckpt_path", "last_or_new"]
    print(f"[stable to step {s}] {shlex.join(cmd)}", flush=True)
    return 0 if dry_run else subprocess.run(cmd, cwd=ROOT).returncode


def stable_checkpoints(run_dir: Path, s: int) -> tuple[list[tuple[int, Path]], list[int]]:
    """The run's checkpoints at or before step ``s`` (newest first), and the steps of those after it. A file
    that does not open and may stand at or before ``s`` is refused, naming it: never passed over for an older
    one."""
    steps = [(recorded_step(p), p) for p in sorted(RunDir(ROOT / run_dir).checkpoints.glob("*.ckpt"))]
    before = sorted(((st, p) for st, p in steps if st is not None and st <= s), key=lambda x: (-x[0], x[1].name))
    newest = before[0][0] if before else -1
    for st, p in steps:
        named = re.match(r"step(\d+)", p.name)  # FinalCheckpoint's stepNNNNNNN.ckpt; other names: any step
        if st is None and (named is None or newest < int(named[1]) <= s):
            problem = checkpoint_problem(p, cursors=False) or "does not open"
            raise ConfigError(f"--from {run_dir}: checkpoint {p}: {problem.rstrip('.')}; it may be the stable "
                              f"run's newest at or before the anneal start (step {s}), so no older one is taken in "
                              "its place: restore it, or remove it to branch from the older one")
    return before, sorted(st for st, _ in steps if st is not None and st > s)


def arms_and_corpus(data, arms_file: Path | None) -> tuple[dict[str, dict[str, float]], dict[str, int], object]:
    """Every arm (``control`` first) checked against the corpus and ``data.max_epochs``; the corpus's tokens per
    source and its manifest."""
    schedule = data.schedule.build()
    s = schedule.anneal_step
    if schedule.phase_boundaries[-1][1] != s or len(schedule.phase_boundaries) < 2:
        raise ConfigError(f"data.schedule.mixture: no phase starts at the anneal start (step {s}); a branch "
                          "replaces the phase that starts there")
    if data.val_tokens_per_source <= 0:
        raise ConfigError("data.val_tokens_per_source is 0: the arms are compared on held-out loss per source, and "
                          "a stable run trained without a held-out set has trained on what would be held out; "
                          "train the stable phase with one (--train-stable -- CONFIGS --data.val_tokens_per_source "
                          "4096, into a new --from directory)")
    manifest = build_manifest(data)
    available = {n: int(info.stream_tokens) for n, info in manifest.sources.items()}
    arms = {CONTROL: dict(zip(schedule.sources, schedule.phase_weights[-2].tolist())), **load_arms(arms_file, schedule)}
    for name, weights in arms.items():
        check_arm(name, arm_mixture(data.schedule, weights), data, available, arms_file)
    return arms, available, manifest


def make_plan(source: Path, arms_file: Path | None, replicates: int, extra: list[str], out: Path) -> Plan:
    """Everything checked, nothing written: the stable checkpoint, the arms, the overrides, their implied
    epochs."""
    if not (ROOT / source / "config.yaml").is_file():
        raise ConfigError(f"--from {source}: no config.yaml (not a train fit run directory); train the stable "
                          "phase with --train-stable -- --config CONFIG")
    cfg = resolve_config(stable_config(source) + extra)
    data = data_config(cfg)
    check_relative_globs(data, f"--from {source}'s config.yaml")
    schedule = data.schedule.build()
    s = schedule.anneal_step
    arms, available, manifest = arms_and_corpus(data, arms_file)
    before, after = stable_checkpoints(source, s)
    if not before:
        raise ConfigError(f"--from {source}: " + (
            f"its checkpoints are at steps {after}, all after the anneal start (step {s}): it is already annealing "
            "and a branch needs one at or before it; train the stable phase into another --from directory with "
            "--train-stable" if after else f"no checkpoint at or before the anneal start (step {s}); train the "
            "stable phase with --train-stable"))
    step, ckpt = before[0]
    loaded = read_checkpoint(ckpt, "stable checkpoint", "choose another --from")  # verified against its sidecar
    check_resume(str(ckpt), loaded.get("hyper_parameters"), cfg.model.as_dict())
    state = loaded.get("WellMixedData") or {}
    if state.get("seed") != data.seed:
        raise ConfigError(f"stable checkpoint {ckpt}: data.seed {state.get('seed')}, the branch asks "
                          f"{data.seed}: a branch continues the stable run's data order; give its seed")
    if state.get("fingerprint") != manifest.fingerprint():
        raise ConfigError(f"stable checkpoint {ckpt}: trained on another corpus (fingerprint "
                          f"{state.get('fingerprint')}, this one {manifest.fingerprint()}); branch with the stable "
                          "run's corpus")
    # the overrides after -- may change nothing a branch keeps (else every arm would be refused at its start)
    changed = [c for c in schedule_changes(state.get("schedule"), schedule_fingerprint(data.schedule))
               if not c.startswith("data.schedule.mixture")]
    if changed:
        raise ConfigError(f"stable checkpoint {ckpt} (step {step}): the overrides after -- change "
                          f"{'; '.join(changed)}: a branch changes only the mixture from the anneal start on; "
                          "remove them (another LR or schedule is another stable run)")
    check_data_settings(state.get("data_settings"), data_settings(data), False, step)
    return Plan(str(source), str(repo_relative(ckpt)), step, s, schedule.total_steps, arms,
                [data.num_workers] * replicates, available,
                sum(schedule.tokens_at(t) for t in range(s)), schedule.total_tokens, extra,
                start_losses(ROOT / source, step), content_sha256(ckpt),
                str(out / "stable-to-S") if step < s else None)


def stable_config(source: Path) -> list[str]:
    """``--config`` with the stable run's saved config, less the keys of ``fit`` alone (``ckpt_path``)."""
    saved = yaml.safe_load((ROOT / source / "config.yaml").read_text())
    return ["--config", yaml.safe_dump({k: v for k, v in saved.items() if k not in ("ckpt_path", "weights_only")},
                                         sort_keys=False)]


def read_yaml(path: Path, what: str):
    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        detail = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0]
        raise ConfigError(f"{what}: cannot read {path} ({detail}); fix the file or the path") from None


def load_arms(path: Path | None, schedule) -> dict[str, dict[str, float]]:
    """The arms of ``--arms`` (default: the run's own phase at the anneal start), names and weights checked."""
    if path is None:
        name = schedule.phase_boundaries[-1][0]
        return {name: dict(zip(schedule.sources, schedule.phase_weights[-1].tolist()))}
    loaded = read_yaml(path, "--arms")
    entries = loaded.get("arms") if isinstance(loaded, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"--arms {path}: expected `arms: [{{name: N, weights: {{source: share}}}}, ...]`")
    out: dict[str, dict[str, float]] = {}
    for i, entry in enumerate(entries):
        entry = entry if isinstance(entry, dict) else {}
        name, weights = entry.get("name"), entry.get("weights")
        if not isinstance(name, str) or not ARM_NAME.match(name) or name == CONTROL:
            raise ConfigError(f"--arms {path}: arms[{i}].name {name!r}: give a name of letters, digits, _ and . "
                              f"(`{CONTROL}` is the stable weights, added by itself)")
        if name in out:
            raise ConfigError(f"--arms {path}: arms[{i}].name {name!r} is given twice; rename one")
        where = f"--arms {path}: arms[{i}] ({name}).weights"
        if isinstance(weights, str):
            loaded = read_yaml(Path(path).parent / weights, where) or {}
            weights = loaded.get("weights", loaded) if isinstance(loaded, dict) else loaded
        if not isinstance(weights, dict):
            raise ConfigError(f"{where}: give {{source: share, ...}} or a file holding one")
        bad = next(((k, v) for k, v in weights.items()
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0), None)
        if bad:
            raise ConfigError(f"{where}.{bad[0]}: {bad[1]!r} is not a share (a number >= 0)")
        out[name] = {str(k): float(v) for k, v in weights.items()}
    return out


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
    """The bridge to S (when the stable checkpoint is earlier), then one job per (replicate, arm),
    replicate-major: every arm of a replicate before the next one. Each starts from its checkpoint while its
    run directory holds none (``Job.start``)."""
    stable = ["--config", str(Path(plan.stable_run) / "config.yaml"), *plan.extra, "--data.order_log", "true"]
    jobs = [Job("stable", 0, plan.bridge, [*stable, "--trainer.max_steps", str(plan.anneal_start), "--run.dir",
                                           plan.bridge], start=plan.checkpoint)] if plan.bridge else []
    for r, workers in enumerate(plan.workers):
        for arm in plan.arms:
            run_dir = out / f"{arm}-rep{r}"
            args = [*stable, "--data.schedule.mixture", str(out / "arms" / f"{arm}.yaml"), "--data.num_workers",
                    str(workers), "--data.replicate", str(r), "--run.branch", "true", "--trainer.max_steps", "-1",
                    "--run.dir", str(run_dir), "--run.wandb_group", out.name,
                    "--run.wandb_name", f"{out.name}/{arm}-rep{r}"]
            jobs.append(Job(arm, r, str(run_dir), args, start=plan.branch_checkpoint()))
    return jobs


def claim(out: Path, plan: Plan) -> None:
    """Writes ``OUT/branch.json`` and the arms' mixtures. An OUT holding this plan is continued; one holding
    it with fewer replicates or arms is extended; another plan (or other files) is refused, naming what
    differs: the same command continues its arms, never overwrites them."""
    root = ROOT / out
    plan_file = root / "branch.json"
    new = json.loads(json.dumps(asdict(plan)))
    if plan_file.is_file():
        try:
            old = json.loads(plan_file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--out {out}: {plan_file} does not read ({e}); choose another --out") from None
        differ = sorted(k for k in new.keys() | old.keys() if k not in ("arms", "workers") and old.get(k) != new.get(k))
        kept = {a: w for a, w in new["arms"].items() if a in old.get("arms", {})}
        if kept != old.get("arms") or new["workers"][:len(old.get("workers", []))] != old.get("workers"):
            differ.append("arms (an arm's weights changed, or an arm is missing)" if kept != old.get("arms")
                          else "workers (replicate r's data.num_workers)")
        if differ:
            raise ConfigError(f"--out {out} already holds a branch ablation with another plan ({plan_file}): "
                              f"{', '.join(differ)} differ; continue it with its own --from/--arms/--replicates "
                              "and overrides (more replicates or another arm extend it), or choose another --out")
        if old == new:
            return
        print(f"extending {out}: arms {', '.join(a for a in new['arms'] if a not in old['arms']) or '-'}, "
              f"replicates {len(old['workers'])} -> {len(new['workers'])}", flush=True)
    elif root.is_dir() and any(root.iterdir()):
        raise ConfigError(f"--out {out} is not empty and holds no branch.json: choose another --out")
    base = data_config(resolve_config(stable_config(Path(plan.stable_run)) + plan.extra)).schedule
    (root / "arms").mkdir(parents=True, exist_ok=True)
    for arm, weights in plan.arms.items():
        write_text(root / "arms" / f"{arm}.yaml", yaml.safe_dump(arm_mixture(base, weights), sort_keys=False))
    write_json(plan_file, new, indent=1)


if __name__ == "__main__":
    sys.exit(main())
