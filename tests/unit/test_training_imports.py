"""``train/`` is what a training run imports; the tools that run on a run live in ``train/tools/``.

The rule both ways: no module of the training path names ``train.tools`` (static, any depth), and importing
what ``python -m train fit`` imports leaves ``train.tools`` out of ``sys.modules`` (a fresh interpreter).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imports(path: Path) -> set[str]:
    """Every absolute module name a file imports, at any depth."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
    return out


TRAINING_PATH = [p for p in sorted((ROOT / "train").rglob("*.py")) if "tools" not in p.relative_to(ROOT).parts]


@pytest.mark.parametrize("path", TRAINING_PATH, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_training_path_never_imports_the_tools(path):
    bad = sorted(m for m in imports(path) if m == "train.tools" or m.startswith("train.tools."))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: a tool's code belongs in train/tools/"


def test_python_m_train_fit_imports_no_tool():
    code = ("import sys, train.__main__, train.cli, train.module, train.datamodule, train.callbacks; "
            "print(sorted(m for m in sys.modules if m.startswith('train.tools')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", f"a training run imports {r.stdout.strip()}"
