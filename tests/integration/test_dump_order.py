"""The order dump's command-line contract (issue 2, section 7), run as real subprocesses:

    python scripts/dump_order.py --config CONFIG --steps N --world-size R --num-workers W --out FILE

One JSON line per (step, rank); same seed -> same bytes; a cursor saved in one process continues
exactly in another (a subprocess); flags override the config, in this script's older spelling and in
``train fit``'s (``--data.seed``), over stacked configs; bad input -> exit 2 and a one-line ``error:``.
The script's ``main`` runs in this process except where a fresh process is the point.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from data.manifest import build_manifest
from data.simulate import OrderSimulator, dumps

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "dump_order.py"
SOURCES = ["web", "code", "books", "curated"]
WEIGHTS = {"web": 0.62, "code": 0.18, "books": 0.12, "curated": 0.08}
STEPS, R, W, BATCH, SEQ = 6, 2, 2, 4, 128
FIXED = {"mixture": {"weights": WEIGHTS}, "seq_len": {"start": SEQ, "end": SEQ, "warmup_steps": 0},
         "anneal_start": 1.0}
"""A fixed mixture at one sequence length as a config spells it (with ``model.lr: {warmup_steps: 0}`` the LR
at its peak throughout, as in data/schedules.py fixed_schedule)."""


@pytest.fixture(scope="module")
def work(tmp_path_factory, demo_corpus) -> Path:
    """A tmp dir with config.yaml: the demo corpus, a small buffer (16: fast), manifest cache in tmp."""
    d = tmp_path_factory.mktemp("dump_order")
    data = {
        "sources": {s: {"paths": [str(demo_corpus / s / "*.parquet")]} for s in SOURCES},
        "schedule": FIXED, "seed": 1234, "batch_size": BATCH,
        "buffer_size": 16, "open_shards": 4, "num_workers": 3, "manifest_cache": str(d / "cache"),
    }
    config = {"data": data, "model": {"lr": {"warmup_steps": 0}}}
    (d / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return d


def _script():
    """scripts/dump_order.py loaded as a module (its ``main(argv) -> int``), once."""
    if "module" not in _SCRIPT:
        spec = importlib.util.spec_from_file_location("dump_order_script", SCRIPT)
        _SCRIPT["module"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_SCRIPT["module"])
    return _SCRIPT["module"]


_SCRIPT: dict = {}


def dump_order(work: Path, *args, expect_rc: int = 0, fresh: bool = False) -> subprocess.CompletedProcess:
    """Run the script (cwd: the tmp dir; manifest cache: tmp): its ``main`` in this process (the import of
    torch and Lightning, which its configuration parser needs, is paid once), or with ``fresh`` in a new
    interpreter."""
    argv = [str(a) for a in args]
    env = {**os.environ, "WELLMIXED_CACHE": str(work / "cache")}
    if fresh:
        proc = subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=work, env=env,
                              capture_output=True, text=True, timeout=120)
    else:
        out, err, cwd, saved = io.StringIO(), io.StringIO(), os.getcwd(), dict(os.environ)
        os.chdir(work)
        os.environ["WELLMIXED_CACHE"] = env["WELLMIXED_CACHE"]
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    rc = _script().main(argv)
                except SystemExit as e:
                    rc = e.code
        finally:
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(saved)
        proc = subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())
    assert proc.returncode == expect_rc, proc.stderr
    return proc


def run_dump(work: Path, name: str, *args, fresh: bool = False) -> list[str]:
    """Dump with the test config (R=2, W=2, 8 steps unless overridden) and return the lines."""
    out = work / name
    dump_order(work, "--config", work / "config.yaml", "--steps", STEPS, "--world-size", R,
               "--num-workers", W, "--out", out, *args, fresh=fresh)
    return out.read_text().splitlines()


@pytest.fixture(scope="module")
def baseline(work) -> list[str]:
    return run_dump(work, "baseline.jsonl")


@pytest.fixture(scope="module")
def shard_info(demo_corpus) -> dict[str, tuple[str, list[int]]]:
    """Shard stem -> (mixture source, token_count per row), read from the demo files."""
    return {
        p.stem: (s, pq.read_table(p, columns=["token_count"]).column(0).to_pylist())
        for s in SOURCES for p in (demo_corpus / s).glob("*.parquet")
    }


# -- the line format ----------------------------------------------------------------------------


def test_one_line_per_step_and_rank_in_the_documented_format(baseline, shard_info):
    """Guards: a dump a user cannot read or diff (missing keys, ranks out of order, pieces that do
    not add up). Each line: step, rank, seq_len, pieces [doc_id, first_token_offset, n_tokens],
    source_tokens (and the weights and LR in force); doc_id is <shard stem>:<row>; the pieces cover the
    rank's micro-batch exactly: sum(n_tokens) == batch_size * seq_len == sum(source_tokens)."""
    lines = [json.loads(x) for x in baseline]
    assert [(x["step"], x["rank"]) for x in lines] == [(s, r) for s in range(STEPS) for r in range(R)]
    for x in lines:
        assert set(x) == {"step", "rank", "seq_len", "pieces", "source_tokens", "weights", "lr"}
        assert x["seq_len"] == SEQ
        assert x["weights"] == WEIGHTS
        assert x["lr"] == 3.0e-3  # model.lr.peak: no warmup, no decay
        assert list(x["source_tokens"]) == SOURCES
        per_source = dict.fromkeys(SOURCES, 0)
        for doc_id, offset, n in x["pieces"]:
            assert re.fullmatch(r"[\w.-]+:\d+", doc_id), doc_id
            stem, row = doc_id.rsplit(":", 1)
            source, counts = shard_info[stem]
            assert 0 <= offset and 0 < n and offset + n <= counts[int(row)] + 1  # + EOT
            per_source[source] += n
        assert sum(n for _, _, n in x["pieces"]) == BATCH * SEQ == sum(x["source_tokens"].values())
        assert per_source == x["source_tokens"]


def test_documents_continue_where_they_stopped(baseline):
    """Guards: tokens dropped or repeated at micro-batch boundaries. A piece that starts inside a
    document (offset > 0) continues, on the same rank, a piece of that document that ended there.
    (Small sources wrap into later epochs here, so one document can be in flight more than once.)"""
    ends: dict[tuple[str, int], Counter] = defaultdict(Counter)  # (doc_id, rank) -> open end offsets
    for x in map(json.loads, baseline):
        for doc_id, offset, n in x["pieces"]:
            open_ends = ends[(doc_id, x["rank"])]
            if offset > 0:
                assert open_ends[offset] > 0, (x["step"], x["rank"], doc_id, offset)
                open_ends[offset] -= 1
            open_ends[offset + n] += 1


def test_same_seed_same_bytes_other_seed_other_order(work, baseline):
    """Guards: nondeterminism (set or dict iteration, thread timing in batch encoding, wall-clock
    seeds) that would make the dump useless as a preview of the run."""
    assert run_dump(work, "again.jsonl") == baseline
    assert (work / "again.jsonl").read_bytes() == (work / "baseline.jsonl").read_bytes()
    other = run_dump(work, "seed99.jsonl", "--seed", 99, "--steps", 2)
    assert len(other) == 4 and other != baseline[:4]


def test_train_fit_flags_and_stacked_configs_give_the_order_of_the_older_flags(work, baseline):
    """Guards: a tool keeping only the last --config, or its own flag vocabulary drifting from train fit's.
    ``--seed 99``, ``--data.seed 99`` and a second --config setting data.seed 99 dump the same bytes."""
    (work / "seed99.yaml").write_text("data:\n  seed: 99\n")
    old = run_dump(work, "old99.jsonl", "--seed", 99, "--steps", 2)
    assert run_dump(work, "new99.jsonl", "--data.seed", 99, "--steps", 2) == old
    assert run_dump(work, "stacked99.jsonl", "--config", work / "seed99.yaml", "--steps", 2) == old
    assert old != baseline[:4]


@pytest.mark.parametrize("key, value", [("selector", "random"), ("min_chunks_per_source", 8)])
def test_an_environment_override_dumps_the_order_of_its_flag(work, baseline, monkeypatch, key, value):
    """Guards: ``PL_FIT__DATA__*``, which ``train fit`` applies, ignored by the dump (the order printed was
    not the order trained). The variable dumps what its flag dumps, and not what the config alone gives."""
    flagged = run_dump(work, f"flag-{key}.jsonl", f"--data.{key}", value, "--steps", 2)
    monkeypatch.setenv(f"PL_FIT__DATA__{key.upper()}", str(value))
    assert run_dump(work, f"env-{key}.jsonl", "--steps", 2) == flagged != baseline[:4]


@pytest.fixture(scope="module")
def head(work) -> Path:
    """A dump stopped after step 2, with its cursor in head.jsonl.cursor.json."""
    run_dump(work, "head.jsonl", "--save-cursor-at", 2)
    return work / "head.jsonl"


def test_cursor_continues_exactly_in_a_fresh_process(work, baseline, head):
    """Guards: a resume that replays or skips documents (nanoGPT #467), or that only works in the
    process that saved it. R=2 x W=2: the head (steps 0..2) plus the continuation from the cursor,
    in another process, is the uninterrupted dump line for line."""
    head_lines = head.read_text().splitlines()
    assert [json.loads(x)["step"] for x in head_lines] == [0, 0, 1, 1, 2, 2]
    cursor = Path(str(head) + ".cursor.json")
    assert cursor.stat().st_size < 200_000
    tail = run_dump(work, "tail.jsonl", "--resume-from", cursor, fresh=True)
    assert json.loads(tail[0])["step"] == 3
    assert head_lines + tail == baseline


@pytest.mark.parametrize("flags", [["--trainer.precision", "bf16-mixed"], ["--run.dir", "elsewhere"],
                                   ["--model.model.d_model", "64"], ["--trainer.max_steps", "5"]])
def test_flags_of_fits_other_sections_are_accepted_and_change_nothing(work, baseline, flags):
    """The help promises every option of `train fit`; before, --trainer.precision or --run.dir over a config
    that has those sections (a run's config.yaml, configs/demo.yaml) ended in a TypeError traceback."""
    sections = work / "sections.yaml"
    sections.write_text(yaml.safe_dump({"trainer": {"precision": "32-true", "max_steps": 3}, "run": {"dir": "runs/x"},
                                        "model": {"model": {"d_model": 32}}}))
    assert run_dump(work, "other_sections.jsonl", "--config", sections, *flags) == baseline


def test_ranks_never_share_a_document_piece(work, shard_info):
    """Guards: ranks reading the same documents (each rank shuffling the whole corpus on its own).
    A short run in which no source wraps into its next epoch (only web and curated drawn, tiny
    buffers): every (doc_id, offset) appears once in the whole dump, and each document stays on
    one rank."""
    lines = [json.loads(x) for x in run_dump(work, "unique.jsonl", "--weights", "web=0.7,code=0,books=0,curated=0.3",
                                              "--buffer-size", 8, "--open-shards", 2, "--steps", 4)]
    seen, ranks = set(), defaultdict(set)
    for x in lines:
        assert x["source_tokens"]["code"] == x["source_tokens"]["books"] == 0
        for doc_id, offset, _ in x["pieces"]:
            assert (doc_id, offset) not in seen, doc_id
            seen.add((doc_id, offset))
            ranks[doc_id].add(x["rank"])
    assert all(len(r) == 1 for r in ranks.values())
    docs_of = {s: sum(len(c) for src, c in shard_info.values() if src == s) for s in ("web", "curated")}
    assert len(ranks) < min(docs_of.values())  # no wrap was possible: fewer docs than the smaller source


# -- flags override the config -----------------------------------------------------------------


def test_flags_override_the_config(work, demo_corpus, make_cfg):
    """Guards: a flag parsed but never applied (the dump then shows another order than the one the
    user asked about). The config's globs point nowhere and every knob differs from the flags; the
    dump must equal the in-process order for exactly the flags' values."""
    cfg_path = work / "elsewhere.yaml"
    cfg_path.write_text(yaml.safe_dump({"model": {"lr": {"warmup_steps": 0}}, "data": {
        "sources": {s: {"paths": [str(work / "nowhere" / s / "*.parquet")]} for s in SOURCES},
        "schedule": FIXED, "seed": 1234, "batch_size": 4, "buffer_size": 64,
        "open_shards": 4, "num_workers": 2, "selector": "deficit", "manifest_cache": str(work / "cache"),
    }}, sort_keys=False))
    weights = {"web": 0.4, "code": 0.3, "books": 0.2, "curated": 0.1}
    out = work / "flags.jsonl"
    dump_order(work, "--config", cfg_path, "--corpus", demo_corpus, "--steps", 4, "--world-size", 2,
               "--num-workers", 1, "--out", out, "--seed", 7,
               "--weights", ",".join(f"{k}={v}" for k, v in weights.items()),
               "--batch-size", 2, "--seq-len", 64, "--buffer-size", 8, "--open-shards", 2, "--selector", "random")
    got = out.read_text().splitlines()
    cfg = make_cfg(seed=7, weights=weights, batch_size=2, seq_len=64, buffer_size=8, open_shards=2, selector="random")
    want = [dumps(x) for x in OrderSimulator(build_manifest(cfg), cfg, 2, 1).order_lines(4)]
    assert got == want
    for x in map(json.loads, got):
        assert x["seq_len"] == 64 and x["weights"] == weights
        assert sum(n for _, _, n in x["pieces"]) == 2 * 64


def test_schedule_drives_seq_len_weights_and_lr(work, demo_corpus):
    """Guards: the dump ignoring the schedule (a preview without the warmup or the anneal). With
    configs/demo.yaml and no --steps, the whole schedule is dumped: seq_len follows the warmup (128
    at step 0, 256 at the end), the anneal weights start at anneal_start, each line has the LR."""
    from data.config import resolve_sections
    from data.schedules import build_schedule

    demo = resolve_sections(["--config", str(ROOT / "configs" / "demo.yaml")])
    sched = build_schedule(demo.data.schedule, sources=SOURCES)
    lr = demo.model.lr.build(sched.total_steps, sched.anneal_step)
    out = work / "schedule.jsonl"
    dump_order(work, "--config", ROOT / "configs" / "demo.yaml", "--corpus", demo_corpus, "--world-size", 1,
               "--num-workers", 1, "--batch-size", 1, "--buffer-size", 16, "--out", out)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(sched.total_steps))
    assert lines[0]["seq_len"] == 128 and lines[-1]["seq_len"] == 256
    stable = {"web": 0.62, "code": 0.18, "books": 0.12, "curated": 0.08}
    anneal = {"web": 0.35, "code": 0.20, "books": 0.10, "curated": 0.35}
    for x in lines:
        s = x["step"]
        assert x["seq_len"] == sched.max_seq_len(s) and x["seq_len"] % 64 == 0
        assert sum(x["source_tokens"].values()) == x["seq_len"]
        assert x["weights"] == (anneal if s >= sched.anneal_step else stable)
        assert x["lr"] == pytest.approx(lr(s))
    assert 0 < sched.anneal_step < sched.total_steps - 1
    assert lines[0]["lr"] < lines[30]["lr"] and lines[-1]["lr"] == pytest.approx(0.0)


def test_weights_and_seq_len_replace_the_mixture_and_the_warmup(work, demo_corpus):
    """Guards: --weights / --seq-len merged into configs/demo.yaml's schedule instead of replacing its
    parts (two phases and a fixed mixture at once, or the 128..256 warmup still running). Every line has
    the given weights (JSON here) and length, and with no --steps the dump runs the budget at that length."""
    weights = {"web": 0.5, "code": 0.2, "books": 0.2, "curated": 0.1}
    out = work / "fixed.jsonl"
    dump_order(work, "--config", ROOT / "configs" / "demo.yaml", "--corpus", demo_corpus, "--world-size", 1,
               "--num-workers", 1, "--batch-size", 1, "--buffer-size", 16, "--out", out,
               "--weights", json.dumps(weights), "--seq-len", 96)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == -(-300_000 // (4 * 96))  # schedule.train_tokens / (global_batch_size x 96), rounded up
    assert all(x["seq_len"] == 96 and x["weights"] == weights for x in lines)


# -- bad input: exit 2, one line naming the flag or file, no traceback -------------------------


def _mangled_cursor(work: Path, head: Path) -> Path:
    state = json.loads(Path(str(head) + ".cursor.json").read_text())
    src = state["consumers"][0][0]["sources"]["web"]
    src["buffer"] = "AAAA" + src["buffer"][4:]  # no longer a zlib stream
    out = work / "mangled.cursor.json"
    out.write_text(json.dumps(state))
    return out


BAD = {
    "missing config": (["--config", "{work}/nope.yaml"], ["--config", "nope.yaml", "not found"]),
    "weights sum": (["--weights", "web=0.5,code=0.2,books=0.1,curated=0.1"], ["--weights", "sum to 0.9"]),
    "unknown source": (["--weights", "web=0.9,wiki=0.1"], ["--weights", "wiki"]),
    "weights syntax": (["--weights", "web=0.5,code"], ["--weights", "'code'"]),
    "cursor garbage": (["--resume-from", "{work}/garbage.json"], ["--resume-from", "garbage.json"]),
    "cursor not a cursor": (["--resume-from", "{work}/empty.json"], ["--resume-from", "empty.json"]),
    "cursor mangled": (["--resume-from", "{mangled}"], ["--resume-from", "mangled.cursor.json"]),
    "weights JSON": (["--weights", '{{"web": "a lot"}}'], ["--weights", "number"]),  # {{: str.format below
    "removed data key": (["--data.seq_len", "64"], ["data.seq_len", "data.schedule.seq_len.start"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_with_one_line(work, head, case):
    """Guards: tracebacks (or a silent exit 0) for user mistakes. Missing config, --weights not
    summing to 1 / naming an unknown source / malformed, and cursor files that are not JSON, not a
    cursor, or corrupt inside (a cursor for another world size, seed or corpus is refused the same
    way; tests/unit/test_stream.py covers those refusals): exit code 2 and a single stderr line
    `error: ...` naming the flag or file."""
    (work / "garbage.json").write_text("this is not json {")
    (work / "empty.json").write_text("{}")
    fill = {"work": work, "mangled": _mangled_cursor(work, head)}
    args, phrases = BAD[case]
    args = [str(a).format(**fill) for a in args]
    base = {"--config": str(work / "config.yaml"), "--steps": str(STEPS), "--world-size": "2", "--num-workers": "2",
            "--out": str(work / "bad.jsonl")}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    proc = dump_order(work, *[x for kv in base.items() for x in kv], expect_rc=2)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for phrase in phrases:
        assert phrase in err, (phrase, err)
    assert not (work / "bad.jsonl").exists()


# The order of configs/demo.yaml, 2 ranks x 2 workers, 60 steps: a refactor must leave these bytes
# alone. A deliberate change of the order (a fix of the stream, the mixer or the packer) updates the
# hash here, and its commit says why the order changed.
DEMO_ORDER_SHA256 = "6fa0f88410a4a64863c0d455a72b37435d2cd7b5250154df718afd070c336419"


def test_the_demo_order_dump_is_byte_identical_to_the_recorded_one(tmp_path, demo_corpus):
    import hashlib

    out = tmp_path / "order.jsonl"
    dump_order(tmp_path, "--config", ROOT / "configs" / "demo.yaml", "--corpus", demo_corpus, "--steps", 60,
               "--world-size", 2, "--num-workers", 2, "--out", out)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == DEMO_ORDER_SHA256
