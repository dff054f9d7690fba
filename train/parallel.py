"""How the global batch is split over GPUs, and the FSDP strategy that shards the model per block.

**The global batch is fixed; the shape that reaches it is not.** ``data.batch_size`` (per rank) x ranks
x ``trainer.accumulate_grad_batches`` must equal ``data.schedule.global_batch_size``, the batch the
schedule is tuned for; :func:`check_global_batch` refuses any other product before the first step and
names a combination that works. ``configs/presets/{1,8,64}gpu.yaml`` are the worked shapes.

**FSDP with one unit per transformer block** (docs/real-run.md). :func:`resolve_strategy` turns
``fsdp`` (or ``fsdp2``) into FSDP2: Lightning's ``ModelParallelStrategy`` over a 1-D mesh of all ranks,
with ``fully_shard`` on each :class:`train.model.Block` and then the root (:func:`shard_per_block`), so
one all-gather per block overlaps the previous block's compute, where Lightning's own ``fsdp`` wraps the
model as one flat unit. FSDP2 because it is the maintained path and runs on CPU ranks under gloo
(tests/integration/test_fsdp.py); ``fsdp1`` gives Lightning's FSDPStrategy with the same per-block
policy, for GPUs only. Checkpoints are ``torch.distributed.checkpoint`` folders; crossing between a
DDP file and a sharded folder on resume is refused.

**DDP reduces every step in one order, so a resume is bitwise** (docs/checkpoints.md). A sum over more
than 2 ranks depends on the order of its terms, and DDP's order is its gradient bucket layout (which
elements share an all-reduce, at which offset). By default DDP reduces a process's first step in one
bucket of every parameter and then rebuilds the buckets in the order backward produced the gradients:
a resumed process reduced its first step unlike the uninterrupted run, whose first step was long past
(4 gloo ranks, the tiny model: 34,077 of 3.2M gradient elements differ in the last bits; 2 ranks: none).
:func:`fix_bucket_layout` asks for ``find_unused_parameters=True``, the one mode in which DDP never
rebuilds: buckets of 25 MB (the first 1 MB) in reverse parameter order, the order backward produces
them, from every process's first step. Its cost per step: one walk of the autograd graph and one small
all-reduce, a flag per parameter tensor (scripts/bench_train.py --ddp); DDP warns once per rank that it
found no unused parameter. FSDP2 needs nothing: each unit reduce-scatters its gradients in the layout
``fully_shard`` fixed at wrapping.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from data.errors import ConfigError

if TYPE_CHECKING:
    from train.architecture import Architecture


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
    """Lightning's FSDPStrategy (FSDP1, GPUs only), one unit per :class:`train.model.Block`, sharded checkpoints."""
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
    """``fsdp`` / ``fsdp2`` / ``fsdp1`` (the string a config or ``--trainer.strategy`` gives) -> per-block FSDP;
    anything else (``auto`` = DDP on several devices, a Strategy object) is passed to Lightning as is."""
    name = strategy.lower() if isinstance(strategy, str) else None
    if name in ("fsdp", "fsdp2"):  # torch FSDP2 (fully_shard), tested on CPU ranks
        return fsdp2_strategy()
    if name == "fsdp1":  # FullyShardedDataParallel, GPUs only
        return fsdp_strategy()
    return strategy


def fix_bucket_layout(strategy: Any) -> None:
    """DDP: one gradient bucket layout from every process's first step on (see the module docstring); set
    before the strategy wraps the model. Any other strategy is left as it is."""
    from lightning.pytorch.strategies import DDPStrategy

    from train.lightning_internals import ddp_kwargs

    if isinstance(strategy, DDPStrategy):
        ddp_kwargs(strategy)["find_unused_parameters"] = True


def shard_per_block(model: Architecture, mesh) -> None:
    """FSDP2: ``fully_shard`` each of ``model.blocks`` (train/architecture.py), then the root (GPT: embedding
    = tied LM head, final norm), so the forward all-gathers one block at a time. Called from the module's
    configure_model under ModelParallelStrategy, before torch.compile."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def fsdp2_strategy(**overrides: Any):
    """Lightning's ModelParallelStrategy over a 1-D data-parallel mesh, distributed checkpoints (the
    per-block ``fully_shard``: :func:`shard_per_block`, from PretrainModule.configure_model)."""
    from train.lightning_internals import FSDP2Strategy  # ModelParallelStrategy, data parallel over every rank

    kwargs: dict[str, Any] = {"save_distributed_checkpoint": True}
    kwargs.update(overrides)
    return FSDP2Strategy(**kwargs)


def check_checkpoint_layout(ckpt_path: str | None, strategy: Any) -> None:
    """Refuse, before compute, a checkpoint whose layout the strategy cannot load: a sharded FSDP folder
    under DDP, or a single-file DDP checkpoint under FSDP. Lightning would fail inside its load with a
    state-dict error that names neither the strategy nor the way out."""
    if ckpt_path is None or ckpt_path in ("best", "hpc", "registry", "last"):
        return
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    sharded = Path(ckpt_path).is_dir()
    fsdp = isinstance(strategy, (FSDPStrategy, ModelParallelStrategy))
    if sharded and not fsdp:
        raise ConfigError(
            f"--ckpt_path {ckpt_path}: a sharded FSDP checkpoint (a folder), but this run uses "
            f"{type(strategy).__name__}; resume with --trainer.strategy fsdp, or convert it to one file with "
            "`python -m lightning.pytorch.utilities.consolidate_checkpoint FOLDER` (FSDP1 folders)"
        )
    if fsdp and not sharded:
        raise ConfigError(
            f"--ckpt_path {ckpt_path}: a single-file (DDP) checkpoint, but this run shards with FSDP, whose "
            "checkpoints are folders; resume it with the strategy that wrote it (DDP: drop --trainer.strategy fsdp)"
        )
