"""Every repository path the docs cite exists: README.md, docs/*.md, ablations/README.md and the
docstrings of every module, class and function (a reader who follows a cited test file or design
note must find it).

A path is checked when it starts with one of the repository's top-level folders (``data/``,
``train/``, ``docs/``, ...) and names a file (it has an extension: ``train/loss`` is a metric, not a
path), or is an upper-case Markdown file name (``CHANGELOG.md``); Markdown link targets are checked
relative to their document. Not checked: the team's shared notes (``../shared/``), what a run writes
(``runs/...``), URLs, and patterns or placeholders (``*``, ``<run>``, ``{x}``, ``$VAR``, ``NNN``,
``scripts/NAME.py``, ``scripts/x.py``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "ablations" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = [p for folder in ("data", "train", "ablations", "scripts", "tests")
        for p in sorted((ROOT / folder).rglob("*.py"))]
TOP = ["data", "train", "ablations", "scripts", "configs", "docs", "tests", ".ci"]
PATH = re.compile(r"(?<![\w./$~-])((?:%s)/[\w./-]*\.[a-z]+|[A-Z][A-Z_]+\.md)(?![\w/*{<$])"
                  % "|".join(map(re.escape, TOP)))
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
PLACEHOLDER = re.compile(r"[*<>{}$]|NNN|\.\.\.|/([A-Z_]+|[a-z])\.py$")  # scripts/NAME.py, scripts/x.py


def cited(text: str) -> set[str]:
    return {m for m in PATH.findall(text) if not PLACEHOLDER.search(m)}


def exists(path: str, base: Path) -> bool:
    path = path.rstrip(".")
    return any((b / path).exists() for b in (base, ROOT))


def docstrings(path: Path) -> str:
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                    ast.ClassDef)))]
    return "\n".join(ast.get_docstring(n) or "" for n in nodes)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_document_cites_exists(doc):
    text = doc.read_text()
    missing = sorted(p for p in cited(text) if not exists(p, doc.parent))
    links = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and "../shared/" not in t]
    missing += sorted(f"link {t}" for t in links if not (doc.parent / t).exists())
    assert not missing, f"{doc.relative_to(ROOT)} cites what does not exist: {missing}"


def test_every_path_a_docstring_cites_exists():
    missing = {}
    for path in CODE:
        bad = sorted(p for p in cited(docstrings(path)) if not exists(p, path.parent))
        if bad:
            missing[str(path.relative_to(ROOT))] = bad
    assert not missing, f"docstrings cite what does not exist: {missing}"


def test_the_check_finds_a_missing_path():
    assert cited("see `tests/test_ablations.py`, docs/DESIGN.md and DESIGN.md, not runs/demo/x.png, <run>/evals/ "
                 "or scripts/NAME.py") == {"tests/test_ablations.py", "docs/DESIGN.md", "DESIGN.md"}
    assert not exists("tests/test_ablations.py", ROOT) and exists("tests/unit/test_doc_paths.py", ROOT)
