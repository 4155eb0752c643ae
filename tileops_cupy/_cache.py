"""Thread-safe build-once maps: compiled modules, shared tables, device flags."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any


def build_once(cache: dict, lock: threading.Lock, key: Hashable, build: Callable[[], Any]) -> Any:
    """``cache[key]``, made by ``build()`` under ``lock`` the first time. The common path
    (already built) takes no lock; the second look under the lock makes sure two threads
    never build the same key twice."""
    value = cache.get(key)
    if value is None:
        with lock:
            value = cache.get(key)
            if value is None:
                value = cache[key] = build()
    return value
