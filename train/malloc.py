"""glibc allocator tuning for CPU training (called before torch allocates anything big)."""

import ctypes


def keep_freed_memory() -> None:
    """Stop glibc from unmapping large freed blocks: every step allocates and frees the [B, L, V]
    logits (hundreds of MB), and page-faulting them back in costs more system time than the
    model's own compute on CPU (measured: 0.65 s vs 1.36 s per demo step)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to tune
        return
    big = ctypes.c_int(2**31 - 1)
    libc.mallopt(-3, big)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, big)  # M_TRIM_THRESHOLD


