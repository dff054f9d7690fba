"""Export a checkpoint to the Hugging Face format, so `transformers` and evaluation harnesses can load it.

    python scripts/export_hf.py runs/demo/checkpoints/last.ckpt --out hf/demo
    python scripts/export_hf.py model_state.pt --model-config configs/model/350m.yaml --out hf/350m --dtype bfloat16
    python scripts/export_hf.py last.ckpt --out hf/demo --check     # also compare logits with transformers

Input: a Lightning checkpoint (``state_dict`` with keys ``model.<...>``, the ModelConfig fields in
``hyper_parameters["model"]``) or a bare state dict of ``train.model.GPT`` (then ``--model-config``
names its YAML). ``torch.compile``'s ``_orig_mod.`` prefix is dropped. Output, in ``--out``:

- ``config.json`` (:func:`hf_config`): ``LlamaForCausalLM`` (``Qwen3ForCausalLM`` when ``qk_norm`` is on:
  Llama plus a per-head RMSNorm on q and k before RoPE, exactly ours); the model's (padded) vocabulary;
  bos/eos are the tokenizer's EOT (cl100k's ``<|endoftext|>``, 100257), in ``generation_config.json`` too.
- ``model.safetensors``: the weights under HF's names (:func:`hf_state_dict`). No permutation of wq/wk
  rows: our ``apply_rope`` already rotates halves, as HF's ``rotate_half``; our GQA maps query head h to
  kv head ``h // (H / K)``, as HF's ``repeat_kv``.
- ``tokenizer.json`` and its two companions, for the tokenizer the checkpoint was trained with (its
  ``data.tokenizer``; cl100k_base for a bare state dict): a ``tokenizer.json`` is copied, a tiktoken
  encoding is rebuilt for ``tokenizers`` from its ranks (:func:`write_tokenizer`), so
  ``AutoTokenizer.from_pretrained(OUT)`` encodes like training did; it adds no BOS/EOS (documents end with
  EOT in training).
- ``tokenizer_info.json`` and ``README.md``: the tokenizer, its EOT and vocabulary size; ids from the
  tokenizer's vocabulary size up to the model's are padding rows of the embedding that no token maps to.

Not exported: ``doc_mask`` (training-time attention masking; HF attends causally over the whole
input, which is the same for a single document) and ``activation_checkpointing``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import fields
from pathlib import Path

import torch

from data.errors import ConfigError
from data.tokenizer import Tokenizer, TokenizerConfig
from train.checkpoint import (
    CheckpointError,
    checksum_problem,
    file_problem,
    load_problem,
    read_checkpoint,
)
from train.model import GPT, ModelConfig, load_model_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


EXPORT_ANOTHER = "name another checkpoint (e.g. a stepNNNNNNN.ckpt in the run's checkpoints/)"


def read_weights(path: str | Path, trust: bool = False) -> dict:
    """The checkpoint (or bare state dict) at ``path``, verified as every reader does (train/checkpoint.py:
    format, sidecar checksum; a missing sidecar is refused, with ``trust`` a warning). Loaded with
    ``weights_only=True`` (no code runs) unless ``trust``; only a file refused for holding other objects is
    pointed at ``--trust-checkpoint``."""
    path = Path(path)
    if not trust or not path.is_file():
        try:
            return read_checkpoint(path, "checkpoint", EXPORT_ANOTHER, lightning=False)
        except CheckpointError as e:
            if "holds objects other than tensors" not in str(e):
                raise
            raise CheckpointError(f"{e}; if you trust the file and its source, --trust-checkpoint unpickles it "
                                  "(that runs whatever code it holds)") from None
    problem = file_problem(path, pickle_ok=True) or checksum_problem(path, unverified_ok=True)
    if problem is None:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 -- one line, whatever torch raised
            problem = load_problem(e)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path}: {problem}; {EXPORT_ANOTHER}")
    return obj


def load_checkpoint(path: str | Path, model_config: str | Path | None = None,
                    trust: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor], TokenizerConfig]:
    """(ModelConfig, GPT state dict, its ``data.tokenizer``) from a Lightning checkpoint or a bare state dict
    (cl100k_base then; :func:`read_weights`; ``trust=True`` allows full unpickling, for trusted checkpoints
    that hold other objects, e.g. ones written before checkpoints were made weights-only loadable)."""
    obj = read_weights(path, trust)
    if not isinstance(obj, dict):
        raise ConfigError(f"{path}: expected a dict (a Lightning checkpoint or a state dict), got {type(obj).__name__}")
    state = {_strip(k): v for k, v in obj.get("state_dict", obj).items() if isinstance(v, torch.Tensor)}
    data = ((obj.get("datamodule_hyper_parameters") or {}).get("config") or {}) if "state_dict" in obj else {}
    tokenizer = TokenizerConfig(**(data.get("tokenizer") or {}))
    return (load_model_config(model_config) if model_config is not None else _saved_config(path, obj)), state, tokenizer


def _saved_config(path: str | Path, obj: dict) -> ModelConfig:
    """The model config a Lightning checkpoint holds in its hyper-parameters (a bare state dict has none)."""
    hparams = (obj.get("hyper_parameters") or {}).get("model") if "state_dict" in obj else None
    if not isinstance(hparams, dict):
        raise ConfigError(
            f"{path}: no model config inside (a bare state dict?): pass --model-config configs/model/<name>.yaml"
        )
    known = {f.name for f in fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in hparams.items() if k in known})


def _strip(key: str) -> str:
    """``model._orig_mod.blocks.0...`` (Lightning + torch.compile) -> ``blocks.0...``."""
    for prefix in ("model.", "_orig_mod."):
        if key.startswith(prefix):
            key = key[len(prefix):]
    return key


def check_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """Every GPT weight present with its shape (compared with a GPT built on the meta device)."""
    with torch.device("meta"):
        ref = GPT(cfg).state_dict()
    found = {"missing": [k for k in ref if k not in state], "unexpected": [k for k in state if k not in ref],
             "shape": _shape_mismatches(ref, state)}
    problems = [f"{what} {items[:5]}" for what, items in found.items() if items]
    if problems:
        raise ConfigError("checkpoint does not match the model config: " + "; ".join(problems))


def _shape_mismatches(ref: dict, state: dict) -> list[str]:
    return [f"{k} {tuple(state[k].shape)} != {tuple(v.shape)}" for k, v in ref.items()
            if k in state and state[k].shape != v.shape]


def hf_state_dict(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our parameter names -> HF Llama/Qwen3 names (contiguous, detached, in ``dtype``)."""
    names = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    per_layer = {
        "attn_norm.weight": "input_layernorm.weight",
        "attn.wq.weight": "self_attn.q_proj.weight",
        "attn.wk.weight": "self_attn.k_proj.weight",
        "attn.wv.weight": "self_attn.v_proj.weight",
        "attn.wo.weight": "self_attn.o_proj.weight",
        "mlp_norm.weight": "post_attention_layernorm.weight",
        "mlp.w1.weight": "mlp.gate_proj.weight",
        "mlp.w3.weight": "mlp.up_proj.weight",
        "mlp.w2.weight": "mlp.down_proj.weight",
    }
    if cfg.qk_norm:
        per_layer.update(
            {"attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"}
        )
    for i in range(cfg.n_layers):
        names.update({f"blocks.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in per_layer.items()})
    return {theirs: state[ours].detach().to(dtype).contiguous() for ours, theirs in names.items()}


def hf_config(cfg: ModelConfig, dtype: str, eot_id: int) -> dict:
    """config.json for LlamaForCausalLM (Qwen3ForCausalLM with qk_norm)."""
    out = {
        "architectures": ["Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"],
        "model_type": "qwen3" if cfg.qk_norm else "llama",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": float(cfg.rope_theta),  # transformers < 5 reads this key ...
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},  # ... >= 5 this one
        "rope_scaling": None,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if cfg.qk_norm:
        out.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers,
                    "layer_types": ["full_attention"] * cfg.n_layers})
    else:
        out.update({"mlp_bias": False, "pretraining_tp": 1})
    return out


def write_tokenizer(out: Path, max_len: int, tokenizer: Tokenizer) -> None:
    """tokenizer.json etc.: a Hugging Face tokenizer's own file, or a tiktoken encoding as a `tokenizers`
    byte-level BPE built from its ranks.

    tiktoken stores only ranks; BPE merges are recovered as in transformers' TikTokenConverter: for
    each token, every split into two tokens whose ranks are both lower gives the merge (left, right),
    ordered by the merged token's rank. ``ignore_merges`` makes a whole pre-token that is in the
    vocabulary one token, as tiktoken does. The split pattern is rewritten for Oniguruma (the `tokenizers`
    regex engine): there ``X{1,3}+`` is not a possessive interval but "(X{1,3}) one or more times", which
    would keep digit runs whole; the greedy ``{1,3}`` splits them into groups of three like tiktoken. The
    other possessives are Oniguruma's.
    """
    eot = tokenizer.config.eot
    if tokenizer.config.path is not None:
        shutil.copyfile(Path(tokenizer.config.path).expanduser(), out / "tokenizer.json")
    else:
        _tiktoken_as_hf(tokenizer.backend).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eot, "eos_token": eot, "unk_token": None, "pad_token": None,
        "model_max_length": max_len, "clean_up_tokenization_spaces": False,
        "add_bos_token": False, "add_eos_token": False,
    }, indent=1) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": eot, "eos_token": eot}, indent=1) + "\n")


def _tiktoken_as_hf(enc):
    """A tiktoken Encoding as a `tokenizers` Tokenizer (:func:`write_tokenizer`)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    ranks, special = enc._mergeable_ranks, enc._special_tokens
    byte_map = _bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(byte_map[x] for x in b)

    vocab = {s(tok): rank for tok, rank in ranks.items()}
    vocab.update(special)  # the special ids need not be contiguous with the ranks (cl100k: 100256 is unused)
    merges = [(s(left), s(right)) for left, right in _merges(ranks)]
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    pattern = re.sub(r"(\{\d+,\d+\})\+", r"\1", enc._pat_str)  # X{1,3}+ -> X{1,3} (the docstring above)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of a token into two lower-ranked tokens, ordered by the token's rank, then the parts'."""
    found = sorted((rank, ranks[tok[:i]], ranks[tok[i:]], i, tok) for tok, rank in ranks.items()
                   for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks)
    return [(tok[:i], tok[i:]) for *_, i, tok in found]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenizers use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_tokenizer_info(out: Path, cfg: ModelConfig, with_json: bool, tokenizer: Tokenizer) -> None:
    tiktoken = tokenizer.config.path is None
    n_vocab, eot_id = tokenizer.vocab_size, tokenizer.eot_id
    info = {
        "tokenizer": tokenizer.name,
        "identity": tokenizer.identity,
        "library": "tiktoken" if tiktoken else "tokenizers",
        "load": f'tiktoken.get_encoding("{tokenizer.name}")' if tiktoken else 'Tokenizer.from_file("tokenizer.json")',
        "eot_token": tokenizer.config.eot,
        "eot_id": eot_id,
        "n_vocab": n_vocab,
        "model_vocab_size": cfg.vocab_size,
        "padding_ids": [n_vocab, cfg.vocab_size - 1] if cfg.vocab_size > n_vocab else None,
        "documents": "encoded without special tokens (special-token text stays text), each followed by EOT",
        "tokenizer_json": with_json,
    }
    (out / "tokenizer_info.json").write_text(json.dumps(info, indent=1) + "\n")
    arch = "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"
    (out / "README.md").write_text(
        f"# wellmixed export\n\n{arch}, {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads "
        f"({cfg.kv_heads} kv), context {cfg.max_seq_len}.\n\n"
        f"## Tokenizer\n\n{tokenizer.name} through {info['library']} (`{info['load']}`); every training "
        f"document ends with `{tokenizer.config.eot}` = {eot_id}, which is also bos/eos here. The embedding has "
        f"{cfg.vocab_size} rows: ids {n_vocab}..{cfg.vocab_size - 1} are padding that no token maps to.\n"
        + ("`tokenizer.json` is the same encoding for the `tokenizers` library "
           "(`AutoTokenizer.from_pretrained` loads it); it adds no BOS/EOS.\n" if with_json else
           f"No `tokenizer.json` was written (--no-tokenizer-json): use {info['library']}.\n")
    )


def export(checkpoint: str | Path, out: str | Path, model_config: str | Path | None = None,
           dtype: str = "float32", tokenizer_json: bool = True, trust: bool = False) -> Path:
    """Write config.json, model.safetensors and the tokenizer files into ``out``; returns ``out``."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: choose one of {list(DTYPES)}")
    cfg, state, tokenizer_config = load_checkpoint(checkpoint, model_config, trust)
    check_state(cfg, state)
    tokenizer = tokenizer_config.build()
    if cfg.tie_embeddings and not torch.equal(
        state["tok_emb.weight"], state.get("lm_head.weight", state["tok_emb.weight"])
    ):
        raise ConfigError("model.tie_embeddings is on but lm_head.weight differs from tok_emb.weight in the checkpoint")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = out / "model.safetensors"
    save_file(hf_state_dict(cfg, state, DTYPES[dtype]), str(weights), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    weights.chmod(0o666 & ~umask)  # safetensors writes 0600; others on a shared cluster need to read it
    (out / "config.json").write_text(json.dumps(hf_config(cfg, dtype, tokenizer.eot_id), indent=1) + "\n")
    # generate() reads bos/eos from here (transformers warns and guesses without it)
    generation = {"bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id, "max_length": cfg.max_seq_len}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1) + "\n")
    if tokenizer_json:
        write_tokenizer(out, cfg.max_seq_len, tokenizer)
    write_tokenizer_info(out, cfg, tokenizer_json, tokenizer)
    return out


@torch.no_grad()
def compare_logits(
    checkpoint: str | Path,
    out: str | Path,
    model_config: str | Path | None = None,
    dtype: str = "float32",
    batch: int = 2,
    length: int = 32,
    seed: int = 0,
    trust: bool = False,
) -> float:
    """Max |logits ours - logits transformers| on random ids, both in fp32 on CPU (with the weights
    rounded to ``dtype`` first, as exported)."""
    from transformers import AutoModelForCausalLM

    cfg, state, _ = load_checkpoint(checkpoint, model_config, trust)
    ours = GPT(cfg)
    ours.load_state_dict({k: v.to(DTYPES[dtype]).float() for k, v in state.items()})
    ours.eval()
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    theirs.eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, min(length, cfg.max_seq_len)), generator=g)
    return (ours(ids) - theirs(ids).logits.float()).abs().max().item()
