"""The GPU check: the real training path and the GPU-only code paths, measured in one call (< 9 minutes).

    bash scripts/gpu_check.sh                                   # on the device: carried wheels, then this
    python scripts/gpu_check.py --out DIR [--only train,mask]   # the sections below (or some) on one GPU
    python scripts/gpu_check.py --out DIR --dry-run             # the same steps on CPU: tiny model, gloo

Writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out`` (default ``$OUT``, else ``gpu_check/``),
rewritten after every section, so a call cut short still returns what was measured. Each section has its
own time limit; a section that fails, runs out of time or is skipped (the whole check's ``--budget-s``)
is recorded as such and the next one runs. Sections (docs/real-run.md, "GPU check", says what each
figure means): ``train`` (the 350M config on a generated corpus: tokens/s,
MFU, peak memory against train/memory.py, compile), ``mask`` (flex_attention against the dense
reference, train/tools/gpu_loops.py), ``resume`` (SIGKILL after a checkpoint, resumed), ``fsdp`` (FSDP2
on one GPU, resumed from a sharded checkpoint), ``contenders`` (the forward call in a bare loop).

Training runs are forked from this process, which never initialises CUDA (so the children may).
``--dry-run`` runs every step but the CUDA kernels: torch.compile's eager backend, gloo for FSDP.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# torch.cuda.is_available() by NVML, not the CUDA runtime: this process forks training children that
# initialise CUDA themselves (a parent that initialised it would leave them unusable). Before torch.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402
from jsonargparse import set_parsing_settings  # noqa: E402

import train.cli as cli  # noqa: E402  imported once here: every forked child starts with it
from data.corpus.dolma3_like import write_dolma3_like  # noqa: E402
from data.files import write_text  # noqa: E402
from train.callbacks import ThroughputCallback  # noqa: E402
from train.rundir import read_metrics  # noqa: E402
from train.tools.gpu_loops import contender_figures, mask_figures  # noqa: E402
from train.tools.step_clock import StepClock, watch_dynamo  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("train", "mask", "resume", "fsdp", "contenders")
SECTION_LIMIT_S = {"train": 230, "mask": 110, "resume": 50, "fsdp": 50, "contenders": 170}
"""Each section's own time limit on the GPU (the dry run's are 90 s: only a hang runs into them)."""
TARGETS = {"mfu": 0.50, "peak_gb": 100.0, "mfu_agreement": 0.02, "memory_vs_estimate": 0.10,
           "loop_gap_share": 0.01}


# --- launching ---------------------------------------------------------------------------------------


def forked(target, log_path: Path, timeout_s: float, kill_when=None, env: dict | None = None) -> dict:
    """Run ``target()`` (returns an exit code) in a forked child in its own session, output to ``log_path``;
    SIGKILL its whole process group (DataLoader workers too) when ``kill_when()`` holds or at the timeout."""
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised in the gpu_check process itself: a forked child could not use it")
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(target, log_path, env or {})
    killed = timed_out = False
    try:
        while not (waited := os.waitpid(pid, os.WNOHANG))[0]:
            elapsed = time.monotonic() - t0
            if not killed and (elapsed > timeout_s or (kill_when is not None and kill_when())):
                killed, timed_out = True, elapsed > timeout_s
                _killpg(pid)
            time.sleep(0.005)
    except BaseException:  # never leave a training run behind
        _killpg(pid)
        os.waitpid(pid, 0)
        raise
    _killpg(pid)  # whatever of the group is left (a worker of a killed run)
    return {"rc": os.waitstatus_to_exitcode(waited[1]), "killed": killed, "timed_out": timed_out,
            "wall_s": round(time.monotonic() - t0, 2), "log": str(log_path)}


def _child(target, log_path: Path, env: dict) -> None:
    """The forked child: a session of its own (one process group to kill), output to the log; never returns."""
    rc = 1
    try:
        os.setsid()
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.update(env)
        if os.environ.get("GPU_CHECK_DRY"):  # 2 shared CPU cores: one thread per child, no oversubscription
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


def check_run(result: dict, what: str, figures: dict | None = None) -> None:
    if result["timed_out"]:
        raise SectionFailed(f"{what}: timed out after {result['wall_s']} s\n{tail(result['log'])}", figures)
    if result["rc"] != 0:
        raise SectionFailed(f"{what}: exit code {result['rc']} (expected 0)\n{tail(result['log'])}", figures)


def json_section(ctx: dict, name: str, fn, limit_s: float) -> dict:
    """Run ``fn(ctx, save, deadline)`` in a forked child; ``save(figures)`` writes what it has measured so far,
    so a child that runs out of time or memory still hands back the figures before that."""
    path = ctx["work"] / f"{name}.json"

    def save(figures: dict) -> None:
        write_text(path, json.dumps(figures, default=str), fsync=False)

    def run() -> int:
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
        import train.__main__ as entry  # in the child only: it installs the early signal handlers on import

        counts = watch_dynamo()
        if clock_json is not None:

            class ClockedCLI(cli.WellMixedCLI):
                def instantiate_trainer(self, **kwargs):
                    trainer = super().instantiate_trainer(**kwargs)
                    at = next(i for i, c in enumerate(trainer.callbacks) if isinstance(c, ThroughputCallback))
                    trainer.callbacks.insert(at + 1, StepClock(clock_json, counts))  # sees this step's MFU
                    return trainer

            cli.WellMixedCLI = ClockedCLI
        sys.argv = sys.argv[:1]  # the command line is argv alone (LightningCLI warns when both are set)
        # Help texts are not printed here: parsing every attribute docstring for them was half the CLI's start-up.
        set_parsing_settings(docstring_parse_attribute_docstrings=False)
        return entry.main(argv)

    return run


def launch(ctx: dict, log_name: str, run_dir: Path, limit_s: float, *, resume: bool = False, kill_when=None,
           env: dict | None = None, clock: Path | None = None, **fit) -> dict:
    """One ``train fit`` in a forked child (``fit``: :func:`fit_args`'s keywords), resumed from ``last`` when asked."""
    argv = fit_args(ctx, run_dir, **fit) + (["--ckpt_path", "last"] if resume else [])
    return forked(fit_target(argv, clock), ctx["work"] / f"{log_name}.log", limit_s, kill_when, env or ctx["env"])


def order_lines(run_dir: Path) -> list[dict]:
    """Rank 0's order-log lines; a line still being written (no newline yet) is left out."""
    try:
        text = (run_dir / "order_log" / "rank0.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(ln) for ln in text.split("\n")[:-1] if ln]


# --- section 1: the real training path ----------------------------------------------------------------


def section_train(ctx: dict, limit_s: float) -> dict:
    run_dir, clock = ctx["work"] / "train", ctx["work"] / "train_clock.json"
    env = {**ctx["env"], "GPU_CHECK_T_LAUNCH": repr(time.monotonic())}
    result = launch(ctx, "train", run_dir, limit_s, env=env, clock=clock, steps=3 if ctx["dry"] else 40)
    try:
        out = train_figures(ctx, json.loads(clock.read_text()), run_dir, result)
    except Exception as e:
        if result["rc"] == 0 and not result["timed_out"]:
            raise
        out = {"figures": {"partial": f"none ({type(e).__name__}: {e})"}}
    check_run(result, "train fit", figures=out["figures"])  # a failed run: the figures of the steps it ran
    return out


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
    # logged values are per step: compare their mean with the mean of per-step values (not flops / mean period)
    per_step = statistics.mean(flops / p / peak_flops for p in periods) if peak_flops else None
    first = rows[0]
    compile_s = sum(max(0.0, (b["end"] - a["end"]) - step_s) for a, b in zip(rows, rows[1:]) if b not in steady)
    compile_s += max(0.0, (first["end"] - first["start"]) - step_s)
    dynamo = info["dynamo"]
    fig = {
        "steps_run": len(rows), "steady_steps": len(periods), "micro_batch": steady[-1]["batch"],
        "seq_len": steady[-1]["seq_len"],
        "step_s": step_s, "step_s_median": statistics.median(periods), "tokens_per_s": tokens / step_s,
        "mfu_logged": logged, "mfu_recomputed": mfu_recomputed,
        "mfu_agree_rel": abs(logged - per_step) / per_step if logged and per_step else None,
        "peak_memory_gb": info["peak_gb"], "peak_memory_kind": info["peak_kind"],
        "estimate_gb": info["estimate_gb"], "memory_vs_estimate": info["peak_gb"] / info["estimate_gb"] - 1,
        "time_to_first_step_s": first["end"], "time_to_train_start_s": info["t_train_start"],
        "first_step_s": first["end"] - first["start"], "compile_s_est": compile_s,
        "recompiles": dynamo["recompiles"], "graph_breaks": dynamo["graph_breaks"], "graphs": dynamo["graphs"],
        "recompile_reasons": dynamo["reasons"], "graph_break_reasons": dynamo["graph_break_reasons"],
        "seq_lens": sorted({r["seq_len"] for r in rows}),
        "loop_gap_share": sum(gaps) / sum(periods), "compiled": info["compiled"], "loss_impl": info["loss_impl"],
        "precision": info["precision"], "process_wall_s": result["wall_s"],
        "dynamo_compile_times_s": info.get("dynamo_compile_times_s"),
    }
    ctx["train_step_s"], ctx["train_mfu"], ctx["train_tokens_per_s"] = step_s, mfu_recomputed, tokens / step_s
    return {"figures": fig, "checks": _train_checks(fig, dry=ctx["dry"])}


def _steady_steps(rows: list[dict]) -> tuple[list[dict], list[float], list[float]]:
    """The steps at the last sequence length past its compilation, their periods (end to end) and the gaps
    before them (previous end to their start)."""
    steady = _past_compilation([r for r in rows if r["seq_len"] == max(r["seq_len"] for r in rows)])
    pairs = [(a, b) for a, b in zip(rows, rows[1:]) if b in steady]
    if not pairs:
        raise SectionFailed(f"train fit: too few steps timed ({len(rows)})")
    return steady, [b["end"] - a["end"] for a, b in pairs], [b["start"] - a["end"] for a, b in pairs]


def _past_compilation(at_end: list[dict]) -> list[dict]:
    """The steps at the last sequence length past its compilation (the first three of six or more, else one)."""
    return at_end[3:] if len(at_end) > 5 else at_end[1:] or at_end


def _mfu_as_logged(run_dir: Path, steady: list[dict], last_n: int) -> float | None:
    """The mean of the last ``last_n`` per-step ``perf/mfu`` values in the run's metrics.csv (what users see);
    for a run cut short before it was written, of the values the callback logged."""
    try:
        values = [float(r["perf/mfu"]) for r in read_metrics(run_dir) if r.get("perf/mfu")][-last_n:]
    except Exception:  # not written (a run cut short)
        values = []
    values = values or [r["mfu_logged"] for r in steady if r.get("mfu_logged") is not None]
    return statistics.mean(values) if values else None


def _train_checks(fig: dict, dry: bool) -> dict:
    """The train figures against TARGETS; the GPU targets are n/a (None) for the tiny model on CPU."""
    mfu, agree = fig["mfu_recomputed"], fig["mfu_agree_rel"]
    gpu = {"peak_within_10pct_of_estimate": abs(fig["memory_vs_estimate"]) <= TARGETS["memory_vs_estimate"],
           "mfu_at_least_50pct": mfu is not None and mfu >= TARGETS["mfu"],
           "peak_at_most_100gb": fig["peak_memory_gb"] <= TARGETS["peak_gb"],
           "loop_gap_below_1pct": fig["loop_gap_share"] < TARGETS["loop_gap_share"]}
    # dry: one ~0.1 s CPU step, where the few ms between the two callbacks' clock reads on a loaded host are
    # already 2%; 10% still catches a wrong formula (a factor of world size or accumulation)
    limit = 0.10 if dry else TARGETS["mfu_agreement"]
    return {"mfu_logged_vs_recomputed_within_2pct": agree is not None and agree <= limit,
            **{k: None if dry else v for k, v in gpu.items()}}


# --- sections 2 and 5: document masking and the contenders (train/tools/gpu_loops.py) ---------------


def section_mask(ctx: dict, limit_s: float) -> dict:
    fig = json_section(ctx, "mask", mask_figures, limit_s)
    return {"figures": fig, "checks": {"flex_matches_dense_within_tolerance": bool(fig.get("flex_matches_dense"))}}


def section_contenders(ctx: dict, limit_s: float) -> dict:
    fig = json_section(ctx, "contenders", contender_figures, limit_s)
    ran = [r for r in fig["contenders"] if "step_s" in r or r.get("oom")]
    return {"figures": fig, "checks": {"every_contender_ran_or_oomed": len(ran) == len(fig["contenders"])}}


# --- section 3: SIGKILL and resume ---------------------------------------------------------------------


def section_resume(ctx: dict, limit_s: float) -> dict:
    """The first launch is SIGKILLed (with its DataLoader workers) once its order log has every + 1 lines:
    checkpoint ``every`` is on disk (written right after line every - 1) and the launch trained past it. A GPU
    step takes milliseconds, so the kill may land some steps later: the launch is long enough never to finish,
    the resume starts from whatever ``last.ckpt`` holds, and every step both launches trained is compared."""
    run_dir, every = ctx["work"] / "resume", 2 if ctx["dry"] else 3
    fit = dict(ckpt_every=every, small=True, extra=("--data.order_log", "true"),
               env={**ctx["env"], "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    deadline = time.monotonic() + limit_s
    first = launch(ctx, "resume_killed", run_dir, limit_s, steps=every + 3 if ctx["dry"] else 100_000,
                   kill_when=lambda: len(order_lines(run_dir)) >= every + 1, **fit)
    if not first["killed"] or first["timed_out"]:
        raise SectionFailed(f"the first launch was not killed as planned ({first})\n{tail(first['log'])}")
    killed = order_lines(run_dir)
    last = run_dir / "checkpoints" / "last.ckpt"
    resumed_from = int(torch.load(last, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    steps = len(killed) + 1  # past every line the killed launch wrote
    resumed = launch(ctx, "resume_resumed", run_dir, max(10.0, deadline - time.monotonic()), resume=True,
                     steps=steps, **fit)
    check_run(resumed, "resumed run")
    fig = {"ckpt_every": every, "killed_after_lines": len(killed), "resumed_from_step": resumed_from,
           **_retrained(killed, order_lines(run_dir), resumed_from, steps),
           "killed_wall_s": first["wall_s"], "resumed_wall_s": resumed["wall_s"],
           "note": "the demo model, eager, bf16-mixed (CPU dry run: fp32) on one device; losses may differ in the "
                   "last bits where a kernel is not deterministic (SDPA backward): the tolerance bounds that"}
    checks = {"order_identical": fig["pieces_identical"],
              "losses_within_tolerance": fig["loss_max_abs_diff"] is not None
              and fig["loss_max_abs_diff"] <= fig["loss_tolerance"],
              "one_line_per_step_after_resume": fig["one_line_per_step"]}
    return {"figures": fig, "checks": checks}


def _retrained(killed: list[dict], after: list[dict], resumed_from: int, steps: int) -> dict:
    """The steps both launches trained (from the checkpoint on) compared: order-log pieces and losses."""
    by_step = {ln["step"]: ln for ln in after if ln["step"] >= resumed_from}
    overlap = [(ln, by_step[ln["step"]]) for ln in killed if ln["step"] in by_step]
    diffs = [abs(a["loss"] - b["loss"]) for a, b in overlap]
    return {"retrained_steps": [a["step"] for a, _ in overlap],
            "pieces_identical": bool(overlap) and all(a["pieces"] == b["pieces"] for a, b in overlap),
            "losses_identical": max(diffs, default=1.0) == 0.0, "loss_max_abs_diff": max(diffs, default=None),
            "loss_tolerance": 1e-3, "one_line_per_step": [ln["step"] for ln in after] == list(range(steps))}


# --- section 4: FSDP2 on one device --------------------------------------------------------------------


def section_fsdp(ctx: dict, limit_s: float) -> dict:
    run_dir, n = ctx["work"] / "fsdp", 2 if ctx["dry"] else 4
    fit = dict(ckpt_every=n, small=True, extra=("--trainer.strategy", "fsdp", "--data.order_log", "true"))
    deadline = time.monotonic() + limit_s
    first = launch(ctx, "fsdp_first", run_dir, limit_s, steps=n, **fit)
    check_run(first, "fsdp run")
    last = run_dir / "checkpoints" / "last.ckpt"
    layout = sorted(p.name for p in last.iterdir()) if last.is_dir() else []
    resumed = launch(ctx, "fsdp_resumed", run_dir, max(10.0, deadline - time.monotonic()), resume=True,
                     steps=n + 1, **fit)
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


# --- the report ---------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    """gpu_check.md: a heading with the device and versions, then per section its status, error, checks,
    figures and the rows of its cases or contenders."""
    lines = [f"# GPU check ({'dry run, CPU' if report['dry_run'] else report.get('device') or 'GPU'})", "",
             f"{report['started']}, torch {report['torch']}, {report['total_s']:.0f} s in all; "
             f"install: {report.get('install') or 'n/a'}", ""]
    for name in SECTIONS:
        if name in report["sections"]:
            lines += _section_markdown(name, report["sections"][name])
    return "\n".join(lines) + "\n"


def _section_markdown(name: str, sec: dict) -> list[str]:
    lines = [f"## {name}: {sec['status']} ({sec.get('wall_s', 0):.0f} s)", ""]
    if sec.get("error"):
        lines += ["```", sec["error"][-1500:], "```", ""]
    marks = {None: "n/a", True: "PASS", False: "FAIL"}
    lines += [f"- {marks[None if ok is None else bool(ok)]} {key}" for key, ok in (sec.get("checks") or {}).items()]
    for head, value, items in _tables(sec.get("figures") or {}):
        lines += ["", f"| {head} | {value} |", "| --- | --- |", *(f"| {k} | {_fmt(v)} |" for k, v in items)]
    return lines + [""]


def _tables(fig: dict) -> list[tuple]:
    """The figures' tables: (heading, value heading, rows) for the figures, then the cases or contenders."""
    tables = [("figure", "value", [(k, v) for k, v in fig.items() if k not in ("contenders", "cases")])] if fig else []
    if "cases" in fig:
        tables.append(("case", "figures", fig["cases"].items()))
    if "contenders" in fig:
        tables.append(("contender", "figures", [(r["name"], {k: v for k, v in r.items() if k != "name"})
                                                for r in fig["contenders"]]))
    return tables


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    if isinstance(value, list) and len(value) > 12:
        return f"{value[:12]} ... ({len(value)})"
    return str(value).replace("|", "/").replace("\n", " ")


def write_report(report: dict, out: Path, work: Path) -> None:
    """gpu_check.json, gpu_check.md and gpu_check_logs.txt (every run's log, the last 200 KB of each)."""
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "gpu_check.json", json.dumps(report, indent=1, default=str), fsync=False)
    (out / "gpu_check.md").write_text(markdown(report))
    logs = sorted(work.glob("*.log"), key=lambda p: p.stat().st_mtime)
    (out / "gpu_check_logs.txt").write_text("".join(f"===== {p.name}\n{tail(p, 200_000)}\n" for p in logs))


# --- main ---------------------------------------------------------------------------------------------


def check_gpu_command_lines(ctx: dict) -> dict:
    """Dry run: the GPU sections' ``train fit`` command lines (which the CPU never trains with) parsed by the
    CLI as they will be on the device (``--print_config``: every flag known, every value of its type)."""
    gpu, x = {**ctx, "dry": False}, ctx["work"] / "x"
    order_log = ("--data.order_log", "true")
    lines = {
        "train_h200": fit_args({**gpu, "gpu_gib": 141}, x, steps=40),
        "train_80gb": fit_args({**gpu, "gpu_gib": 80}, x, steps=40),
        "resume": fit_args(gpu, x, steps=5, ckpt_every=3, small=True, extra=order_log) + ["--ckpt_path", "last"],
        "fsdp": fit_args(gpu, x, steps=4, ckpt_every=4, small=True, extra=("--trainer.strategy", "fsdp", *order_log)),
    }
    results = {name: forked(fit_target(argv + ["--print_config"]), ctx["work"] / f"gpu_args_{name}.log", 120,
                            env=ctx["env"]) for name, argv in lines.items()}
    return {name: "ok" if r["rc"] == 0 else f"rc {r['rc']}: {tail(r['log'], 1500)}" for name, r in results.items()}


def gpu_memory_gib() -> float | None:
    """The GPU's memory from nvidia-smi (this process must not initialise CUDA: it forks the runs)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total,name", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return float(out.splitlines()[0].split(",")[0]) / 1024
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


RUNNERS = {"train": section_train, "mask": section_mask, "resume": section_resume, "fsdp": section_fsdp,
           "contenders": section_contenders}


def main(argv: list[str] | None = None) -> int:
    """Every section of ``--only`` in turn, each within its time limit and what is left of ``--budget-s``;
    the report is rewritten after each section and printed at the end."""
    args = _parser().parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    problem = _refusal(only, args.dry_run)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    out = args.out or Path(os.environ.get("OUT") or ROOT / "gpu_check")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ctx, report = _start(args.dry_run, work)
    _run_sections(ctx, report, only, args.budget_s or (300.0 if args.dry_run else 490.0), t0, out)
    report["total_s"] = time.monotonic() - t0
    write_report(report, out, work)
    print((out / "gpu_check.md").read_text())
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _run_sections(ctx: dict, report: dict, only: list[str], budget: float, t0: float, out: Path) -> None:
    """Each section in turn within its limit and what is left of the budget; the report rewritten after each."""
    for name in only:
        left = budget - (time.monotonic() - t0)
        limit = 90.0 if ctx["dry"] else SECTION_LIMIT_S[name]  # dry: only a hang runs into it
        sec = report["sections"][name] = _run_section(ctx, name, min(limit, left), left)
        report.update(device=ctx.get("device"), total_s=time.monotonic() - t0)
        write_report(report, out, ctx["work"])
        print(f"[gpu_check] {name}: {sec['status']} in {sec['wall_s']:.0f} s", flush=True)


def _refusal(only: list[str], dry: bool) -> str | None:
    """Why the check cannot start, in one line: an unknown section, or no GPU without --dry-run."""
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        return f"--only: unknown section(s) {unknown}; choose from {list(SECTIONS)}"
    if not dry and not torch.cuda.is_available():
        return "no CUDA device: run with --dry-run for the CPU rehearsal"
    return None


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


def _start(dry: bool, work: Path) -> tuple[dict, dict]:
    """The sections' context and the report's head: the GPU's memory (from nvidia-smi), the corpus built
    (data/corpus/dolma3_like.py, the config's own source patterns), and dry, the GPU command lines checked."""
    ctx = {"dry": dry, "work": work,
           "env": {"DOLMA3_DIR": str(work / "corpus"), "WELLMIXED_CACHE": str(work / "cache"),
                   "WANDB_MODE": "disabled", "PYTHONHASHSEED": "0", **({"GPU_CHECK_DRY": "1"} if dry else {})}}
    report = {"dry_run": dry, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "torch": torch.__version__, "install": os.environ.get("GPU_CHECK_INSTALL"), "workdir": str(work),
              "targets": TARGETS, "sections": {}, "total_s": 0.0}
    if not dry:
        ctx["gpu_gib"] = report["gpu_memory_gib"] = gpu_memory_gib()
    t0, tokens = time.monotonic(), 60_000 if dry else 6_000_000
    paths = write_dolma3_like(work / "corpus", total_tokens=tokens, files=2 if dry else 4,
                              row_group_size=16 if dry else 512)
    report["corpus"] = {"tokens": tokens, "files": len(paths), "seconds": round(time.monotonic() - t0, 2)}
    if dry:
        report["gpu_command_lines"] = check_gpu_command_lines(ctx)
    return ctx, report


def _run_section(ctx: dict, name: str, limit: float, left: float) -> dict:
    """One section's record: skipped when ``limit`` is too short to be worth starting, else its status
    (ok, "ok, checks failed", failed or timeout), checks and figures or error; with its wall time."""
    s0 = time.monotonic()
    if limit < (5 if ctx["dry"] else 30):
        return {"status": "skipped", "error": f"--budget-s: {left:.0f} s left", "wall_s": 0.0}
    print(f"[gpu_check] {name} (limit {limit:.0f} s)", flush=True)
    try:
        sec = {"status": "ok", **RUNNERS[name](ctx, limit)}
        if not all(v for v in sec["checks"].values() if v is not None):
            sec["status"] = "ok, checks failed"
    except SectionFailed as e:
        sec = {"status": "timeout" if "timed out" in str(e) else "failed", "error": str(e), "figures": e.figures}
    except Exception:
        sec = {"status": "failed", "error": traceback.format_exc()}
    return {**sec, "wall_s": round(time.monotonic() - s0, 2)}
