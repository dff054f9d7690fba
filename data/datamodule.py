"""The Lightning DataModule: the stream of data/stream.py behind DataLoader workers, with its cursor.

The DataModule *is* the data config (a dataclass over :class:`DataConfig`), so LightningCLI's
``data:`` section, ``scripts/dump_order.py`` and the tests read one schema.

Resume, as DESIGN.md section 5 asks:

- every batch carries its producer's cursor (the consumer's state right after producing it);
  :meth:`record` keeps, per worker, the cursor of the last batch that was *trained* (called from a
  callback after the optimizer step, so prefetched batches never leak into a checkpoint);
- :meth:`state_dict` is called on every rank when a checkpoint is written; it gathers all ranks'
  cursors into the checkpoint (Lightning writes rank 0's copy only);
- on resume the DataLoader worker ``i`` takes over consumer ``(i + next_step) % W``, because the
  DataLoader asks worker 0 first and step s must come from the consumer that owns s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterator

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data.config import DataConfig
from data.errors import ConfigError
from data.manifest import Manifest, build_manifest
from data.order import StepSchedule, order_line
from data.reader import ShardReader
from data.stream import ConsumerStream, pack_cursor

log = logging.getLogger(__name__)
TENSOR_KEYS = ("input_ids", "targets", "target_source", "doc_index")


def to_torch(batch: dict) -> dict:
    out = dict(batch)
    for key in TENSOR_KEYS:
        out[key] = torch.from_numpy(np.ascontiguousarray(batch[key]).astype(np.int64))
    out["source_tokens"] = torch.from_numpy(batch["source_tokens"])
    out["weights"] = torch.from_numpy(batch["weights"])
    return out


class ConsumerDataset(IterableDataset):
    """One rank's training stream; each DataLoader worker runs one consumer of the global order."""

    def __init__(self, manifest: Manifest, cfg: DataConfig, rank: int, world_size: int, steps: StepSchedule,
                 cursors: list[dict | None] | None, next_step: int):
        self.manifest, self.cfg, self.rank, self.world_size = manifest, cfg, rank, world_size
        self.steps, self.cursors, self.next_step = steps, cursors, next_step
        self.workers = max(1, cfg.num_workers)

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        slot = info.id if info is not None else 0
        consumer = (slot + self.next_step) % self.workers
        stream = ConsumerStream(self.manifest, self.cfg, self.rank, self.world_size, consumer, self.workers,
                                self.steps.weights, self.steps.seq_len)
        cursor = self.cursors[consumer] if self.cursors else None
        if cursor is not None:
            stream.load_state_dict(cursor)
        elif self.next_step:
            raise ConfigError(f"no data cursor for rank {self.rank} worker {consumer} at step {self.next_step}")
        while True:
            yield to_torch(stream.next_batch())


class HeldOutDataset(torch.utils.data.Dataset):
    """Validation batches per source from chunks training never reads: same for every seed and arm."""

    def __init__(self, manifest: Manifest, cfg: DataConfig, seq_len: int, rank: int, world_size: int):
        reader = ShardReader(manifest, cfg)
        self.batches = []
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
                    "doc_index": torch.cumsum(part[:, :-1] == 100257, dim=1) - (part[:, :-1] == 100257).long(),
                })
        self.batches = self.batches[rank::world_size]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict:
        return self.batches[i]


@dataclass(eq=False)
class WellMixedData(DataConfig, L.LightningDataModule):
    """LightningDataModule over the two-level stream; its init arguments are the ``data:`` config."""

    def __post_init__(self) -> None:
        L.LightningDataModule.__init__(self)
        DataConfig.__post_init__(self)
        self.manifest: Manifest | None = None
        self.steps: StepSchedule | None = None
        self.accumulate = 1
        self._restored: dict | None = None
        self._trained: dict[int, dict] = {}  # worker -> cursor after the last trained batch
        self._order_log = None

    # -- set-up ----------------------------------------------------------------------------------
    def prepare(self, accumulate_grad_batches: int = 1) -> None:
        """Manifest + schedules, before any compute (also what the CLI's start-up checks call)."""
        if self.manifest is None:
            self.manifest = build_manifest(self)
            self.accumulate = accumulate_grad_batches
            self.steps = StepSchedule.from_config(self, accumulate_grad_batches)

    def setup(self, stage: str) -> None:
        self.prepare(self.trainer.accumulate_grad_batches if self.trainer else 1)
        if self.steps.schedule is not None and self.trainer is not None:
            world = self.trainer.world_size * self.accumulate
            want = self.steps.schedule.config.global_batch_size
            if self.batch_size * world != want:
                raise ConfigError(
                    f"data.schedule.global_batch_size ({want}) != data.batch_size ({self.batch_size}) x "
                    f"{self.trainer.world_size} ranks x {self.accumulate} accumulation; make them agree"
                )

    @property
    def rank(self) -> int:
        return self.trainer.global_rank if self.trainer else 0

    @property
    def world_size(self) -> int:
        return self.trainer.world_size if self.trainer else 1

    def train_dataloader(self) -> DataLoader:
        cursors, next_step = None, 0
        if self._restored is not None:
            cursors = self._restored["cursors"][self.rank]
            next_step = self._restored["next_step"]
        ds = ConsumerDataset(self.manifest, self, self.rank, self.world_size, self.steps, cursors, next_step)
        return DataLoader(ds, batch_size=None, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0, prefetch_factor=2 if self.num_workers else None)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_tokens_per_source <= 0:
            return []
        seq_len = self.steps.seq_len(10**12)  # the final (longest) sequence length
        ds = HeldOutDataset(self.manifest, self, seq_len, self.rank, self.world_size)
        return DataLoader(ds, batch_size=None, num_workers=0)

    # -- cursor ----------------------------------------------------------------------------------
    def record(self, batch: dict) -> None:
        """The batch was trained (optimizer step done): its cursor is now the one to checkpoint."""
        self._trained[int(batch["worker"])] = batch["cursor"]

    def state_dict(self) -> dict[str, Any]:
        workers = max(1, self.num_workers)
        mine = [None if w not in self._trained else pack_cursor(self._trained[w]) for w in range(workers)]
        if self._restored is not None:  # workers that have not trained a batch since the resume
            old = self._restored["cursors"][self.rank]
            mine = [m if m is not None else o for m, o in zip(mine, old)]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        step = self.trainer.global_step if self.trainer else 0
        return {
            "cursors": gathered,
            "next_step": step * self.accumulate,
            "world_size": len(gathered),
            "num_workers": workers,
            "seed": self.seed,
            "fingerprint": self.manifest.fingerprint() if self.manifest else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prepare(self.trainer.accumulate_grad_batches if self.trainer else 1)
        problems = []
        if state["fingerprint"] != self.manifest.fingerprint():
            problems.append(f"the corpus changed (fingerprint {state['fingerprint']} -> {self.manifest.fingerprint()})")
        if state["seed"] != self.seed:
            problems.append(f"data.seed changed ({state['seed']} -> {self.seed})")
        if (state["world_size"], state["num_workers"]) != (self.world_size, max(1, self.num_workers)):
            problems.append(
                f"ranks x workers changed ({state['world_size']} x {state['num_workers']} -> "
                f"{self.world_size} x {max(1, self.num_workers)})"
            )
        if problems:
            raise ConfigError("cannot resume the data order exactly: " + "; ".join(problems))
        self._restored = state
        self._trained = {}

    # -- order log -------------------------------------------------------------------------------
    def order_log_line(self, batch: dict, loss: float | None) -> dict:
        line = order_line(
            {**batch, "input_ids": batch["input_ids"], "source_tokens": batch["source_tokens"].tolist(),
             "weights": batch["weights"].tolist()},
            self.manifest.source_names, self.steps.lr,
        )
        if loss is not None:
            line["loss"] = loss
        return line
