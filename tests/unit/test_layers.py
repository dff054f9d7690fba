"""The layer rules, read from the imports of every module (static: nothing is imported or run).

data/ (the training-time path) never imports train/, the corpus tools, Lightning or torch; the model
never imports data/; nothing imports ablations/ except ablations/; nothing imports scripts/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imports(path: Path) -> set[str]:
    """Every module name a file imports, at any depth (function-level imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def top(name: str) -> str:
    return name.split(".")[0]


DATA_PATH = [p for p in modules("data") if "corpus" not in p.relative_to(ROOT / "data").parts]


@pytest.mark.parametrize("path", DATA_PATH, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_data_path_is_framework_free_and_never_imports_train_or_the_corpus_tools(path):
    bad = {m for m in imports(path)
           if top(m) in {"train", "ablations", "scripts", "lightning", "torch"} or m.startswith("data.corpus")}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", modules("data/corpus"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_corpus_tools_never_import_train_or_lightning(path):
    bad = {m for m in imports(path) if top(m) in {"train", "ablations", "scripts", "lightning"}}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_model_never_imports_data():
    bad = {m for m in imports(ROOT / "train" / "model.py") if top(m) == "data"}
    assert not bad, f"train/model.py imports {sorted(bad)}"


@pytest.mark.parametrize("folder", ["data", "train", "ablations", "scripts", "tests"])
def test_nothing_imports_scripts_and_only_ablations_imports_ablations(folder):
    for path in modules(folder):
        found = {top(m) for m in imports(path)}
        assert "scripts" not in found, f"{path.relative_to(ROOT)} imports scripts/"
        if folder in ("data", "train"):
            assert "ablations" not in found, f"{path.relative_to(ROOT)} imports ablations/"


def edits_sys_path(path: Path) -> bool:
    """True where a file calls a method of ``sys.path`` (insert, append, ...)."""
    for node in ast.walk(ast.parse(path.read_text())):
        f = node.func if isinstance(node, ast.Call) else None
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) and f.value.attr == "path" \
                and getattr(f.value.value, "id", "") == "sys":
            return True
    return False


@pytest.mark.parametrize("folder", ["data", "train", "ablations", "scripts", "tests"])
def test_no_file_edits_sys_path(folder):
    assert not [str(p.relative_to(ROOT)) for p in modules(folder) if edits_sys_path(p)]


def test_lightning_internals_name_the_version_they_were_written_for(monkeypatch, caplog):
    """Another Lightning minor version is said once at start-up (train/lightning_internals.py)."""
    from train import lightning_internals as internals

    monkeypatch.setattr(internals, "_warned", False)
    monkeypatch.setattr(internals, "WRITTEN_FOR", (1, 9))
    with caplog.at_level("WARNING"):
        internals.check_version()
        internals.check_version()
    assert sum("written for 1.9" in r.getMessage() for r in caplog.records) == 1


def test_only_lightning_internals_subclass_lightning_private_hooks():
    """Overrides of Lightning's private methods live in train/lightning_internals.py."""
    private_overrides = {"_check_log_dir_exists", "_save_topk_checkpoint", "_save_last_checkpoint",
                         "_instantiate_trainer", "_parse_ckpt_path"}
    found = {}
    for path in modules("train"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in private_overrides:
                found.setdefault(node.name, set()).add(path.name)
    assert found == {name: {"lightning_internals.py"} for name in private_overrides}


PACKAGES = ("data", "train", "ablations")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def repo_targets(node: ast.AST, known: set[str]) -> set[str]:
    """The repository modules an import statement loads (``from data import files`` loads data.files)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    else:
        return set()
    return {n for n in names if n in known}


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module-level imports, function-level imports) between the repository's own modules."""
    paths = {module_name(p): p for pkg in PACKAGES for p in modules(pkg)}
    known = set(paths)
    top_level: dict[str, set[str]] = {}
    nested: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        outer = {id(n) for stmt in tree.body if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                       ast.ClassDef))
                 for n in ast.walk(stmt)}
        typing_only = {id(n) for stmt in tree.body if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(
            stmt.test) for n in ast.walk(stmt)}  # never run: no import at run time
        top_level[name], nested[name] = set(), set()
        for node in ast.walk(tree):
            targets = repo_targets(node, known) - {name}
            if id(node) not in typing_only:
                (top_level if id(node) in outer else nested)[name].update(targets)
    return top_level, nested


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_cycles_and_no_function_level_import_that_dodges_one():
    """A function-level import of a module that imports this one back is a cycle in hiding: both fail."""
    top_level, nested = import_graph()
    cycles = sorted(m for m in top_level if m in closure(top_level, m))
    assert not cycles, f"module-level import cycles through {cycles}"
    dodges = sorted(f"{m} -> {x}" for m, xs in nested.items() for x in xs if m in closure(top_level, x))
    assert not dodges, f"function-level imports that would close a cycle at the top: {dodges}"
