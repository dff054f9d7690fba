"""The model's interface (train/architecture.py): GPT satisfies it as is, and a second architecture --
one new file plus a config (tests/causal_mixer.py, tests/causal_mixer.yaml) -- trains through it."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from causal_mixer import CausalMixer, MixerConfig

from data.config import load_data_config
from data.schedules import LRConfig
from train.architecture import Architecture, ArchitectureConfig, build_model
from train.callbacks import ThroughputCallback
from train.datamodule import WellMixedData
from train.loggers import derived_values
from train.model import GPT, ModelConfigError, load_model_config
from train.module import PretrainModule

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("web", "code", "books", "curated")


def test_gpt_and_its_config_satisfy_the_protocol_as_they_are():
    config = load_model_config(ROOT / "configs" / "model" / "tiny.yaml")
    model = build_model(config)
    assert type(model) is GPT
    assert isinstance(config, ArchitectureConfig) and isinstance(model, Architecture)


def test_a_config_without_build_is_refused_by_name():
    class Bare:
        vocab_size, max_seq_len, doc_mask, loss_impl, activation_checkpointing = 8, 8, False, "plain", False

    with pytest.raises(ModelConfigError, match="Bare has no build"):
        build_model(Bare())


def mixer_config() -> MixerConfig:
    return MixerConfig(**yaml.safe_load((ROOT / "tests" / "causal_mixer.yaml").read_text()))


def test_a_second_architecture_trains_three_steps_through_the_module(demo_corpus, cache_dir, tmp_path):
    config = mixer_config()
    assert isinstance(config, ArchitectureConfig)
    data = load_data_config(ROOT / "configs" / "demo.yaml", overrides={
        "sources": {s: {"paths": [str(demo_corpus / s / "*.parquet")]} for s in SOURCES},
        "manifest_cache": str(cache_dir), "num_workers": 0, "buffer_size": 16, "val_tokens_per_source": 0,
        "schedule": {"train_tokens": 3 * 4 * 32, "global_batch_size": 4,
                     "seq_len": {"start": 32, "end": 32, "warmup_steps": 0, "multiple": 16},
                     "anneal_start": 0.3,
                     "mixture": {"phases": [{"name": "stable", "weights": {s: 0.25 for s in SOURCES}}]}},
    })
    dm = WellMixedData(data)
    module = PretrainModule(model=config, lr=LRConfig(peak=1e-2, min=0.0, warmup_steps=1))
    assert isinstance(module.model, CausalMixer) and isinstance(module.model, Architecture)
    before = module.model.tok_emb.weight.detach().clone()
    throughput = ThroughputCallback()
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, precision="32-true", logger=False,
                        callbacks=[throughput], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        default_root_dir=tmp_path)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 3
    assert not torch.equal(before, module.model.tok_emb.weight)  # the optimizer stepped its parameters
    assert throughput._tokens == 3 * 4 * 32  # and flops_per_token(32) was read for each of its batches
    values = derived_values(dm.context(), module, trainer)
    assert values["parameters"] == sum(p.numel() for p in module.model.parameters())
    assert values["model_config"]["mlp_hidden"] == config.mlp_hidden
    assert module.hparams["model"] == vars(config)
    loss = module.model(torch.zeros(1, 8, dtype=torch.long), targets=torch.ones(1, 8, dtype=torch.long))
    assert loss.shape == (1, 8) and math.isfinite(loss.sum().item())


def test_a_config_file_can_name_the_architecture_by_class_path():
    """The hook a config path needs (docs/model.md): jsonargparse takes a class implementing BuildsArchitecture."""
    from jsonargparse import ArgumentParser

    from train.architecture import BuildsArchitecture
    from train.model import ModelConfig

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--model", type=str | ModelConfig | BuildsArchitecture)
    ns = parser.parse_object({"model": {"class_path": "causal_mixer.MixerConfig", "init_args": {"d_model": 16}}})
    config = parser.instantiate(ns).model
    assert config == MixerConfig(d_model=16) and isinstance(build_model(config), CausalMixer)
