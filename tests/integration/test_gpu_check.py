"""The GPU check's rehearsal: ``scripts/gpu_check.sh --dry-run`` (no installs) runs every section on CPU with
the tiny model and writes every figure, so that the one call on a lent GPU does not fail on a typo; and
``scripts/setup.sh`` keeps an installed torch at or above pyproject's floor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from numbers import Number
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FIGURES = {  # per section: figures that must be numbers in the dry run too
    "train": ["step_s", "tokens_per_s", "mfu_logged", "mfu_recomputed", "mfu_agree_rel", "peak_memory_gb",
              "estimate_gb", "memory_vs_estimate", "time_to_first_step_s", "first_step_s", "compile_s_est",
              "recompiles", "graph_breaks", "loop_gap_share"],
    "mask": ["attention_causal_ms", "attention_flex_ms", "block_mask_ms", "step_added_s", "mfu_masked_est",
             "mfu_cost_rel"],
    "resume": ["loss_max_abs_diff", "resumed_from_step", "killed_wall_s", "resumed_wall_s"],
    "fsdp": ["first_wall_s", "resumed_wall_s"],
    "contenders": ["compiled_over_eager", "half_micro_batch_over_full"],
}


@pytest.mark.slow
def test_dry_run_runs_every_section_and_writes_every_figure(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_SKIP_INSTALL": "1", "PYTHON": sys.executable}
    env.pop("OUT", None)
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(out), "--workdir",
                        str(tmp_path / "work")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry_run"] is True and sorted(report["sections"]) == sorted(FIGURES)
    # the GPU sections' train fit command lines, which the CPU does not train with, parse as written
    assert report["gpu_command_lines"] == {k: "ok" for k in ("train_h200", "train_80gb", "resume", "fsdp")}
    for name, keys in FIGURES.items():
        sec = report["sections"][name]
        assert sec["status"] == "ok", f"{name}: {sec['status']} {sec.get('checks')}\n{sec.get('error', '')}"
        missing = [k for k in keys if not isinstance(sec["figures"].get(k), Number)]
        assert not missing, f"{name}: not numbers: {missing}"
    train = report["sections"]["train"]
    assert train["checks"]["mfu_logged_vs_recomputed_within_2pct"]  # the logged MFU is the step times'
    assert train["figures"]["seq_lens"] == [32, 64]  # the sequence-length warmup ran
    mask = report["sections"]["mask"]["figures"]
    assert mask["flex_matches_dense"] and set(mask["cases"]) == {"fp32_flex_eager_model", "fp32_flex_compiled_model"}
    resume = report["sections"]["resume"]  # fp32 on CPU: the retrained step is bitwise the killed run's
    assert resume["figures"]["retrained_steps"] and resume["figures"]["losses_identical"]
    assert all(resume["checks"].values()) and all(report["sections"]["fsdp"]["checks"].values())
    rows = report["sections"]["contenders"]["figures"]["contenders"]
    assert [r["name"] for r in rows] == ["eager-chunked-2", "eager-plain-2", "compiled-chunked-2", "eager-chunked-1"]
    assert all(isinstance(r.get("step_s"), Number) for r in rows)
    md = (out / "gpu_check.md").read_text()
    assert all(f"## {name}: ok (" in md for name in FIGURES) and "FAIL" not in md


@pytest.mark.parametrize("installed,action", [("", "install"), ("2.11.0+cu130", "keep"), ("2.6.0", "keep"),
                                              ("2.13.0+cpu", "keep"), ("2.5.1", "refuse"), ("1.13.1", "refuse")])
def test_setup_keeps_an_installed_torch_at_or_above_the_floor(installed, action):
    r = subprocess.run(["bash", "scripts/setup.sh", "--decide", installed], cwd=ROOT, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == action, r.stdout + r.stderr


def test_the_floor_in_pyproject_is_what_setup_reads():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch>=2.6" in deps  # FSDP2's public torch.distributed.fsdp.fully_shard (train/parallel.py)
