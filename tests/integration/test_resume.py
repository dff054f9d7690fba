"""Kill-and-resume equivalence with real processes and real signals, and elastic resume.

The seed article's test, made the centrepiece: a training run is SIGKILLed (not stopped gracefully)
at a point after its first checkpoint, resumed with ``--ckpt_path last``, and its order log compared
with an uninterrupted run of the same config: the document pieces of every step identical rank by
rank, the loss bitwise identical (fp32 on CPU), and lr / sequence length / mixture weights those of
the same step. Variants: one process with 2 DataLoader workers, killed in the middle of the anneal;
2 DDP ranks with 2 workers each; a kill across a source's epoch boundary; a run cut short by
``--trainer.max_steps`` and continued; 4 DDP ranks resumed from a checkpoint, the final weights and
Adam state compared bitwise. The uninterrupted 1- and 2-rank runs are shared with
tests/integration/test_faults.py (tests/conftest.py: ref_single, ref_ddp).

Kill points vary from run to run; the seed is printed with every failure and can be fixed with
WELLMIXED_KILL_SEED=<n>.

Elastic resume (another ranks x workers x micro-batch): exactly-once from the order, tested on the
data layer (OrderSimulator, SourceStream) and on a real 2-rank -> 1-rank resume.
"""

from __future__ import annotations

import csv
import json
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from training_runs import (
    DDP,
    TINY,
    Run,
    assert_same_order,
    assert_same_weights,
    copy_checkpoint,
    global_step_of,
    order_log,
    owed_docs,
    run_to_end,
)

from data.config import DataConfig, SourceConfig
from data.elastic import redistribute_simulator_state, redistribute_source
from data.errors import ConfigError
from data.manifest import build_manifest
from data.order import chunk_permutation
from data.reader import ShardReader
from data.schedules import fixed_schedule
from data.simulate import OrderSimulator
from data.stream import SourceStream
from train.cursor_files import load_checkpoint_cursors
from train.datamodule import WellMixedData
from train.rundir import read_metrics

CKPT_EVERY = 3


def _kill_and_resume(workdir, env, run_dir: Path, args: list[str], condition, why: str) -> tuple[int, int]:
    """SIGKILL the whole process group once ``condition(run)`` holds, resume with --ckpt_path last.

    Returns (order-log lines written before the kill, step the resume started from)."""
    run = Run(workdir, run_dir, args, env, "killed")
    run.signal_when(lambda: condition(run))
    rc = run.wait()
    assert rc == -9, f"{why}: expected death by SIGKILL, rc {rc}:\n{run.log()}"
    done = run.lines_done()
    resumed_from = global_step_of(run_dir / "checkpoints" / "last.ckpt")
    resumed = run_to_end(workdir, run_dir, args + ["--ckpt_path", "last"], env, "resumed")
    assert "Restoring states from the checkpoint path at" in resumed.log(tail=10**6), resumed.log()
    return done, resumed_from


def _has_ckpt(run: Run, step: int | None = None) -> bool:
    ckpts = run.run_dir / "checkpoints"
    return (ckpts / "last.ckpt").exists() if step is None else (ckpts / f"step{step:07d}.ckpt").exists()


def _pieces(lines):
    return [(p[0], p[1]) for ln in lines for p in ln["pieces"]]


# -- real processes, real SIGKILL ------------------------------------------------------------------


@pytest.mark.slow
def test_stop_at_max_steps_then_continue_to_the_end(workdir, env, ref_single):
    """A run cut short by ``--trainer.max_steps`` (before the schedule's end, between two step
    checkpoints), then continued with ``--ckpt_path last`` to the schedule's end: one run's order."""
    _, ref = ref_single
    run_dir = workdir / "max_steps"
    first = run_to_end(workdir, run_dir, TINY + ["--trainer.max_steps", "7"], env, "first")
    assert "stops before the schedule's" in first.log(tail=10**6)
    assert global_step_of(run_dir / "checkpoints" / "last.ckpt") == 7
    run_to_end(workdir, run_dir, TINY + ["--ckpt_path", "last"], env, "continued")
    assert_same_order(ref, order_log(run_dir))


@pytest.mark.slow
def test_sigkill_two_ddp_ranks_two_workers_each(workdir, env, ref_ddp, kill_rng):
    """2 ranks x 2 workers: every rank's log identical after the resume; ranks never share a
    document piece (doc_id, offset) -- no source wraps in this run, so no piece may appear twice."""
    _, ref = ref_ddp
    seed, rng = kill_rng
    n = len(ref[0])
    kill_at = rng.randint(CKPT_EVERY + 1, n - 3)
    run_dir = workdir / "b"
    done, resumed_from = _kill_and_resume(
        workdir, env, run_dir, TINY + DDP, lambda r: r.lines_done(0) >= kill_at and _has_ckpt(r), f"seed {seed}")
    assert CKPT_EVERY <= resumed_from < n, (seed, kill_at, done, resumed_from)
    got = order_log(run_dir)
    assert_same_order(ref, got)
    rank0, rank1 = Counter(_pieces(got[0])), Counter(_pieces(got[1]))
    assert not set(rank0) & set(rank1), "two ranks read the same document piece"
    assert max((rank0 + rank1).values()) == 1, "a document piece was read twice"


# 4 ranks x 1 worker, micro-batch 1; 10 steps, checkpoints at 3, 6 and 9
DDP4 = ["--trainer.accelerator", "cpu", "--trainer.devices", "4", "--trainer.strategy", "ddp",
        "--data.batch_size", "1", "--data.num_workers", "1", "--data.schedule.train_tokens", "900"]


@pytest.mark.slow
def test_resume_at_four_ranks_is_bitwise(workdir, env):
    """4 DDP ranks (gloo): resumed from the uninterrupted run's step-3 checkpoint, a run ends with bitwise
    its weights and Adam state, and logs bitwise its losses, step by step. A sum over 4 ranks depends on
    the order of its terms, which DDP's gradient bucket layout sets: a fresh process reduced its first
    step in another layout than a process that had trained one (train/parallel.py); over 2 ranks the
    order cannot matter, so the 2-rank tests above cannot see it."""
    ref_dir, run_dir, at = workdir / "ref4", workdir / "resumed4", 3
    first = run_to_end(workdir, ref_dir, TINY + DDP4, env, "ref4")
    assert "step 9: the weights of 4 ranks agree (checksum" in first.log(tail=10**6)
    ref, n = order_log(ref_dir), len(order_log(ref_dir)[0])
    assert sorted(ref) == [0, 1, 2, 3] and n == 10, (sorted(ref), n)
    ckpt = copy_checkpoint(ref_dir / "checkpoints" / f"step{at:07d}.ckpt", run_dir / "checkpoints")
    run_to_end(workdir, run_dir, TINY + DDP4 + ["--ckpt_path", str(ckpt)], env, "resumed4")
    assert_same_weights(ref_dir / "checkpoints" / "last.ckpt", run_dir / "checkpoints" / "last.ckpt")
    assert_same_order({r: lines[at:] for r, lines in ref.items()}, order_log(run_dir), first_step=at)
    logged = [{k: v for k, v in row.items() if "loss" in k or "grad_norm" in k} for row in read_metrics(run_dir)]
    want = [{k: row[k] for k in logged[0]} for row in read_metrics(ref_dir) if int(row["step"]) >= at]
    assert "train/loss" in logged[0] and logged == want


@pytest.mark.slow
def test_sigkill_one_process_two_workers_in_the_anneal(workdir, env, ref_single, kill_rng):
    """One process, 2 DataLoader workers; the checkpoint and the kill both inside the anneal phase
    (mixture and LR decay changing): the resumed run's order log is the uninterrupted run's, line for
    line (pieces, bitwise loss, lr, seq_len, weights)."""
    _, ref = ref_single
    seed, rng = kill_rng
    n = len(ref[0])
    anneal = next(ln["step"] for ln in ref[0] if ln["weights"] != ref[0][0]["weights"])
    assert ref[0][anneal]["weights"]["curated"] == 0.35 and anneal < n - 4
    ckpt = (anneal // CKPT_EVERY + 1) * CKPT_EVERY  # first checkpoint strictly inside the anneal
    kill_at = ckpt + rng.randint(1, 2)
    run_dir = workdir / "a"
    done, resumed_from = _kill_and_resume(
        workdir, env, run_dir, TINY, lambda r: r.lines_done() >= kill_at and _has_ckpt(r, ckpt), f"seed {seed}")
    assert anneal < resumed_from <= done < n, (seed, anneal, done, resumed_from)
    got = order_log(run_dir)
    assert_same_order(ref, got)
    # the LR decays through the anneal, step by step across the resume
    lrs = [ln["lr"] for ln in got[0][anneal:]]
    assert all(a > b for a, b in zip(lrs, lrs[1:])), lrs
    # metrics.csv holds each step once: the rows the killed run logged past its checkpoint were cut at the resume
    with open(run_dir / "csv" / "metrics.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(n)), (seed, resumed_from, done)


def _small_curated(tmp: Path, demo_corpus: Path, rows: int) -> Path:
    """A curated source of ``rows`` short documents (under 200 tokens, from a demo shard)."""
    out = tmp / "small_curated"
    out.mkdir(exist_ok=True)
    table = pq.read_table(demo_corpus / "curated" / "curated_core-0000.parquet")
    short = [i for i, n in enumerate(table.column("token_count").to_pylist()) if n < 200][:rows]
    pq.write_table(table.take(short), out / "curated_small-0000.parquet")
    return out


@pytest.mark.slow
def test_sigkill_across_a_source_epoch_boundary(workdir, env, demo_corpus, cache_dir, kill_rng):
    """A curated source of 10 short documents read at a 50-60% share: about 2 epochs in the run;
    the checkpoint is before its first epoch ends and the kill after it.

    With a one-document buffer, one open chunk and one worker, the curated documents must come in
    exactly the order perm(epoch 0) ++ perm(epoch 1) ++ ... of the global shard order -- which proves
    from the log that every document is read once per epoch and repeats only after all were seen.
    (With a larger buffer the epochs overlap by up to a buffer's worth of documents, by design;
    tests/unit/test_stream.py checks exactly-once per epoch for that case on the data layer.)"""
    seed, rng = kill_rng
    small = _small_curated(workdir, demo_corpus, rows=10)
    sources = {s: {"paths": [str(demo_corpus / s / "*.parquet")]} for s in ("web", "code", "books")}
    sources["curated"] = {"paths": [str(small / "*.parquet")]}
    mixture = {"phases": [{"name": "stable", "weights": {"web": 0.3, "code": 0.1, "books": 0.1, "curated": 0.5}},
                          {"name": "anneal", "start": "anneal",
                           "weights": {"web": 0.2, "code": 0.1, "books": 0.1, "curated": 0.6}}]}
    args = TINY + ["--data.schedule.train_tokens", "2400",  # 21 steps
                   "--data.sources", json.dumps(sources), "--data.schedule.mixture", json.dumps(mixture),
                   "--data.buffer_size", "1", "--data.open_shards", "1", "--data.num_workers", "1"]
    ref_dir = workdir / "ref_wrap"
    run_to_end(workdir, ref_dir, args + ["--run.ckpt_every_n_steps", "1000"], env, "ref")
    ref = order_log(ref_dir)

    # the expected curated order, from the manifest and the global shard permutation alone
    cfg = DataConfig(sources={k: SourceConfig(paths=v["paths"]) for k, v in sources.items()},
                        schedule=fixed_schedule(dict.fromkeys(sources, 0.25), 128), manifest_cache=str(cache_dir))
    m = build_manifest(cfg)
    chunks = m.sources["curated"].chunks
    n_docs = sum(c.stop - c.start for c in chunks)
    expected = [
        m.doc_id(chunks[i].shard, r)
        for e in range(10)
        for i in chunk_permutation(1234, "curated", e, len(chunks))
        for r in range(chunks[i].start, chunks[i].stop)
    ]

    def curated_reads(lines):
        return [
            (ln["step"], p[0]) for ln in lines for p in ln["pieces"] if p[0].startswith("curated_small") and p[1] == 0
        ]

    reads = curated_reads(ref[0])
    assert len(reads) > 1.5 * n_docs, f"curated must wrap well into epoch 1 ({len(reads)} reads of {n_docs} docs)"
    assert [d for _, d in reads] == expected[:len(reads)]
    wrap = reads[n_docs][0]  # the step that reads the first document of curated's epoch 1

    ckpt_every = max(2, wrap - 1)  # checkpoint before the wrap; checkpoints do not change the order
    kill_at = wrap + 1 + rng.randint(0, 1)
    assert kill_at < 2 * ckpt_every - 1, f"wrap at step {wrap}: the kill must come well before the next checkpoint"
    run_dir = workdir / "d"
    killed_args = args + ["--run.ckpt_every_n_steps", str(ckpt_every)]
    done, resumed_from = _kill_and_resume(
        workdir, env, run_dir, killed_args, lambda r: r.lines_done() >= kill_at and _has_ckpt(r), f"seed {seed}")
    assert resumed_from <= wrap < done, (seed, wrap, resumed_from, done)
    got = order_log(run_dir)
    assert_same_order(ref, got)
    assert [d for _, d in curated_reads(got[0])] == expected[:len(reads)]


@pytest.mark.slow
def test_elastic_resume_two_ranks_to_one(workdir, env, ref_ddp, demo_corpus, cache_dir):
    """A checkpoint of 2 ranks x 2 workers (micro-batch 2) resumed on 1 rank x 3 workers (micro-batch 4):
    the order changes, but across the change no document piece is read twice, every document
    continues exactly where it stopped (the rows' leftovers of all 4 old consumers), and the
    schedules continue at the right step."""
    ref_dir, ref = ref_ddp
    at = 9
    run_dir = workdir / "elastic"
    (run_dir / "checkpoints").mkdir(parents=True)
    ckpt = run_dir / "checkpoints" / f"step{at:07d}.ckpt"
    copy_checkpoint(ref_dir / "checkpoints" / ckpt.name, ckpt.parent)
    args = TINY + ["--data.batch_size", "4", "--data.num_workers", "3", "--ckpt_path", str(ckpt)]
    run = run_to_end(workdir, run_dir, args, env, "elastic")
    assert "elastic resume at step 9" in run.log()
    after = order_log(run_dir)[0]
    n = len(ref[0])
    assert [ln["step"] for ln in after] == list(range(at, n))
    for ln in after:  # schedules: the same values at the same step as the uninterrupted run
        want = ref[0][ln["step"]]
        assert (ln["seq_len"], ln["weights"], ln["lr"]) == (want["seq_len"], want["weights"], want["lr"])
        assert len(ln["pieces"]) >= 4  # 4 rows of the new micro-batch

    before = [ln for step in range(at) for rank in (0, 1) for ln in [ref[rank][step]]]
    _assert_pieces_continue(before + after)

    import torch

    state = torch.load(ckpt, map_location="cpu", weights_only=True)["WellMixedData"]
    names = ("web", "code", "books", "curated")
    m = build_manifest(DataConfig(sources={s: SourceConfig(paths=[str(demo_corpus / s / "*.parquet")])
                                              for s in names},
                                     schedule=fixed_schedule(dict.fromkeys(names, 0.25), 128),
                                     manifest_cache=str(cache_dir)))
    # documents in flight: in the rows (commit: document) or handed back between steps (commit: sequence)
    leftovers = [(m.doc_id(shard, row), off) for rank in load_checkpoint_cursors(ckpt, state) for cur in rank
                 for (src, shard, row, epoch, off) in filter(None, cur["rows"] + cur.get("continuations", []))]
    assert len(leftovers) >= 8  # 4 old consumers x 2 rows, each in the middle of a document
    continued = Counter((p[0], p[1]) for ln in after for p in ln["pieces"])
    # a document handed back between steps waits for its source's next turn: one not continued by the
    # end of the run is still in flight, at the same offset, in the final cursors
    last = run_dir / "checkpoints" / "last.ckpt"
    final = torch.load(last, map_location="cpu", weights_only=True)["WellMixedData"]
    waiting = {(m.doc_id(shard, row), off) for rank in load_checkpoint_cursors(last, final) for cur in rank
               for (src, shard, row, epoch, off) in filter(None, cur["rows"] + cur.get("continuations", [])
                                                            + cur.get("pending", []))}
    for piece in leftovers:
        assert continued[piece] + (piece in waiting) == 1, \
            f"leftover {piece} of the old layout was not continued exactly once"


def _assert_pieces_continue(lines: list[dict]) -> None:
    """In order, each document's pieces start at offset 0 and continue where the last one stopped:
    no token skipped, none repeated (valid while no source wraps, as in these short runs)."""
    at: dict[str, int] = {}
    for ln in lines:
        for doc, off, n in ln["pieces"]:
            assert off == at.get(doc, 0), (
                f"step {ln['step']} rank {ln['rank']}: {doc} at {off}, expected {at.get(doc, 0)}"
            )
            at[doc] = off + n


# -- elastic resume on the data layer --------------------------------------------------------------

SCHEDULE = {
    "train_tokens": 60000, "global_batch_size": 4,
    "seq_len": {"start": 64, "end": 128, "warmup_steps": 10, "multiple": 64},
    "lr": {"peak": 1e-3, "warmup_steps": 2},
    "anneal_start": 0.5,
    "mixture": {"phases": [
        {"name": "stable", "weights": {"web": 0.9, "curated": 0.1}},
        {"name": "anneal", "start": "anneal", "weights": {"web": 0.6, "curated": 0.4}},
    ]},
}


LAYOUTS = [  # (ranks, workers, micro-batch) before -> after; the global batch stays 4 except where noted
    ((2, 2, 2), (1, 2, 4)),  # 2 ranks -> 1 rank
    ((1, 2, 4), (1, 3, 4)),  # more workers
    ((1, 3, 4), (2, 1, 2)),  # 1 rank -> 2 ranks, fewer workers
    ((2, 1, 2), (2, 2, 1)),  # smaller micro-batch (leftovers beyond the rows wait in `pending`)
]


@pytest.mark.parametrize("old,new", LAYOUTS, ids=lambda x: "x".join(map(str, x)))
def test_elastic_layout_change_keeps_exactly_once(make_cfg, old, new):
    """Across the change: no document piece twice, every document continues where it stopped, and --
    from the new consumers' state at the end -- every document of a source is either read or still
    owed, exactly once (none skipped); the schedules continue at the right step."""
    (R, W, B), (R2, W2, B2) = old, new
    cut, end = 7, 26
    # web and curated only: 4 consumers x (16 buffered + 2 open chunks) stay inside their first epoch, so a
    # repeated piece is a bug (books, 20 documents, would wrap inside the buffers by design)
    sources = {k: v for k, v in make_cfg().sources.items() if k in ("web", "curated")}
    common = dict(sources=sources, buffer_size=16, open_shards=2, schedule=SCHEDULE)
    cfg = make_cfg(batch_size=B, num_workers=W, **common)
    cfg2 = make_cfg(batch_size=B2, num_workers=W2, **common)
    m = build_manifest(cfg)
    first = OrderSimulator(m, cfg, R, W)
    lines = list(first.order_lines(cut))
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint holds
    new_state = redistribute_simulator_state(state, m, seed=cfg.seed, world_size=R2, num_workers=W2, batch_size=B2)
    second = OrderSimulator(m, cfg2, R2, W2)
    second.load_state_dict(json.loads(json.dumps(new_state)))
    after = list(second.order_lines(end))
    _assert_pieces_continue(lines + after)

    # schedules: the step numbers continue, with the values of the same step of an unchanged run
    assert sorted({ln["step"] for ln in after}) == list(range(cut, end))
    reference = {ln["step"]: ln for ln in OrderSimulator(m, cfg, R, W).order_lines(end) if ln["rank"] == 0}
    for ln in after:
        want = reference[ln["step"]]
        assert (ln["seq_len"], ln["weights"], ln["lr"]) == (want["seq_len"], want["weights"], want["lr"])

    # every document read so far was read whole -- or is still in a row (or pending), emitted up to
    # its offset: the old rows' leftovers were continued, no token of a document skipped
    address = {m.doc_id(c.shard, r): (i, c.shard, r) for i, info in enumerate(m.sources.values())
               for c in info.chunks for r in range(c.start, c.stop)}
    emitted = Counter()
    for ln in lines + after:
        for doc, _, n in ln["pieces"]:
            emitted[doc] += n
    in_rows = {m.doc_id(left.doc.shard, left.doc.row): left.offset for rank in second.consumers for consumer in rank
               for left in [r for r in consumer.packer.rows if r is not None] + consumer.policy.pending
               + consumer.policy.continuations}
    reader = ShardReader(m, cfg)
    for doc, n in emitted.items():
        src, shard, row = address[doc]
        (tokens,) = reader.read_docs(src, [(shard, row)])
        assert n == in_rows.get(doc, len(tokens)), f"{doc}: {n} tokens emitted of {len(tokens)}"

    # none skipped: read + owed == every document of the source, once (no source wraps here)
    started = defaultdict(set)
    for doc in list(emitted) + list(in_rows):
        started[m.source_names[address[doc][0]]].add(doc)
    for i, (name, info) in enumerate(m.sources.items()):
        owed = Counter(m.doc_id(*a) for rank in second.consumers for c in rank for a in owed_docs(c.sources[i], 0))
        everything = {m.doc_id(c.shard, r) for c in info.chunks for r in range(c.start, c.stop)}
        assert not set(owed) & started[name], f"{name}: a document was read and is still owed"
        assert max(owed.values(), default=1) == 1, f"{name}: a document is owed twice"
        assert set(owed) | started[name] == everything, f"{name}: {len(everything - set(owed) - started[name])} skipped"


@pytest.mark.parametrize("n_old,n_new", [(4, 3), (3, 6), (16, 5)])
def test_elastic_source_streams_cover_each_epoch_once(make_cfg, n_old, n_new):
    """Source level, across epochs: curated with fewer chunks than consumers (min_chunks 1) and tiny
    buffers, so the old consumers' pending work spans epochs 0 and 1 at the change. After draining
    every new consumer past epoch 1, each epoch's documents were emitted exactly once."""
    cfg = make_cfg(buffer_size=4, open_shards=2, min_chunks_per_source=1)
    m = build_manifest(cfg)
    idx, name = 3, "curated"
    chunks = m.sources[name].chunks
    reader = ShardReader(m, cfg)
    everything = Counter((c.shard, r) for c in chunks for r in range(c.start, c.stop))
    emitted = [Counter(), Counter()]

    def take(stream, n):
        for _ in range(n):
            d = stream.next_doc()
            if d.epoch < 2:
                emitted[d.epoch][(d.shard, d.row)] += 1

    old = [SourceStream(idx, name, chunks, reader, cfg, c, n_old) for c in range(n_old)]
    for i, s in enumerate(old):
        take(s, 60 + 7 * i)  # uneven progress, as workers have
    assert any(s.taken * n_old + s.consumer >= len(chunks) for s in old), "the change must come inside epoch 1"
    states = redistribute_source([s.cursor() for s in old], n_new, name, cfg.seed, resume_step=100)
    new = []
    for c, st in enumerate(states):
        s = SourceStream(idx, name, chunks, reader, cfg, c, n_new)
        s.restore(st)
        new.append(s)
    for s in new:
        for _ in range(20000):
            if not owed_docs(s, 0) and not owed_docs(s, 1):
                break
            take(s, 1)
        assert not owed_docs(s, 0) and not owed_docs(s, 1)
    for epoch in (0, 1):
        assert emitted[epoch] == everything, f"epoch {epoch}: not every document exactly once"


# -- the resume policy: refusals and overrides ---------------------------------------------------------


def _saved_state(make_cfg, **kw) -> tuple[WellMixedData, dict]:
    cfg = make_cfg(**kw)
    dm = WellMixedData(cfg)
    manifest = dm.prepare().manifest
    sim = OrderSimulator(manifest, cfg, 1, cfg.num_workers)
    list(sim.batches(4))
    state = {"cursors": [[c.state_dict() for c in sim.consumers[0]]], "next_step": 4, "world_size": 1,
             "num_workers": cfg.num_workers, "batch_size": cfg.batch_size, "accumulate": 1, "seed": cfg.seed,
             "fingerprint": manifest.fingerprint()}
    return dm, state


def test_layout_change_is_elastic_by_default_and_refused_when_off(make_cfg, caplog):
    dm, state = _saved_state(make_cfg)
    other, _ = _saved_state(make_cfg, num_workers=3)
    other.load_state_dict(state)
    assert "elastic resume at step 4" in caplog.text
    assert len(other._resumed_cursors()) == 3 and other._resume.next_step == 4
    strict, _ = _saved_state(make_cfg, num_workers=3)
    strict.elastic = False
    with pytest.raises(ConfigError, match="ranks x workers x micro-batch x accumulation changed .*--run.elastic"):
        strict.load_state_dict(state)


def test_changed_seed_or_corpus_refused_unless_allowed(make_cfg, caplog):
    dm, state = _saved_state(make_cfg)
    reseeded, _ = _saved_state(make_cfg, seed=7)
    with pytest.raises(ConfigError, match=r"data.seed changed \(1234 -> 7\).*--run.allow_changed_data"):
        reseeded.load_state_dict(state)
    with pytest.raises(ConfigError, match="the corpus changed"):
        dm.load_state_dict({**state, "fingerprint": "0" * 16})
    reseeded.allow_changed_data = True
    reseeded.load_state_dict(state)
    assert reseeded._resume.state is None and reseeded._resume.next_step == 4 and reseeded._resumed_cursors() is None
    assert "starts afresh at step 4" in caplog.text
