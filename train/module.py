"""The LightningModule: the model, AdamW with the warmup-stable-decay LR, per-source losses.

The training step is the whole story (torchtitan's rule: keep control flow visible here):
forward, token losses without reduction, the mean for backward, and per-source sums and counts that
are all-reduced across ranks before logging (so a source with few tokens in a batch weighs little).
The learning rate is ``schedule.lr(step)`` -- a pure function of the optimizer step, so resuming
only needs the step.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from typing import Literal, Optional

import lightning as L
import torch

from data.types import EvalBatch, TrainBatch, TrainingContext
from train.architecture import Architecture, ArchitectureConfig, build_model
from train.model import ModelConfig, load_model_config

log = logging.getLogger(__name__)


@dataclass
class OptimConfig:
    """AdamW; the learning rate itself comes from ``data.schedule.lr``."""

    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    """Applied to matrices (embeddings included), not to norm gains."""
    eps: float = 1e-8
    fused: Optional[bool] = None
    """Fused AdamW kernel; None = wherever the device supports it (CUDA, and CPU in recent torch)."""


class WeightsDiffer(FloatingPointError):
    """The DDP ranks hold different weights at a checkpoint: the run stops like one whose weights went
    non-finite (exit 3, no checkpoint written)."""


class PretrainModule(L.LightningModule):
    def __init__(
        self,
        model: ModelConfig = ModelConfig(),  # noqa: B008 -- never changed in place (copied below)
        optim: Optional[OptimConfig] = None,
        compile: bool | Literal["auto"] = False,
        on_nonfinite: Literal["stop", "skip"] = "stop",
        log_every_n_steps: int = 1,
    ):
        """
        Args:
            model: the model's shape (train/model.py). On the command line and in configs a group:
                ``model: {model: model/demo.yaml}`` loads a model file (relative to the config file that
                names it), ``--model.model.d_model 64`` changes one field of it. In Python a ModelConfig,
                the path of a model YAML, a checkpoint's dict, or another architecture's config
                (train/architecture.py, docs/model.md).
            optim: AdamW settings.
            compile: wrap the model in torch.compile (GPU runs; sequence lengths are multiples of 64);
                ``auto`` compiles on CUDA only, so one config serves the GPU run and a CPU smoke test.
            on_nonfinite: a non-finite loss stops the run with a clear message, or skips the step
                (no parameter update, logged as train/skipped_steps).
            log_every_n_steps: interval of the per-source reductions and logs (each is an all-reduce).
        """
        super().__init__()
        if isinstance(model, dict):  # a checkpoint's hparams (below) given to the class directly
            model = ModelConfig(**model)
        if isinstance(optim, dict):
            optim = OptimConfig(**{**optim, "betas": tuple(optim.get("betas", OptimConfig.betas))})
        if isinstance(model, (str, os.PathLike)):
            model = load_model_config(model)
        elif isinstance(model, ModelConfig):
            model = copy.copy(model)  # the CLI's parsed config stays as parsed
        self.model_config: ArchitectureConfig = model
        self.optim = optim or OptimConfig()
        # What a checkpoint needs to rebuild this module, saved once and never rewritten: the model config
        # resolved (a YAML path would tie the checkpoint to a file), plain types (checkpoints load with
        # torch.load(weights_only=True)), and _class_path/_instantiator so that both
        # PretrainModule.load_from_checkpoint and lightning.LightningModule.load_from_checkpoint build this
        # class. Loggers get the whole run config from the CLI instead (logger=False).
        self.save_hyperparameters({
            "model": dict(vars(self.model_config)),
            "optim": {**vars(self.optim), "betas": list(self.optim.betas)},
            "compile": compile, "on_nonfinite": on_nonfinite, "log_every_n_steps": log_every_n_steps,
            "_class_path": f"{type(self).__module__}.{type(self).__qualname__}",
            "_instantiator": "lightning.pytorch.cli.instantiate_module",
        }, logger=False)
        self.model: Architecture = build_model(self.model_config)
        self.on_nonfinite = on_nonfinite
        self.log_every = max(1, log_every_n_steps)
        self.source_names: list[str] = []
        self.lr_at = None
        self.skipped_steps = 0
        self._skip = False
        self._val = None
        self._train_acc: list[torch.Tensor] | None = None  # per-source sums, counts, tokens of this step so far
        self._train_acc_n = 0  # micro-batches in it
        self._last_val_step: int | None = None  # global step of the newest held-out loss

    # -- set-up ------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        self.ctx: TrainingContext = self.trainer.datamodule.context()
        self.source_names = list(self.ctx.source_names)
        # keyed on the optimizer step (the schedule's own unit, whatever the accumulation)
        self.lr_at = self.ctx.schedule.lr

    def configure_model(self) -> None:
        if self.device_mesh is not None:  # ModelParallelStrategy (train/parallel.py: fsdp2)
            from train.parallel import shard_per_block

            shard_per_block(self.model, self.device_mesh["data_parallel"])  # FSDP2, one unit per block
        compile = self.hparams.compile
        if compile == "auto":  # CPU compile costs minutes of start-up for little gain at test sizes
            compile = self.trainer.strategy.root_device.type == "cuda"
        if compile and not isinstance(self.model, torch._dynamo.eval_frame.OptimizedModule):
            self.model = torch.compile(self.model)

    def configure_optimizers(self):
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        fused = self.optim.fused
        if fused is None:
            fused = self.device.type == "cuda" or self.device.type == "cpu"
        schedule = self.ctx.schedule
        base = schedule.config.lr.peak
        # (Safe here although it dropped a stateful loader's state, Lightning #20550: the cursors are the DataModule's.)
        if self.trainer.estimated_stepping_batches < schedule.total_steps:
            log.warning("trainer.max_steps=%d stops before the schedule's %d steps: the LR will not finish "
                        "its decay and the anneal is cut short", self.trainer.estimated_stepping_batches,
                        schedule.total_steps)
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=base, betas=tuple(self.optim.betas), eps=self.optim.eps, fused=fused,
        )
        # A plain function, not a callable object: LambdaLR would pickle an object's __dict__ (the
        # schedule) into the checkpoint. The LR is a pure function of the step; only the step is saved.
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: schedule.lr(step) / base)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # -- steps -------------------------------------------------------------------------------
    def _token_losses(self, batch: EvalBatch[torch.Tensor]) -> torch.Tensor:
        doc_index = batch["doc_index"] if self.model_config.doc_mask else None
        # Per-token fp32 losses [B, L] from the model itself (model.loss_impl: chunked by default, which
        # never holds [tokens, vocab] fp32 logits); flattened to [B * L].
        return self.model(batch["input_ids"], doc_index=doc_index, targets=batch["targets"]).flatten()

    def _per_source(self, tok_loss: torch.Tensor, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.source_names)
        src = source.flatten()
        sums = torch.zeros(n, device=tok_loss.device, dtype=torch.float64)
        sums.index_add_(0, src, tok_loss.detach().double().flatten())
        counts = torch.bincount(src, minlength=n).double()
        return sums, counts

    def loss_per_source(self, batch: EvalBatch[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's summed token losses and token counts per source (``source_names`` order, fp64) of
        one batch: the held-out loss of a source is its sums over its counts."""
        return self._per_source(self._token_losses(batch), batch["target_source"])

    def training_step(self, batch: TrainBatch[torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        """The loss to backpropagate, and ``raw_loss`` (the micro-batch's mean token loss as computed, NaN
        included) for the order log. A non-finite loss on any rank stops the run, or (``skip``) marks the
        whole optimizer step skipped: every micro-batch of it still runs forward and backward (DDP ranks
        stay in step), and :meth:`on_before_optimizer_step` drops the gradients."""
        tok_loss = self._token_losses(batch)
        loss = tok_loss.mean()
        finite = torch.isfinite(loss).float()
        all_finite = self.trainer.strategy.reduce(finite, reduce_op="min") > 0  # same decision on every rank
        backward = loss
        if not all_finite:
            if self.on_nonfinite == "stop":
                raise FloatingPointError(
                    f"non-finite loss at step {self.global_step} (rank {self.global_rank}: {loss.item()}); "
                    "lower data.schedule.lr.peak, or set model.on_nonfinite: skip to skip such steps"
                )
            self._mark_skipped("loss")
            backward = torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0)
        if self.global_step % self.log_every == 0:
            self._log_train(batch, tok_loss, loss)
        return {"loss": backward, "raw_loss": loss.detach()}

    def _mark_skipped(self, what: str) -> None:
        if self._skip:  # another micro-batch of the same optimizer step
            return
        self._skip = True
        self.skipped_steps += 1
        log.warning("non-finite %s at step %d: step skipped (%d so far); no parameter update", what,
                    self.global_step, self.skipped_steps)

    def on_before_optimizer_step(self, optimizer) -> None:
        """After the step's last backward, before clipping and the update: a non-finite gradient (the loss
        may be finite) stops the run or skips the step like a non-finite loss; a skipped step's gradients
        are dropped, so AdamW leaves every parameter and its moments untouched."""
        if not self._skip and not self._finite(p.grad for p in self.parameters()):
            if self.on_nonfinite == "stop":
                raise FloatingPointError(
                    f"non-finite gradient at step {self.global_step} (the loss was finite); no update was made. "
                    "Lower data.schedule.lr.peak, or set model.on_nonfinite: skip to skip such steps")
            self._mark_skipped("gradient")
        if self._skip:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
        self._skip = False

    def _finite(self, tensors) -> bool:
        """Every element of ``tensors`` (None skipped; a sharded tensor's local part) finite on every rank."""
        ok = torch.ones((), device=self.device)
        for t in tensors:
            if t is not None:
                t = t.to_local() if hasattr(t, "to_local") else t
                ok = ok * torch.isfinite(t).all()
        return bool(self.trainer.strategy.reduce(ok, reduce_op="min") > 0)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """No checkpoint holds non-finite weights, nor weights the DDP ranks disagree on: such a run stops
        here (every rank decides alike), and the checkpoint is not written, so the last one written stays
        the newest.

        The ranks' agreement: each rank sums the bit patterns of each parameter tensor as integers (exact
        in any order, so one flipped bit anywhere changes the sum), one all-gather of those sums compares
        them, and rank 0 logs their checksum. Under FSDP every rank holds other shards: nothing to compare."""
        from lightning.pytorch.strategies import DDPStrategy

        if not self._finite(p.detach() for p in self.parameters()):
            raise FloatingPointError(
                f"the weights hold non-finite values at step {self.global_step}: no checkpoint written (the last "
                "one written stands). Resume from it with --ckpt_path FILE, and lower data.schedule.lr.peak or "
                "set model.on_nonfinite: skip")
        if isinstance(self.trainer.strategy, DDPStrategy):
            names, params = zip(*self.named_parameters())
            bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
            sums = torch.stack([torch.sum(p.detach().view(bits[p.element_size()]), dtype=torch.int64) for p in params])
            ranks: dict[tuple[int, ...], list[int]] = {}
            for rank, row in enumerate(self.trainer.strategy.all_gather(sums).view(-1, len(params)).tolist()):
                ranks.setdefault(tuple(row), []).append(rank)
            a, *others = ranks
            if others:
                held = "; ".join(f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}" for r in ranks.values())
                first = next(n for n, x, y in zip(names, a, others[0]) if x != y)
                raise WeightsDiffer(
                    f"the ranks hold different weights at step {self.global_step} ({held}: one set each; the "
                    f"first tensor that differs: {first}): no checkpoint written (the last one written stands, "
                    "and every rank loads it alike). Resume from it with --ckpt_path last")
            if self.global_rank == 0:
                log.info("step %d: the weights of %d ranks agree (checksum %016x)", self.global_step,
                         self.trainer.world_size, sum(a) % 2**64)
        checkpoint["skipped_steps"] = self.skipped_steps

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.skipped_steps = int(checkpoint.get("skipped_steps", 0))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip by global norm ourselves: Lightning refuses to clip with a fused AdamW under mixed
        precision (it assumes a grad scaler, which bf16 does not use). FSDP2's sharded (DTensor) gradients
        clip the same way (the norm is reduced over the shards); FSDP1 keeps Lightning's path."""
        if not gradient_clip_val:
            return
        from lightning.pytorch.strategies import FSDPStrategy

        if isinstance(self.trainer.strategy, FSDPStrategy):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
        if self.global_step % self.log_every == 0:
            self.log("train/grad_norm", norm.float(), on_step=True, on_epoch=False)

    def _log_train(self, batch: TrainBatch[torch.Tensor], tok_loss: torch.Tensor, loss: torch.Tensor) -> None:
        """Per-source loss and token shares of the whole optimizer step: under gradient accumulation the
        micro-batches' sums and counts are added up and reduced once, at the step's last micro-batch
        (Lightning writes only that micro-batch's logged values, so logging each alone would report
        1/A of the batch)."""
        sums, counts = self._per_source(tok_loss, batch["target_source"])
        part = [sums, counts, batch["source_tokens"].double().to(self.device)]
        acc = self._train_acc
        self._train_acc = part if acc is None else [a + p for a, p in zip(acc, part)]
        self._train_acc_n += 1
        if self._train_acc_n < self.trainer.accumulate_grad_batches:
            return
        (sums, counts, tokens), self._train_acc, self._train_acc_n = self._train_acc, None, 0
        reduce = self.trainer.strategy.reduce
        sums, counts = reduce(sums, reduce_op="sum"), reduce(counts, reduce_op="sum")
        shares = reduce(tokens, reduce_op="sum")
        shares = shares / shares.sum()
        weights = batch["weights"].double().to(self.device)
        metrics = {
            "train/loss": sums.sum() / counts.sum(),
            "train/lr": torch.tensor(self.lr_at(self.global_step)),
            "train/seq_len": torch.tensor(float(batch["input_ids"].shape[1])),
            "train/share_distance": 0.5 * (shares - weights).abs().sum(),
            "train/skipped_steps": torch.tensor(float(self.skipped_steps)),
        }
        for i, name in enumerate(self.source_names):
            # NaN (0/0) when the step has no tokens of the source: a key left out would not be a gap, because
            # Lightning re-sends the last value of a step metric on every step that does not log it
            metrics[f"train/loss/{name}"] = sums[i] / counts[i]
            metrics[f"train/share/{name}"] = shares[i]
            metrics[f"train/target/{name}"] = weights[i]
        self.log_dict({k: v.float() for k, v in metrics.items()}, on_step=True, on_epoch=False, sync_dist=False,
                      batch_size=batch["input_ids"].shape[0])

    def on_validation_epoch_start(self) -> None:
        n = len(self.source_names)
        self._val = [torch.zeros(n, dtype=torch.float64, device=self.device) for _ in range(2)]

    def validation_step(self, batch: EvalBatch[torch.Tensor], batch_idx: int) -> None:
        sums, counts = self.loss_per_source(batch)
        self._val[0] += sums
        self._val[1] += counts

    def _val_metrics(self) -> dict[str, torch.Tensor]:
        sums = self.trainer.strategy.reduce(self._val[0], reduce_op="sum")
        counts = self.trainer.strategy.reduce(self._val[1], reduce_op="sum")
        metrics = {"val/loss": (sums.sum() / counts.sum().clamp(min=1)).float()}
        for i, name in enumerate(self.source_names):
            if counts[i] > 0:
                metrics[f"val/loss/{name}"] = (sums[i] / counts[i]).float()
        return metrics

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self._val_metrics(), on_step=False, on_epoch=True, sync_dist=False)
        self._last_val_step = self.global_step

    def on_train_start(self) -> None:
        """Held-out loss of the initial model, logged at step 0 (the 'before' of every comparison)."""
        if self.global_step > 0 or self.ctx.held_out is None:
            return
        self._log_held_out(step=0)

    def on_train_end(self) -> None:
        """Held-out loss of the final model, when the run reached max_steps between two validations.

        Without it the last value would predate the end of the anneal and the LR decay (validation
        runs every ``run.val_every_n_steps``), which is exactly what an ablation compares. Logged at
        the last trained step's index, as Lightning logs validations.
        """
        if (self.ctx.held_out is None or self.global_step < self.trainer.max_steps
                or self._last_val_step == self.global_step):
            return
        self._log_held_out(step=self.global_step - 1)

    def _log_held_out(self, step: int) -> None:
        was_training = self.training
        self.eval()
        self.on_validation_epoch_start()
        with torch.no_grad():
            for i, batch in enumerate(self.ctx.held_out()):
                batch = {k: v.to(self.device) for k, v in batch.items()}
                self.validation_step(batch, i)
        metrics = self._val_metrics()
        self.train(was_training)
        for logger in self.loggers:
            logger.log_metrics({k: v.item() for k, v in metrics.items()}, step=step)
        self._last_val_step = self.global_step

    def model_config_summary(self) -> str:
        model = getattr(self.model, "_orig_mod", self.model)
        return model.param_summary()
