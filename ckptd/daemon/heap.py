"""Bounding the daemon's heap (issue 21: RSS 64 -> 327 MB over 80 small dumps).

glibc's malloc gives threads arenas of their own (up to 8 per core), and an arena keeps what
was freed in it: each operation runs in a thread of its own, so the freed memory of many
operations stays resident. ``limit_arenas`` caps their number (``mallopt(M_ARENA_MAX)``), at
the daemon's start, before its threads; ``trim`` hands freed memory back to the kernel
(``malloc_trim(0)``), called once each dump, restore or migration has ended.

Invariants: neither ever raises; on a C library without them (musl) both do nothing; an
operator's ``MALLOC_ARENA_MAX`` in the environment wins over ``limit_arenas``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

log = logging.getLogger("ckptd")

M_ARENA_MAX = -8
"""glibc's mallopt parameter number (malloc.h)."""
ARENA_MAX = 2
"""The daemon's arenas: the main one and one that its many short-lived threads share."""

_lock = threading.Lock()


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None
    return libc


_LIBC = _libc()


def limit_arenas(arena_max: int) -> bool:
    """Cap glibc's malloc arenas at ``arena_max`` (unless ``MALLOC_ARENA_MAX`` is set);
    whether the cap is in force. Call it before the threads that would make arenas."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return True
    if _LIBC is None or arena_max <= 0:
        return False
    try:
        return bool(_LIBC.mallopt(ctypes.c_int(M_ARENA_MAX), ctypes.c_int(arena_max)))
    except (OSError, AttributeError) as exc:  # pragma: no cover - glibc has both
        log.debug("mallopt(M_ARENA_MAX) failed: %s", exc)
        return False


def trim() -> None:
    """Give the memory malloc holds freed back to the kernel (one trim at a time)."""
    if _LIBC is None:
        return
    with _lock:
        try:
            _LIBC.malloc_trim(ctypes.c_size_t(0))
        except (OSError, AttributeError) as exc:  # pragma: no cover - glibc has it
            log.debug("malloc_trim failed: %s", exc)
