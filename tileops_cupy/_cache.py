"""Thread-safe build-once maps (compiled modules, shared tables, device flags), and what an
op keeps of them when it is copied or pickled (:class:`ProcessLocal`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, ClassVar


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


class ProcessLocal:
    """An op whose state splits in two: its arguments, and what it holds for this process
    alone (handles to shared tables, the launches it recorded, its device error flag and
    the ``config`` that names that flag), made by ``_start()``. A copy or a pickle carries
    the arguments and makes the rest anew, so ``copy.deepcopy`` of a model, ``torch.save``
    and multiprocessing work, and a copy never shares launch records or a flag with its
    original (nor holds locks or device pointers of another process)."""

    _process_state: ClassVar[frozenset[str]]  # the attributes _start() makes

    def _start(self) -> None:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._process_state}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start()
