"""data/schedules.py and data/plan.py: step-pure schedules, token accounting, validation, plan output.

Reference values are recomputed here from the definitions, step by step, with no shortcut shared
with the code under test (closed forms and piecewise sums there, plain loops here).
"""

from __future__ import annotations

import copy
import math
import re
from fractions import Fraction

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from data.errors import ConfigError
from data.plan import check_epochs, implied_epochs, plan_table, plot_schedule
from data.schedules import (
    LR_SHAPES,
    LRConfig,
    Schedule,
    ScheduleConfig,
    build_schedule,
    fixed_equivalent_weights,
    tokens_per_phase,
    tokens_per_source,
    validate_model_context,
    validate_sources,
)

DEFAULT_YAML = """
schedule:
  train_tokens: 20_000_000_000
  global_batch_size: 256
  seq_len: {start: 512, end: 2048, warmup_steps: 2000, multiple: 64}
  anneal_start: 0.9
  mixture:
    ramp_steps: 0
    phases:
      - {name: stable, weights: {web: 0.62, code: 0.18, books: 0.12, curated: 0.08}}
      - {name: anneal, start: anneal, weights: {web: 0.35, code: 0.20, books: 0.10, curated: 0.35}}
"""
SOURCES = ["web", "code", "books", "curated"]


def default_dict() -> dict:
    return yaml.safe_load(DEFAULT_YAML)["schedule"]


def build(d: dict) -> Schedule:
    return ScheduleConfig.from_dict(d).build()


DEFAULT = build(default_dict())
DEFAULT_LR = LRConfig(peak=3.0e-3, min=0.0, warmup_steps=2000).build(DEFAULT.total_steps, DEFAULT.anneal_step)


@st.composite
def schedule_dicts(draw) -> dict:
    """Valid configs small enough to check every step: 100 to ~1,800 steps, 1-4 phases, 1-5 sources."""
    multiple = draw(st.sampled_from([8, 16, 64]))
    start = multiple * draw(st.integers(1, 8))
    end = start + multiple * draw(st.integers(0, 32))
    seq_warmup, batch = draw(st.integers(0, 300)), draw(st.integers(1, 8))
    steps_floor = seq_warmup + draw(st.integers(100, 1500))  # the budget needs at least this many steps
    train_tokens = draw(st.integers(batch * end * (steps_floor - 1) + 1, batch * end * steps_floor))
    sources = [f"s{i}" for i in range(draw(st.integers(1, 5)))]
    n_phases = draw(st.integers(1, 4))
    middle = sorted(draw(st.lists(st.sampled_from([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]),
                                  min_size=max(0, n_phases - 2), max_size=max(0, n_phases - 2), unique=True)))
    phases = []
    for i, phase_start in enumerate([None] + middle + (["anneal"] if n_phases > 1 else [])):
        raw = draw(st.lists(st.integers(0, 10), min_size=len(sources), max_size=len(sources)))
        raw[0] += sum(raw) == 0
        phase = {"name": f"p{i}", "weights": {s: r / sum(raw) for s, r in zip(sources, raw)}}
        if phase_start is not None:
            phase["start"] = phase_start
        phases.append(phase)
    return {
        "train_tokens": train_tokens,
        "global_batch_size": batch,
        "seq_len": {"start": start, "end": end, "warmup_steps": seq_warmup, "multiple": multiple},
        "anneal_start": draw(st.floats(0.8, 0.95)),
        "mixture": {"ramp_steps": draw(st.integers(0, 4)), "phases": phases},
    }


PROPERTY = settings(max_examples=60, deadline=None)


# --- the 350M / 20B default, by hand ---------------------------------------------------------------

def test_default_total_steps_hand_computed():
    """2000 warmup steps of 256 sequences at 512..1984 tokens, then 256 x 2048 tokens per step."""
    warm = sum(256 * max(512, (512 + 1536 * s // 2000) // 64 * 64) for s in range(2000))
    assert warm == 638_844_928
    # (20e9 - warm) / (256 * 2048) = 36_928.47 full-length steps -> 36_929 after the warmup
    assert DEFAULT.total_steps == 2000 + 36_929 == 38_929
    assert DEFAULT.total_tokens == warm + 36_929 * 256 * 2048
    assert DEFAULT.anneal_step == round(0.9 * 38_929) == 35_036 == DEFAULT_LR.decay_start
    assert DEFAULT.phase_boundaries == [("stable", 0), ("anneal", 35_036)]
    assert DEFAULT.sources == SOURCES


def test_default_values_at_chosen_steps():
    assert DEFAULT.max_seq_len(0) == 512 and DEFAULT.max_seq_len(1999) == 1984
    assert DEFAULT.max_seq_len(2000) == 2048 and DEFAULT.tokens_at(2000) == 256 * 2048
    assert DEFAULT_LR(0) == pytest.approx(3e-3 / 2000) and DEFAULT_LR(1999) == pytest.approx(3e-3)
    assert DEFAULT_LR(35_036) == pytest.approx(3e-3) and DEFAULT_LR(38_928) == 0.0
    assert DEFAULT.mixture_weights(35_035) == pytest.approx({"web": 0.62, "code": 0.18, "books": 0.12, "curated": 0.08})
    assert DEFAULT.mixture_weights(35_036) == pytest.approx({"web": 0.35, "code": 0.20, "books": 0.10, "curated": 0.35})


def test_steps_past_the_end_behave_like_the_last_step():
    """A prefetching loader may ask for step total_steps; a negative step is a bug."""
    last = DEFAULT.total_steps - 1
    for step in (last + 1, last + 100):
        assert DEFAULT_LR(step) == DEFAULT_LR(last) and DEFAULT.max_seq_len(step) == 2048
        assert DEFAULT.mixture_weights(step) == DEFAULT.mixture_weights(last)
    with pytest.raises(ValueError):
        DEFAULT_LR(-1)


def test_mixture_forms_from_yaml():
    """`weights` is a one-phase fixed mixture; `fixed_equivalent_of` derives one from a schedule."""
    d = default_dict()
    d["mixture"] = {"weights": {"web": 0.5, "code": 0.5}}
    fixed = build(d)
    assert fixed.phase_boundaries == [("fixed", 0)] and fixed.mixture_weights(30_000) == {"web": 0.5, "code": 0.5}
    d["mixture"] = {"fixed_equivalent_of": default_dict()["mixture"]}
    derived = build(d)
    assert derived.mixture_weights(0) == pytest.approx(fixed_equivalent_weights(DEFAULT), rel=1e-12)


def test_shortest_budget_is_one_step_past_the_warmup():
    d = default_dict()
    d["train_tokens"] = 638_844_928 + 1
    assert build(d).total_steps == 2001


def test_anneal_start_one_means_no_decay():
    d = default_dict()
    d["anneal_start"] = 1.0
    d["mixture"] = {"weights": {"web": 1.0}}
    s = build(d)
    lr = LRConfig(peak=3e-3, warmup_steps=2000).build(s.total_steps, s.anneal_step)
    assert s.anneal_step == lr.decay_start == s.total_steps and lr(s.total_steps - 1) == lr(s.total_steps) == 3e-3


def test_ramp_interpolates_strictly_between_phases():
    d = default_dict()
    d["mixture"]["ramp_steps"] = 3
    s, b = build(d), DEFAULT.anneal_step
    before, after = DEFAULT.mixture_weights(b - 1), DEFAULT.mixture_weights(b)
    assert s.mixture_weights(b - 1) == before and s.mixture_weights(b + 3) == pytest.approx(after)
    curated = [s.mixture_weights(step)["curated"] for step in range(b - 1, b + 4)]
    assert curated == sorted(set(curated))  # strictly rising from 0.08 to 0.35
    assert s.mixture_weights(b)["curated"] == pytest.approx(0.08 + 0.27 / 4)


# --- properties over random configs ---------------------------------------------------------------

@PROPERTY
@given(schedule_dicts())
def test_seq_len_warmup(d):
    s, seq = build(d), d["seq_len"]
    lengths = [s.max_seq_len(step) for step in range(seq["warmup_steps"] + 3)]
    assert lengths[0] == (seq["start"] if seq["warmup_steps"] else seq["end"])
    assert all(a <= b for a, b in zip(lengths, lengths[1:]))
    assert all(n % seq["multiple"] == 0 and seq["start"] <= n <= seq["end"] for n in lengths)
    assert lengths[seq["warmup_steps"]:] == [seq["end"]] * 3
    for step, n in enumerate(lengths[: seq["warmup_steps"]]):  # the definition, in exact arithmetic
        line = seq["start"] + Fraction((seq["end"] - seq["start"]) * step, seq["warmup_steps"])
        assert n == max(seq["start"], math.floor(line / seq["multiple"]) * seq["multiple"])


@PROPERTY
@given(schedule_dicts())
def test_total_steps_minimal_and_sufficient(d):
    s = build(d)
    tokens = [s.tokens_at(step) for step in range(s.total_steps)]
    assert sum(tokens) == s.total_tokens >= d["train_tokens"] > sum(tokens[:-1])


@PROPERTY
@given(schedule_dicts(), st.data())
def test_lr_shapes_step_by_step(d, data):
    """Every shape: the linear warmup, ``peak`` until the decay start (the anneal start for wsd unless
    ``decay_start`` is given; the end of the warmup for cosine and linear), the shape's decay to exactly
    ``min`` at the last step; recomputed here from the definition, step by step."""
    s = build(d)
    peak = data.draw(st.floats(1e-5, 1e-1))
    cfg = LRConfig(shape=data.draw(st.sampled_from(LR_SHAPES)), peak=peak,
                   min=peak * data.draw(st.sampled_from([0.0, 0.1, 0.3])),
                   warmup_steps=data.draw(st.integers(0, s.total_steps // 3)),
                   decay_start=data.draw(st.none() | st.sampled_from([0.4, 0.5, 0.75])))
    lr = cfg.build(s.total_steps, s.anneal_step)
    n, warm = s.total_steps, cfg.warmup_steps
    start = (round(cfg.decay_start * n) if cfg.decay_start is not None else s.anneal_step if cfg.shape == "wsd"
             else warm)
    assert lr.decay_start == start
    for step in range(n):
        if step < warm:
            want = peak * (step + 1) / warm
        elif step < start:
            want = peak
        else:
            f = (step - start) / (n - 1 - start)
            want = (cfg.min + (peak - cfg.min) * (1 + math.cos(math.pi * f)) / 2 if cfg.shape == "cosine"
                    else peak + (cfg.min - peak) * f)
        assert lr(step) == pytest.approx(want, rel=1e-12, abs=1e-15), (step, cfg)
    assert lr(n - 1) == cfg.min


def test_the_decay_start_is_no_longer_the_anneal_start():
    """The anneal phase may start elsewhere than 'anneal' (it was refused: the LR decay began there), and
    ``model.lr.decay_start`` moves the decay away from the anneal start; a bad value names its key."""
    d = default_dict()
    d["mixture"]["phases"][1]["start"] = 0.5
    s = build(d)
    assert s.phase_boundaries[1][1] == round(0.5 * s.total_steps) and s.anneal_step == 35_036
    lr = LRConfig(peak=3e-3, warmup_steps=2000, decay_start=0.8).build(s.total_steps, s.anneal_step)
    assert lr.decay_start == round(0.8 * 38_929) and lr(lr.decay_start) == 3e-3 > lr(lr.decay_start + 1)
    for bad, key in [(dict(decay_start=1.5), "model.lr.decay_start"), (dict(shape="step"), "model.lr.shape"),
                     (dict(warmup_steps=36_000), "model.lr.warmup_steps"), (dict(min=1.0), "model.lr.min"),
                     (dict(warmup_steps=40_000), "model.lr.warmup_steps"), (dict(peak=0.0), "model.lr.peak")]:
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}"):
            LRConfig(**{"peak": 3e-3, "warmup_steps": 2000, **bad}).build(s.total_steps, s.anneal_step)


@PROPERTY
@given(schedule_dicts())
def test_boundaries_come_from_the_anneal_start(d):
    s = build(d)
    assert s.anneal_step == round(d["anneal_start"] * s.total_steps)
    expected = [0] + [round(p["start"] * s.total_steps) if p["start"] != "anneal" else s.anneal_step
                      for p in d["mixture"]["phases"][1:]]
    assert [first for _, first in s.phase_boundaries] == expected
    if len(expected) > 1:
        assert s.phase_boundaries[-1][1] == s.anneal_step


@PROPERTY
@given(schedule_dicts())
def test_weights_sum_to_one_and_phases_take_over_where_configured(d):
    s, ramp = build(d), d["mixture"]["ramp_steps"]
    weights = [s.mixture_weights(step) for step in range(s.total_steps)]
    assert all(min(w.values()) >= 0 and sum(w.values()) == pytest.approx(1, abs=1e-12) for w in weights)
    for (_, first), phase in zip(s.phase_boundaries, d["mixture"]["phases"]):
        reached = first + ramp if first else 0
        assert weights[reached] == pytest.approx(phase["weights"], abs=1e-12)
    for (_, first), phase in zip(s.phase_boundaries[1:], d["mixture"]["phases"]):
        assert weights[first - 1] == pytest.approx(phase["weights"], abs=1e-12)


@PROPERTY
@given(schedule_dicts())
def test_token_accounting_matches_a_step_by_step_sum(d):
    s = build(d)
    by_step = {src: sum(s.mixture_weights(step)[src] * s.tokens_at(step) for step in range(s.total_steps))
               for src in s.sources}
    assert tokens_per_source(s) == pytest.approx(by_step, rel=1e-9, abs=1e-3)
    per_phase = tokens_per_phase(s)
    assert list(per_phase) == [name for name, _ in s.phase_boundaries]
    assert {src: sum(p[src] for p in per_phase.values()) for src in s.sources} == pytest.approx(by_step, rel=1e-9)


@PROPERTY
@given(schedule_dicts())
def test_fixed_equivalent_draws_the_same_tokens_per_source(d):
    scheduled = build(d)
    d = copy.deepcopy(d)
    d["mixture"] = {"fixed_equivalent_of": d["mixture"]}
    fixed = build(d)
    assert fixed.total_steps == scheduled.total_steps and len(fixed.phase_boundaries) == 1
    assert tokens_per_source(fixed) == pytest.approx(tokens_per_source(scheduled), rel=1e-6, abs=1e-3)


# --- validation: every invalid config names its key ------------------------------------------------

def _set(path: str, value):
    """A mutation of the default dict: `path` like 'mixture.phases[1].weights.web'; None deletes."""
    def mutate(d):
        parts = re.findall(r"[^.\[\]]+", path)
        for part in parts[:-1]:
            d = d[int(part)] if part.isdigit() else d[part]
        if value is None:
            del d[parts[-1]]
        else:
            d[int(parts[-1]) if parts[-1].isdigit() else parts[-1]] = value
    return mutate


INVALID = [
    (_set("mixture.phases[0].weights.web", -0.1), "schedule.mixture.phases[0].weights.web: weight -0.1 is negative"),
    (_set("mixture.phases[1].weights.curated", 0.32),
     "schedule.mixture.phases[1].weights: weights sum to 0.97, must sum to 1 (±1e-06)"),
    (_set("mixture.phases[1].weights", {"web": 0.45, "code": 0.2, "curated": 0.35}),
     "schedule.mixture.phases[1].weights"),
    (_set("mixture.phases[0].start", 0.2), "schedule.mixture.phases[0].start"),
    (_set("mixture.phases[1].start", 1.5), "schedule.mixture.phases[1].start"),
    (_set("mixture.phases[1].name", "stable"), "schedule.mixture.phases"),
    (_set("mixture.ramp_steps", 5000), "schedule.mixture.phases[1].start"),
    (_set("mixture.weights", {"web": 1.0}), "schedule.mixture"),
    (_set("mixture.phases[0].wieghts", {"web": 1.0}), "schedule.mixture.phases.wieghts.web: unknown key"),
    (_set("mixture.wieghts", {}), "schedule.mixture.wieghts: unknown key (did you mean schedule.mixture.weights"),
    (_set("mixture.phases[1].wieghts", {}), "schedule.mixture.phases[1].wieghts: unknown key"),  # read as nothing
    (_set("seq_len.start", 4096), "schedule.seq_len.start"),
    (_set("seq_len.end", 2000), "schedule.seq_len.end"),
    (_set("seq_len.start", 500), "schedule.seq_len.start"),
    (_set("seq_len.stat", 512), "schedule.seq_len.stat: unknown key"),
    (_set("train_tokens", 500_000_000), "schedule.train_tokens"),  # ends inside the seq-len warmup
    (_set("train_tokens", 638_844_928), "schedule.train_tokens"),  # ends exactly with the seq-len warmup
    (_set("train_tokens", 0), "schedule.train_tokens"),
    (_set("global_batch_size", 0), "schedule.global_batch_size"),
    (_set("global_batch_size", -4), "schedule.global_batch_size"),
    (_set("anneal_start", 1.5), "schedule.anneal_start"),
    (_set("anneal_start", 0.99999), "schedule.mixture.phases[1].start"),  # an anneal phase of no step
    (_set("epochs", 1), "schedule.epochs: unknown key"),
    (_set("mixture", None), "schedule.mixture: give exactly one of phases"),
    (_set("mixture.phases[1].name", None), "schedule.mixture.phases: the following arguments are required: name"),
    (_set("mixture.phases[1].weights.code", "x"),
     "schedule.mixture.phases.weights: Expected a <class 'float'>. Got value: x"),
    (_set("mixture.phases", 3), "schedule.mixture.phases: Expected a <class 'tuple'>. Got value: 3"),
    (_set("mixture.ramp_steps", 2.5), "schedule.mixture.ramp_steps: Not of type Count: expected a whole number, "
                                      "got 2.5"),
    (_set("train_tokens", True), "schedule.train_tokens: Not of type Count: expected a whole number, got True"),
    (_set("train_tokens", "2.5e0"), "schedule.train_tokens: Not of type Count: expected a whole number, got 2.5"),
    (_set("seq_len", 0.1), "schedule.seq_len: expected a mapping or a YAML file, got 0.1"),
    (_set("mixture", "no_such_mixture.yaml"), "schedule.mixture: Unable to load config 'no_such_mixture.yaml'"),
]


@pytest.mark.parametrize(("mutate", "key"), INVALID, ids=[key for _, key in INVALID])
def test_invalid_config_names_its_key(mutate, key):
    d = default_dict()
    mutate(d)
    with pytest.raises(ConfigError) as info:
        build(d)
    assert str(info.value).startswith(key), str(info.value)


def test_corpus_and_model_checks_name_their_key():
    validate_sources(DEFAULT, SOURCES)
    assert build_schedule(default_dict(), sources=SOURCES).total_steps == DEFAULT.total_steps
    validate_model_context(DEFAULT, 2048)
    for corpus in (SOURCES[:3], SOURCES + ["math"]):
        with pytest.raises(ConfigError, match=re.escape("schedule.mixture.phases[*].weights: ")):
            validate_sources(DEFAULT, corpus)
    with pytest.raises(ConfigError, match=re.escape("schedule.mixture.phases[*].weights: corpus source 'math'")):
        build_schedule(default_dict(), sources=SOURCES + ["math"])
    with pytest.raises(ConfigError, match=r"^schedule\.seq_len\.end: 2048 exceeds"):
        validate_model_context(DEFAULT, 1024)


# --- epochs and the plan ---------------------------------------------------------------------------

AVAILABLE = {"web": 3_000_000_000_000, "code": 400_000_000_000, "books": 50_000_000_000, "curated": 500_000_000}


def test_epochs_warn_or_raise_per_source():
    epochs = implied_epochs(DEFAULT, AVAILABLE)
    assert epochs["curated"] == pytest.approx(tokens_per_source(DEFAULT)["curated"] / 500_000_000)
    with pytest.warns(UserWarning, match=r"'curated' would be repeated 4\.30 epochs.*data\.max_epochs") as caught:
        check_epochs(DEFAULT, AVAILABLE, max_epochs=4.0)
    assert len(caught) == 1
    check_epochs(DEFAULT, AVAILABLE, max_epochs=5.0)
    with pytest.raises(ConfigError, match="'curated'"):
        check_epochs(DEFAULT, AVAILABLE, max_epochs=4.0, error=True)
    with pytest.raises(ConfigError, match="schedule.mixture"):
        implied_epochs(DEFAULT, {"web": 1})


def test_plan_table_lists_sources_and_totals():
    table = plan_table(DEFAULT, AVAILABLE, DEFAULT_LR)
    for text in SOURCES + ["38,929", "35,036", "stable @ 0", "anneal @ 35,036", "20.00B", "step 2,000", "4.30",
                           "wsd: peak 3.00e-03 after 2,000 steps, decay from step 35,036"]:
        assert text in table, text


def test_plot_is_a_png_written_atomically(tmp_path):
    out = tmp_path / "schedule.png"
    plot_schedule(DEFAULT, DEFAULT_LR, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["schedule.png"]


def test_numbers_given_as_text_are_read():
    """Command-line overrides (--data.schedule.train_tokens 2e10) and YAML 1.1's '3e-3' arrive as text."""
    d = default_dict()
    d["train_tokens"] = "20_000_000_000"
    assert build_schedule(d).total_steps == 38_929


def test_a_mixture_given_as_a_yaml_file_is_read_as_train_fit_reads_it(tmp_path):
    """`mixture: FILE.yaml` and `fixed_equivalent_of: FILE.yaml`, as the ablation configs write them."""
    path = tmp_path / "mixture.yaml"
    path.write_text(yaml.safe_dump(default_dict()["mixture"]))
    d = default_dict()
    d["mixture"] = str(path)
    assert build(d).phase_boundaries == DEFAULT.phase_boundaries
    d["mixture"] = {"fixed_equivalent_of": str(path)}
    assert build(d).mixture_weights(0) == pytest.approx(fixed_equivalent_weights(DEFAULT), rel=1e-12)
