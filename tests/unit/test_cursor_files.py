"""Per-rank data cursor files (train/cursor_files.py): each rank writes and reads its own.

Ranks are simulated in one process: a stand-in trainer per rank over one shared "broadcast", and the
cursors of a real OrderSimulator run (2 ranks x 2 workers, 4 steps) as what each rank trained.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from data.cursor import ConsumerCursor
from data.errors import ConfigError
from data.simulate import OrderSimulator
from train.checkpoint import remove_unreferenced
from train.checkpoint_io import AtomicCheckpointIO
from train.cursor_files import (
    claim_step_dir,
    load_checkpoint_cursors,
    save_rank_cursors,
)
from train.datamodule import WellMixedData

STEP = 4


class Broadcast:
    """The strategy of every simulated rank: rank 0's broadcast value is what the others receive."""

    root_device = torch.device("cpu")

    def __init__(self):
        self.value = None

    def reduce(self, tensor, reduce_op="sum"):  # the other ranks contribute nothing that changes it
        return tensor

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
    dm = WellMixedData(cfg)
    dm.prepare()
    return dm


@pytest.fixture
def trained(make_cfg):
    """Packed cursors [rank][worker] after 4 steps of 2 ranks x 2 workers."""
    dm = _datamodule(make_cfg)
    sim = OrderSimulator(dm.context().manifest, dm.config, 2, 2)
    list(sim.batches(STEP))
    return [[c.state_dict() for c in rank] for rank in sim.consumers]


def _typed(cursors: list[dict]) -> dict[int, ConsumerCursor]:
    """What the DataModule records per worker: the cursor of its last trained batch."""
    return {w: ConsumerCursor.from_dict(c) for w, c in enumerate(cursors)}


class Collectives:
    """The strategy of simulated ranks running in threads: broadcast, barrier and all_gather meet at a
    threading.Barrier, as the real collectives meet across processes."""

    root_device = torch.device("cpu")

    def __init__(self, world: int):
        self.meet, self.slots = threading.Barrier(world), [None] * world

    def rank(self, rank: int) -> SimpleNamespace:
        def exchange(obj):
            self.slots[rank] = obj
            self.meet.wait()
            out = list(self.slots)
            self.meet.wait()
            return out

        return SimpleNamespace(root_device=self.root_device, broadcast=lambda obj, src=0: exchange(obj)[src],
                               barrier=lambda name=None: exchange(None) and None,
                               all_gather=lambda t: torch.stack(exchange(t)))


def _save(make_cfg, trained, ckpt_dir: Path, world: int = 2) -> dict:
    """Every simulated rank's state_dict (each writes its file, one thread per rank); rank 0's state into a
    checkpoint file."""
    collectives, states = Collectives(world), [None] * world
    dms = []
    for rank in range(world):
        dm = _datamodule(make_cfg)
        dm.trainer = _trainer(rank, world, ckpt_dir, collectives.rank(rank))
        dm._trained = _typed(trained[rank])
        dms.append(dm)

    def save(rank):
        states[rank] = dms[rank].state_dict()

    threads = [threading.Thread(target=save, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(s is not None for s in states)
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
    size = {n: len(pickle.dumps({k: v for k, v in s.items() if k != "data_settings"}))
            for n, s in (("one", one), ("two", two))}
    assert size["one"] < 2_000 and size["two"] - size["one"] < 100  # a digest per rank (the data settings: once)
    bigger = [[{**c, "fingerprint": c["fingerprint"] + " " * 100_000} for c in rank] for rank in trained]  # +100 KB
    big = _save(make_cfg, bigger, tmp_path / "big", world=2)
    assert len(pickle.dumps(big)) == len(pickle.dumps(two))  # the cursors' size stays in their files


def test_same_layout_resume_reads_only_its_own_file_elastic_reads_all(make_cfg, trained, tmp_path, monkeypatch):
    state = _save(make_cfg, trained, tmp_path)
    ckpt = tmp_path / f"step{STEP:07d}.ckpt"
    read = []
    real_read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda path: read.append(path.name) or real_read(path))

    dm = _datamodule(make_cfg)
    dm.trainer = _trainer(1, 2, tmp_path, Broadcast(), ckpt_path=str(ckpt))
    dm.load_state_dict(state)
    assert read == []  # read when the DataLoader is built (load_from_checkpoint reads no cursor file)
    assert [c.to_dict() for c in dm._resumed_cursors()] == trained[1] and dm._resume.next_step == STEP
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
    assert [c.to_dict() for c in dm._resumed_cursors()] == trained[1]  # rank 1 needs only its own file
    dm.trainer.global_rank, dm.trainer.is_global_zero = 0, True
    dm.load_state_dict(state)
    with pytest.raises(ConfigError, match=rf"data cursor file {step_dir / 'rank00000.pt'} \(rank 0 of checkpoint "
                                          rf"{ckpt}\) is missing .*--ckpt_path FILE"):
        dm.train_dataloader()
    (step_dir / "rank00001.pt").rename(step_dir / "rank00000.pt")  # the wrong rank's file in its place
    with pytest.raises(ConfigError, match=r"rank00000.pt \(rank 0 of .*\) does not match the sha256 its checkpoint "
                                          r"records .*--ckpt_path FILE"):
        load_checkpoint_cursors(ckpt, state, ranks=[0])
    old = {k: v for k, v in state.items() if k != "cursor_sha256"}  # a checkpoint written before digests
    with pytest.raises(ConfigError, match=r"rank00000.pt \(rank 0 of .*\) does not belong to it \(rank, next step "
                                          r"\(1, 4\), expected \(0, 4\)\)"):
        load_checkpoint_cursors(ckpt, old, ranks=[0])
    with pytest.raises(ConfigError, match="names per-rank cursor files .* Trainer.fit"):
        load_checkpoint_cursors(None, state)


def test_without_a_checkpoint_dir_one_rank_keeps_its_cursors_inline(make_cfg, trained):
    """Library use (no trainer, or one without a ModelCheckpoint): the state holds the cursors as before."""
    dm = _datamodule(make_cfg)
    dm._trained = _typed(trained[0])
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


def _rewrite(path: Path, change) -> None:
    """Load a rank file, change its first worker's cursor, save it back (what an edit or a bad disk does)."""
    data = torch.load(path, weights_only=True)
    change(data["cursors"][0])
    torch.save(data, path)


def _edit_buffer_address(cursor: dict) -> None:
    from data.cursor import buffer_addrs, pack_ints

    addrs = buffer_addrs(cursor["sources"]["web"]["buffer"])
    addrs[0, 1] = (addrs[0, 1] + 1) % 8  # another row of the same shard: in range, so range checks pass
    cursor["sources"]["web"]["buffer"] = pack_ints(addrs)


def _flip_rng_bit(cursor: dict) -> None:
    cursor["sources"]["web"]["rng"]["state"]["state"] ^= 1 << 17


def _flip_packed_buffer(cursor: dict) -> None:
    buf = cursor["sources"]["web"]["buffer"]
    cursor["sources"]["web"]["buffer"] = buf[:20] + ("A" if buf[20] != "A" else "B") + buf[21:]


@pytest.mark.parametrize("change", [_edit_buffer_address, _flip_rng_bit, _flip_packed_buffer])
def test_a_changed_cursor_file_is_refused_naming_it_and_the_way_out(make_cfg, trained, tmp_path, change):
    """Each of these passed (an edited address, a flipped RNG bit: a silently different order) or crashed
    (the packed buffer: a zlib.error traceback) before the checkpoint recorded each file's sha256."""
    state = _save(make_cfg, trained, tmp_path)
    ckpt = tmp_path / f"step{STEP:07d}.ckpt"
    path = tmp_path / state["cursor_dir"] / "rank00001.pt"
    _rewrite(path, change)
    for ranks in ([1], None):  # same-layout resume (its own file), elastic resume (every file)
        with pytest.raises(ConfigError, match=rf"^data cursor file {path} \(rank 1 of checkpoint {ckpt}\) does not "
                                              r"match the sha256 its checkpoint records .*--ckpt_path FILE.*"
                                              r"--run.ckpt_fallback true\)$"):
            load_checkpoint_cursors(ckpt, state, ranks)
    from train.checkpoint import checkpoint_problem, resolve_checkpoint  # resume's check, and the fallback's

    assert "does not match the sha256" in checkpoint_problem(ckpt)
    with pytest.raises(ConfigError) as info:  # before: both ways out, "--ckpt_path FILE" twice
        resolve_checkpoint(str(ckpt), tmp_path, fallback=False)
    assert str(info.value).startswith(f"--ckpt_path {ckpt}: data cursor file {path} (rank 1 of checkpoint {ckpt}) "
                                      "does not match the sha256 its checkpoint records")
    assert str(info.value).count("--ckpt_path FILE") == 1 and str(info.value).count(";") == 1, str(info.value)
    assert state["cursor_sha256"][0] == hashlib.sha256((tmp_path / state["cursor_dir"] / "rank00000.pt")
                                                       .read_bytes()).hexdigest()


def test_a_checkpoint_without_digests_loads_its_cursors_with_a_warning_naming_the_file(make_cfg, trained, tmp_path,
                                                                                       caplog):
    state = _save(make_cfg, trained, tmp_path)
    ckpt = tmp_path / f"step{STEP:07d}.ckpt"
    old = {k: v for k, v in state.items() if k != "cursor_sha256"}
    assert load_checkpoint_cursors(ckpt, old) == trained
    path = tmp_path / state["cursor_dir"] / "rank00000.pt"
    assert f"data cursor file {path} (rank 0 of checkpoint {ckpt}) is not verified" in caplog.text
    # unverified, a flipped packed buffer is still one line from the range check, not a zlib.error traceback
    _rewrite(path, _flip_packed_buffer)
    with pytest.raises(ConfigError, match=r"malformed \(error: Error -3 while decompressing"):
        ConsumerCursor.from_dict(load_checkpoint_cursors(ckpt, old, [0])[0][0])
