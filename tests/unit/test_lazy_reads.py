"""Lazy, bounded reads: opening or resuming a chunk tokenizes a slice, not the row group; null texts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data.reader as reader_mod
from data.config import DataConfig, SourceConfig
from data.errors import ConfigError
from data.manifest import build_manifest
from data.packer import ConsumerStream
from data.reader import SLICE_ROWS, ShardReader
from data.schedules import fixed_schedule
from data.tokenizer import Tokenizer, TokenizerConfig

TOKENIZER = TokenizerConfig().build()


def write(path: Path, texts: list, row_group: int) -> None:
    n = len(texts)
    table = pa.table({"source": ["web"] * n, "date": ["2024-01-01"] * n, "text": pa.array(texts, pa.string()),
                      "token_count": pa.array([0 if t is None else n for t, n in zip(texts, TOKENIZER.count(
                          [t or "" for t in texts]))], pa.int64()),
                      "category": ["web"] * n})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group)


def cfg_for(tmp_path: Path, **kw) -> DataConfig:
    kw.setdefault("min_chunks_per_source", 1)
    kw.setdefault("buffer_size", 8)
    return DataConfig(sources={"web": SourceConfig([str(tmp_path / "web" / "*.parquet")])},
                      schedule=fixed_schedule({"web": 1.0}, 64), batch_size=2, open_shards=1, num_workers=1,
                      manifest_cache=str(tmp_path / "cache"), **kw)


@pytest.fixture
def counted(monkeypatch) -> list[int]:
    """Documents tokenized so far (the reader's Tokenizer.encode_docs is counted)."""
    seen = [0]
    encode = Tokenizer.encode_docs

    def counting(self, texts, num_threads=1):
        seen[0] += len(texts)
        return encode(self, texts, num_threads)

    monkeypatch.setattr(Tokenizer, "encode_docs", counting)
    return seen


def test_open_and_resume_tokenize_a_slice_not_the_row_group(tmp_path, counted):
    """One row group of 5,000 documents (one chunk): the first batches tokenize what they emit (at
    most a slice), not 5,000 documents, and a resume inside the chunk tokenizes only the documents
    under way (buffered documents are re-read as text)."""
    write(tmp_path / "web" / "a.parquet", [f"document {i} " + "word " * (i % 50) for i in range(5000)], 5000)
    cfg = cfg_for(tmp_path)
    m = build_manifest(cfg)
    c = ConsumerStream(m, cfg, 0, 1, 0, 1, lambda s: np.array([1.0]), lambda s: 64)
    batches = [c.next_batch() for _ in range(5)]
    assert counted[0] <= SLICE_ROWS + cfg.buffer_size
    state = c.state_dict()
    counted[0] = 0
    resumed = ConsumerStream(m, cfg, 0, 1, 0, 1, lambda s: np.array([1.0]), lambda s: 64)
    resumed.load_state_dict(state)
    assert counted[0] <= 2 * cfg.batch_size  # only the documents under way; the buffer holds text
    more = [c.next_batch()["pieces"] for _ in range(5)]
    assert [resumed.next_batch()["pieces"] for _ in range(5)] == more
    assert counted[0] <= 2 * SLICE_ROWS + 2 * cfg.buffer_size + cfg.batch_size
    assert batches[0]["pieces"]


def test_read_chunk_equals_whole_row_group_tokenization(tmp_path):
    """Slices join up: a chunk read lazily is the same documents as before, in row order."""
    texts = [f"doc {i} " + "x y z " * (i % 7) for i in range(700)]
    write(tmp_path / "web" / "a.parquet", texts, 700)
    cfg = cfg_for(tmp_path, min_chunks_per_source=3)
    m = build_manifest(cfg)
    r = ShardReader(m, cfg)
    rows = [row for ch in m.sources["web"].chunks for row in r.read_chunk(0, ch)[0]]
    assert rows == list(range(700))
    ch = m.sources["web"].chunks[1]
    got_rows, toks = r.read_chunk(0, ch, skip=5)
    assert got_rows[0] == ch.start + 5
    assert [len(t) for t in toks] == [len(t) for t in r.read_docs(0, [(0, row) for row in got_rows])]


def test_null_text_is_named_or_skipped_and_counted(tmp_path):
    texts = [f"doc {i} words here" for i in range(40)]
    texts[17] = None
    write(tmp_path / "web" / "a.parquet", texts, 20)
    cfg = cfg_for(tmp_path)
    m = build_manifest(cfg)
    with pytest.raises(ConfigError, match=r"a\.parquet:0:17.*on_bad_shard: skip"):
        ConsumerStream(m, cfg, 0, 1, 0, 1, lambda s: np.array([1.0]), lambda s: 64).next_batch()
    cfg = cfg_for(tmp_path, on_bad_shard="skip")
    runs = []
    for _ in range(2):  # the same rows are skipped every time: the order does not change
        c = ConsumerStream(m, cfg, 0, 1, 0, 1, lambda s: np.array([1.0]), lambda s: 64)
        runs.append([p for _ in range(8) for p in c.next_batch()["pieces"]])
        assert c.reader.bad_rows == {(0, 0): [17]}
    assert runs[0] == runs[1]
    assert not any(p[0].endswith(":17") for p in runs[0])


def test_invalid_utf8_is_named_by_file_row_group_and_row(tmp_path):
    """Bytes that are not UTF-8 behind an intact footer (parquet does not check): a ConfigError naming
    ``file:row group:row`` when the slice holding them is read, not a worker traceback."""
    texts = [f"doc {i} words here".encode() for i in range(40)]
    texts[23] = b"doc 23 \xff\xfe broken"
    offsets = np.cumsum([0] + [len(t) for t in texts]).astype(np.int32)
    bad = pa.Array.from_buffers(pa.string(), 40, [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(texts))])
    table = pa.table({"source": ["web"] * 40, "date": ["2024-01-01"] * 40, "text": bad,
                      "token_count": pa.array([4] * 40, pa.int64()), "category": ["web"] * 40})
    (tmp_path / "web").mkdir()
    pq.write_table(table, tmp_path / "web" / "a.parquet", row_group_size=20)
    cfg = cfg_for(tmp_path)
    m = build_manifest(cfg)
    with pytest.raises(ConfigError, match=r"a\.parquet:1:23: `text` cannot be decoded"):
        c = ConsumerStream(m, cfg, 0, 1, 0, 1, lambda s: np.array([1.0]), lambda s: 64)
        for _ in range(40):
            c.next_batch()


def test_a_buffer_holds_compressed_text_until_a_document_leaves_it(tmp_path):
    """Buffered documents are zstd-compressed UTF-8 (a tenth here, ~a third on natural text), and come
    out as the same tokens as the text read directly."""
    texts = [f"document {i} " + "the same words again " * 50 for i in range(200)]
    write(tmp_path / "web" / "a.parquet", texts, 200)
    cfg = cfg_for(tmp_path, buffer_size=64)
    m = build_manifest(cfg)
    c = ConsumerStream(m, cfg, 0, 1, 0, 1, lambda s: np.array([1.0]), lambda s: 64)
    c.next_batch()
    held = [d.text for d in c.sources[0].buffer]
    assert len(held) == 64 and all(isinstance(h, reader_mod.HeldText) for h in held)
    assert sum(len(h.data) for h in held) < 0.1 * sum(h.size for h in held)
    d = c.sources[0].buffer[0]
    assert d.text.text() == texts[d.row]
    assert c.reader.encode(d.text).tolist() == TOKENIZER.encode_docs([texts[d.row]])[0].tolist()
