"""Shared fixtures: the real demo corpus, built once per test session, and small data configs on it."""

from __future__ import annotations

import os
import random
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("WANDB_MODE", "offline")
# One intra-op thread per process (before torch is imported here and in every training subprocess,
# which inherit this environment): the suite runs more processes than cores, and idle OpenMP threads
# spinning for work took a fifth of its CPU (2 cores, 3 workers: 444 s instead of 507 s). Export
# OMP_NUM_THREADS to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from data.config import DataConfig, SourceConfig  # noqa: E402 (after the environment above)
from data.schedules import fixed_schedule  # noqa: E402

SOURCES = ["web", "code", "books", "curated"]

def pytest_collection_modifyitems(config, items):
    """Modules with slow (training) tests first: pytest-xdist (--dist loadfile, as scripts/test.sh runs
    it) hands whole modules to workers in collection order, and a long module started last would keep
    the suite running while the other workers sit idle."""
    slow_tests: dict = {}
    for item in items:
        slow_tests[item.path] = slow_tests.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow_tests[item.path])  # stable: file order otherwise


WEIGHTS = {"web": 0.62, "code": 0.18, "books": 0.12, "curated": 0.08}


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory) -> Path:
    from data.corpus.demo import build_demo_corpus

    out = tmp_path_factory.mktemp("demo_corpus")
    build_demo_corpus(out)
    return out


def tiny_bpe(demo_corpus: Path, out: Path, vocab_size: int) -> Path:
    """A byte-level BPE ``tokenizer.json`` of ``vocab_size`` ids (``<|endoftext|>`` one of them), trained by the
    ``tokenizers`` library on the first 4,000 characters of every demo document: another tokenizer, in seconds."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [t[:4000] for p in sorted(demo_corpus.glob("*/*.parquet"))
             for t in pq.read_table(p, columns=["text"]).column("text").to_pylist()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.save(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_bpe_json(demo_corpus, tmp_path_factory) -> Path:
    """A 384-id BPE tokenizer.json (:func:`tiny_bpe`): about 3x cl100k's token counts on the demo corpus."""
    return tiny_bpe(demo_corpus, tmp_path_factory.mktemp("tokenizer") / "tokenizer.json", 384)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("manifest_cache")


@pytest.fixture
def make_cfg(demo_corpus, cache_dir):
    """DataConfig on the demo corpus with small, fast defaults: a fixed mixture of ``weights`` at
    ``seq_len`` tokens per sequence (data/schedules.py fixed_schedule), or ``schedule=``; keyword overrides."""

    def make(weights: dict[str, float] = WEIGHTS, seq_len: int = 128, **overrides) -> DataConfig:
        kw = dict(
            sources={s: SourceConfig(paths=[str(demo_corpus / s / "*.parquet")]) for s in SOURCES},
            schedule=fixed_schedule(weights, seq_len),
            seed=1234,
            batch_size=4,
            buffer_size=64,
            open_shards=4,
            num_workers=2,
            manifest_cache=str(cache_dir),
        )
        kw.update(overrides)
        return DataConfig(**kw)

    return make


# -- reference runs shared by tests/integration/test_resume.py and test_faults.py (tests/training_runs.py) --------
#
# Trained once per session. Under pytest-xdist (scripts/test.sh runs the suite on several workers) the
# first worker that needs one trains it under a file lock in the folder all workers share, and the
# others wait for it and read it: a reference run costs one training, whichever worker asks.


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    base = tmp_path_factory.getbasetemp()  # under xdist: <session folder>/popen-gw<N>
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "reference_runs"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def env(cache_dir) -> dict:
    """The environment of training subprocesses: the session's manifest cache, wandb offline."""
    from training_runs import run_env

    return run_env(cache_dir)


# -- for the modules that train, kill and resume in subprocesses (test_resume, test_faults) --------


@pytest.fixture(scope="module")
def workdir(request, tmp_path_factory, demo_corpus) -> Path:
    """One working folder per module, where configs/demo.yaml's relative corpus globs resolve."""
    from training_runs import make_workdir

    return make_workdir(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]), demo_corpus)


@pytest.fixture(scope="module")
def kill_rng():
    """Where the kills land: random per run, printed, and replayable with WELLMIXED_KILL_SEED."""
    seed = int(os.environ.get("WELLMIXED_KILL_SEED", random.randrange(10**6)))
    print(f"WELLMIXED_KILL_SEED={seed}")
    return seed, random.Random(seed)


def _shared_run(root: Path, demo_corpus: Path, env: dict, name: str, args: list[str]):
    from filelock import FileLock
    from training_runs import make_workdir, order_log, run_to_end

    run_dir = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (root / f"{name}.done").exists():
            shutil.rmtree(run_dir, ignore_errors=True)  # a run interrupted in an earlier attempt
            run_to_end(make_workdir(root / "work", demo_corpus), run_dir, args, env, name)
            (root / f"{name}.done").touch()
    return run_dir, order_log(run_dir)


@pytest.fixture(scope="session")
def ref_single(runs_root, demo_corpus, env):
    """The uninterrupted TINY run: 1 process, 2 DataLoader workers, a checkpoint every 3 steps, all
    kept. (run_dir, rank -> order-log lines); tests copy what they change, never write into it."""
    from training_runs import TINY

    return _shared_run(runs_root, demo_corpus, env, "ref_single", TINY)


@pytest.fixture(scope="session")
def ref_ddp(runs_root, demo_corpus, env):
    """The uninterrupted TINY run on 2 DDP ranks (gloo), 2 DataLoader workers each, micro-batch 2 x 2
    ranks; a checkpoint at step 9 (the elastic-resume test starts from it)."""
    from training_runs import DDP, TINY

    return _shared_run(runs_root, demo_corpus, env, "ref_ddp", TINY + DDP + ["--run.ckpt_every_n_steps", "9"])


@pytest.fixture(autouse=True)
def _restore_environ():
    """Every test leaves os.environ as it found it. Lightning writes MASTER_ADDR / MASTER_PORT /
    NODE_RANK into os.environ when a Trainer is built under an (injected) SLURM environment; leaked
    into later tests, the DDP subprocesses they start try to rendezvous with a fake host and hang."""
    saved = dict(os.environ)
    rank = _rank_zero_only_rank()
    yield
    from train.signals import disarm_fatal_exit

    disarm_fatal_exit()  # a test that ran the CLI's main() in-process must not leave its fatal-exit watchdog
    os.environ.clear()
    os.environ.update(saved)
    if rank is not None:  # a Trainer built under an injected SLURM rank 5 leaves rank_zero_only.rank = 5:
        _set_rank_zero_only_rank(rank)  # a later logger test in this process would then write nothing


def _rank_zero_only_rank() -> int | None:
    if "lightning_utilities.core.rank_zero" not in sys.modules:
        return None
    return getattr(sys.modules["lightning_utilities.core.rank_zero"].rank_zero_only, "rank", None)


def _set_rank_zero_only_rank(rank: int) -> None:
    for name in ("lightning_utilities.core.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning.pytorch.utilities.rank_zero"):
        if name in sys.modules:
            sys.modules[name].rank_zero_only.rank = rank
