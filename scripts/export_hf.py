"""Export a checkpoint to the Hugging Face format, so `transformers` and evaluation harnesses can load it.

    python scripts/export_hf.py runs/demo/checkpoints/last.ckpt --out hf/demo
    python scripts/export_hf.py model_state.pt --model-config configs/model/350m.yaml --out hf/350m --dtype bfloat16
    python scripts/export_hf.py last.ckpt --out hf/demo --check     # also compare logits with transformers

What it does, the options' meaning and the measurements: the library, ``train/tools/export.py``.
"""

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import sys

from data.errors import one_line_errors
from train.model import ModelConfigError
from train.tools.export import DTYPES, compare_logits, export


@one_line_errors(also=(ModelConfigError,))
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
    out = export(
        args.checkpoint, args.out, args.model_config, args.dtype, not args.no_tokenizer_json, args.trust_checkpoint
    )
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
