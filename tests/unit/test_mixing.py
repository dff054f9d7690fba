"""Token-exact mixing under a schedule: per-phase shares, the fixed-equivalent arm, implied epochs."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from data.manifest import build_manifest
from data.plan import implied_epochs
from data.schedules import build_schedule, fixed_equivalent_weights, tokens_per_source
from data.simulate import OrderSimulator

PHASES = [
    {"name": "stable", "weights": {"web": 0.62, "code": 0.18, "books": 0.12, "curated": 0.08}},
    {"name": "anneal", "start": "anneal", "weights": {"web": 0.35, "code": 0.20, "books": 0.10, "curated": 0.35}},
]


def schedule_dict(mixture: dict, tokens: int = 600_000) -> dict:
    return {
        "train_tokens": tokens,
        "global_batch_size": 8,
        "seq_len": {"start": 128, "end": 256, "warmup_steps": 20, "multiple": 64},
        "anneal_start": 0.5,  # long phases: the in-flight documents of 8 rows are small next to them
        "mixture": mixture,
    }


def run(make_cfg, mixture: dict):
    cfg = make_cfg(schedule=schedule_dict(mixture), batch_size=8, buffer_size=64)
    m = build_manifest(cfg)
    sim = OrderSimulator(m, cfg, 1, 1)
    per_step = [(step, b["source_tokens"].copy()) for step, _, b in sim.batches(sim.steps.total_steps)]
    return m, sim, per_step


def longest_doc(m) -> int:
    return max(max(pq.read_table(s.path, columns=["token_count"]).column(0).to_pylist()) for s in m.shards) + 1


def test_realised_shares_follow_each_phase(make_cfg):
    m, sim, per_step = run(make_cfg, {"phases": PHASES})
    boundary = sim.steps.by_optimizer_step.anneal_step
    for name, steps, target in [("stable", lambda s: s < boundary, PHASES[0]["weights"]),
                                ("anneal", lambda s: s >= boundary, PHASES[1]["weights"])]:
        tokens = sum(t for s, t in per_step if steps(s))
        shares = tokens / tokens.sum()
        np.testing.assert_allclose(shares, [target[n] for n in m.source_names], atol=0.02, err_msg=name)


def test_fixed_equivalent_arm_draws_the_same_tokens_per_source(make_cfg):
    """Committed tokens (chosen documents) of both arms agree within a couple of documents per source;
    and the analytic token counts of the two arms agree exactly."""
    m, sched_sim, _ = run(make_cfg, {"phases": PHASES})
    _, fixed_sim, _ = run(make_cfg, {"fixed_equivalent_of": {"phases": PHASES}})
    a = sched_sim.consumers[0][0].mixer.committed
    b = fixed_sim.consumers[0][0].mixer.committed
    assert np.all(np.abs(a - b) <= 2 * longest_doc(m)), (a, b)
    scheduled = build_schedule(schedule_dict({"phases": PHASES}))
    fixed = build_schedule(schedule_dict({"weights": fixed_equivalent_weights(scheduled)}))
    for s, t in tokens_per_source(scheduled).items():
        assert tokens_per_source(fixed)[s] == pytest.approx(t, rel=1e-9)


def test_implied_epochs_match_a_hand_count(make_cfg, demo_corpus):
    cfg = make_cfg(schedule=schedule_dict({"phases": PHASES}))
    m = build_manifest(cfg)
    schedule = build_schedule(cfg.schedule, sources=m.source_names)
    for name in m.source_names:  # by hand: sum of token_count + one EOT per document, from the files
        cols = [pq.read_table(p, columns=["token_count"]).column(0).to_pylist()
                for p in sorted((demo_corpus / name).glob("*.parquet"))]
        by_hand = sum(map(sum, cols)) + sum(map(len, cols))
        assert m.sources[name].stream_tokens == by_hand
    epochs = implied_epochs(schedule, {n: s.stream_tokens for n, s in m.sources.items()})
    drawn = tokens_per_source(schedule)
    for name in m.source_names:
        assert epochs[name] == pytest.approx(drawn[name] / m.sources[name].stream_tokens)
