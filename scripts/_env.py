"""Imported first by every script (``python scripts/<name>.py``): run by a Python without wellmixed's
environment, say in one line how to set it up, instead of a ``ModuleNotFoundError`` for torch or ``data``.

Standard library only (it runs before anything else can be imported). Each script imports it as

    try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
        import _env  # noqa: F401
    except ImportError:  # loaded by path (a test, runpy): the caller's environment
        pass

``python scripts/x.py`` puts scripts/ first on ``sys.path``, so this file is found there; a test that
loads a script by its path has no scripts/ on the path, and no need of the check. ``python -m train``
checks the same in train/__main__.py.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REQUIRED = ("data", "train", "numpy", "pyarrow", "yaml", "tiktoken", "torch", "lightning", "jsonargparse")
"""What a script may import: the repository's own packages (``pip install -e .`` by scripts/setup.sh) and the
import names of pyproject.toml's dependencies."""


def missing(names: tuple[str, ...] = REQUIRED) -> list[str]:
    """The modules this Python cannot find (nothing is imported)."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def setup_line(absent: list[str], script: str) -> str:
    """``error: ...`` naming what is missing, and the two commands that fix it."""
    root = Path(__file__).resolve().parent.parent
    venv = root / ".venv" / "bin" / "python"
    setup = "" if venv.is_file() else f"set it up once with `bash {root / 'scripts' / 'setup.sh'}`, then "
    return (f"error: {sys.executable} has no module named {', '.join(absent)}: wellmixed runs in its own "
            f"environment; {setup}run `{venv} {script} ...`")


def check() -> None:
    absent = missing()
    if absent:
        print(setup_line(absent, sys.argv[0] or "scripts/<name>.py"), file=sys.stderr)
        raise SystemExit(2)


check()
