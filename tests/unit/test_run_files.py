"""The files a run writes into its run directory while it trains: never through a symbolic link, order logs
that a crash cut short, and metrics.csv across resumes (train/rundir.py, train/lightning_internals.py,
train/callbacks.py, train/loggers.py, train/rundir_lock.py, train/cursor_files.py)."""

from __future__ import annotations

import csv
import errno
import json
import logging
import os
from pathlib import Path

import pytest

from data import files
from data.errors import ConfigError
from train.rundir import RunDir, one_row_per_step, read_jsonl, read_metrics, read_order_log

PRECIOUS = b"a checkpoint that took a day" * 100


def _planted_link(at: Path, tmp_path: Path) -> Path:
    """A symbolic link at ``at`` to a file whose bytes must survive."""
    target = tmp_path / "precious.ckpt"
    target.write_bytes(PRECIOUS)
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(target)
    return target


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    """Before: the lock was opened without O_NOFOLLOW and truncated the file it pointed to (a 39 MB checkpoint
    became 42 bytes)."""
    from train.rundir_lock import LOCK_NAME, acquire_run_dir

    run_dir = tmp_path / "run"
    target = _planted_link(run_dir / LOCK_NAME, tmp_path)
    with pytest.raises(ConfigError, match=rf"^run.dir: the lock file {run_dir / LOCK_NAME} is a symbolic link "
                                          rf"\(to {target}\); .*remove the link"):
        acquire_run_dir(run_dir)
    assert target.read_bytes() == PRECIOUS


def test_a_lock_file_with_another_name_is_refused_and_that_file_untouched(tmp_path):
    from train.rundir_lock import LOCK_NAME, acquire_run_dir

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    target = tmp_path / "precious.ckpt"
    target.write_bytes(PRECIOUS)
    os.link(target, run_dir / LOCK_NAME)
    with pytest.raises(ConfigError, match=r"^run.dir: the lock file .* has another name \(a hard link\)"):
        acquire_run_dir(run_dir)
    assert target.read_bytes() == PRECIOUS


def test_every_file_a_run_writes_refuses_a_symlink_at_its_name(tmp_path):
    from train.cursor_files import claim_step_dir
    from train.lightning_internals import ResumableCSVLogger
    from train.loggers import save_launch_config, wandb_run_id

    paths = RunDir(tmp_path / "run")
    cases = {
        paths.wandb / "run_id": lambda: wandb_run_id(paths.root),
        paths.config: lambda: save_launch_config(paths.root, "fit: {}\n"),
        paths.metrics_csv: lambda: ResumableCSVLogger(save_dir=str(paths.root), name="csv", version="").experiment,
        paths.order_log(0): lambda: files.open_append(paths.order_log(0)),
        paths.checkpoints / "cursors": lambda: claim_step_dir(paths.checkpoints, 3),
    }
    for at, write in cases.items():
        target = _planted_link(at, tmp_path)
        with pytest.raises(ConfigError, match=rf"{at} is a symbolic link \(to {target}\)"):
            write()
        assert target.read_bytes() == PRECIOUS, at
        at.unlink()


def test_an_atomic_write_never_writes_through_a_link_at_its_temp_name(tmp_path):
    dest = tmp_path / "config.yaml"
    target = _planted_link(files.temp_path(dest), tmp_path)
    files.write_text(dest, "x: 1\n")
    assert dest.read_text() == "x: 1\n" and target.read_bytes() == PRECIOUS


def _order_lines(path: Path, steps: range) -> list[str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": s, "rank": 0, "loss": 1.0 / (s + 1)}, separators=(",", ":")) for s in steps]
    path.write_text("".join(ln + "\n" for ln in lines))
    return lines


def test_an_order_log_cut_mid_line_drops_the_torn_line_with_a_warning(tmp_path, caplog):
    """Before: a JSONDecodeError on every resume and in diagnose_run.py until the file was fixed by hand."""
    path = RunDir(tmp_path).order_log(0)
    lines = _order_lines(path, range(4))
    with open(path, "a") as f:
        f.write(lines[0][:9])  # the crash came while appending step 4
    with caplog.at_level(logging.WARNING):
        assert [d["step"] for d in read_order_log(tmp_path)] == [0, 1, 2, 3]
    assert f"{path}: line 5 is cut short (9 characters" in caplog.text

    from train.callbacks import _drop_lines_from  # what a resume does to the file before appending

    _drop_lines_from(path, 3)
    assert path.read_text() == "".join(ln + "\n" for ln in lines[:3])


def test_a_bad_line_in_the_middle_of_an_order_log_is_an_error_naming_it(tmp_path):
    path = RunDir(tmp_path).order_log(0)
    lines = _order_lines(path, range(4))
    path.write_text("".join(ln + "\n" for ln in lines[:2] + [lines[2][:7]] + lines[3:]))
    with pytest.raises(ConfigError, match=rf"^{path} line 3 is not a JSON line .*damaged"):
        read_jsonl(path)


def test_nan_losses_stay_nan_in_the_order_log(tmp_path):
    path = tmp_path / "rank0.jsonl"
    path.write_text(json.dumps({"step": 0, "rank": 0, "loss": float("nan")}) + "\n")
    (line,) = read_jsonl(path)
    assert line["loss"] != line["loss"]


def _rows(*steps_and_keys) -> list[dict[str, str]]:
    keys = ["step", "train/loss", "val/loss"]
    return [{k: v for k, v in zip(keys, row)} for row in steps_and_keys]


def test_metrics_read_as_one_row_per_step_after_a_resume():
    """Before: after a resume the replayed steps were in metrics.csv twice (50-62 in the issue's run)."""
    rows = _rows(("0", "", "6.0"), ("0", "5.0", ""), ("1", "4.0", ""), ("2", "3.0", ""), ("2", "", "2.9"),
                 ("3", "2.0", ""),  # killed after step 3; the checkpoint was at step 2
                 ("2", "3.0", ""), ("3", "2.5", ""), ("4", "2.0", ""))
    got = one_row_per_step(rows)
    assert [(r["step"], r["train/loss"], r["val/loss"]) for r in got] == [
        ("0", "5.0", "6.0"), ("1", "4.0", ""), ("2", "3.0", ""), ("3", "2.5", ""), ("4", "2.0", "")]


def test_the_csv_logger_cuts_the_rows_of_replayed_steps_when_training_resumes(tmp_path):
    from train.lightning_internals import ResumableCSVLogger

    def logger():
        return ResumableCSVLogger(save_dir=str(tmp_path), name="csv", version="")

    first = logger()
    for step in range(6):
        first.log_metrics({"train/loss": 10.0 - step}, step=step)
    first.save()
    resumed = logger()  # resumed from the checkpoint of step 4: steps 4 and 5 are trained again
    assert resumed.drop_steps_from(4) == 2
    for step in range(4, 7):
        resumed.log_metrics({"train/loss": 20.0 - step, "train/lr": 0.1}, step=step)  # a new column too
    resumed.save()
    with open(RunDir(tmp_path).metrics_csv) as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["train/loss"]) for r in rows] == [
        ("0", "10.0"), ("1", "9.0"), ("2", "8.0"), ("3", "7.0"), ("4", "16.0"), ("5", "15.0"), ("6", "14.0")]
    assert read_metrics(tmp_path) == rows
    assert [p.name for p in (tmp_path / "csv").iterdir() if p.name.endswith(".tmp")] == []


def _enospc(*a, **kw):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_at_the_cursor_folder_or_file_is_one_named_line(tmp_path, monkeypatch):
    """Before: a raw OSError from mkdir (no inodes left) or from the cursor file's write."""
    from train.cursor_files import claim_step_dir, save_rank_cursors

    monkeypatch.setattr(Path, "mkdir", _enospc)
    with pytest.raises(files.WriteError, match=rf"^could not write {tmp_path / 'cursors' / 'step0000003'}: No space "
                                               r"left on device \(disk full or out of inodes\?\); no checkpoint was "
                                               r"written for this step, .*--ckpt_path last$"):
        claim_step_dir(tmp_path, 3)
    monkeypatch.undo()
    step_dir = tmp_path / claim_step_dir(tmp_path, 3)
    monkeypatch.setattr(os, "replace", _enospc)
    with pytest.raises(files.WriteError, match=rf"^could not write {step_dir / 'rank00000.pt'}: No space left"):
        save_rank_cursors(step_dir, 0, [None], 3)
    assert list(step_dir.iterdir()) == []  # no temporary left behind


def test_a_full_disk_at_the_metrics_file_is_one_named_line(tmp_path, monkeypatch):
    from train.lightning_internals import ResumableCSVLogger

    logger = ResumableCSVLogger(save_dir=str(tmp_path), name="csv", version="")
    logger.log_metrics({"train/loss": 1.0}, step=0)
    logger.save()
    logger.log_metrics({"train/loss": 1.0, "train/lr": 0.1}, step=1)  # a new column: the file is rewritten
    monkeypatch.setattr(os, "replace", _enospc)
    with pytest.raises(files.WriteError, match=rf"^could not write {RunDir(tmp_path).metrics_csv}: No space"):
        logger.save()
    monkeypatch.undo()
    with open(RunDir(tmp_path).metrics_csv) as f:  # the rewrite is atomic: the file as it was
        assert list(csv.DictReader(f)) == [{"step": "0", "train/loss": "1.0"}]
