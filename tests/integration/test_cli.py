"""The command line as a user meets it: what --help offers, what is refused, how the config is kept.

Nothing here trains: each case is a subprocess that stops at parsing or at the CLI's checks before
instantiation (a few seconds each, mostly the import of torch and Lightning).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs" / "demo.yaml")


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "train", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def fit_help() -> str:
    proc = cli("fit", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def option_help(text: str) -> dict[str, str]:
    """option -> its description in the help output (without the '(type: ..., default: ...)' suffix)."""
    out: dict[str, str] = {}
    current = None
    for line in text[text.index("options:"):].splitlines():
        m = re.match(r"  (?:ARG:\s+)?(--[\w.]+)", line)
        if m:
            current = m.group(1)
            parts = re.split(r"\s{2,}", line[m.end():].strip(), maxsplit=1)  # metavar, then the description
            out[current] = parts[1] if len(parts) > 1 else ""
        elif current and line.startswith(" " * 10) and not line.strip().startswith("ENV:"):
            out[current] += " " + line.strip()
        elif not line.strip().startswith("ENV:"):
            current = None
    return {k: re.sub(r"\((required, )?type:.*", "", v, flags=re.S).strip() for k, v in out.items()}


def test_help_offers_no_optimizer_or_scheduler_override(fit_help):
    """LightningCLI's --optimizer/--lr_scheduler silently replaced AdamW and the WSD schedule."""
    assert "--optimizer" not in fit_help and "--lr_scheduler" not in fit_help


def test_optimizer_flag_is_an_error():
    proc = cli("fit", "--config", DEMO, "--optimizer", "torch.optim.SGD", "--optimizer.lr", "0.5")
    assert proc.returncode == 2 and proc.stderr == "error: --optimizer: unknown flag\n", proc.stderr


def test_help_describes_every_data_run_and_model_option(fit_help):
    options = option_help(fit_help)
    ours = [o for o in options if o.split(".")[0] in ("--data", "--run", "--model") and "." in o
            and not o.endswith(".help")]
    assert len(ours) > 30, ours
    missing = [o for o in ours if not options[o]]
    assert not missing, f"options without a description: {missing}"


def test_the_resume_policy_is_set_under_run_only(tmp_path):
    """run.elastic etc. are the DataModule's resume policy, not data: keys; the data.* spelling is refused
    naming the run.* key, on the command line and in a config file."""
    proc = cli("fit", "--config", DEMO, "--data.elastic", "false", "--run.dir", str(tmp_path / "a"))
    assert proc.returncode == 2 and "data.elastic is a resume setting: write it as run.elastic" in proc.stderr, \
        proc.stderr[-2000:]
    (tmp_path / "c.yaml").write_text("data:\n  allow_changed_data: true\n")
    proc = cli("fit", "--config", DEMO, "--config", str(tmp_path / "c.yaml"), "--run.dir", str(tmp_path / "b"))
    assert proc.returncode == 2 and "data.allow_changed_data is a resume setting" in proc.stderr, \
        proc.stderr[-2000:]


def test_usage_names_the_program_and_offers_only_working_subcommands():
    proc = cli("--help")
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: python -m train") and "__main__.py" not in proc.stdout
    assert "{fit,validate}" in proc.stdout
    bad = cli("test", "--config", DEMO)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_environment_variables_override_like_lightningcli(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PL_FIT__RUN__KEEP_LAST_K": "7"}
    proc = subprocess.run([sys.executable, "-m", "train", "fit", "--config", DEMO, "--print_config"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "keep_last_k: 7" in proc.stdout, proc.stderr[-2000:]


def test_version():
    proc = cli("--version")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert proc.returncode == 0 and proc.stdout.strip() == f"wellmixed {version}"


def test_trainer_logger_is_refused_not_ignored(tmp_path):
    proc = cli("fit", "--config", DEMO, "--trainer.logger", "false", "--run.dir", str(tmp_path / "run"))
    assert proc.returncode == 2 and "--run.loggers" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None
                    or importlib.util.find_spec("tensorboardX") is not None, reason="tensorboard is installed")
def test_a_logger_that_is_not_installed_is_named(tmp_path):
    proc = cli("fit", "--config", DEMO, "--run.loggers", "[csv, tensorboard]", "--run.dir", str(tmp_path / "run"))
    assert proc.returncode == 2 and "pip install tensorboard" in proc.stderr, proc.stderr[-2000:]


def test_unknown_logger_is_refused(tmp_path):
    proc = cli("fit", "--config", DEMO, "--run.loggers", "[csv, neptune]", "--run.dir", str(tmp_path / "run"))
    assert proc.returncode == 2 and "neptune" in proc.stderr, proc.stderr[-2000:]


def test_logger_choice_resolves_and_csv_is_always_first():
    from train.loggers import resolve

    assert resolve(["wandb"], None) == ["csv", "wandb"]
    assert resolve(["csv", "wandb"], False) == ["csv"]
    assert resolve(["csv"], True) == ["csv", "wandb"]


def test_every_launch_of_a_run_dir_logs_to_one_wandb_run(tmp_path):
    """The wandb id is made once per run directory: a resume (a second build) continues the same wandb run,
    and a run dir from before run_id existed keeps the id of its newest wandb run."""
    from train.loggers import build, wandb_run_id

    first = build(["csv", "wandb"], tmp_path / "run", wandb_project="p", wandb_name=None, wandb_group=None)[1]
    again = build(["wandb"], tmp_path / "run", wandb_project="p", wandb_name=None, wandb_group=None)[0]
    assert first._wandb_init["id"] == again._wandb_init["id"] == wandb_run_id(tmp_path / "run")
    assert first._wandb_init["resume"] == "allow" and len(first._wandb_init["id"]) == 8
    (tmp_path / "old" / "wandb" / "offline-run-20260101_000000-abc12345").mkdir(parents=True)
    assert wandb_run_id(tmp_path / "old") == "abc12345"
    assert (tmp_path / "old" / "wandb" / "run_id").read_text().strip() == "abc12345"


def test_each_launch_keeps_its_config(tmp_path):
    from train.loggers import save_launch_config

    first = save_launch_config(tmp_path, "a: 1\n")
    second = save_launch_config(tmp_path, "a: 2\n")
    assert (first.name, second.name) == ("config-001.yaml", "config-002.yaml")
    assert first.read_text() == "a: 1\n" and (tmp_path / "config.yaml").read_text() == "a: 2\n"


def test_entry_point_runs_from_another_directory(tmp_path):
    """[project.scripts] wellmixed: the function it names works with the working directory elsewhere."""
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["wellmixed"]
    module, func = target.split(":")
    code = f"import sys; sys.argv[0] = 'wellmixed'; from {module} import {func}; sys.exit({func}(['--help']))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: wellmixed")
