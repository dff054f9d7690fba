"""ablations/cleanup.py: a finished run keeps what the report reads (last.ckpt, its cursors, the logs)
and loses its intermediate step checkpoints; an unfinished run is left whole. On hard-linked copies of
the session's reference run (tests/conftest.py ``ref_single``: 16 steps, a checkpoint every 3)."""

from __future__ import annotations

import os
import shutil

import pytest

from ablations.cleanup import prune_finished_run
from ablations.outcomes import final_mixer_state, is_complete
from train.checkpoint import checkpoint_problem

SOURCES = ["web", "code", "books", "curated"]


def disk_usage(path) -> int:
    """Bytes of the files under ``path`` (each hard-linked file once)."""
    seen, total = set(), 0
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def linked_copy(src, dst):
    shutil.copytree(src, dst, copy_function=os.link)  # removing a name in the copy leaves the original
    return dst


@pytest.mark.slow
def test_a_finished_run_keeps_only_what_the_report_reads(ref_single, tmp_path):
    ref_dir, _ = ref_single
    run = linked_copy(ref_dir, tmp_path / "run")
    before, state = disk_usage(run), final_mixer_state(run, SOURCES)
    steps = sorted(p.name for p in (run / "checkpoints").glob("step*.ckpt"))
    assert is_complete(run) and len(steps) >= 3
    removed = prune_finished_run(run)
    assert sorted(p.name for p in removed if p.suffix == ".ckpt") == steps
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert left == ["cursors", "last.ckpt", "last.ckpt.sha256"]
    assert len(list((run / "checkpoints" / "cursors").iterdir())) == 1
    assert checkpoint_problem(run / "checkpoints" / "last.ckpt") is None  # still resumes, exports, reports
    assert final_mixer_state(run, SOURCES) == state and (run / "csv" / "metrics.csv").is_file()
    assert disk_usage(run) < before / 2
    assert prune_finished_run(run) == []  # twice: nothing more to remove
    assert sorted(p.name for p in (ref_dir / "checkpoints").glob("step*.ckpt")) == steps  # the original is whole


@pytest.mark.slow
def test_an_unfinished_run_is_left_whole(ref_single, tmp_path):
    ref_dir, _ = ref_single
    run = linked_copy(ref_dir, tmp_path / "run")
    log = run / "order_log" / "rank0.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.unlink()  # a new file, not the original's linked one
    log.write_text("".join(lines[:-4]))
    assert not is_complete(run)
    assert prune_finished_run(run) == [] and len(list((run / "checkpoints").glob("step*.ckpt"))) >= 3
