"""Numbers for people: the one formatter of counts and durations that plans, logs and benchmarks print."""

from __future__ import annotations


def human(n: float) -> str:
    """``20.00B``, ``1.23M``, ``512.00K``; plain below a thousand (tokens, documents, tok/s, bytes)."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}"


def duration(seconds: float) -> str:
    """``1h02m``, ``3m05s``, ``42s``."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
