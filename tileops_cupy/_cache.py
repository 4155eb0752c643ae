"""Thread-safe build-once maps (compiled modules, shared tables, device flags) and the
package's locks (:class:`ForkSafeLock`), the bound on ops rebuilt behind the dispatcher
(:data:`TWINS`), an op's launch records (:class:`LaunchRecords`), and what an op keeps of
them when it is copied or pickled (:class:`ProcessLocal`)."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any, ClassVar


class ForkSafeLock:
    """A lock (``with lock:``) that a forked child holds anew, unlocked. A fork copies a
    lock as it is: taken by another thread of the parent (a table growing, a kernel
    building, a launch being recorded), it would stay taken in the child, which has no such
    thread, and the child's first call that needs it would wait forever (multiprocessing's
    fork start method and DataLoader workers fork from threaded processes). What the locks
    guard is published by single assignments (a table's arrays, a map's entry), so the
    child finds each done or not begun, and redoes it; the one exception is the custom ops'
    registration with torch, whose own registry a fork in its midst leaves half made (the
    child then gets torch's error, not a hang). Every lock of the package is one; only slow
    paths take them."""

    __slots__ = ("_lock", "__weakref__")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _fork_safe_locks.add(self)

    def __enter__(self) -> ForkSafeLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exception: object) -> None:
        self._lock.release()

    def _renew(self) -> None:
        self._lock = threading.Lock()


_fork_safe_locks: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _renew_locks_in_child() -> None:
    for lock in list(_fork_safe_locks):
        lock._renew()


if hasattr(os, "register_at_fork"):  # (POSIX: where a process can fork)
    os.register_at_fork(after_in_child=_renew_locks_in_child)


def build_once(cache: dict, lock: ForkSafeLock, key: Hashable, build: Callable[[], Any]) -> Any:
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


_records_lock = ForkSafeLock()  # (every op's records: only a new record takes it)


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
