"""The Lightning DataModule: the stream of data/stream.py behind DataLoader workers, with its cursor.

:class:`WellMixedData` passes its data config (a :class:`DataConfig`, the ``data:`` section) and the rank
facts down to the framework-free data path: a DataLoader worker receives those, never the Trainer.

Resume (docs/checkpoints.md has the file layout, the checks and the elastic re-cut): every batch
carries its producer's cursor; :meth:`record` keeps, per worker, that of the last batch *trained*
(called after the optimizer step, so prefetched batches never leak into a checkpoint); each rank writes
its own workers' cursors to a file beside the checkpoint (train/cursor_files.py) and reads back only its
own unless the layout changed; the ranks then agree on whether every rank's cursors were usable, so a
damaged file ends every rank with one error line. DataLoader worker ``i`` takes over consumer
``(i + next_step) % W``, because the DataLoader asks worker 0 first and step s must come from the
consumer that owns s. Another layout is re-cut with data/elastic.py unless ``elastic`` is off; a changed
corpus or seed is refused unless ``allow_changed_data``.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data.config import DataConfig
from data.cursor import ConsumerCursor, read_order_state
from data.elastic import redistribute, reseed
from data.errors import ConfigError
from data.manifest import Manifest, build_manifest
from data.packer import ConsumerStream
from data.plan import effective_streams, stream_table
from data.reader import ShardReader
from data.steps import StepSchedule
from data.types import TENSOR_KEYS, EvalBatch, TrainBatch, TrainingContext
from train.cursor_files import (
    claim_step_dir,
    gather_digests,
    load_checkpoint_cursors,
    save_rank_cursors,
    way_out_on_several_ranks,
)
from train.parallel import check_global_batch
from train.resume import check_data_settings, check_schedule_unchanged, data_settings, schedule_fingerprint

log = logging.getLogger(__name__)


class ReportedByRankZero(SystemExit):
    """Ends a rank (exit code 2) whose error global rank 0 reports for every rank, so it is printed once."""


def to_torch(batch: TrainBatch[np.ndarray]) -> TrainBatch[torch.Tensor]:
    """The packer's batch with tensors for arrays (the token keys as int64), as the DataLoader delivers it."""
    out = dict(batch)
    for key in TENSOR_KEYS:
        out[key] = torch.from_numpy(np.ascontiguousarray(batch[key]).astype(np.int64))
    out["source_tokens"] = torch.from_numpy(batch["source_tokens"])
    out["weights"] = torch.from_numpy(batch["weights"])
    return out


class ConsumerDataset(IterableDataset):
    """One rank's training stream; each DataLoader worker runs one consumer of the global order."""

    def __init__(self, manifest: Manifest, cfg: DataConfig, rank: int, world_size: int, steps: StepSchedule,
                 cursors: list[ConsumerCursor | None] | None, next_step: int):
        self.manifest, self.cfg, self.rank, self.world_size = manifest, cfg, rank, world_size
        self.steps, self.cursors, self.next_step = steps, cursors, next_step
        self.workers = max(1, cfg.num_workers)

    def __iter__(self) -> Iterator[TrainBatch[torch.Tensor]]:
        info = get_worker_info()
        slot = info.id if info is not None else 0
        consumer = (slot + self.next_step) % self.workers
        stream = ConsumerStream(self.manifest, self.cfg, self.rank, self.world_size, consumer, self.workers,
                                self.steps.weights, self.steps.seq_len)
        cursor = self.cursors[consumer] if self.cursors else None
        if cursor is not None:
            stream.restore(cursor)
        elif self.cursors is None and self.next_step:  # allow_changed_data: a fresh order from this step
            stream.next_step = self.next_step + slot
        # else: this consumer has not trained a batch yet (e.g. a checkpoint at step 1 with 2 workers):
        # its initial state is the one to continue from.
        while True:
            yield to_torch(stream.next_batch())


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers ignore SIGTERM/SIGUSR1: SLURM signals every process of the job step, and a
    worker killed by it would crash the main process before it can checkpoint (train/signals.py)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


class HeldOutDataset(torch.utils.data.Dataset):
    """Validation batches per source from chunks training never reads: same for every seed and arm."""

    def __init__(self, manifest: Manifest, cfg: DataConfig, seq_len: int, rank: int, world_size: int):
        reader = ShardReader(manifest, cfg)
        eot = reader.tokenizer.eot_id
        self.batches: list[EvalBatch[torch.Tensor]] = []
        for s, info in enumerate(manifest.sources.values()):
            docs = [doc for chunk in info.val_chunks for doc in reader.read_chunk(s, chunk)[1]]
            tokens = np.concatenate(docs).astype(np.int64)[: cfg.val_tokens_per_source + 1]
            n_rows = (len(tokens) - 1) // seq_len
            rows = np.stack([tokens[i * seq_len:(i + 1) * seq_len + 1] for i in range(n_rows)])
            for i in range(0, n_rows, cfg.batch_size):
                part = torch.from_numpy(rows[i:i + cfg.batch_size])
                self.batches.append({
                    "input_ids": part[:, :-1], "targets": part[:, 1:],
                    "target_source": torch.full_like(part[:, 1:], s),
                    "doc_index": torch.cumsum(part[:, :-1] == eot, dim=1) - (part[:, :-1] == eot).long(),
                })
        self.batches = self.batches[rank::world_size]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> EvalBatch[torch.Tensor]:
        return self.batches[i]


def _plain(value: Any) -> Any:
    """Dataclasses as dicts, tuples as lists: what jsonargparse parses back into the config types."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass
class _Resume:
    """What :meth:`WellMixedData.load_state_dict` accepted; the cursors themselves are read on first use."""

    next_step: int
    """The first data step (micro-batch) to train, in this run's units."""
    state: dict | None
    """The checkpoint's data state; None: a fresh data order from ``next_step`` (run.allow_changed_data)."""
    recut: bool = False
    """Another layout: data/elastic.py re-cuts every old consumer's cursors for this rank."""
    reseed: bool = False
    """A branch replicate (``data.replicate``): data/elastic.py re-seeds this rank's cursors once read."""
    mine: list | None = None
    """This rank's cursors, one per worker, once read."""


class WellMixedData(L.LightningDataModule):
    """LightningDataModule over the two-level stream. It holds the ``data:`` config (:attr:`config`, a
    :class:`DataConfig`: what the data path and every DataLoader worker receive, with the rank facts) and
    the resume policy below, which the CLI passes from ``run.*`` (they say how to treat a checkpoint, not
    what the data is, so they are not ``data:`` keys)."""

    def __init__(self, config: DataConfig, elastic: bool = True, allow_changed_data: bool = False,
                 allow_changed_schedule: bool = False, branch: bool = False):
        """``elastic``: a resume with another layout re-cuts the cursors (else it is refused);
        ``allow_changed_data``: a changed corpus or seed starts a fresh order (else refused);
        ``allow_changed_schedule``: a changed schedule applies from the resumed step (else refused);
        ``branch``: another mixture from the resumed step on, nothing else (a decay branch)."""
        super().__init__()
        self.config = config
        self.elastic, self.allow_changed_data, self.allow_changed_schedule, self.branch = \
            elastic, allow_changed_data, allow_changed_schedule, branch
        self._context: TrainingContext | None = None  # the prepared data, once prepare() ran
        self._resume: _Resume | None = None
        self._trained: dict[int, ConsumerCursor] = {}  # worker -> cursor after the last trained batch
        # The data config in the checkpoint (plain types: weights_only loading), so that
        # WellMixedData.load_from_checkpoint rebuilds it; loggers get the whole config from the CLI.
        self.save_hyperparameters({"config": _plain(config),
                                   "_instantiator": "lightning.pytorch.cli.instantiate_module"}, logger=False)

    # -- set-up ----------------------------------------------------------------------------------
    def prepare(self, accumulate_grad_batches: int = 1) -> TrainingContext:
        """The prepared data (manifest + schedules), built before any compute on the first call (also
        what the CLI's start-up checks, launch's dry run and evaluate call); later calls return it."""
        if self._context is None:
            manifest = build_manifest(self.config)
            steps = StepSchedule.from_config(self.config, accumulate_grad_batches)
            self._context = TrainingContext(
                config=self.config,
                manifest=manifest,
                schedule=steps.by_optimizer_step,
                steps=steps,
                held_out=self.val_dataloader if self.config.val_tokens_per_source > 0 else None,
            )
        return self._context

    def context(self) -> TrainingContext:
        """The prepared data (data/types.py): what the module, the callbacks and the tools read of the data."""
        if self._context is None:
            raise RuntimeError("WellMixedData.context() before prepare() or setup()")
        return self._context

    def setup(self, stage: str) -> None:
        ctx = self.prepare(self.trainer.accumulate_grad_batches if self.trainer else 1)
        if self.trainer is not None:
            check_global_batch(ctx.schedule.config.global_batch_size, self.config.batch_size,
                               self.trainer.world_size, ctx.accumulate)
        if stage == "fit" and self.rank == 0:
            self._report_capped_streams()

    def _report_capped_streams(self) -> None:
        """Say at start-up where ranks x workers x open chunks (or the buffer) ask more of a source than
        one epoch gives a consumer: the epoch barrier (data/stream.py) keeps every document once per
        source-epoch, but those consumers then read fewer chunks at once (a weaker shuffle) than the
        config says."""
        manifest, cfg = self.context().manifest, self.config
        consumers = self.world_size * max(1, cfg.num_workers)
        eff = effective_streams(manifest, cfg, consumers)
        capped = [name for name, e in eff.items() if e["open"] < cfg.open_shards or e["buffer"] < cfg.buffer_size]
        if capped:
            log.warning("%s: fewer documents or chunks per consumer-epoch than data.open_shards %d / data.buffer_size "
                        "%d ask (%d consumers = ranks x workers); each document is still read once per epoch, "
                        "from fewer chunks at once:\n%s", ", ".join(capped), cfg.open_shards, cfg.buffer_size,
                        consumers, stream_table(manifest, cfg, consumers))

    @property
    def rank(self) -> int:
        return self.trainer.global_rank if self.trainer else 0

    @property
    def world_size(self) -> int:
        return self.trainer.world_size if self.trainer else 1

    def train_dataloader(self) -> DataLoader:
        cursors, next_step = self._agreed_resumed_cursors(), 0
        if self._resume is not None:
            next_step = self._resume.next_step
        ctx = self.context()
        ds = ConsumerDataset(ctx.manifest, self.config, self.rank, self.world_size, ctx.steps, cursors, next_step)
        workers = self.config.num_workers
        return DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0,
                          prefetch_factor=2 if workers else None,
                          worker_init_fn=ignore_stop_signals if workers else None)

    def val_dataloader(self) -> DataLoader | list:
        if self.config.val_tokens_per_source <= 0:
            return []
        ctx = self.context()
        seq_len = ctx.steps.seq_len(10**12)  # the final (longest) sequence length
        ds = HeldOutDataset(ctx.manifest, self.config, seq_len, self.rank, self.world_size)
        return DataLoader(ds, batch_size=None, num_workers=0)

    # -- cursor ----------------------------------------------------------------------------------
    def record(self, batch: TrainBatch[torch.Tensor]) -> None:
        """The batch was trained (optimizer step done): its cursor is now the one to checkpoint."""
        self._trained[int(batch["worker"])] = batch["cursor"]

    def state_dict(self) -> dict[str, Any]:
        """The data state of a checkpoint, on every rank: this rank's cursors go to its own file (see
        train/cursor_files.py), the returned state (rank 0's is the one saved) names their folder."""
        saved = [None if c is None else c.to_dict() for c in self._cursors_to_save()]  # buffers packed
        step = self.trainer.global_step if self.trainer else 0
        state = self._layout(step)
        ckpt_dir = self._checkpoint_dir()
        if ckpt_dir is None:
            if self.world_size > 1:
                raise ConfigError("the data cursors of several ranks are saved to per-rank files beside the "
                                  "checkpoints: give the Trainer a ModelCheckpoint callback (its dirpath is used)")
            return {**state, "cursors": [saved]}
        strategy = self.trainer.strategy
        cursor_dir = strategy.broadcast(claim_step_dir(ckpt_dir, step) if self.trainer.is_global_zero else None, src=0)
        digest = save_rank_cursors(ckpt_dir / cursor_dir, self.rank, saved, state["next_step"])
        digests = gather_digests(strategy, digest, self.world_size)  # the checkpoint records every rank's
        strategy.barrier("WellMixedData.state_dict")  # every rank's file is in place before the checkpoint names it
        return {**state, "cursor_dir": cursor_dir, "cursor_sha256": digests}

    def _cursors_to_save(self) -> list[ConsumerCursor | None]:
        """Per worker, the cursor after its last trained batch; a worker idle since the resume keeps the
        cursor it resumed with."""
        mine = [self._trained.get(w) for w in range(max(1, self.config.num_workers))]
        resumed = self._resumed_cursors()
        return mine if resumed is None else [m if m is not None else o for m, o in zip(mine, resumed)]

    def _layout(self, step: int) -> dict[str, Any]:
        """What a resume compares at optimizer step ``step``: the layout, seed, corpus and schedule."""
        ctx = self._context
        accumulate = ctx.accumulate if ctx else 1
        return {
            "next_step": step * accumulate,
            "world_size": self.world_size,
            "num_workers": max(1, self.config.num_workers),
            "batch_size": self.config.batch_size,
            "accumulate": accumulate,
            "seed": self.config.seed,
            "replicate": self.config.replicate,
            "fingerprint": ctx.manifest.fingerprint() if ctx else None,
            "corpus_files": ctx.manifest.file_digests() if ctx else None,
            "schedule": schedule_fingerprint(self.config.schedule),
            "data_settings": data_settings(self.config),
        }

    def _checkpoint_dir(self) -> Path | None:
        """Where the cursor files go: the folder of the trainer's ModelCheckpoint (the CLI's
        ``<run>/checkpoints``, where FinalCheckpoint and StopOnSignal write); None without one."""
        callback = self.trainer.checkpoint_callback if self.trainer is not None else None
        dirpath = getattr(callback, "dirpath", None)
        return Path(dirpath) if dirpath else None

    def _resumed_cursors(self) -> list[ConsumerCursor | None] | None:
        """This rank's cursors of the checkpoint resumed from (None: no resume, or a fresh order), read on
        first use: its own file with the same layout, every old rank's file for an elastic re-cut."""
        resume = self._resume
        if resume is None or resume.state is None:
            return None
        if resume.mine is None and resume.recut:
            workers = max(1, self.config.num_workers)
            # every old rank's file, on every rank: the re-cut pools the pending work of all old consumers
            cursors = redistribute(self._load_cursors(resume.state, None), self.context().manifest,
                                   seed=self.config.seed, world_size=self.world_size, num_workers=workers,
                                   batch_size=self.config.batch_size,
                                   resume_step=resume.next_step, ranks=[self.rank])  # this rank's new cursors only
            resume.mine = cursors[self.rank]
        elif resume.mine is None:
            resume.mine = self._load_cursors(resume.state, [self.rank])[0]  # the same layout: its own file only
        if resume.reseed:  # a branch replicate: the same work drawn in another order (data/elastic.py)
            resume.mine = [reseed(c, self.config.replicate, resume.next_step) for c in resume.mine]
            resume.reseed = False
        return resume.mine

    def _agreed_resumed_cursors(self) -> list[ConsumerCursor | None] | None:
        """:meth:`_resumed_cursors`, with every rank learning whether any rank's cursors are unusable.

        Each rank reads its own file here; alone, a rank with a damaged file would end with its error while
        the others wait in their next collective (and die of a lost connection). Instead the ranks agree
        (one all-reduce, one broadcast of the message): global rank 0 raises the failing rank's ConfigError,
        every other rank ends with exit code 2 and no message of its own."""
        try:
            cursors, problem = self._resumed_cursors(), None
        except ConfigError as e:
            cursors, problem = None, e
        resuming = self._resume is not None and self._resume.state is not None  # alike on every rank
        if self.world_size == 1 or not resuming:
            if problem is not None:
                raise problem
            return cursors
        strategy = self.trainer.strategy
        mine = torch.tensor(float(self.rank if problem is not None else self.world_size), device=strategy.root_device)
        first = int(strategy.reduce(mine, reduce_op="min").item())
        if first == self.world_size:
            return cursors
        message = way_out_on_several_ranks(strategy.broadcast(str(problem) if self.rank == first else None, src=first))
        if self.trainer.is_global_zero:
            raise ConfigError(message)
        raise ReportedByRankZero(2)

    def _load_cursors(self, state: dict[str, Any], ranks: list[int] | None) -> list[list[ConsumerCursor | None]]:
        """The checkpoint's cursors of ``ranks`` (all: None), read from its files and range-checked."""
        ckpt_path = self.trainer.ckpt_path if self.trainer is not None else None
        rows = load_checkpoint_cursors(ckpt_path, state, ranks)
        try:
            return read_order_state({"next_step": state["next_step"], "cursors": rows,
                                     "num_workers": state["num_workers"], "world_size": state["world_size"]},
                                    ranks=ranks)
        except ConfigError as e:
            raise ConfigError(f"checkpoint {ckpt_path}: {e}") from None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ctx = self.prepare(self.trainer.accumulate_grad_batches if self.trainer else 1)
        manifest = ctx.manifest
        workers = max(1, self.config.num_workers)
        # Units: next_step counts micro-batches; the optimizer step is what the schedules follow.
        step = state["next_step"] // state.get("accumulate", 1)
        next_step = step * ctx.accumulate
        check_schedule_unchanged(state.get("schedule"), schedule_fingerprint(self.config.schedule),
                                 self.allow_changed_schedule, step, self.branch)
        check_data_settings(state.get("data_settings"), data_settings(self.config), self.allow_changed_data, step)
        changed = []
        if state["fingerprint"] != manifest.fingerprint():
            files = manifest.changed_files(state.get("corpus_files"))
            changed.append(f"the corpus changed (fingerprint {state['fingerprint']} -> {manifest.fingerprint()}"
                           + (f"; {len(files)} file(s): {', '.join(files[:5])}{' ...' if len(files) > 5 else ''}"
                              if files else "") + ")")
        if state["seed"] != self.config.seed:
            changed.append(f"data.seed changed ({state['seed']} -> {self.config.seed})")
        if changed:
            if not self.allow_changed_data:
                raise ConfigError(
                    "cannot resume the data order: " + "; ".join(changed) + ". Restore the corpus and seed, or "
                    "pass --run.allow_changed_data true to start a fresh data order at the resumed step "
                    "(documents already trained on may then be read again)"
                )
            log.warning("resuming with %s (run.allow_changed_data): the data order starts afresh at step %d; "
                        "exactly-once does not hold across this resume", "; ".join(changed), step)
            self._resume, self._trained = _Resume(next_step, None), {}
            return
        old = (
            state["world_size"],
            state["num_workers"],
            state.get("batch_size", self.config.batch_size),
            state.get("accumulate", 1),
        )
        new = (self.world_size, workers, self.config.batch_size, ctx.accumulate)
        if old != new:
            what = "ranks x workers x micro-batch x accumulation"
            if not self.elastic:
                raise ConfigError(
                    f"cannot resume the data order exactly: {what} changed ({' x '.join(map(str, old))} -> "
                    f"{' x '.join(map(str, new))}); restore them, or allow an elastic resume "
                    "(--run.elastic true: exactly-once kept, the order differs)"
                )
            log.warning("elastic resume at step %d: %s %s -> %s; the pending work of the old consumers is "
                        "redistributed (each document still read once per epoch, in another order)",
                        step, what, old, new)
        reseed = self.config.replicate not in (0, state.get("replicate", 0))
        if reseed:
            log.warning("replicate %d of the checkpoint's data order at step %d: its pending work re-seeded "
                        "(data.replicate; exactly-once and the token targets kept)", self.config.replicate, step)
        self._resume = _Resume(next_step, state, recut=old != new, reseed=reseed)
        self._trained = {}
