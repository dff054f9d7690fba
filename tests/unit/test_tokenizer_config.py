"""``data.tokenizer`` (issue 40): one config builds the tokenizer; its identity guards the manifest, the token-count
sample and a resume. The other tokenizer is a BPE ``tokenizer.json`` trained here by the ``tokenizers`` library on
the demo corpus (tests/conftest.py ``tiny_bpe``); the demo's ``token_count`` column is cl100k's."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from conftest import WEIGHTS, tiny_bpe

from data.config import DataConfig, SourceConfig
from data.errors import ConfigError, TokenizerError
from data.manifest import build_manifest
from data.schedules import fixed_schedule
from data.tokenizer import CL100K_IDENTITY, TokenizerConfig
from train.resume import check_data_settings, data_settings

DEMO_FINGERPRINT = "b9926979dbf4e73e"  # the demo corpus's manifest before the tokenizer was a config key


def demo_cfg(demo_corpus, cache, **tokenizer) -> DataConfig:
    return DataConfig(sources={s: SourceConfig(paths=[str(demo_corpus / s / "*.parquet")]) for s in WEIGHTS},
                      schedule=fixed_schedule(WEIGHTS, 64), manifest_cache=str(cache),
                      tokenizer=TokenizerConfig(**tokenizer))


def test_the_default_is_cl100k_with_its_recorded_identity():
    """Guards: the default drifting from the constants it replaced (what every older checkpoint trained with)."""
    tok = TokenizerConfig().build()
    assert (tok.name, tok.eot_id, tok.vocab_size, tok.identity) == ("cl100k_base", 100257, 100277, CL100K_IDENTITY)
    assert TokenizerConfig(name="cl100k_base").build().identity == CL100K_IDENTITY
    assert tok.encode_docs(["hello world"])[0].tolist() == [15339, 1917, 100257]


def test_a_tokenizer_json_builds_one_object_that_workers_rebuild(tiny_bpe_json):
    tok = TokenizerConfig(path=str(tiny_bpe_json)).build()
    assert tok.vocab_size == 384 and tok.name == "tokenizer.json" and tok.identity != CL100K_IDENTITY
    docs = tok.encode_docs(["hello world", "", "a <|endoftext|> inside"], num_threads=2)
    assert all(d.dtype == np.uint32 and d[-1] == tok.eot_id for d in docs) and docs[1].tolist() == [tok.eot_id]
    assert tok.eot_id not in docs[2][:-1], "special-token text in a document became a document boundary"
    assert tok.decode(docs[2][:-1].tolist()) == "a <|endoftext|> inside"
    assert tok.count(["hello world", "a <|endoftext|> inside"]) == [len(docs[0]) - 1, len(docs[2]) - 1]
    again = pickle.loads(pickle.dumps(tok))  # what a DataLoader worker receives: the config, built once there
    assert len(pickle.dumps(tok)) < 1000 and again.encode_docs(["hello world"])[0].tolist() == docs[0].tolist()


@pytest.mark.parametrize("fields, phrase", [
    ({"name": "cl100k_base", "path": "t.json"}, "data.tokenizer: give name (cl100k_base) or path (t.json), not both"),
    ({"name": "no_such_encoding"}, "data.tokenizer.name no_such_encoding: not a tiktoken encoding (known: "),
    ({"path": "missing/tokenizer.json"}, "data.tokenizer.path missing/tokenizer.json: cannot load it"),
    ({"eot": "<|eot|>"}, "data.tokenizer.eot '<|eot|>' is not a token of cl100k_base; give one of"),
])
def test_a_bad_tokenizer_config_is_one_line_naming_the_key(fields, phrase):
    with pytest.raises(TokenizerError) as err:
        TokenizerConfig(**fields).build()
    assert str(err.value).startswith(phrase) and "\n" not in str(err.value), str(err.value)


def test_a_near_tokenizer_is_refused_by_the_token_count_sample(demo_corpus, tmp_path):
    """Guards: a tokenizer whose counts are 1.45x the column's (a 2,000-id BPE against cl100k's counts) passing the
    old x0.5..x2 sample check while every plan and epoch is off by that factor."""
    near = tiny_bpe(demo_corpus, tmp_path / "near.json", 2000)
    with pytest.raises(ConfigError) as err:
        build_manifest(demo_cfg(demo_corpus, tmp_path / "cache", path=str(near)))
    msg = str(err.value)
    assert msg.startswith("data.sources.web: token_count does not match the text ("), msg
    assert "within x0.95..x1.05 of its count with data.tokenizer (near.json)" in msg
    assert "data.tokenizer.recount true" in msg


def test_recount_counts_with_the_tokenizer_and_its_identity_enters_the_fingerprint(demo_corpus, tmp_path,
                                                                                      tiny_bpe_json):
    """The demo's cl100k column recounted with the tiny BPE at start-up; the fingerprint and cache follow the
    tokenizer, and the default's fingerprint is the one it had before (older checkpoints resume)."""
    default = build_manifest(demo_cfg(demo_corpus, tmp_path / "cache"))
    assert default.fingerprint() == DEMO_FINGERPRINT and default.tokenizer == CL100K_IDENTITY
    cfg = demo_cfg(demo_corpus, tmp_path / "cache", path=str(tiny_bpe_json), recount=True)
    tok = cfg.tokenizer.build()
    manifest = build_manifest(cfg)
    import pyarrow.parquet as pq

    texts = pq.read_table(sorted((demo_corpus / "books").glob("*.parquet"))[0], columns=["text"]).column("text")
    assert manifest.tokenizer == tok.identity and manifest.fingerprint() != DEMO_FINGERPRINT
    assert manifest.sources["books"].tokens > 2 * default.sources["books"].tokens  # ~3x: the column was cl100k's
    assert sum(tok.count(texts.to_pylist())) <= manifest.sources["books"].tokens
    assert build_manifest(cfg).sources == manifest.sources  # from the cache (keyed by the tokenizer) the same


def test_a_resume_with_another_tokenizer_is_refused_naming_the_key(demo_corpus, tmp_path, tiny_bpe_json):
    """Whatever run.allow_changed_data says; a checkpoint from before the key was recorded counts as cl100k's."""
    cl100k = data_settings(demo_cfg(demo_corpus, tmp_path))
    bpe = data_settings(demo_cfg(demo_corpus, tmp_path, path=str(tiny_bpe_json)))
    for old, new in ((cl100k, bpe), (bpe, cl100k)):
        with pytest.raises(ConfigError, match=r"^--ckpt_path: the checkpoint \(step 7\) was trained with "
                                              r"data.tokenizer \S+, this run has \S+: a resume keeps its tokenizer"):
            check_data_settings(old, new, allow=True, step=7)
    legacy = json.dumps({k: v for k, v in json.loads(cl100k).items() if k != "tokenizer"})
    check_data_settings(legacy, cl100k, allow=False, step=7)
    with pytest.raises(ConfigError, match="data.tokenizer cl100k_base:"):
        check_data_settings(legacy, bpe, allow=False, step=7)
