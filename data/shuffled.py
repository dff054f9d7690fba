"""Is a global-shuffle output complete? The readers' side of scripts/global_shuffle.py's completion record.

``global_shuffle.py`` writes ``bucket-NNNNN.parquet`` files into its output folder, then, once every
bucket is written and verified, ``shuffle_report.json`` with ``ok``, the rows in and out, and per bucket
its rows and :func:`~data.files.file_digest` (size and footer hash: the footer holds the row count and
every column chunk's sizes and statistics, so another run's bucket cannot match it by accident). A
folder holding buckets (or the tool's ``_shuffle_tmp``) is a corpus only when that record is ``ok``,
pins exactly the buckets there, byte for byte, and its bucket rows add up to its own ``rows_out`` and
``rows_in``. A run killed after 3 of 12 buckets, a failed verification, a bucket rebuilt, copied from
another run or deleted (record edited or not), and a record of a version that did not pin its buckets
are refused by the manifest, ``scripts/dump_order.py`` and ``scripts/inspect_corpus.py``, naming the
folder and the command that repairs it. The record carries a hash of its own content (``record_sha256``):
a record edited by hand (a digest, a count) or one that is not a record (``null``, ``[]``) is named as the
thing at fault, not the buckets it pins.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from data.files import file_digest

REPORT = "shuffle_report.json"
"""The completion record, written last into the output folder."""
TMP = "_shuffle_tmp"
BUCKET = re.compile(r"bucket-\d{5}\.parquet")
FIX = "rerun the same scripts/global_shuffle.py command to finish it (it skips what is done)"


def shuffle_output_problem(folder: str | Path) -> str | None:
    """Why ``folder`` is an incomplete shuffle output, or None (complete, or not a shuffle output)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    present = sorted(p.name for p in folder.iterdir() if BUCKET.fullmatch(p.name))
    if not present and not (folder / TMP).is_dir():
        return None
    try:
        report = json.loads((folder / REPORT).read_text())
    except FileNotFoundError:
        return f"{folder}: an incomplete global-shuffle output ({len(present)} bucket(s), no {REPORT}); {FIX}"
    except (OSError, ValueError) as e:
        return f"{folder}/{REPORT}: unreadable ({e}); {FIX}"
    return _record_problem(folder, report) or _pin_problem(folder, report["bucket_files"], present)


def record_checksum(report: dict) -> str:
    """A hash of the record's content, its own ``record_sha256`` left out: global_shuffle.py writes it into the
    record, so an edit of any value in it (a pinned digest, a row count) is told from a changed bucket."""
    body = {k: v for k, v in report.items() if k != "record_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def record_intact(report: Any) -> bool:
    """A record (a JSON object) whose ``record_sha256`` matches its content (a record written before it had
    one is taken as it is)."""
    return isinstance(report, dict) and report.get("record_sha256", record_checksum(report)) == record_checksum(report)


def _record_problem(folder: Path, report: Any) -> str | None:
    """A record that is not one, was edited, failed, cannot pin its buckets (an older version) or does not add up."""
    if not isinstance(report, dict):
        return f"{folder}/{REPORT}: not a completion record (it holds {json.dumps(report)[:40]}); {FIX}"
    if not record_intact(report):
        return (f"{folder}/{REPORT}: edited or damaged (its record_sha256 does not match its content), so it shows "
                "nothing about the buckets there, which need not be deleted: rerun the same "
                "scripts/global_shuffle.py command to rewrite it (it re-reads the input and every bucket's rows)")
    if not report.get("ok"):
        return (f"{folder}: the global shuffle's verification failed ({'; '.join(report.get('problems', []))}); "
                f"see {REPORT}, then {FIX}")
    pins = report.get("bucket_files")
    if not isinstance(pins, dict):
        identity = report.get("identity") or {}
        return (f"{folder}/{REPORT}: written by an older global_shuffle.py that does not pin each bucket's rows and "
                "bytes, so it cannot show the buckets there are the ones it verified; re-verify them and rewrite it "
                f"with: python scripts/global_shuffle.py IN_GLOB --out {folder} --buckets "
                f"{identity.get('buckets', report.get('buckets', 'N'))} --seed {identity.get('seed', 'SEED')} "
                "--report-only (IN_GLOB: the run's input globs)")
    try:
        rows = sum(int(r) for r, _ in pins.values())
    except (TypeError, ValueError):  # a pin that is not [rows, digest]
        rows = -1
    if rows == report.get("rows_out") == report.get("rows_in") and len(pins) == report.get("buckets"):
        return None
    return (f"{folder}/{REPORT}: does not add up ({len(pins)} bucket(s) pinned with {rows:,} rows; the record "
            f"says {report.get('buckets')} bucket(s), rows_out {report.get('rows_out')}, rows_in "
            f"{report.get('rows_in')}): it was edited or damaged; {FIX}")


def _pin_problem(folder: Path, pins: dict[str, list], present: list[str]) -> str | None:
    """Each bucket there against its pin (rows, size and footer hash): missing, changed, unrecorded ones."""
    missing = sorted(set(pins) - set(present))
    extra = sorted(set(present) - set(pins))
    changed = sorted(n for n in set(pins) & set(present) if file_digest(folder / n) != pins[n][1])
    if not missing and not extra and not changed:
        return None
    what = "; ".join(_names(label, names) for label, names in
                     (("missing", missing), ("changed since", changed), ("not in it", extra)) if names)
    fix = f"delete the changed and unrecorded bucket files, then {FIX}" if changed or extra else FIX
    return f"{folder}: the buckets do not match {REPORT} ({len(pins)} recorded, {len(present)} present: {what}); {fix}"


def _names(label: str, names: list[str]) -> str:
    return f"{label} {names[:3]}{' ...' if len(names) > 3 else ''}"


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
