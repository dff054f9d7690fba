"""One wording per configuration mistake, wherever it is made or found.

``train fit``, every tool and ``ScheduleConfig.from_dict`` word jsonargparse's refusals with one function
(data/errors.py ``parser_error_line``); an unknown key in a stacked config file is named with its file and
a "did you mean"; a misspelt key holding an empty mapping (which jsonargparse reads as nothing) is refused
by every tool; a resume under other data settings names the key and its two values.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml
from scripts_in_process import load_script
from training_runs import fit_in_process as fit

from data.errors import ConfigError
from data.schedules import ScheduleConfig
from train.datamodule import WellMixedData

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs" / "demo.yaml")


def error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def tool_error(name: str, argv: list[str], capsys) -> str:
    """A tool's refusal, in process: exit 2 and its one error line."""
    saved, sys.argv = sys.argv, sys.argv[:1]
    try:
        rc = load_script(name).main(argv)
    finally:
        sys.argv = saved
    err = capsys.readouterr().err
    assert rc == 2, err
    return error_line(err)


def fit_error(argv: list[str], capsys) -> str:
    rc, _, err = fit(argv, capsys)
    assert rc == 2, err
    return error_line(err)


def test_a_wrong_value_gets_the_same_line_from_fit_a_tool_and_from_dict(tmp_path, capsys):
    """``seq_len.end: abc`` was ``--data.schedule.seq_len.end: Expected ...`` from fit and ``schedule.seq_len.end:
    expected a number, got 'abc'`` from ScheduleConfig.from_dict (two translators of one message)."""
    schedule = yaml.safe_load(Path(DEMO).read_text())["data"]["schedule"]
    schedule["seq_len"]["end"] = "abc"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"data": {"schedule": {"seq_len": {"end": "abc"}}}}))
    with pytest.raises(ConfigError) as info:
        ScheduleConfig.from_dict(schedule, key="data.schedule")
    line = f"error: {info.value}"
    assert line == "error: data.schedule.seq_len.end: Expected a <class 'int'>. Got value: abc"
    assert fit_error(["--config", DEMO, "--config", str(bad)], capsys) == line
    assert tool_error("plan", ["--config", DEMO, "--config", str(bad)], capsys) == line
    assert fit_error(["--config", DEMO, "--data.schedule.seq_len.end", "abc"], capsys) == line


def test_the_lr_under_data_schedule_is_named_as_moved_to_model_lr(tmp_path, capsys):
    """The LR schedule moved from ``data.schedule.lr`` to ``model.lr`` (train/module.py): an old config file
    or flag gets the one line naming the new key, from fit and from the data tools (data/config.py
    REMOVED_KEYS)."""
    old = tmp_path / "old.yaml"
    old.write_text("data:\n  schedule:\n    lr: {peak: 1.0e-3, warmup_steps: 20}\n")
    line = ("error: data.schedule.lr: no longer a key; the LR schedule is the module's: give it as model.lr "
            "(--model.lr.peak ...; the same fields, plus shape and decay_start)")
    assert fit_error(["--config", DEMO, "--config", str(old)], capsys) == line
    assert fit_error(["--config", DEMO, "--data.schedule.lr.peak", "1e-3"], capsys) == line
    assert tool_error("dump_order", ["--config", DEMO, "--config", str(old), "--steps", "1", "--out",
                                     str(tmp_path / "o.jsonl")], capsys) == line


def test_an_unknown_key_in_a_stacked_config_names_its_file_and_the_key_meant(tmp_path, capsys):
    """It was ``Group 'data' does not accept option 'schedule.seq_len.ned'``: no file, no suggestion."""
    (tmp_path / "ok.yaml").write_text("data:\n  seed: 3\n")
    typo = tmp_path / "typo.yaml"
    typo.write_text("data:\n  schedule:\n    seq_len: {ned: 256}\n")
    argv = ["--config", DEMO, "--config", str(tmp_path / "ok.yaml"), "--config", str(typo)]
    line = f"error: {typo}: data.schedule.seq_len.ned: unknown key (did you mean data.schedule.seq_len.end?)"
    assert fit_error(argv, capsys) == line
    assert tool_error("dump_order", [*argv, "--steps", "1", "--out", str(tmp_path / "o.jsonl")], capsys) == line
    with pytest.raises(ConfigError, match=r"^data\.schedule\.seq_len\.ned: unknown key \(did you mean data\.schedule\."
                                          r"seq_len\.end\?\)$"):
        ScheduleConfig.from_dict({"seq_len": {"ned": 256}, "mixture": {"weights": {"web": 1.0}}}, key="data.schedule")


def test_a_misspelt_key_holding_an_empty_mapping_is_refused_by_every_tool(tmp_path, capsys):
    """``wieghts: {}`` was read as nothing at all: fit, plan, dump_order, inspect_corpus and the ablation
    runner accepted it (docs/config.md: unknown keys are refused)."""
    typo = tmp_path / "typo.yaml"
    typo.write_text("data:\n  schedule:\n    mixture:\n      wieghts: {}\n")
    argv = ["--config", DEMO, "--config", str(typo)]
    line = f"error: {typo}: data.schedule.mixture.wieghts: unknown key (did you mean data.schedule.mixture.weights?)"
    assert fit_error(argv, capsys) == line
    assert tool_error("plan", argv, capsys) == line
    assert tool_error("dump_order", [*argv, "--steps", "1", "--out", str(tmp_path / "o.jsonl")], capsys) == line
    assert tool_error("inspect_corpus", [str(ROOT / "demo_corpus"), *argv], capsys) == line
    from ablations import run

    assert run.main(["--pair", "demo", "--out", str(tmp_path / "abl"), "--dry-run", "--", "--config",
                     str(typo)]) == 2
    assert error_line(capsys.readouterr().err) == line
    with pytest.raises(ConfigError, match=r"^schedule\.mixture\.wieghts: unknown key"):
        ScheduleConfig.from_dict({"mixture": {"weights": {"web": 1.0}, "wieghts": {}}})


def test_a_number_where_a_group_goes_is_one_line_naming_the_file_from_fit_and_from_dict(tmp_path, capsys):
    """``seq_len: 0.1`` in a config file ended ``train fit`` in a TypeError traceback naming no key."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  schedule:\n    seq_len: 0.1\n")
    line = "data.schedule.seq_len: expected a mapping or a YAML file, got 0.1"
    assert fit_error(["--config", DEMO, "--config", str(bad)], capsys) == f"error: {bad}: {line}"
    with pytest.raises(ConfigError, match=f"^{re.escape(line)}$"):
        ScheduleConfig.from_dict({"seq_len": 0.1, "mixture": {"weights": {"web": 1.0}}}, key="data.schedule")


def test_a_key_given_twice_in_one_yaml_file_is_one_line_naming_the_file_the_key_and_both_lines(tmp_path, capsys):
    """``web:`` twice under ``sources``: the later silently won in every tool (the run trained 1 web file instead
    of 7). A stacked config (in fit, plan, dump_order, inspect_corpus, the ablation runner), a mixture file a
    config names and a model file each refuse it."""
    tmp_path = tmp_path.resolve()
    twice = tmp_path / "twice.yaml"
    twice.write_text("data:\n  sources:\n    web: {paths: [a]}\n    code: {paths: [b]}\n    web: {paths: [c]}\n")
    argv = ["--config", DEMO, "--config", str(twice)]
    line = (f"error: {twice}: data.sources.web is given twice (lines 3 and 5); keep one (YAML would silently "
            "use the later)")
    assert fit_error(argv, capsys) == line
    assert tool_error("plan", argv, capsys) == line
    assert tool_error("dump_order", [*argv, "--steps", "1", "--out", str(tmp_path / "o.jsonl")], capsys) == line
    assert tool_error("inspect_corpus", [str(ROOT / "demo_corpus"), *argv], capsys) == line
    from ablations import run

    assert run.main(["--pair", "demo", "--out", str(tmp_path / "abl"), "--dry-run", "--", "--config", str(twice)]) == 2
    assert error_line(capsys.readouterr().err) == line
    (tmp_path / "mix.yaml").write_text("weights: {web: 0.5, code: 0.5, books: 0,\n  curated: 0, web: 0.1}\n")
    (tmp_path / "over.yaml").write_text("data:\n  schedule:\n    mixture: mix.yaml\n")
    argv = ["--config", DEMO, "--config", str(tmp_path / "over.yaml")]
    line = f"error: {tmp_path / 'mix.yaml'}: weights.web is given twice (lines 1 and 2)"
    assert fit_error(argv, capsys).startswith(line)
    dump = [*argv, "--steps", "1", "--out", str(tmp_path / "o.jsonl")]
    assert tool_error("dump_order", dump, capsys).startswith(line)
    model = tmp_path / "model.yaml"
    model.write_text((ROOT / "configs" / "model" / "demo.yaml").read_text() + "n_layers: 7\n")
    assert fit_error(["--config", DEMO, "--model.model", str(model)], capsys).startswith(
        f"error: {model}: n_layers is given twice (lines ")


@pytest.mark.parametrize(("key", "value"), [("val_tokens_per_source", 512), ("min_chunks_per_source", 3)])
def test_a_resume_under_another_data_setting_names_the_key_and_its_two_values(make_cfg, key, value):
    """It said "the corpus changed (fingerprint ...)" and offered --run.allow_changed_data (which restarts
    the data order) for a setting that is simply restored."""
    def datamodule(**overrides) -> WellMixedData:
        return WellMixedData(make_cfg(**overrides))

    saved = datamodule()
    saved.prepare()
    state = saved.state_dict()
    resumed = datamodule(**{key: value})
    with pytest.raises(ConfigError) as info:
        resumed.load_state_dict(state)
    message = str(info.value)
    assert f"data.{key}: {getattr(saved.config, key)!r} -> {value!r}" in message, message
    assert "allow_changed_data" not in message and "fingerprint" not in message


def test_the_config_parser_reaches_into_no_private_parser_member_outside_lightning_internals():
    """``_load_config`` patched in ConfigCLI, ``parser._actions``, ``self._logger``, ``WellMixedParser._argv``
    and a ``sys.argv`` swap lived in train/config.py; what must remain is in train/lightning_internals.py,
    with the version it was written for."""
    text = (ROOT / "train" / "config.py").read_text() + (ROOT / "data" / "config.py").read_text()
    for private in ("._actions", "._load_config", "._logger", "._argv", "sys.argv ="):
        assert private not in text, private
    assert not re.search(r"^\s+global ", text, re.M)  # no module state set while parsing
