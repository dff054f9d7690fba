"""Every command in the README and docs/ parses as written: the script exists, its flags are known,
its required arguments are given, and every ``--config`` file exists.

Commands are taken from the ```bash blocks of README.md, docs/*.md and ablations/README.md (backslash
continuations joined, comments stripped). Every ``python scripts/X.py ...`` or ``python ablations/X.py``
command runs, in one subprocess for all of them, with argparse stopping right after parsing (nothing is
computed); ``python -m train fit ...`` runs with ``--print_config`` (LightningCLI parses and validates
everything, then exits); ``bash``/``sbatch`` commands name a file that must exist.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "ablations" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

PARSE_ALL = """
import argparse, contextlib, io, json, os, runpy, sys
real = argparse.ArgumentParser.parse_args
def parse_then_stop(self, *a, **k):
    real(self, *a, **k)
    sys.exit(0)
argparse.ArgumentParser.parse_args = parse_then_stop
results = {}
for line, args in json.load(sys.stdin):
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            if args[1:3] == ["-m", "train"]:
                from train.__main__ import main
                sys.argv = ["wellmixed", *args[3:], "--print_config"]
                rc = main(args[3:] + ["--print_config"])
            else:
                sys.argv = args[1:]
                runpy.run_path(args[1], run_name="__main__")
                rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:  # a crash while parsing: the command is wrong as written
        rc, err = 1, io.StringIO(f"{type(e).__name__}: {e}")
    results[line] = [rc, err.getvalue()[-2000:]]
print(json.dumps(results))
"""
"""Parses every command in one process (torch and Lightning imported once, not once per command):
argparse stops right after parsing; ``python -m train fit`` runs with ``--print_config``."""


def commands() -> list[tuple[str, str]]:
    """(id, command) of every command of the docs, each distinct command once (where it first appears)."""
    out, seen = [], set()
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S):
            text = re.sub(r"\\\n\s*", " ", block)
            for line in text.splitlines():
                line = line.split(" #")[0].strip()
                if re.match(r"^(python|bash|sbatch) ", line) and "<" not in line and line not in seen:
                    seen.add(line)
                    out.append((f"{doc.relative_to(ROOT)}: {line[:70]}", line))
    return out


COMMANDS = commands()


def test_the_docs_hold_commands():
    assert len(COMMANDS) >= 20 and any("python -m train fit" in c for _, c in COMMANDS)


@pytest.fixture(scope="module")
def parsed(tmp_path_factory) -> dict[str, list]:
    """Each python command of the docs parsed as written: ``{line: [exit code, stderr tail]}``."""
    dolma3 = tmp_path_factory.mktemp("dolma3")
    env = {**os.environ, "DOLMA3_DIR": str(dolma3), "PYTHONPATH": str(ROOT)}
    todo = [(line, shlex.split(os.path.expandvars(line.replace("$DOLMA3_DIR", str(dolma3))))) for _, line in COMMANDS]
    todo = [(line, args) for line, args in todo if args[0] == "python"]
    r = subprocess.run([sys.executable, "-c", PARSE_ALL], input=json.dumps(todo), cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("line", [c for _, c in COMMANDS], ids=[i for i, _ in COMMANDS])
def test_command_parses_as_written(line, parsed):
    args = shlex.split(line)
    if args[0] in ("bash", "sbatch"):
        assert (ROOT / args[1]).is_file(), f"{args[1]} does not exist"
        return
    for i, a in enumerate(args[:-1]):
        if a == "--config":
            assert (ROOT / args[i + 1]).is_file(), f"--config {args[i + 1]} does not exist"
    if args[1:3] != ["-m", "train"]:
        assert (ROOT / args[1]).is_file(), f"{args[1]} does not exist"
    rc, err = parsed[line]
    assert rc == 0, f"{line}\n{err}"


# -- after the demo: the README's next commands, as the demo prints them, run in order --------------------------
AFTER_THE_DEMO = "### After the demo"
# The demo run at test size: appended to every `train fit` line (the config, the run directory and the
# order log stay the README's). 5 steps of 4 x 16..32 tokens, held-out data; held-out loss and a
# checkpoint only at the start and the end (each costs time, and the commands read only the last).
TEST_SIZE = [
    "--model.model", str(ROOT / "configs" / "model" / "tiny.yaml"), "--trainer.precision", "32-true",
    "--run.wandb", "false", "--data.schedule.train_tokens", "400", "--data.schedule.anneal_start", "0.5",
    "--data.schedule.seq_len.start", "16", "--data.schedule.seq_len.end", "32",
    "--data.schedule.seq_len.multiple", "16", "--data.schedule.seq_len.warmup_steps", "2",
    "--model.lr.warmup_steps", "1", "--data.val_tokens_per_source", "256", "--data.buffer_size", "16",
    "--run.val_every_n_steps", "1000", "--run.ckpt_every_n_steps", "1000", "--data.num_workers", "0",
]


def demo_next_lines() -> list[str]:
    """The command lines scripts/demo.sh prints last (its ``NEXT`` block, after the heading line)."""
    block = re.search(r"cat <<'NEXT'\n(.*?)\nNEXT\n", (ROOT / "scripts" / "demo.sh").read_text(), re.S)
    assert block, "scripts/demo.sh has no NEXT block"
    return [ln.strip() for ln in block.group(1).splitlines()[1:]]


def readme_next_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    assert AFTER_THE_DEMO in text
    block = re.search(r"```bash\n(.*?)```", text[text.index(AFTER_THE_DEMO):], re.S).group(1)
    return [ln.strip() for ln in block.splitlines() if ln.startswith("python ")]


def test_the_demo_ends_with_its_run_directory_and_the_readme_next_commands():
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert "\nRUN=runs/demo\n" in demo and 'mv "$RUN" "$OLD"' in demo and "rm " not in demo  # moved aside, kept
    assert 'echo "== done: the demo run is in $RUN"' in demo
    assert demo_next_lines() == readme_next_lines() and len(readme_next_lines()) == 3
    assert all("runs/demo" in ln or "configs/demo.yaml" in ln for ln in readme_next_lines())


def _script_main(path: str):
    from scripts_in_process import load_script

    assert path.startswith("scripts/"), path
    return load_script(Path(path).stem).main


@pytest.mark.slow
def test_after_the_demo_the_readme_commands_work_in_order(demo_corpus, cache_dir, tmp_path, monkeypatch, capsys):
    """The demo's training (at test size) into runs/demo, then each README line after the demo, in order,
    in-process as printed: evaluate (lm-eval's own process stubbed: its tasks are tests/unit/test_local_tasks.py's
    subject; the HF cache empty, so the standard tasks are planned out up front), diagnose, resume."""
    from huggingface_hub import constants

    import train.cli
    import train.tools.evaluate

    monkeypatch.chdir(tmp_path)  # a checkout's root as the README's commands see it, with a runs/ of its own
    (tmp_path / "demo_corpus").symlink_to(demo_corpus, target_is_directory=True)
    (tmp_path / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    monkeypatch.setenv("WELLMIXED_CACHE", str(cache_dir))
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    lm_eval_calls = []

    def fake_lm_eval(hf_dir, tasks, out_dir, offline=True, extra="", include_path=None):
        assert (Path(hf_dir) / "config.json").is_file() and offline
        lm_eval_calls.append(tasks)
        return {f"{t}/acc": 0.25 for t in tasks.split(",")}

    monkeypatch.setattr(train.tools.evaluate, "run_lm_eval", fake_lm_eval)
    demo_train = shlex.split((ROOT / "scripts" / "demo.sh").read_text().split("$PY -m train ")[1].splitlines()[0])
    assert train.cli.main(demo_train + TEST_SIZE) == 0  # the demo's step 4, its own flags
    run = tmp_path / "runs" / "demo"
    order = (run / "order_log" / "rank0.jsonl").read_text()
    capsys.readouterr()

    for line in readme_next_lines():
        args = shlex.split(line.split(" #")[0])
        if args[1:3] == ["-m", "train"]:
            assert train.cli.main(args[3:] + TEST_SIZE) == 0, line
            assert "ckpt_path: last" in (run / "config-002.yaml").read_text()  # the second launch, a resume
        else:
            rc = _script_main(args[1])(args[2:])
            out = capsys.readouterr().out
            if args[1] == "scripts/evaluate.py":
                assert rc == 0, out
                assert out.index("plan: held-out loss per source, then lm-eval: local") < out.index("| web |")
                assert "skip  hellaswag: offline" in out and "lm-eval hellaswag skipped" in out
                assert [t.split(",")[0] for t in lm_eval_calls] == ["wellmixed_cloze_web"] or all(
                    t.startswith("wellmixed_") for c in lm_eval_calls for t in c.split(","))
                assert len(lm_eval_calls) == 1 and (run / "evals" / "results.json").is_file()
            else:
                assert rc in (0, 1) and (run / "diagnostics.md").is_file(), out  # 1: a diagnostic failed, reported
    # resumed from the last checkpoint, not trained again from step 0: the order log has no new line
    assert (run / "order_log" / "rank0.jsonl").read_text() == order
