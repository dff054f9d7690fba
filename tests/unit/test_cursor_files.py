"""Per-rank data cursor files (train/cursor_files.py): each rank writes and reads its own.

Ranks are simulated in one process: a stand-in trainer per rank over one shared "broadcast", and the
cursors of a real OrderSimulator run (2 ranks x 2 workers, 4 steps) as what each rank trained.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from data.cursor import pack_cursor
from data.errors import ConfigError
from data.simulate import OrderSimulator
from train.callbacks import AtomicCheckpointIO
from train.cursor_files import (
    claim_step_dir,
    load_checkpoint_cursors,
    remove_unreferenced,
    save_rank_cursors,
)
from train.datamodule import WellMixedData

STEP = 4


class Broadcast:
    """The strategy of every simulated rank: rank 0's broadcast value is what the others receive."""

    def __init__(self):
        self.value = None

    def broadcast(self, obj, src=0):
        if obj is not None:
            self.value = obj
        return self.value

    def barrier(self, name=None):
        pass


def _trainer(rank: int, world: int, ckpt_dir: Path, strategy: Broadcast, ckpt_path=None):
    return SimpleNamespace(global_rank=rank, world_size=world, is_global_zero=rank == 0, global_step=STEP,
                           accumulate_grad_batches=1, strategy=strategy, ckpt_path=ckpt_path,
                           checkpoint_callback=SimpleNamespace(dirpath=str(ckpt_dir)))


def _datamodule(make_cfg, **kw) -> WellMixedData:
    cfg = make_cfg(**kw)
    dm = WellMixedData(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__})
    dm.prepare()
    return dm


@pytest.fixture
def trained(make_cfg):
    """Packed cursors [rank][worker] after 4 steps of 2 ranks x 2 workers."""
    dm = _datamodule(make_cfg)
    sim = OrderSimulator(dm.manifest, dm, 2, 2)
    list(sim.batches(STEP))
    return [[pack_cursor(c.state_dict()) for c in rank] for rank in sim.consumers]


def _save(make_cfg, trained, ckpt_dir: Path, world: int = 2) -> dict:
    """Every simulated rank's state_dict (each writes its file); rank 0's state into a checkpoint file."""
    strategy, states = Broadcast(), []
    for rank in range(world):
        dm = _datamodule(make_cfg)
        dm.trainer = _trainer(rank, world, ckpt_dir, strategy)
        dm._trained = dict(enumerate(trained[rank]))
        states.append(dm.state_dict())
    AtomicCheckpointIO().save_checkpoint({"state_dict": {}, "global_step": STEP, "WellMixedData": states[0]},
                                         ckpt_dir / f"step{STEP:07d}.ckpt")
    return states[0]


def test_each_rank_writes_its_own_file_and_the_checkpoint_holds_an_index(make_cfg, trained, tmp_path):
    state = _save(make_cfg, trained, tmp_path)
    assert state["cursor_dir"] == f"cursors/step{STEP:07d}" and "cursors" not in state
    assert sorted(p.name for p in (tmp_path / state["cursor_dir"]).iterdir()) == ["rank00000.pt", "rank00001.pt"]
    for rank in (0, 1):
        saved = torch.load(tmp_path / state["cursor_dir"] / f"rank{rank:05d}.pt", weights_only=True)
        assert saved == {"rank": rank, "next_step": STEP, "cursors": trained[rank]}
    ckpt = tmp_path / f"step{STEP:07d}.ckpt"
    assert load_checkpoint_cursors(ckpt, state) == trained
    assert load_checkpoint_cursors(ckpt, state, ranks=[1]) == [trained[1]]


def test_the_checkpoint_state_does_not_grow_with_the_consumers(make_cfg, trained, tmp_path):
    """Before: every rank's cursors were gathered into it ([rank][worker], ~318 KB each at the real shape)."""
    one = _save(make_cfg, trained[:1], tmp_path / "one", world=1)
    two = _save(make_cfg, trained, tmp_path / "two", world=2)
    assert len(pickle.dumps(one)) == len(pickle.dumps(two)) < 2_000
    assert sum(len(pickle.dumps(r)) for r in trained) > 10 * len(pickle.dumps(two))


def test_same_layout_resume_reads_only_its_own_file_elastic_reads_all(make_cfg, trained, tmp_path, monkeypatch):
    state = _save(make_cfg, trained, tmp_path)
    ckpt = tmp_path / f"step{STEP:07d}.ckpt"
    read = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda path, *a, **kw: read.append(Path(path).name) or real_load(path, *a, **kw))

    dm = _datamodule(make_cfg)
    dm.trainer = _trainer(1, 2, tmp_path, Broadcast(), ckpt_path=str(ckpt))
    dm.load_state_dict(state)
    assert read == []  # read when the DataLoader is built (load_from_checkpoint reads no cursor file)
    assert dm._resumed_cursors() == trained[1] and dm._resume.next_step == STEP
    assert read == ["rank00001.pt"]

    read.clear()
    elastic = _datamodule(make_cfg, num_workers=3)  # 2 x 2 -> 2 x 3: the re-cut needs every old consumer
    elastic.trainer = _trainer(1, 2, tmp_path, Broadcast(), ckpt_path=str(ckpt))
    elastic.load_state_dict(state)
    assert len(elastic._resumed_cursors()) == 3
    assert read == ["rank00000.pt", "rank00001.pt"]


def test_a_missing_or_foreign_cursor_file_is_named(make_cfg, trained, tmp_path):
    state = _save(make_cfg, trained, tmp_path)
    ckpt = tmp_path / f"step{STEP:07d}.ckpt"
    step_dir = tmp_path / state["cursor_dir"]
    (step_dir / "rank00000.pt").rename(tmp_path / "moved.pt")
    dm = _datamodule(make_cfg)
    dm.trainer = _trainer(1, 2, tmp_path, Broadcast(), ckpt_path=str(ckpt))
    dm.load_state_dict(state)
    assert dm._resumed_cursors() == trained[1]  # rank 1 needs only its own file
    dm.trainer.global_rank = 0
    dm.load_state_dict(state)
    with pytest.raises(ConfigError, match=rf"data cursor file {step_dir / 'rank00000.pt'} \(rank 0 of checkpoint "
                                          rf"{ckpt}\) is missing .*--ckpt_path FILE"):
        dm.train_dataloader()
    (step_dir / "rank00001.pt").rename(step_dir / "rank00000.pt")  # the wrong rank's file in its place
    with pytest.raises(ConfigError, match=r"rank00000.pt \(rank 0 of .*\) does not belong to it \(rank, next step "
                                          r"\(1, 4\), expected \(0, 4\)\)"):
        load_checkpoint_cursors(ckpt, state, ranks=[0])
    with pytest.raises(ConfigError, match="names per-rank cursor files .* Trainer.fit"):
        load_checkpoint_cursors(None, state)


def test_without_a_checkpoint_dir_one_rank_keeps_its_cursors_inline(make_cfg, trained):
    """Library use (no trainer, or one without a ModelCheckpoint): the state holds the cursors as before."""
    dm = _datamodule(make_cfg)
    dm._trained = dict(enumerate(trained[0]))
    state = dm.state_dict()
    assert state["cursors"] == [trained[0]] and "cursor_dir" not in state and state["world_size"] == 1
    assert load_checkpoint_cursors(None, state) == [trained[0]]
    dm.trainer = SimpleNamespace(global_rank=1, world_size=2, global_step=STEP, checkpoint_callback=None)
    with pytest.raises(ConfigError, match="ModelCheckpoint"):
        dm.state_dict()


def test_a_step_directory_is_never_written_twice(tmp_path):
    """A checkpoint of the same step written again (StopOnSignal's last.ckpt, then the step file; or a
    resume from an older checkpoint reaching the step again) gets a new folder: the files an existing
    checkpoint references are never rewritten."""
    assert [claim_step_dir(tmp_path, 9) for _ in range(3)] == ["cursors/step0000009", "cursors/step0000009-v1",
                                                              "cursors/step0000009-v2"]
    assert claim_step_dir(tmp_path, 12) == "cursors/step0000012"


def test_clean_up_keeps_what_checkpoints_reference_and_the_newest(tmp_path):
    io = AtomicCheckpointIO()

    def ckpt(name: str, cursor_dir: str | None) -> Path:
        path = tmp_path / name
        state = {"next_step": 0, "world_size": 1, "num_workers": 1, "cursor_dir": cursor_dir}
        io.save_checkpoint({"state_dict": {}, "global_step": 0, "WellMixedData": state}, path)
        return path

    dirs = {s: claim_step_dir(tmp_path, s) for s in (3, 6, 9, 12, 15)}
    for rel in dirs.values():
        save_rank_cursors(tmp_path / rel, 0, [None], 0)
    ckpt("step0000006.ckpt", dirs[6])
    ckpt("step0000009.ckpt", dirs[9])
    ckpt("last.ckpt", dirs[9])  # (a hard link of the step file in a run; the same reference)
    sharded = tmp_path / "step0000012.ckpt"  # an FSDP folder: the reference is in its meta.pt
    sharded.mkdir()
    torch.save({"global_step": 12, "WellMixedData": {"cursor_dir": dirs[12]}}, sharded / "meta.pt")
    # step 3: its checkpoint was removed (keep_last_k); step 15: unreferenced but the newest (being written)
    assert [p.name for p in remove_unreferenced(tmp_path)] == ["step0000003"]
    assert sorted(p.name for p in (tmp_path / "cursors").iterdir()) == [
        "step0000006", "step0000009", "step0000012", "step0000015"]

    (tmp_path / "step0000006.ckpt").unlink()
    (tmp_path / "step0000009.ckpt").write_bytes(b"garbage")  # its reference is unknown: nothing removed
    assert remove_unreferenced(tmp_path) == []
    (tmp_path / "step0000009.ckpt").unlink()
    cache: dict = {}
    assert [p.name for p in remove_unreferenced(tmp_path, cache)] == ["step0000006"]
    assert set(cache.values()) == {dirs[9], dirs[12]}
    assert remove_unreferenced(tmp_path / "nothing") == []
