"""scripts/export_hf.py: our GPT and transformers' Llama (Qwen3 with qk_norm) give the same logits
after export, and the exported tokenizer.json encodes like tiktoken's cl100k_base."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from data.errors import ConfigError
from data.tokenizer import TokenizerConfig, cl100k_encoding
from train.checkpoint import checksum_path, file_sha256
from train.model import GPT, ModelConfig, load_model_config
from train.tools import export as export_hf

CL100K = TokenizerConfig().build()
EOT_ID, VOCAB_SIZE = CL100K.eot_id, CL100K.vocab_size

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "model" / "tiny.yaml"


def random_model(cfg: ModelConfig, seed: int = 0) -> GPT:
    """Random weights everywhere, norm gains included (all-ones gains would hide a swapped norm)."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)  # larger than the init, so attention patterns are far from uniform
    return model


def save_lightning(model: GPT, path: Path) -> Path:
    """The layout PretrainModule's checkpoints have: ``model.``-prefixed state dict + hparams."""
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "hyper_parameters": {"model": dict(vars(model.config)), "optim": {}},
                "global_step": 0}, path)
    return with_sidecar(path)


def with_sidecar(path: Path) -> Path:
    """A file saved by hand gets the sidecar this code writes (a checkpoint without one is refused)."""
    checksum_path(path).write_text(f"{file_sha256(path)}  {path.name}\n")
    return path


@torch.no_grad()
def max_logit_diff(model: GPT, out: Path, cls) -> float:
    hf = cls.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB_SIZE, (2, 48), generator=torch.Generator().manual_seed(1))
    model.eval()
    ours, theirs = model(ids), hf(ids).logits
    assert theirs.shape == ours.shape == (2, 48, model.config.vocab_size)
    return (ours - theirs).abs().max().item()


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """The tiny config exported once, tokenizer.json included."""
    tmp = tmp_path_factory.mktemp("export_tiny")
    model = random_model(load_model_config(TINY))
    out = export_hf.export(save_lightning(model, tmp / "last.ckpt"), tmp / "hf")
    return model, out


def test_tiny_llama_logits_match(tiny_export):
    model, out = tiny_export
    assert max_logit_diff(model, out, transformers.LlamaForCausalLM) <= 1e-4


def test_config_json(tiny_export):
    model, out = tiny_export
    cfg = json.loads((out / "config.json").read_text())
    c = model.config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (
        c.d_model,
        c.ffn_hidden,
        c.n_layers,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (c.n_heads, c.n_heads)
    assert cfg["vocab_size"] == 100352 and cfg["max_position_embeddings"] == c.max_seq_len
    assert cfg["rope_theta"] == c.rope_theta and cfg["rms_norm_eps"] == c.norm_eps
    assert cfg["tie_word_embeddings"] is True and cfg["attention_bias"] is False and cfg["mlp_bias"] is False
    assert cfg["bos_token_id"] == cfg["eos_token_id"] == EOT_ID and cfg["torch_dtype"] == "float32"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys  # tied: stored once
    info = json.loads((out / "tokenizer_info.json").read_text())
    assert info["tokenizer"] == "cl100k_base" and info["eot_id"] == EOT_ID


def test_gqa_untied_logits_match(tmp_path):
    """n_kv_heads < n_heads (query head h reads kv head h // 2) and a separate LM head."""
    cfg = replace(
        load_model_config(TINY), d_model=64, n_heads=4, n_kv_heads=2, tie_embeddings=False, rope_theta=500000.0
    )
    model = random_model(cfg, seed=2)
    out = export_hf.export(save_lightning(model, tmp_path / "gqa.ckpt"), tmp_path / "hf", tokenizer_json=False)
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    assert max_logit_diff(model, out, transformers.LlamaForCausalLM) <= 1e-4


def test_qk_norm_exports_as_qwen3(tmp_path):
    cfg = replace(load_model_config(TINY), qk_norm=True, n_heads=4, n_kv_heads=2)
    model = random_model(cfg, seed=3)
    out = export_hf.export(save_lightning(model, tmp_path / "qk.ckpt"), tmp_path / "hf", tokenizer_json=False)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert max_logit_diff(model, out, transformers.Qwen3ForCausalLM) <= 1e-4


@pytest.mark.slow
def test_cli_bare_state_dict_with_check(tmp_path):
    """A bare GPT state dict (as torch.compile would save it) + --model-config, bf16 weights, --check."""
    model = random_model(load_model_config(TINY), seed=4)
    torch.save({f"_orig_mod.{k}": v for k, v in model.state_dict().items()}, tmp_path / "bare.pt")
    with_sidecar(tmp_path / "bare.pt")
    r = subprocess.run(
        [
            sys.executable,
            "scripts/export_hf.py",
            str(tmp_path / "bare.pt"),
            "--out",
            str(tmp_path / "hf"),
            "--model-config",
            str(TINY),
            "--dtype",
            "bfloat16",
            "--no-tokenizer-json",
            "--check",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(ok, tolerance 0.0001)" in r.stdout
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # Without a config, a bare state dict is refused with a message naming the flag.
    r = subprocess.run(
        [sys.executable, "scripts/export_hf.py", str(tmp_path / "bare.pt"), "--out", str(tmp_path / "x")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "--model-config" in r.stderr


def test_mismatched_checkpoint_is_refused(tmp_path):
    model = random_model(load_model_config(TINY))
    save_lightning(model, tmp_path / "a.ckpt")
    with pytest.raises(ConfigError, match="does not match the model config"):
        export_hf.export(tmp_path / "a.ckpt", tmp_path / "hf", model_config=ROOT / "configs" / "model" / "demo.yaml")


def test_tokenizer_json_encodes_like_tiktoken(tiny_export, demo_corpus):
    _, out = tiny_export
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    enc = cl100k_encoding()
    texts = [
        t
        for p in sorted(demo_corpus.glob("*/*.parquet"))
        for t in pq.read_table(p, columns=["text"]).column("text").to_pylist()[::4]
    ]
    texts += ["Hello   world!!\n\n\n  x", "I'm you'LL THEY'RE 12345678 ünïcödé 日本語テキスト 🎉🎉", "\t\t  \r\n tabs",
              "  leading", "trailing   ", "", "1234567 89 0000001", "a  \n\n  b\r\n\r\n", "  \n"]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False) == enc.encode_ordinary(text), text[:200]
    assert tok.encode("a<|endoftext|>b", add_special_tokens=False) == enc.encode(
        "a<|endoftext|>b", allowed_special="all"
    )
    assert tok.eos_token_id == tok.bos_token_id == EOT_ID
    assert tok.decode(enc.encode_ordinary(texts[0])) == texts[0]
