"""The data cursor's dataclasses (data/cursor.py): the serialised form round-trips to the same dict and
bytes (a re-saved cursor file keeps its sha256), and a batch's cursor survives the trip to the device.

Damaged fields refused by ``ConsumerCursor.from_dict`` are tested with the other damaged-cursor cases
(tests/unit/test_fault_checks.py ``CURSOR_ATTACKS``).
"""

from __future__ import annotations

import hashlib
import io
import json

import pytest
import torch

from data.cursor import ConsumerCursor, read_order_state
from data.elastic import redistribute
from data.errors import ConfigError
from data.manifest import build_manifest
from data.simulate import OrderSimulator


def _saved_bytes(obj) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return hashlib.sha256(buf.getvalue()).hexdigest()


@pytest.fixture
def cursors(make_cfg):
    """Serialised cursors with every optional part: handed-back documents (``commit: sequence``), rows in
    the middle of documents (``commit: document``), and elastic leftovers pending (2 x 2 -> 1 x 1)."""
    out = {}
    for commit in ("sequence", "document"):
        cfg = make_cfg(commit=commit, seq_len=64, buffer_size=16, batch_size=2)
        sim = OrderSimulator(build_manifest(cfg), cfg, 2, 2)
        list(sim.batches(6))
        out[commit] = [c.state_dict() for rank in sim.consumers for c in rank]
    state = sim.state_dict()
    recut = redistribute(state["consumers"], sim.manifest, seed=cfg.seed, world_size=1, num_workers=1,
                         batch_size=1, resume_step=state["step"])
    out["elastic"] = [recut[0][0].to_dict()]
    return out


def test_a_cursor_round_trips_to_the_identical_dict_and_bytes(cursors):
    assert any("continuations" in c for c in cursors["sequence"])
    assert any(r is not None for c in cursors["document"] for r in c["rows"])
    assert "pending" in cursors["elastic"][0]
    for kind, saved in cursors.items():
        for d in saved:
            again = ConsumerCursor.from_dict(d).to_dict()
            assert again == d and list(again) == list(d), kind
            assert [type(v) for v in again.values()] == [type(v) for v in d.values()], kind
            assert _saved_bytes(again) == _saved_bytes(d), kind  # what a cursor file's sha256 is taken over
            assert ConsumerCursor.from_dict(json.loads(json.dumps(d))).to_dict() == d  # a dump_order cursor file


def test_a_cursor_of_another_version_is_refused_naming_what_to_do(cursors):
    d = {**cursors["sequence"][0], "version": 1}
    with pytest.raises(ConfigError, match=r"^data cursor version 1 is not 2: .* start the data order afresh$"):
        ConsumerCursor.from_dict(d)
    with pytest.raises(ConfigError, match=r"data cursor version None is not 2"):
        ConsumerCursor.from_dict([1, 2])
    assert not ConsumerCursor.is_current(d) and ConsumerCursor.is_current(cursors["sequence"][0])


def test_an_order_state_reads_into_typed_cursors(cursors):
    rows = [cursors["sequence"][:2], cursors["sequence"][2:]]
    typed = read_order_state({"step": 6, "consumers": rows, "world_size": 2, "num_workers": 2})
    assert [[c.to_dict() for c in row] for row in typed] == rows
    assert [c.consumer for row in typed for c in row] == [0, 1, 2, 3]


def test_a_cursor_of_another_batch_size_is_refused_not_packed_silently(make_cfg):
    """Before: the rows came from the cursor, so a resume with another data.batch_size packed the old one."""
    cfg = make_cfg(seq_len=64, buffer_size=16)
    m = build_manifest(cfg)
    sim = OrderSimulator(m, cfg, 1, 1)
    list(sim.batches(2))
    state = sim.state_dict()
    other = make_cfg(seq_len=64, buffer_size=16, batch_size=3)
    with pytest.raises(ConfigError, match=r"data cursor holds 4 batch rows, but data.batch_size is 3"):
        OrderSimulator(m, other, 1, 1).load_state_dict(state)


def test_a_batch_cursor_stays_on_the_host_when_lightning_moves_the_batch(make_cfg):
    """Before: the DataLoader turned the cursor's buffers into tensors and Lightning moved them to the
    device with the batch, so packing it for a checkpoint failed on an accelerator ("can't convert cuda:0
    device type tensor to numpy"). The meta device stands in for one."""
    from lightning.fabric.utilities.apply_func import move_data_to_device
    from torch.utils.data import DataLoader

    from data.steps import StepSchedule
    from train.datamodule import ConsumerDataset

    cfg = make_cfg(seq_len=64, buffer_size=16, num_workers=1)
    m = build_manifest(cfg)
    ds = ConsumerDataset(m, cfg, 0, 1, StepSchedule.from_config(cfg), None, 0)
    batch = next(iter(DataLoader(ds, batch_size=None, num_workers=0)))
    moved = move_data_to_device(batch, torch.device("meta"))
    assert moved["input_ids"].device.type == "meta" and moved["cursor"] is batch["cursor"]
    sim = OrderSimulator(m, cfg, 1, 1)
    list(sim.batches(1))
    assert moved["cursor"].to_dict() == sim.consumers[0][0].state_dict()
