"""Thread-safe build-once maps (compiled modules, shared tables, device flags), the bound
on ops rebuilt behind the dispatcher (:data:`TWINS`), an op's launch records
(:class:`LaunchRecords`), and what an op keeps of them when it is copied or pickled
(:class:`ProcessLocal`)."""

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


# The torch custom ops carry an op by value; behind the dispatcher each configuration runs
# on a twin rebuilt from it, of which the TWINS most recently used are kept (objects made
# per call share their configuration's twin, and configurations may change every step, as
# an mHC op's alphas passed as numbers: they leave nothing behind).
TWINS = 256


class LaunchRecords(dict):
    """An op's recorded launches by the layout of its arguments (see the ops' direct
    paths), the oldest forgotten once it holds :attr:`KEPT`: a server or a trainer whose
    batch and sequence lengths change call after call would otherwise keep one launch (for
    mHC also a few bytes of device memory) per layout for as long as the op lives. A
    forgotten layout is validated and planned again at its next call. Lookups are a plain
    dict's; only a new record pays for the bound. (mHC's per-stream workspaces are bounded
    the same way.)"""

    KEPT = 256

    def __setitem__(self, key: Hashable, value: Any) -> None:
        # one writer at a time (threads calling one op): unlocked, two could forget the same
        # oldest record and both add theirs, past the bound for good
        with _records_lock:
            while len(self) >= self.KEPT and key not in self:
                del self[next(iter(self))]  # (dicts keep insertion order: the oldest)
            super().__setitem__(key, value)


_records_lock = threading.Lock()  # (every op's records: only a new record takes it)


class ProcessLocal:
    """An op whose state splits in two: its arguments, and what it holds for this process
    alone (handles to shared tables and to its configuration's device error flag, the
    ``config`` that names that flag, the launches it recorded), made by ``_start()``. A copy
    or a pickle carries the arguments and makes the rest anew, so ``copy.deepcopy`` of a
    model, ``torch.save`` and multiprocessing work, and a copy never shares launch records
    with its original (nor holds locks or device pointers of another process)."""

    _process_state: ClassVar[frozenset[str]]  # the attributes _start() makes

    def _start(self) -> None:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._process_state}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start()
