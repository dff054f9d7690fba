"""The offline lm-eval tasks of scripts/evaluate.py, built from the held-out chunks (train/tools/evaluate.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import yaml

from data.manifest import build_manifest
from data.tokenizer import cl100k_encoding
from train.tools.evaluate import CLOZE_CHOICES, CLOZE_CONTEXT, CLOZE_CONTINUATION, held_out_documents, write_local_tasks


def data_with_manifest(cfg):
    return SimpleNamespace(config=cfg, manifest=build_manifest(cfg))


def test_local_tasks_are_one_item_set_for_every_seed_and_come_from_held_out_text(make_cfg, tmp_path):
    """Ablation arms and seeds are compared on the same items: the files do not depend on data.seed.
    Each cloze item's true continuation follows its context in a held-out document; the distractors
    are other held-out continuations of the same source; lm-eval reads the task as written."""
    a = data_with_manifest(make_cfg(seed=1, val_tokens_per_source=4000))
    b = data_with_manifest(make_cfg(seed=2, val_tokens_per_source=4000))
    names = write_local_tasks(a, tmp_path / "a")
    assert names == write_local_tasks(b, tmp_path / "b")
    for name in names:
        assert (tmp_path / "a" / f"{name}.jsonl").read_text() == (tmp_path / "b" / f"{name}.jsonl").read_text()
    enc = cl100k_encoding()
    docs = held_out_documents(a)
    for source, held in docs.items():
        path = tmp_path / "a" / f"wellmixed_cloze_{source}.jsonl"
        if not path.exists():
            continue
        texts = [enc.decode(t.tolist()) for t in held]
        for item in map(json.loads, path.read_text().splitlines()):
            assert len(item["choices"]) == CLOZE_CHOICES == len(set(item["choices"]))
            true = item["context"] + item["choices"][item["gold"]]
            assert any(true in t for t in texts), source
            assert len(enc.encode_ordinary(item["context"])) <= CLOZE_CONTEXT + 2
            assert all(len(enc.encode_ordinary(c)) <= CLOZE_CONTINUATION + 2 for c in item["choices"])
        task = yaml.safe_load((tmp_path / "a" / f"wellmixed_cloze_{source}.yaml").read_text())
        assert task["output_type"] == "multiple_choice" and task["dataset_kwargs"]["data_files"]["test"] == str(path)
    assert {n.split("_", 2)[1] for n in names} == {"cloze", "ppl"}


def test_the_report_lm_eval_suite_skips_an_uncached_task_and_keeps_the_others(tmp_path, monkeypatch, capsys):
    """The standard suite where cached: each task runs on its own; one lm-eval cannot load offline is
    skipped with a note, the others' accuracies stand; none at all is an error."""
    import pytest

    import ablations.evals as evals
    import train.tools.evaluate as ev

    def fake_run(hf_dir, task, out_dir, offline=True, extra=""):
        if task == "hellaswag":
            raise ev.LmEvalFailed("lm_eval --tasks hellaswag exited 1: Couldn't reach 'Rowan/hellaswag'")
        return {f"{task}/acc": 0.5, f"{task}/acc_norm": 0.25, f"{task}/perplexity": 9.0}

    monkeypatch.setattr(ev, "run_lm_eval", fake_run)
    monkeypatch.setattr(evals, "_exported", lambda run_dir, what: (run_dir / "last.ckpt", run_dir / "hf"))
    monkeypatch.setattr(evals, "LM_EVAL_TASKS", "hellaswag,arc_easy")
    got = evals.lm_eval_harness(tmp_path / "run")
    assert got == {"arc_easy/acc": 0.5, "arc_easy/acc_norm": 0.25}
    assert "lm-eval task hellaswag skipped: " in capsys.readouterr().err
    monkeypatch.setattr(evals, "LM_EVAL_TASKS", "hellaswag")
    with pytest.raises(RuntimeError, match="no lm-eval task of hellaswag ran"):
        evals.lm_eval_harness(tmp_path / "other")
