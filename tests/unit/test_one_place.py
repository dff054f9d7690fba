"""The "one place" rules, read from the source of every module (static: nothing is imported or run).

- Renaming a finished file over its destination (an atomic write) happens in data/files.py only;
  every other writer goes through its helpers (atomic_path, publish, write_*).
- Lightning's private loop and connector objects are touched in train/lightning_internals.py only.
- The Dolma3 schema (source, date, text, token_count, category) is written in data/config.py only.
- Outside train/datamodule.py the DataModule is used through its methods only: ``prepare()`` and
  ``context()`` (the prepared data, data/types.py TrainingContext), ``record()``, and the hooks of
  Lightning's LightningDataModule; its fields and attributes are read from the context.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("data", "train", "ablations", "scripts")
SOURCES = [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
DOLMA3_COLUMNS = {"source", "date", "text", "token_count", "category"}
LIGHTNING_PRIVATE = {  # the Trainer's loops, progress counters and connectors: not Lightning's public API
    "fit_loop", "epoch_loop", "batch_progress", "_data_fetcher", "_combined_loader", "_active_loop",
    "_checkpoint_connector", "_data_connector", "_logger_connector", "_accelerator_connector",
    "_callback_connector", "_signal_connector", "_results",
}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


@functools.cache
def tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), filename=str(path))


def renames(path: Path) -> list[str]:
    """``os.replace`` / ``os.rename`` / ``shutil.move`` calls, and ``x.replace(target)`` / ``x.rename(target)``
    with one argument (a ``Path`` rename: ``str.replace`` takes two, ``dataclasses.replace`` keywords)."""
    out = []
    for node in ast.walk(tree(path)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, owner = node.func.attr, getattr(node.func.value, "id", None)
        if (owner, name) in {("os", "replace"), ("os", "rename"), ("os", "renames"), ("shutil", "move")} \
                or (name in ("replace", "rename") and len(node.args) == 1 and not node.keywords):
            out.append(f"{rel(path)}:{node.lineno} {ast.unparse(node.func)}(...)")
    return out


def test_only_data_files_renames_a_file_over_its_destination():
    found = [hit for path in SOURCES if path != ROOT / "data" / "files.py" for hit in renames(path)]
    assert not found, "atomic writes go through data/files.py (atomic_path, publish, write_*): " + "; ".join(found)


def test_the_rename_rule_sees_the_spellings_it_forbids(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os, shutil\nos.replace(a, b)\nos.rename(a, b)\nshutil.move(a, b)\np.replace(q)\n"
                     "s.replace('a', 'b')\ndataclasses.replace(c, x=1)\n")
    assert [hit.split(" ")[1] for hit in renames(probe)] == \
        ["os.replace(...)", "os.rename(...)", "shutil.move(...)", "p.replace(...)"]


def lightning_private(path: Path) -> list[str]:
    out = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Attribute) and node.attr in LIGHTNING_PRIVATE:
            out.append(f"{rel(path)}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lightning" \
                and any(part.startswith("_") or part in ("loops", "connectors") for part in node.module.split(".")):
            out.append(f"{rel(path)}:{node.lineno} from {node.module}")
    return out


def test_only_lightning_internals_touches_the_trainers_loops_and_connectors():
    internals = ROOT / "train" / "lightning_internals.py"
    found = [hit for path in SOURCES if path != internals for hit in lightning_private(path)]
    assert not found, "Lightning internals belong in train/lightning_internals.py: " + "; ".join(found)
    assert lightning_private(internals), "the rule names what train/lightning_internals.py really touches"


def imported_names(node: ast.AST) -> dict[str, str]:
    """Local name -> dotted origin of every import in a file (any depth): ``L`` -> ``lightning``."""
    out = {}
    for n in ast.walk(node):
        if isinstance(n, ast.Import):
            out.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                        for a in n.names})
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.update({a.asname or a.name: f"{n.module}.{a.name}" for a in n.names})
    return out


def lightning_bases(cls: ast.ClassDef, names: dict[str, str]) -> list[type]:
    """The classes of ``cls``'s bases that are Lightning's, or ours built on Lightning's (imported,
    possibly inside a function): a subclass of train/config.py's ConfigCLI is a LightningCLI too."""
    out = []
    for base in cls.bases:
        dotted = ast.unparse(base).split(".")
        origin = names.get(dotted[0])
        if origin is None or origin.split(".")[0] not in ("lightning", "train"):
            continue
        module, attr = origin.rpartition(".")[::2] if len(dotted) == 1 else (origin, None)
        obj = importlib.import_module(module)
        for part in ([attr] if attr else []) + dotted[1:]:
            obj = getattr(obj, part)
        if isinstance(obj, type) and any(k.__module__.startswith("lightning") for k in obj.__mro__):
            out.append(obj)
    return out


def lightning_owns(bases: list[type], name: str) -> bool:
    """``name`` is a method, class attribute or ``self.name`` of a Lightning class in the bases' MRO."""
    for base in bases:
        for k in base.__mro__:
            if not k.__module__.startswith("lightning"):
                continue
            if name in vars(k):
                return True
            with contextlib.suppress(OSError, TypeError):
                if f"self.{name}" in inspect.getsource(k):
                    return True
    return False


def private_lightning_members(path: Path) -> list[str]:
    """The private (``_name``) members of Lightning classes that a subclass in ``path`` defines, reads or sets."""
    file_tree = tree(path)
    names = imported_names(file_tree)
    out = []
    for cls in (n for n in ast.walk(file_tree) if isinstance(n, ast.ClassDef)):
        bases = lightning_bases(cls, names)
        if not bases:
            continue
        used = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
        used |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
                 and (getattr(n.value, "id", None) == "self" or ast.unparse(n.value) == "super()")}
        out += [f"{rel(path)}:{cls.lineno} {cls.name}.{name}" for name in sorted(used)
                if name.startswith("_") and not name.startswith("__") and lightning_owns(bases, name)]
    return out


@pytest.mark.parametrize("path", [p for p in SOURCES if p.parts[-2] == "train" and p.name != "lightning_internals.py"],
                         ids=rel)
def test_subclasses_of_lightning_classes_use_no_private_members_outside_lightning_internals(path):
    found = private_lightning_members(path)
    assert not found, "move these into train/lightning_internals.py: " + "; ".join(found)


def test_the_private_member_rule_sees_what_lightning_internals_does():
    found = private_lightning_members(ROOT / "train" / "lightning_internals.py")
    assert any(f.endswith(" FSDP2Strategy._data_parallel_size") for f in found)  # set, from the base's __init__
    assert any(f.endswith(" _AppendingWriter._check_log_dir_exists") for f in found)  # an overridden method
    assert any(f.endswith(" CheckpointHooks._last_global_step_saved") for f in found)  # read, set by the base
    assert any(f.endswith(" CLIHooks._instantiate_trainer") for f in found)


def schema_literals(path: Path) -> list[str]:
    """Dict literals keyed by all five Dolma3 columns with type names as values, and ``*.schema([...])`` calls
    naming ``token_count``: a second spelling of the schema (a table of data keyed by the columns is fine)."""
    out = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if DOLMA3_COLUMNS <= keys and all(isinstance(v, ast.Constant) and isinstance(v.value, str)
                                              for v in node.values):
                out.append(f"{rel(path)}:{node.lineno} {{...}}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "schema" \
                and "'token_count'" in ast.unparse(node):
            out.append(f"{rel(path)}:{node.lineno} {ast.unparse(node.func)}(...)")
    return out


def test_the_dolma3_schema_is_written_in_data_config_only():
    found = [hit for path in SOURCES for hit in schema_literals(path)]
    assert [hit.split(":")[0] for hit in found] == ["data/config.py"], \
        "the Dolma3 schema is data.config.SCHEMA (arrow_schema() for pyarrow): " + "; ".join(found)


DATAMODULE_METHODS = {"prepare", "context", "record"}
"""WellMixedData's own methods for other modules; Lightning's LightningDataModule methods are allowed too."""


def datamodule_methods() -> set[str]:
    import lightning as L

    base = L.LightningDataModule
    return DATAMODULE_METHODS | {n for n in dir(base) if not n.startswith("_") and callable(getattr(base, n))}


def is_datamodule(node: ast.AST | None, names: set[str]) -> bool:
    """``<x>.datamodule``, ``WellMixedData(...)`` / ``WellMixedData.<classmethod>(...)``, or a name bound to one."""
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Attribute):
        return node.attr == "datamodule"
    return isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[0] == "WellMixedData"


def datamodule_names(file_tree: ast.AST) -> set[str]:
    """``dm`` (the name every module gives a DataModule) and the names assigned one or annotated ``WellMixedData``."""
    names = {"dm"}
    for _ in range(2):  # a name assigned from a name found in the first pass
        for node in ast.walk(file_tree):
            if isinstance(node, ast.Assign) and is_datamodule(node.value, names):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and (
                    is_datamodule(node.value, names) or "WellMixedData" in ast.unparse(node.annotation)):
                names.add(node.target.id)
            elif isinstance(node, ast.arg) and node.annotation is not None \
                    and "WellMixedData" in ast.unparse(node.annotation):
                names.add(node.arg)
    return names


def datamodule_reads(path: Path) -> list[str]:
    """Attributes of a DataModule that ``path`` reads or sets other than its allowed methods."""
    file_tree = tree(path)
    names, allowed = datamodule_names(file_tree), datamodule_methods()
    hits = sorted((node.lineno, node.col_offset, ast.unparse(node)) for node in ast.walk(file_tree)
                  if isinstance(node, ast.Attribute) and is_datamodule(node.value, names) and node.attr not in allowed)
    return [f"{rel(path)}:{line} {text}" for line, _, text in hits]


def test_other_modules_read_the_prepared_data_from_the_context_not_the_datamodule():
    found = [hit for path in SOURCES if path != ROOT / "train" / "datamodule.py" for hit in datamodule_reads(path)]
    assert not found, "read these from dm.context() (data/types.py TrainingContext): " + "; ".join(found)


def test_the_datamodule_rule_sees_the_spellings_it_forbids(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("dm.manifest\ndm.context().manifest\ntrainer.datamodule.accumulate\n"
                     "trainer.datamodule.record(b)\ndata = trainer.datamodule\ndata.batch_size\n"
                     "data.val_dataloader()\ndef f(x: WellMixedData):\n    return x.steps\n"
                     "m = WellMixedData.load_from_checkpoint(p)\nm.prepare(1).schedule\nm.schedule\n"
                     "WellMixedData(**kw).order_log\n")
    assert [hit.split(" ")[1] for hit in datamodule_reads(probe)] == \
        ["dm.manifest", "trainer.datamodule.accumulate", "data.batch_size", "x.steps", "m.schedule",
         "WellMixedData(**kw).order_log"]


def test_the_written_schema_is_the_one_the_manifest_checks():
    import pyarrow as pa

    from data.config import SCHEMA, arrow_schema
    from data.corpus.demo import SCHEMA as DEMO

    assert arrow_schema().names == list(SCHEMA) == ["source", "date", "text", "token_count", "category"]
    assert DEMO == arrow_schema()
    assert arrow_schema().field("token_count").type == pa.int64()
