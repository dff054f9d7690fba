"""Forker task (issue 40): another tokenizer from config alone. A 384-id BPE ``tokenizer.json`` trained in the test by
the ``tokenizers`` library (tests/conftest.py ``tiny_bpe``) trains the tiny model end to end, its export carries that
tokenizer, and it is refused on resume of a cl100k run and against a model vocabulary smaller than its own."""

from __future__ import annotations

import json
import shutil

import pytest
from training_runs import TINY, run_to_end

BPE = ["--model.model.vocab_size", "384"]


def with_bpe(path, **extra) -> list[str]:
    return ["--data.tokenizer", json.dumps({"path": str(path), **extra})]


@pytest.mark.slow
def test_a_tiny_bpe_tokenizer_json_trains_the_tiny_model_end_to_end_and_exports(workdir, env, tiny_bpe_json):
    """The demo's token_count column is cl100k's: ``recount`` counts the texts with the BPE at start-up."""
    import torch

    run_dir = workdir / "bpe"
    run = run_to_end(workdir, run_dir, TINY + BPE + with_bpe(tiny_bpe_json, recount=True), env, "bpe")
    lines = [json.loads(ln) for ln in (run_dir / "order_log" / "rank0.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(len(lines))) and len(lines) > 10  # the whole token budget
    assert lines[0]["loss"] < 7.0  # ln 384 = 5.95 at the start (with cl100k's ids: ln 100,352 = 11.5)
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    from data.tokenizer import TokenizerConfig

    tok = TokenizerConfig(path=str(tiny_bpe_json)).build()
    assert json.loads(state["WellMixedData"]["data_settings"])["tokenizer"] == tok.identity
    assert "Traceback" not in run.log()

    from train.tools.export import export

    out = export(run_dir / "checkpoints" / "last.ckpt", workdir / "bpe_hf")
    assert (out / "tokenizer.json").read_bytes() == tiny_bpe_json.read_bytes()
    info = json.loads((out / "tokenizer_info.json").read_text())
    assert (info["eot_id"], info["n_vocab"], info["identity"]) == (tok.eot_id, 384, tok.identity)
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == tok.eot_id


@pytest.mark.slow
def test_a_resume_of_a_cl100k_run_with_the_bpe_tokenizer_is_refused_naming_the_key(workdir, env, ref_single,
                                                                                   tiny_bpe_json):
    run_dir = workdir / "cl100k_then_bpe"
    shutil.copytree(ref_single[0], run_dir, symlinks=True)
    run = run_to_end(workdir, run_dir, TINY + with_bpe(tiny_bpe_json, recount=True) + ["--ckpt_path", "last"], env,
                     "resume", expect_rc=2)
    assert "was trained with data.tokenizer cl100k_base:" in run.log() and "Traceback" not in run.log(), run.log()


@pytest.mark.slow
def test_a_model_vocabulary_smaller_than_the_tokenizer_s_is_refused_at_start_up(workdir, env, tiny_bpe_json):
    run_dir = workdir / "small_vocab"
    args = TINY + ["--model.model.vocab_size", "256"] + with_bpe(tiny_bpe_json, recount=True)
    run = run_to_end(workdir, run_dir, args, env, "vocab", expect_rc=2)
    assert ("error: model.vocab_size 256 is smaller than data.tokenizer's vocabulary (tokenizer.json: 384 ids): set "
            "model.vocab_size to at least 384") in run.log(), run.log()
    assert not (run_dir / "checkpoints").exists()
