"""Rank arithmetic of a SLURM job at scale, with injected environments (no Slurm, no training).

For N nodes x G tasks per node (one per GPU) srun sets SLURM_PROCID / SLURM_LOCALID / SLURM_NODEID /
SLURM_NTASKS per task (block distribution). These tests set those variables as srun would
(train/launch.py: ``slurm_task_env``) and check what Lightning makes of them -- its SLURMEnvironment,
a Trainer, and the repo's CLI -- and each rank's data slice: consumers ``rank*W + w`` of
``C = ranks x W``, whose chunk elements ``c, c+C, ...`` cover every document of a source exactly once
per source-epoch, so no two ranks of a 512-rank job share a document within a source-epoch.
"""

from __future__ import annotations

import json
import os
import socket
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment

from data.manifest import build_manifest
from data.packer import ConsumerStream
from data.stream import SourceStream
from train.launch import (
    consumer_ids,
    derived_port,
    dry_run,
    expand_nodelist,
    master_port,
    patched_environ,
    port_is_free,
    probe_ports,
    rank_info,
    simulated_nodelist,
    slurm_task_env,
)

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = [(4, 8), (64, 8)]  # nodes x GPUs: 32 and 512 ranks


def _set_env(monkeypatch, env: dict[str, str]) -> None:
    for k in ("MASTER_ADDR", "MASTER_PORT", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("nodes,gpus", LAYOUTS)
def test_slurm_environment_ranks_for_every_task(monkeypatch, nodes, gpus):
    world = nodes * gpus
    seen = set()
    for rank in range(world):
        _set_env(monkeypatch, slurm_task_env(nodes, gpus, rank, job_id=734512))
        assert SLURMEnvironment.detect()
        env = SLURMEnvironment(auto_requeue=False)
        assert env.world_size() == world
        assert env.global_rank() == rank
        assert env.local_rank() == rank % gpus
        assert env.node_rank() == rank // gpus
        assert env.main_address == "node00"  # rank 0's node: the first of the allocation
        env.validate_settings(num_devices=gpus, num_nodes=nodes)  # what the sbatch passes: no error
        seen.add((env.node_rank(), env.local_rank()))
    assert len(seen) == world  # one task per (node, GPU)
    with pytest.raises(ValueError, match="ntasks-per-node"):
        env.validate_settings(num_devices=gpus // 2, num_nodes=nodes)
    with pytest.raises(ValueError, match="nodes"):
        env.validate_settings(num_devices=gpus, num_nodes=nodes + 1)


@pytest.mark.parametrize("nodes,gpus", LAYOUTS)
def test_trainer_resolves_rank_and_world_from_slurm(monkeypatch, nodes, gpus):
    """A real Trainer (CPU stands in for the GPUs) on sample tasks: first, last, node boundaries."""
    from lightning.pytorch import Trainer

    world = nodes * gpus
    for rank in sorted({0, 1, gpus - 1, gpus, world // 2 + 3, world - gpus, world - 1}):
        _set_env(monkeypatch, slurm_task_env(nodes, gpus, rank, job_id=99))
        trainer = Trainer(accelerator="cpu", devices=gpus, num_nodes=nodes, strategy="ddp", logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          plugins=[SLURMEnvironment(auto_requeue=False)])
        assert isinstance(trainer.strategy.cluster_environment, SLURMEnvironment)
        assert (trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.world_size) == \
            (rank, rank % gpus, rank // gpus, world)


def test_cli_disables_lightning_auto_requeue_under_slurm(monkeypatch, demo_corpus, cache_dir, tmp_path):
    """train/cli.py adds SLURMEnvironment(auto_requeue=False): StopOnSignal checkpoints at a step
    boundary and the sbatch requeues (Lightning's requeue saves mid-step, Lightning #21406)."""
    from train.cli import WellMixedCLI

    _set_env(monkeypatch, slurm_task_env(2, 2, 3, job_id=5))
    monkeypatch.setenv("WELLMIXED_CACHE", str(cache_dir))
    sources = {s: {"paths": [str(demo_corpus / s / "*.parquet")]} for s in ("web", "code", "books", "curated")}
    cli = WellMixedCLI(
        args=[
            "--config",
            str(ROOT / "configs/demo.yaml"),
            "--model.model",
            str(ROOT / "configs/model/tiny.yaml"),
            "--data.sources",
            json.dumps(sources),
            "--run.wandb",
            "false",
            "--run.dir",
            str(tmp_path / "run"),
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "2",
            "--trainer.num_nodes",
            "2",
            "--data.batch_size",
            "1",
        ],
        run=False,
    )
    env = cli.trainer.strategy.cluster_environment
    assert isinstance(env, SLURMEnvironment) and env.auto_requeue is False
    assert (cli.trainer.global_rank, cli.trainer.local_rank, cli.trainer.node_rank, cli.trainer.world_size) == (
        3,
        1,
        1,
        4,
    )


@pytest.mark.parametrize("nodes,gpus,workers", [(4, 8, 2), (64, 8, 2), (64, 8, 1)])
def test_data_slice_of_each_rank(monkeypatch, make_cfg, nodes, gpus, workers):
    """Rank r's DataLoader worker w is consumer r*W + w of ranks x W: what the data layer builds."""
    cfg = make_cfg(num_workers=workers)
    manifest = build_manifest(cfg)
    world = nodes * gpus
    owner = {}
    for rank in range(world):
        _set_env(monkeypatch, slurm_task_env(nodes, gpus, rank))
        info = rank_info()
        assert info.global_rank == rank and info.world_size == world
        ids = consumer_ids(info.global_rank, workers)
        assert ids == [rank * workers + w for w in range(workers)]
        for w in range(workers):
            cs = ConsumerStream(manifest, cfg, rank, world, w, workers, lambda s: None, lambda s: 32)
            assert (cs.consumer, cs.num_consumers) == (ids[w], world * workers)
            assert all(s.consumer == ids[w] and s.num_consumers == world * workers for s in cs.sources)
            owner[cs.consumer] = rank
    assert sorted(owner) == list(range(world * workers))  # every consumer belongs to exactly one rank


def _docs_of_epoch_elements(manifest, cfg, num_consumers: int, epochs: int):
    """(source, epoch) -> Counter of doc ids, and -> {doc id: consumer}, from the element arithmetic:
    consumer c takes elements c, c+C, c+2C, ... (SourceStream.chunk_at maps an element to its chunk)."""
    counts: dict[tuple[str, int], Counter] = defaultdict(Counter)
    reader_of: dict[tuple[str, int, str], set[int]] = defaultdict(set)
    for i, (name, info) in enumerate(manifest.sources.items()):
        n = len(info.chunks)
        for c in range(num_consumers):
            st = SourceStream(i, name, info.chunks, None, cfg, c, num_consumers)
            g = st.consumer
            while g < epochs * n:
                epoch, chunk = st.chunk_at(g)
                for row in range(chunk.start, chunk.stop):
                    doc = manifest.doc_id(chunk.shard, row)
                    counts[(name, epoch)][doc] += 1
                    reader_of[(name, epoch, doc)].add(c)
                g += st.num_consumers
    return counts, reader_of


@pytest.mark.parametrize("nodes,gpus,workers", [(4, 8, 2), (64, 8, 2)])
def test_no_two_ranks_share_a_document_within_a_source_epoch(make_cfg, nodes, gpus, workers):
    """Every document of every source is read exactly once per source-epoch by the whole job, so by
    one rank only -- also for 512 ranks x 2 workers, more consumers than any source has chunks."""
    cfg = make_cfg(num_workers=workers)
    manifest = build_manifest(cfg)
    world = nodes * gpus
    C = world * workers
    epochs = 3
    counts, reader_of = _docs_of_epoch_elements(manifest, cfg, C, epochs)
    for name, info in manifest.sources.items():
        all_docs = {manifest.doc_id(ch.shard, r) for ch in info.chunks for r in range(ch.start, ch.stop)}
        assert len(all_docs) == info.docs
        for epoch in range(epochs):
            got = counts[(name, epoch)]
            assert set(got) == all_docs, f"{name} epoch {epoch}: not every document is read"
            assert max(got.values()) == 1, f"{name} epoch {epoch}: a document is read twice"
    ranks_per_doc = {key: {c // workers for c in cs} for key, cs in reader_of.items()}
    assert all(len(r) == 1 for r in ranks_per_doc.values())
    if C > max(len(i.chunks) for i in manifest.sources.values()):
        # more consumers than chunks: later consumers start in a later epoch, still exactly once per epoch
        readers_epoch0 = {c for (name, epoch, _), cs in reader_of.items() if epoch == 0 for c in cs}
        assert max(readers_epoch0) < C


def test_simulated_consumers_emit_each_document_once_per_epoch_at_512_ranks(monkeypatch, make_cfg):
    """The real consumers of 64 x 8 ranks x 2 workers (ConsumerStream -> SourceStream: open chunks,
    shuffle buffer), with the parquet read replaced by the chunk's row addresses (no text read):
    across all 1024 consumers no (source, epoch, document) is emitted twice."""
    from data.reader import HeldText

    nodes, gpus, workers = 64, 8, 2
    world = nodes * gpus
    cfg = make_cfg(num_workers=workers, buffer_size=3, open_shards=2)
    manifest = build_manifest(cfg)

    class Addresses:
        """A LazyChunk stand-in: the chunk's row addresses, no text."""

        def __init__(self, shard: int, rows: list[int]):
            self.shard, self.rows, self.pos = shard, rows, 0

        @property
        def left(self) -> int:
            return len(self.rows) - self.pos

        def take(self):
            self.pos += 1
            return self.rows[self.pos - 1], HeldText.of(b"")

    def load_addresses(self, g, skip=0):
        chunk = self.chunk_at(g)[1]
        return Addresses(chunk.shard, list(range(chunk.start + skip, chunk.stop)))

    monkeypatch.setattr(SourceStream, "_load", load_addresses)
    emitted: dict[tuple[int, int, int, int], int] = {}
    for rank in range(world):
        for w in range(workers):
            cs = ConsumerStream(manifest, cfg, rank, world, w, workers, lambda s: None, lambda s: 32)
            for src in cs.sources:
                for _ in range(12):
                    d = src.next_doc()
                    key = (d.source, d.epoch, d.shard, d.row)
                    assert key not in emitted, f"{key} emitted by ranks {emitted[key]} and {rank}"
                    emitted[key] = rank
    assert len(emitted) == world * workers * len(manifest.sources) * 12


# -- launcher helpers ----------------------------------------------------------------------------
def test_nodelist_expansion_and_simulated_layout():
    assert expand_nodelist("gpu[01-03,07],login2") == ["gpu01", "gpu02", "gpu03", "gpu07", "login2"]
    assert expand_nodelist(simulated_nodelist(64))[-1] == "node63"
    env = slurm_task_env(64, 8, 511)
    assert (env["SLURM_PROCID"], env["SLURM_LOCALID"], env["SLURM_NODEID"], env["SLURM_NTASKS"]) == (
        "511",
        "7",
        "63",
        "512",
    )
    with pytest.raises(ValueError):
        slurm_task_env(4, 8, 32)


def test_master_port_is_derived_per_job_and_skips_a_taken_port():
    # consecutive jobs (likely to share a node) get different ports; array tasks consecutive ones
    assert len({derived_port(j) for j in range(734500, 734600)}) == 100
    assert derived_port(1, 500, 3) == derived_port(1, 500, 0) + 3
    # Lightning's default (15000 + last 4 digits) gives two running jobs the same port; the check walks on
    job = next(j for j in range(10**6, 10**6 + 500) if all(port_is_free(p) for p in probe_ports(derived_port(j), 2)))
    first, second = probe_ports(derived_port(job), 2)
    assert second not in {derived_port(job + d) for d in range(-100, 101)}  # not a neighbouring job's port
    with socket.socket() as taken:
        taken.bind(("", first))
        taken.listen()
        assert not port_is_free(first)
        assert master_port({"SLURM_JOB_ID": str(job)}) == second
    assert master_port({"SLURM_JOB_ID": str(job)}) == first
    probes = probe_ports(20000, 10000)
    assert len(set(probes)) == 10000 and min(probes) == 20000 and max(probes) == 29999


def test_patched_environ_restores_everything(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("MASTER_PORT", "1234")
    with patched_environ(slurm_task_env(2, 4, 5)):
        assert os.environ["SLURM_PROCID"] == "5" and "MASTER_PORT" not in os.environ
        rank_info()  # Lightning writes MASTER_ADDR / MASTER_PORT into os.environ
    assert os.environ["SLURM_JOB_ID"] == "1" and os.environ["MASTER_PORT"] == "1234"
    assert "SLURM_PROCID" not in os.environ


def test_dry_run_simulated_512_ranks(monkeypatch, capsys, demo_corpus, cache_dir):
    monkeypatch.setenv("WELLMIXED_CACHE", str(cache_dir))
    sources = {s: {"paths": [str(demo_corpus / s / "*.parquet")]} for s in ("web", "code", "books", "curated")}
    rc = dry_run(["--simulate", "64x8", "--ranks", "0,1,8,511", "--", "--config", str(ROOT / "configs/demo.yaml"),
                  "--data.sources", json.dumps(sources), "--data.num_workers", "2", "--data.batch_size", "1",
                  "--data.schedule.global_batch_size", "512", "--data.schedule.train_tokens", "20000000"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "world size  512 = 64 nodes x 8 tasks per node" in out
    assert "global_batch_size 512: ok" in out
    assert "rank     0 node 0 (node00) local 0: consumers 0..1 of 1024" in out
    assert "rank     8 node 1 (node01) local 0: consumers 16..17 of 1024" in out
    assert "rank   511 node 63 (node63) local 7: consumers 1022..1023 of 1024" in out
    assert "  ...\n" in out  # the gap between rank 1 and rank 8
    assert "web: 83 chunks < 1024 consumers" in out
    # a layout whose global batch does not match is reported (training would refuse it), exit code 2
    rc = dry_run(["--simulate", "4x8", "--ranks", "none", "--", "--config", str(ROOT / "configs/demo.yaml"),
                  "--data.sources", json.dumps(sources)])
    assert rc == 2 and "MISMATCH" in capsys.readouterr().out


def test_dry_run_slices_are_what_the_consumers_read(make_cfg):
    """SliceTable (the dry run's per-rank chunks) against the real stream: the first documents each
    consumer's shuffle buffer takes come from the first chunks the table lists for that consumer."""
    from train.launch import SliceTable

    world, workers = 2, 2
    cfg = make_cfg(num_workers=workers, buffer_size=4, open_shards=2)
    manifest = build_manifest(cfg)
    table = SliceTable(manifest, cfg, world * workers)
    for rank in range(world):
        for w in range(workers):
            cs = ConsumerStream(manifest, cfg, rank, world, w, workers, lambda s: None, lambda s: 32)
            for s, src in enumerate(cs.sources):
                first = src.next_doc()  # fills the buffer: B documents from the first open chunks
                # enough elements to hold the buffer, plus the k kept open ahead of it
                listed, docs = [], 0
                for g, epoch, chunk in table.elements(s, cs.consumer, 64):
                    listed.append((epoch, chunk))
                    docs += chunk.stop - chunk.start
                    if docs >= cfg.buffer_size:
                        break
                listed += [
                    (e, c) for _, e, c in table.elements(s, cs.consumer, len(listed) + cfg.open_shards)[len(listed) :]
                ]
                assert any(
                    e == first.epoch and c.shard == first.shard and c.start <= first.row < c.stop for e, c in listed
                )
                assert table.elements(s, cs.consumer, 1)[0][2] == src.chunk_at(cs.consumer)[1]
