"""Run a script's ``main(argv)`` in this process: scripts/ is not a package that anything imports
(tests/unit/test_layers.py), so a script is loaded from its file, as ``python scripts/NAME.py`` would."""

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """The module of ``scripts/<name>.py`` (its ``main`` takes an argv list and returns the exit code)."""
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
