"""The resume rule (train/resume.py, docs/config.md): one rule for every way of resuming.

A checkpoint named by file silently replaced every ``--model.*`` flag by the checkpoint's (another model
was asked for, the old one trained) and dropped ``--model.on_nonfinite skip``; with ``--ckpt_path last``
a changed shape gave a state_dict size-mismatch traceback. Now the settings that must match are compared
and a difference refused by name (exit 2, before the first step); those that may change are applied.
The checkpoints here are small hand-made Lightning checkpoints (state_dict, global_step, the module's
hyper-parameters): the comparison needs nothing more, and nothing trains.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from training_runs import fit_in_process as fit

from train.checkpoint_io import AtomicCheckpointIO

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs" / "demo.yaml")
TINY = str(ROOT / "configs" / "model" / "tiny.yaml")


def hparams(**changes) -> dict:
    """The hyper-parameters PretrainModule saves for the tiny model, with ``changes`` (``d_model=64``
    changes the model; ``on_nonfinite=...`` a top-level setting)."""
    from train.model import load_model_config

    model = {**vars(load_model_config(TINY))}
    top = {"compile": False, "on_nonfinite": "stop", "log_every_n_steps": 1}
    for key, value in changes.items():
        (model if key in model else top)[key] = value
    return {"model": model, "optim": {"betas": [0.9, 0.95], "weight_decay": 0.1, "eps": 1e-8, "fused": None},
            **top, "_class_path": "train.module.PretrainModule"}


def fake_checkpoint(path: Path, hp: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    AtomicCheckpointIO().save_checkpoint({"state_dict": {}, "global_step": 2, "hyper_parameters": hp}, path)
    return path




def test_the_rule_refuses_a_changed_model_and_applies_what_may_change():
    from data.errors import ConfigError
    from train.resume import check_resume

    saved = hparams()
    assert check_resume("x.ckpt", saved, hparams()) == []
    applied = check_resume("x.ckpt", saved, hparams(on_nonfinite="skip", activation_checkpointing=True))
    assert applied == ["model.model.activation_checkpointing: checkpoint False -> True",
                       "model.on_nonfinite: checkpoint 'stop' -> 'skip'"]
    with pytest.raises(ConfigError) as e:
        check_resume("x.ckpt", saved, hparams(d_model=64, on_nonfinite="skip"))
    msg = str(e.value)
    assert "model.model.d_model is 32 in the checkpoint, 64 here" in msg and "--model.model.d_model 32" in msg
    assert "on_nonfinite" not in msg and "\n" not in msg
    optim = hparams()
    optim["optim"]["weight_decay"] = 0.0  # the optimizer state would restore 0.1 without a word
    with pytest.raises(ConfigError, match=r"model\.optim\.weight_decay is 0\.1 in the checkpoint, 0\.0 here"):
        check_resume("x.ckpt", saved, optim)


def test_another_optimizer_is_refused_by_name_and_fused_may_change(tmp_path, capsys):
    """The optimizer config (train/optim.py) says what may change: an AdamW checkpoint (written before
    ``optim.name`` existed: its missing fields are the defaults) resumed with ``name: muon`` from a YAML
    file is refused naming model.optim.name, before anything is written; ``fused`` is applied."""
    from train.resume import check_resume

    assert check_resume("x.ckpt", hparams(), {**hparams(), "optim": {"fused": True}}) == [
        "model.optim.fused: checkpoint None -> True"]
    run = tmp_path / "run"
    fake_checkpoint(run / "checkpoints" / "last.ckpt", hparams())
    muon = tmp_path / "muon.yaml"
    muon.write_text("model:\n  optim: {name: muon}\n")
    rc, _, err = fit(["--config", DEMO, "--model.model", TINY, "--config", str(muon), "--run.dir", str(run),
                      "--run.wandb", "false", "--ckpt_path", "last"], capsys)
    assert rc == 2, err
    line = err.strip().splitlines()[-1]
    assert "model.optim.name is 'adamw' in the checkpoint, 'muon' here" in line and "--model.optim.name adamw" in line
    assert not (run / ".run.lock").exists() and not (run / "csv").exists()


def test_a_changed_lr_is_refused_by_name_unless_the_schedule_may_change():
    """``model.lr`` (the module's LR schedule) is compared like the rest of the module's settings; like the data
    schedule it was part of, it may change with ``run.allow_changed_schedule`` (applied and logged)."""
    from data.errors import ConfigError
    from train.resume import check_resume

    lr = {"shape": "wsd", "peak": 1e-3, "min": 0.0, "warmup_steps": 20, "decay_start": None}
    saved, cosine = {**hparams(), "lr": lr}, {**hparams(), "lr": {**lr, "shape": "cosine"}}
    with pytest.raises(ConfigError, match=r"model\.lr\.shape is 'wsd' in the checkpoint, 'cosine' here"):
        check_resume("x.ckpt", saved, cosine)
    assert check_resume("x.ckpt", saved, cosine, lr_may_change=True) == ["model.lr.shape: checkpoint 'wsd' -> 'cosine'"]
    assert check_resume("x.ckpt", hparams(), cosine) == []  # a checkpoint from before model.lr: not compared


@pytest.mark.parametrize("how", ["file", "last"])
def test_a_resume_with_another_model_is_refused_by_name_before_compute(how, tmp_path, capsys):
    """Named file: the flag was replaced by the checkpoint's; ``last``: a size-mismatch traceback."""
    run = tmp_path / "run"
    ckpt = fake_checkpoint(run / "checkpoints" / ("step0000002.ckpt" if how == "file" else "last.ckpt"), hparams())
    rc, _, err = fit(["--config", DEMO, "--model.model", TINY, "--model.model.d_model", "64", "--run.dir", str(run),
                   "--run.wandb", "false", "--ckpt_path", str(ckpt) if how == "file" else "last"], capsys)
    assert rc == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: --ckpt_path") and "model.model.d_model is 32 in the checkpoint, 64 here" in line
    assert "Traceback" not in err and "size mismatch" not in err, err
    assert not (run / ".run.lock").exists() and not (run / "csv").exists()


def test_a_named_checkpoint_keeps_the_users_flags(tmp_path):
    """``--ckpt_path FILE --model.on_nonfinite skip``: the flag stays (it was replaced by the checkpoint's
    ``stop``, so the remedy the non-finite stop suggests stopped again at the same step)."""
    from train.cli import WellMixedCLI

    ckpt = fake_checkpoint(tmp_path / "run" / "checkpoints" / "step0000002.ckpt", hparams())

    class ParseOnly(WellMixedCLI):
        def instantiate_classes(self) -> None:
            pass

        def _run_subcommand(self, subcommand: str) -> None:
            pass

    saved, sys.argv = sys.argv, sys.argv[:1]
    try:
        cfg = ParseOnly(args=["fit", "--config", DEMO, "--model.model", TINY, "--model.on_nonfinite", "skip",
                              "--model.model.qk_norm", "true", "--run.dir", str(tmp_path / "run"),
                              "--ckpt_path", str(ckpt)]).config.fit
    finally:
        sys.argv = saved
    assert cfg.model.on_nonfinite == "skip" and cfg.model.model.qk_norm is True  # compared later, not replaced
