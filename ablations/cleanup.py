"""Keep of a finished ablation run only what the report reads: the disk an ablation needs.

The step checkpoints (weights and AdamW state) are nearly all of an ablation's disk (ablations/README.md,
"What it costs"); the report and its evaluations read, per run, the CSV log, the saved config, the order
logs, ``checkpoints/last.ckpt`` and ``evals/``. So once a run is complete its step checkpoints and the
cursor folders only they referenced go; ``last.ckpt`` stays (a hard link to the final step file: removing
the step name keeps its data), so the run still resumes, exports and reports. Nothing is removed from a
run that is not complete, nor when ``last.ckpt`` is missing, does not open, lacks its cursors or is not
at the run's last step.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ablations.outcomes import is_complete, schedule_of
from train.rundir import RunDir, read_config

log = logging.getLogger(__name__)


def prune_finished_run(run_dir: str | Path) -> list[Path]:
    """Delete a complete run's intermediate step checkpoints (and their checksum files and the data
    cursor folders no remaining checkpoint references); returns what was removed ([] when the run is
    not complete or its ``last.ckpt`` is not sound: see the module docstring)."""
    from train.checkpoint import checkpoint_problem, checksum_path, recorded_step, remove_unreferenced

    run = RunDir(Path(run_dir))
    last = run.last_ckpt
    if not is_complete(run.root) or not last.exists():
        return []
    config = read_config(run.root)
    final = schedule_of(config).total_steps
    max_steps = (config.get("trainer") or {}).get("max_steps")
    final = final if max_steps in (None, -1) else min(final, int(max_steps))
    problem = checkpoint_problem(last)
    if problem is not None or recorded_step(last) != final:
        log.warning("%s kept whole: its last.ckpt %s", run.root,
                    problem or f"is at step {recorded_step(last)}, not the run's last step {final}")
        return []
    removed = []
    for ckpt in sorted(run.checkpoints.glob("step*.ckpt")):
        for path in (ckpt, checksum_path(ckpt)):
            if path.is_file():
                path.unlink()
                removed.append(path)
    removed += remove_unreferenced(run.checkpoints)
    return removed
