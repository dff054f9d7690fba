"""Exactly-once per source-epoch, whatever the sizes: documents, chunks, consumers, buffer, open chunks.

Read from the order log (``OrderSimulator``: pieces ``[doc_id, offset, n_tokens]`` per step and rank;
the consumer of (step, rank) is ``rank * W + step % W``). The properties, precisely:

1. Per consumer and source, the sequence of document starts (pieces at offset 0) is the consumer's
   slice of source-epoch e0 in some order, then its slice of the next epoch that gives it chunks,
   and so on (the last one possibly unfinished). The slice of epoch e is the documents of the
   chunks at the elements g = c (mod C) in [e N, (e + 1) N) of the source's chunk sequence, and the
   slices of one epoch partition the source (tests/unit/test_stream.py), so across the job every
   document is read at most once per source-epoch, and a consumer never reads a document a second
   time before it has read every document of its slice once.
2. Per consumer and document, the pieces of one read are contiguous and in order (0..a, a..b, ...
   up to the document's length), and a read starts only after the previous one ended.
3. No micro-batch (step, rank) holds one document twice (another source always has something else
   here; data/packer.py allows a repeat only when every source offers nothing but repeats).
4. After every step, a consumer's buffer and open chunks of a source hold one source-epoch only
   (hence no two copies of a document, and an effective buffer of at most the consumer's slice of
   one epoch).

The barrier is per consumer: consumers run at their own pace, so across the job two consumers may
be in different epochs of a source at the same step (always, when consumers outnumber its chunks).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data.config import DataConfig, SourceConfig
from data.manifest import Manifest, build_manifest
from data.order import ChunkOrder
from data.reader import ShardReader
from data.schedules import fixed_schedule
from data.simulate import OrderSimulator
from data.tokenizer import TokenizerConfig

count_tokens = TokenizerConfig().build().count

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write_source(folder: Path, name: str, n_docs: int, n_files: int, row_group: int, seed: int) -> None:
    """n_docs documents of 3-90 words over n_files Dolma3-schema files."""
    rng = np.random.default_rng(seed)
    texts = [f"{name} {i} " + " ".join(rng.choice(WORDS, int(rng.integers(3, 90)))) for i in range(n_docs)]
    folder.mkdir(parents=True, exist_ok=True)
    for f, part in enumerate(np.array_split(np.arange(n_docs), n_files)):
        if len(part) == 0:
            continue
        rows = [texts[i] for i in part]
        table = pa.table({
            "source": pa.array([name] * len(rows)), "date": pa.array(["2024-01-01"] * len(rows)),
            "text": pa.array(rows), "token_count": pa.array(count_tokens(rows), pa.int64()),
            "category": pa.array([name] * len(rows)),
        })
        pq.write_table(table, folder / f"{name}-{f:02d}.parquet", row_group_size=row_group)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> Path:
    """tiny<n>/ sources of 1, 2, 5, 13 and 41 documents, and one "big" source of 600 (enough that
    every consumer's slice of one epoch has more documents than a micro-batch holds)."""
    root = tmp_path_factory.mktemp("exactly_once")
    write_source(root / "big", "big", 600, 3, 16, seed=1)
    for n in (1, 2, 5, 13, 41):
        write_source(root / f"tiny{n}", f"tiny{n}", n, 1 + (n > 4), 4, seed=n)
    return root


def make_cfg(root: Path, n_tiny: int, **kw) -> DataConfig:
    sources = {"big": SourceConfig([str(root / "big" / "*.parquet")]),
               "tiny": SourceConfig([str(root / f"tiny{n_tiny}" / "*.parquet")])}
    kw.setdefault("manifest_cache", str(root / "cache"))
    return DataConfig(sources=sources, schedule=fixed_schedule({"big": 0.6, "tiny": 0.4}, 32), **kw)


_LENGTHS: dict[str, dict[str, int]] = {}


def doc_lengths(key: str, manifest: Manifest, cfg: DataConfig) -> dict[str, int]:
    """Tokens (EOT included) of every document, by doc_id (cached per corpus: chunking does not matter)."""
    if key not in _LENGTHS:
        _LENGTHS[key] = _read_lengths(manifest, cfg)
    return _LENGTHS[key]


def _read_lengths(manifest: Manifest, cfg: DataConfig) -> dict[str, int]:
    reader = ShardReader(manifest, cfg)
    out = {}
    for i, info in enumerate(manifest.sources.values()):
        for ch in info.chunks:
            rows, toks = reader.read_chunk(i, ch)
            out.update({manifest.doc_id(ch.shard, r): len(t) for r, t in zip(rows, toks)})
    return out


def slice_docs(manifest: Manifest, seed: int, name: str, consumer: int, n_consumers: int, epoch: int) -> set[str]:
    """The documents of a consumer's slice of one source-epoch (level 1, recomputed here)."""
    chunks = manifest.sources[name].chunks
    order = ChunkOrder(seed, name, chunks)
    n = len(chunks)
    first = epoch * n + (consumer - epoch * n) % n_consumers
    docs = set()
    for g in range(first, (epoch + 1) * n, n_consumers):
        ch = order(g)[1]
        docs |= {manifest.doc_id(ch.shard, r) for r in range(ch.start, ch.stop)}
    return docs


def check_run(root: Path, n_tiny: int, world: int, workers: int, steps: int, **kw) -> None:
    cfg = make_cfg(root, n_tiny, **kw)
    m = build_manifest(cfg)
    lengths = doc_lengths(f"{root}|{n_tiny}", m, cfg)
    sim = OrderSimulator(m, cfg, world, workers)
    W, C = sim.workers, world * sim.workers
    reads = record_reads(sim, m)
    starts: dict[tuple[int, str], int] = defaultdict(int)
    open_end: dict[tuple[int, str], int] = {}
    for step, rank, batch in sim.batches(steps):
        c = rank * W + step % W
        ids = [p[0] for p in batch["pieces"]]
        assert len(set(ids)) == len(ids), f"step {step} rank {rank}: a document twice in one micro-batch"
        for doc_id, off, n in batch["pieces"]:
            end = open_end.get((c, doc_id))
            if off == 0:
                assert end in (None, lengths[doc_id]), f"{doc_id} restarted by consumer {c} before it ended"
                starts[(c, doc_id)] += 1
            else:
                assert end == off, f"{doc_id}: piece at {off} does not continue {end} (consumer {c})"
            open_end[(c, doc_id)] = off + n
        if rank == world - 1:
            check_held(sim.consumers)
    # The log's starts are the stream's reads (a read whose first token was only a row's last target
    # shows up one micro-batch later, at offset 0).
    read_count: dict[tuple[int, str], int] = defaultdict(int)
    for c, _, doc_id, _ in reads:
        read_count[(c, doc_id)] += 1
    assert all(n <= read_count[key] <= n + 1 for key, n in starts.items())
    tagged = [(name, doc_id, epoch) for _, name, doc_id, epoch in reads]
    assert len(set(tagged)) == len(tagged), "a document read twice in one source-epoch across the job"
    per_consumer: dict[tuple[int, str], list[tuple[str, int]]] = defaultdict(list)
    for c, name, doc_id, epoch in reads:
        per_consumer[(c, name)].append((doc_id, epoch))
    for (c, name), seq in per_consumer.items():
        check_epoch_segments(seq, m, cfg.seed, name, c, C)


def record_reads(sim: OrderSimulator, m: Manifest) -> list[tuple[int, str, str, int]]:
    """(consumer, source, doc_id, source-epoch) of every document the streams hand out, in order."""
    reads = []
    for rank in sim.consumers:
        for consumer in rank:
            for s in consumer.sources:
                s.next_doc = _recording(s, s.next_doc, reads, m)
    return reads


def _recording(stream, next_doc, reads: list, m: Manifest):
    def wrapped(exclude=None):
        doc = next_doc(exclude)
        if doc is not None:
            reads.append((stream.consumer, stream.name, m.doc_id(doc.shard, doc.row), doc.epoch))
        return doc
    return wrapped


def check_epoch_segments(seq: list[tuple[str, int]], m: Manifest, seed: int, name: str, c: int, C: int) -> None:
    """Property 1: a consumer's reads are whole epoch slices, one after another, each tagged with its epoch."""
    pos, epoch = 0, 0
    while pos < len(seq):
        want = slice_docs(m, seed, name, c, C, epoch)
        seg = seq[pos:pos + len(want)]
        docs = [d for d, _ in seg]
        assert {e for _, e in seg} <= {epoch}, f"consumer {c}: {name} reads of epochs {seg} in its epoch {epoch}"
        assert len(set(docs)) == len(docs), f"consumer {c} read a {name} document twice in epoch {epoch}"
        assert set(docs) <= want, f"consumer {c}: {set(docs) - want} are not in its slice of {name} epoch {epoch}"
        pos, epoch = pos + len(want), epoch + 1


def check_held(consumers: list[list]) -> None:
    """Property 4: one source-epoch per consumer's buffer and open chunks."""
    for rank in consumers:
        for consumer in rank:
            for s in consumer.sources:
                epochs = {d.epoch for d in s.buffer} | {g // len(s.chunks) for g, _, _ in s.open}
                assert len(epochs) <= 1, (s.name, consumer.consumer, epochs)
                addrs = [(d.shard, d.row) for d in s.buffer]
                assert len(set(addrs)) == len(addrs)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(n_tiny=st.sampled_from([1, 2, 5, 13, 41]), min_chunks=st.integers(1, 12), world=st.integers(1, 6),
       workers=st.integers(0, 3), buffer=st.integers(1, 48), k=st.integers(1, 6), rows=st.integers(1, 4),
       commit=st.sampled_from(["sequence", "document"]))
def test_exactly_once_per_source_epoch(corpora, n_tiny, min_chunks, world, workers, buffer, k, rows, commit):
    check_run(corpora, n_tiny, world, workers, steps=12, min_chunks_per_source=min_chunks, buffer_size=buffer,
              open_shards=k, batch_size=rows, num_workers=workers, commit=commit)


@pytest.mark.parametrize("commit", ["sequence", "document"])
def test_five_documents_read_by_64_consumers(corpora, commit):
    """The issue's case: 16 ranks x 4 workers over a 5-document source, buffers of 64."""
    check_run(corpora, 5, 16, 4, steps=12, buffer_size=64, open_shards=8, batch_size=4, num_workers=4,
              commit=commit)


@pytest.mark.parametrize("commit", ["sequence", "document"])
def test_cursor_resumes_exactly_across_tiny_epochs(corpora, commit):
    """The barrier's state is derived from the cursor (buffer epochs, open chunks): a resume in the
    middle of a drained buffer continues the same order."""
    cfg = make_cfg(corpora, 13, buffer_size=32, open_shards=3, batch_size=3, num_workers=2, commit=commit)
    m = build_manifest(cfg)
    full = OrderSimulator(m, cfg, 2, 2)
    lines = list(full.order_lines(24))
    first = OrderSimulator(m, cfg, 2, 2)
    head = list(first.order_lines(11))
    resumed = OrderSimulator(m, cfg, 2, 2)
    resumed.load_state_dict(first.state_dict())
    assert head + list(resumed.order_lines(24)) == lines


@pytest.mark.parametrize("commit", ["sequence", "document"])
def test_a_replicate_draws_the_same_work_in_another_order_each_piece_once(corpora, commit):
    """data.replicate r re-seeds every consumer's streams at the resume (a decay branch's replicate): the order
    after it differs from replicate 0's (the exact continuation), every property of exactly-once still holds
    over the whole run, the layout is the same and each source's tokens stay on their targets."""
    cfg = make_cfg(corpora, 13, buffer_size=32, open_shards=3, batch_size=3, num_workers=2, commit=commit)
    m = build_manifest(cfg)
    first = OrderSimulator(m, cfg, 2, 2)
    head_reads = record_reads(first, m)
    list(first.order_lines(11))
    tails, longest = {}, max(doc_lengths(f"{corpora}|13", m, cfg).values())
    for r in (0, 1, 2):
        sim = OrderSimulator(m, dataclasses.replace(cfg, replicate=r), 2, 2)
        sim.load_state_dict(first.state_dict())
        reads = record_reads(sim, m)
        tails[r] = list(sim.order_lines(24))
        check_held(sim.consumers)
        tagged = [(name, doc_id, epoch) for _, name, doc_id, epoch in head_reads + reads]
        assert len(set(tagged)) == len(tagged), f"replicate {r}: a document read twice in one source-epoch"
    assert tails[0] != tails[1] and tails[1] != tails[2] and tails[0] != tails[2]
    tokens = {r: {s: sum(line["source_tokens"][s] for line in tail) for s in m.source_names}
              for r, tail in tails.items()}
    for r in (1, 2):  # the same mixer counters: each source within a document per consumer of replicate 0's
        assert sum(tokens[r].values()) == sum(tokens[0].values())
        assert all(abs(tokens[r][s] - tokens[0][s]) <= 4 * longest for s in m.source_names), (tokens, longest)


def test_fit_says_at_start_up_where_consumers_ask_more_of_a_source_than_an_epoch_gives(make_cfg, caplog):
    """Issue 17: ranks x workers x open chunks above a source's chunks was said only by the dry run.
    ``train fit`` now warns at start-up, naming the capped sources and showing the effective streams."""
    import logging

    from train.datamodule import WellMixedData

    def datamodule(**kw) -> WellMixedData:
        return WellMixedData(make_cfg(**kw))

    with caplog.at_level(logging.WARNING, logger="train.datamodule"):
        datamodule(num_workers=1, open_shards=1, buffer_size=4).setup("fit")
    assert "data.open_shards" not in caplog.text  # nothing capped: nothing said
    with caplog.at_level(logging.WARNING, logger="train.datamodule"):
        datamodule(num_workers=10, open_shards=8, buffer_size=64).setup("fit")
    assert "books" in caplog.text and "data.open_shards 8 / data.buffer_size 64" in caplog.text
    assert "10 consumers" in caplog.text and "epochs in flight" in caplog.text
