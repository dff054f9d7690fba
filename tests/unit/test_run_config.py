"""One configuration path (train/config.py): what a flag says is what every tool builds.

In process (the parser is LightningCLI's; nothing trains): a model field override keeps the model the
config names, scripts/plan.py and scripts/dump_order.py resolve exactly what ``train fit --print_config``
prints, a typo is one line with a "did you mean", ``fit --help`` shows the schedule and hides what the
CLI sets itself, every run config has its own run directory, and a start refused for want of data has
written nothing into it.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml
from scripts_in_process import load_script
from training_runs import fit_in_process as fit

from data.config import parse_data_config

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs" / "demo.yaml")
REAL = str(ROOT / "configs" / "pretrain_350m_20b.yaml")
PRESET64 = str(ROOT / "configs" / "presets" / "64gpu.yaml")


script = load_script



def test_a_model_field_override_changes_that_field_of_the_model_the_config_names(capsys):
    """``model`` was typed ``str | ModelConfig``: ``--model.model.d_model 64`` replaced the demo model file
    by the ModelConfig defaults (20 blocks, the 350M shape) without a word."""
    from train.config import model_config, resolve_config
    from train.model import load_model_config

    demo = load_model_config(ROOT / "configs" / "model" / "demo.yaml")
    built = model_config(resolve_config(["--config", DEMO, "--model.model.d_model", "64"]))
    assert built == type(demo)(**{**vars(demo), "d_model": 64})
    assert built.n_layers == 4 and built.ffn_hidden == 352
    rc, out, _ = fit(["--config", DEMO, "--model.model.d_model", "64", "--print_config"], capsys)
    printed = yaml.safe_load(out)["model"]["model"]
    assert rc == 0 and printed["d_model"] == 64 and printed["n_layers"] == 4 and printed["ffn_hidden"] == 352


def test_plan_sees_what_fit_print_config_shows(capsys, monkeypatch, tmp_path):
    """Guards: a tool that keeps only the last --config (the 64-GPU preset's plan failed: 'data.sources
    required') or reads its own flags. plan's resolved data and model sections equal fit's."""
    import train.config as config

    args = ["--config", REAL, "--config", PRESET64, "--data.seed", "7", "--model.model.n_layers", "3"]
    rc, out, _ = fit([*args, "--print_config"], capsys)
    assert rc == 0
    printed = yaml.safe_load(out)
    seen = []
    real_resolve = config.resolve_config
    monkeypatch.setattr(config, "resolve_config", lambda argv: seen.append(real_resolve(argv)) or seen[-1])
    monkeypatch.delenv("DOLMA3_DIR", raising=False)
    assert script("plan").main([*args, "--out", str(tmp_path / "plan.png")]) == 0
    stdout = capsys.readouterr().out
    assert resolved_sections(seen[-1]) == sections(out)
    assert "data.batch_size 4 x 2048 tokens" in stdout  # the 64-GPU preset's micro-batch
    assert printed["data"]["batch_size"] == 4 and printed["model"]["model"]["n_layers"] == 3
    (tmp_path / "printed.yaml").write_text(out)  # as a run's saved config.yaml: ckpt_path, weights_only too
    assert script("plan").main(["--config", str(tmp_path / "printed.yaml"), "--out", str(tmp_path / "p.png")]) == 0
    assert resolved_sections(seen[-1]) == sections(out)


def sections(text: str) -> dict:
    """The DataConfig and ModelConfig that a printed config's data and model sections build."""
    from train.model import ModelConfig

    cfg = yaml.safe_load(text)
    return {"data": parse_data_config(cfg["data"]), "model": ModelConfig(**cfg["model"]["model"])}


def resolved_sections(resolved) -> dict:
    """The DataConfig and ModelConfig a tool builds of a resolved config."""
    from train.config import data_config, model_config

    return {"data": data_config(resolved), "model": model_config(resolved)}


def test_data_tools_resolve_the_data_section_as_fit_print_config_shows(capsys, monkeypatch, tmp_path, demo_corpus):
    """Guards: dump_order and inspect_corpus read the data section without torch (data/config.py
    resolve_data_config): stacked --config files, --data.* overrides and a mixture given as a file (relative
    to the config that names it) must mean what they mean to ``train fit``; its printed config, or a run's
    saved config.yaml, is accepted as a --config, and an unknown data key in it is still refused."""
    from data.config import resolve_data_config

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "mix.yaml").write_text("phases: [{name: one, weights: {web: 0.4, code: 0.3, books: 0.2, "
                                               "curated: 0.1}}]\n")
    (tmp_path / "sub" / "over.yaml").write_text("data:\n  seed: 9\n  schedule:\n    mixture: mix.yaml\n")
    args = ["--config", DEMO, "--config", str(tmp_path / "sub" / "over.yaml"), "--data.buffer_size", "32"]
    rc, out, _ = fit([*args, "--print_config"], capsys)
    printed = parse_data_config(yaml.safe_load(out)["data"])
    assert rc == 0 and printed.seed == 9 and printed.buffer_size == 32
    assert printed.schedule.mixture.phases[0].weights["curated"] == 0.1  # the mixture file beside over.yaml
    monkeypatch.chdir(tmp_path)  # another working directory: the mixture file is found beside over.yaml
    (tmp_path / "demo_corpus").symlink_to(demo_corpus)  # where the demo config's globs look (inspect_corpus reads them)
    seen = []

    def noted(argv: list[str], resolve=resolve_data_config):
        resolved = resolve(argv)
        seen.append(copy.deepcopy(getattr(resolved, "data", resolved)))  # as resolved (before --corpus)
        return resolved

    for name, resolver, extra in (
            ("dump_order", "resolve_sections", ["--corpus", str(demo_corpus), "--steps", "1", "--out", "o.jsonl"]),
            ("inspect_corpus", "resolve_data_config", [str(demo_corpus), "--sample-rows", "0"])):
        tool = script(name)
        monkeypatch.setattr(tool, resolver, functools.partial(noted, resolve=getattr(tool, resolver)))
        assert tool.main([*args, *extra]) == 0
        assert seen[-1] == printed, name
    (tmp_path / "printed.yaml").write_text(out)  # ckpt_path, trainer, model, run: accepted unread
    assert resolve_data_config(["--config", str(tmp_path / "printed.yaml")]) == printed
    (tmp_path / "typo.yaml").write_text(out.replace("\ndata:\n", "\ndata:\n  buffer_sise: 8\n"))
    capsys.readouterr()
    assert script("dump_order").main(["--config", str(tmp_path / "typo.yaml"), "--out", "t.jsonl"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "buffer_sise" in err, err


def test_every_tool_reads_the_environment_as_fit_does(capsys, monkeypatch):
    """Guards: ``PL_FIT__DATA__*`` (documented in ``fit --help``) applied by ``train fit`` and ignored by the
    tools' parsers, so dump_order printed one order and fit trained another. Every resolution reads the
    environment as fit does: over the defaults, under the config files (the demo's seed stays) and the flags;
    ``PL_DATA__*``, a name fit does not read, changes nothing."""
    from data.config import resolve_data_config
    from train.config import data_config, resolve_config

    monkeypatch.setenv("PL_FIT__DATA__SELECTOR", "random")
    monkeypatch.setenv("PL_FIT__DATA__MIN_CHUNKS_PER_SOURCE", "8")
    monkeypatch.setenv("PL_FIT__DATA__SEED", "7")
    monkeypatch.setenv("PL_DATA__BUFFER_SIZE", "3")
    rc, out, _ = fit(["--config", DEMO, "--print_config"], capsys)
    printed = parse_data_config(yaml.safe_load(out)["data"])
    assert rc == 0 and (printed.selector, printed.min_chunks_per_source, printed.seed) == ("random", 8, 1234)
    assert printed.buffer_size == 256
    assert resolve_data_config(["--config", DEMO]) == printed == data_config(resolve_config(["--config", DEMO]))
    flag = ["--config", DEMO, "--data.selector", "deficit"]
    assert resolve_data_config(flag).selector == data_config(resolve_config(flag)).selector == "deficit"


def test_data_tools_import_and_run_without_torch_or_lightning(tmp_path, demo_corpus):
    """Guards: a data tool that imports torch and Lightning to read a YAML (seconds and ~400 MB more per
    process). Each tool's module is imported, and dump_order and inspect_corpus run, in a fresh interpreter."""
    code = (
        "import importlib.util, sys\n"
        "mods = {}\n"
        "for name in ('dump_order', 'inspect_corpus', 'plan'):\n"
        "    spec = importlib.util.spec_from_file_location(name, f'{sys.argv[1]}/scripts/{name}.py')\n"
        "    mods[name] = importlib.util.module_from_spec(spec)\n"
        "    spec.loader.exec_module(mods[name])\n"
        "demo = ['--config', f'{sys.argv[1]}/configs/demo.yaml', '--corpus', sys.argv[2]]\n"
        "assert mods['dump_order'].main([*demo, '--steps', '2', '--out', 'o.jsonl']) == 0\n"
        "assert mods['inspect_corpus'].main([sys.argv[2], *demo[:2], '--sample-rows', '10']) == 0\n"
        "print('HEAVY', sorted(m for m in ('torch', 'lightning', 'pytorch_lightning') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WELLMIXED_CACHE": str(tmp_path / "cache")}
    (tmp_path / "demo_corpus").symlink_to(demo_corpus)  # where the demo config's globs look (inspect_corpus reads them)
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT), str(demo_corpus)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HEAVY []" in proc.stdout, proc.stdout[-2000:]
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 2


def test_a_flag_typo_is_one_line_with_did_you_mean(capsys):
    """~90 lines of usage came before the one error line; abbreviations (``--data.bat``) were accepted."""
    rc, _, err = fit(["--config", DEMO, "--data.sed", "7"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ") and "did you mean --data.seed" in err
    rc, _, err = fit(["--config", DEMO, "--model.lr.peek", "1e-3"], capsys)
    assert rc == 2 and "did you mean --model.lr.peak" in err and len(err.strip().splitlines()) == 1, err
    rc, _, err = fit(["--config", DEMO, "--data.bat", "4"], capsys)
    assert rc == 2 and "did you mean --data.batch_size" in err, err


def test_a_removed_data_key_is_one_line_naming_its_replacement(capsys, tmp_path):
    """``data.weights`` and ``data.seq_len`` (a fixed mixture before ``data.schedule`` was the one spelling)
    got jsonargparse's "Group 'data' does not accept option 'weights.web'": in a file, as a flag, and in a
    bare data config (scripts/inspect_corpus.py), one line names the key and the one that replaces it."""
    from data.config import load_data_config
    from data.errors import ConfigError

    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({"data": {"weights": {"web": 1.0}, "seq_len": 128}}))
    for argv, replacement in (([], "data.schedule.mixture.weights"),
                              (["--data.seq_len", "64"], "data.schedule.seq_len.start"),
                              (["--data.weights", '{"web": 1.0}'], "data.schedule.mixture.weights")):
        config = ["--config", DEMO] + (argv or ["--config", str(old)])
        rc, _, err = fit(config, capsys)
        key = "data.seq_len" if "--data.seq_len" in argv else "data.weights"
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"error: {key}: no longer a key") and replacement in err, err
    try:
        load_data_config(old)
    except ConfigError as e:
        assert str(e) == f"{old}: data.weights: no longer a key; give the fixed mixture as " \
                         "data.schedule.mixture.weights"
    else:
        raise AssertionError("load_data_config accepted data.weights")


def test_fit_help_shows_the_schedule_and_not_what_the_cli_sets(capsys):
    """The help omitted ``--data.schedule.lr.peak`` (the README's example), advertised ``--trainer.logger``
    (refused at run time), had three log_every_n_steps and was 817 lines. Every schedule key has its own
    entry (data.schedule is a required group)."""
    rc, out, _ = fit(["--help"], capsys)
    assert rc == 0
    options = set(re.findall(r"^\s+(?:ARG:\s+)?(--[\w.]+)", out, re.M))
    assert "--model.lr.peak" in out and "--model.lr.shape" in out and "--data.schedule.seq_len.end" in out
    for shown in ("--data.seed", "--model.model.d_model", "--run.dir", "--trainer.devices", "--model.on_nonfinite"):
        assert shown in options, shown
    for hidden in ("--trainer.logger", "--trainer.log_every_n_steps", "--model.log_every_n_steps",
                   "--trainer.val_check_interval", "--trainer.use_distributed_sampler"):
        assert hidden not in options, hidden
    assert len(out.splitlines()) < 530  # 475 before data.tokenizer (10 lines), model.optim and model.lr (27), ...


def test_a_trainer_option_the_cli_sets_is_refused_naming_the_key_to_use(capsys, tmp_path):
    rc, _, err = fit(["--config", DEMO, "--trainer.log_every_n_steps", "5", "--run.dir", str(tmp_path / "r")], capsys)
    assert rc == 2 and "--run.log_every_n_steps" in err, err
    assert not (tmp_path / "r").exists()


def test_every_run_config_names_its_own_run_dir():
    """The 350M config inherited run.dir runs/demo: the real run's checkpoints would land in the demo's."""
    from train.config import resolve_config

    runs = sorted(p for p in (ROOT / "configs").glob("*.yaml"))
    dirs = {p.name: resolve_config(["--config", str(p)]).run.dir for p in runs}
    assert len(set(dirs.values())) == len(dirs), dirs
    for name, d in dirs.items():
        assert "run.dir" in (ROOT / "configs" / name).read_text() or "dir:" in (ROOT / "configs" / name).read_text()
        assert Path(d).name == Path(name).stem or name == "demo.yaml", (name, d)


def test_a_start_refused_for_want_of_data_writes_nothing_into_the_run_dir(capsys, tmp_path):
    """A start that failed for want of data left .run.lock and wandb/run_id in run.dir."""
    config = tmp_path / "nodata.yaml"
    config.write_text(Path(DEMO).read_text().replace("demo_corpus/", str(tmp_path / "absent") + "/"))
    run_dir = tmp_path / "run"
    rc, _, err = fit(["--config", str(config), "--run.dir", str(run_dir), "--run.wandb", "true",
                      "--model.model", str(ROOT / "configs" / "model" / "tiny.yaml")], capsys)
    assert rc == 2 and "absent" in err, err
    assert not run_dir.exists() or not any(run_dir.rglob("*")), sorted(run_dir.rglob("*"))
