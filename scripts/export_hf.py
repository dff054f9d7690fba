"""Export a checkpoint to the Hugging Face format, so `transformers` and evaluation harnesses can load it.

    python scripts/export_hf.py runs/demo/checkpoints/last.ckpt --out hf/demo
    python scripts/export_hf.py model_state.pt --model-config configs/model/350m.yaml --out hf/350m --dtype bfloat16
    python scripts/export_hf.py last.ckpt --out hf/demo --check     # also compare logits with transformers

Input: a Lightning checkpoint (``state_dict`` with keys ``model.<...>``, the ModelConfig fields in
``hyper_parameters["model"]``) or a bare state dict of ``train.model.GPT`` (then ``--model-config``
names its YAML). ``torch.compile``'s ``_orig_mod.`` prefix is dropped. Output, in ``--out``:

- ``config.json``: ``LlamaForCausalLM`` (``Qwen3ForCausalLM`` when ``qk_norm`` is on: Llama plus a
  per-head RMSNorm on q and k before RoPE, exactly ours). vocab_size is the padded 100,352;
  bos/eos are cl100k's ``<|endoftext|>`` (100257).
- ``model.safetensors``: renamed weights (tok_emb -> model.embed_tokens, blocks.i.attn.wq ->
  model.layers.i.self_attn.q_proj, w1/w3/w2 -> gate/up/down_proj, attn_norm/mlp_norm ->
  input/post_attention_layernorm, norm -> model.norm; lm_head only when untied). No permutation of
  wq/wk rows: our ``apply_rope`` already rotates halves ``(x[i], x[i + Dh/2])``, HF's ``rotate_half``.
  Our GQA maps query head h to kv head ``h // (H / K)``, as HF's ``repeat_kv`` does.
- ``tokenizer.json`` (+ ``tokenizer_config.json``, ``special_tokens_map.json``): cl100k_base rebuilt
  for the ``tokenizers`` library from tiktoken's ranks (byte-level BPE with cl100k's split pattern and
  merges recovered from the ranks; the five special tokens at their cl100k ids), so
  ``AutoTokenizer.from_pretrained(OUT)`` works; the test checks it encodes like tiktoken. Documents
  end with ``<|endoftext|>`` in training; the tokenizer adds no BOS/EOS by itself.
- ``tokenizer_info.json`` and ``README.md``: the canonical tokenizer is tiktoken's cl100k_base
  (``tiktoken.get_encoding("cl100k_base")``), EOT 100257; ids 100277..100351 are padding rows of the
  embedding that no token maps to.

Not exported: ``doc_mask`` (training-time attention masking; HF attends causally over the whole
input, which is the same for a single document) and ``activation_checkpointing``.
"""

import argparse
import sys

from data.errors import ConfigError
from train.export import DTYPES, compare_logits, export
from train.model import ModelConfigError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoint", help="Lightning .ckpt or a bare GPT state dict (.pt)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--model-config", help="model YAML (required for a bare state dict; overrides the checkpoint's)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="weight dtype (default float32)")
    p.add_argument("--no-tokenizer-json", action="store_true", help="skip tokenizer.json (tokenizer_info.json only)")
    p.add_argument("--check", action="store_true", help="load the export with transformers and compare logits")
    p.add_argument(
        "--trust-checkpoint", action="store_true", help="allow full unpickling (only for checkpoints you trust)"
    )
    args = p.parse_args(argv)
    try:
        out = export(
            args.checkpoint, args.out, args.model_config, args.dtype, not args.no_tokenizer_json, args.trust_checkpoint
        )
    except (ConfigError, ModelConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(sorted(f.name for f in out.iterdir()))} to {out}")
    if args.check:
        diff = compare_logits(args.checkpoint, out, args.model_config, args.dtype, trust=args.trust_checkpoint)
        tol = 1e-4
        print(
            f"max |logits ours - transformers| = {diff:.3g} ({'ok' if diff <= tol else 'TOO LARGE'}, tolerance {tol:g})"
        )
        return 0 if diff <= tol else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
