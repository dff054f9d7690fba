"""The ablation pair: configs that differ only in the mixture, the runner, and the comparison report.

The end-to-end test trains both demo arms over 2 seeds with the tiny model (one runner command, ~35
steps each) and reads the report; the flagging tests doctor copies of those runs instead of training
again.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml
from training_runs import SMALL

from ablations import report, run
from ablations.outcomes import drawn_tokens, is_complete
from data.schedules import LRConfig, PhaseConfig, build_schedule, tokens_per_source
from train.rundir import read_metrics

ROOT = Path(__file__).resolve().parents[2]

PAIRS = sorted(run.PAIRS)
SOURCES = ("web", "code", "books", "curated")  # the demo corpus's sources
SOURCES_OF = {"demo": SOURCES, "350m_2b": ("web", "code", "pdfs", "curated")}  # each pair's config's sources


# -- configs -------------------------------------------------------------------------------------
def resolved(configs: list[str]) -> dict:
    """The full config LightningCLI builds from the stacked files (``fit --print_config``)."""
    from train.cli import WellMixedCLI

    args = ["fit"] + [a for c in configs for a in ("--config", str(ROOT / c))] + ["--print_config"]
    buf = io.StringIO()
    with (mock.patch.object(sys, "argv", ["train"]), contextlib.redirect_stdout(buf),  # argv: pytest's, not ours
          pytest.raises(SystemExit)):
        WellMixedCLI(args=args)
    return with_phase_defaults(yaml.safe_load(buf.getvalue()))


def with_phase_defaults(cfg: dict) -> dict:
    """Each mixture phase with its dataclass defaults filled in: jsonargparse prints a phase list written
    inline with only the keys given, and one read from a file (``mixture: schedule_mixture.yaml``) with
    every key; both build the same PhaseConfig objects."""
    mixture = cfg["data"]["schedule"]["mixture"]
    for holder in (mixture, mixture.get("fixed_equivalent_of") or {}):
        if isinstance(holder, dict) and holder.get("phases"):
            holder["phases"] = [dataclasses.asdict(PhaseConfig(**ph)) for ph in holder["phases"]]
    return cfg


def flatten(d, prefix="") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


@pytest.fixture(scope="module")
def arms() -> dict[str, dict[str, dict]]:
    return {name: {arm: resolved(pair.configs(arm)) for arm in run.ARMS} for name, pair in run.PAIRS.items()}


@pytest.mark.parametrize("pair", PAIRS)
def test_arms_differ_only_in_the_mixture(arms, pair):
    sched, fixed = arms[pair]["scheduled"], arms[pair]["fixed"]
    a, b = flatten(sched), flatten(fixed)
    differing = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert differing and all(k.startswith("data.schedule.mixture.") or k == "run.dir" for k in differing), differing
    mix_s, mix_f = sched["data"]["schedule"]["mixture"], fixed["data"]["schedule"]["mixture"]
    # the fixed arm is derived from the scheduled phases, not typed by hand
    assert mix_f["phases"] == [] and mix_f["weights"] is None
    assert mix_f["fixed_equivalent_of"]["phases"] == mix_s["phases"]
    assert sched["data"]["seed"] == fixed["data"]["seed"] and sched["seed_everything"] == fixed["seed_everything"]


@pytest.mark.parametrize("pair", PAIRS)
def test_fixed_arm_draws_the_scheduled_tokens_per_source(arms, pair):
    sched, fixed = (build_schedule(arms[pair][arm]["data"]["schedule"], list(SOURCES_OF[pair])) for arm in run.ARMS)
    planned_s, planned_f = tokens_per_source(sched), tokens_per_source(fixed)
    for s in SOURCES_OF[pair]:
        assert planned_f[s] == pytest.approx(planned_s[s], rel=1e-6)
    for attr in ("total_steps", "total_tokens", "anneal_step"):  # and so the same LR (model.lr on these steps)
        assert getattr(fixed, attr) == getattr(sched, attr), attr
    assert len(sched.phase_boundaries) == 2 and len(fixed.phase_boundaries) == 1  # a real schedule vs a fixed mix
    assert fixed.mixture_weights(0)["curated"] > sched.mixture_weights(0)["curated"]


def test_350m_2b_is_the_full_run_at_ten_percent(arms):
    full = flatten(resolved(["configs/pretrain_350m_20b.yaml"]))
    ablation = flatten(arms["350m_2b"]["scheduled"])
    differing = {k for k in full.keys() | ablation.keys() if full.get(k) != ablation.get(k)}
    scaled = {"data.schedule.train_tokens", "data.schedule.seq_len.warmup_steps", "model.lr.warmup_steps"}
    assert differing - scaled <= {"data.order_log"} | {k for k in differing if k.startswith("run.")}, differing
    for key in scaled:
        assert ablation[key] * 10 == full[key], key
    schedule = build_schedule(arms["350m_2b"]["scheduled"]["data"]["schedule"], list(SOURCES_OF["350m_2b"]))
    assert schedule.anneal_step / schedule.total_steps == pytest.approx(0.9, abs=1e-3)  # anneal in the last 10%
    lr = LRConfig(**arms["350m_2b"]["scheduled"]["model"]["lr"]).build(schedule.total_steps, schedule.anneal_step)
    assert lr.decay_start == schedule.anneal_step and lr(schedule.total_steps - 1) == 0.0
    assert schedule.mixture_weights(schedule.anneal_step)["curated"] == 0.35


def test_demo_pair_is_the_demo_config(arms):
    demo = flatten(resolved(["configs/demo.yaml"]))
    ablation = flatten(arms["demo"]["scheduled"])
    differing = {k for k in demo.keys() | ablation.keys() if demo.get(k) != ablation.get(k)}
    assert differing <= {"data.order_log"} | {k for k in differing if k.startswith("run.")}, differing


def test_every_ablation_yaml_loads():
    for path in sorted((ROOT / "ablations").glob("*.yaml")):
        assert isinstance(yaml.safe_load(path.read_text()), dict), path
    rule = report.DecisionRule.load(ROOT / "ablations" / "decision_rule.yaml")
    assert rule.improve == ["heldout/curated", "heldout/all"] and rule.max_regression == 0.01 and rule.alpha == 0.05


# thin command lines over an ablations/ library module
SCRIPTS_OVER_ABLATIONS = {"scripts/diagnose_run.py", "scripts/bench_decision.py"}


def test_imports_run_one_way():
    """ablations/ imports train/ and data/; train/, data/ (and scripts/, but for the command lines over
    ablations/ modules) never import ablations/."""
    for folder in ("train", "data", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.relative_to(ROOT).as_posix() in SCRIPTS_OVER_ABLATIONS:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                assert not any(n.split(".")[0] == "ablations" for n in names), path


# -- runner --------------------------------------------------------------------------------------
def test_runner_dry_run_names_each_arm_and_seed(capsys, tmp_path):
    assert run.main(["--pair", "demo", "--seeds", "1", "2", "--out", str(tmp_path / "abl"), "--dry-run",
                     "--", "--trainer.precision", "32-true"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split("]")[0] for ln in lines] == ["[scheduled-seed1", "[fixed-seed1", "[scheduled-seed2",
                                                  "[fixed-seed2"]
    fixed = lines[1]
    assert ("--config configs/demo.yaml --config ablations/demo_scheduled.yaml "
            "--config ablations/demo_fixed.yaml") in fixed
    assert f"--run.dir {tmp_path}/abl/fixed-seed1 " in fixed and "--data.seed 1 " in fixed
    assert "--run.wandb_group abl --run.wandb_name abl/fixed-seed1" in fixed
    assert fixed.endswith("--trainer.precision 32-true --ckpt_path last_or_new")  # resumes whatever it holds
    assert "demo_fixed" not in lines[0]


def test_runner_checks_the_overrides_as_train_fit_does_before_any_run(capsys, tmp_path):
    """Guards: ``-- --data.seed 9`` relabelling every run (seed 1234's run trained with seed 9), and a
    misspelt override found only when the first run starts."""
    assert run.main(["--pair", "demo", "--out", str(tmp_path / "abl"), "--dry-run", "--", "--data.seed", "9"]) == 2
    assert capsys.readouterr().err.startswith("error: --data.seed is set per run by ablations/run.py")
    assert run.main(["--pair", "demo", "--out", str(tmp_path / "abl"), "--dry-run", "--", "--trainer.precison",
                     "32"]) == 2
    assert "did you mean --trainer.precision" in capsys.readouterr().err
    # a key that parses but a data config that does not validate: refused as train fit refuses it
    assert run.main(["--pair", "demo", "--out", str(tmp_path / "abl"), "--dry-run", "--",
                     "--data.schedule.anneal_start", "1.5"]) == 2
    assert "data.schedule.anneal_start: 1.5 must be in (0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "abl").exists()


def test_runner_runs_three_seeds_by_default(capsys, tmp_path):
    assert run.main(["--pair", "demo", "--out", str(tmp_path / "abl"), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split("]")[0] for ln in lines] == [f"[{arm}-seed{s}" for s in (1234, 1235, 1236) for arm in run.ARMS]
    for line in lines:  # seed s of one arm is seed s of the other: model init and data order alike
        seed = line.split("-seed")[1].split("]")[0]
        assert f"--seed_everything {seed} --data.seed {seed} " in line and f"-seed{seed} " in line
    assert run.main(["--pair", "demo", "--out", str(tmp_path / "abl"), "--dry-run", "--num-seeds", "1"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert run.main(["--pair", "demo", "--seeds", "1", "1", "--dry-run"]) == 2
    assert capsys.readouterr().err == "error: --seeds repeats a seed: [1, 1]\n"


def test_slurm_array_runs_one_arm_per_task(capsys, tmp_path):
    out = tmp_path / "abl"
    assert run.main(["--pair", "350m_2b", "--slurm", "--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    # one array task per arm and seed: 2 arms x 3 seeds by default
    assert printed.startswith("sbatch --array=0-5 --job-name=abl ablations/ablation.sbatch ")
    assert [ln.split(":")[0].strip() for ln in printed.splitlines()[1:]] == [f"task {i}" for i in range(6)]
    assert "fixed-seed1236 " in printed.splitlines()[-1]
    # what array task 1 runs: the fixed arm, through the SLURM launcher (CONFIG, then the overrides)
    jobs = run.plan_jobs(run.PAIRS["350m_2b"], [1234], out, "abl", [])
    out.mkdir()
    (out / "jobs.json").write_text(json.dumps([vars(j) for j in jobs]))

    def task(launcher: str) -> str:
        env = {**os.environ, "SLURM_ARRAY_TASK_ID": "1", "DRY_RUN": "1", "LAUNCHER": launcher, "PY": sys.executable}
        return subprocess.run(["bash", str(ROOT / run.SBATCH), str(out / "jobs.json")], cwd=ROOT, env=env,
                              capture_output=True, text=True, check=True).stdout.strip()

    launched = task("scripts/slurm/train.sbatch")
    assert launched.startswith("bash scripts/slurm/train.sbatch configs/pretrain_350m_20b.yaml --config "
                               "ablations/350m_2b_scheduled.yaml --config ablations/350m_2b_fixed.yaml "
                               "--seed_everything")
    assert f"--run.dir {out}/fixed-seed1234 " in launched and "--ckpt_path" not in launched  # the launcher resumes
    plain = task("srun")
    assert plain.startswith("srun ") and "-m train fit --config configs/pretrain_350m_20b.yaml" in plain
    assert plain.endswith("--ckpt_path last_or_new")  # resumes when resubmitted; the first start has none


# -- end to end on the demo corpus, tiny model -----------------------------------------------------
TINY = [*SMALL, "--data.num_workers", "1", "--run.ckpt_every_n_steps", "10"]
# 4k tokens over 4 rows while single demo documents run to 14k tokens: the documents in flight at
# the end are a large share of each source's tokens, so the realised counts get a wide tolerance
# here (planned tokens and the mixers' targets are still compared to 1e-6).
TINY_REPORT = ["--token-rtol", "0.5", "--suite", "heldout"]


SEEDS = (1234, 1235)


@pytest.fixture(scope="module")
def ablation_out(demo_corpus, tmp_path_factory) -> Path:
    """Both demo arms over 2 seeds (the fewest the decision rule decides on), tiny model."""
    out = tmp_path_factory.mktemp("ablation") / "abl"
    sources = {s: {"paths": [str(demo_corpus / s / "*.parquet")]} for s in SOURCES}
    cmd = [sys.executable, str(ROOT / "ablations" / "run.py"), "--pair", "demo", "--out", str(out), "--no-report",
           "--num-seeds", str(len(SEEDS)), "--", *TINY, "--data.sources", json.dumps(sources)]
    env = {**os.environ, "WELLMIXED_CACHE": str(out.parent / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_demo_ablation_end_to_end(ablation_out, capsys):
    assert sorted(d.name for d in ablation_out.iterdir() if d.is_dir()) == sorted(
        f"{arm}-seed{s}" for arm in run.ARMS for s in SEEDS)
    runs = {arm: ablation_out / f"{arm}-seed1234" for arm in run.ARMS}
    assert all(is_complete(d) for d in runs.values())  # held-out loss logged at the last step
    (sched, steps_s), (fixed, steps_f) = (drawn_tokens(runs[arm]) for arm in run.ARMS)
    assert steps_s == steps_f > 30 and sum(sched.values()) == sum(fixed.values())
    for d in runs.values():  # last.ckpt holds the final model, although step checkpoints came before it
        assert torch.load(d / "checkpoints" / "last.ckpt", weights_only=True, mmap=True)["global_step"] == steps_s

    assert report.main([str(ablation_out), *TINY_REPORT]) == 0
    md = (ablation_out / "report.md").read_text()
    assert "CHECKS FAILED" not in md and "MISMATCH" not in md
    assert "Equal: both arms drew the same tokens per source" in md
    assert "Planned tokens (each run's saved config): equal. Mixer targets" in md and "checkpoint): equal." in md
    assert any(h in md for h in ("KEEP the schedule", "DROP the schedule", "NO CLEAR GAIN"))
    assert "CANNOT DECIDE" not in md and "2 seed(s) (1234, 1235)" in md
    # the rule and its inputs, one table: a row per metric with both seeds' paired gains, mean, SE, t, p
    assert ("| metric | role | pairs | gain per pair | mean gain | SE | t | t needed | p | detectable gain | threshold "
            "| status | |") in md
    curated = next(ln for ln in md.splitlines() if ln.startswith("| `heldout/curated` | improve + guard | 2 | "))
    gains = [float(x) for x in curated.split(" | ")[3].split(", ")]
    assert len(gains) == 2 and float(curated.split(" | ")[4]) == pytest.approx(sum(gains) / 2, abs=1e-4)
    assert float(curated.split(" | ")[5]) == pytest.approx(abs(gains[0] - gains[1]) / 2, abs=1e-4)  # SE of 2
    for source in (*SOURCES, "all"):
        assert f"| {source} |" in md
    for png in ("heldout_end.png", "heldout_along_run.png", "tokens_drawn.png"):
        assert (ablation_out / png).stat().st_size > 10_000 and f"]({png})" in md

    # the runner is idempotent: finished runs are skipped, nothing trains again
    assert run.main(["--pair", "demo", "--out", str(ablation_out), "--no-report", "--num-seeds", "2"]) == 0
    assert capsys.readouterr().out.count("is complete: skipped") == 4


def copy_runs(src: Path, dst: Path, seeds=SEEDS) -> Path:
    """The logs of an ablation folder, without the checkpoints (the mixer targets are then not checked)."""
    for d in src.iterdir():
        m = report.RUN_DIR.match(d.name)
        if d.is_dir() and m and int(m.group(2)) in seeds:
            for part in ("csv", "order_log"):
                shutil.copytree(d / part, dst / d.name / part)
            for config in d.glob("config*.yaml"):  # config.yaml (latest launch) and config-NNN.yaml
                shutil.copy(config, dst / d.name / config.name)
    return dst


@pytest.mark.slow
def test_report_flags_unequal_tokens(ablation_out, tmp_path):
    out = copy_runs(ablation_out, tmp_path / "abl")
    log = out / "fixed-seed1234" / "order_log" / "rank0.jsonl"
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    for line in lines:  # as if the fixed arm had drawn 60 tokens per step of web as curated
        moved = min(60, line["source_tokens"]["web"])
        line["source_tokens"]["web"] -= moved
        line["source_tokens"]["curated"] += moved
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert report.main([str(out), *TINY_REPORT]) == 1
    md = (out / "report.md").read_text()
    assert md.startswith("# Ablation report") and "## ⚠️ CHECKS FAILED" in md
    flag = next(ln for ln in md.splitlines() if ln.startswith("- **FLAG**"))
    assert "seed 1234: tokens drawn per source DIFFER beyond the tolerance for" in flag and "curated (" in flag
    assert "| curated |" in md and "**MISMATCH**" in md and "Mixer targets" in md and "not checked" in md


@pytest.mark.slow
def test_report_flags_arms_configured_for_different_tokens(ablation_out, tmp_path):
    """A fixed arm run with hand-typed weights (the stable phase's) instead of the fixed equivalent."""
    out = copy_runs(ablation_out, tmp_path / "abl")
    cfg_path = out / "fixed-seed1234" / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["data"]["schedule"]["mixture"] = {"weights": {"web": 0.62, "code": 0.18, "books": 0.12, "curated": 0.08}}
    cfg_path.write_text(yaml.safe_dump(cfg))
    assert report.main([str(out), "--token-rtol", "100", "--suite", "heldout"]) == 1  # the plan differs
    md = (out / "report.md").read_text()
    assert "configured for DIFFERENT tokens per source" in md
    assert "Planned tokens (each run's saved config): **NOT equal**" in md
    assert "differ in more than the mixture" not in md

    cfg["model"]["lr"]["peak"] = 3e-3  # and a different learning rate
    cfg_path.write_text(yaml.safe_dump(cfg))
    assert report.main([str(out), "--token-rtol", "100", "--suite", "heldout"]) == 1
    md = (out / "report.md").read_text()
    assert "the arms' configs differ in more than the mixture: `model.lr.peak`" in md


@pytest.mark.slow
def test_decision_rule_from_flags(ablation_out, tmp_path):
    out = copy_runs(ablation_out, tmp_path / "abl")
    diffs = report.evaluate([report.EVALUATIONS["heldout"]], report.discover(out), list(SEEDS))
    assert all(d.n == 2 for d in diffs.values())
    # almost no noise allowance (alpha -> 0.5: t needed -> 0) and no tolerance, on the metric whose mean loss
    # rose most: it drops the schedule if its loss rose at all
    worst, metric = max((-d.gain, m) for m, d in diffs.items())
    strict = report.decide(report.DecisionRule(improve=[], guard=[metric], max_regression=0.0, alpha=0.4999), diffs)
    assert strict.outcome == ("drop" if worst > 0 else "keep")
    # a loose tolerance: nothing worsens, nothing must improve
    loose = report.decide(report.DecisionRule(improve=[], max_regression=max(worst, 0) + 1.0), diffs)
    assert loose.keep
    assert report.main([str(out), *TINY_REPORT, "--improve", "heldout/code", "--max-regression", "5",
                        "--alpha", "0.2"]) == 0
    md = (out / "report.md").read_text()
    assert "| `heldout/code` | improve + guard | 2 |" in md and "worsens when -t exceeds" in md
    assert "Student's 1 - 0.2/A quantile" in md and "--improve, --max-regression, --alpha" in md


@pytest.mark.slow
def test_one_seed_cannot_decide(ablation_out, tmp_path):
    out = copy_runs(ablation_out, tmp_path / "abl", seeds=(1234,))
    assert report.main([str(out), *TINY_REPORT]) == 0  # a valid comparison, but no decision
    md = (out / "report.md").read_text()
    assert "**CANNOT DECIDE (fewer than 2 seeds: no estimate of the noise)**" in md
    assert "KEEP the schedule" not in md and "DROP the schedule" not in md
    assert "| `heldout/curated` | improve + guard | 1 |" in md and "cannot decide" in md


@pytest.mark.slow
def test_diagnostics_of_a_real_run(ablation_out, tmp_path, demo_corpus):
    """scripts/diagnose_run.py on an arm of the tiny ablation passes; with its order log copied onto a
    second rank (two ranks reading the same documents) the rank-overlap check fails."""
    from ablations.diagnose import FAIL, PASS, write_report

    run_dir = ablation_out / "scheduled-seed1234"
    out, checks = write_report(run_dir, tmp_path / "ok" / "diagnostics.md", corpus_dir=demo_corpus)
    status = {c.name: c.status for c in checks}
    assert FAIL not in status.values(), out.read_text()
    assert status["document overlap between ranks per source-epoch"] == PASS
    assert status["implied epochs: realised vs planned"] == PASS
    assert "Corpus: found" in out.read_text()

    bad = copy_runs(ablation_out, tmp_path / "abl", seeds=(1234,)) / "scheduled-seed1234"
    rank0 = (bad / "order_log" / "rank0.jsonl").read_text().splitlines()
    (bad / "order_log" / "rank1.jsonl").write_text(
        "".join(json.dumps({**json.loads(x), "rank": 1}) + "\n" for x in rank0 if x))
    _, checks = write_report(bad, corpus_dir=demo_corpus, plots=False)
    overlap = next(c for c in checks if c.name.startswith("document overlap"))
    assert overlap.status == FAIL and "on 2+ ranks" in overlap.summary and "over 2 rank(s)" in overlap.summary


# -- what the comparison relies on in the training loop ----------------------------------------------
def test_csv_history_survives_a_resume(tmp_path):
    """Lightning's CSV logger deleted metrics.csv on start: a resumed arm lost its held-out curve."""
    from train.lightning_internals import ResumableCSVLogger

    for steps in ([0, 1], [2]):  # a run, then its resume (with a new column)
        logger = ResumableCSVLogger(save_dir=str(tmp_path), name="csv", version="")
        for step in steps:
            logger.log_metrics({"val/loss": 10.0 - step, **({"new": 1.0} if step == 2 else {})}, step=step)
        logger.save()
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["val/loss"], r["new"]) for r in rows] == [("0", "10.0", ""), ("1", "9.0", ""),
                                                                    ("2", "8.0", "1.0")]


def test_the_lm_eval_suite_without_the_harness_is_refused_before_any_export(tmp_path):
    """Without lm-eval installed, `--suite heldout,lm_eval` names the install command and writes nothing
    (it used to export 66 MB into each run and then crash)."""
    import subprocess
    import sys

    # lm-eval hidden even where it is installed (a None entry in sys.modules: find_spec says absent)
    hide = ("import runpy, sys; sys.modules['lm_eval'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    before = sorted(p for p in (ROOT / "ablations" / "sample").rglob("*"))
    r = subprocess.run([sys.executable, "-c", hide, "ablations/report.py", "ablations/sample", "--suite",
                        "heldout,lm_eval"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "pip install -e '.[eval]'" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p for p in (ROOT / "ablations" / "sample").rglob("*")) == before


@pytest.mark.slow
def test_the_report_shows_the_local_downstream_tasks_per_arm_and_seed(ablation_out, tmp_path):
    """The `local` suite's per-run results (lm-eval on each run's export, cached in
    <run>/evals/lm_eval/local/metrics.json; the route itself is tested end to end in test_train.py)
    reach the report's downstream table as paired differences, higher is better."""
    out = copy_runs(ablation_out, tmp_path / "abl")
    acc = {("scheduled", 1234): 0.40, ("fixed", 1234): 0.30, ("scheduled", 1235): 0.50, ("fixed", 1235): 0.30}
    for (arm, seed), value in acc.items():
        cached = out / f"{arm}-seed{seed}" / "evals" / "lm_eval" / "local" / "metrics.json"
        cached.parent.mkdir(parents=True)
        cached.write_text(json.dumps({"cloze_web": value, "cloze_code": 0.25}))
    assert report.main([str(out), *TINY_REPORT, "--suite", "heldout,local"]) == 0
    md = (out / "report.md").read_text()
    assert "| local/cloze_web | 0.4500 | 0.3000 | +0.1500 ± 0.0707 | higher |" in md, md
    assert "| local/cloze_code | 0.2500 | 0.2500 | +0.0000 ± 0.0000 | higher |" in md


@pytest.mark.slow
def test_the_default_suite_adds_the_local_tasks_only_where_they_can_run(ablation_out, tmp_path, capsys):
    """With lm-eval and every run's final checkpoint: heldout,local. Logs only (no checkpoints): heldout,
    and a note saying why, instead of a FileNotFoundError half-way through the report."""
    assert report.default_suite(ablation_out) == "heldout,local"  # every run has its last.ckpt
    assert report.default_suite(copy_runs(ablation_out, tmp_path / "logs_only")) == "heldout"
    assert "no checkpoints/last.ckpt in scheduled-seed1234, " in capsys.readouterr().err
