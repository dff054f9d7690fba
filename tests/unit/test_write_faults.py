"""A full disk, or no inode left, while the run writes: one line naming the file and the cause, and
what is kept said truly (train/checkpoint_io.py, train/loggers.py).

torch's zip writer reports a short write as ``RuntimeError: [enforce fail at inline_container.cc:...] .
unexpected pos N vs M``, without an errno: on a real full filesystem when the test runs as root (a tmpfs
of 256 KiB), else from a torch.save that raises what torch raised there."""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest
import torch

from data.files import WriteError
from train import loggers
from train.checkpoint_io import AtomicCheckpointIO


@pytest.fixture(params=["tmpfs", "simulated"])
def full_disk(request, tmp_path, monkeypatch) -> tuple[Path, bool]:
    """(a folder on a filesystem that fills up at a checkpoint of 1M floats, whether every save fails)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if request.param == "tmpfs":
        # the suite runs as root (the Slurm fixture needs it too): a real full filesystem, never skipped
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                                 capture_output=True, text=True)
        assert mounted.returncode == 0, f"mounting a 256 KiB tmpfs (needs root): {mounted.stderr}"
        yield mount, False
        subprocess.run(["umount", str(mount)], check=True)
        return
    real_save = torch.save

    def save(obj, f, *a, **kw):
        real_save({"head": torch.zeros(8)}, f)  # some bytes reach the file, then the writer stops
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", save)
    yield mount, True


def _save(path: Path, step: int, size: int) -> None:
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(size)}, "global_step": step}, path)


def test_a_full_disk_at_the_first_checkpoint_is_named_and_says_there_is_none_to_resume(full_disk):
    """Before: "... unexpected pos 704 vs 598; the previous checkpoint is intact and the partial file was
    removed; make the file and its folder writable, then resume with --ckpt_path last": a permission
    problem, and a previous checkpoint, neither of which existed."""
    path = full_disk[0] / "checkpoints" / "step0000001.ckpt"
    with pytest.raises(WriteError) as info:
        _save(path, 1, 1 << 20)
    message = str(info.value)
    assert message.startswith(f"could not write checkpoint {path}: [enforce fail at inline_container.cc:")
    assert message.endswith("(disk full or out of inodes?); this was the run's first checkpoint, so there is none "
                            "to resume; the partial file was removed; free space (or inodes), then start again "
                            "with --ckpt_path last_or_new")
    assert "writable" not in message and "\n" not in message
    assert [p.name for p in path.parent.iterdir()] == []  # nothing partial left


def test_a_full_disk_after_a_checkpoint_keeps_it_and_says_so(full_disk):
    ckpts = full_disk[0] / "checkpoints"
    if full_disk[1]:  # the simulated writer fails every save
        ckpts.mkdir()
        (ckpts / "step0000001.ckpt").write_bytes(b"an earlier checkpoint")
    else:
        _save(ckpts / "step0000001.ckpt", 1, 1000)  # fits
    before = (ckpts / "step0000001.ckpt").read_bytes()
    with pytest.raises(WriteError) as info:
        _save(ckpts / "step0000002.ckpt", 2, 1 << 20)
    assert str(info.value).endswith("(disk full or out of inodes?); the previous checkpoint is intact and the partial "
                                    "file was removed; free space (or inodes), then resume with --ckpt_path last")
    assert (ckpts / "step0000001.ckpt").read_bytes() == before
    assert not (ckpts / "step0000002.ckpt").exists()


def test_no_inode_left_for_the_launch_config_is_one_line_and_changes_nothing(tmp_path, monkeypatch):
    """Out of inodes when a resumed launch saves its config: before, a raw OSError traceback from
    train/loggers.py (``open(path, "x")``); now one line, and the run's files as they were."""
    run = tmp_path / "run"
    first = loggers.save_launch_config(run, "seed: 1\n")
    assert first.name == "config-001.yaml"
    real_open = open

    def no_inode(path, mode="r", *a, **kw):
        if "x" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(loggers, "open", no_inode, raising=False)
    with pytest.raises(WriteError) as info:
        loggers.save_launch_config(run, "seed: 2\n")
    assert str(info.value) == (
        f"could not write {run / 'config-002.yaml'}: No space left on device (disk full or out of inodes?); nothing "
        "was trained or changed in the run directory; free space (or inodes), then launch again")
    assert sorted(p.name for p in run.iterdir()) == ["config-001.yaml", "config.yaml"]
    assert (run / "config.yaml").read_text() == "seed: 1\n"
