"""The contract between the stages: what a document, a row's leftover and a batch are.

The packer (``data/packer.py``) builds a :class:`Batch`; the held-out set builds the same keys that
the module reads; the order log writes :func:`data.simulate.order_line` of it. Token arrays are
numpy here; the DataLoader turns them into tensors on the way (``train/datamodule.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

if TYPE_CHECKING:
    from data.cursor import ConsumerCursor
    from data.reader import HeldText
    from data.schedules import Schedule


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


class TrainBatch(TypedDict):
    """A micro-batch of one global step from one consumer (rank, worker).

    ``input_ids``/``targets``/``target_source``/``doc_index`` are [B, L]; ``pieces`` are the document
    pieces ``[doc_id, first_token_offset, n_tokens]`` covering the input tokens row after row;
    ``source_tokens`` and ``weights`` are per source in manifest order; ``cursor`` is the consumer's
    state after this batch (data/cursor.py; serialised only when a checkpoint is written).
    """

    step: int
    rank: int
    worker: int
    input_ids: Any
    targets: Any
    target_source: Any
    doc_index: Any
    pieces: list[list[int]]
    source_tokens: Any
    weights: Any
    cursor: ConsumerCursor


class EvalBatch(TypedDict):
    """A held-out batch: the tensor keys of :class:`TrainBatch` only."""

    input_ids: Any
    targets: Any
    target_source: Any
    doc_index: Any


TENSOR_KEYS = ("input_ids", "targets", "target_source", "doc_index")
"""The keys the model and the loss read; everything else in a batch is bookkeeping."""


@dataclass(frozen=True)
class TrainingContext:
    """What the training side (the LightningModule, the throughput and progress callbacks) needs to know
    of the data, handed over in one piece by ``WellMixedData.context()`` instead of attribute reaches."""

    source_names: tuple[str, ...]
    """The mixture's sources, in manifest order: the index ``target_source`` holds."""
    schedule: Schedule
    """The pure schedules of the global (optimizer) step: ``lr(step)``, ``tokens_at(step)``,
    ``total_steps``, ..."""
    held_out: Callable[[], Iterable[EvalBatch]] | None
    """A fresh iterable of this rank's held-out batches (tensors); None when the run holds none out."""
    num_workers: int
    """DataLoader workers per rank (each one a consumer of the data order)."""
