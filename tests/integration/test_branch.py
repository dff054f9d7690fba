"""Decay branches (ablations/branch.py): one stable run, arms branched from its checkpoint before the
anneal start, the data order continued; checked on the order logs. Then the refusals, before compute.

The stable run is tests/training_runs.py's TINY (17 steps; anneal start S = 8; checkpoints every 3
steps, so its newest checkpoint before S is step 6: the ablation trains steps 6-7 once, in
``OUT/stable-to-S``, and every arm branches at S) with a held-out set; two arms (the run's own anneal,
and curated at 0.5 from S) and the control, 2 replicates: 6 branches of 9 steps.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml
from training_runs import TINY

from ablations import branch, report
from ablations.run import Job, task_args
from data.errors import ConfigError
from train.rundir import read_order_log

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("web", "code", "books", "curated")
S, CKPT = 8, 6  # the anneal start; the newest checkpoint at or before it


def env_for(root: Path) -> dict:
    return {**os.environ, "WELLMIXED_CACHE": str(root / "cache"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def stable(demo_corpus, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("branch")
    sources = {s: {"paths": [str(demo_corpus / s / "*.parquet")]} for s in SOURCES}
    cmd = [sys.executable, "-m", "train", "fit", *TINY, "--data.sources", json.dumps(sources),
           "--data.val_tokens_per_source", "64", "--run.dir", str(root / "stable")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env_for(root), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (root / "arms.yaml").write_text(yaml.safe_dump({"arms": [
        {"name": "anneal", "weights": {"web": 0.35, "code": 0.20, "books": 0.10, "curated": 0.35}},
        {"name": "curated50", "weights": {"web": 0.25, "code": 0.15, "books": 0.10, "curated": 0.50}}]}))
    return root / "stable"


@pytest.fixture(scope="module")
def branched(stable) -> tuple[Path, str]:
    out = stable.parent / "abl"
    cmd = [sys.executable, "-m", "ablations.branch", "--from", str(stable), "--arms", str(stable.parent / "arms.yaml"),
           "--replicates", "2", "--out", str(out), "--report-args=--suite heldout"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env_for(stable.parent), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout + proc.stderr


def lines(run_dir: Path) -> dict[int, dict]:
    return {d["step"]: d for d in read_order_log(run_dir)}


def arm_dirs(out: Path, rep: int | None = None) -> list[Path]:
    return sorted(d for d in out.glob(f"*-rep{'*' if rep is None else rep}") if d.is_dir())


@pytest.mark.slow
def test_the_stable_phase_is_finished_once_and_replicate_0_is_the_uninterrupted_run(stable, branched):
    """The steps from the stable checkpoint (6) to S (8) are trained once, in OUT/stable-to-S, equal to the
    uninterrupted run line for line (documents, tokens, weights, LR, the loss itself); every arm starts at
    S. Replicate 0 of the run's own anneal is then the uninterrupted run from S to the end, line for line:
    a restart at S with another seed or order would fail here."""
    out, log = branched
    assert log.count("branch at step 8: data.schedule.mixture.phases[1].weights.") == 4  # the arms that change it
    assert log.count("data.schedule.mixture.phases[1].weights.curated: 0.35 -> 0.5;") == 2  # curated50
    assert log.count("data.schedule.mixture.phases[1].weights.curated: 0.35 -> 0.08;") == 2  # control
    ref = lines(stable)
    bridge = lines(out / "stable-to-S")
    assert sorted(bridge) == list(range(CKPT, S))
    for step in range(CKPT, S):
        assert json.dumps(bridge[step]) == json.dumps(ref[step]), step
    for d in arm_dirs(out):
        mine = lines(d)
        assert min(mine) == S and max(mine) == max(ref), d.name
        assert mine[S]["lr"] == ref[S]["lr"] and mine[max(ref)]["lr"] == ref[max(ref)]["lr"]  # the same LR decay
        if not d.name.startswith("anneal"):
            assert mine[S]["weights"] != ref[S]["weights"]  # the arm's mixture from S on
    anneal = lines(out / "anneal-rep0")
    for step in range(S, max(ref) + 1):
        assert json.dumps(anneal[step]) == json.dumps(ref[step]), step


@pytest.mark.slow
def test_no_piece_trained_before_the_branch_is_trained_again(stable, branched):
    """Every arm and replicate: its whole history (the stable run to the checkpoint, then its own steps)
    trains each token of a document at most once (no source wraps in these runs)."""
    out, _ = branched
    ref = lines(stable)
    for d in arm_dirs(out):
        history = [ref[s] for s in range(S)] + list(lines(d).values())
        seen: dict[str, list[tuple[int, int]]] = {}
        for line in history:
            for doc, first, n in line["pieces"]:
                spans = seen.setdefault(doc, [])
                assert not any(a < first + n and first < b for a, b in spans), (d.name, line["step"], doc)
                spans.append((first, first + n))


def per_consumer_sources(run_dir: Path, workers: int) -> dict[tuple[int, str], list[str]]:
    """Documents of each (consumer, source) in order of first appearance after the branch (step s comes
    from consumer s mod workers)."""
    out: dict[tuple[int, str], list[str]] = {}
    for step, line in sorted(lines(run_dir).items()):
        for doc, _, _ in line["pieces"]:
            seq = out.setdefault((step % workers, doc.split("_")[0]), [])
            if step >= S and doc not in seq:
                seq.append(doc)
    return out


@pytest.mark.slow
def test_every_arm_draws_each_source_in_the_same_order(branched):
    """Common random numbers: within a replicate, each consumer's documents of a source are the same
    sequence in every arm, the arms taking more or less of it: the shorter is a prefix of the longer, in every
    replicate (a replicate keeps the layout; only its random streams are re-seeded)."""
    out, _ = branched
    plan = json.loads((out / "branch.json").read_text())
    orders = {}
    for rep, workers in enumerate(plan["workers"]):
        arms = [per_consumer_sources(d, workers) for d in arm_dirs(out, rep)]
        assert len(arms) == 3
        for a, b in ((0, 1), (0, 2), (1, 2)):
            for key in set(arms[a]) | set(arms[b]):
                short, long = sorted((arms[i].get(key, []) for i in (a, b)), key=len)
                assert short == long[:len(short)], (rep, key)
        orders[rep] = arms[0]
    assert orders[0] != orders[1]  # the replicates' layouts do re-cut the order: the noise is real


@pytest.mark.slow
def test_the_report_sets_every_arm_beside_the_control_and_the_command_continues(branched, capsys):
    out, _ = branched
    md = (out / "report.md").read_text()
    assert "CHECKS FAILED" not in md and "### `curated50`: **" in md
    assert "| metric | role | pairs | gain per pair |" in md  # decision.py's rule table, paired by replicate
    assert "| source | start (step) | end: control | end: anneal | end: curated50 |" in md
    assert "replicate r runs the branch with data.replicate r" in md and "common random numbers" in md
    plan = json.loads((out / "branch.json").read_text())
    assert plan["step"] == CKPT and plan["anneal_start"] == S and plan["bridge"] == str(out / "stable-to-S")
    assert list(plan["arms"]) == ["control", "anneal", "curated50"] and len(plan["checkpoint_sha256"]) == 64
    assert f"Stable phase once: {plan['stable_tokens']:,} tokens" in md
    assert (out / "heldout_end_curated50.png").stat().st_size > 10_000
    for d in arm_dirs(out):  # last.ckpt kept (report, export), the step checkpoints pruned
        assert torch.load(d / "checkpoints" / "last.ckpt", weights_only=True, mmap=True)["global_step"] == 17
    # the same command again: every arm is complete, nothing trains or is overwritten
    argv = ["--from", str(out.parent / "stable"), "--arms", str(out.parent / "arms.yaml"), "--replicates", "2",
            "--out", str(out), "--no-report"]
    assert branch.main(argv) == 0
    assert capsys.readouterr().out.count("is complete: skipped") == 7  # the bridge and 6 branches
    assert report.main([str(out), "--suite", "heldout"]) == 0


def refused(capsys, argv: list[str]) -> str:
    assert branch.main(argv) == 2
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


@pytest.mark.slow
def test_bad_input_is_refused_before_compute_with_one_line(stable, tmp_path, capsys):
    out = tmp_path / "abl"
    base = ["--from", str(stable), "--out", str(out)]

    def arms(*entries) -> list[str]:
        path = tmp_path / f"arms{len(list(tmp_path.glob('arms*')))}.yaml"
        path.write_text(yaml.safe_dump({"arms": list(entries)}))
        return ["--arms", str(path)]

    w = {"web": 0.25, "code": 0.15, "books": 0.10, "curated": 0.50}
    assert "arm 'a': schedule.mixture.phases[1].weights: weights sum to 1.1" in refused(
        capsys, base + arms({"name": "a", "weights": {**w, "web": 0.35}}))
    assert "arm 'a': " in refused(capsys, base + arms({"name": "a", "weights": {**w, "pdfs": 0.0}}))
    assert "arms[1].name 'a' is given twice" in refused(capsys, base + arms({"name": "a", "weights": w}, {"name": "a",
                                                                                                         "weights": w}))
    assert "`control` is the stable weights" in refused(capsys, base + arms({"name": "control", "weights": w}))
    assert "arm 'a': implied epochs curated 0.01" in refused(
        capsys, base + arms({"name": "a", "weights": w}) + ["--", "--data.max_epochs", "0.005"])
    assert "data.seed 1234, the branch asks 99" in refused(capsys, base + ["--", "--data.seed", "99"])
    assert "model.d_model is 32 in the checkpoint, 64 here" in refused(capsys, base + ["--", "--model.model.d_model",
                                                                                        "64"])
    assert "--run.branch is set by ablations.branch" in refused(capsys, base + ["--", "--run.branch", "false"])
    assert "--data.num_workers is set by" in refused(capsys, base + ["--", "--data.num_workers", "4"])
    # an override a branch cannot make: refused naming it before OUT is claimed (so the corrected command runs)
    assert "change data.schedule.seq_len.end: 32 -> 64: a branch changes only the mixture" in refused(
        capsys, base + ["--", "--data.schedule.seq_len.end", "64"])
    assert "model.lr.peak is 0.001 in the checkpoint, 0.002 here" in refused(
        capsys, base + ["--", "--model.lr.peak", "2e-3"])
    # the arms file itself
    for weights, says in [({**w, "web": "much"}, "arms[0] (a).weights.web: 'much' is not a share"),
                          ({**w, "web": None}, "arms[0] (a).weights.web: None is not a share"),
                          ("missing.yaml", "arms[0] (a).weights: cannot read"),
                          ({**w, "pdfs": 0.1, "web": 0.15}, "arm 'a': schedule.mixture.phases[1].weights: names "
                                                           "sources ['books', 'code', 'curated', 'pdfs', 'web']")]:
        line = refused(capsys, base + arms({"name": "a", "weights": weights}))
        assert says in line and "None:" not in line, line
    (tmp_path / "bad.yaml").write_text("arms: [name: a\n")
    assert "--arms: cannot read" in refused(capsys, base + ["--arms", str(tmp_path / "bad.yaml")])
    (tmp_path / "list.yaml").write_text("- name: a\n")
    assert "expected `arms: [{name: N" in refused(capsys, base + ["--arms", str(tmp_path / "list.yaml")])
    (tmp_path / "plain").write_text("")
    assert "--out" in refused(capsys, ["--from", str(stable), "--out", str(tmp_path / "plain")])
    assert not out.exists()  # nothing written

    damaged = tmp_path / "damaged"  # the newest checkpoint before the anneal start truncated: never skipped
    shutil.copytree(stable, damaged)
    ckpt = damaged / "checkpoints" / "step0000006.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    line = refused(capsys, ["--from", str(damaged), "--out", str(out)])
    assert f"checkpoint {ckpt}:" in line and "no older one is taken in its place" in line

    late = tmp_path / "late"  # a run whose checkpoints are all past the anneal start
    (late / "checkpoints").mkdir(parents=True)
    (late / "config.yaml").write_text((stable / "config.yaml").read_text())
    assert "no checkpoint at or before the anneal start (step 8)" in refused(capsys, ["--from", str(late)])
    torch.save({"global_step": 12}, late / "checkpoints" / "step0000012.ckpt")
    assert "checkpoints are at steps [12], all after the anneal start (step 8): it is already annealing" in refused(
        capsys, ["--from", str(late)])
    assert "train the stable phase into another --from directory" in refused(capsys, ["--from", str(late)])
    # --train-stable would resume the finished run and stop at once: refused, naming the way out
    assert "cannot train it back to S; give the stable phase another --from directory" in refused(
        capsys, ["--from", str(late), "--train-stable", "--", "--config", str(late / "config.yaml")])

    out.mkdir()
    (out / "branch.json").write_text(json.dumps({"arms": {}}))
    assert "already holds a branch ablation with another plan" in refused(capsys, base)
    (out / "branch.json").unlink()
    (out / "x").write_text("")
    assert "is not empty and holds no branch.json" in refused(capsys, base)


@pytest.mark.slow
def test_more_replicates_or_another_arm_extend_the_folder_and_another_plan_is_named(branched, tmp_path, capsys):
    out, _ = branched
    plan = branch.Plan(**json.loads((out / "branch.json").read_text()))
    copy = tmp_path / "abl"
    copy.mkdir()
    shutil.copy(out / "branch.json", copy / "branch.json")
    more = branch.Plan(**{**asdict(plan), "workers": [*plan.workers, plan.workers[-1]],
                          "arms": {**plan.arms, "web70": {"web": 0.7, "code": 0.1, "books": 0.1, "curated": 0.1}}})
    branch.claim(copy, more)
    assert json.loads((copy / "branch.json").read_text())["workers"] == [2, 2, 2]
    assert (copy / "arms" / "web70.yaml").is_file()
    assert "extending" in capsys.readouterr().out
    for changed, named in [({"checkpoint_sha256": "0" * 64}, "checkpoint_sha256"),
                           ({"arms": {**more.arms, "anneal": {**more.arms["curated50"]}}}, "arms"),
                           ({"workers": [5, 6]}, "workers"), ({"extra": ["--data.seed", "3"]}, "extra")]:
        with pytest.raises(ConfigError, match=f"another plan .*: {named}"):
            branch.claim(copy, branch.Plan(**{**asdict(more), **changed}))


@pytest.mark.slow
def test_each_replicate_is_dump_orders_simulation_of_its_replicate_seed(stable, branched, tmp_path):
    """Replicate r of an arm trains, line for line, what scripts/dump_order.py simulates from the stable run's
    order at S with the arm's mixture and --data.replicate r: the replicates' statistics are a documented
    function of (seed, replicate), not of the layout."""
    out, _ = branched

    def dump(*args) -> None:
        cmd = [sys.executable, "scripts/dump_order.py", "--config", str(stable / "config.yaml"), "--steps", "17",
               *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=env_for(stable.parent), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]

    head = tmp_path / "head.jsonl"
    dump("--save-cursor-at", str(S - 1), "--out", str(head))
    for rep in (0, 1):
        tail = tmp_path / f"tail{rep}.jsonl"
        dump("--data.schedule.mixture", str(out / "arms" / "curated50.yaml"), "--data.replicate", str(rep),
             "--resume-from", f"{head}.cursor.json", "--out", str(tail))
        simulated = {d["step"]: d for d in map(json.loads, tail.read_text().splitlines())}
        trained = lines(out / f"curated50-rep{rep}")
        assert sorted(simulated) == sorted(trained) == list(range(S, 17))
        for step, line in trained.items():
            assert {k: line[k] for k in simulated[step]} == simulated[step], (rep, step)


@pytest.mark.slow
def test_the_report_refuses_a_run_that_is_not_the_planned_one(branched, tmp_path, capsys):
    """One arm's run replaced by a copy of the control's would enter the verdict as a gain of 0."""
    out, _ = branched
    copy = tmp_path / "abl"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("*.ckpt"))
    shutil.rmtree(copy / "curated50-rep0")
    shutil.copytree(copy / "control-rep0", copy / "curated50-rep0")
    assert report.main([str(copy), "--suite", "heldout"]) == 2
    err = capsys.readouterr().err
    assert "run curated50-rep0 is not the one" in err and "weights from the anneal start" in err
    shutil.rmtree(copy / "curated50-rep0")
    shutil.copytree(out / "curated50-rep0", copy / "curated50-rep0", ignore=shutil.ignore_patterns("*.ckpt"))
    (copy / "curated50-rep1" / "branched_from.json").write_text(json.dumps({"sha256": "0" * 64}))
    assert report.main([str(copy), "--suite", "heldout"]) == 2
    assert "the runs started from different checkpoints" in capsys.readouterr().err


def test_train_stable_dry_run_names_the_stable_command(tmp_path, capsys, demo_corpus, monkeypatch):
    sources = {s: {"paths": [str(demo_corpus / s / "*.parquet")]} for s in SOURCES}
    argv = ["--from", str(tmp_path / "stable"), "--train-stable", "--dry-run", "--", *TINY,
            "--data.sources", json.dumps(sources)]
    # TINY has no held-out set: refused before the stable phase would train (not after, at the arms)
    assert branch.main(argv) == 2 and "data.val_tokens_per_source is 0" in capsys.readouterr().err
    argv += ["--data.val_tokens_per_source", "64"]
    assert branch.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("[stable to step 8] ") and "--trainer.max_steps 8 --ckpt_path last_or_new" in printed
    assert not (tmp_path / "stable").exists()
    # relative corpus globs from outside the repository root: the plan would read one corpus, the arms another
    monkeypatch.chdir(demo_corpus.parent)
    relative = {s: {"paths": [f"{demo_corpus.name}/{s}/*.parquet"]} for s in SOURCES}
    assert branch.main(argv + ["--data.sources", json.dumps(relative)]) == 2
    assert "is relative, and the runs of an ablation start in the repository root" in capsys.readouterr().err
    monkeypatch.chdir(ROOT)
    # the arms are read before the stable phase would train
    (tmp_path / "arms.yaml").write_text("arms: [{name: a, weights: {web: 1.5}}]\n")
    assert branch.main(argv[:4] + ["--arms", str(tmp_path / "arms.yaml")] + argv[4:]) == 2
    captured = capsys.readouterr()
    assert "arm 'a'" in captured.err and "[stable to step" not in captured.out


def test_an_array_task_starts_from_the_stable_checkpoint_then_resumes_its_own(tmp_path):
    """ablations/ablation.sbatch asks ``run.py --task-args`` at every (re)start: the stable checkpoint while
    the branch's run directory holds none, then nothing (the launcher resumes the run's own newest)."""
    job = Job("control", 0, str(tmp_path / "control-rep0"), ["--run.dir", str(tmp_path / "control-rep0")],
              start="runs/demo/checkpoints/step0000277.ckpt")
    assert task_args(job, resume=False)[-2:] == ["--ckpt_path", "runs/demo/checkpoints/step0000277.ckpt"]
    (tmp_path / "control-rep0" / "checkpoints").mkdir(parents=True)
    (tmp_path / "control-rep0" / "checkpoints" / "step0000280.ckpt").write_bytes(b"")
    assert "--ckpt_path" not in task_args(job, resume=False)
    assert task_args(job)[-2:] == ["--ckpt_path", "last_or_new"]
