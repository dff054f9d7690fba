"""The start-up memory check (train/memory.py): what fits, and a refusal that names the knob to turn."""

from __future__ import annotations

from pathlib import Path

import pytest

from train.memory import GB, check_fits, estimate_peak_memory
from train.model import ModelConfig, load_model_config

ROOT = Path(__file__).resolve().parents[2]
H200 = 140 * 2**30


def real() -> ModelConfig:
    return load_model_config(ROOT / "configs/model/350m.yaml")


def test_32x2048_fits_an_h200_with_the_chunked_loss_and_not_with_the_plain_one():
    cfg = real()
    assert cfg.loss_impl == "chunked"
    assert check_fits(cfg, 32, 2048, H200)["total"] < 100 * GB
    cfg.loss_impl = "plain"
    with pytest.raises(ValueError) as e:
        check_fits(cfg, 32, 2048, H200)
    msg = str(e.value)
    assert "data.batch_size 32" in msg and "exceeds" in msg
    for knob in ("model.loss_impl chunked", "model.activation_checkpointing true", "data.batch_size 16",
                 "trainer.accumulate_grad_batches x2"):
        assert knob in msg, knob


def test_activation_checkpointing_and_the_chunked_loss_shrink_the_estimate():
    cfg = real()
    full = estimate_peak_memory(cfg, 32, 2048, loss="plain")["total"]
    chunked = estimate_peak_memory(cfg, 32, 2048, loss="chunked")["total"]
    ckpt = estimate_peak_memory(cfg, 32, 2048, loss="chunked", activation_checkpointing=True)["total"]
    assert ckpt < chunked < full
    # linear in the micro-batch beyond the fixed parameter state
    fixed = sum(estimate_peak_memory(cfg, 1, 2048)[k] for k in ("params_grads", "optimizer_state"))
    assert estimate_peak_memory(cfg, 16, 2048)["block_activations"] * 2 == \
        estimate_peak_memory(cfg, 32, 2048)["block_activations"]
    assert fixed == pytest.approx(16 * 359_703_552)


def test_the_estimate_asks_the_optimizer_for_its_state():
    """AdamW keeps two fp32 moments per parameter; Muon one momentum per hidden matrix (train/optim.py):
    the Muon estimate is 4 bytes smaller per block-matrix parameter, the embeddings and norms unchanged."""
    from train.optim import OptimConfig

    cfg = real()
    adamw = estimate_peak_memory(cfg, 32, 2048, optim=OptimConfig(name="adamw"))
    muon = estimate_peak_memory(cfg, 32, 2048, optim=OptimConfig(name="muon"))
    assert adamw == estimate_peak_memory(cfg, 32, 2048)  # the default is AdamW
    assert adamw["optimizer_state"] == 8 * 359_703_552
    matrices = 20 * (4 * 1024 * 1024 + 3 * 1024 * 2816)  # 20 blocks: wq, wk, wv, wo; w1, w3, w2
    assert adamw["total"] - muon["total"] == adamw["optimizer_state"] - muon["optimizer_state"] == 4 * matrices


def test_a_model_too_large_for_the_device_names_the_knobs_and_the_table():
    with pytest.raises(ValueError) as e:
        check_fits(real(), 64, 2048, 24 * 2**30)  # a 24 GiB card
    assert "estimated peak per GPU" in str(e.value) and "device memory" in str(e.value)


def test_only_bf16_mixed_is_modelled():
    with pytest.raises(ValueError, match="bf16-mixed"):
        estimate_peak_memory(real(), 1, 128, precision="32-true")


def test_the_start_up_check_on_a_gpu_refuses_what_cannot_fit(monkeypatch):
    """The CLI's GPU-only branch (train/cli.py _check_memory), run here with a stand-in H200: the real
    shape passes and prints its plan; the plain loss is refused as a ConfigError naming the knobs."""
    from types import SimpleNamespace

    import torch
    from lightning.pytorch.strategies import DDPStrategy

    from data.errors import ConfigError
    from data.schedules import fixed_schedule
    from train.cli import RunConfig, WellMixedCLI

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=H200))
    strategy = DDPStrategy()
    monkeypatch.setattr(DDPStrategy, "root_device", property(lambda self: torch.device("cuda", 0)))
    trainer = SimpleNamespace(strategy=strategy, precision="bf16-mixed", is_global_zero=True)
    schedule = fixed_schedule({"web": 1.0}, 2048).build()
    dm = SimpleNamespace(schedule=schedule, config=SimpleNamespace(batch_size=32))  # the TrainingContext it reads
    cli = SimpleNamespace(trainer=trainer, model=SimpleNamespace(model_config=real(), optim=None))
    WellMixedCLI._check_memory(cli, dm, RunConfig())  # 86.6 GB: fits
    cli.model.model_config.loss_impl = "plain"
    with pytest.raises(ConfigError, match=r"(?s)model.loss_impl chunked.*run.memory_check false"):
        WellMixedCLI._check_memory(cli, dm, RunConfig())
    WellMixedCLI._check_memory(cli, dm, RunConfig(memory_check=False))  # the documented way around it
