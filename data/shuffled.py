"""Is a global-shuffle output complete? The readers' side of scripts/global_shuffle.py's completion record.

``global_shuffle.py`` writes ``bucket-NNNNN.parquet`` files into its output folder, then, once every
bucket is written and verified, ``shuffle_report.json`` with ``ok``, the number of buckets and each
bucket's size (data/corpus/shuffle.py). A folder holding buckets (or the tool's ``_shuffle_tmp``)
without a report that is ``ok`` and names exactly the buckets there -- a run killed after 3 of 12
buckets, a failed verification, a bucket rebuilt since -- is not a corpus: the manifest,
``scripts/dump_order.py`` and ``scripts/inspect_corpus.py`` refuse it, naming the folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

REPORT = "shuffle_report.json"
"""The completion record, written last into the output folder."""
TMP = "_shuffle_tmp"
BUCKET = re.compile(r"bucket-\d{5}\.parquet")


def bucket_sizes(folder: Path) -> dict[str, int]:
    """``bucket-NNNNN.parquet`` name -> size in bytes, of the buckets in ``folder``."""
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if BUCKET.fullmatch(p.name)}


def shuffle_output_problem(folder: str | Path) -> str | None:
    """Why ``folder`` is an incomplete shuffle output, or None (complete, or not a shuffle output)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    buckets = bucket_sizes(folder)
    if not buckets and not (folder / TMP).is_dir():
        return None
    fix = "rerun the same scripts/global_shuffle.py command to finish it (it skips what is done)"
    try:
        report = json.loads((folder / REPORT).read_text())
    except FileNotFoundError:
        return f"{folder}: an incomplete global-shuffle output ({len(buckets)} bucket(s), no {REPORT}); {fix}"
    except (OSError, ValueError) as e:
        return f"{folder}/{REPORT}: unreadable ({e}); {fix}"
    if not report.get("ok"):
        return (f"{folder}: the global shuffle's verification failed ({'; '.join(report.get('problems', []))}); "
                f"see {REPORT}, then {fix}")
    want = report.get("bucket_bytes")
    if want is None:  # a report of a version without sizes: the count at least
        want = {f"bucket-{b:05d}.parquet": buckets.get(f"bucket-{b:05d}.parquet")
                for b in range(int(report.get("buckets", -1)))}
    if want != buckets:
        missing = sorted(set(want) - set(buckets))
        changed = sorted(n for n in set(want) & set(buckets) if want[n] != buckets[n])
        extra = sorted(set(buckets) - set(want))
        what = "; ".join(f"{label} {names[:3]}{' ...' if len(names) > 3 else ''}" for label, names in
                         (("missing", missing), ("changed since", changed), ("not in it", extra)) if names)
        return (f"{folder}: the buckets do not match {REPORT} ({len(want)} recorded, {len(buckets)} present: "
                f"{what}); {fix}")
    return None


def shuffle_problems(paths: list[str]) -> list[str]:
    """The problems of every folder among ``paths``' parents (see :func:`shuffle_output_problem`)."""
    out = []
    parts = [p for p in paths if TMP in Path(p).parts]
    if parts:
        out.append(f"{parts[0]}: a global shuffle's temporary part ({len(parts)} such file(s) matched); narrow the "
                   "glob to the bucket files")
    for folder in sorted({Path(p).parent for p in paths}):
        problem = shuffle_output_problem(folder)
        if problem:
            out.append(problem)
    return out
