"""The resume rule's branch (train/resume.py ``check_branch``): another mixture from the checkpoint's step
on, and nothing else; logged as ``branch at step S``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from data.errors import ConfigError
from data.schedules import ScheduleConfig
from train.resume import check_schedule_unchanged, schedule_fingerprint

ROOT = Path(__file__).resolve().parents[2]
DEMO = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())["data"]["schedule"]  # anneal from step 277


def fingerprint(**change) -> str:
    d = yaml.safe_load(yaml.safe_dump(DEMO))
    for key, value in change.items():
        if key == "curated":  # the anneal phase's curated share, web taking up the difference
            d["mixture"]["phases"][1]["weights"].update(curated=value, web=round(0.70 - value, 6))
        else:
            d[key] = value
    return schedule_fingerprint(ScheduleConfig.from_dict(d))


def test_a_branch_changes_the_mixture_from_its_step_on_and_says_so(caplog):
    with caplog.at_level("WARNING"):
        for step in (277, 250):  # at the anneal start, or before it (the arm follows the stable phase to it)
            check_schedule_unchanged(fingerprint(), fingerprint(curated=0.5), allow=False, step=step, branch=True)
    assert caplog.text.count("branch at step") == 2
    assert ("branch at step 277: data.schedule.mixture.phases[1].weights.curated: 0.35 -> 0.5; "
            "data.schedule.mixture.phases[1].weights.web: 0.35 -> 0.2") in caplog.text
    # the same schedule: nothing to say
    caplog.clear()
    check_schedule_unchanged(fingerprint(), fingerprint(), allow=False, step=277, branch=True)
    assert "branch" not in caplog.text


def test_a_branch_after_the_anneal_start_or_changing_more_than_the_mixture_is_refused():
    with pytest.raises(ConfigError, match=r"^--run.branch: the new mixture differs from the checkpoint's at step "
                                          r"277, before the checkpoint's step 280"):
        check_schedule_unchanged(fingerprint(), fingerprint(curated=0.5), allow=False, step=280, branch=True)
    with pytest.raises(ConfigError, match=r"^--run.branch: a branch changes only the mixture, but the checkpoint "
                                          r"\(step 277\) differs in data.schedule.train_tokens: 300000 -> 400000;"):
        check_schedule_unchanged(fingerprint(), fingerprint(curated=0.5, train_tokens=400_000), allow=False,
                                 step=277, branch=True)
    with pytest.raises(ConfigError, match=r"data.schedule.anneal_start: 0.9 -> 0.8"):  # the LR decay moves too
        check_schedule_unchanged(fingerprint(), fingerprint(anneal_start=0.8), allow=False, step=200, branch=True)
    with pytest.raises(ConfigError, match=r"--run.allow_changed_schedule true"):  # without run.branch: refused
        check_schedule_unchanged(fingerprint(), fingerprint(curated=0.5), allow=False, step=277)
