"""What the code's own text may say: comments and docstrings describe the code as it is now.

Issue numbers and before/after stories belong in CHANGELOG.md and the commit log; a comment that says
"fixed in issue 15" tells a forker nothing about what the line does.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("data", "train", "ablations", "scripts")
ISSUE = re.compile(r"\b(?:issue|task)\s*#?\d+|\bgh-\d+", re.IGNORECASE)


def source_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_issue_numbers_in_code_text():
    hits = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for path in source_files()
            for i, line in enumerate(path.read_text().splitlines(), 1) if ISSUE.search(line)]
    assert not hits, "say what the code does; the CHANGELOG says what changed:\n" + "\n".join(hits)


def test_the_rule_sees_an_issue_number():
    assert ISSUE.search("# feeding the unchanged step crashed, issue 15")
    assert ISSUE.search("see task #27") and not ISSUE.search("an issue with the reader")
