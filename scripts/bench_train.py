"""Benchmark the training step.

    python scripts/bench_train.py                        # (a) CPU: Lightning step vs a plain PyTorch loop
    python scripts/bench_train.py --device cuda          # (b) GPU: tokens/s and MFU of the 350M config
    python scripts/bench_train.py --cpu-precision        # (c) CPU: fp32 vs bf16 autocast, the demo model

(a) The same tiny model, the same batches (real packed batches of the demo corpus), the same AdamW,
    gradient clipping and LR schedule: our LightningModule under a Trainer (its per-source loss
    reductions and logging included) against a plain PyTorch loop. The contenders alternate a few
    rounds in this process; the overhead ratio is the median of per-round time ratios (target <= 1.05).
(b) The 350M config (configs/model/350m.yaml) at the real micro-batch (32) x 2048 in bf16 autocast with
    fused AdamW (document masking as the config says; --doc-mask on for flex_attention), the module's
    forward call: eager vs torch.compile x plain vs chunked loss, each on a fresh model in this process.
    Prints the first steps (compilation), step time, tokens/s, TFLOP/s, MFU against the device's dense
    bf16 peak (989.5 TFLOP/s on H100/H200; --peak-flops to override), measured peak memory and
    train/memory.py's estimate; a contender that runs out of memory says OOM (the plain loss at 32 x
    2048 is expected to). Targets on an H200: MFU >= 50%, peak <= 100 GB with the chunked loss; the
    whole run stays under 8 minutes (--budget-s).
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
import dataclasses
import gc
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

from data.types import TrainBatch, TrainingContext  # noqa: E402
from train.callbacks import default_peak_flops  # noqa: E402
from train.model import GPT, load_model_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["web", "code", "books", "curated"]


def demo_data(n: int, batch: int, seq: int, corpus: Path | None) -> tuple[list[TrainBatch[torch.Tensor]],
                                                                          TrainingContext]:
    """Real packed batches from the demo corpus (built into a temp dir unless given), and the prepared
    data the module reads, with :func:`lr_schedule`'s LR."""
    from data.config import DataConfig, corpus_sources
    from data.corpus.demo import build_demo_corpus
    from data.manifest import build_manifest
    from data.schedules import fixed_schedule
    from data.simulate import OrderSimulator
    from data.steps import StepSchedule
    from train.datamodule import to_torch

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
    from data.schedules import build_schedule

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
    from train.module import PretrainModule

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
    print(
        f"(a) CPU, tiny model ({sum(p.numel() for p in GPT(cfg).parameters()) / 1e6:.1f}M), "
        f"{args.steps} steps of 8 x 128, "
        f"{args.rounds} alternating rounds"
    )
    print(
        f"    plain PyTorch loop   {statistics.median(plain_t):7.2f} s  {tok / statistics.median(plain_t):9.0f} tok/s"
    )
    print(
        f"    Lightning module     {statistics.median(light_t):7.2f} s  {tok / statistics.median(light_t):9.0f} tok/s"
    )
    print(f"    per-round ratios     {' '.join(f'{x:.3f}' for x in ratios)}")
    print(f"    overhead ratio (median): {statistics.median(ratios):.3f}  (target <= 1.05)")


def packed_doc_index(batch: int, seq: int, mean_doc: int, generator: torch.Generator) -> torch.Tensor:
    """Document ids [B, L] of packed rows: documents of exponential length (mean ``mean_doc`` tokens)
    back to back, as the packer produces them, so document masking does real work."""
    rows = []
    for _ in range(batch):
        lengths = (torch.empty(seq).exponential_(1.0 / mean_doc, generator=generator).long() + 1).cumsum(0)
        boundaries = torch.zeros(seq, dtype=torch.long)
        boundaries[lengths[lengths < seq]] = 1
        rows.append(boundaries.cumsum(0))
    return torch.stack(rows)


def real_micro_batch() -> int:
    import yaml

    raw = yaml.safe_load((ROOT / "configs/pretrain_350m_20b.yaml").read_text())
    return int(raw["data"]["batch_size"])


def cuda_variant(cfg, batch: dict, compile: bool, loss: str, warmup: int, steps: int, doc_mask: bool) -> dict:
    """One contender: fresh model and fused AdamW, the module's own forward call, bf16 autocast."""

    from train.memory import estimate_peak_memory

    cfg = dataclasses.replace(cfg, loss_impl=loss, doc_mask=doc_mask)
    out = {"compile": compile, "loss": loss,
           "estimate_gb": estimate_peak_memory(cfg, *batch["input_ids"].shape, loss=loss,
                                               activation_checkpointing=cfg.activation_checkpointing)["total"] / 1e9}
    torch.manual_seed(0)
    model = opt = fwd = None
    try:
        model = GPT(cfg).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        fwd = torch.compile(model) if compile else model
        doc_index = batch["doc_index"] if cfg.doc_mask else None

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss_value = fwd(batch["input_ids"], doc_index=doc_index, targets=batch["targets"]).mean()
            loss_value.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss_value

        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        out["first_steps_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(steps):
            last = step()
        torch.cuda.synchronize()
        out["step_s"] = (time.perf_counter() - t0) / steps
        out["final_loss"] = float(last.detach())
        out["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        out["flops_per_token"] = model.flops_per_token(batch["input_ids"].shape[1])
    except torch.cuda.OutOfMemoryError:
        out["oom"] = True
        out["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    finally:
        model = opt = fwd = None  # free before the next contender
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    return out


def bench_cuda(args) -> None:
    """(b): the real shape, eager vs compiled x plain vs chunked loss, in one process."""
    assert torch.cuda.is_available(), "--device cuda needs a CUDA GPU"
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = load_model_config(ROOT / "configs/model/350m.yaml")
    B, Lq = args.batch or real_micro_batch(), args.seq_len
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size - 100, (B, Lq + 1), generator=g)
    batch = {"input_ids": tokens[:, :-1].cuda(), "targets": tokens[:, 1:].cuda(),
             "doc_index": packed_doc_index(B, Lq, args.mean_doc, g).cuda()}
    peak = args.peak_flops or default_peak_flops()
    doc_mask = cfg.doc_mask if args.doc_mask is None else args.doc_mask == "on"
    total = torch.cuda.get_device_properties(0).total_memory
    print(f"(b) {torch.cuda.get_device_name()} ({total / 2**30:.0f} GiB): 350M, micro-batch {B} x {Lq} "
          f"(the real config's), bf16 autocast, fused AdamW, document masking "
          f"{f'on (packed documents of mean {args.mean_doc} tokens)' if doc_mask else 'off'}; "
          f"{args.warmup} untimed + {args.steps} timed steps per contender")
    print(f"    {'contender':<22} {'first steps':>11} {'step':>9} {'tokens/s':>11} {'TFLOP/s':>8} {'MFU':>6} "
          f"{'peak mem':>9} {'estimate':>9}")
    started, results = time.perf_counter(), []
    for compile in (False, True):
        for loss in ("plain", "chunked"):
            if args.only and f"{'compiled' if compile else 'eager'}-{loss}" not in args.only:
                continue
            if time.perf_counter() - started > args.budget_s:
                print(f"    {'(skipped: --budget-s)':<22}")
                continue
            r = cuda_variant(cfg, batch, compile, loss, args.warmup, args.steps, doc_mask)
            results.append(r)
            name = f"{'compiled' if compile else 'eager'} + {loss}"
            if r.get("oom"):
                print(f"    {name:<22} {'OOM':>11} {'':>9} {'':>11} {'':>8} {'':>6} {r['peak_gb']:8.1f}G "
                      f"{r['estimate_gb']:8.1f}G")
                continue
            tps = B * Lq / r["step_s"]
            tflops = r["flops_per_token"] * tps / 1e12
            mfu = f"{tflops * 1e12 / peak:6.1%}" if peak else "   n/a"
            print(f"    {name:<22} {r['first_steps_s']:10.1f}s {r['step_s'] * 1e3:7.1f}ms {tps:11,.0f} {tflops:8.1f} "
                  f"{mfu} {r['peak_gb']:8.1f}G {r['estimate_gb']:8.1f}G", flush=True)
    if peak:
        print(f"    MFU against {peak / 1e12:.1f} TFLOP/s dense bf16 (target >= 50%); peak memory target at 32 x 2048 "
              "with the chunked loss <= 100 GB; estimate = train/memory.py")
    else:
        print("    MFU: unknown device peak; pass --peak-flops")
    print(f"    total {time.perf_counter() - started:.0f} s")


def bench_cpu_precision(rounds: int) -> None:
    """(c): fp32 vs bf16 autocast forward + backward of the demo model, alternating, one thread."""
    from train.model import GPT, load_model_config

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=None, help="timed steps (cpu: 40, cuda: 20)")
    p.add_argument("--rounds", type=int, default=3, help="cpu: alternating rounds")
    p.add_argument("--corpus", type=Path, default=None, help="cpu: demo corpus dir (default: build one)")
    p.add_argument("--batch", type=int, default=None,
                   help="cuda: micro-batch (default: data.batch_size of configs/pretrain_350m_20b.yaml)")
    p.add_argument("--mean-doc", type=int, default=800, help="cuda: mean packed document length in tokens")
    p.add_argument("--doc-mask", choices=["on", "off"], default=None,
                   help="cuda: document masking (default: the 350M config's model.doc_mask, off)")
    p.add_argument("--only", nargs="*", default=None,
                   help="cuda: contenders to run, of eager-plain eager-chunked compiled-plain compiled-chunked")
    p.add_argument("--budget-s", type=float, default=420, help="cuda: skip the contenders left after this")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3, help="cuda: untimed steps (compilation)")
    p.add_argument("--peak-flops", type=float, default=None)
    p.add_argument("--cpu-precision", action="store_true", help="(c) only: fp32 vs bf16 autocast on this CPU")
    args = p.parse_args(argv)
    if args.cpu_precision:
        bench_cpu_precision(args.rounds)
    elif args.device == "cpu":
        args.steps = args.steps or 40
        bench_cpu(args)
    else:
        args.steps = args.steps or 10
        bench_cuda(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
