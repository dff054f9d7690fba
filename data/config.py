"""The data config: which parquet files make up each mixture source, and how to stream them.

A run's YAML has a ``data:`` section with these keys (``configs/demo.yaml`` is the worked example)::

    data:
      sources:                       # mixture source -> files (and an optional row filter)
        web:     {paths: ["demo_corpus/web/*.parquet"]}
        curated: {paths: ["dolma3/*.parquet"], filter: {column: source, values: ["finemath*", "rpj*arxiv*"],
                                                          optional: ["dolma1_7*wiki*"]}}
      schedule:                      # token budget, sequence lengths, LR and mixture (data/schedules.py)
        mixture: {weights: {web: 0.62, code: 0.18, books: 0.12, curated: 0.08}}   # fixed (or `phases:`)
        seq_len: {start: 512, end: 2048, warmup_steps: 2000}
      seed: 1234
      batch_size: 8                  # sequences per rank per step (micro-batch)

A filter's ``values`` must each match some value in the source's files; ``optional`` patterns may match
nothing (alternative spellings of one sub-source). Values no source claims are refused above
``unclaimed`` (a share of the tokens, default 0.001) and warned about below it (data/mapping.py).

Parsing goes through jsonargparse, so unknown keys and wrong types are refused with the key named, and a key
given twice in one YAML file with the file and both lines (:func:`load_yaml`, the loader every parse uses);
relations between fields are checked in :meth:`DataConfig.validate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser, get_loader, set_loader
from jsonargparse._util import config_load_stack  # the file being read (train/lightning_internals.py lists it)

from data.errors import ConfigError, misread_keys, misread_line, parser_error_line
from data.schedules import Count, LRConfig, ScheduleConfig, validate_sources
from data.tokenizer import TokenizerConfig

SCHEMA = {"source": "string", "date": "string", "text": "string", "token_count": "int64", "category": "string"}
"""Dolma3 columns every shard must have, with their Arrow types (large_string also accepted): the one place
the schema is written (the manifest checks it, the corpus tools write it; tests/unit/test_one_place.py)."""


def arrow_schema():
    """:data:`SCHEMA` as a ``pyarrow.Schema``, in its column order: what the corpus tools write."""
    import pyarrow as pa  # here: reading the config needs no pyarrow

    return pa.schema([(name, pa.type_for_alias(kind)) for name, kind in SCHEMA.items()])


@dataclass
class FilterConfig:
    """Keep only the rows whose ``column`` matches one of ``values`` (fnmatch patterns, e.g. ``arxiv*``)."""

    column: Literal["source", "category"]
    """Column to filter on: Dolma3's ``source`` (sub-source) or ``category``."""
    values: list[str]
    """Patterns; each must match at least one value in the files, or start-up fails naming it."""
    optional: list[str] = dataclasses.field(default_factory=list)
    """Patterns that also select rows but may match nothing (a sub-source a download may lack); the
    start-up mapping report still lists what each one matched."""

    @property
    def patterns(self) -> list[str]:
        """Every pattern that selects rows: the required ones, then the optional ones."""
        return [*self.values, *self.optional]


@dataclass
class SourceConfig:
    """One mixture source: a set of parquet files, optionally a filter on its rows."""

    paths: list[str]
    """Glob patterns of parquet files (relative to the working directory, ``~`` expanded)."""
    filter: Optional[FilterConfig] = None
    """Row filter for corpora whose files mix sources (e.g. dolma3_300B_sample_shuffled)."""

    def files(self) -> list[str]:
        out: list[str] = []
        for pattern in self.paths:
            pattern = os.path.expandvars(str(Path(pattern).expanduser()))
            out.extend(sorted(glob.glob(pattern, recursive=True)))
        return sorted(dict.fromkeys(out))


def unset_variables(patterns: list[str]) -> list[str]:
    """Environment variables the patterns name (``$VAR`` / ``${VAR}``) that are not set: ``os.path.expandvars``
    leaves them as literal text, so the glob matches nothing and the error would show only the pattern."""
    names = [m.group(1) or m.group(2) for p in patterns for m in re.finditer(r"\$(?:(\w+)|\{(\w+)\})", p)]
    return sorted({n for n in names if n not in os.environ})


def no_match_reason(paths: list[str]) -> str:
    """Why a source's globs matched no file, for the start-up error."""
    unset = unset_variables(paths)
    if unset:
        return (f"environment variable {', '.join('$' + n for n in unset)} is not set "
                f"(export {unset[0]}=/path/to/the/corpus; docs/data-download.md)")
    return "no file matches"


@dataclass
class DataConfig:
    """Everything the data path needs; every permutation is a function of ``seed`` only."""

    sources: dict[str, SourceConfig]
    """Mixture sources, in the order they are reported and indexed (source id = position)."""
    schedule: ScheduleConfig
    """Token budget, sequence lengths, LR and mixture (fixed: mixture.weights) as step-pure schedules."""
    seed: int = 1234
    """Global seed: shard permutations per (seed, source, epoch); local RNGs per (seed, consumer)."""
    batch_size: int = 8
    """Sequences per rank per optimizer step (the micro-batch)."""
    open_shards: int = 8
    """k: chunks each consumer reads at once, interleaved at random (level 2 of the shuffle)."""
    buffer_size: int = 10_000
    """B: documents in each consumer's per-source shuffle buffer."""
    min_chunks_per_source: int = 64
    """Row groups are split into row ranges until a source has at least this many chunks, so a
    small source (say 2 clustered shards) still spreads over many consumers and buffers."""
    selector: Literal["deficit", "random"] = "deficit"
    """How the mixer picks the next document's source: furthest below its token target, or i.i.d."""
    commit: Literal["sequence", "document"] = "sequence"
    """What one choice of the mixer commits: at most one sequence of a document, the rest handed back
    to its source in order (bounded, the default), or the whole document (the older rule, which lets a
    book pin a batch row for hundreds of steps; kept for benchmarks)."""
    num_workers: int = 2
    """DataLoader workers per rank; each worker is one consumer of the global order."""
    replicate: int = 0
    """A decay branch's replicate (ablations/branch.py): when it differs from the resumed checkpoint's, every
    consumer's pending work is drawn in another order, re-seeded from (seed, replicate) (data/elastic.py
    ``reseed``); 0 continues the checkpoint's own order. Layout, tokens per source and exactly-once unchanged."""
    text_column: str = "text"
    """Column holding the document text that is tokenized."""
    id_column: Optional[str] = None
    """Column holding a document ID (Dolma3 has none: IDs are then ``<shard stem>:<row>``)."""
    on_bad_shard: Literal["error", "skip"] = "error"
    """A corrupt/unreadable/wrong-schema file stops the run (default), or is logged and skipped."""
    manifest_cache: Optional[str] = None
    """Directory for the cached manifest (default: $WELLMIXED_CACHE or ~/.cache/wellmixed)."""
    val_tokens_per_source: Count = 0
    """Tokens per source held out for validation: whole chunks training never reads, chosen by a
    fixed seed-independent draw (so every seed and ablation arm has the same validation set)."""
    max_epochs: float = 4.0
    """Implied epochs per source above which start-up warns (or fails, with ``max_epochs_error``)."""
    max_epochs_error: bool = False
    """Fail at start-up (instead of warning) when a source would be repeated more than ``max_epochs``."""
    unclaimed: float = 0.001
    """Share of the tokens in the filtered sources' files whose filter-column value no mixture source
    claims (those rows are never read): above it start-up fails, below it warns (data/mapping.py)."""
    expected_tokens: Optional[dict[str, Count]] = None
    """Published tokens per source, for planning (scripts/plan.py) before the corpus is downloaded."""
    order_log: bool = False
    """Write per-step, per-rank document pieces (the order-dump format) into the run directory."""
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)
    """The tokenizer: ``{name: cl100k_base}`` (a tiktoken encoding, the default) or ``{path: tokenizer.json}``
    (Hugging Face); data/tokenizer.py."""
    tokenizer_threads: int = 1
    """Encoder threads per consumer; DataLoader workers already run one consumer per process."""

    def __post_init__(self) -> None:
        if isinstance(self.schedule, dict):  # built in Python from a plain mapping
            self.schedule = ScheduleConfig.from_dict(self.schedule)
        self.validate()

    @property
    def source_names(self) -> list[str]:
        return list(self.sources)

    def validate(self) -> None:
        """Every independent problem of the data config at once, one ``key: problem; what to do`` line each.

        The one place a run's data config is checked (the schedule included: ScheduleConfig does not
        validate itself while jsonargparse parses it), so ``train fit``, dump_order and the tests
        report the same lines.
        """
        out = _source_problems(self.sources)
        positive = ("batch_size", "open_shards", "buffer_size", "min_chunks_per_source")
        out += [f"data.{key}: {getattr(self, key)} must be >= 1" for key in positive if getattr(self, key) < 1]
        if not 0.0 <= self.unclaimed <= 1.0:
            out.append(f"data.unclaimed: {self.unclaimed} must be a share of tokens in [0, 1]")
        if self.num_workers < 0:
            out.append(f"data.num_workers: {self.num_workers} must be >= 0 (0 reads in the main process)")
        out += _schedule_problems(self.schedule, self.source_names)
        if out:
            raise ConfigError("\n".join(out))


def _source_problems(sources: dict[str, SourceConfig]) -> list[str]:
    """No source, or a source without globs or filter patterns."""
    out = [] if sources else ["data.sources: no sources configured; name at least one mixture source"]
    for name, src in sources.items():
        if not src.paths:
            out.append(f"data.sources.{name}.paths is empty: give at least one parquet glob")
        if src.filter is not None and not src.filter.patterns:
            out.append(f"data.sources.{name}.filter.values is empty: give patterns to keep")
    return out


def _schedule_problems(schedule: ScheduleConfig, sources: list[str]) -> list[str]:
    """The schedule's own problems, prefixed ``data.``; if there are none, the ones of its build
    (budget vs warmups) and of its sources against ``data.sources``."""
    out = [f"data.{p}" for p in schedule.problems()]
    if out:
        return out
    try:
        validate_sources(schedule.build(), sources)
    except ConfigError as e:
        out += [f"data.{p}" for p in str(e).splitlines()]
    return out


def check_weights(weights: dict[str, float], sources: list[str], key: str) -> None:
    """Weights are token shares: non-negative, summing to 1, one per configured source; one line per
    independent problem."""
    unknown = [s for s in weights if s not in sources]
    missing = [s for s in sources if s not in weights]
    out = _share_problems(weights, key)
    if unknown:  # with an unknown name, a misspelling is the likely cause of a missing one too
        out.insert(0, f"{key}: unknown source(s) {unknown}; the corpus has {sources}")
    elif missing:
        out.insert(0, f"{key}: no weight for source(s) {missing}; give every source a weight (0 is allowed)")
    if out:
        raise ConfigError("\n".join(out))


def _share_problems(weights: dict[str, float], key: str) -> list[str]:
    """Negative weights, or (none negative) weights that do not sum to 1."""
    negative = {s: w for s, w in weights.items() if w < 0}
    if negative:
        return [f"{key}: negative weight(s) {negative}; weights are token shares (0 leaves a source out)"]
    total = sum(weights.values())
    return [f"{key}: weights sum to {total:.6g}, must sum to 1; rescale them"] if abs(total - 1.0) > 1e-6 else []


REMOVED_KEYS = {
    "weights": "give the fixed mixture as data.schedule.mixture.weights",
    "seq_len": "give data.schedule.seq_len.start and data.schedule.seq_len.end (the same length in both, "
               "with warmup_steps 0, for one fixed length)",
    "schedule.lr": "the LR schedule is the module's: give it as model.lr (--model.lr.peak ...; the same fields, "
                   "plus shape and decay_start)",
}
"""``data:`` keys that no longer exist, and what replaces each."""


def removed_key_error(key: str) -> str:
    """The one line for a config that still sets a key of :data:`REMOVED_KEYS`."""
    return f"data.{key}: no longer a key; {REMOVED_KEYS[key]}"


def load_yaml(text: str) -> Any:
    """jsonargparse's YAML loader, refusing a key given twice in one mapping (PyYAML keeps the later one without
    a word: ``web:`` twice under ``sources`` trained one web file instead of seven). Registered for every parse:
    config files, stacked ``--config`` files, sub-configs (``mixture: FILE.yaml``, ``model: FILE``), values."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        root = None  # jsonargparse's loader says what is wrong
    stack = config_load_stack.get()
    where = stack[-1][0] if stack else "a value given on the command line or in the environment"  # absolute
    _refuse_duplicate_keys(root, where, "")
    return _jsonargparse_yaml(text)


_jsonargparse_yaml = get_loader("yaml")
set_loader("yaml", load_yaml, (yaml.YAMLError,))


def _refuse_duplicate_keys(node: Any, where: str, prefix: str) -> None:
    """ConfigError ``WHERE: KEY is given twice (lines A and B)`` for the first key a mapping under ``node`` repeats."""
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, where, f"{prefix}[{i}]")
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[tuple[str, str], int] = {}  # (tag, key) -> line: `1:` and `"1":` are two keys
    for key, value in node.value:
        name, line = f"{prefix}.{key.value}" if prefix else str(key.value), key.start_mark.line + 1
        if (key.tag, key.value) in seen:
            raise ConfigError(f"{where}: {name} is given twice (lines {seen[key.tag, key.value]} and {line}); "
                              "keep one (YAML would silently use the later)")
        seen[key.tag, key.value] = line
        _refuse_duplicate_keys(value, where, name)


RUN_SECTIONS = ("seed_everything", "trainer", "run", "ckpt_path", "weights_only")
"""The top-level keys of a run config besides ``data:`` and ``model:`` (a run's saved config.yaml and ``fit
--print_config`` hold them): a tool that reads only the data section accepts them unread."""

MODEL_KEYS = ("model", "optim", "compile", "on_nonfinite", "log_every_n_steps")
"""The ``model:`` keys besides ``lr`` (train/module.py's PretrainModule arguments), accepted unread; ``model.lr``
is parsed (the order dump writes the LR of each step)."""


def data_parser() -> ArgumentParser:
    """The ``data:`` part of ``python -m train fit``'s parser, without torch or Lightning: ``--config`` files
    stacked in order, the same DataConfig group added the same way (``--data.KEY V`` overrides, unknown keys
    and wrong types refused, a mixture given as a file read relative to the config that names it), fit's
    environment variables (``PL_FIT__DATA__SEED``, below the config files), and the other sections of a run
    config accepted unread (train/config.py builds the full parser)."""
    parser = ArgumentParser(prog="python -m train fit", exit_on_error=False, allow_abbrev=False,
                            env_prefix="PL_FIT_", default_env=True)
    parser.add_argument("-c", "--config", action=ActionConfigFile)
    parser.add_class_arguments(DataConfig, "data", fail_untyped=False, sub_configs=True)
    parser.add_class_arguments(LRConfig, "model.lr", sub_configs=True)
    for key in RUN_SECTIONS + tuple(f"model.{k}" for k in MODEL_KEYS):
        parser.add_argument(f"--{key}", type=Any, default=None)
    return parser


def resolve_data_config(argv: list[str]) -> DataConfig:
    """The :class:`DataConfig` that ``python -m train fit ARGV`` builds (``--config`` files, ``PL_FIT__DATA__*``,
    ``--data.*`` overrides), resolved without importing torch or Lightning; a bad key or value is a ConfigError."""
    return resolve_sections(argv).data


def resolve_sections(argv: list[str]) -> Any:
    """What :func:`resolve_data_config` resolves, as the namespace of ``data`` (a DataConfig) and ``model.lr``
    (an LRConfig)."""
    parser, args = data_parser(), [a for a in argv if a != "fit"]
    return _instantiated(parser, lambda: parser.parse_args(args), config_files(args))


def parse_data_config(section: dict[str, Any], origin: str = "config") -> DataConfig:
    """Build a DataConfig from the ``data:`` mapping, refusing unknown keys and wrong types (the environment
    is not read: the mapping is a resolved or saved config)."""
    try:
        parser = data_parser()
        return _instantiated(parser, lambda: parser.parse_object({"data": section}, env=False)).data
    except ConfigError as e:
        raise ConfigError(f"{origin}: {e}") from None


def _instantiated(parser: ArgumentParser, parse, files: list[tuple[str, dict]] = ()) -> Any:
    """The sections that ``parse()`` gives ``parser``, instantiated; a refusal is one ConfigError line in
    data/errors.py's wording (the one ``train fit`` gives), ``files`` naming the config file of an unknown key."""
    known = list(parser.get_defaults().keys())
    try:
        parsed = parse()
    except ArgumentError as e:
        hints = {f"data.{key}": removed_key_error(key) for key in REMOVED_KEYS}
        raise ConfigError(parser_error_line(str(e), known, files, hints)) from None
    refuse_misread(parsed, parser.get_defaults())
    return parser.instantiate(parsed)


def config_files(argv: list[str]) -> list[tuple[str, dict]]:
    """The ``--config`` files of a command line, read (name, contents), for naming the file of an unknown key."""
    names = [b for a, b in zip(argv, argv[1:]) if a in ("-c", "--config")]
    names += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    return [(name, _read_yaml(name)) for name in names]


def read_config_files(parsed: Any) -> list[tuple[str, dict]]:
    """(name as given, contents) of the ``--config`` files a parse read."""
    return [(str(getattr(p, "relative", p)), _read_yaml(str(getattr(p, "absolute", p))))
            for p in parsed.get("config") or []]


def refuse_misread(parsed: Any, defaults: Any) -> None:
    """What jsonargparse lets through in a ``--config`` file, refused naming the file: a misspelt key holding an
    empty mapping (``wieghts: {}``, read as nothing at all) and a number where a group goes (``lr: 0.1``)."""
    for name, given in read_config_files(parsed):
        for key, value in misread_keys(given, parsed, defaults):
            raise ConfigError(misread_line(key, value, parsed.keys(), [(name, given)]))


def _read_yaml(path: str) -> dict:
    """A config file's mapping ({} when it is something else: jsonargparse read it already and said so)."""
    try:
        given = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return given if isinstance(given, dict) else {}


class ToolParser(argparse.ArgumentParser):
    """A tool's own parser, remembering which of its flags take a value (for :func:`split_tool_args`;
    argparse keeps its list of actions private)."""

    def __init__(self, *args, **kwargs):
        self.takes_value: dict[str, bool] = {}
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        self.takes_value.update({o: action.nargs != 0 for o in action.option_strings})
        return action


def split_tool_args(own: ToolParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """A tool's command line split into its own flags (``own``'s options, with their values) and the rest,
    for the configuration parser (``--config``, ``--data.*``, ...): a configuration flag keeps the word after it
    as its value, and a bare word no flag took is one of the tool's positional arguments. The tool then parses
    its own part with ``own.parse_args`` (an unknown flag is the configuration parser's to name, with a "did
    you mean")."""
    takes_value = own.takes_value
    mine, rest, tokens = [], [], list(argv)
    while tokens:
        token = tokens.pop(0)
        name = token.split("=", 1)[0]
        if name in takes_value:
            mine += _with_value(token, tokens, takes_value[name])
        elif token.startswith("-"):  # a configuration flag; its value (if any) follows it
            rest += _with_value(token, tokens, bool(tokens) and not tokens[0].startswith("--"))
        else:  # a bare word no flag took: one of the tool's positional arguments
            mine.append(token)
    return mine, rest


def _with_value(token: str, tokens: list[str], wanted: bool) -> list[str]:
    """``token`` and, when ``wanted`` and not written ``--flag=value``, the next word (taken off ``tokens``)."""
    return [token] + ([tokens.pop(0)] if wanted and "=" not in token and tokens else [])


def load_data_config(path: str | Path, overrides: Optional[dict[str, str]] = None) -> DataConfig:
    """The data section of the run config ``path`` (``--config PATH``), with ``data.KEY: value`` overrides;
    a refusal names the file."""
    if not Path(path).is_file():
        raise ConfigError(f"--config {path}: file not found")
    try:
        return resolve_data_config(["--config", str(path), *[a for k, v in (overrides or {}).items()
                                                             for a in (f"--data.{k}", str(v))]])
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def corpus_sources(corpus_dir: str | Path, names: Optional[list[str]] = None) -> dict[str, SourceConfig]:
    """Sources for the ``DIR/<source>/*.parquet`` layout (one folder per mixture source)."""
    root = Path(corpus_dir).expanduser()
    if not root.is_dir():
        raise ConfigError(f"--corpus {root}: not a directory")
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*.parquet")))
    if names is not None:
        missing = [n for n in names if n not in found]
        if missing:
            raise ConfigError(
                f"--corpus {root}: no parquet files for source(s) {missing} (expected {root}/<source>/*.parquet)"
            )
        found = list(names)
    if not found:
        raise ConfigError(f"--corpus {root}: no <source>/*.parquet folders found")
    return {name: SourceConfig(paths=[str(root / name / "*.parquet")]) for name in found}
