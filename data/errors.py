"""The errors a user can act on, raised before compute is spent, and how every entry point prints them.

One family, one base: ``except WellMixedError`` catches every refusal of the repository (the classes
below: ConfigError, DataError, TokenizerError; ConfigError's subclasses raised elsewhere are
``data.files.LinkRefused``, ``data.files.WriteError`` and ``train.checkpoint.CheckpointError``).

``train.model.ModelConfigError`` stands outside the family: the model file imports nothing of data/
(tests/unit/test_layers.py), so the entry points that build a model name it beside the base
(``one_line_errors(also=(ModelConfigError,))``).

Every entry point -- ``python -m train fit`` and each ``main(argv) -> int`` of scripts/ and ablations/ --
prints such an error with :func:`error_lines` (``error: ...``, no traceback) and exits 2
(:func:`one_line_errors`). docs/faults.md lists the refusals.

:func:`parser_error_line` is the one wording of a configuration the parser (jsonargparse) refuses, for
``train fit``, every tool and ``ScheduleConfig.from_dict``; :func:`misread_keys` finds what it lets through
unread (a misspelt key holding ``{}``) or misread (a number where a group goes).
"""

from __future__ import annotations

import difflib
import functools
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any, Callable

REFUSED_EXIT = 2
"""Exit status of a refusal (bad configuration, flag or input): nothing was computed."""


class WellMixedError(Exception):
    """A refusal the user can act on: the message names the thing at fault and the way out."""


class ConfigError(WellMixedError, ValueError):
    """A configuration value, a flag, or an input file is unusable."""


class DataError(ConfigError, RuntimeError):
    """A corpus file is unreadable, or a row of it cannot be trained on (a null or undecodable text, a
    corrupt page): the message names the file and row group (and row). A ``ConfigError`` (the input is
    unusable) and a ``RuntimeError`` (found while reading)."""


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


_UNKNOWN = re.compile(r"(?:Group '([\w.]+)'|Subcommand '\w+') does not accept option '([\w.]+)'"
                      r"|Option '([\w.]+)' is not accepted"
                      r"|unrecognized arguments: (\S+)")
_PARSER_KEY = re.compile(r'^(?:- )?Parser key "([\w.]+)":?\s*')


def parser_error_line(message: str, known: Iterable[str] = (), files: Iterable[tuple[str, Mapping]] = (),
                      hints: Mapping[str, str] | None = None) -> str:
    """jsonargparse's refusal as one line, the same wherever the configuration came from.

    - a key nothing accepts: ``FILE: KEY: unknown key (did you mean KEY2?)``, FILE being the first of
      ``files`` (name, contents) that holds KEY; a flag: ``--KEY: unknown flag (did you mean --KEY2?)``;
    - a file not found: ``--KEY PATH: file not found``;
    - anything else: ``KEY: `` and jsonargparse's own words (``Expected a <class 'float'>. Got value: abc``);
    - ``hints``: the whole line for a key with a known replacement (a key this CLI sets, a removed key).
    """
    keys, text = _read_message(message)
    unknown = _UNKNOWN.search(message)
    key = _unknown_key(unknown.groups(), keys) if unknown else ".".join(keys)
    bare = key.lstrip("-")
    hint = next((line for k, line in (hints or {}).items() if bare == k or bare.startswith(k + ".")), None)
    missing = re.match(r"File does not exist: '?([^']+)'?$", text)
    if missing and not hint:
        return f"--{key} {missing.group(1)}: file not found"
    if hint or not unknown:
        return hint or f"{key}: {text or message}"
    return unknown_key_line(key, known, files)


def unknown_key_line(key: str, known: Iterable[str] = (), files: Iterable[tuple[str, Mapping]] = ()) -> str:
    """``FILE: KEY: unknown key (did you mean KEY2?)`` (FILE: the first of ``files`` that holds KEY), or for a
    flag ``--KEY: unknown flag (did you mean --KEY2?)``: the closest of ``known``, or those it abbreviates."""
    dash = "--" if key.startswith("--") else ""
    bare = key.lstrip("-")
    where = "" if dash else next((f"{name}: " for name, given in files if _holds(given, bare.split("."))), "")
    close = _closest(bare, list(known))
    maybe = f" (did you mean {' or '.join(dash + k for k in close)}?)" if close else ""
    return f"{where}{key}: unknown {'flag' if dash else 'key'}{maybe}"


def _read_message(message: str) -> tuple[list[str], str]:
    """The keys jsonargparse's message names (outermost first) and its first line of prose."""
    keys, text = [], ""
    for line in message.splitlines():
        line = line.strip()
        while _PARSER_KEY.match(line):
            keys.append(_PARSER_KEY.match(line).group(1))
            line = _PARSER_KEY.sub("", line, count=1)
        if line and not text and not line.startswith("Problem with given class_path"):
            text = line
    return list(dict.fromkeys(keys)), text


def _unknown_key(groups: tuple, keys: list[str]) -> str:
    """The key (or ``--flag``) an unknown-option message names, in full."""
    group, option, alone, flag = groups
    if flag:
        return flag.split("=")[0]
    return ".".join(filter(None, (group or ".".join(keys), option or alone)))


def _closest(key: str, known: list[str]) -> list[str]:
    """The known keys ``key`` abbreviates (up to three), else the one closest to it."""
    return [k for k in known if k.startswith(key) and k != key][:3] or difflib.get_close_matches(key, known, 1)


def _holds(given: Any, parts: list[str]) -> bool:
    for part in parts:
        if not isinstance(given, Mapping) or part not in given:
            return False
        given = given[part]
    return True


_ABSENT = object()


def misread_keys(given: Mapping, parsed: Any, defaults: Any = None, prefix: str = "") -> list[tuple[str, Any]]:
    """(key, value) of what ``given`` (a config as written) says that the parser did not read as written:
    a misspelt key holding an empty mapping (``wieghts: {}``, read as nothing at all), and a number or a
    list where ``defaults`` (the parser's) has a group (``lr: 0.1``, which failed later with a TypeError
    naming no key). Tell them apart with :func:`misread_line`."""
    out = []
    for name, value in given.items():
        inner, default, key = _child(parsed, name), _child(defaults, name), f"{prefix}{name}"
        if inner is _ABSENT:
            out += [(key, value)] if value == {} else []
        elif isinstance(value, Mapping):
            out += misread_keys(value, inner, default, f"{key}.")
        elif isinstance(value, list):
            out += _misread_in_list(value, inner, key)
        elif hasattr(default, "as_dict") and not isinstance(value, str):  # a group: a mapping or a file
            out.append((key, value))
    return out


def _misread_in_list(given: list, parsed: Any, key: str) -> list[tuple[str, Any]]:
    """:func:`misread_keys` of each mapping of a list (``phases: [...]``)."""
    items = zip(given, parsed) if isinstance(parsed, (list, tuple)) else ()
    return [k for i, (v, p) in enumerate(items) if isinstance(v, Mapping)
            for k in misread_keys(v, p, None, f"{key}[{i}].")]


def misread_line(key: str, value: Any, known: Iterable[str] = (), files: Iterable[tuple[str, Mapping]] = ()) -> str:
    """The line for one of :func:`misread_keys`."""
    if value == {}:
        return unknown_key_line(key, known, files)
    where = next((f"{name}: " for name, given in files if _holds(given, key.split("."))), "")
    return f"{where}{key}: expected a mapping or a YAML file, got {value!r}"


def _child(node: Any, name: str) -> Any:
    if node is None or isinstance(node, Mapping):
        return (node or {}).get(name, _ABSENT)
    if isinstance(node, (str, list, tuple)):  # a value where the config has a group (an untyped section)
        return _ABSENT
    if hasattr(node, "__contains__") and hasattr(node, "__getitem__"):  # jsonargparse's Namespace
        return node[name] if name in node else _ABSENT
    return getattr(node, name, _ABSENT)
