"""Benchmark the training step.

    python scripts/bench_train.py                        # (a) CPU: Lightning step vs a plain PyTorch loop
    python scripts/bench_train.py --cpu-precision        # (c) CPU: fp32 vs bf16 autocast, the demo model
    python scripts/bench_train.py --ddp 4                # (d) CPU: DDP's fixed bucket layout vs its default

(a) The same tiny model, the same batches (real packed batches of the demo corpus), the same AdamW,
    gradient clipping and LR schedule: our LightningModule under a Trainer (its per-source loss
    reductions and logging included) against a plain PyTorch loop. The contenders alternate a few
    rounds in this process; the overhead ratio is the median of per-round time ratios (target <= 1.05).
(b) GPU: the GPU check's ``contenders`` section (``bash scripts/gpu_check.sh --only contenders``).
(c) The demo model (configs/model/demo.yaml) forward + backward on 4 x 128 tokens, fp32 against bf16
    autocast, alternating in this process: the bf16/fp32 time ratio, and whether this CPU has native
    bf16 (AVX512-BF16 / AMX). It decides configs/demo.yaml's trainer.precision for a given machine.
"""

from __future__ import annotations

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from train.malloc import keep_freed_memory

keep_freed_memory()  # the same allocator setting as python -m train

import lightning as L  # noqa: E402
import torch  # noqa: E402

from data.config import DataConfig, corpus_sources  # noqa: E402
from data.corpus.demo import build_demo_corpus  # noqa: E402
from data.manifest import build_manifest  # noqa: E402
from data.schedules import build_schedule, fixed_schedule  # noqa: E402
from data.simulate import OrderSimulator  # noqa: E402
from data.steps import StepSchedule  # noqa: E402
from data.types import TrainBatch, TrainingContext  # noqa: E402
from train.datamodule import to_torch  # noqa: E402
from train.model import GPT, load_model_config  # noqa: E402
from train.module import PretrainModule  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["web", "code", "books", "curated"]


def demo_data(n: int, batch: int, seq: int, corpus: Path | None) -> tuple[list[TrainBatch[torch.Tensor]],
                                                                          TrainingContext]:
    """Real packed batches from the demo corpus (built into a temp dir unless given), and the prepared
    data the module reads, with :func:`lr_schedule`'s LR."""
    if corpus is None:
        corpus = Path(tempfile.mkdtemp()) / "demo_corpus"
        build_demo_corpus(corpus)
    cfg = DataConfig(
        sources=corpus_sources(corpus, SOURCES),
        schedule=fixed_schedule({"web": 0.62, "code": 0.18, "books": 0.12, "curated": 0.08}, seq),
        batch_size=batch,
        buffer_size=256,
        manifest_cache=str(corpus.parent / ".cache"),
    )
    manifest = build_manifest(cfg)
    sim = OrderSimulator(manifest, cfg, 1, 1)
    schedule = lr_schedule(n)
    context = TrainingContext(config=cfg, manifest=manifest, schedule=schedule, steps=StepSchedule(SOURCES, schedule),
                              held_out=None)
    return [to_torch(b) for _, _, b in sim.batches(n)], context


def lr_schedule(total: int):
    return build_schedule({
        "train_tokens": max(total, 100) * 8 * 128, "global_batch_size": 8,  # >= 100 steps: a valid decay
        "seq_len": {"start": 128, "end": 128, "warmup_steps": 0, "multiple": 64},
        "lr": {"peak": 1e-3, "min": 0.0, "warmup_steps": 5}, "anneal_start": 0.9,
        "mixture": {"weights": {"web": 0.62, "code": 0.18, "books": 0.12, "curated": 0.08}},
    })


def plain_loop(model: GPT, batches: list[TrainBatch[torch.Tensor]], schedule) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule.lr(s) / 1e-3)
    t0 = time.perf_counter()
    doc_mask = model.config.doc_mask
    for b in batches:  # the module's own forward call (train/module.py _token_losses): same loss path
        loss = model(b["input_ids"], doc_index=b["doc_index"] if doc_mask else None, targets=b["targets"]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        loss.item()  # the Lightning loop syncs on the loss for logging too
    return time.perf_counter() - t0


class _Batches(L.LightningDataModule):
    """Pre-built batches behind the contract the module reads (data/types.py TrainingContext)."""

    def __init__(self, batches: list[TrainBatch[torch.Tensor]], context: TrainingContext):
        super().__init__()
        self.batches, self._context = batches, context

    def context(self) -> TrainingContext:
        return self._context

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None)


def lightning_loop(model_cfg, batches: list[TrainBatch[torch.Tensor]], context: TrainingContext) -> float:
    module = PretrainModule(model=model_cfg)
    trainer = L.Trainer(max_steps=len(batches), accelerator="cpu", devices=1, precision="32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=1.0, num_sanity_val_steps=0, limit_val_batches=0)
    timer = {}

    class Timer(L.Callback):  # time the training loop only, not Trainer set-up
        def on_train_start(self, *a):
            timer["t0"] = time.perf_counter()

        def on_train_end(self, *a):
            timer["t1"] = time.perf_counter()

    trainer.callbacks.append(Timer())
    trainer.fit(module, datamodule=_Batches(batches, context))
    return timer["t1"] - timer["t0"]


def bench_cpu(args) -> None:
    torch.manual_seed(0)
    cfg = load_model_config(ROOT / "configs/model/tiny.yaml")
    batches, context = demo_data(args.steps, 8, 128, args.corpus)
    schedule = context.schedule

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    ratios, plain_t, light_t = [], [], []
    for r in range(args.rounds):
        torch.manual_seed(r)
        p = plain_loop(GPT(cfg), batches, schedule)
        torch.manual_seed(r)
        q = lightning_loop(cfg, batches, context)
        plain_t.append(p)
        light_t.append(q)
        ratios.append(q / p)
    tok = sum(b["input_ids"].numel() for b in batches)
    print(f"(a) CPU, tiny model ({sum(p.numel() for p in GPT(cfg).parameters()) / 1e6:.1f}M), "
          f"{args.steps} steps of 8 x 128, {args.rounds} alternating rounds")
    for name, times in (("plain PyTorch loop", plain_t), ("Lightning module", light_t)):
        print(f"    {name:<20} {statistics.median(times):7.2f} s  {tok / statistics.median(times):9.0f} tok/s")
    print(f"    per-round ratios     {' '.join(f'{x:.3f}' for x in ratios)}")
    print(f"    overhead ratio (median): {statistics.median(ratios):.3f}  (target <= 1.05)")


def bench_cpu_precision(rounds: int) -> None:
    """(c): fp32 vs bf16 autocast forward + backward of the demo model, alternating, one thread."""
    torch.set_num_threads(1)
    cfg = load_model_config(ROOT / "configs" / "model" / "demo.yaml")
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, 129))

    def step(bf16: bool) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.float().mean().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    step(False)  # first call: allocations
    times = {"fp32": [], "bf16": []}
    for _ in range(rounds):
        times["fp32"].append(step(False))
        times["bf16"].append(step(True))
    fp32, bf16 = statistics.median(times["fp32"]), statistics.median(times["bf16"])
    print(f"(c) demo model, 4 x 128 tokens, forward + backward, 1 thread, median of {rounds} alternating rounds; "
          f"native bf16 on this CPU: {'yes' if native else 'no'}")
    print(f"    fp32 {fp32:.2f} s   bf16 autocast {bf16:.2f} s   bf16/fp32 = {bf16 / fp32:.2f}x")


def _ddp_rank(rank: int, world: int, port: int, steps: int, out) -> None:
    """(d), one rank: rank 0 puts the (default s, fixed s) of each timed pair of steps on ``out``."""
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_model_config(ROOT / "configs/model/tiny.yaml")
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (8, 4, 129), generator=torch.Generator().manual_seed(rank))
    wrappers = {}
    for name, kwargs in (("default", {}), ("fixed", {"find_unused_parameters": True})):
        ddp = DistributedDataParallel(GPT(cfg), **kwargs)
        ddp.module.load_state_dict(model.state_dict())
        wrappers[name] = (ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3, fused=True))

    def step(name: str, x: torch.Tensor) -> float:
        ddp, opt = wrappers[name]
        dist.barrier()
        t0 = time.perf_counter()
        ddp(x[:, :-1], targets=x[:, 1:]).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        return time.perf_counter() - t0

    for name in wrappers:  # the default rebuilds its buckets after its first step: not timed
        step(name, tokens[0])
        step(name, tokens[1])
    times = []
    for i in range(steps):  # step by step, alternating which goes first: both see the same machine
        x = tokens[i % len(tokens)]
        order = ("default", "fixed") if i % 2 == 0 else ("fixed", "default")
        t = {name: step(name, x) for name in order}
        times.append((t["default"], t["fixed"]))
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def bench_ddp(args) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_ddp_rank, args=(args.ddp, port, args.steps, out), nprocs=args.ddp)
    times = out.get()
    ratios = sorted(b / a for a, b in times)
    q = statistics.quantiles(ratios, n=4)
    print(f"(d) CPU, {args.ddp} gloo ranks x 1 thread, tiny model, 4 x 128 tokens per rank, {args.steps} pairs of "
          "steps (one of each wrapper, alternating)")
    for i, name in enumerate(("DDP default", "DDP fixed layout")):
        print(f"    {name:<20} {statistics.median(t[i] for t in times) * 1e3:7.1f} ms/step (median)")
    print(f"    per-pair ratios      quartiles {q[0]:.3f} {q[1]:.3f} {q[2]:.3f}")
    print(f"    cost ratio (median): {q[1]:.3f}  (target <= 1.02)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="(a): timed steps")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    p.add_argument("--corpus", type=Path, default=None, help="(a): demo corpus dir (default: build one)")
    p.add_argument("--cpu-precision", action="store_true", help="(c) only: fp32 vs bf16 autocast on this CPU")
    p.add_argument("--ddp", type=int, default=0, metavar="RANKS", help="(d) only: DDP bucket layouts, RANKS ranks")
    args = p.parse_args(argv)
    if args.ddp:
        bench_ddp(args)
    elif args.cpu_precision:
        bench_cpu_precision(args.rounds)
    else:
        bench_cpu(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
