"""scripts/evaluate.py says up front which tasks will run and which are skipped offline, from what is
installed and cached, before any minute is spent (train/tools/evaluate.py ``plan_tasks``)."""

from __future__ import annotations

import pytest

from train.tools import evaluate as ev

pytest.importorskip("lm_eval")
STANDARD = ev.STANDARD_TASKS.split(",")


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty HF cache (hub and datasets), wherever the machine's own is."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    return tmp_path


def test_standard_tasks_resolve_to_their_datasets():
    assert ev.task_dataset("hellaswag") == "Rowan/hellaswag"
    assert ev.task_dataset("arc_easy") == "allenai/ai2_arc"
    assert ev.task_dataset("no_such_task_anywhere") is None


def test_offline_the_uncached_standard_tasks_are_skipped_up_front_and_local_runs(hf_cache):
    plan = ev.plan_tasks(["local", *STANDARD], offline=True)
    assert plan.run == ["local"] and list(plan.skipped) == STANDARD
    assert "Rowan/hellaswag is not in the HF cache" in plan.skipped["hellaswag"]
    text = plan.describe()
    assert text.splitlines()[0] == "plan: held-out loss per source, then lm-eval: local"
    assert "skip  piqa: offline" in text


def test_a_cached_dataset_runs_and_online_everything_runs(hf_cache):
    (hf_cache / "hub" / "datasets--Rowan--hellaswag" / "snapshots" / "abc123").mkdir(parents=True)
    (hf_cache / "datasets" / "allenai___ai2_arc" / "ARC-Easy").mkdir(parents=True)
    plan = ev.plan_tasks(["hellaswag", "arc_easy", "piqa"], offline=True)
    assert plan.run == ["hellaswag", "arc_easy"] and list(plan.skipped) == ["piqa"]
    assert "cached in" in plan.notes["hellaswag"]
    online = ev.plan_tasks(["local", *STANDARD], offline=False)
    assert online.run == ["local", *STANDARD] and not online.skipped


def test_without_lm_eval_every_task_is_skipped_with_the_install_command(monkeypatch):
    monkeypatch.setattr(ev, "lm_eval_available", lambda: False)
    plan = ev.plan_tasks(["local", "hellaswag"])
    assert plan.run == [] and all(ev.INSTALL_HINT in why for why in plan.skipped.values())
    assert "no lm-eval task will run" in plan.describe()
