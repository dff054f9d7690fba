"""What the GPU check (train/tools/gpu_check.py) measures inside a training run: its step clock, compile counts.

:class:`StepClock` is a callback the check's training child adds right after the ThroughputCallback; it
writes every optimizer step's start, end, shape and logged MFU, then peak memory, the memory estimate and
the compile counters, to a JSON file the check reads back. :func:`watch_dynamo` counts recompiles and
:func:`dynamo_counts` adds torch._dynamo's own counters.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from pathlib import Path

import lightning as L
import torch

from data.files import write_text
from train.callbacks import ThroughputCallback, default_peak_flops
from train.memory import estimate_peak_memory


def watch_dynamo() -> dict:
    """Count torch.compile's recompiles (its ``recompiles`` log records, which stop at the torch._dynamo
    logger) and keep the first reasons; :func:`dynamo_counts` adds its own counters at the end."""
    counts = {"recompiles": 0, "reasons": []}

    class Count(logging.Handler):
        def emit(self, record):
            if record.name.endswith("__recompiles"):
                counts["recompiles"] += 1
                if len(counts["reasons"]) < 8:
                    counts["reasons"].append(record.getMessage()[:400])

    torch._logging.set_logs(recompiles=True, graph_breaks=True)  # the reasons land in the run's log too
    logging.getLogger("torch._dynamo").addHandler(Count())
    return counts


def dynamo_counts(counts: dict) -> dict:
    """Recompiles (counted by :func:`watch_dynamo`), graph breaks and graphs (torch._dynamo's counters)."""
    from torch._dynamo.utils import counters

    breaks = dict(counters.get("graph_break", {}))
    return {**counts, "graph_breaks": sum(breaks.values()), "graphs": counters["stats"].get("unique_graphs", 0),
            "frames_compiled": counters["frames"].get("ok", 0),
            "graph_break_reasons": [r[:300] for r in list(breaks)[:5]]}


class StepClock(L.Callback):
    """Per optimizer step: when its batch started and when it ended (CUDA synchronised), its shape and
    the MFU the ThroughputCallback just logged; at the end peak memory, the memory estimate, compile
    counters. Written to JSON at the end of training (and on an exception)."""

    def __init__(self, path: Path, dynamo_counts: dict):
        self.path, self.counts = path, dynamo_counts
        self.steps: list[dict] = []
        self.t_launch = float(os.environ.get("GPU_CHECK_T_LAUNCH", time.monotonic()))
        self._start = None
        self._step = None
        self.info: dict = {}

    def on_train_start(self, trainer, pl_module):
        self._step = trainer.global_step
        self.info["t_train_start"] = time.monotonic() - self.t_launch
        dev = trainer.strategy.root_device
        self.info["device"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            self.info["device_memory_gb"] = torch.cuda.get_device_properties(dev).total_memory / 1e9

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._start is None:
            self._start = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self._step:  # accumulating
            return
        self._step = trainer.global_step
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        B, L_ = batch["input_ids"].shape
        model = getattr(pl_module.model, "_orig_mod", pl_module.model)
        m = trainer.callback_metrics
        self.steps.append({
            "step": trainer.global_step, "start": self._start - self.t_launch,
            "end": time.monotonic() - self.t_launch, "batch": B, "seq_len": L_,
            "tokens": B * L_ * trainer.accumulate_grad_batches,
            "flops": model.flops_per_token(L_) * B * L_ * trainer.accumulate_grad_batches,
            "mfu_logged": float(m["perf/mfu"]) if "perf/mfu" in m else None,
        })
        self._start = None
        if len(self.steps) % 5 == 0:  # a run cut short still leaves its figures (a cheap write: the
            self.write(trainer, pl_module, final=False)  # estimate is made once, at the end or here)

    def on_train_end(self, trainer, pl_module):
        self.write(trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception):
        self.info["exception"] = f"{type(exception).__name__}: {exception}"[:2000]
        self.write(trainer, pl_module)

    def write(self, trainer, pl_module, final: bool = True):
        """The steps so far and the run's figures, to the JSON file."""
        cfg = pl_module.model_config
        self._estimate(cfg, final)
        self.info.update(
            peak_flops=next((c.peak_flops or default_peak_flops(trainer) for c in trainer.callbacks
                             if isinstance(c, ThroughputCallback)), None),
            loss_impl=cfg.loss_impl, compiled=hasattr(pl_module.model, "_orig_mod"),
            precision=str(trainer.precision), dynamo=dynamo_counts(self.counts),
        )
        self._peak_memory(trainer.strategy.root_device)
        self._compile_times(final)
        write_text(self.path, json.dumps({"info": self.info, "steps": self.steps}, indent=1), fsync=False)

    def _estimate(self, cfg, final: bool) -> None:
        """train/memory.py's estimate at the largest shape run so far (built on meta: at the end, or when
        the shape changed)."""
        seq = max([s["seq_len"] for s in self.steps] or [cfg.max_seq_len])
        batch = max([s["batch"] for s in self.steps] or [1])
        if final or (batch, seq) != self.info.get("estimate_shape"):
            self.info["estimate_shape"] = (batch, seq)
            self.info["estimate_gb"] = estimate_peak_memory(
                cfg, batch, seq, loss=cfg.loss_impl, activation_checkpointing=cfg.activation_checkpointing
            )["total"] / 1e9

    def _peak_memory(self, dev) -> None:
        if dev.type == "cuda":
            self.info["peak_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
            self.info["peak_reserved_gb"] = torch.cuda.max_memory_reserved(dev) / 1e9
            self.info["peak_kind"] = "torch.cuda.max_memory_allocated"
        else:
            self.info["peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
            self.info["peak_kind"] = "process max RSS (CPU dry run: not comparable to the estimate)"

    def _compile_times(self, final: bool) -> None:
        try:
            import torch._dynamo.utils as dynamo_utils

            if final:
                names, values = dynamo_utils.compile_times(repr="csv", aggregate=True)
                self.info["dynamo_compile_times_s"] = {n: float(v) for n, v in zip(names, values)}
        except Exception as e:  # an internal API: its absence must not lose the figures above
            self.info["dynamo_compile_times_s"] = f"unavailable: {type(e).__name__}"
