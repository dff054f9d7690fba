"""The one formatter of counts and durations (data/formatting.py)."""

from data.formatting import duration, human


def test_counts_take_the_largest_unit_below_them():
    assert [human(x) for x in (999, 1_000, 1_234_567, 20e9, 3.5e12, -2_000)] == [
        "999", "1.00K", "1.23M", "20.00B", "3.50T", "-2.00K"]


def test_durations_read_as_hours_minutes_seconds():
    assert [duration(x) for x in (0.4, 42, 185, 3_720, 90_000)] == ["0s", "42s", "3m05s", "1h02m", "25h00m"]
