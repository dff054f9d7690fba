"""The GPU check's sections that run the model in a bare loop, not through ``train fit`` (each in a child
the check forks, train/tools/gpu_check.py ``json_section``; ``save(figures)`` hands back what is measured):
``mask``, flex_attention against the dense-mask reference (within :data:`TOLERANCE`) and what masking
adds to a step, and ``contenders``, the module's forward call in a bare loop (docs/real-run.md says what
each figure means).
"""

from __future__ import annotations

import gc
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.nn.attention import flex_attention as flex

from train.callbacks import default_peak_flops
from train.memory import estimate_peak_memory
from train.model import GPT, Attention, document_block_mask, load_model_config, rope_tables
from train.optim import OptimConfig

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = {  # flex vs dense: max |logit diff|, |loss diff|, max over parameters of |grad diff| / |grad|
    "fp32": {"logits": 1e-3, "loss": 1e-4, "grad_rel": 1e-3},
    "bf16": {"logits": 0.1, "loss": 2e-2, "grad_rel": 5e-2},  # bf16 rounding of q, k, v and the scores
}


# --- section 2: document masking ----------------------------------------------------------------------


def model_config(dry: bool):
    """The real model's config; dry, the tiny one with 1,024 rows of vocabulary (the vocabulary does not
    touch masking or the loop, and the tiny model's 100k rows dominate its CPU time)."""
    base = load_model_config(ROOT / "configs/model" / ("tiny.yaml" if dry else "350m.yaml"))
    return replace(base, vocab_size=1024) if dry else base


def packed_doc_index(batch: int, seq: int, mean_doc: int, generator):
    """Document ids [B, L] of packed rows: exponential document lengths (mean ``mean_doc``) back to back."""
    rows = []
    for _ in range(batch):
        ends = (torch.empty(seq).exponential_(1.0 / mean_doc, generator=generator).long() + 1).cumsum(0)
        starts = torch.zeros(seq, dtype=torch.long)
        starts[ends[ends < seq]] = 1
        rows.append(starts.cumsum(0).to(torch.int32))
    return torch.stack(rows)


def timed(fn, warmup: int, steps: int, device: str) -> float:
    """Mean seconds per call of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def mask_figures(ctx: dict, save, deadline: float) -> dict:
    """The time masking adds to a step (first: it is cheap), then flex vs dense (fp32, then bf16 autocast)
    on a 2-layer slice of the model: the eager model (compiled flex helpers on CUDA) with logits, losses and
    gradients; the whole model compiled (flex traced into its graph) with losses and gradients."""
    dry = ctx["dry"]
    device = "cpu" if dry else "cuda"
    if dry:  # torch refuses flex_attention's backward on CPU by an input check; its math backward runs
        flex._validate_device = lambda *tensors: None  # (as tests/unit/test_attention.py does)
    base = model_config(dry)
    g = torch.Generator().manual_seed(0)
    out: dict = {"tolerance": TOLERANCE, "cases": {}, **_masking_cost(base, g, device, dry)}
    out.update(_masked_step(ctx.get("train_step_s"), ctx.get("train_mfu"), out["step_added_s"]))
    save(out)
    B, L = (2, 64) if dry else (4, 2048)
    doc = packed_doc_index(B, L, max(8, L // 6), g).to(device)
    ids = torch.randint(0, base.vocab_size - 100, (B, L + 1), generator=g).to(device)
    cfg = replace(base, n_layers=2, doc_mask=True)
    out.update(correctness_shape=[B, L], correctness_layers=2)
    for precision in ("fp32",) if dry else ("fp32", "bf16"):  # one compiled graph per precision: its cost
        dense = _masked_run(cfg, ("dense", False), precision, ids, doc, device, dry)
        for compiled in (False, True):
            flex_run = _masked_run(cfg, ("flex", compiled), precision, ids, doc, device, dry)
            name = f"{precision}_flex_{'compiled_model' if compiled else 'eager_model'}"
            out["cases"][name] = _compare_to_dense(flex_run, dense, TOLERANCE[precision])
        out["flex_matches_dense"] = all(case["within_tolerance"] for case in out["cases"].values())
        save(out)
    return out


def _masked_step(step_s: float | None, mfu: float | None, added: float) -> dict:
    """Section 1's steady step (masking off there: the 350M config's default) with masking's cost added."""
    if not step_s:
        return {}
    return {"step_s_masked_est": step_s + added, "mfu_masked_est": mfu * step_s / (step_s + added) if mfu else None,
            "mfu_cost_rel": added / (step_s + added)}


def _masking_cost(base, g, device: str, dry: bool) -> dict:
    """One attention layer of the real model, forward + backward under bf16 autocast: causal SDPA (flash) vs
    flex with the BlockMask of packed documents, plus building the BlockMask (once per forward)."""
    Bt, Lt = (1, 64) if dry else (32, 2048)
    x = torch.randn(Bt, Lt, base.d_model, device=device, requires_grad=True)
    doc_t = packed_doc_index(Bt, Lt, max(8, min(800, Lt // 3)), g).to(device)
    attn = Attention(base).to(device)
    cos, sin = (t[:Lt].unsqueeze(-3).to(device) for t in rope_tables(base.max_seq_len, base.head_dim, base.rope_theta))
    steps, warmup = (2, 1) if dry else (10, 3)

    def layer(mask):
        def fn():
            with torch.autocast(device, dtype=torch.bfloat16):
                y = attn(x, cos, sin, mask)
            y.float().sum().backward()
        return fn

    causal_s = timed(layer(None), warmup, steps, device)
    block_mask = document_block_mask(doc_t)
    flex_s = timed(layer(block_mask), warmup, steps, device)
    mask_s = timed(lambda: document_block_mask(doc_t), warmup, steps, device)
    added = base.n_layers * (flex_s - causal_s) + mask_s
    return dict(layer_shape=[Bt, Lt], attention_causal_ms=causal_s * 1e3, attention_flex_ms=flex_s * 1e3,
                block_mask_ms=mask_s * 1e3, step_added_s=added, block_mask_sparsity=float(block_mask.sparsity()))


def _masked_run(cfg, key: tuple[str, bool], precision: str, ids, doc, device: str, dry: bool) -> tuple:
    """(logits, mean loss, gradients) of a fresh model with masking ``key`` = (impl, whole model compiled);
    no logits from the compiled model (its graph is the loss's)."""
    impl, compiled = key
    torch.manual_seed(0)
    model = GPT(replace(cfg, doc_mask_impl=impl)).to(device)
    fwd = torch.compile(model, backend="eager" if dry else "inductor") if compiled else model
    with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
        logits = None if compiled else fwd(ids[:, :-1], doc_index=doc).detach()
        losses = fwd(ids[:, :-1], doc_index=doc, targets=ids[:, 1:])
    losses.mean().backward()
    return logits, losses.detach().mean(), {n: p.grad.detach().float() for n, p in model.named_parameters()}


def _compare_to_dense(result: tuple, reference: tuple, tol: dict) -> dict:
    """A flex run against the dense-mask run: logits, loss and gradient differences within ``tol``."""
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = result, reference
    case = {
        "logits_max_abs_diff": None if logits is None else float((logits - ref_logits).abs().max()),
        "loss_abs_diff": float((loss - ref_loss).abs()),
        "grad_max_rel_diff": max(float((grads[n] - g_).norm() / g_.norm().clamp_min(1e-30))
                                 for n, g_ in ref_grads.items()),
    }
    case["within_tolerance"] = ((case["logits_max_abs_diff"] or 0.0) <= tol["logits"]
                                and case["loss_abs_diff"] <= tol["loss"]
                                and case["grad_max_rel_diff"] <= tol["grad_rel"])
    return case


# --- section 5: contenders ----------------------------------------------------------------------------


def contender_figures(ctx: dict, save, deadline: float) -> dict:
    """The module's forward call (per-token losses inside forward) + fused AdamW under bf16 autocast, each
    contender on a fresh model; OOM is a result. Compiled with inductor on the GPU, the eager backend dry.
    A contender is skipped (recorded) when it would not finish before the section's deadline."""
    dry = ctx["dry"]
    base = model_config(dry)
    full, L = (2, 32) if dry else (32, 2048)
    peak = 1e12 if dry else default_peak_flops()
    half_mode = "eager" if dry else "compiled"  # dry: one compiled contender is enough to exercise the path
    plan = [("eager", "chunked", full), ("eager", "plain", full), ("compiled", "chunked", full),
            (half_mode, "chunked", full // 2)]
    rows: list[dict] = []
    out: dict = {"contenders": rows, "peak_flops": peak}
    for mode, loss, batch in plan:
        cfg = replace(base, loss_impl=loss)
        row = {"name": f"{mode}-{loss}-{batch}", "compile": mode == "compiled", "loss": loss, "micro_batch": batch,
               "seq_len": L, "estimate_gb": estimate_peak_memory(cfg, batch, L, loss=loss)["total"] / 1e9}
        need = 0 if dry else 100 if mode == "compiled" else 30  # seconds: a compile of the 350M, or a few steps
        rows.append({**row, "skipped": "section time limit"} if time.monotonic() + need > deadline
                    else _run_contender(row, cfg, peak, dry))
        save(out)
    return {**out, **_contender_ratios(ctx, rows, full, half_mode)}


def _run_contender(row: dict, cfg, peak: float | None, dry: bool) -> dict:
    """One contender's first step and mean step time, tokens/s, MFU and peak memory into ``row`` (or
    ``oom``); the model, optimizer and compiled graphs are released after it."""
    device = "cpu" if dry else "cuda"
    batch, L = row["micro_batch"], row["seq_len"]
    tokens = torch.randint(0, cfg.vocab_size - 100, (batch, L + 1), generator=torch.Generator().manual_seed(0))
    step = model = None
    try:
        step, model = _train_step(cfg, tokens.to(device), row["compile"], device, dry)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.monotonic()
        step()
        row["first_step_s"] = time.monotonic() - t0
        row["step_s"] = timed(step, (1 if dry else 3) - 1, 2 if dry else 8, device)
        row["tokens_per_s"] = batch * L / row["step_s"]
        row["mfu"] = model.flops_per_token(L) * row["tokens_per_s"] / peak if peak else None
    except torch.cuda.OutOfMemoryError:
        row["oom"] = True
    finally:
        row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None
        step = model = None
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()
    return row


def _train_step(cfg, tokens, compiled: bool, device: str, dry: bool):
    """A fresh model and fused AdamW; the step (forward with the loss, backward, clipping, optimizer) and the model."""
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = OptimConfig(fused=True).build(model.named_parameters(), lr=1e-4)  # the run's default: AdamW
    fwd = torch.compile(model, backend="eager" if dry else "inductor") if compiled else model

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            value = fwd(tokens[:, :-1], targets=tokens[:, 1:]).mean()
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, model


def _contender_ratios(ctx: dict, rows: list[dict], full: int, half_mode: str) -> dict:
    """Tokens/s ratios: compiled over eager, section 1's train fit (compiled, the whole Lightning step) over
    the eager bare loop, half the micro-batch over the full one; and whether the plain loss ran out of memory."""
    rate = {r["name"]: r.get("tokens_per_s") for r in rows}

    def ratio(a, b):
        return a / b if a and b else None

    return {"compiled_over_eager": ratio(rate[f"compiled-chunked-{full}"], rate[f"eager-chunked-{full}"]),
            "train_fit_over_eager": ratio(ctx.get("train_tokens_per_s"), rate[f"eager-chunked-{full}"]),
            "half_micro_batch_over_full": ratio(rate[f"{half_mode}-chunked-{full // 2}"],
                                                rate[f"{half_mode}-chunked-{full}"]),
            "plain_loss_oom": bool(next(r for r in rows if r["name"] == f"eager-plain-{full}").get("oom"))}


