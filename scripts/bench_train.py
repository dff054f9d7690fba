"""Benchmark the training step.

    python scripts/bench_train.py                        # (a) CPU: Lightning step vs a plain PyTorch loop
    python scripts/bench_train.py --device cuda          # (b) GPU: tokens/s and MFU of the 350M config

(a) The same tiny model, the same batches (real packed batches of the demo corpus), the same AdamW,
    gradient clipping and LR schedule: our LightningModule under a Trainer (its per-source loss
    reductions and logging included) against a plain PyTorch loop. The contenders alternate a few
    rounds in this process; the overhead ratio is the median of per-round time ratios (target <= 1.05).
(b) The 350M config (configs/model/350m.yaml) at sequence 2048 in bf16 autocast with torch.compile and
    fused AdamW, a plain training step on random tokens: tokens/s and MFU against the device's dense
    bf16 peak (989.5 TFLOP/s on H100/H200; --peak-flops to override). Target: MFU >= 50% on an H200.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from train.malloc import keep_freed_memory

keep_freed_memory()  # the same allocator setting as python -m train

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from train.callbacks import default_peak_flops  # noqa: E402
from train.model import GPT, load_model_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["web", "code", "books", "curated"]


def demo_batches(n: int, batch: int, seq: int, corpus: Path | None) -> list[dict]:
    """Real packed batches from the demo corpus (built into a temp dir unless given)."""
    from data.config import DataConfig, corpus_sources
    from data.corpus.demo import build_demo_corpus
    from data.manifest import build_manifest
    from data.simulate import OrderSimulator
    from train.datamodule import to_torch

    if corpus is None:
        corpus = Path(tempfile.mkdtemp()) / "demo_corpus"
        build_demo_corpus(corpus)
    cfg = DataConfig(
        sources=corpus_sources(corpus, SOURCES),
        weights={"web": 0.62, "code": 0.18, "books": 0.12, "curated": 0.08},
        batch_size=batch,
        seq_len=seq,
        buffer_size=256,
        manifest_cache=str(corpus.parent / ".cache"),
    )
    sim = OrderSimulator(build_manifest(cfg), cfg, 1, 1)
    return [to_torch(b) for _, _, b in sim.batches(n)]


def lr_schedule(total: int):
    from data.schedules import build_schedule

    return build_schedule({
        "train_tokens": total * 8 * 128, "global_batch_size": 8,
        "seq_len": {"start": 128, "end": 128, "warmup_steps": 0, "multiple": 64},
        "lr": {"peak": 1e-3, "min": 0.0, "warmup_steps": 5}, "anneal_start": 0.9,
        "mixture": {"weights": {"web": 0.62, "code": 0.18, "books": 0.12, "curated": 0.08}},
    })


def plain_loop(model: GPT, batches: list[dict], schedule) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule.lr(s) / 1e-3)
    t0 = time.perf_counter()
    for b in batches:
        logits = model(b["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), b["targets"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        loss.item()  # the Lightning loop syncs on the loss for logging too
    return time.perf_counter() - t0


class _Batches(L.LightningDataModule):
    """The minimum of WellMixedData the module reads: source names, the schedule, the batches."""

    def __init__(self, batches: list[dict], schedule):
        super().__init__()
        self.batches, self.val_tokens_per_source, self.accumulate = batches, 0, 1
        self.manifest = SimpleNamespace(source_names=SOURCES)
        self.steps = SimpleNamespace(lr=schedule.lr, schedule=schedule)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None)


def lightning_loop(model_cfg, batches: list[dict], schedule) -> float:
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
    trainer.fit(module, datamodule=_Batches(batches, schedule))
    return timer["t1"] - timer["t0"]


def bench_cpu(args) -> None:
    torch.manual_seed(0)
    cfg = load_model_config(ROOT / "configs/model/tiny.yaml")
    batches = demo_batches(args.steps, 8, 128, args.corpus)
    schedule = lr_schedule(args.steps)
    import logging

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    ratios, plain_t, light_t = [], [], []
    for r in range(args.rounds):
        torch.manual_seed(r)
        p = plain_loop(GPT(cfg), batches, schedule)
        torch.manual_seed(r)
        q = lightning_loop(cfg, batches, schedule)
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


def bench_cuda(args) -> None:
    assert torch.cuda.is_available(), "--device cuda needs a CUDA GPU"
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = load_model_config(ROOT / "configs/model/350m.yaml")
    model = GPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    step_model = torch.compile(model) if not args.no_compile else model
    B, Lq = args.batch, args.seq_len
    x = torch.randint(0, 100277, (B, Lq + 1), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = step_model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    tps = B * Lq / dt
    peak = args.peak_flops or default_peak_flops()
    flops = model.flops_per_token(Lq) * tps
    print(f"(b) {torch.cuda.get_device_name()}: 350M ({model.num_params() / 1e6:.1f}M params), batch {B} x {Lq}, "
          f"bf16 autocast, compile={not args.no_compile}, fused AdamW")
    print(f"    warm-up + compile {compile_s:.1f} s; step {dt * 1e3:.1f} ms; {tps:,.0f} tokens/s; "
          f"{flops / 1e12:.1f} TFLOP/s model FLOPs; peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    if peak:
        print(f"    MFU {flops / peak:.1%} of {peak / 1e12:.1f} TFLOP/s dense bf16  (target >= 50%)")
    else:
        print("    MFU: unknown device peak; pass --peak-flops")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=None, help="timed steps (cpu: 40, cuda: 20)")
    p.add_argument("--rounds", type=int, default=3, help="cpu: alternating rounds")
    p.add_argument("--corpus", type=Path, default=None, help="cpu: demo corpus dir (default: build one)")
    p.add_argument("--batch", type=int, default=8, help="cuda: sequences per step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=5, help="cuda: untimed steps (compilation)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--peak-flops", type=float, default=None)
    args = p.parse_args(argv)
    if args.device == "cpu":
        args.steps = args.steps or 40
        bench_cpu(args)
    else:
        args.steps = args.steps or 20
        bench_cuda(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
