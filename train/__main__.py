"""``python -m train fit --config configs/demo.yaml [--ckpt_path last]``, and the ``wellmixed`` command
(``[project.scripts]`` in pyproject.toml) that runs the same :func:`main`."""

import sys

from train.malloc import keep_freed_memory


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()  # before the first big allocation
    from train.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
