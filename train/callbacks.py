"""Callbacks: the data cursor and order log, throughput/MFU, progress lines (the checkpoint callback,
FinalCheckpoint, is train/checkpoint.py's)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops

from data import files
from data.formatting import duration
from data.simulate import order_line
from data.types import TrainBatch, TrainingContext
from train import lightning_internals as internals
from train.rundir import RunDir, read_jsonl

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s per device. Lightning's table does not know "NVIDIA H200" (it then reports
# no MFU); H100 SXM and H200 share the same tensor cores: 989.5 TFLOP/s dense bf16.
PEAK_BF16_FLOPS = {"h200": 989.5e12, "h100": 989.5e12, "a100": 312e12, "l40s": 362.05e12, "a10g": 125e12}


def default_peak_flops(trainer=None) -> float | None:
    """Peak FLOP/s of one device: our dense-bf16 table, else Lightning's (CUDA only), else None (CPU:
    no MFU, since a CPU's peak depends on cores, clocks and ISA that nothing here measures)."""
    device = trainer.strategy.root_device if trainer is not None else None
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return None
    name = torch.cuda.get_device_name(device).lower()
    ours = [flops for key, flops in PEAK_BF16_FLOPS.items() if key in name]
    return ours[0] if ours else _lightning_peak_flops(device, str(getattr(trainer, "precision", "")))


def _lightning_peak_flops(device, precision: str) -> float | None:
    """Lightning's table, at the trainer's precision."""
    dtype = torch.bfloat16 if "bf16" in precision else torch.float16 if "16" in precision else torch.float32
    return get_available_flops(device or torch.device("cuda"), dtype)


class DataStateCallback(L.Callback):
    """After every optimizer step: record the trained batch's cursor; optionally append its order line.

    The order log (``data.order_log: true``, docs/checkpoints.md) has one line per data step (micro-batch:
    with accumulation A, optimizer step s trains lines sA .. sA+A-1). On resume, lines past the checkpoint's
    data step (about to be trained again) are dropped, so the file reads as one clean run; after an elastic
    resume that changes the accumulation, the steps continue in the new units (step s at data step s x A).
    """

    def __init__(self, run_dir: str):
        self.run_dir = Path(run_dir)
        self._file = None
        self._resumed_data_step: int | None = None  # micro-batches the checkpoint had trained, in its units

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """The lines on disk were written in the checkpoint's micro-batch units (its accumulation), which
        an elastic resume may change: the stale ones start at the checkpoint's own data step."""
        state = checkpoint.get(type(trainer.datamodule).__qualname__) or {}
        self._resumed_data_step = state.get("next_step")

    def _path(self, trainer) -> Path:
        return RunDir(self.run_dir).order_log(trainer.global_rank)

    def on_train_start(self, trainer, pl_module) -> None:
        internals.align_accumulation_phase(trainer)
        if trainer.is_global_zero:  # metrics.csv rows of the steps about to be trained again
            for logger in trainer.loggers:
                if isinstance(logger, internals.ResumableCSVLogger):
                    logger.drop_steps_from(trainer.global_step)
        ctx = trainer.datamodule.context()
        if not ctx.config.order_log:
            return
        path = self._path(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        # lines from the checkpoint's data step on are about to be trained again (not global_step x the
        # new accumulation: after a 4x1 -> 2x2 resume at step s that kept the old lines s..2s-1)
        next_step = self._resumed_data_step
        if next_step is None:
            next_step = trainer.global_step * ctx.accumulate
        _drop_lines_from(path, next_step)
        if trainer.is_global_zero:  # after an elastic resume onto fewer ranks, the others' logs end here too
            for other in path.parent.glob("rank*.jsonl"):
                if int(other.stem[4:]) >= trainer.world_size:
                    _drop_lines_from(other, next_step)
        self._file = files.open_append(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch: TrainBatch[torch.Tensor], batch_idx: int) -> None:
        trainer.datamodule.record(batch)
        if self._file is not None:
            if isinstance(outputs, dict) and "raw_loss" in outputs:  # PretrainModule: as computed, NaN included
                loss = outputs["raw_loss"].item()
            else:  # Lightning hands back the loss divided by A
                loss = (outputs["loss"].item() if isinstance(outputs, dict) else float(outputs))
                loss *= trainer.accumulate_grad_batches
            try:
                line = order_log_line(trainer.datamodule.context(), batch, loss, pl_module.lr_at)
                self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
                self._file.flush()
            except OSError as e:
                raise files.write_error(self._path(trainer), e, "resume with --ckpt_path last (a line cut "
                                        "short is dropped on resume)") from e

    def on_train_end(self, trainer, pl_module) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def order_log_line(ctx: TrainingContext, batch: TrainBatch[torch.Tensor], loss: float, lr_at) -> dict:
    """The order-dump line of a trained batch (data/simulate.py ``order_line``) plus its ``loss``; ``lr_at``:
    the module's LR of an optimizer step."""
    plain = {**batch, "source_tokens": batch["source_tokens"].tolist(), "weights": batch["weights"].tolist()}
    return {**order_line(plain, list(ctx.source_names), lambda step: lr_at(step // ctx.accumulate)), "loss": loss}


def _drop_lines_from(path: Path, step: int) -> None:
    """Keep the order-log lines of steps before ``step`` (the rest is about to be trained again); a last
    line cut by a crash is dropped with a warning (train/rundir.py ``read_jsonl``)."""
    files.refuse_link(path, "the order log")
    if path.exists():
        keep = [d for d in read_jsonl(path) if d["step"] < step]
        files.write_text(path, "".join(json.dumps(d, separators=(",", ":")) + "\n" for d in keep))


class ThroughputCallback(L.Callback):
    """Per-interval throughput: global tokens/s, TFLOP/s and MFU per device, every ``log_every_n_steps``.

    Lightning's :class:`Throughput` gets ``time``, ``batches`` and ``samples`` cumulative and ``flops``
    *since the previous update* (cumulative FLOPs would make MFU grow with the step); its window is 2
    updates, so each figure covers exactly the last interval. Updates happen only when an optimizer step
    completed (micro-batches in between add their tokens and FLOPs). The first completed step after a
    (re)start is the baseline, so no interval contains compilation or start-up. MFU is logged only where
    the peak is known (``run.peak_flops``, or a GPU in :data:`PEAK_BF16_FLOPS` / Lightning's table).
    ``perf/tflops_per_sec`` is per device, ``perf/tokens_per_sec`` over all ranks.
    """

    def __init__(self, peak_flops: float | None = None, log_every_n_steps: int = 1,
                 clock: Callable[[], float] = time.perf_counter):
        self.peak_flops = peak_flops
        self.log_every = max(1, log_every_n_steps)
        self.clock = clock  # tests pass a fake clock

    def on_train_start(self, trainer, pl_module) -> None:
        peak = self.peak_flops if self.peak_flops is not None else default_peak_flops(trainer)
        self.meter = Throughput(available_flops=peak, world_size=trainer.world_size, window_size=2)
        self._step = trainer.global_step  # the optimizer step the next micro-batch belongs to
        self._steps_done = 0  # optimizer steps completed since this (re)start: Throughput's `batches`
        self._tokens = 0  # this rank's tokens since this (re)start
        self._flops = 0.0  # this rank's FLOPs since the last meter update
        self._baseline = False
        schedule = trainer.datamodule.context().schedule  # tokens before a resume, from the pure schedule
        self.tokens_before = sum(schedule.tokens_at(s) for s in range(trainer.global_step))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch: TrainBatch[torch.Tensor], batch_idx: int) -> None:
        B, L_ = batch["input_ids"].shape
        model = getattr(pl_module.model, "_orig_mod", pl_module.model)
        self._tokens += B * L_
        self._flops += model.flops_per_token(L_) * B * L_
        if trainer.global_step == self._step:  # accumulating: the optimizer step is not done yet
            return
        self._step = trainer.global_step
        self._steps_done += 1
        if self._baseline and self._step % self.log_every:
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self.meter.update(time=self.clock(), batches=self._steps_done, samples=self._tokens, flops=self._flops)
        self._flops = 0.0
        out = {"perf/tokens_seen": float(self.tokens_before + self._tokens * trainer.world_size)}
        if self._baseline:
            metrics = self.meter.compute()
            out["perf/tokens_per_sec"] = metrics["device/samples_per_sec"] * trainer.world_size
            out["perf/tflops_per_sec"] = metrics["device/flops_per_sec"] / 1e12
            if "device/mfu" in metrics:
                out["perf/mfu"] = metrics["device/mfu"]
        self._baseline = True
        pl_module.log_dict(out, on_step=True, on_epoch=False, batch_size=B)


PROGRESS_FIELDS = (("train/loss", "loss {:.3f}"), ("train/lr", "lr {:.2e}"), ("train/seq_len", "seq {:.0f}"),
                   ("perf/tokens_per_sec", "{:,.0f} tok/s"), ("perf/mfu", "MFU {:.1%}"))
"""The progress line's metrics (those logged so far) and their formats."""


class ProgressLog(L.Callback):
    """One plain log line every N steps (batch jobs and pipes have no progress bar), with the percentage
    done and an ETA from the mean step time since this launch started training; a resume says where
    it resumed."""

    def __init__(self, every_n_steps: int = 25):
        self.every = every_n_steps
        self._t0: float | None = None
        self._step0 = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self._t0, self._step0 = time.perf_counter(), trainer.global_step
        if trainer.global_step and trainer.is_global_zero:
            log.info("resumed at step %d (data cursors of %d ranks x %d workers)", trainer.global_step,
                     trainer.world_size, max(1, trainer.datamodule.context().num_workers))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch: TrainBatch[torch.Tensor], batch_idx: int) -> None:
        step = trainer.global_step
        if self.every > 0 and step % self.every == 0 and trainer.is_global_zero:
            log.info(self.progress_line(trainer, step))

    def progress_line(self, trainer, step: int) -> str:
        """``step s/total (p%) | loss ... | ETA ...``: the metrics logged so far, the ETA from this launch's pace."""
        m = trainer.callback_metrics
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        parts = [f"step {step}/{total} ({step / total:.0%})" if total else f"step {step}"]
        parts += [fmt.format(float(m[key])) for key, fmt in PROGRESS_FIELDS if key in m]
        if total and self._t0 is not None and step > self._step0:
            per_step = (time.perf_counter() - self._t0) / (step - self._step0)
            parts.append(f"ETA {duration(per_step * max(0, total - step))}")
        return " | ".join(parts)
