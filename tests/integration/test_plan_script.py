"""scripts/plan.py: table on stdout, PNG on disk. The first test runs it as a user does (a subprocess
from the repo root); the others call its ``main`` in this process (torch and Lightning imported once)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from scripts_in_process import load_script

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["web", "code", "books", "curated"]  # the demo corpus's sources
REAL_SOURCES = ["web", "code", "pdfs", "curated"]  # configs/pretrain_350m_20b.yaml's

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_plan(*args: str, cache_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DOLMA3_DIR"}  # the 350M globs must find nothing
    env["WELLMIXED_CACHE"] = str(cache_dir)
    return subprocess.run([sys.executable, "scripts/plan.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def plan(cache_dir, monkeypatch, capsys):
    """``plan(*args) -> (exit code, stdout, stderr)``: scripts/plan.py's main in this process, from the
    repo root, with the environment of :func:`run_plan`."""
    main = load_script("plan").main
    monkeypatch.delenv("DOLMA3_DIR", raising=False)
    monkeypatch.setenv("WELLMIXED_CACHE", str(cache_dir))
    monkeypatch.chdir(ROOT)

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            rc = main(list(args))
        except SystemExit as e:  # the config parser's refusal, as `python scripts/plan.py` exits with it
            rc = e.code
        out = capsys.readouterr()
        return rc, out.out, out.err

    return run


def table_rows(stdout: str) -> dict[str, list[str]]:
    """source -> [available, drawn, epochs, phase shares...] from the printed table (the first one; the
    effective-streams table follows it)."""
    table = stdout.split("effective streams")[0]
    return {line.split()[0]: line.split()[1:] for line in table.splitlines()
            if line.split() and line.split()[0] in SOURCES + REAL_SOURCES}


def test_demo_config_on_demo_corpus(demo_corpus, cache_dir, tmp_path):
    """The demo config with --corpus: the table has every source, the PNG is a real image."""
    out = tmp_path / "plan.png"
    r = run_plan("--config", "configs/demo.yaml", "--corpus", str(demo_corpus), "--out", str(out), cache_dir=cache_dir)
    assert r.returncode == 0, r.stderr
    assert "corpus manifest" in r.stdout
    rows = table_rows(r.stdout)
    assert sorted(rows) == sorted(SOURCES)
    for source, cells in rows.items():
        assert len(cells) == 5, (source, cells)  # available, drawn, epochs, stable share, anneal share
        assert float(cells[2]) > 0
    assert re.search(r"total steps\s+[\d,]+ x 4 sequences", r.stdout)
    assert "anneal @" in r.stdout
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_350m_uses_expected_tokens(plan, tmp_path):
    """Without the Dolma3 download the published counts give the epochs: each well under one."""
    out = tmp_path / "plan.png"
    rc, stdout, stderr = plan("--config", "configs/pretrain_350m_20b.yaml", "--out", str(out))
    assert rc == 0, stderr
    assert "data.expected_tokens" in stdout
    rows = table_rows(stdout)
    assert sorted(rows) == sorted(REAL_SOURCES)
    epochs = {s: float(cells[2]) for s, cells in rows.items()}
    assert all(0 < e < 1 for e in epochs.values()), epochs
    assert "warning:" not in stdout
    assert out.read_bytes().startswith(PNG_MAGIC)
    # the memory plan of the real model at the config's micro-batch (32 x 2048): chunked fits, plain not
    assert "data.batch_size 32 x 2048 tokens" in stdout
    mem = [ln for ln in stdout.splitlines() if ln.strip().startswith("model.loss_impl")]
    assert len(mem) == 4 and "<- this config" in mem[0] and mem[0].split()[-4:-3] != ["DOES"]
    assert "DOES NOT FIT" in mem[2]  # plain loss, no checkpointing: 177 GB


def test_tokens_flag_warns_about_epochs(plan, tmp_path):
    """--tokens overrides the counts; a source drawn more than --max-epochs times is warned about."""
    rc, stdout, stderr = plan("--config", "configs/pretrain_350m_20b.yaml", "--out", str(tmp_path / "p.png"),
                              "--tokens", "web=2e11,code=2e10,pdfs=4e10,curated=1e8")
    assert rc == 0, stderr
    assert float(table_rows(stdout)["curated"][2]) > 4
    assert "warning: source 'curated' would be repeated" in stdout
    rc, _, stderr = plan("--config", "configs/pretrain_350m_20b.yaml", "--out", str(tmp_path / "p.png"),
                         "--tokens", "web=2e11,code=2e10,pdfs=4e10,curated=1e8", "--strict")
    assert rc == 2 and "curated" in stderr


def test_a_token_count_may_be_written_as_a_whole_float(plan, tmp_path):
    """plan's own example ``--data.schedule.train_tokens 2e9`` failed ("Expected int, got 2000000000.0"), as did
    ``train_tokens: 3.6e3`` in a config file: a whole number in float notation plans what the integer plans (steps
    too); a fraction is refused naming the key."""
    args = ["--config", "configs/pretrain_350m_20b.yaml", "--out", str(tmp_path / "p.png")]
    rc, as_int, stderr = plan(*args, "--data.schedule.train_tokens", "2000000000")
    assert rc == 0, stderr
    assert plan(*args, "--data.schedule.train_tokens", "2e9")[:2] == (0, as_int)
    (tmp_path / "floats.yaml").write_text("data:\n  schedule:\n    train_tokens: 2.0e9\n"
                                          "model:\n  lr: {warmup_steps: 2.0e3}\n")
    rc, stdout, stderr = plan(*args, "--config", str(tmp_path / "floats.yaml"))
    assert rc == 0 and stdout.split("\n", 1)[1] == as_int.split("\n", 1)[1], stderr  # the first line names the files
    rc, _, stderr = plan(*args, "--data.schedule.train_tokens", "2.5e0")
    assert rc == 2 and stderr.strip() == ("error: data.schedule.train_tokens: Not of type Count: expected a whole "
                                          "number, got 2.5"), stderr


def test_bad_config_exits_2(plan, tmp_path):
    bad = tmp_path / "bad.yaml"
    text = (
        (ROOT / "configs/pretrain_350m_20b.yaml").read_text().replace("web: 0.62, code: 0.18", "web: 0.70, code: 0.18")
    )
    bad.write_text(text)
    rc, _, stderr = plan("--config", str(bad), "--out", str(tmp_path / "p.png"))
    assert rc == 2
    assert stderr.startswith("error: ") and "weights sum to" in stderr
    assert not (tmp_path / "p.png").exists()

    rc, _, stderr = plan("--config", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "p.png"))
    assert rc == 2 and "error: " in stderr

    rc, _, stderr = plan("--config", "configs/demo.yaml", "--corpus", str(tmp_path), "--out", str(tmp_path / "p.png"))
    assert rc == 2 and "--corpus" in stderr
