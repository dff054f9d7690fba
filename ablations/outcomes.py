"""What an ablation needs to know of one finished (or unfinished) run: its plan, what it drew, whether
it is complete, the mixer's final counters. The run directory's paths and file readers are
train/rundir.py's; no wandb, no model here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from data.cursor import as_cursor
from data.schedules import Schedule, build_schedule, tokens_per_source
from train.rundir import RunDir, read_config, read_metrics, series, tokens_per_step

WALL_SECONDS = "wall_seconds.txt"
"""In a run directory: the wall time ablations/run.py's ``run_here`` measured training it (start-up included)."""
BRANCHED_FROM = "branched_from.json"
"""In a branch's run directory: the checkpoint it started from and its sha256, as ablations/run.py's
``record_start`` read them before its first step (ablations/branch_report.py checks them against the plan)."""


def config_differences(a: dict, b: dict, allowed: tuple[str, ...]) -> list[str]:
    """Dotted keys whose values differ between two saved configs, except those under ``allowed``."""
    flat_a, flat_b = _flatten(a), _flatten(b)
    return sorted(k for k in flat_a.keys() | flat_b.keys()
                  if flat_a.get(k) != flat_b.get(k) and not any(k == p or k.startswith(p + ".") for p in allowed))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def schedule_of(config: dict) -> Schedule:
    return build_schedule(config["data"]["schedule"], list(config["data"]["sources"]))


def planned_tokens(config: dict) -> dict[str, float]:
    """Tokens per source the run's schedule plans over its budget (data/schedules.py)."""
    return tokens_per_source(schedule_of(config))


def drawn_tokens(run_dir: Path) -> tuple[dict[str, int], int]:
    """Tokens per source actually trained (order logs summed over ranks) and the steps trained through (the
    last step logged + 1: a decay branch's log starts at its branch step)."""
    per_step = tokens_per_step(run_dir)
    totals: dict[str, int] = {}
    for tokens in per_step.values():
        for source, n in tokens.items():
            totals[source] = totals.get(source, 0) + n
    return totals, max(per_step, default=-1) + 1


@dataclass
class MixerState:
    """Summed over every consumer (rank x worker) of the final checkpoint's data cursors."""

    step: int
    """The checkpoint's global step."""
    target: dict[str, float]
    """Tokens per source the mixer aimed for over the tokens it emitted: sum of w_s(step) x tokens."""
    in_flight: dict[str, int]
    """Tokens of documents chosen and counted, not yet trained (the batch rows' unfinished documents)."""


def final_mixer_state(run_dir: Path, sources: list[str]) -> MixerState | None:
    """The mixer counters of ``checkpoints/last.ckpt``'s data cursors (every rank's file:
    train/cursor_files.py), or None without one (mmap: weights stay on disk)."""
    path = RunDir(run_dir).last_ckpt
    if not path.is_file():
        return None
    from train.checkpoint import read_checkpoint
    from train.cursor_files import load_checkpoint_cursors

    ckpt = read_checkpoint(path, "checkpoint", "resume the run to write a new one, or move it away to report "
                           "without the mixer check")  # verified like every reader's; tensors stay on disk
    state = ckpt.get("WellMixedData")
    if not state:
        return None
    target = dict.fromkeys(sources, 0.0)
    in_flight = dict.fromkeys(sources, 0)
    for rank in load_checkpoint_cursors(path, state):
        for cursor in map(as_cursor, rank):  # checked: a damaged cursor is named, not summed
            if cursor is None:
                continue
            mixer = cursor.mixer
            for i, s in enumerate(sources):
                target[s] += mixer.target[i]
                in_flight[s] += mixer.committed[i] - mixer.emitted[i]
    return MixerState(step=int(ckpt["global_step"]), target=target, in_flight=in_flight)


def is_complete(run_dir: Path) -> bool:
    """True when the run trained its whole schedule (and logged the held-out loss at its last step)."""
    try:
        config, rows = read_config(run_dir), read_metrics(run_dir)
    except FileNotFoundError:
        return False
    total = schedule_of(config).total_steps
    max_steps = (config.get("trainer") or {}).get("max_steps")
    last = (total if max_steps in (None, -1) else min(total, int(max_steps))) - 1
    if config["data"].get("val_tokens_per_source"):  # the final held-out loss is logged at the last step
        return any(step >= last for step, _ in series(rows, "val/loss"))
    try:  # no held-out set: the order log (micro-batch steps) reached the end
        _, steps = drawn_tokens(run_dir)
    except FileNotFoundError:
        return False
    return steps >= (last + 1) * int((config.get("trainer") or {}).get("accumulate_grad_batches") or 1)
