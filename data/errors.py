"""The errors a user can act on, raised before compute is spent, and how every entry point prints them.

One family, one base: ``except WellMixedError`` catches every refusal of the repository.

- :class:`WellMixedError` -- the base. The message names the file, config key or flag at fault and says
  what to do about it.
- :class:`ConfigError` -- a configuration value, a flag, or an input file is unusable (also a ``ValueError``).
  Subclasses raised elsewhere: ``data.files.LinkRefused`` (a file the run writes is a symbolic link),
  ``data.files.WriteError`` (a full disk, no inodes, permissions), ``train.checkpoint.CheckpointError`` (a
  checkpoint a reader refuses).
- :class:`DataError` -- a corpus file is unreadable or holds a row that cannot be trained on (a null or
  undecodable text, a corrupt page); the message names ``file: row group`` (and the row where known).
- :class:`TokenizerError` -- the cl100k_base BPE file is missing or corrupt (also a ``RuntimeError``).

``train.model.ModelConfigError`` stands outside the family: the model file imports nothing of data/
(tests/unit/test_layers.py), so the entry points that build a model name it beside the base
(``one_line_errors(also=(ModelConfigError,))``).

Every entry point -- ``python -m train fit`` and each ``main(argv) -> int`` of scripts/ and ablations/ --
prints such an error with :func:`error_lines` (``error: ...``, no traceback) and exits 2
(:func:`one_line_errors`). docs/faults.md lists the refusals.
"""

from __future__ import annotations

import functools
import re
import sys
from typing import Callable

REFUSED_EXIT = 2
"""Exit status of a refusal (bad configuration, flag or input): nothing was computed."""


class WellMixedError(Exception):
    """A refusal the user can act on: the message names the thing at fault and the way out."""


class ConfigError(WellMixedError, ValueError):
    """A configuration value, a flag, or an input file is unusable."""


class DataError(ConfigError, RuntimeError):
    """A corpus file is unreadable, or a row of it cannot be trained on: the message names the file and
    row group (and row). A ``ConfigError`` (the input is unusable) and a ``RuntimeError`` (found while
    reading)."""


class TokenizerError(WellMixedError, RuntimeError):
    """The cl100k_base BPE file is missing, or is not the official file (data/tokenizer.py)."""


_FROM_WORKER = re.compile(r"\ACaught (\w+) (in DataLoader worker process \d+)\.\nOriginal Traceback.*\n"
                          r"(?:[\w.]+\.)?\1: (.+)\Z", re.S)
"""torch's re-raise of a worker's error in the main process: its name, the worker, the whole traceback
as text, and last the original message (torch/_utils.py ``ExceptionWrapper``)."""


def error_lines(e: BaseException) -> str:
    """``error: <key>: <problem>; <what to do>``, one line per problem the error carries (several
    independent config problems are reported together, so one run shows them all); indented lines
    continue the problem above them. An error raised in a DataLoader worker (a corrupt corpus row met
    during training) is its original message, naming the worker, without the worker's traceback."""
    text = str(e)
    worker = _FROM_WORKER.match(text)
    if worker:
        first, _, rest = worker.group(3).rstrip().partition("\n")
        text = f"{first} ({worker.group(2)})" + (f"\n{rest}" if rest else "")
    lines = [ln if ln[:1].isspace() else f"error: {ln}" for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines) or f"error: {e!r}"


def one_line_errors(main: Callable[..., int] | None = None, *,
                    also: tuple[type[BaseException], ...] = ()) -> Callable[..., int]:
    """Decorate an entry point's ``main(argv) -> int``: a :class:`WellMixedError` (or one of ``also``)
    is printed as :func:`error_lines` on stderr and the exit status is 2 -- no traceback. Anything else
    propagates (a bug keeps its traceback).

    ``@one_line_errors`` or ``@one_line_errors(also=(ModelConfigError,))``.
    """
    refused = (WellMixedError, *also)

    def wrap(fn: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(fn)
        def entry(*args, **kwargs) -> int:
            try:
                return fn(*args, **kwargs)
            except refused as e:
                print(error_lines(e), file=sys.stderr, flush=True)
                return REFUSED_EXIT

        return entry

    return wrap if main is None else wrap(main)
