"""How the global batch is split over GPUs, and the FSDP strategy that shards the model per block.

**The global batch is fixed; the shape that reaches it is not.** The schedule (LR, sequence-length
warmup, anneal) is tuned for ``data.schedule.global_batch_size`` sequences per optimizer step, so a run
on 1, 8 or 64 GPUs must reach the same number: ``data.batch_size`` (the micro-batch per rank) x ranks
x ``trainer.accumulate_grad_batches``. :func:`check_global_batch` refuses any other product before the
first step and names the knobs (and a combination that works), because a silently different global
batch changes every schedule in tokens. ``configs/presets/{1,8,64}gpu.yaml`` are the worked shapes.

**FSDP with one unit per transformer block.** Lightning's ``--trainer.strategy fsdp`` wraps the whole
model as one flat unit: every rank all-gathers all parameters at once (no memory saved during the
forward) and the checkpoint is one ``torch.save`` file gathered on rank 0. :func:`resolve_strategy`
turns the string ``fsdp`` into Lightning's ``FSDPStrategy`` with ``auto_wrap_policy={Block}`` (one
all-gather per block, overlapped with the previous block's compute) and ``state_dict_type="sharded"``
(``torch.distributed.checkpoint``: each rank writes its own shard; the non-model state, the data
cursors of every rank included, is written once by rank 0 after ``WellMixedData.state_dict`` gathered
them). FSDP1 (``FullyShardedDataParallel``) rather than FSDP2 ``fully_shard``: Lightning 2.6's FSDP2
path (``ModelParallelStrategy``) builds a CUDA device mesh and cannot be exercised on the CPU test
machines, while ``FSDPStrategy`` runs under gloo. At 350M, DDP stays the default (the whole model and
its AdamW moments fit every GPU many times over); FSDP is for a larger model or a smaller GPU.

A DDP checkpoint is one file and a sharded FSDP checkpoint is a folder; Lightning refuses to load one
into the other strategy with its own message. Convert with Lightning's
``python -m lightning.pytorch.utilities.consolidate_checkpoint <folder>`` (sharded -> one file), which
a DDP run then resumes from.
"""

from __future__ import annotations

from typing import Any

from data.errors import ConfigError


def check_global_batch(global_batch: int, batch_size: int, world_size: int, accumulate: int) -> None:
    """Refuse a layout whose micro-batch x ranks x accumulation is not the schedule's global batch."""
    got = batch_size * world_size * accumulate
    if got == global_batch:
        return
    hint = ""
    per_step = batch_size * world_size
    if global_batch % per_step == 0:
        hint = f"; e.g. --trainer.accumulate_grad_batches {global_batch // per_step}"
    elif global_batch % (world_size * accumulate) == 0:
        hint = f"; e.g. --data.batch_size {global_batch // (world_size * accumulate)}"
    raise ConfigError(
        f"global batch mismatch: data.batch_size ({batch_size}) x {world_size} ranks (trainer.devices x "
        f"trainer.num_nodes) x trainer.accumulate_grad_batches ({accumulate}) = {got}, but "
        f"data.schedule.global_batch_size is {global_batch}. Change data.batch_size or "
        f"trainer.accumulate_grad_batches (configs/presets/ has 1, 8 and 64 GPU shapes){hint}"
    )


def fsdp_strategy(**overrides: Any):
    """Lightning's FSDPStrategy, one FSDP unit per :class:`train.model.Block`, sharded checkpoints."""
    from lightning.pytorch.strategies import FSDPStrategy

    from train.model import Block

    kwargs: dict[str, Any] = {
        "auto_wrap_policy": {Block},
        "state_dict_type": "sharded",
        "sharding_strategy": "FULL_SHARD",
        # the tied embedding / LM head stays in the root unit; use_orig_params keeps parameter names
        # and lets AdamW's decay / no-decay groups see the original tensors
        "use_orig_params": True,
    }
    kwargs.update(overrides)
    return FSDPStrategy(**kwargs)


def resolve_strategy(strategy: Any) -> Any:
    """``fsdp`` (the string a config or ``--trainer.strategy`` gives) -> the per-block FSDP strategy;
    anything else (``auto`` = DDP on several devices, a Strategy object) is passed to Lightning as is."""
    if isinstance(strategy, str) and strategy.lower() in ("fsdp", "fsdp_sharded"):
        return fsdp_strategy()
    return strategy
