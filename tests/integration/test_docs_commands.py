"""Every command in the README and docs/ parses as written: the script exists, its flags are known,
its required arguments are given, and every ``--config`` file exists.

Commands are taken from the ```bash blocks of README.md, docs/*.md and ablations/README.md (backslash
continuations joined, comments stripped). A ``python scripts/X.py ...`` or ``python ablations/X.py``
command runs in a subprocess whose argparse stops right after parsing (nothing is computed); ``python
-m train fit ...`` runs with ``--print_config`` (LightningCLI parses and validates everything, then
exits); ``bash``/``sbatch`` commands name a file that must exist.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "ablations" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

PARSE_ONLY = """
import argparse, runpy, sys
real = argparse.ArgumentParser.parse_args
def parse_then_stop(self, *a, **k):
    real(self, *a, **k)
    sys.exit(0)
argparse.ArgumentParser.parse_args = parse_then_stop
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def commands() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S):
            text = re.sub(r"\\\n\s*", " ", block)
            for line in text.splitlines():
                line = line.split(" #")[0].strip()
                if re.match(r"^(python|bash|sbatch) ", line) and "<" not in line:
                    out.append((f"{doc.relative_to(ROOT)}: {line[:70]}", line))
    return out


COMMANDS = commands()


def test_the_docs_hold_commands():
    assert len(COMMANDS) >= 20 and any("python -m train fit" in c for _, c in COMMANDS)


@pytest.mark.parametrize("line", [c for _, c in COMMANDS], ids=[i for i, _ in COMMANDS])
def test_command_parses_as_written(line, tmp_path):
    env = {**os.environ, "DOLMA3_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    args = shlex.split(os.path.expandvars(line.replace("$DOLMA3_DIR", str(tmp_path))))
    if args[0] in ("bash", "sbatch"):
        assert (ROOT / args[1]).is_file(), f"{args[1]} does not exist"
        return
    for i, a in enumerate(args[:-1]):
        if a == "--config":
            assert (ROOT / args[i + 1]).is_file(), f"--config {args[i + 1]} does not exist"
    if args[1:3] == ["-m", "train"]:
        cmd = [sys.executable, *args[1:], "--print_config"]
    else:
        assert (ROOT / args[1]).is_file(), f"{args[1]} does not exist"
        cmd = [sys.executable, "-c", PARSE_ONLY, *args[1:]]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{line}\n{r.stderr[-2000:]}"
