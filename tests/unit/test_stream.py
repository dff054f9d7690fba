"""The two-level stream on the real demo corpus: determinism, disjoint slices, coverage, packing, cursor."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from training_runs import owed_docs

from data.manifest import build_manifest
from data.order import chunk_permutation
from data.packer import ConsumerStream
from data.reader import ShardReader
from data.simulate import OrderSimulator
from data.stream import SourceStream
from data.tokenizer import TokenizerConfig, cl100k_encoding

EOT_ID = TokenizerConfig().build().eot_id


def dump(manifest, cfg, steps, world_size=2, workers=2):
    return [json.dumps(line) for line in OrderSimulator(manifest, cfg, world_size, workers).order_lines(steps)]


def test_same_seed_same_order_other_seed_other_order(make_cfg):
    cfg = make_cfg()
    m = build_manifest(cfg)
    a, b = dump(m, cfg, 8), dump(m, cfg, 8)
    assert a == b
    c = dump(m, make_cfg(seed=99), 8)
    assert c != a


def test_each_epoch_has_its_own_permutation(make_cfg):
    m = build_manifest(make_cfg())
    n = len(m.sources["web"].chunks)
    perms = [chunk_permutation(1234, "web", e, n) for e in range(3)]
    for p in perms:
        assert sorted(p) == list(range(n))  # a permutation
    assert not np.array_equal(perms[0], perms[1]) and not np.array_equal(perms[1], perms[2])
    # the rank never enters the global order: the same call always gives the same permutation
    assert np.array_equal(perms[0], chunk_permutation(1234, "web", 0, n))


def _all_docs(m, source):
    """(shard, row) of every document of a source, from the manifest alone (no filter in these tests)."""
    return {(c.shard, r) for c in m.sources[source].chunks for r in range(c.start, c.stop)}


@pytest.mark.parametrize("min_chunks", [64, 1])  # 1: curated has fewer chunks than the 16 consumers
@pytest.mark.parametrize("source", ["curated", "books"])
def test_consumers_disjoint_and_cover_each_epoch(make_cfg, source, min_chunks):
    """R x W = 4 x 4 consumers: at every cut, what was emitted plus what is still owed is every
    document of epoch 0 exactly once; once all consumers are past epoch 0, all of it was emitted."""
    cfg = make_cfg(buffer_size=4, open_shards=2, min_chunks_per_source=min_chunks)
    m = build_manifest(cfg)
    if min_chunks == 1:
        assert len(m.sources[source].chunks) < 16
    reader = ShardReader(m, cfg)
    idx = m.source_names.index(source)
    C = 16
    streams = [SourceStream(idx, source, m.sources[source].chunks, reader, cfg, c, C) for c in range(C)]
    everything = _all_docs(m, source)
    emitted: Counter = Counter()
    for round_ in range(25):
        for s in streams:
            for _ in range(4):
                d = s.next_doc()
                if d.epoch == 0:
                    emitted[(d.shard, d.row)] += 1
        if round_ % 8 == 0:
            owed = Counter(a for s in streams for a in owed_docs(s, 0))
            assert not (set(owed) & set(emitted)), "a document was both emitted and still owed"
            total = emitted + owed
            assert set(total) == everything and max(total.values()) == 1
    # drain every consumer past epoch 0: the whole epoch was emitted, each document exactly once
    for s in streams:
        for _ in range(5000):
            if not owed_docs(s, 0):
                break
            d = s.next_doc()
            if d.epoch == 0:
                emitted[(d.shard, d.row)] += 1
        assert owed_docs(s, 0) == []
    assert set(emitted) == everything and max(emitted.values()) == 1


def test_packing_invariants(make_cfg):
    """Rows are exactly seq_len; targets are inputs shifted by one; pieces tile the inputs; the
    tokens are the documents' tokens with EOT after each; source ids follow the documents."""
    cfg = make_cfg(seq_len=96, batch_size=3)
    m = build_manifest(cfg)
    c = ConsumerStream(m, cfg, 0, 1, 0, 1, lambda s: np.array([0.62, 0.18, 0.12, 0.08]), lambda s: 96)
    reader = ShardReader(m, cfg)
    stems = {s.stem: i for i, s in enumerate(m.shards)}
    source_of_shard = {sh: i for i, info in enumerate(m.sources.values()) for sh in info.shards}
    for _ in range(6):
        b = c.next_batch()
        assert b["input_ids"].shape == (3, 96) and b["targets"].shape == (3, 96)
        assert sum(p[2] for p in b["pieces"]) == 3 * 96 == b["source_tokens"].sum()
        flat = b["input_ids"].reshape(-1)
        pos = 0
        for doc_id, off, n in b["pieces"]:
            stem, row = doc_id.rsplit(":", 1)
            shard = stems[stem]
            src = source_of_shard[shard]
            (toks,) = reader.read_docs(src, [(shard, int(row))])
            assert toks[-1] == EOT_ID
            np.testing.assert_array_equal(flat[pos:pos + n], toks[off:off + n])
            pos += n
        # targets: the next token of the same row's stream
        np.testing.assert_array_equal(b["targets"][:, :-1], b["input_ids"][:, 1:])
        assert set(np.unique(b["target_source"])) <= {0, 1, 2, 3}
    # the last target of a row is the first input of the piece that continues its document (nothing
    # lost): the same row of the next batch with `commit: document`, wherever the document is next
    # placed with bounded commitment (`commit: sequence`, the default)
    prev = c.next_batch()
    later = [c.next_batch() for _ in range(40)]
    first_input = {(p[0], p[1]): tok for b in later for p, tok in zip(b["pieces"], _piece_starts(b))}
    for row, (doc_id, off, n) in enumerate(_row_last_pieces(prev)):
        assert first_input[(doc_id, off + n)] == prev["targets"][row, -1]
    cfg = make_cfg(seq_len=96, batch_size=3, commit="document")
    c = ConsumerStream(m, cfg, 0, 1, 0, 1, lambda s: np.array([0.62, 0.18, 0.12, 0.08]), lambda s: 96)
    prev = c.next_batch()
    nxt = c.next_batch()
    np.testing.assert_array_equal(prev["targets"][:, -1], nxt["input_ids"][:, 0])


def _piece_starts(batch: dict) -> list[int]:
    """The first input token of each piece of a batch."""
    flat = batch["input_ids"].reshape(-1)
    return [int(flat[pos]) for pos in np.cumsum([0] + [p[2] for p in batch["pieces"]])[:-1]]


def _row_last_pieces(batch: dict) -> list[list]:
    """The piece each row of a batch ends with."""
    L = batch["input_ids"].shape[1]
    ends = np.cumsum([p[2] for p in batch["pieces"]])
    return [batch["pieces"][int(np.searchsorted(ends, (r + 1) * L))] for r in range(batch["input_ids"].shape[0])]


def test_doc_index_marks_boundaries(make_cfg):
    cfg = make_cfg(seq_len=256, batch_size=2)
    m = build_manifest(cfg)
    c = ConsumerStream(m, cfg, 0, 1, 0, 1, lambda s: np.array([0.25] * 4), lambda s: 256)
    b = c.next_batch()
    ids, di = b["input_ids"], b["doc_index"]
    for row in range(2):
        # a new document starts right after every EOT
        eots = np.nonzero(ids[row, :-1] == EOT_ID)[0]
        for e in eots:
            assert di[row, e + 1] == di[row, e] + 1
        assert np.all(np.diff(di[row]) >= 0)


def test_long_run_token_shares_follow_weights(make_cfg):
    """Deficit mixing is token-exact up to the documents in flight in the batch rows (the demo's
    code and books documents average 3-5k tokens, so the run must be long next to them)."""
    cfg = make_cfg(seq_len=128, batch_size=8)
    m = build_manifest(cfg)
    sim = OrderSimulator(m, cfg, 1, 1)
    totals = np.zeros(4)
    for _, _, b in sim.batches(300):
        totals += b["source_tokens"]
    shares = totals / totals.sum()
    np.testing.assert_allclose(shares, [0.62, 0.18, 0.12, 0.08], atol=0.01)
    # the mixer's own bound: committed tokens stay within one longest document of w_s * total
    import pyarrow.parquet as pq

    longest = max(max(pq.read_table(sh.path, columns=["token_count"]).column(0).to_pylist()) for sh in m.shards) + 1
    mixer = sim.consumers[0][0].mixer
    w = np.array([0.62, 0.18, 0.12, 0.08])
    assert np.all(np.abs(mixer.committed - w * mixer.committed.sum()) <= longest)


def _roundtrip(m, cfg, R, W, cut, steps):
    full = [json.dumps(x) for x in OrderSimulator(m, cfg, R, W).order_lines(steps)]
    first = OrderSimulator(m, cfg, R, W)
    head = [json.dumps(x) for x in first.order_lines(cut + 1)]
    state = json.loads(json.dumps(first.state_dict()))  # what a cursor file holds
    second = OrderSimulator(m, cfg, R, W)
    second.load_state_dict(state)
    tail = [json.dumps(x) for x in second.order_lines(steps)]
    return full, head + tail


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 14), R=st.sampled_from([1, 2]), W=st.sampled_from([1, 2, 3]),
       selector=st.sampled_from(["deficit", "random"]))
def test_cursor_roundtrip_equals_uninterrupted(make_cfg, cut, R, W, selector):
    cfg = make_cfg(selector=selector, buffer_size=32)
    m = build_manifest(cfg)
    full, resumed = _roundtrip(m, cfg, R, W, cut, 18)
    assert resumed == full


def test_cursor_roundtrip_across_source_epoch(make_cfg):
    """A tiny buffer and many steps: the curated source wraps into later epochs before and after the cut."""
    cfg = make_cfg(buffer_size=4, open_shards=1, seq_len=256, batch_size=8, min_chunks_per_source=8,
                   weights={"web": 0.1, "code": 0.1, "books": 0.1, "curated": 0.7})
    m = build_manifest(cfg)
    sim = OrderSimulator(m, cfg, 1, 1)
    list(sim.batches(60))
    curated = sim.consumers[0][0].sources[3]
    assert curated.taken > len(curated.chunks), "the test must cross an epoch boundary of curated"
    full, resumed = _roundtrip(m, cfg, 1, 1, 30, 60)  # 30: before the wrap, which comes near step 40
    assert resumed == full


def test_cursor_is_small_and_plain(make_cfg):
    """Addresses and integers only: under 10 bytes per buffered document, so the default 4 sources x
    10,000-document buffers make a cursor of a few hundred KB."""
    cfg = make_cfg(buffer_size=300)
    m = build_manifest(cfg)
    sim = OrderSimulator(m, cfg, 1, 1)
    list(sim.batches(12))
    state = sim.consumers[0][0].state_dict()
    text = json.dumps(state)  # JSON-serialisable
    buffered = sum(len(s.buffer) for s in sim.consumers[0][0].sources)
    # a source with fewer documents than the buffer (books 21, code 63) holds at most one epoch
    assert buffered <= sum(min(300, info.docs) for info in m.sources.values())
    assert len(sim.consumers[0][0].sources[0].buffer) == 300
    assert len(text) < 2_000 + 10 * buffered


def test_cursor_refuses_other_corpus_or_seed(make_cfg):
    from data.errors import ConfigError

    cfg = make_cfg()
    m = build_manifest(cfg)
    sim = OrderSimulator(m, cfg, 1, 1)
    list(sim.batches(2))
    state = sim.state_dict()
    other = OrderSimulator(m, make_cfg(seed=5), 1, 1)
    with pytest.raises(ConfigError, match="seed"):
        other.load_state_dict(state)
    bad = json.loads(json.dumps(state))
    bad["consumers"][0][0]["fingerprint"] = "0" * 16
    with pytest.raises(ConfigError, match="another corpus"):
        OrderSimulator(m, cfg, 1, 1).load_state_dict(bad)
    with pytest.raises(ConfigError, match="world-size"):
        OrderSimulator(m, cfg, 2, 1).load_state_dict(state)


def test_tokens_decode_to_document_text(make_cfg):
    import pyarrow.parquet as pq

    cfg = make_cfg()
    m = build_manifest(cfg)
    reader = ShardReader(m, cfg)
    shard = m.sources["code"].shards[0]
    (toks,) = reader.read_docs(1, [(shard, 3)])
    text = pq.read_table(m.shards[shard].path, columns=["text"]).column("text")[3].as_py()
    assert cl100k_encoding().decode(toks[:-1].tolist()) == text
    n = pq.read_table(m.shards[shard].path, columns=["token_count"]).column("token_count")[3].as_py()
    assert len(toks) == n + 1  # token_count is the true cl100k count; +1 for EOT
