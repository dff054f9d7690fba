"""``python -m train fit --config configs/demo.yaml [--ckpt_path last]``, and the ``wellmixed`` command
(``[project.scripts]`` in pyproject.toml) that runs the same :func:`main`."""

import importlib.util
import sys

from train.early_signals import install_early_handlers

install_early_handlers()  # before torch's seconds of imports: a SIGTERM then is a flag, not a kill

from train.malloc import keep_freed_memory  # noqa: E402

REQUIRED = ("data", "torch", "lightning", "jsonargparse", "numpy", "pyarrow", "yaml", "tiktoken")
"""Checked before the first import of any (scripts/_env.py checks the same for the scripts)."""


def environment_problem() -> str | None:
    """``error: ...`` with the way to set the environment up, when this Python cannot find a module the
    run needs (a bare ``ModuleNotFoundError`` for torch otherwise); None when all are there."""
    absent = [name for name in REQUIRED if importlib.util.find_spec(name) is None]
    if not absent:
        return None
    return (f"error: {sys.executable} has no module named {', '.join(absent)}: wellmixed runs in its own "
            "environment; set it up once with `bash scripts/setup.sh` (from the repository root), then run "
            "`.venv/bin/python -m train ...`")


def main(argv: list[str] | None = None) -> int:
    problem = environment_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    keep_freed_memory()  # before the first big allocation
    from train.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
