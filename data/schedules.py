"""Step-pure schedules: mixture weights, sequence length and learning rate as functions of the step.

The ``data.schedule:`` block drives the mixture and the sequence length; the number of steps follows from
its token budget with the warmup's shorter sequences counted, and ``anneal_start`` is where the anneal
phase begins. The learning rate is the module's (``model.lr``, :class:`LRConfig`), built on those step
counts: its decay starts at the anneal start unless ``model.lr.decay_start`` says otherwise::

    schedule = ScheduleConfig.from_dict(yaml.safe_load(text)["schedule"]).build()
    schedule.total_steps, schedule.anneal_step     # 38_929 and 35_036 for the 350M/20B default
    schedule.mixture_weights(step)                 # {"web": 0.62, "code": 0.18, ...}
    schedule.max_seq_len(step)
    lr = LRConfig(shape="cosine").build(schedule.total_steps, schedule.anneal_step); lr(step)

Every method is a pure function of the global optimizer step (not of micro-batches), so a resume
only passes the step in. Steps past the end behave like the last step, because a prefetching loader
may ask for one. Nothing here imports the data stream: the stream, the LR scheduler and the plan
all call into this module. Every invalid config raises :class:`ConfigError` naming its YAML key,
e.g. ``schedule.mixture.phases[1].weights: weights sum to 0.97, must sum to 1 (±1e-06)``.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jsonargparse import ArgumentParser
from jsonargparse.typing import register_type

from data.errors import ConfigError, misread_keys, misread_line, parser_error_line

WEIGHT_SUM_TOLERANCE = 1e-6
ANNEAL = "anneal"  # a phase start that means "at schedule.anneal_start"


class Count(int):
    """The type of a count of tokens or steps in a config: a plain ``int`` that may be written as a whole
    number in float notation (``train_tokens: 2e9``, ``--data.schedule.train_tokens 3.6e3``); a fraction
    (``2.5e0``) is refused naming the key. The parser reads it with :func:`whole_number`; the value is an
    ``int``, never a Count."""


def whole_number(value: Any) -> int:
    """``value`` (an int, a float with no fraction, or either as text) as an int; ValueError otherwise."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return int(value)
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"expected a whole number, got {value!r}")


register_type(Count, serializer=int, deserializer=whole_number, type_check=lambda value, _: type(value) is int)


@dataclass(frozen=True, kw_only=True)
class SeqLenConfig:
    """Sequence-length warmup (``schedule.seq_len``)."""

    start: int = 512
    """Tokens per sequence at step 0."""
    end: int = 2048
    """Tokens per sequence from ``warmup_steps`` on; at most the model's context."""
    warmup_steps: Count = 2000
    """Steps of the linear warmup from ``start`` to ``end``; 0 trains at ``end`` throughout."""
    multiple: int = 64
    """Warmup lengths are rounded down to a multiple of this (fewer shapes for torch.compile)."""


LR_SHAPES = ("wsd", "cosine", "linear")


@dataclass(frozen=True, kw_only=True)
class LRConfig:
    """The learning-rate schedule (``model.lr``): a linear warmup to ``peak``, ``peak`` until the decay
    start, then ``shape``'s decay to ``min`` at the last step. Built on the run's step counts by ``build``."""

    shape: str = "wsd"
    """wsd (warmup-stable-decay: linear decay from the anneal start), cosine or linear (a cosine or linear
    decay from the end of the warmup); ``decay_start`` moves the decay's start of any of them."""
    peak: float = 3.0e-3
    """Learning rate after the warmup and until the decay."""
    min: float = 0.0
    """Learning rate at the last step."""
    warmup_steps: Count = 2000
    """Steps of the linear warmup from ``peak / warmup_steps`` to ``peak``; 0 = no warmup."""
    decay_start: float | None = None
    """Fraction of the total steps where the decay starts; default: ``data.schedule.anneal_start`` for wsd,
    the end of the warmup for cosine and linear. 1 = no decay."""

    def build(self, total_steps: int, anneal_step: int) -> LRSchedule:
        """The LR of every optimizer step of a run of ``total_steps`` whose anneal starts at ``anneal_step``;
        ConfigError naming the ``model.lr`` key when the warmup or the decay do not fit."""
        out = [f"model.lr.{name}: {value} is negative; give 0 or more"
               for name, value in (("warmup_steps", self.warmup_steps), ("min", self.min)) if value < 0]
        if self.shape not in LR_SHAPES:
            out.append(f"model.lr.shape: {self.shape!r} is not one of {', '.join(LR_SHAPES)}")
        if not self.peak > 0:
            out.append(f"model.lr.peak: {self.peak} must be positive")
        if self.min > self.peak:
            out.append(f"model.lr.min: {self.min} is above model.lr.peak ({self.peak}); the LR decays to min")
        if self.decay_start is not None and not 0 <= self.decay_start <= 1:
            out.append(f"model.lr.decay_start: {self.decay_start} must be a fraction of the run in [0, 1]")
        _raise(out)
        if self.decay_start is not None:
            decay, key = round(self.decay_start * total_steps), "model.lr.decay_start"
        elif self.shape == "wsd":
            decay, key = anneal_step, "data.schedule.anneal_start"
        else:
            decay, key = self.warmup_steps, "model.lr.warmup_steps"
        if total_steps <= self.warmup_steps:
            raise ConfigError(f"model.lr.warmup_steps: {self.warmup_steps} is not below the "
                              f"{total_steps} total steps of data.schedule.train_tokens")
        if decay < total_steps and decay > total_steps - 2:
            raise ConfigError(f"{key}: the LR decay from step {decay} is under 2 of the {total_steps} steps of "
                              "data.schedule.train_tokens; raise the budget or start the decay earlier")
        if self.warmup_steps > decay:
            raise ConfigError(f"model.lr.warmup_steps: {self.warmup_steps} reaches into the LR decay, "
                              f"which starts at step {decay} ({key})")
        return LRSchedule(self, total_steps, min(decay, total_steps))


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate as a pure function of the optimizer step: ``lr(step)`` (built by ``LRConfig.build``)."""

    config: LRConfig
    total_steps: int
    decay_start: int
    """The decay's first step (``total_steps``: no decay)."""

    def __call__(self, step: int) -> float:
        """``peak * (step + 1) / warmup``, ``peak`` until ``decay_start``, then the shape's decay from ``peak``
        to exactly ``min`` at step ``total_steps - 1``."""
        lr, step = self.config, min(_check_step(step), self.total_steps - 1)
        if step < lr.warmup_steps:
            return lr.peak * (step + 1) / lr.warmup_steps
        if step < self.decay_start:
            return lr.peak
        if step == self.total_steps - 1:
            return lr.min
        fraction = (step - self.decay_start) / (self.total_steps - 1 - self.decay_start)
        if lr.shape == "cosine":
            return lr.min + (lr.peak - lr.min) * 0.5 * (1 + math.cos(math.pi * fraction))
        return lr.peak + (lr.min - lr.peak) * fraction


@dataclass(frozen=True, kw_only=True)
class PhaseConfig:
    """One phase of a scheduled mixture (``schedule.mixture.phases[i]``)."""

    name: str
    """Unique phase name, used in plans, plots and per-phase token counts."""
    weights: dict[str, float]
    """Token share per source; non-negative, summing to 1."""
    start: float | str = 0.0
    """First step as a fraction of total steps in [0, 1), or ``anneal`` (= ``anneal_start``)."""


@dataclass(frozen=True, kw_only=True)
class MixtureConfig:
    """Source mixture (``schedule.mixture``): exactly one of ``phases``, ``weights``, ``fixed_equivalent_of``."""

    phases: tuple[PhaseConfig, ...] = ()
    """Scheduled phases; the first starts at step 0, starts strictly increase."""
    ramp_steps: Count = 0
    """Steps of linear interpolation after each phase boundary (0 = step change); phases only."""
    weights: dict[str, float] | None = None
    """A fixed mixture for the whole run."""
    fixed_equivalent_of: MixtureConfig | None = None
    """A phases mixture whose token-weighted average over the run becomes a fixed mixture, so a
    scheduled-vs-fixed ablation draws the same tokens per source in both arms."""

    def validate(self, key: str, anneal_start: float) -> None:
        """Checks the form, the weights and the phase starts; raises ConfigError naming the key."""
        _raise(self.problems(key, anneal_start))

    def problems(self, key: str, anneal_start: float) -> list[str]:
        """Every independent problem of the form, the weights and the phase starts, each naming its key."""
        forms = [name for name in ("phases", "weights", "fixed_equivalent_of") if getattr(self, name)]
        if len(forms) != 1:
            return [f"{key}: give exactly one of phases, weights, fixed_equivalent_of (got {forms})"]
        out = []
        if self.ramp_steps < 0:
            out.append(f"{key}.ramp_steps: {self.ramp_steps} is negative; give 0 (a step change) or more")
        if self.ramp_steps and not self.phases:
            out.append(f"{key}.ramp_steps: only a phases mixture has ramps; remove it")
        if self.weights is not None:
            out += _weight_problems(self.weights, f"{key}.weights")
        if self.fixed_equivalent_of is not None:
            if not self.fixed_equivalent_of.phases:
                out.append(f"{key}.fixed_equivalent_of: must be a phases mixture")
            else:
                out += self.fixed_equivalent_of.problems(f"{key}.fixed_equivalent_of", anneal_start)
        return out + self._phase_problems(f"{key}.phases", anneal_start)

    def _phase_problems(self, key: str, anneal_start: float) -> list[str]:
        out: list[str] = []
        names = [p.name for p in self.phases]
        if len(set(names)) != len(names):
            out.append(f"{key}: phase names must be unique, got {names}; rename the repeated ones")
        previous = -1.0
        for i, phase in enumerate(self.phases):
            out += _weight_problems(phase.weights, f"{key}[{i}].weights")
            if set(phase.weights) != set(self.phases[0].weights):
                out.append(
                    f"{key}[{i}].weights: names sources {sorted(phase.weights)}, but {key}[0] names "
                    f"{sorted(self.phases[0].weights)}; every phase must name the same sources (0 is allowed)")
            problem, previous = _start_problem(phase, f"{key}[{i}].start", i, anneal_start, previous)
            if problem:
                out.append(problem)
                if i:  # a later start is not judged against a start that is wrong
                    return out
        return out


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """The ``schedule:`` block: token budget, batch, sequence-length warmup and mixture."""

    mixture: MixtureConfig
    """Source mixture, fixed or by phases."""
    train_tokens: Count = 20_000_000_000
    """Token budget; total steps are the fewest whose tokens reach it."""
    global_batch_size: int = 256
    """Sequences per optimizer step, summed over all ranks and micro-batches."""
    seq_len: SeqLenConfig = field(default_factory=SeqLenConfig)
    """Sequence-length warmup."""
    anneal_start: float = 0.9
    """Fraction of total steps where the anneal phase (a phase starting at 'anneal') and, by default, the
    LR decay (``model.lr``) start; 1 = neither."""

    # No validation in __post_init__: jsonargparse instantiates this dataclass while it parses
    # ``data.schedule``, where an exception is not one line naming the key. DataConfig.validate (the one
    # place a run's config is checked, all problems at once) and ``build`` call ``problems``.

    @classmethod
    def from_dict(cls, d: Any, key: str = "schedule") -> ScheduleConfig:
        """Parses the mapping under ``schedule:`` with jsonargparse, as ``train fit`` parses ``data.schedule``:
        the same types, numbers given as text read, a YAML file path accepted for ``mixture`` and
        ``fixed_equivalent_of`` (relative to the working directory). ``problems`` checks relations between fields.

        Raises:
            ConfigError: one line naming the key under ``key``, on an unknown or missing key or a wrong type.
        """
        if not isinstance(d, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {d!r}")
        given = {key.rpartition(".")[2]: dict(d)}
        for outer in reversed(key.split(".")[:-1]):  # data.schedule: {"data": {"schedule": d}}
            given = {outer: given}
        parser = _parser(cls, key)
        try:
            parsed = parser.parse_object(given)
        except Exception as e:  # jsonargparse's ArgumentError
            raise ConfigError(parser_error_line(str(e), parser.get_defaults().keys())) from None
        defaults = parser.get_defaults()
        for bad, value in misread_keys(given, parsed, defaults):
            raise ConfigError(misread_line(bad, value, defaults.keys()))
        return functools.reduce(getattr, key.split("."), parser.instantiate(parsed))

    def validate(self) -> None:
        """Checks every relation that does not need the total steps; ``build`` checks the rest."""
        _raise(self.problems())

    def problems(self) -> list[str]:
        """Every independent problem that does not need the total steps, each ``key: problem; what to do``."""
        seq = self.seq_len
        out = [f"schedule.{name}: {value} must be positive"
               for name, value in (("train_tokens", self.train_tokens), ("global_batch_size", self.global_batch_size),
                                   ("seq_len.multiple", seq.multiple), ("seq_len.start", seq.start)) if value <= 0]
        if seq.warmup_steps < 0:
            out.append(f"schedule.seq_len.warmup_steps: {seq.warmup_steps} is negative; give 0 or more")
        out += _seq_len_problems(seq)
        if not 0 < self.anneal_start <= 1:
            out.append(f"schedule.anneal_start: {self.anneal_start} must be in (0, 1]: the fraction of the run "
                       "where the anneal (and by default the LR decay) starts (e.g. 0.9; 1 = none)")
            return out + self.mixture.problems("schedule.mixture", 0.9)  # the phases' own problems still count
        return out + self.mixture.problems("schedule.mixture", self.anneal_start)

    def build(self) -> Schedule:
        """Returns the Schedule; raises ConfigError when the budget does not fit the warmups."""
        return Schedule.from_config(self)


@dataclass(frozen=True, eq=False)
class Schedule:
    """Mixture weights and sequence length as pure functions of the optimizer step.

    Build it with ``ScheduleConfig.build()``. ``phase_weights[i]`` holds phase i's weights in
    ``sources`` order, normalized to sum to 1 exactly (the config allows 1e-6 of slack).
    """

    config: ScheduleConfig
    sources: list[str]
    total_steps: int
    total_tokens: int
    anneal_step: int
    """``anneal_start`` as a step: where a phase starting at 'anneal' begins, and by default the LR decay."""
    phase_boundaries: list[tuple[str, int]]
    phase_weights: np.ndarray

    @classmethod
    def from_config(cls, config: ScheduleConfig, mixture_key: str = "schedule.mixture") -> Schedule:
        """Computes the step counts and resolves the mixture; ``mixture_key`` names it in errors."""
        config.validate()
        total_steps, total_tokens = _step_counts(config)
        anneal_step = round(config.anneal_start * total_steps)
        mixture, phases = config.mixture, _phases(config, mixture_key)
        boundaries = [anneal_step if p.start == ANNEAL else round(p.start * total_steps) for p in phases]
        for i, (first, stop) in enumerate(zip(boundaries, boundaries[1:] + [total_steps])):
            ramp = mixture.ramp_steps if i else 0
            if stop < first + ramp + 1:
                raise ConfigError(
                    f"{mixture_key}.phases[{i}].start: phase {phases[i].name!r} spans steps [{first}, {stop}) "
                    f"of {total_steps}, too few for itself and its {ramp} {mixture_key}.ramp_steps")
        sources = list(phases[0].weights)
        matrix = np.array([[p.weights[s] for s in sources] for p in phases], dtype=np.float64)
        matrix /= matrix.sum(axis=1, keepdims=True)
        matrix.flags.writeable = False
        return cls(config=config, sources=sources, total_steps=total_steps, total_tokens=total_tokens,
                   anneal_step=anneal_step, phase_weights=matrix,
                   phase_boundaries=[(p.name, b) for p, b in zip(phases, boundaries)])

    def max_seq_len(self, step: int) -> int:
        """Tokens per sequence at ``step``: the warmup line rounded down to ``multiple``, then ``end``."""
        seq = self.config.seq_len
        if _check_step(step) >= seq.warmup_steps:
            return seq.end
        line = seq.start + (seq.end - seq.start) * step // seq.warmup_steps
        return max(seq.start, line // seq.multiple * seq.multiple)

    def tokens_at(self, step: int) -> int:
        """Tokens trained at ``step`` over all ranks: global batch size times the sequence length."""
        return self.config.global_batch_size * self.max_seq_len(step)

    def mixture_weights(self, step: int) -> dict[str, float]:
        """Token share per source at ``step``; non-negative and summing to 1, ramps included."""
        return dict(zip(self.sources, self._weights_array(step).tolist()))

    def _weights_array(self, step: int) -> np.ndarray:
        starts = [first for _, first in self.phase_boundaries]
        i = bisect.bisect_right(starts, _check_step(step)) - 1
        ramp = self.config.mixture.ramp_steps
        if i == 0 or step >= starts[i] + ramp:
            return self.phase_weights[i]
        t = (step - starts[i] + 1) / (ramp + 1)  # in (0, 1): never either phase's weights exactly
        return (1 - t) * self.phase_weights[i - 1] + t * self.phase_weights[i]

    def _tokens_by_phase(self) -> np.ndarray:
        """Tokens per (phase, source), summed exactly over constant-length, linear-weight pieces."""
        starts = [first for _, first in self.phase_boundaries]
        ramp = self.config.mixture.ramp_steps
        cuts = {first for first, _ in _seq_len_segments(self.config.seq_len) if first < self.total_steps}
        cuts |= set(starts) | {s + ramp for s in starts[1:]} | {self.total_steps}
        cuts = sorted(cuts)
        out = np.zeros_like(self.phase_weights)
        for a, stop in zip(cuts, cuts[1:]):
            i, n = bisect.bisect_right(starts, a) - 1, stop - a
            if i == 0 or a >= starts[i] + ramp:
                weight_sums = n * self.phase_weights[i]
            else:  # sum over the piece of t = (s - start + 1) / (ramp + 1), linear in s
                t_sum = (n * (a - starts[i] + 1) + n * (n - 1) / 2) / (ramp + 1)
                weight_sums = (n - t_sum) * self.phase_weights[i - 1] + t_sum * self.phase_weights[i]
            out[i] += self.tokens_at(a) * weight_sums
        return out


def fixed_schedule(weights: Mapping[str, float], seq_len: int, global_batch_size: int = 1,
                   steps: int = 1_000_000) -> ScheduleConfig:
    """A fixed mixture at one sequence length for ``steps`` steps, no anneal (and so, with ``model.lr``'s
    ``warmup_steps: 0``, the LR at its peak throughout): the schedule of benchmarks and tests that need no
    schedule shape."""
    return ScheduleConfig(
        mixture=MixtureConfig(weights=dict(weights)),
        train_tokens=steps * global_batch_size * seq_len,
        global_batch_size=global_batch_size,
        seq_len=SeqLenConfig(start=seq_len, end=seq_len, warmup_steps=0, multiple=1),
        anneal_start=1.0,
    )


def build_schedule(d: ScheduleConfig | Mapping[str, Any], sources: list[str] | None = None) -> Schedule:
    """Parses the ``schedule:`` dict, builds the Schedule and, given the corpus ``sources``, checks them.

    Raises:
        ConfigError: on any invalid config, or a schedule whose sources differ from ``sources``.
    """
    if isinstance(d, ScheduleConfig):
        config = d
    else:  # a mapping from YAML, or jsonargparse's Namespace before instantiation
        config = ScheduleConfig.from_dict(d.as_dict() if hasattr(d, "as_dict") else d)
    schedule = config.build()
    if sources is not None:
        validate_sources(schedule, sources)
    return schedule


def fixed_equivalent_weights(schedule: Schedule) -> dict[str, float]:
    """Fixed weights drawing the same tokens per source as ``schedule`` over the same budget.

    The token-weighted average of ``mixture_weights`` over all steps, sum_s w(s) tokens(s) /
    sum_s tokens(s), computed exactly from a handful of piecewise sums.
    """
    return {s: t / schedule.total_tokens for s, t in tokens_per_source(schedule).items()}


def tokens_per_source(schedule: Schedule) -> dict[str, float]:
    """Tokens drawn from each source over the whole run."""
    return dict(zip(schedule.sources, schedule._tokens_by_phase().sum(axis=0).tolist()))


def tokens_per_phase(schedule: Schedule) -> dict[str, dict[str, float]]:
    """Tokens drawn from each source in each phase (a ramp counts toward the phase it leads into)."""
    by_phase = schedule._tokens_by_phase()
    return {name: dict(zip(schedule.sources, row.tolist()))
            for (name, _), row in zip(schedule.phase_boundaries, by_phase)}


def validate_sources(schedule: Schedule, corpus_sources: list[str]) -> None:
    """Raises ConfigError when the schedule names a source the corpus lacks or misses one it has."""
    mixture = schedule.config.mixture
    key = ("schedule.mixture.weights" if mixture.weights is not None else
           "schedule.mixture.fixed_equivalent_of.phases[*].weights" if mixture.fixed_equivalent_of
           else "schedule.mixture.phases[*].weights")
    for source in schedule.sources:
        if source not in corpus_sources:
            raise ConfigError(f"{key}: source {source!r} is not in the corpus (it has {sorted(corpus_sources)})")
    for source in corpus_sources:
        if source not in schedule.sources:
            raise ConfigError(f"{key}: corpus source {source!r} is missing; give it weight 0 to leave it out")


def validate_model_context(schedule: Schedule, max_seq_len: int) -> None:
    """Raises ConfigError when the final sequence length exceeds the model's context."""
    if schedule.config.seq_len.end > max_seq_len:
        raise ConfigError(f"schedule.seq_len.end: {schedule.config.seq_len.end} exceeds the model's "
                          f"context of {max_seq_len} tokens (max_seq_len)")


def _seq_len_segments(seq: SeqLenConfig) -> list[tuple[int, int]]:
    """``(first step, length)`` where each warmup length begins, ending with ``(warmup_steps, end)``.

    ``max_seq_len(step) >= v`` exactly when ``step >= ceil((v - start) * warmup_steps / (end - start))``.
    A length skipped because the line crosses several multiples in one step shares its first step
    with the next length, so its run is empty and adds nothing to any sum.
    """
    if seq.warmup_steps == 0:
        return [(0, seq.end)]
    span, segments = seq.end - seq.start, [(0, seq.start)]
    for length in range(seq.start + seq.multiple, seq.end, seq.multiple):
        first = -(-(length - seq.start) * seq.warmup_steps // span)
        if first >= seq.warmup_steps:
            break
        segments.append((first, length))
    return segments + [(seq.warmup_steps, seq.end)]


def _phases(config: ScheduleConfig, mixture_key: str) -> list[PhaseConfig]:
    """The mixture as phases: a fixed mixture (given, or the fixed equivalent of a schedule) is one."""
    mixture = config.mixture
    if mixture.fixed_equivalent_of is not None:
        inner = dataclasses.replace(config, mixture=mixture.fixed_equivalent_of)
        weights = fixed_equivalent_weights(Schedule.from_config(inner, f"{mixture_key}.fixed_equivalent_of"))
        return [PhaseConfig(name="fixed", weights=weights)]
    if mixture.weights is not None:
        return [PhaseConfig(name="fixed", weights=mixture.weights)]
    return list(mixture.phases)


def _step_counts(config: ScheduleConfig) -> tuple[int, int]:
    """(total steps, total tokens) of the budget, the warmup's shorter sequences counted; a budget that does
    not fit the sequence-length warmup raises ConfigError."""
    seq, batch = config.seq_len, config.global_batch_size
    if config.train_tokens < batch * seq.start:
        raise ConfigError(f"schedule.train_tokens: {config.train_tokens} tokens is below one batch "
                          f"(schedule.global_batch_size x seq_len.start = {batch * seq.start}); raise the budget")
    segments = _seq_len_segments(seq)
    warm_tokens = sum(batch * length * (stop - first) for (first, length), (stop, _) in zip(segments, segments[1:]))
    if warm_tokens >= config.train_tokens:
        raise ConfigError(f"schedule.train_tokens: {config.train_tokens} tokens end within the "
                          f"{seq.warmup_steps} steps of schedule.seq_len.warmup_steps")
    after = -(-(config.train_tokens - warm_tokens) // (batch * seq.end))
    return seq.warmup_steps + after, warm_tokens + after * batch * seq.end


def _start_problem(phase: PhaseConfig, key: str, i: int, anneal_start: float,
                   previous: float) -> tuple[str | None, float]:
    """Phase ``i``'s start against the anneal and the previous start; and the start (a fraction) it sets."""
    if i == 0:
        return (None, 0.0) if phase.start == 0 else (f"{key}: the first phase starts at step 0; omit start", previous)
    fraction = anneal_start if phase.start == ANNEAL else phase.start
    if phase.start == ANNEAL and anneal_start >= 1:
        return f"{key}: 'anneal' needs schedule.anneal_start < 1 (got {anneal_start})", previous
    if not 0 <= fraction < 1:
        return f"{key}: {phase.start!r} must be a fraction in [0, 1) or 'anneal'", previous
    if fraction <= previous:
        return f"{key}: {phase.start!r} must come after the previous phase's start", previous
    return None, fraction


def _seq_len_problems(seq: SeqLenConfig) -> list[str]:
    """The warmup's lengths against ``multiple`` and each other."""
    out = [f"schedule.seq_len.{name}: {value} is not a multiple of schedule.seq_len.multiple ({seq.multiple}); "
           "round it" for name, value in (("start", seq.start), ("end", seq.end))
           if seq.multiple > 0 and value % seq.multiple]
    if seq.start > seq.end:
        out.append(f"schedule.seq_len.start: {seq.start} is above schedule.seq_len.end ({seq.end}); "
                   "the warmup goes from start up to end")
    return out


def _check_step(step: int) -> int:
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    return step


@functools.cache
def _parser(config_class: type, key: str) -> Any:
    """A parser of one ``--KEY`` argument of ``config_class``, built once per class and key."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument(f"--{key}", type=config_class, sub_configs=True)  # sub_configs: FILE.yaml values
    return parser


def _weight_problems(weights: dict[str, float], key: str) -> list[str]:
    if not weights:
        return [f"{key}: names no source; give every source a weight"]
    out = [f"{key}.{source}: weight {w} is negative; weights are token shares (0 leaves a source out)"
           for source, w in weights.items() if not w >= 0]
    total = sum(weights.values())
    if not out and abs(total - 1) > WEIGHT_SUM_TOLERANCE:
        out.append(f"{key}: weights sum to {total:.6g}, must sum to 1 (±{WEIGHT_SUM_TOLERANCE:g}); "
                   "rescale them")
    return out


def _raise(problems: list[str]) -> None:
    """One ConfigError for all of them, one problem per line (the CLI prints each as an ``error:`` line)."""
    if problems:
        raise ConfigError("\n".join(problems))
