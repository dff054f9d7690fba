"""``python -m train fit --config configs/demo.yaml [--ckpt_path last]``, and the ``wellmixed`` command
(``[project.scripts]`` in pyproject.toml) that runs the same :func:`main`."""

import sys

from train.early_signals import install_early_handlers

install_early_handlers()  # before torch's seconds of imports: a SIGTERM then is a flag, not a kill

from train.malloc import keep_freed_memory  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()  # before the first big allocation
    from train.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
