"""Benchmark the data path against its ceilings, side by side in one process on the demo corpus.

    python scripts/bench_data.py                       # builds the demo corpus in a temp dir
    python scripts/bench_data.py --corpus demo_corpus  # or uses DIR/<source>/*.parquet
    python scripts/bench_data.py --quick               # smoke run, a few seconds of work per part

(a) throughput of one consumer against bare tiktoken; (b) per-batch mixing against an i.i.d. draw of
documents; (d) a cursor's restore time and size early and late in the order; (f, ``--part f``) a
Dolma3-shaped corpus in a fresh process: start-up, throughput, peak RSS, cursor, restore. How each
part measures, and the figures: docs/benchmarks.md. Absolute times are noisy on a shared machine;
read the ratios.
"""

from __future__ import annotations

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from data.config import DataConfig, corpus_sources, load_data_config
from data.corpus.demo import build_demo_corpus
from data.corpus.scale import make_scale_corpus
from data.formatting import human
from data.manifest import build_manifest
from data.packer import ConsumerStream
from data.schedules import build_schedule, fixed_schedule
from data.simulate import OrderSimulator
from data.tokenizer import cl100k_encoding

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["web", "code", "books", "curated"]
BIG_CONFIG = ROOT / "configs" / "pretrain_350m_20b.yaml"
DEMO_WEIGHTS = {"web": 0.62, "code": 0.18, "books": 0.12, "curated": 0.08}
DEFAULT_BUFFER = 10_000  # DataConfig.buffer_size
DEMO_BUFFER = 256  # configs/demo.yaml: the demo corpus has fewer documents than the default


# ---------------------------------------------------------------------------------------------------
# helpers


def read_corpus(corpus: Path) -> tuple[list[str], dict[str, np.ndarray]]:
    """All texts (in file order) and the token counts + EOT of every document, per source."""
    texts, lengths = [], {}
    for source in SOURCES:
        counts = []
        for path in sorted((corpus / source).glob("*.parquet")):
            table = pq.read_table(path, columns=["text", "token_count"])
            texts += table.column("text").to_pylist()
            counts += table.column("token_count").to_pylist()
        lengths[source] = np.asarray(counts, dtype=np.int64) + 1  # + EOT, as the stream packs them
    return texts, lengths


def stream_config(corpus: Path, seq_len: int = 2048, **overrides) -> DataConfig:
    """The bench corpus at the 350M config's stable-phase mixture and one sequence length."""
    kw = dict(sources=corpus_sources(corpus, SOURCES), schedule=fixed_schedule(big_config()[0], seq_len),
              val_tokens_per_source=0)
    kw.update(overrides)
    return DataConfig(**kw)


def big_config() -> tuple[dict[str, float], int, int]:
    """The 350M/20B config's stable-phase weights (its first phase), slot by slot on this bench's corpus
    sources (the real config's third slot is pdfs, the demo and scale corpora's books), and its per-rank
    micro-batch after the warmup: (weights, sequences per rank, tokens per sequence)."""
    cfg = load_data_config(BIG_CONFIG)
    weights = build_schedule(cfg.schedule, sources=list(cfg.sources)).mixture_weights(0)
    if len(weights) != len(SOURCES):
        raise SystemExit(f"{BIG_CONFIG}: {len(weights)} mixture sources, this bench's corpus has {len(SOURCES)}")
    return dict(zip(SOURCES, weights.values())), cfg.batch_size, int(cfg.schedule.seq_len.end)


def tv(shares: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Total-variation distance per row: half the L1 distance between distributions."""
    return 0.5 * np.abs(shares - weights).sum(axis=-1)


# ---------------------------------------------------------------------------------------------------
# (a) throughput


def bare_rate(texts: list[str], threads: int) -> float:
    """Tokens/s of bare tiktoken over ``texts``."""
    t0 = time.perf_counter()
    out = cl100k_encoding().encode_ordinary_batch(texts, num_threads=threads)
    return sum(map(len, out)) / (time.perf_counter() - t0)


class PathRunner:
    """One consumer of the real data path (1 rank x 1 worker), kept running between timed rounds."""

    def __init__(self, corpus: Path, threads: int, buffer_size: int):
        self.cfg = stream_config(corpus, tokenizer_threads=threads, buffer_size=buffer_size, batch_size=8, seq_len=2048)
        self.sim = OrderSimulator(build_manifest(self.cfg), self.cfg, 1, 1)
        self.it = self.sim.batches(10**12)
        t0 = time.perf_counter()
        next(self.it)  # fills the k open chunks and the B-document buffer of every source
        self.first_batch_s = time.perf_counter() - t0

    def rate(self, batches: int) -> float:
        """Input tokens/s of the next ``batches`` batches."""
        t0 = time.perf_counter()
        tokens = sum(next(self.it)[2]["input_ids"].size for _ in range(batches))
        return tokens / (time.perf_counter() - t0)


def bench_throughput(corpus: Path, texts: list[str], thread_counts: list[int], buffer_size: int,
                     rounds: int, batches: int) -> list[str]:
    lines = [f"(a) throughput: one consumer, batch 8 x 2048, k=8 open chunks, buffer {buffer_size:,} docs/source",
             f"    timed: {batches} batches after the first vs all {len(texts):,} texts; "
             f"{rounds} alternating round(s), medians",
             f"    {'threads':>7}  {'bare tok/s':>10}  {'path tok/s':>10}  {'ratio':>5}  {'rounds':<22} first batch"]
    rows = {t: throughput_row(corpus, texts, t, buffer_size, rounds, batches) for t in thread_counts}
    lines += [line for line, _, _ in rows.values()]
    lines += [f"    ratio path/bare (threads={t}): {r:.2f}  (target >= 0.8: {'ok' if r >= 0.8 else 'BELOW'})"
              for t, (_, r, _) in rows.items()]
    return lines + [f"    the consumer's shuffle buffers hold {rows[thread_counts[0]][2]}"]


def throughput_row(corpus: Path, texts: list[str], threads: int, buffer_size: int, rounds: int,
                   batches: int) -> tuple[str, float, str]:
    """Bare tiktoken and one consumer alternating ``rounds`` times: the table's line, the median ratio,
    and what the consumer's buffers hold."""
    runner = PathRunner(corpus, threads, buffer_size)
    rates = [(bare_rate(texts, threads), runner.rate(batches)) for _ in range(rounds)]
    ratio = statistics.median(path / bare for bare, path in rates)
    line = (f"    {threads:>7}  {human(statistics.median(b for b, _ in rates)):>10}  "
            f"{human(statistics.median(p for _, p in rates)):>10}  {ratio:>5.2f}  "
            f"{' '.join(f'{p / b:.2f}' for b, p in rates):<22} {runner.first_batch_s:.2f} s")
    return line, ratio, held_in_buffers(runner)


def held_in_buffers(runner: PathRunner) -> str:
    """What the consumer's shuffle buffers hold: documents, bytes, and the text among them (compressed)."""
    docs = [d for src in runner.sim.consumers[0][0].sources for d in src.buffer]
    held = sum(len(d.text.data) if d.tokens is None else d.tokens.nbytes for d in docs)
    text = sum(d.text.size for d in docs if d.tokens is None)
    return (f"{len(docs):,} docs, {held / 2**20:.1f} MB held ({text / 2**20:.1f} MB of UTF-8 text, "
            "compressed until a document leaves the buffer)")


# ---------------------------------------------------------------------------------------------------
# (b) per-batch mixing


def stream_tv(corpus: Path, selector: str, buffer_size: int, batch_size: int, seq_len: int, batches: int) -> np.ndarray:
    """Per-batch TV of one consumer of the stream."""
    cfg = stream_config(corpus, selector=selector, buffer_size=buffer_size, batch_size=batch_size, seq_len=seq_len)
    sim = OrderSimulator(build_manifest(cfg), cfg, 1, 1)
    rows = [(b["source_tokens"].astype(np.float64), np.array(b["weights"], dtype=np.float64))  # copies
            for _, _, b in sim.batches(batches)]
    counts, weights = np.array([c for c, _ in rows]), np.array([w for _, w in rows])
    return tv(counts / counts.sum(axis=1, keepdims=True), weights)


def iid_docs(lengths: dict[str, np.ndarray], weights: np.ndarray, n_tokens: int, rng: np.random.Generator):
    """(source, tokens) of i.i.d. documents by tokens until n_tokens: P(s) ~ w_s / mean length of s."""
    mean = np.array([lengths[s].mean() for s in SOURCES])
    p = weights / mean
    p /= p.sum()
    n = int(n_tokens / (p @ mean) * 1.2) + 64
    while True:
        src = rng.choice(len(SOURCES), size=n, p=p)
        toks = np.empty(n, dtype=np.int64)
        for i, s in enumerate(SOURCES):
            sel = src == i
            toks[sel] = lengths[s][rng.integers(len(lengths[s]), size=int(sel.sum()))]
        if toks.sum() >= n_tokens:
            return src, toks
        n *= 2


def iid_tv(lengths: dict[str, np.ndarray], weights: np.ndarray, batch_size: int, seq_len: int, batches: int,
           seed: int = 0) -> np.ndarray:
    """Per-batch TV of i.i.d. documents, packed linearly (one stream cut into batches)."""
    per_batch = batch_size * seq_len
    src, toks = iid_docs(lengths, weights, batches * per_batch, np.random.default_rng(seed))
    labels = np.repeat(src, toks)[: batches * per_batch].reshape(batches, per_batch)
    counts = np.stack([(labels == i).sum(axis=1) for i in range(len(SOURCES))], axis=1).astype(np.float64)
    return tv(counts / counts.sum(axis=1, keepdims=True), weights)


def bench_mixing(corpus: Path, lengths: dict[str, np.ndarray], buffer_size: int, batches: int,
                 iid_batches: int) -> list[str]:
    w, batch_size, seq_len = big_config()
    weights = np.array([w[s] for s in SOURCES])
    rows = {f"stream, selector {sel} ({batches} batches)": stream_tv(corpus, sel, buffer_size, batch_size, seq_len,
                                                                      batches) for sel in ("deficit", "random")}
    rows[f"i.i.d. docs by tokens, linear packing ({iid_batches} batches)"] = iid_tv(lengths, weights, batch_size,
                                                                                    seq_len, iid_batches)
    lines = [f"(b) per-batch mixing: {batch_size} x {seq_len} tokens per batch (the 350M config's per-rank "
             f"micro-batch),", f"    weights {', '.join(f'{s} {w[s]:g}' for s in SOURCES)}; buffer {buffer_size:,}; "
             "TV = 0.5 * sum_s |share_s - w_s|", f"    {'':<58} {'mean TV':>8} {'p90':>6} {'max':>6}"]
    lines += [f"    {label:<58} {v.mean():>8.4f} {np.quantile(v, 0.9):>6.3f} {v.max():>6.3f}"
              for label, v in rows.items()]
    deficit, random, iid = (float(v.mean()) for v in rows.values())
    return lines + [f"    mixing ratio deficit/iid: {deficit / iid:.2f}  (target <= 0.5: "
                    f"{'ok' if deficit / iid <= 0.5 else 'ABOVE'})",
                    f"    mixing ratio random/iid: {random / iid:.2f}   (deficit/random: {deficit / random:.2f})"]


# ---------------------------------------------------------------------------------------------------
# (d) cost of resume


def bench_resume(corpus: Path, buffer_size: int, positions: tuple[int, int], repeats: int) -> list[str]:
    cfg = stream_config(corpus, buffer_size=buffer_size, batch_size=4, seq_len=256, open_shards=4)
    manifest = build_manifest(cfg)
    sim = OrderSimulator(manifest, cfg, 1, 1)
    cursors = {}
    t0 = time.perf_counter()
    for step in positions:
        list(sim.batches(step))
        cursors[step] = json.loads(json.dumps(sim.consumers[0][0].state_dict()))  # what a checkpoint holds
    replay_s = time.perf_counter() - t0
    epochs = {s.name: s.taken / len(s.chunks) for s in sim.consumers[0][0].sources}
    restore, size = {}, {}
    for step, cursor in cursors.items():
        times = []
        for _ in range(repeats):
            fresh = ConsumerStream(manifest, cfg, 0, 1, 0, 1, sim.steps.weights, sim.steps.seq_len)
            t = time.perf_counter()
            fresh.load_state_dict(cursor)
            times.append(time.perf_counter() - t)
        restore[step] = statistics.median(times)
        size[step] = len(json.dumps(cursor, separators=(",", ":")).encode())
    early, late = positions
    ratio = restore[late] / restore[early]
    buffered = len(cfg.sources) * buffer_size
    lines = [f"(d) cost of resume: one consumer, batch 4 x 256, buffer {buffer_size:,} docs/source, k=4; "
             f"median of {repeats} restores",
             f"    replaying the order to step {late:,} took {replay_s:.1f} s (what a cursor-less resume would "
             f"redo); chunk epochs reached: " + ", ".join(f"{n} {e:.1f}" for n, e in epochs.items())]
    for step in positions:
        lines.append(
            f"    restore at step {step:>6,}: {restore[step] * 1e3:7.1f} ms   cursor {size[step]:,} bytes per consumer "
            f"({size[step] / buffered:.1f} bytes per buffered document)"
        )
    lines.append(f"    restore ratio step {late:,} / step {early:,}: {ratio:.2f}  (target <= 1.5: "
                 f"{'ok' if ratio <= 1.5 else 'ABOVE'})")
    return lines


# ---------------------------------------------------------------------------------------------------
# (f) a Dolma3-shaped corpus: start-up, throughput, memory, cursor, restore

SCALE_PROBE = r"""
import json, resource, shutil, sys, time
import numpy as np
from data.config import DataConfig
from data.corpus.scale import scale_sources
from data.manifest import build_manifest
from data.packer import ConsumerStream
from data.schedules import fixed_schedule
a = json.loads(sys.argv[1])
def cfg_with(cache):
    return DataConfig(sources=scale_sources(a["corpus"]), schedule=fixed_schedule(a["weights"], a["seq_len"]),
                      buffer_size=a["buffer"], open_shards=a["open"], batch_size=a["rows"], min_chunks_per_source=1,
                      num_workers=1, val_tokens_per_source=0, manifest_cache=cache)
shutil.rmtree(a["cache"], ignore_errors=True)
t = time.perf_counter(); m = build_manifest(cfg_with(a["cache"])); cold = time.perf_counter() - t
t = time.perf_counter(); m = build_manifest(cfg_with(a["cache"])); warm = time.perf_counter() - t
cfg = cfg_with(a["cache"])
w = np.array([a["weights"][n] for n in cfg.sources])
make = lambda: ConsumerStream(m, cfg, 0, 1, 0, 1, lambda s: w, lambda s: a["seq_len"])
t = time.perf_counter(); c = make(); c.next_batch(); first = time.perf_counter() - t
t = time.perf_counter()
for _ in range(a["batches"]):
    c.next_batch()
steady = time.perf_counter() - t
rate = a["batches"] * a["rows"] * a["seq_len"] / steady
overall = (a["batches"] + 1) * a["rows"] * a["seq_len"] / (steady + first)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
state = c.state_dict()
cursor = len(json.dumps(state))
del c
t = time.perf_counter(); r = make(); r.load_state_dict(state); r.next_batch(); restore = time.perf_counter() - t
print(json.dumps({"manifest_cold": cold, "manifest_warm": warm, "first_batch": first, "tok_s": rate,
                  "tok_s_overall": overall,
                  "peak_rss_mb": rss, "cursor_bytes": cursor, "restore": restore}))
"""


def scale_probe(corpus: Path, cache: Path, buffer_size: int, batches: int) -> dict:
    """The probe above in a fresh process (so peak RSS is its own)."""
    args = {"corpus": str(corpus), "weights": DEMO_WEIGHTS, "cache": str(cache), "buffer": buffer_size, "open": 8,
            "rows": 4, "seq_len": 2048, "batches": batches}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCALE_PROBE, json.dumps(args)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"scale probe failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_scale(tmp: Path, corpus: Path | None, demo: Path, rows: int, buffer_size: int, batches: int) -> list[str]:
    if corpus is None:
        corpus = tmp / "scale_corpus"
        make_scale_corpus(corpus, files=2, rows=rows, row_group=rows, demo=demo)
    r = scale_probe(corpus, tmp / "cache", buffer_size, batches)
    files = sorted(corpus.glob("*.parquet"))
    meta = pq.ParquetFile(files[0]).metadata
    return [f"(f) Dolma3-shaped corpus: {len(files)} files x {meta.num_rows:,} rows, "
            f"{meta.num_rows // meta.num_row_groups:,} rows per row group, every file mixing 6 sub-sources; "
            f"one consumer, chunks = whole row groups (as at 3,000 files), buffer {buffer_size:,}, 8 open chunks, "
            f"4 x 2048 tokens per batch, {batches} batches",
            "    tok/s: steady (after the first batch) / overall (first batch included)",
            f"    {'manifest cold/warm':>19} {'first batch':>12} {'tok/s':>19} {'peak RSS':>9} {'cursor':>9} "
            f"{'restore':>8}",
            f"    {r['manifest_cold']:>8.2f} s/{r['manifest_warm']:>6.2f} s {r['first_batch']:>10.1f} s "
            f"{human(r['tok_s']):>9} / {human(r['tok_s_overall']):>7} {r['peak_rss_mb']:>6.0f} MB "
            f"{r['cursor_bytes'] / 1e3:>6.1f} KB {r['restore']:>6.1f} s"]


def comma_ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=None,
                   help="corpus DIR/<source>/*.parquet (default: build the demo corpus in a temp dir)")
    p.add_argument("--quick", action="store_true", help="a fast smoke run (small counts, one round, one thread count)")
    p.add_argument("--threads", default=None, type=comma_ints,
                   help="tokenizer thread counts for (a), comma-separated (default: 1 and the config default 4)")
    p.add_argument("--buffer-size", type=int, default=None, help=f"shuffle buffer per source (default "
                   f"{DEFAULT_BUFFER:,}, or {DEMO_BUFFER} when the corpus has fewer docs)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds of (a) (default 5)")
    p.add_argument("--part", default="abd",
                   help="which parts to run, e.g. 'a' or 'bd' (default abd; f: a Dolma3-shaped corpus)")
    p.add_argument("--scale-corpus", type=Path, default=None,
                   help="part f: a corpus from scripts/make_scale_corpus.py (default: 2 files written to a temp dir)")
    p.add_argument("--scale-rows", type=int, default=6000, help="part f: rows per file (one row group) when writing")
    p.add_argument("--scale-buffer", type=int, default=600,
                   help="part f: buffer size (default 600: a tenth of a row group, as 10,000 is of ~100k)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="wellmixed-bench-") as tmp:
        corpus = args.corpus
        if corpus is not None and not corpus.is_dir():
            raise SystemExit(f"bench_data.py: --corpus {corpus}: not a directory "
                             "(give a corpus root with one folder of parquet shards per source, or omit the flag)")
        if corpus is None:
            corpus = Path(tmp) / "demo_corpus"
            build_demo_corpus(corpus)
        return run(args, corpus.resolve())


def run(args, corpus: Path) -> int:
    """Print the header, then the report of each part of ``--part`` in the order a-f, then the total time."""
    texts, lengths = read_corpus(corpus)
    n_docs, n_tokens = len(texts), int(sum(int(v.sum()) - len(v) for v in lengths.values()))
    print(f"wellmixed data benchmark: corpus {corpus} ({n_docs:,} docs, {human(n_tokens)} tokens); "
          f"python {platform.python_version()}, {os.cpu_count()} CPUs{'; --quick' if args.quick else ''}")
    t_start = time.perf_counter()
    for part, bench in parts(args, corpus, texts, lengths).items():
        if part in args.part:
            with tempfile.TemporaryDirectory(prefix="wellmixed-bench-") as tmp:
                print("\n".join(bench(Path(tmp))), flush=True)
    print(f"done in {time.perf_counter() - t_start:.0f} s")
    return 0


QUICK = dict(buffer=64, threads=[1], rounds=1, batches=4, mixing=(4, 50), positions=(10, 300), repeats=3,
             scale_batches=3)
FULL = dict(buffer=0, threads=[1, 4], rounds=5, batches=0, mixing=(48, 2000), positions=(10, 10_000), repeats=5,
            scale_batches=300)
"""The parts' sizes with ``--quick`` and without (0: from the corpus); the flags override some."""


def parts(args, corpus: Path, texts: list[str], lengths: dict) -> dict:
    """``--part`` letter -> the part's report lines (given a scratch folder), run in this order."""
    z = QUICK if args.quick else FULL
    buffer_size = args.buffer_size or z["buffer"] or (DEMO_BUFFER if len(texts) < DEFAULT_BUFFER else DEFAULT_BUFFER)
    threads = args.threads or z["threads"]
    n_tokens = sum(int(v.sum()) - len(v) for v in lengths.values())
    batches = z["batches"] or -(-n_tokens // (8 * 2048))  # about one pass over the corpus per round
    rows, scale_buffer = (1000, 100) if args.quick else (args.scale_rows, args.scale_buffer)
    return {
        "a": lambda tmp: bench_throughput(corpus, texts, threads, buffer_size, args.rounds or z["rounds"], batches),
        "b": lambda tmp: bench_mixing(corpus, lengths, buffer_size, *z["mixing"]),
        "d": lambda tmp: bench_resume(corpus, buffer_size, z["positions"], z["repeats"]),
        "f": lambda tmp: bench_scale(tmp, args.scale_corpus, corpus, rows=rows, buffer_size=scale_buffer,
                                     batches=z["scale_batches"]),
    }


if __name__ == "__main__":
    sys.exit(main())
