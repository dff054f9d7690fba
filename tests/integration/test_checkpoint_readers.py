"""Fault injection: every reader of a checkpoint -- ``train fit``'s resume, scripts/evaluate.py,
scripts/export_hf.py and the ablation report's mixer check -- takes the same corrupt files to the same
verdict, with the same one-line message (train/checkpoint.py).

The files are made from one real checkpoint (``last.ckpt`` of the shared reference run, with its data
cursors), one folder per fault. Readers run in-process through their ``main(argv)``; where a reader
accepts the file and would go on to train or evaluate, the verification step it calls is asserted instead.
(scripts/diagnose_run.py reads no checkpoint: metrics, order logs and the config only.) A checkpoint without
its sidecar is refused by all of them alike (its bytes cannot be verified).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from scripts_in_process import load_script
from training_runs import TINY, copy_checkpoint

from train.checkpoint import CheckpointError, checksum_path

pytestmark = pytest.mark.slow  # the shared reference run (tests/conftest.py ref_single) trains once per session

FAULTS = {
    "truncated": "truncated or corrupt (its zip index cannot be read)",
    "flipped_byte": "does not match last.ckpt.sha256",
    "malformed_sidecar": "its sidecar last.ckpt.sha256 is malformed",
    "not_a_checkpoint": "a text file (YAML? a config?), not a checkpoint",
    "missing_sidecar": "no sidecar last.ckpt.sha256, so its bytes cannot be verified",
    "flipped_without_sidecar": "no sidecar last.ckpt.sha256, so its bytes cannot be verified",
}


def _damage(path: Path, fault: str) -> None:
    data = bytearray(path.read_bytes())
    if fault == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif fault == "flipped_byte":
        data[len(data) // 2] ^= 0x01  # tensor bytes: the file still loads, with one wrong value
        path.write_bytes(bytes(data))
    elif fault == "malformed_sidecar":
        checksum_path(path).write_text("not-a-digest  last.ckpt\n")
    elif fault == "not_a_checkpoint":
        shutil.copy(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml", path)
    elif fault == "missing_sidecar":
        checksum_path(path).unlink()
    elif fault == "flipped_without_sidecar":  # before: 8 steps of other losses, or a PytorchStreamReader traceback
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        checksum_path(path).unlink()


@pytest.fixture(scope="module")
def damaged(ref_single, tmp_path_factory) -> dict[str, Path]:
    """fault -> a run directory whose checkpoints/last.ckpt (with its cursors) has that fault."""
    ref_dir, _ = ref_single
    root = tmp_path_factory.mktemp("damaged")
    out = {}
    for fault in FAULTS:
        run_dir = root / fault
        last = copy_checkpoint(ref_dir / "checkpoints" / "last.ckpt", run_dir / "checkpoints")
        shutil.copy(checksum_path(ref_dir / "checkpoints" / "last.ckpt"), checksum_path(last))
        _damage(last, fault)
        out[fault] = run_dir
    return out


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err and "weights_only" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0].removeprefix("error: ")


def _train(run_dir: Path, capsys, monkeypatch) -> str:
    from train.cli import main

    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    last = run_dir / "checkpoints" / "last.ckpt"
    assert main(["fit", *TINY, "--run.dir", str(run_dir), "--ckpt_path", str(last)]) == 2
    return _one_error_line(capsys.readouterr().err)


def _evaluate(run_dir: Path, capsys, monkeypatch) -> str:
    from train.tools.evaluate import main

    assert main([str(run_dir), "--tasks", "", "--no-log", "--out", str(run_dir / "evals")]) == 2
    return _one_error_line(capsys.readouterr().err)


def _export(run_dir: Path, capsys, monkeypatch) -> str:
    main = load_script("export_hf").main

    last = run_dir / "checkpoints" / "last.ckpt"
    assert main([str(last), "--out", str(run_dir / "hf"), "--no-tokenizer-json"]) == 2
    assert not (run_dir / "hf").exists()
    return _one_error_line(capsys.readouterr().err)


def _report(run_dir: Path, capsys, monkeypatch) -> str:
    from ablations.outcomes import final_mixer_state

    with pytest.raises(CheckpointError) as info:
        final_mixer_state(run_dir, ["web", "code", "books", "curated"])
    assert "\n" not in str(info.value)
    return str(info.value)


READERS = {"train fit --ckpt_path": _train, "evaluate.py": _evaluate, "export_hf.py": _export,
           "ablation report": _report}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_every_checkpoint_reader_refuses_a_damaged_checkpoint_with_the_same_line(fault, damaged, capsys,
                                                                                  monkeypatch):
    """Before: evaluate and export loaded a file whose sidecar failed (1,024 corrupt embedding values were
    exported), a malformed sidecar counted as none, and a truncated or YAML file gave torch tracebacks."""
    last = damaged[fault] / "checkpoints" / "last.ckpt"
    problems = {}
    for name, reader in READERS.items():
        line = reader(damaged[fault], capsys, monkeypatch)
        assert f"{last}: " in line, (name, line)
        problems[name] = line.split(f"{last}: ", 1)[1].split(";")[0]
    assert len(set(problems.values())) == 1, problems  # one verdict, word for word
    assert FAULTS[fault] in next(iter(problems.values()))


def test_a_checkpoint_without_sidecar_is_used_only_when_accepted_and_then_named(damaged, caplog, tmp_path):
    """Before: every reader used it after a generic warning. Now each refuses it (above); train fit takes
    it with --run.allow_unverified_ckpt true, logged, and every reader once its sidecar is written (the
    way out the refusal gives)."""
    import hashlib

    from ablations.outcomes import final_mixer_state
    from train import checkpoint

    run_dir = damaged["missing_sidecar"]
    last = run_dir / "checkpoints" / "last.ckpt"
    checkpoint._WARNED.clear()
    with caplog.at_level("WARNING", logger="wellmixed"):
        assert checkpoint.resolve_checkpoint(str(last), last.parent, fallback=False, unverified_ok=True) == str(last)
    assert [r.getMessage() for r in caplog.records if "no sidecar" in r.getMessage()] == [
        f"checkpoint {last}: no sidecar last.ckpt.sha256, so its bytes cannot be verified (written before checksums, "
        "or a kill between its rename and the sidecar); used as it opens (--run.allow_unverified_ckpt true)"]
    with pytest.raises(CheckpointError, match=r"if you trust it, write its sidecar \(in .*: sha256sum last.ckpt > "
                                              r"last.ckpt.sha256\)$"):
        final_mixer_state(run_dir, ["web", "code", "books", "curated"])
    checksum_path(last).write_text(f"{hashlib.sha256(last.read_bytes()).hexdigest()}  last.ckpt\n")
    assert final_mixer_state(run_dir, ["web", "code", "books", "curated"]).step > 0
