"""The embedded demo corpus: a small Dolma3-style pretraining mix built offline from CPython itself.

Every Python install ships a few MB of English prose and code: the standard library's sources, their
docstrings and comments, the pydoc topic pages (the language reference) and the license. We cut that
material into four mixture sources with realistic token shares:

    web      ~60%  reference "pages" per module (docstrings under signature headings) and comment notes
    code     ~20%  a seeded sample of the .py sources themselves
    books    ~12%  the language reference (pydoc topics) in long chapters, license as an appendix
    curated   ~6%  docstrings of 20 everyday core modules, one short entry per class/function

About 1M tokens (4 MB of text) in all. The prose is what caps the size: books cannot grow past the
language reference, and everything else is scaled to keep books at its ~12% share.

The files look like Dolma3's: ``DIR/<source>/<sub-source>-NNNN.parquet`` with columns
``source, date, text, token_count, category``; each shard holds one sub-source (the ``source`` column)
with rows in stored (sorted path) order, i.e. clustered, not shuffled -- which is exactly what the data
order code of this repo has to cope with. Document IDs are ``<shard stem>:<row>``.

The build is deterministic for a given Python install: file listings are sorted, dates are hashes,
and the only randomness (which code files to sample) comes from a seeded ``random.Random``.
"""

from __future__ import annotations

import ast
import contextlib
import gc
import hashlib
import importlib.util
import json
import math
import os
import platform
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import date, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from data.config import arrow_schema
from data.files import atomic_path
from data.tokenizer import TokenizerConfig

# Bump whenever the produced text changes, so that an existing corpus directory gets rebuilt.
CORPUS_VERSION = 1
SOURCES = ("web", "code", "books", "curated")
SCHEMA = arrow_schema()
MANIFEST = "corpus.json"

SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
MAX_FILE_BYTES = 200_000  # a few generated tables (_pydecimal, pydoc_data/topics) are not "code"
MAX_DOC_CHARS = 40_000  # longer documents are cut at line boundaries
CHAPTER_CHARS = 30_000  # pydoc topics are packed into book chapters of about this size

# Sub-source buckets, like Dolma's per-domain ones: packages by theme, single-file modules together.
PACKAGE_GROUPS = {
    **dict.fromkeys(("email", "html", "http", "json", "urllib", "wsgiref", "xml", "xmlrpc"), "internet"),
    **dict.fromkeys(("asyncio", "concurrent", "multiprocessing"), "concurrency"),
}
# The curated source: the best-documented everyday modules (kept out of web, so no text is duplicated).
CURATED_MODULES = (
    "abc", "argparse", "collections", "contextlib", "dataclasses", "datetime", "enum", "functools",
    "inspect", "json", "os", "pathlib", "random", "re", "shutil", "statistics", "subprocess",
    "textwrap", "threading", "typing",
)  # fmt: skip

# Code is sampled to this share of all tokens. Python source averages ~4 characters per cl100k token;
# the estimate only picks the files, token_count is always the exact count.
CODE_SHARE = 0.20
CODE_CHARS_PER_TOKEN = 4.0
SEED = 1234

# Shard sizes in characters per source: many shards for web, few for the small sources (curated
# must stay under 8). Every shard is written in ROW_GROUPS_PER_SHARD row groups, as loaders must
# handle files with several of them.
SHARD_CHARS = {"web": 400_000, "code": 200_000, "books": 250_000, "curated": 150_000}
ROW_GROUPS_PER_SHARD = 4

DATE_START = date(2016, 1, 1)
DATE_SPAN_DAYS = 3000


@dataclass(frozen=True)
class Module:
    rel: str  # path below the stdlib dir, e.g. "email/message.py"
    name: str  # dotted module name, e.g. "email.message"
    group: str  # sub-source bucket, see PACKAGE_GROUPS
    source: str
    sections: list[str]  # docstrings as reference sections (see _api_sections)


@dataclass(frozen=True)
class Doc:
    category: str  # mixture source: web, code, books, curated
    sub_source: str  # the `source` column, one per shard
    key: str  # what the date is derived from: the file path or chapter name
    text: str
    tokens: int = -1  # true cl100k count, filled in once all documents are known


# ---------------------------------------------------------------------------------------------------
# Docstrings and comments


def _signature(node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef, qualname: str) -> str:
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in [*node.bases, *node.keywords])
        return f"class {qualname}({bases})" if bases else f"class {qualname}"
    kind = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    return f"{kind} {qualname}({ast.unparse(node.args)})"


def _documented(node: ast.stmt, prefix: str, depth: int) -> Iterator[str]:
    """Markdown-ish sections for a class/function and, for classes, their documented members."""
    if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return
    qualname = prefix + node.name
    doc = ast.get_docstring(node)
    if doc and doc.strip():
        yield f"{'#' * depth} {_signature(node, qualname)}\n\n{doc}"
    if isinstance(node, ast.ClassDef):
        for child in node.body:
            yield from _documented(child, qualname + ".", depth + 1)


def _api_sections(tree: ast.Module) -> list[str]:
    """A module's docstrings as reference sections: its own docstring, then one per top-level object."""
    sections = []
    doc = ast.get_docstring(tree)
    if doc and doc.strip():
        sections.append(doc)
    for node in tree.body:
        entry = "\n\n".join(_documented(node, prefix="", depth=2))
        if entry:
            sections.append(entry)
    return sections


def _comment_blocks(source: str) -> list[str]:
    """Runs of full-line comments, '#' stripped; rulers like '# -----' dropped. (Trailing comments
    after code are skipped: finding them needs the tokenize module, which is slow.)"""
    blocks, block = [], []
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            body = stripped.lstrip("#").strip()
            if any(c.isalnum() for c in body):
                block.append(body)
            continue
        if block:
            blocks.append("\n".join(block))
            block = []
    if block:
        blocks.append("\n".join(block))
    return blocks


# ---------------------------------------------------------------------------------------------------
# Reading the standard library


def _group(rel: str) -> str:
    parts = rel.split("/")
    return "modules" if len(parts) == 1 else PACKAGE_GROUPS.get(parts[0], "packages")


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    # ast.parse allocates millions of nodes; the cyclic GC would scan them over and over (~30% of the
    # parse time) although, having no cycles, they are freed by reference counting anyway.
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _read_modules(stdlib: Path) -> list[Module]:
    """The stdlib's own .py files in sorted path order, decoded, with their docstrings extracted."""
    rels = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]  # prune: test/ alone has ~1000 files
        for fn in filenames:
            path = Path(dirpath, fn)
            if fn.endswith(".py") and path.stat().st_size <= MAX_FILE_BYTES:
                rels.append(path.relative_to(stdlib).as_posix())
    modules = []
    with _gc_paused():
        for rel in sorted(rels):
            # decode_source honours PEP 263 coding cookies and normalises newlines, like the importer.
            source = importlib.util.decode_source((stdlib / rel).read_bytes())
            try:
                sections = _api_sections(ast.parse(source))
            except SyntaxError:  # e.g. a file written for another Python version; still fine as code
                sections = []
            name = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            modules.append(Module(rel, name, _group(rel), source, sections))
    return modules


# ---------------------------------------------------------------------------------------------------
# The four sources


def _web_and_curated_docs(modules: list[Module]) -> list[Doc]:
    docs = []
    for m in modules:
        if m.name in CURATED_MODULES:
            # Short, clean entries, as in a curated encyclopedia-like source.
            docs += [Doc("curated", "curated_core", m.rel, f"# {m.name}\n\n{s}") for s in m.sections]
        elif m.sections:
            page = "\n\n".join([f"# {m.name}", *m.sections])
            docs.append(Doc("web", f"web_{m.group}", m.rel, page))
        # Comments are developer notes, not reference text: web even for the curated modules.
        blocks = _comment_blocks(m.source)
        if blocks:
            notes = "\n\n".join([f"Notes on {m.name}", *blocks])
            docs.append(Doc("web", f"web_{m.group}", m.rel, notes))
    return docs


def _books_docs(stdlib: Path) -> list[Doc]:
    """The language reference (pydoc topic pages, sorted) packed into chapters, then the license
    as an appendix, as in the printed Python documentation."""
    from pydoc_data.topics import topics  # 750 KB module: import only when building

    chapters, current = [], []
    for key in sorted(topics):
        text = topics[key].strip()
        if current and sum(map(len, current)) + len(text) > CHAPTER_CHARS:
            chapters.append(current)
            current = []
        current.append(text)
    chapters.append(current)
    docs = [
        Doc("books", "books_reference", f"chapter-{i}", f"Chapter {i}\n\n" + "\n\n".join(ch))
        for i, ch in enumerate(chapters, start=1)
    ]
    license_file = stdlib / "LICENSE.txt"  # absent on some distro builds
    if license_file.is_file():
        text = license_file.read_text(encoding="utf-8", errors="replace")
        text = "Appendix: History and License\n\n" + text
        docs.append(Doc("books", "books_reference", "LICENSE.txt", text))
    return docs


def _code_docs(modules: list[Module], prose_tokens: int, rng: random.Random) -> list[Doc]:
    """A seeded sample of source files sized so that code is about CODE_SHARE of all tokens.

    Every group is sampled at the same rate, so each code sub-source keeps enough files for a
    shard with several row groups; the sampled files are then put back in path order.
    """
    budget = CODE_SHARE / (1 - CODE_SHARE) * prose_tokens * CODE_CHARS_PER_TOKEN
    by_group: dict[str, list[Module]] = {}
    for m in modules:
        if m.source.strip():  # many __init__.py files are empty
            by_group.setdefault(m.group, []).append(m)
    total = sum(len(m.source) for ms in by_group.values() for m in ms)
    docs = []
    for group in sorted(by_group):
        candidates = by_group[group]
        chosen = _sample_group(candidates, budget * sum(len(m.source) for m in candidates) / total, rng)
        docs += [Doc("code", f"code_{group}", m.rel, m.source) for m in sorted(chosen, key=lambda m: m.rel)]
    return docs


def _sample_group(candidates: list[Module], budget: float, rng: random.Random) -> list[Module]:
    """Files of one group in a seeded order until the next would overshoot ``budget`` (characters) by more
    than half its size, and at least ROW_GROUPS_PER_SHARD of them."""
    chosen, size = [], 0
    for m in rng.sample(candidates, len(candidates)):
        if size + len(m.source) / 2 > budget and len(chosen) >= ROW_GROUPS_PER_SHARD:
            break
        chosen.append(m)
        size += len(m.source)
    return chosen


def _split(text: str, limit: int = MAX_DOC_CHARS) -> list[str]:
    """Cut a document at line boundaries into pieces of at most `limit` characters (a single line
    longer than that is cut too); whitespace-only pieces are dropped."""
    pieces, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        for chunk in (line[i : i + limit] for i in range(0, len(line), limit)):
            if current and size + len(chunk) > limit:
                pieces.append("".join(current))
                current, size = [], 0
            current.append(chunk)
            size += len(chunk)
    pieces.append("".join(current))
    return [p for p in pieces if p.strip()]


def _capped(docs: list[Doc]) -> list[Doc]:
    return [replace(d, text=piece) for d in docs for piece in _split(d.text)]


def _counted(docs: list[Doc]) -> list[Doc]:
    return [replace(d, tokens=n) for d, n in zip(docs, TokenizerConfig().build().count([d.text for d in docs]))]


def _date(key: str) -> str:
    # Spread over ~8 years like the crawl dates of a real corpus; a hash keeps it reproducible.
    days = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % DATE_SPAN_DAYS
    return (DATE_START + timedelta(days=days)).isoformat()


# ---------------------------------------------------------------------------------------------------
# Writing shards (atomically: data/files.py)


def _shards(docs: list[Doc]) -> Iterator[tuple[str, list[Doc]]]:
    """(stem, docs) per shard: each sub-source cut into contiguous shards of about equal row count."""
    by_sub: dict[str, list[Doc]] = {}
    for d in docs:
        by_sub.setdefault(d.sub_source, []).append(d)
    for sub in sorted(by_sub):
        rows = by_sub[sub]
        chars = sum(len(d.text) for d in rows)
        n = max(1, min(round(chars / SHARD_CHARS[rows[0].category]), len(rows) // ROW_GROUPS_PER_SHARD))
        for i in range(n):
            yield f"{sub}-{i:04d}", rows[i * len(rows) // n : (i + 1) * len(rows) // n]


def _is_complete(out_dir: Path, manifest: dict) -> bool:
    return all(
        (out_dir / category / f"{shard['name']}.parquet").is_file()
        for category, summary in manifest["sources"].items()
        for shard in summary["shards"]
    )


def build_demo_corpus(out_dir: str | Path, force: bool = False) -> dict:
    """Build the demo corpus under `out_dir` and return its manifest (also saved as corpus.json).

    Per source the manifest lists ``shards`` (name, sub-source, rows, row_groups, tokens) with the
    source's ``rows`` and ``tokens``; ``content_hash`` covers every shard name and text. A directory
    already holding a complete corpus of this version is reused (``reused: True`` in the returned
    dict) unless `force`.
    """
    out_dir = Path(out_dir)
    manifest_path = out_dir / MANIFEST
    # The stdlib differs between Python versions, so the corpus does too.
    identity = {"corpus_version": CORPUS_VERSION, "python": platform.python_version()}
    existing = None if force else _existing_manifest(out_dir, identity)
    if existing is not None:
        return {**existing, "reused": True}
    out_dir.mkdir(parents=True, exist_ok=True)
    # No manifest while shards are being replaced: an interrupted build must not look complete.
    manifest_path.unlink(missing_ok=True)

    sources = {c: {"rows": 0, "tokens": 0, "shards": []} for c in SOURCES}
    digest = hashlib.sha256()
    for stem, rows in _shards(_documents()):
        shard = _write_shard(out_dir, stem, rows)
        summary = sources[rows[0].category]
        summary["shards"].append(shard)
        summary["rows"] += shard["rows"]
        summary["tokens"] += shard["tokens"]
        digest.update(stem.encode() + b"\0" + "\0".join(d.text for d in rows).encode() + b"\0")
    _remove_stale_shards(out_dir, sources)

    manifest = {**identity, "content_hash": digest.hexdigest(), "sources": sources}
    with atomic_path(manifest_path) as tmp:
        Path(tmp).write_text(json.dumps(manifest, indent=1) + "\n")
    return {**manifest, "reused": False}


def _existing_manifest(out_dir: Path, identity: dict) -> dict | None:
    """The manifest under `out_dir` if it is of this identity and all its shards are there."""
    manifest_path = out_dir / MANIFEST
    if not manifest_path.is_file():
        return None
    manifest = json.loads(manifest_path.read_text())
    if all(manifest.get(k) == v for k, v in identity.items()) and _is_complete(out_dir, manifest):
        return manifest
    return None


def _documents() -> list[Doc]:
    """Every document of the corpus, prose first, cut to size and with token counts."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = _read_modules(stdlib)
    prose = _counted(_capped(_web_and_curated_docs(modules) + _books_docs(stdlib)))
    code = _counted(_capped(_code_docs(modules, sum(d.tokens for d in prose), random.Random(SEED))))
    return prose + code


def _write_shard(out_dir: Path, stem: str, rows: list[Doc]) -> dict:
    """Write one shard's parquet file (atomically) and return its manifest entry."""
    category = rows[0].category
    table = pa.table(
        {
            "source": [d.sub_source for d in rows],
            "date": [_date(d.key) for d in rows],
            "text": [d.text for d in rows],
            "token_count": [d.tokens for d in rows],
            "category": [d.category for d in rows],
        },
        schema=SCHEMA,
    )
    row_group_size = math.ceil(len(rows) / ROW_GROUPS_PER_SHARD)
    path = out_dir / category / f"{stem}.parquet"
    path.parent.mkdir(exist_ok=True)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, row_group_size=row_group_size)
    return {
        "name": stem,
        "source": rows[0].sub_source,
        "rows": len(rows),
        "row_groups": math.ceil(len(rows) / row_group_size),
        "tokens": sum(d.tokens for d in rows),
    }


def _remove_stale_shards(out_dir: Path, sources: dict) -> None:
    """Delete shards of an older build, which anything globbing the directory would pick up."""
    keep = {f"{s['name']}.parquet" for summary in sources.values() for s in summary["shards"]}
    for category in SOURCES:
        for stale in sorted((out_dir / category).glob("*.parquet")):
            if stale.name not in keep:
                stale.unlink()


def format_summary(manifest: dict) -> str:
    """A per-source table: shards, row groups, documents, tokens and share of tokens."""
    total = sum(s["tokens"] for s in manifest["sources"].values())
    lines = [f"{'source':<8} {'shards':>6} {'row groups':>10} {'docs':>7} {'tokens':>10} {'share':>6}"]
    for category, s in manifest["sources"].items():
        row_groups = sum(shard["row_groups"] for shard in s["shards"])
        lines.append(
            f"{category:<8} {len(s['shards']):>6} {row_groups:>10} {s['rows']:>7} {s['tokens']:>10,} "
            f"{s['tokens'] / total:>6.1%}"
        )
    rows = sum(s["rows"] for s in manifest["sources"].values())
    lines.append(f"{'total':<8} {'':>6} {'':>10} {rows:>7} {total:>10,}")
    return "\n".join(lines)
