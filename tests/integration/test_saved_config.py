"""A saved config is a config: relaunched from a run's ``config.yaml``, a run does not silently go back.

The saved config records the ``ckpt_path`` its launch resumed from; ``fit --config <run>/config.yaml``
went back to that checkpoint, trained its steps again and added ``-v2`` checkpoints. Uses the session's
reference run (tests/conftest.py ``ref_single``: 16 steps, a checkpoint every 3), copied.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import yaml
from training_runs import global_step_of, make_workdir, order_log


def test_a_relaunch_from_a_saved_config_that_would_rewind_is_refused(ref_single, tmp_path, demo_corpus, env):
    ref_dir, ref_order = ref_single
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir, symlinks=True)
    older = run_dir / "checkpoints" / "step0000006.ckpt"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    saved["ckpt_path"], saved["run"]["dir"] = str(older), str(run_dir)  # as a launch resumed from step 6 saves it
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))  # the sources in their order
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    last = global_step_of(run_dir / "checkpoints" / "last.ckpt")

    proc = subprocess.run([sys.executable, "-m", "train", "fit", "--config", str(run_dir / "config.yaml")],
                          cwd=make_workdir(tmp_path / "work", demo_corpus), env=env, capture_output=True, text=True,
                          timeout=300)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0] == (
        f"error: ckpt_path {older} (from {run_dir / 'config.yaml'}) is step 6, but {run_dir / 'checkpoints'} "
        f"holds step {last} (last.ckpt): resuming from it would train steps 7-{last} again. Continue with --ckpt_path "
        f"last, or give --ckpt_path {older} on the command line to go back on purpose")
    assert order_log(run_dir) == ref_order  # nothing trained again
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before  # no -v2 checkpoints
