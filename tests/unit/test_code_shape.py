"""The code's shape holds (scripts/complexity.py, radon): no function over 60 lines and at most 5 blocks at
cyclomatic complexity D or worse in data/, train/, ablations/ and scripts/ (tests are not counted).

A function that grows past either limit is cut into named steps, not added to an allow-list.
"""

from __future__ import annotations

import pytest
from scripts_in_process import load_script

MAX_LINES, WORST_RANK, MAX_COMPLEX_BLOCKS = 60, "D", 5


def test_no_function_over_60_lines_and_at_most_5_blocks_at_complexity_d():
    pytest.importorskip("radon", reason="radon is in the dev extra (scripts/setup.sh installs it)")
    complexity = load_script("complexity")
    long, complex_ = [], []
    for path in complexity.python_files(list(complexity.DEFAULT_FOLDERS)):
        _, file_long, file_complex = complexity.measure(path, MAX_LINES, WORST_RANK)
        long += file_long
        complex_ += file_complex
    assert not long, "cut these into named steps:\n" + "\n".join(long)
    assert len(complex_) <= MAX_COMPLEX_BLOCKS, "simplify these:\n" + "\n".join(complex_)


def test_the_measure_sees_a_long_complex_function(tmp_path):
    pytest.importorskip("radon")
    complexity = load_script("complexity")
    body = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(40))
    path = tmp_path / "long.py"
    path.write_text(f"def f(x):\n{body}    return -1\n")
    _, long, complex_ = complexity.measure(path, MAX_LINES, WORST_RANK)
    assert len(long) == 1 and "82 lines" in long[0]
    assert len(complex_) == 1 and " F (41)" in complex_[0]
