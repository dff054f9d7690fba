"""Every entry point shares ``train fit``'s error path: a refusal (``data.errors.WellMixedError``: a bad
config, a corrupt corpus file, a corrupt tokenizer file) is one ``error:`` line naming the file, exit
status 2, no traceback; run outside the environment, a script or ``python -m train`` says how to set it up.

The tools run in-process through their ``main(argv)`` on a tiny corpus written here.
"""

from __future__ import annotations

import ast
import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from scripts_in_process import load_script

from data import tokenizer
from data.errors import ConfigError, DataError, TokenizerError, WellMixedError, error_lines, one_line_errors
from data.files import LinkRefused, WriteError
from data.tokenizer import CL100K_URL, cl100k_encoding

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [f"document {i} has a few words in it" for i in range(600)]


def write_corpus(folder: Path, texts: list, compression: str | None = "snappy") -> Path:
    """One source, one file of 600 rows in row groups of 300 (texts may be bytes: not checked as UTF-8)."""
    n = len(texts)
    if isinstance(texts[0], bytes):  # parquet writes whatever bytes a string column holds
        offsets = np.cumsum([0] + [len(t) for t in texts]).astype(np.int32)
        text = pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets.tobytes()),
                                                      pa.py_buffer(b"".join(texts))])
    else:
        text = pa.array(texts, pa.string())
    table = pa.table({"source": ["web"] * n, "date": ["2024-01-01"] * n, "text": text,
                      "token_count": pa.array([8] * n, pa.int64()), "category": ["web"] * n})
    path = folder / "web" / "a.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(table, path, row_group_size=300, compression=compression)
    fixed = {"mixture": {"weights": {"web": 1.0}}, "seq_len": {"start": 64, "end": 64, "warmup_steps": 0},
             "anneal_start": 1.0}
    data = {"sources": {"web": {"paths": [str(folder / "web" / "*.parquet")]}}, "schedule": fixed,
            "seed": 1, "batch_size": 2, "buffer_size": 8, "open_shards": 1, "num_workers": 1,
            "min_chunks_per_source": 1, "manifest_cache": str(folder / "cache")}
    (folder / "config.yaml").write_text(yaml.safe_dump({"data": data, "model": {"lr": {"warmup_steps": 0}}}))
    return path


@pytest.fixture(scope="module")
def dump_order():
    return load_script("dump_order")


def one_error_line(err: str) -> str:
    """The stderr of a refusal: one ``error:`` line, the last one, and no traceback."""
    assert "Traceback" not in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0], err
    return errors[0]


def run_dump(dump_order, folder: Path, capsys) -> str:
    assert dump_order.main(["--config", str(folder / "config.yaml"), "--steps", "100",
                            "--out", str(folder / "order.jsonl")]) == 2
    assert not (folder / "order.jsonl").exists()
    return one_error_line(capsys.readouterr().err)


def test_dump_order_names_the_row_of_a_null_text(dump_order, tmp_path, capsys):
    texts = list(TEXTS)
    texts[5] = None
    path = write_corpus(tmp_path, texts)
    line = run_dump(dump_order, tmp_path, capsys)
    assert f"{path}:0:5" in line and "null `text`" in line and "data.on_bad_shard: skip" in line


def test_dump_order_names_the_row_of_text_that_is_not_utf8(dump_order, tmp_path, capsys):
    """Row 299 of row group 0: past the rows the manifest's token-count sample reads (the first 256 of
    a row group), so the reader finds it."""
    texts = [t.encode() for t in TEXTS]
    texts[299] = b"document 299 \xff\xfe is broken"
    path = write_corpus(tmp_path, texts)
    line = run_dump(dump_order, tmp_path, capsys)
    assert f"{path}:0:299: `text` cannot be decoded" in line and "UTF-8" in line


def test_dump_order_names_the_file_and_row_group_of_a_corrupt_text_page(dump_order, tmp_path, capsys):
    """Bytes overwritten inside the text column's page, behind an intact footer: the start-up
    token_count sample reads that page, so the refusal comes before compute, naming file and row group.
    A page the sample does not read is named by the reader (``text`` unreadable) when it gets there."""
    path = write_corpus(tmp_path, TEXTS, compression=None)
    raw = bytearray(path.read_bytes())
    at = raw.find(b"document 3 has")
    raw[at - 16:at + 48] = b"\xee" * 64
    path.write_bytes(bytes(raw))
    line = run_dump(dump_order, tmp_path, capsys)
    assert f"{path}: row group 0: unreadable (" in line and "start-up token_count sample" in line, line
    assert "remove it from the corpus" in line


def test_dump_order_names_a_corrupt_tokenizer_cache_file(dump_order, tmp_path, capsys, monkeypatch):
    write_corpus(tmp_path / "corpus", TEXTS)
    cache = tmp_path / "tiktoken"
    cache.mkdir()
    bad = cache / hashlib.sha1(CL100K_URL.encode()).hexdigest()
    bad.write_bytes(b"not a BPE file\n")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    cl100k_encoding.cache_clear()
    tokenizer._build.cache_clear()  # the built tokenizer too: loaded again, as in a new process
    try:
        line = run_dump(dump_order, tmp_path / "corpus", capsys)
    finally:
        cl100k_encoding.cache_clear()  # later tests load the real file again
        tokenizer._build.cache_clear()
    assert line.startswith(f"error: TIKTOKEN_CACHE_DIR: {bad}: sha256") and "delete that file" in line


def test_inspect_corpus_names_a_file_that_is_not_parquet(tmp_path, capsys):
    write_corpus(tmp_path, TEXTS)
    bad = tmp_path / "web" / "b.parquet"
    bad.write_bytes(b"PAR1 cut short by a failed download")
    assert load_script("inspect_corpus").main([str(tmp_path)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {bad}: not a readable parquet file (") and "--pattern" in line


def test_one_error_family_under_one_base():
    for cls in (ConfigError, DataError, TokenizerError, LinkRefused, WriteError):
        assert issubclass(cls, WellMixedError), cls
    assert issubclass(DataError, ConfigError) and issubclass(DataError, RuntimeError)  # old except clauses hold
    assert issubclass(TokenizerError, RuntimeError) and issubclass(ConfigError, ValueError)


def test_one_line_errors_prints_each_problem_as_an_error_line_and_lets_bugs_through(capsys):
    @one_line_errors
    def refuses(argv=None) -> int:
        raise ConfigError("a.yaml: data.seed must be an integer\n  (got 'x')\nb.yaml: data.sources is missing")

    assert refuses([]) == 2
    assert capsys.readouterr().err == ("error: a.yaml: data.seed must be an integer\n  (got 'x')\n"
                                       "error: b.yaml: data.sources is missing\n")
    assert error_lines(ConfigError("one")) == "error: one"

    class Other(ValueError):
        pass

    @one_line_errors(also=(Other,))
    def also(argv=None) -> int:
        raise Other("model.d_model must be a positive integer (got 0)")

    assert also([]) == 2 and capsys.readouterr().err == "error: model.d_model must be a positive integer (got 0)\n"

    @one_line_errors
    def bug(argv=None) -> int:
        raise KeyError("a bug keeps its traceback")

    with pytest.raises(KeyError):
        bug([])


def test_an_error_from_a_dataloader_worker_is_its_own_line_without_the_worker_traceback():
    """torch re-raises a worker's DataError in the main process with the worker's whole traceback as
    its message; ``train fit`` prints the original line and the worker."""
    from torch._utils import ExceptionWrapper

    try:
        try:
            raise OSError("Unexpected end of stream")
        except OSError as cause:
            raise DataError("f.parquet: row group 3: `text` unreadable: Unexpected end of stream; fix it") from cause
    except DataError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 1")
    with pytest.raises(DataError) as info:
        wrapped.reraise()
    assert "Original Traceback" in str(info.value)
    assert error_lines(info.value) == ("error: f.parquet: row group 3: `text` unreadable: Unexpected end of stream; "
                                       "fix it (in DataLoader worker process 1)")


def test_the_ablation_report_refuses_a_folder_without_runs_in_one_line(tmp_path, capsys):
    """Before: a SystemExit from deep inside the report (exit 1); now the family's line, exit 2."""
    from ablations.report import main

    assert main([str(tmp_path), "--suite", "heldout"]) == 2
    assert f"{tmp_path} holds no pair of scheduled-seed<S>/ and fixed-seed<S>/" in one_error_line(
        capsys.readouterr().err)


ENTRY_POINTS = [*(p for p in sorted((ROOT / "scripts").glob("*.py")) if not p.name.startswith(("_", "bench_"))),
                ROOT / "ablations" / "run.py", ROOT / "ablations" / "report.py"]


@pytest.mark.parametrize("path", ENTRY_POINTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_entry_point_shares_the_one_line_error_path(path):
    """Each ``main`` is wrapped by ``one_line_errors`` (decorated, or ``main = one_line_errors(...)``)."""
    tree = ast.parse(path.read_text())

    def names(node) -> set[str]:
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}

    wrapped = any(isinstance(n, ast.FunctionDef) and n.name == "main"
                  and any("one_line_errors" in names(d) for d in n.decorator_list) for n in tree.body)
    assigned = any(isinstance(n, ast.Assign) and [getattr(t, "id", "") for t in n.targets] == ["main"]
                   and "one_line_errors" in names(n.value) for n in tree.body)
    assert wrapped or assigned


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "scripts").glob("*.py") if p.name != "_env.py"),
                         ids=lambda p: p.name)
def test_every_script_checks_the_environment_before_its_first_import(path):
    tree = ast.parse(path.read_text())
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.Try))
               and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
    first = imports[0]
    assert isinstance(first, ast.Try) and ast.unparse(first.body[0]) == "import _env", path.name


def test_a_python_without_the_environment_is_told_how_to_set_it_up(tmp_path):
    """``python scripts/plan.py`` (from another folder) and ``python -m train`` (from the repository)
    with a Python that has none of the packages (``-S``: no site-packages; ``-E``: no PYTHONPATH)."""
    py = sys.executable
    shell = (f'"{py}" -S -E "{ROOT}/scripts/plan.py" --config configs/demo.yaml; echo "rc $?"; '
             f'cd "{ROOT}" && "{py}" -S -E -m train fit --config configs/demo.yaml; echo "rc $?"')
    r = subprocess.run(["sh", "-c", shell], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["rc", "2", "rc", "2"], (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    script, module = r.stderr.splitlines()
    assert script.startswith(f"error: {py} has no module named ") and "numpy" in script
    assert script.endswith(f"{ROOT / '.venv' / 'bin' / 'python'} {ROOT}/scripts/plan.py ...`")
    assert "bash scripts/setup.sh" in module and "`.venv/bin/python -m train ...`" in module and "torch" in module
