"""The GPU check: the real training path and the GPU-only code paths, measured in one call (< 9 minutes).

    bash scripts/gpu_check.sh                                   # on the device: carried wheels, then this
    python scripts/gpu_check.py --out DIR                       # the sections below on one CUDA GPU
    python scripts/gpu_check.py --out DIR --dry-run             # the same steps on CPU: tiny model, gloo
    python scripts/gpu_check.py --out DIR --only train,mask     # some sections (a rerun)

Writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out`` (default ``$OUT``, else ``gpu_check/``),
rewritten after every section, so a call cut short still returns what was measured. Each section has its
own time limit; a section that fails, runs out of time or is skipped (the whole check's ``--budget-s``)
is recorded as such and the next one runs. docs/real-run.md ("GPU check") says what each figure means.

1. ``train``: ``python -m train fit`` with configs/pretrain_350m_20b.yaml + presets/1gpu.yaml (350M,
   32 x 2048, bf16-mixed, compile, chunked loss) on a generated Dolma 3-shaped corpus
   (data/corpus/dolma3_like.py, the config's own source patterns), the sequence-length warmup shortened to
   a few steps, accumulation 1: steady tokens/s, MFU as logged and recomputed from step times, peak memory
   against train/memory.py, time to first step, compile time, recompiles and graph breaks, the share of
   step time spent between steps (DataLoader fetch and loop bookkeeping).
2. ``mask``: document masking, flex_attention against the dense-mask SDPA reference (logits, losses,
   gradients; eager model with compiled helpers, and the whole model compiled), and the time masking adds
   to a step (one attention layer, causal SDPA vs flex, times the layers, plus the BlockMask).
3. ``resume``: a run SIGKILLed after a checkpoint and resumed; the steps both launches trained compared
   (order-log pieces identical; losses).
4. ``fsdp``: ``--trainer.strategy fsdp`` (FSDP2) on one GPU, a few steps, a sharded checkpoint, resumed.
5. ``contenders``: the module's forward call in a bare loop: compiled vs eager, chunked vs plain loss
   (plain at 32 x 2048 is expected to run out of memory: recorded as OOM), micro-batch 16 vs 32.

Training runs are forked from this process (a forked child starts without re-importing torch; this
process never initialises CUDA, so the children may). ``--dry-run`` runs every section on CPU with
configs/model/tiny.yaml, a few steps each, torch.compile with the eager backend where the GPU uses
inductor, and gloo for FSDP: every step but the CUDA kernels, in well under a minute.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

from data.files import write_text

# torch.cuda.is_available() by NVML, not the CUDA runtime: this process may then fork training children
# that initialise CUDA themselves (a parent that initialised it would leave them unusable). Set on import,
# before anything here imports torch.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("train", "mask", "resume", "fsdp", "contenders")
SECTION_LIMIT_S = {"train": 230, "mask": 110, "resume": 50, "fsdp": 50, "contenders": 170}
"""Each section's own time limit on the GPU (the dry run's are 90 s: only a hang runs into them)."""
TOLERANCE = {  # flex vs dense: max |logit diff|, |loss diff|, max over parameters of |grad diff| / |grad|
    "fp32": {"logits": 1e-3, "loss": 1e-4, "grad_rel": 1e-3},
    "bf16": {"logits": 0.1, "loss": 2e-2, "grad_rel": 5e-2},  # bf16 rounding of q, k, v and the scores
}
TARGETS = {"mfu": 0.50, "peak_gb": 100.0, "mfu_agreement": 0.02, "memory_vs_estimate": 0.10,
           "loop_gap_share": 0.01}

log = logging.getLogger("gpu_check")


# --- launching ---------------------------------------------------------------------------------------


def forked(target, log_path: Path, timeout_s: float, kill_when=None, env: dict | None = None) -> dict:
    """Run ``target()`` (returns an exit code) in a forked child in its own session, output to ``log_path``;
    SIGKILL its whole process group (DataLoader workers too) when ``kill_when()`` holds or at the timeout."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised in the gpu_check process itself: a forked child could not use it")
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child
        rc = 1
        try:
            os.setsid()
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.update(env or {})
            if os.environ.get("GPU_CHECK_DRY"):  # 2 shared CPU cores: one thread per child, no oversubscription
                import torch

                torch.set_num_threads(1)
            rc = int(target() or 0)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    killed = timed_out = False
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            elapsed = time.monotonic() - t0
            if not killed and (elapsed > timeout_s or (kill_when is not None and kill_when())):
                timed_out = elapsed > timeout_s
                killed = True
                _killpg(pid)
            time.sleep(0.005)
    except BaseException:  # never leave a training run behind
        _killpg(pid)
        os.waitpid(pid, 0)
        raise
    _killpg(pid)  # whatever of the group is left (a worker of a killed run)
    rc = os.waitstatus_to_exitcode(status)
    return {"rc": rc, "killed": killed, "timed_out": timed_out, "wall_s": round(time.monotonic() - t0, 2),
            "log": str(log_path)}


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: Path | str, n: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


class SectionFailed(RuntimeError):
    """A section's run failed or ran out of time; ``figures`` holds what it measured before that."""

    def __init__(self, message: str, figures: dict | None = None):
        super().__init__(message)
        self.figures = figures or {}


def check_run(result: dict, what: str, expect_rc: int = 0, figures: dict | None = None) -> None:
    if result["timed_out"]:
        raise SectionFailed(f"{what}: timed out after {result['wall_s']} s\n{tail(result['log'])}", figures)
    if result["rc"] != expect_rc:
        raise SectionFailed(f"{what}: exit code {result['rc']} (expected {expect_rc})\n{tail(result['log'])}", figures)


def json_section(ctx: dict, name: str, fn, limit_s: float) -> dict:
    """Run ``fn(ctx, save, deadline)`` in a forked child; ``save(figures)`` writes what it has measured so far,
    so a child that runs out of time or memory still hands back the figures before that."""
    path = ctx["work"] / f"{name}.json"

    def run() -> int:
        def save(figures: dict) -> None:
            write_text(path, json.dumps(figures, default=str), fsync=False)

        save(fn(ctx, save, time.monotonic() + limit_s))
        return 0

    result = forked(run, ctx["work"] / f"{name}.log", limit_s, env=ctx["env"])
    figures = json.loads(path.read_text()) if path.is_file() else {}
    check_run(result, name, figures=figures)
    return figures


# --- the training command line ---------------------------------------------------------------------


def fit_args(ctx: dict, run_dir: Path, *, steps: int, ckpt_every: int = 100_000, small: bool = False,
             extra: tuple = ()) -> list[str]:
    """``train fit`` arguments: the real config and 1-GPU preset; ``small`` = the demo model (GPU) for the
    resume and FSDP sections; the dry run scales everything to the tiny model on CPU."""
    args = ["fit", "--config", str(ROOT / "configs/pretrain_350m_20b.yaml"),
            "--config", str(ROOT / "configs/presets/1gpu.yaml"),
            "--data.val_tokens_per_source", "0", "--run.val_every_n_steps", "100000",
            "--run.wandb", "false", "--run.print_every_n_steps", "5",
            "--run.ckpt_every_n_steps", str(ckpt_every), "--run.keep_last_k", "-1",
            "--trainer.max_steps", str(steps), "--run.dir", str(run_dir),
            "--data.buffer_size", "256"]
    if ctx["dry"]:
        shape = dict(model="tiny.yaml", batch=2, start=32, end=64, multiple=32, warmup=1, workers=1)
        # fp32: bf16 autocast on a CPU without native bf16 is several times slower (its path is unit-tested)
        args += ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--run.peak_flops", "1e12",
                 "--data.buffer_size", "16", "--data.open_shards", "2"]
    elif small:
        shape = dict(model="demo.yaml", batch=8, start=256, end=512, multiple=64, warmup=2, workers=2,
                     compile="false")
    else:  # the real shape: 32 x 2048 at the end of a 4-step sequence-length warmup from 512
        shape = dict(model="350m.yaml", batch=32, start=512, end=2048, multiple=64, warmup=4, workers=4)
        if (ctx.get("gpu_gib") or 141) < 120:  # an 80 GB H100: 32 x 2048 (86.6 GB estimated) does not fit
            shape.update(batch=16, accumulate=2)
    accumulate = shape.get("accumulate", 1)
    args += ["--model.model", str(ROOT / "configs/model" / shape["model"]),
             "--data.batch_size", str(shape["batch"]), "--trainer.accumulate_grad_batches", str(accumulate),
             "--data.schedule.global_batch_size", str(shape["batch"] * accumulate),
             "--data.schedule.seq_len.start", str(shape["start"]), "--data.schedule.seq_len.end", str(shape["end"]),
             "--data.schedule.seq_len.multiple", str(shape["multiple"]),
             "--data.schedule.seq_len.warmup_steps", str(shape["warmup"]),
             "--data.num_workers", str(shape["workers"])]
    if "compile" in shape:
        args += ["--model.compile", shape["compile"]]
    return args + list(extra)


def fit_target(argv: list[str], clock_json: Path | None = None):
    """The child's body: ``python -m train fit`` (train/__main__.py's main: its early signal handlers and
    allocator setting, then train/cli.py), with a step clock when asked."""

    def run() -> int:
        import train.__main__ as entry  # installs the early signal handlers, as `python -m train` does
        import train.cli as cli
        from train.callbacks import ThroughputCallback
        from train.tools.step_clock import StepClock, watch_dynamo

        counts = watch_dynamo()
        if clock_json is not None:
            base = cli.WellMixedCLI

            class ClockedCLI(base):
                def instantiate_trainer(self, **kwargs):
                    trainer = super().instantiate_trainer(**kwargs)
                    at = next(i for i, c in enumerate(trainer.callbacks) if isinstance(c, ThroughputCallback))
                    trainer.callbacks.insert(at + 1, StepClock(clock_json, counts))  # sees this step's MFU
                    return trainer

            cli.WellMixedCLI = ClockedCLI
        sys.argv = sys.argv[:1]  # the command line is argv alone (LightningCLI warns when both are set)
        # Help texts are not printed here: parsing every attribute docstring for them was half the CLI's start-up.
        from jsonargparse import set_parsing_settings

        set_parsing_settings(docstring_parse_attribute_docstrings=False)
        return entry.main(argv)

    return run


def order_lines(run_dir: Path) -> list[dict]:
    """Rank 0's order-log lines; a line still being written (no newline yet) is left out."""
    path = run_dir / "order_log" / "rank0.jsonl"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(ln) for ln in text.split("\n")[:-1] if ln]


# --- section 1: the real training path ----------------------------------------------------------------


def section_train(ctx: dict, limit_s: float) -> dict:
    run_dir = ctx["work"] / "train"
    clock = ctx["work"] / "train_clock.json"
    steps = 3 if ctx["dry"] else 40
    env = {"GPU_CHECK_T_LAUNCH": repr(time.monotonic())}
    result = forked(fit_target(fit_args(ctx, run_dir, steps=steps), clock), ctx["work"] / "train.log", limit_s,
                    env={**ctx["env"], **env})
    if result["rc"] != 0 or result["timed_out"]:  # the figures of the steps it ran (the clock writes every 5)
        try:
            figures = train_figures(ctx, json.loads(clock.read_text()), run_dir, result)["figures"]
        except Exception as e:
            figures = {"partial": f"none ({type(e).__name__}: {e})"}
        check_run(result, "train fit", figures=figures)
    return train_figures(ctx, json.loads(clock.read_text()), run_dir, result)


def train_figures(ctx: dict, data: dict, run_dir: Path, result: dict) -> dict:
    """The train section's figures and checks from the step clock's JSON (``data``) and the run's metrics;
    sets ``ctx``'s device, step time, MFU and tokens/s for the later sections."""
    info, rows = data["info"], data["steps"]
    ctx["device"] = info.get("device")
    steady, periods, gaps = _steady_steps(rows)
    step_s = statistics.mean(periods)
    tokens, flops = steady[-1]["tokens"], steady[-1]["flops"]
    peak_flops = info.get("peak_flops")
    mfu_recomputed = flops / step_s / peak_flops if peak_flops else None
    logged = _mfu_as_logged(run_dir, steady, len(periods))
    first = rows[0]
    compile_s = sum(max(0.0, (b["end"] - a["end"]) - step_s) for a, b in zip(rows, rows[1:]) if b not in steady)
    compile_s += max(0.0, (first["end"] - first["start"]) - step_s)
    fig = {
        "steps_run": len(rows), "steady_steps": len(periods), "micro_batch": steady[-1]["batch"],
        "seq_len": steady[-1]["seq_len"],
        "step_s": step_s, "step_s_median": statistics.median(periods), "tokens_per_s": tokens / step_s,
        "mfu_logged": logged, "mfu_recomputed": mfu_recomputed,
        "mfu_agree_rel": abs(logged - mfu_recomputed) / mfu_recomputed if logged and mfu_recomputed else None,
        "peak_memory_gb": info["peak_gb"], "peak_memory_kind": info["peak_kind"],
        "estimate_gb": info["estimate_gb"], "memory_vs_estimate": info["peak_gb"] / info["estimate_gb"] - 1,
        "time_to_first_step_s": first["end"], "time_to_train_start_s": info["t_train_start"],
        "first_step_s": first["end"] - first["start"], "compile_s_est": compile_s,
        "recompiles": info["dynamo"]["recompiles"], "graph_breaks": info["dynamo"]["graph_breaks"],
        "graphs": info["dynamo"]["graphs"], "recompile_reasons": info["dynamo"]["reasons"],
        "graph_break_reasons": info["dynamo"]["graph_break_reasons"], "seq_lens": sorted({r["seq_len"] for r in rows}),
        "loop_gap_share": sum(gaps) / sum(periods), "compiled": info["compiled"], "loss_impl": info["loss_impl"],
        "precision": info["precision"], "process_wall_s": result["wall_s"],
        "dynamo_compile_times_s": info.get("dynamo_compile_times_s"),
    }
    ctx["train_step_s"], ctx["train_mfu"], ctx["train_tokens_per_s"] = step_s, mfu_recomputed, tokens / step_s
    return {"figures": fig, "checks": _train_checks(fig, dry=ctx["dry"])}


def _steady_steps(rows: list[dict]) -> tuple[list[dict], list[float], list[float]]:
    """The steps at the last sequence length past its compilation, their periods (end to end) and the gaps
    before them (previous end to their start)."""
    end_len = max(r["seq_len"] for r in rows)
    at_end = [r for r in rows if r["seq_len"] == end_len]
    steady = at_end[3:] if len(at_end) > 5 else at_end[1:] or at_end  # past compilation of the last shape
    periods = [b["end"] - a["end"] for a, b in zip(rows, rows[1:]) if b in steady]
    gaps = [b["start"] - a["end"] for a, b in zip(rows, rows[1:]) if b in steady]
    if not periods:
        raise SectionFailed(f"train fit: too few steps timed ({len(rows)})")
    return steady, periods, gaps


def _mfu_as_logged(run_dir: Path, steady: list[dict], last_n: int) -> float | None:
    """The MFU users see in metrics.csv; for a run cut short before it was written, the values the
    callback logged."""
    logged = logged_mfu(run_dir, last_n)
    if logged is None:
        values = [r["mfu_logged"] for r in steady if r.get("mfu_logged") is not None]
        logged = statistics.mean(values) if values else None
    return logged


def _train_checks(fig: dict, dry: bool) -> dict:
    """The train figures against TARGETS; the GPU targets are n/a (None) for the tiny model on CPU."""
    mfu = fig["mfu_recomputed"]
    checks = {
        "mfu_logged_vs_recomputed_within_2pct": fig["mfu_agree_rel"] is not None
        and fig["mfu_agree_rel"] <= TARGETS["mfu_agreement"],
        "peak_within_10pct_of_estimate": abs(fig["memory_vs_estimate"]) <= TARGETS["memory_vs_estimate"],
        "mfu_at_least_50pct": mfu is not None and mfu >= TARGETS["mfu"],
        "peak_at_most_100gb": fig["peak_memory_gb"] <= TARGETS["peak_gb"],
        "loop_gap_below_1pct": fig["loop_gap_share"] < TARGETS["loop_gap_share"],
    }
    if dry:
        checks.update(peak_within_10pct_of_estimate=None, mfu_at_least_50pct=None, peak_at_most_100gb=None,
                      loop_gap_below_1pct=None)
    return checks


def logged_mfu(run_dir: Path, last_n: int) -> float | None:
    """Mean of the last ``last_n`` per-step ``perf/mfu`` values in the run's metrics.csv (what users see)."""
    from train.rundir import read_metrics

    try:
        values = [float(r["perf/mfu"]) for r in read_metrics(run_dir) if r.get("perf/mfu")]
    except Exception:  # not written (a run cut short): the caller falls back on the callback's values
        return None
    return statistics.mean(values[-last_n:]) if values else None


# --- section 2: document masking ----------------------------------------------------------------------


def packed_doc_index(batch: int, seq: int, mean_doc: int, generator):
    """Document ids [B, L] of packed rows: exponential document lengths (mean ``mean_doc``) back to back."""
    import torch

    rows = []
    for _ in range(batch):
        ends = (torch.empty(seq).exponential_(1.0 / mean_doc, generator=generator).long() + 1).cumsum(0)
        starts = torch.zeros(seq, dtype=torch.long)
        starts[ends[ends < seq]] = 1
        rows.append(starts.cumsum(0).to(torch.int32))
    return torch.stack(rows)


def timed(fn, warmup: int, steps: int, device: str) -> float:
    """Mean seconds per call of ``fn`` after ``warmup`` calls."""
    import torch

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
    """The time masking adds to a step (first: it is cheap), then flex vs dense (fp32, then bf16 autocast)."""
    import torch
    from torch.nn.attention import flex_attention as flex

    from train.model import load_model_config

    dry = ctx["dry"]
    device = "cpu" if dry else "cuda"
    if dry:  # torch refuses flex_attention's backward on CPU by an input check; its math backward runs
        flex._validate_device = lambda *tensors: None  # (as tests/unit/test_attention.py does)
    base = load_model_config(ROOT / "configs/model" / ("tiny.yaml" if dry else "350m.yaml"))
    if dry:  # the vocabulary does not touch masking; the tiny model's 100k rows dominate its CPU time
        base = replace(base, vocab_size=1024)
    g = torch.Generator().manual_seed(0)
    out: dict = {"tolerance": TOLERANCE, "cases": {}}
    out.update(_masking_cost(base, g, device, dry))
    step_s, mfu = ctx.get("train_step_s"), ctx.get("train_mfu")
    if step_s:  # against section 1's steady step (masking off there: the 350M config's default)
        added = out["step_added_s"]
        out["step_s_masked_est"] = step_s + added
        out["mfu_masked_est"] = mfu * step_s / (step_s + added) if mfu else None
        out["mfu_cost_rel"] = added / (step_s + added)
    save(out)

    # Flex vs dense on a 2-layer slice of the model: the eager model (compiled flex helpers on CUDA) with
    # logits, losses and gradients; the whole model compiled (flex traced into its graph) with losses and
    # gradients (one graph per precision: the compile is the cost).
    B, L = (2, 64) if dry else (4, 2048)
    doc = packed_doc_index(B, L, max(8, L // 6), g).to(device)
    ids = torch.randint(0, base.vocab_size - 100, (B, L + 1), generator=g).to(device)
    cfg = replace(base, n_layers=2, doc_mask=True)
    out.update(correctness_shape=[B, L], correctness_layers=2)
    ok = True
    for precision in ("fp32",) if dry else ("fp32", "bf16"):
        results = {key: _masked_run(cfg, key, precision, ids, doc, device, dry)
                   for key in (("dense", False), ("flex", False), ("flex", True))}
        for key in (("flex", False), ("flex", True)):
            case = _compare_to_dense(results[key], results[("dense", False)], TOLERANCE[precision])
            ok &= case["within_tolerance"]
            out["cases"][f"{precision}_flex_{'compiled_model' if key[1] else 'eager_model'}"] = case
        del results
        out["flex_matches_dense"] = ok
        save(out)
    return out


def _masking_cost(base, g, device: str, dry: bool) -> dict:
    """One attention layer of the real model, forward + backward under bf16 autocast: causal SDPA (flash) vs
    flex with the BlockMask of packed documents, plus building the BlockMask (once per forward)."""
    import torch

    from train.model import Attention, document_block_mask, rope_tables

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
    import torch

    from train.model import GPT

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
    logits, loss, grads = result
    ref_logits, ref_loss, ref_grads = reference
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


def section_mask(ctx: dict, limit_s: float) -> dict:
    fig = json_section(ctx, "mask", mask_figures, limit_s)
    return {"figures": fig, "checks": {"flex_matches_dense_within_tolerance": bool(fig.get("flex_matches_dense"))}}


# --- section 3: SIGKILL and resume ---------------------------------------------------------------------


def section_resume(ctx: dict, limit_s: float) -> dict:
    """The first launch is SIGKILLed (with its DataLoader workers) once its order log has every + 1 lines:
    checkpoint ``every`` is on disk (written right after line every - 1) and the launch trained past it. A GPU
    step takes milliseconds, so the kill may land some steps later: the launch is long enough never to finish,
    the resume starts from whatever ``last.ckpt`` holds, and every step both launches trained is compared."""
    import torch

    run_dir = ctx["work"] / "resume"
    every = 2 if ctx["dry"] else 3
    extra = ("--data.order_log", "true")
    env = {**ctx["env"], "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    deadline = time.monotonic() + limit_s
    long = every + 3 if ctx["dry"] else 100_000
    first = forked(fit_target(fit_args(ctx, run_dir, steps=long, ckpt_every=every, small=True, extra=extra)),
                   ctx["work"] / "resume_killed.log", limit_s, env=env,
                   kill_when=lambda: len(order_lines(run_dir)) >= every + 1)
    if not first["killed"] or first["timed_out"]:
        raise SectionFailed(f"the first launch was not killed as planned ({first})\n{tail(first['log'])}")
    killed = order_lines(run_dir)
    last = run_dir / "checkpoints" / "last.ckpt"
    resumed_from = int(torch.load(last, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    steps = len(killed) + 1  # past every line the killed launch wrote
    resumed = forked(fit_target(fit_args(ctx, run_dir, steps=steps, ckpt_every=every, small=True, extra=extra)
                                + ["--ckpt_path", "last"]),
                     ctx["work"] / "resume_resumed.log", max(10.0, deadline - time.monotonic()), env=env)
    check_run(resumed, "resumed run")
    after = order_lines(run_dir)
    by_step = {ln["step"]: ln for ln in after}
    overlap = [(ln, by_step[ln["step"]]) for ln in killed if ln["step"] in by_step and ln["step"] >= resumed_from]
    same_pieces = bool(overlap) and all(a["pieces"] == b["pieces"] for a, b in overlap)
    diffs = [abs(a["loss"] - b["loss"]) for a, b in overlap]
    fig = {
        "ckpt_every": every, "killed_after_lines": len(killed), "resumed_from_step": resumed_from,
        "retrained_steps": [a["step"] for a, _ in overlap],
        "pieces_identical": same_pieces, "losses_identical": bool(diffs) and max(diffs) == 0.0,
        "loss_max_abs_diff": max(diffs) if diffs else None, "loss_tolerance": 1e-3,
        "one_line_per_step": [ln["step"] for ln in after] == list(range(steps)),
        "killed_wall_s": first["wall_s"], "resumed_wall_s": resumed["wall_s"],
        "note": "the demo model, eager, bf16-mixed (CPU dry run: fp32) on one device; losses may differ in the "
                "last bits where a kernel is not deterministic (SDPA backward): the tolerance bounds that",
    }
    checks = {"order_identical": same_pieces,
              "losses_within_tolerance": bool(diffs) and max(diffs) <= fig["loss_tolerance"],
              "one_line_per_step_after_resume": fig["one_line_per_step"]}
    return {"figures": fig, "checks": checks}


# --- section 4: FSDP2 on one device --------------------------------------------------------------------


def section_fsdp(ctx: dict, limit_s: float) -> dict:
    run_dir = ctx["work"] / "fsdp"
    extra = ("--trainer.strategy", "fsdp", "--data.order_log", "true")
    deadline = time.monotonic() + limit_s
    n = 2 if ctx["dry"] else 4
    first = forked(fit_target(fit_args(ctx, run_dir, steps=n, ckpt_every=n, small=True, extra=extra)),
                   ctx["work"] / "fsdp_first.log", limit_s, env=ctx["env"])
    check_run(first, "fsdp run")
    last = run_dir / "checkpoints" / "last.ckpt"
    layout = sorted(p.name for p in last.iterdir()) if last.is_dir() else []
    resumed = forked(fit_target(fit_args(ctx, run_dir, steps=n + 1, ckpt_every=n, small=True, extra=extra)
                                + ["--ckpt_path", "last"]),
                     ctx["work"] / "fsdp_resumed.log", max(10.0, deadline - time.monotonic()), env=ctx["env"])
    check_run(resumed, "fsdp resume")
    lines = order_lines(run_dir)
    losses = [ln["loss"] for ln in lines]
    fig = {"checkpoint_files": layout, "sharded_checkpoint": "meta.pt" in layout
           and any(n.endswith(".distcp") for n in layout),
           "steps_logged": [ln["step"] for ln in lines], "losses": losses,
           "first_wall_s": first["wall_s"], "resumed_wall_s": resumed["wall_s"]}
    checks = {"sharded_checkpoint_written": fig["sharded_checkpoint"],
              "resumed_one_line_per_step": fig["steps_logged"] == list(range(n + 1)),
              "losses_finite": all(x == x and abs(x) != float("inf") for x in losses)}
    return {"figures": fig, "checks": checks}


# --- section 5: contenders ----------------------------------------------------------------------------


def contender_figures(ctx: dict, save, deadline: float) -> dict:
    """The module's forward call (per-token losses inside forward) + fused AdamW under bf16 autocast, each
    contender on a fresh model; OOM is a result. Compiled with inductor on the GPU, the eager backend dry.
    A contender is skipped (recorded) when it would not finish before the section's deadline."""
    from train.callbacks import default_peak_flops
    from train.memory import estimate_peak_memory
    from train.model import load_model_config

    dry = ctx["dry"]
    base = load_model_config(ROOT / "configs/model" / ("tiny.yaml" if dry else "350m.yaml"))
    if dry:
        base = replace(base, vocab_size=1024)
    full, L = (2, 32) if dry else (32, 2048)
    peak = 1e12 if dry else default_peak_flops()
    half_mode = "eager" if dry else "compiled"  # dry: one compiled contender is enough to exercise the path
    plan = [("eager", "chunked", full), ("eager", "plain", full), ("compiled", "chunked", full),
            (half_mode, "chunked", full // 2)]
    rows: list[dict] = []
    out: dict = {"contenders": rows, "peak_flops": peak}
    for mode, loss, batch in plan:
        row = {"name": f"{mode}-{loss}-{batch}", "compile": mode == "compiled", "loss": loss, "micro_batch": batch,
               "seq_len": L}
        cfg = replace(base, loss_impl=loss)
        row["estimate_gb"] = estimate_peak_memory(cfg, batch, L, loss=loss)["total"] / 1e9
        need = 0 if dry else 100 if mode == "compiled" else 30  # seconds: a compile of the 350M, or a few steps
        if time.monotonic() + need > deadline:
            rows.append({**row, "skipped": "section time limit"})
        else:
            rows.append(_run_contender(row, cfg, peak, dry))
        save(out)
    return {**out, **_contender_ratios(ctx, rows, full, half_mode)}


def _run_contender(row: dict, cfg, peak: float | None, dry: bool) -> dict:
    """One contender's first step and mean step time, tokens/s, MFU and peak memory into ``row`` (or
    ``oom``); the model, optimizer and compiled graphs are released after it."""

    import torch

    from train.model import GPT

    device = "cpu" if dry else "cuda"
    warmup, steps = (1, 2) if dry else (3, 8)
    batch, L = row["micro_batch"], row["seq_len"]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size - 100, (batch, L + 1), generator=g).to(device)
    model = opt = fwd = None
    try:
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        fwd = torch.compile(model, backend="eager" if dry else "inductor") if row["compile"] else model

        def step():
            with torch.autocast(device, dtype=torch.bfloat16):
                value = fwd(tokens[:, :-1], targets=tokens[:, 1:]).mean()
            value.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.monotonic()
        step()
        row["first_step_s"] = time.monotonic() - t0
        row["step_s"] = timed(step, warmup - 1, steps, device)
        row["tokens_per_s"] = batch * L / row["step_s"]
        row["mfu"] = model.flops_per_token(L) * row["tokens_per_s"] / peak if peak else None
        row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None
    except torch.cuda.OutOfMemoryError:
        row["oom"] = True
        row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None
    finally:
        model = opt = fwd = None
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()
    return row


def _contender_ratios(ctx: dict, rows: list[dict], full: int, half_mode: str) -> dict:
    """Tokens/s ratios: compiled over eager, section 1's train fit over the eager bare loop, half the
    micro-batch over the full one; and whether the plain loss ran out of memory."""
    by = {r["name"]: r for r in rows}

    def ratio(a, b):
        ra, rb = by.get(a, {}), by.get(b, {})
        return ra["tokens_per_s"] / rb["tokens_per_s"] if "tokens_per_s" in ra and "tokens_per_s" in rb else None

    eager = by[f"eager-chunked-{full}"].get("tokens_per_s")
    return {"compiled_over_eager": ratio(f"compiled-chunked-{full}", f"eager-chunked-{full}"),
            # section 1's steady tokens/s (compiled, the whole Lightning step) over the eager bare loop
            "train_fit_over_eager": ctx["train_tokens_per_s"] / eager
            if eager and ctx.get("train_tokens_per_s") else None,
            "half_micro_batch_over_full": ratio(f"{half_mode}-chunked-{full // 2}", f"{half_mode}-chunked-{full}"),
            "plain_loss_oom": bool(by[f"eager-plain-{full}"].get("oom"))}


def section_contenders(ctx: dict, limit_s: float) -> dict:
    fig = json_section(ctx, "contenders", contender_figures, limit_s)
    ran = [r for r in fig["contenders"] if "step_s" in r or r.get("oom")]
    return {"figures": fig, "checks": {"every_contender_ran_or_oomed": len(ran) == len(fig["contenders"])}}


# --- the report ---------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    """gpu_check.md: a heading with the device and versions, then per section its status, error, checks,
    figures and the rows of its cases or contenders."""
    lines = [f"# GPU check ({'dry run, CPU' if report['dry_run'] else report.get('device') or 'GPU'})", "",
             f"{report['started']}, torch {report['torch']}, {report['total_s']:.0f} s in all; "
             f"install: {report.get('install') or 'n/a'}", ""]
    for name in SECTIONS:
        sec = report["sections"].get(name)
        if sec is not None:
            lines += _section_markdown(name, sec)
    return "\n".join(lines) + "\n"


def _section_markdown(name: str, sec: dict) -> list[str]:
    lines = [f"## {name}: {sec['status']} ({sec.get('wall_s', 0):.0f} s)", ""]
    if sec.get("error"):
        lines += ["```", sec["error"][-1500:], "```", ""]
    for key, ok in (sec.get("checks") or {}).items():
        lines.append(f"- {'n/a' if ok is None else 'PASS' if ok else 'FAIL'} {key}")
    fig = sec.get("figures") or {}
    if fig:
        lines += ["", "| figure | value |", "| --- | --- |"]
        lines += [f"| {key} | {_fmt(value)} |" for key, value in fig.items() if key not in ("contenders", "cases")]
    for key in ("cases", "contenders"):
        if key in fig:
            items = fig[key].items() if isinstance(fig[key], dict) else ((r["name"], r) for r in fig[key])
            lines += ["", f"| {key[:-1]} | figures |", "| --- | --- |"]
            lines += [f"| {k} | {_fmt({kk: vv for kk, vv in v.items() if kk != 'name'})} |" for k, v in items]
    lines.append("")
    return lines


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    if isinstance(value, list) and len(value) > 12:
        return f"{value[:12]} ... ({len(value)})"
    return str(value).replace("|", "/").replace("\n", " ")


def write_report(report: dict, out: Path, work: Path | None = None) -> None:
    """gpu_check.json, gpu_check.md and gpu_check_logs.txt (every run's log, the last 200 KB of each)."""
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "gpu_check.json", json.dumps(report, indent=1, default=str), fsync=False)
    (out / "gpu_check.md").write_text(markdown(report))
    if work is not None:
        logs = sorted(work.glob("*.log"), key=lambda p: p.stat().st_mtime)
        (out / "gpu_check_logs.txt").write_text("".join(f"===== {p.name}\n{tail(p, 200_000)}\n" for p in logs))


# --- main ---------------------------------------------------------------------------------------------


def check_gpu_command_lines(ctx: dict) -> dict:
    """Dry run: the GPU sections' ``train fit`` command lines (which the CPU never trains with) parsed by the
    CLI as they will be on the device (``--print_config``: every flag known, every value of its type)."""
    gpu = {**ctx, "dry": False}
    lines = {
        "train_h200": fit_args({**gpu, "gpu_gib": 141}, ctx["work"] / "x", steps=40),
        "train_80gb": fit_args({**gpu, "gpu_gib": 80}, ctx["work"] / "x", steps=40),
        "resume": fit_args(gpu, ctx["work"] / "x", steps=5, ckpt_every=3, small=True,
                           extra=("--data.order_log", "true")) + ["--ckpt_path", "last"],
        "fsdp": fit_args(gpu, ctx["work"] / "x", steps=4, ckpt_every=4, small=True,
                         extra=("--trainer.strategy", "fsdp", "--data.order_log", "true")),
    }
    out = {}
    for name, argv in lines.items():
        result = forked(fit_target(argv + ["--print_config"]), ctx["work"] / f"gpu_args_{name}.log", 120,
                        env=ctx["env"])
        out[name] = "ok" if result["rc"] == 0 else f"rc {result['rc']}: {tail(result['log'], 1500)}"
    return out


def gpu_memory_gib() -> float | None:
    """The GPU's memory from nvidia-smi (this process must not initialise CUDA: it forks the runs)."""

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total,name", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return float(out.splitlines()[0].split(",")[0]) / 1024
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def build_corpus(ctx: dict) -> dict:
    from data.corpus.dolma3_like import write_dolma3_like

    t0 = time.monotonic()
    tokens = 60_000 if ctx["dry"] else 6_000_000
    paths = write_dolma3_like(ctx["work"] / "corpus", total_tokens=tokens, files=2 if ctx["dry"] else 4,
                              row_group_size=16 if ctx["dry"] else 512)
    return {"tokens": tokens, "files": len(paths), "seconds": round(time.monotonic() - t0, 2)}


RUNNERS = {"train": section_train, "mask": section_mask, "resume": section_resume, "fsdp": section_fsdp,
           "contenders": section_contenders}


def main(argv: list[str] | None = None) -> int:
    """Every section of ``--only`` in turn, each within its time limit and what is left of ``--budget-s``;
    the report is rewritten after each section and printed at the end."""
    args = _parser().parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        print(f"error: --only: unknown section(s) {unknown}; choose from {list(SECTIONS)}", file=sys.stderr)
        return 2
    out = args.out or Path(os.environ.get("OUT") or ROOT / "gpu_check")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device: run with --dry-run for the CPU rehearsal", file=sys.stderr)
        return 2
    import lightning  # noqa: F401  imported once here: every forked child starts with it

    import train.cli  # noqa: F401
    budget = args.budget_s or (300.0 if args.dry_run else 490.0)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ctx, report = _start(args.dry_run, work, torch.__version__)
    for name in only:
        left = budget - (time.monotonic() - t0)
        limit = SECTION_LIMIT_S[name] if not args.dry_run else 90.0  # dry: only a hang runs into it
        sec = _run_section(ctx, name, min(limit, left), left)
        report["sections"][name] = sec
        report["device"] = ctx.get("device")
        report["total_s"] = time.monotonic() - t0
        write_report(report, out, work)
        print(f"[gpu_check] {name}: {sec['status']} in {sec['wall_s']:.0f} s", flush=True)
    report["total_s"] = time.monotonic() - t0
    write_report(report, out, work)
    print((out / "gpu_check.md").read_text())
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="output folder (default: $OUT, else gpu_check/)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, a few steps per section")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {', '.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=None,
                   help="the whole check's time (default 490 s on GPU: with gpu_check.sh's installs, under 9 "
                        "minutes; 300 dry); a section is given at most what is left, and skipped under 30 s")
    p.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    return p


def _start(dry: bool, work: Path, torch_version: str) -> tuple[dict, dict]:
    """The sections' context and the report's head: the GPU's memory (from nvidia-smi), the corpus built,
    and in a dry run the GPU sections' command lines checked."""
    ctx = {"dry": dry, "work": work,
           "env": {"DOLMA3_DIR": str(work / "corpus"), "WELLMIXED_CACHE": str(work / "cache"),
                   "WANDB_MODE": "disabled", "PYTHONHASHSEED": "0", **({"GPU_CHECK_DRY": "1"} if dry else {})}}
    report = {"dry_run": dry, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "torch": torch_version, "install": os.environ.get("GPU_CHECK_INSTALL"), "workdir": str(work),
              "targets": TARGETS, "sections": {}, "total_s": 0.0}
    if not dry:
        ctx["gpu_gib"] = report["gpu_memory_gib"] = gpu_memory_gib()
    report["corpus"] = build_corpus(ctx)
    if dry:
        report["gpu_command_lines"] = check_gpu_command_lines(ctx)
    return ctx, report


def _run_section(ctx: dict, name: str, limit: float, left: float) -> dict:
    """One section's record: skipped when ``limit`` is too short to be worth starting, else its status
    (ok, "ok, checks failed", failed or timeout), checks and figures or error; with its wall time."""
    s0 = time.monotonic()
    if limit < (5 if ctx["dry"] else 30):
        sec = {"status": "skipped", "error": f"--budget-s: {left:.0f} s left"}
    else:
        print(f"[gpu_check] {name} (limit {limit:.0f} s)", flush=True)
        try:
            sec = {"status": "ok", **RUNNERS[name](ctx, limit)}
            if not all(v for v in sec["checks"].values() if v is not None):
                sec["status"] = "ok, checks failed"
        except SectionFailed as e:
            sec = {"status": "timeout" if "timed out" in str(e) else "failed", "error": str(e),
                   "figures": e.figures}
        except Exception:
            sec = {"status": "failed", "error": traceback.format_exc()}
    sec["wall_s"] = round(time.monotonic() - s0, 2)
    return sec
