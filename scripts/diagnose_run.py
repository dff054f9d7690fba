"""Diagnose one training run: does the shuffle mix? Writes RUN/diagnostics.md with plots and a PASS/FAIL
verdict per diagnostic (the library is ablations/diagnose.py; what each check does: docs/diagnostics.md).

    python scripts/diagnose_run.py runs/demo
    python scripts/diagnose_run.py runs/ablation-demo/fixed-seed1234 --corpus demo_corpus --out diag/report.md

Reads the run's csv/metrics.csv, order_log/rank*.jsonl (train with --data.order_log true) and
config.yaml; the corpus (the config's source globs, or --corpus DIR with DIR/<source>/*.parquet) for
the checks that need each document's source and each source's size. Exit status 1 when a diagnostic
fails, 0 otherwise: a check without the inputs it needs, or with too few of them (a short or killed
run), is SKIP with the reason and does not fail.
"""

from __future__ import annotations

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import sys
from pathlib import Path

from ablations.diagnose import FAIL, Thresholds, write_report
from data.errors import ConfigError, one_line_errors
from train.rundir import RunDir


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, default=None, help="Markdown path (default RUN/diagnostics.md); plots beside it")
    p.add_argument("--corpus", type=Path, default=None,
                   help="corpus dir DIR/<source>/*.parquet (default: the config's)")
    p.add_argument("--no-plots", action="store_true")
    flags = {"max_batch_distance": "default: the distance of batches whose rows each hold one random source",
             "max_cumulative_distance": "plus one step's share of the tokens trained (docs/diagnostics.md)",
             "min_steps": "fewer logged steps: the histogram check is SKIP", "epoch_rtol": None,
             "alpha": "sawtooth test's false-alarm rate on white noise", "window": "steps each side of an epoch "
             "boundary", "min_drop": "nats: a smaller drop at a boundary passes"}
    for name, text in flags.items():
        default = getattr(Thresholds(), name)
        p.add_argument("--" + name.replace("_", "-"), type=float if default is None else type(default),
                       default=default, help=text)
    args = p.parse_args(argv)
    if not RunDir(args.run_dir).metrics_csv.is_file():
        raise ConfigError(f"{args.run_dir}/csv/metrics.csv not found (a run directory of python -m train fit?)")
    th = Thresholds(**{name: getattr(args, name) for name in flags})
    out, checks = write_report(args.run_dir, args.out, args.corpus, th, plots=not args.no_plots)
    for c in checks:
        print(f"{c.status:4}  {c.name}: {c.summary}")
    print(f"report: {out}")
    return 1 if any(c.status == FAIL for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
