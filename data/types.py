"""The contract between the stages: what a document, a row's leftover and a batch are.

The packer (``data/packer.py``) builds a :class:`TrainBatch` of numpy arrays; the DataLoader turns
it into one of tensors on the way (``train/datamodule.py``), which the module and the callbacks take;
the held-out set builds an :class:`EvalBatch` (the keys the model reads); the order log writes
:func:`data.simulate.order_line` of a batch. :class:`TrainingContext` is the prepared data the
training side reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypedDict, TypeVar

import numpy as np

if TYPE_CHECKING:
    from data.config import DataConfig
    from data.cursor import ConsumerCursor
    from data.manifest import Manifest
    from data.reader import HeldText
    from data.schedules import Schedule
    from data.steps import StepSchedule


@dataclass
class Doc:
    """One read of one document: its address, the source-epoch the read belongs to, its tokens."""

    source: int  # index into the manifest's sources
    shard: int
    row: int
    epoch: int  # the source-epoch this read belongs to
    tokens: np.ndarray | None  # uint32 token ids, EOT last (None while only the text is held, in a buffer)
    text: HeldText | None = None  # compressed text, until the stream tokenizes it on leaving its buffer


@dataclass
class Leftover:
    """The document a batch row is in the middle of, and how many of its tokens it already emitted."""

    doc: Doc
    offset: int


Array = TypeVar("Array")
"""The type of a batch's token arrays: ``np.ndarray`` where the data path builds it (data/packer.py),
``torch.Tensor`` after the DataLoader's worker converted it (train/datamodule.py ``to_torch``)."""


class EvalBatch(TypedDict, Generic[Array]):
    """The keys the model and the loss read (:data:`TENSOR_KEYS`), [B, L] each; alone, a held-out batch."""

    input_ids: Array
    targets: Array
    target_source: Array
    doc_index: Array


class TrainBatch(EvalBatch[Array]):
    """A micro-batch of one global step from one consumer (rank, worker).

    ``input_ids``/``targets``/``target_source``/``doc_index`` are [B, L]; ``pieces`` are the document
    pieces ``[doc_id, first_token_offset, n_tokens]`` covering the input tokens row after row;
    ``source_tokens`` and ``weights`` are per source in manifest order; ``cursor`` is the consumer's
    state after this batch (data/cursor.py; serialised only when a checkpoint is written).
    """

    step: int
    rank: int
    worker: int
    pieces: list[list[int]]
    source_tokens: Array
    weights: Array
    cursor: ConsumerCursor


TENSOR_KEYS = ("input_ids", "targets", "target_source", "doc_index")
"""The keys the model and the loss read; everything else in a batch is bookkeeping."""


@dataclass(frozen=True)
class TrainingContext:
    """The prepared data of a run, built once by ``WellMixedData.prepare()`` and handed over by
    ``WellMixedData.context()``: everything outside train/datamodule.py (the LightningModule, the
    callbacks and loggers, the CLI's start-up checks, launch's dry run, evaluate) reads the data from
    here, never from the DataModule's attributes.

    Naming rule: ``schedule`` is the built :class:`~data.schedules.Schedule`, a pure function of the
    optimizer step. The ``data.schedule`` YAML key it is built from (a ``ScheduleConfig``) is only ever
    spelled ``config.schedule``, and :attr:`steps` (the same schedule per data step, a micro-batch)
    holds the built one as ``steps.by_optimizer_step``.
    """

    config: DataConfig
    """The ``data:`` section (its ``schedule`` is the ScheduleConfig)."""
    manifest: Manifest
    """The corpus: sources, shards, chunks, the held-out split."""
    schedule: Schedule
    """The pure schedules of the global (optimizer) step: ``mixture_weights(step)``, ``tokens_at(step)``,
    ``total_steps``, ..."""
    steps: StepSchedule
    """Mixture weights and sequence length per data step (micro-batch), for the order log and workers."""
    held_out: Callable[[], Iterable[EvalBatch]] | None
    """A fresh iterable of this rank's held-out batches (tensors); None when the run holds none out."""

    @property
    def source_names(self) -> tuple[str, ...]:
        """The mixture's sources, in manifest order: the index ``target_source`` holds."""
        return tuple(self.manifest.source_names)

    @property
    def num_workers(self) -> int:
        """DataLoader workers per rank (each one a consumer of the data order; 0 counts as one)."""
        return self.config.num_workers

    @property
    def accumulate(self) -> int:
        """Micro-batches per optimizer step (gradient accumulation)."""
        return self.steps.accumulate
