"""cos/sin tables, two-level, and the process-wide registry that shares them.

A position ``p`` splits into ``p = hi * FINE_ROWS + lo``. Two float64-derived tables hold
``(a*cos, a*sin)`` of ``hi * FINE_ROWS * inv`` (coarse, grows with the positions asked for)
and ``(cos, sin)`` of ``lo * inv`` (fine, fixed ``FINE_ROWS`` rows); the kernels combine them
with the angle-addition formula in float32. Each entry is correctly rounded from float64,
so the combination errs by a few float32 ulps at any position below 2**24, well inside the
accuracy contract, while memory stays O(sqrt(P) * d) instead of O(P * d): at rotary_dim
128 the tables hold 0.6 MB for 128k positions, 1 MB for 1M and 9 MB for 2**24.

Tables are keyed by (scheme, rotary_dim, pair order): every op and every RoPE component with
the same key shares one table, on the host and on each device. The pair order is the
frequencies' natural one, or (for the interleaved MRoPE sections of ``_rotate``'s grouped
layout) a permutation of them: the same entries, bit for bit, at other columns. Growth
replaces the coarse table by a larger one (doubling), under a lock; retired device copies
stay referenced so that a kernel still reading one on another stream never reads freed
memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._arrays import cupy
from ._cache import ForkSafeLock, build_once
from ._validate import FLOAT32_MAX, MAX_POSITIONS
from .schemes import Scheme

FINE_BITS = 10
FINE_ROWS = 1 << FINE_BITS
_MIN_COARSE_ROWS = 8  # 8k positions on first use
_PAIR_COLUMN_ROWS = 1  # rows after a permuted fine table: its pairs' columns (_with_pair_columns)


def _cos_sin(angles: np.ndarray, amplitude: float) -> np.ndarray:
    """[rows, pairs, 2] float64 (a*cos, a*sin)."""
    return amplitude * np.stack([np.cos(angles), np.sin(angles)], axis=-1)


@dataclass
class RotaryTable:
    """cos/sin of one (scheme, rotary_dim), covering positions ``[0, capacity)``; column t
    holds frequency pair ``pair_order[t]`` (None: pair t)."""

    scheme: Scheme
    rotary_dim: int
    pair_order: tuple[int, ...] | None = None
    inv_freq: np.ndarray = field(init=False)
    amplitude: float = field(init=False)
    fine64: np.ndarray = field(init=False)
    coarse64: np.ndarray = field(init=False)
    fine32: np.ndarray = field(init=False)
    device_fine32: np.ndarray = field(init=False)  # what device_tables uploads as fine
    coarse32: np.ndarray = field(init=False)
    _device: dict[int, tuple[Any, Any]] = field(default_factory=dict, init=False)
    _retired: list[Any] = field(default_factory=list, init=False)
    _lock: ForkSafeLock = field(default_factory=ForkSafeLock, init=False)

    def __post_init__(self) -> None:
        self.inv_freq = self.scheme.inv_freq(self.rotary_dim)
        self.amplitude = float(self.scheme.amplitude(self.rotary_dim))
        if not abs(self.amplitude) <= FLOAT32_MAX:  # (the float32 tables would hold inf)
            raise ValueError(
                f"{self.scheme} gives a cos/sin amplitude of {self.amplitude!r}, beyond "
                f"float32's range (<= {FLOAT32_MAX:.8g})"
            )
        fine_angles = np.arange(FINE_ROWS, dtype=np.float64)[:, None] * self.inv_freq
        self.fine64 = self._in_order(_cos_sin(fine_angles, 1.0))
        self.device_fine32 = self._with_pair_columns(self.fine64.astype(np.float32))
        self.fine32 = self.device_fine32[:FINE_ROWS]  # (a view: the rows positions index)
        self.coarse64 = np.empty((0, self.rotary_dim // 2, 2))
        self.coarse32 = self.coarse64.astype(np.float32)

    def _in_order(self, entries: np.ndarray) -> np.ndarray:
        """[rows, pairs, 2] entries, computed in the natural order (so that every order holds
        the same bits), in this table's column order."""
        return entries if self.pair_order is None else entries[:, list(self.pair_order)]

    def _with_pair_columns(self, fine32: np.ndarray) -> np.ndarray:
        """The fine table as the device holds it: ``fine32`` ([FINE_ROWS, pairs, 2]), and in
        a permuted order _PAIR_COLUMN_ROWS row more whose first rotary_dim/2 bytes give the
        column of each pair (pair j's at byte j): where rope.cu's grouped kernel finds the
        lanes that hold its pairs (a load, not their closed form: a fifth of its
        instructions). Positions index only the first FINE_ROWS rows."""
        if self.pair_order is None:
            return fine32
        pairs = self.rotary_dim // 2  # (at most 256: a byte a column)
        columns = np.empty(pairs, np.uint8)
        columns[list(self.pair_order)] = np.arange(pairs)
        extra = np.zeros((_PAIR_COLUMN_ROWS, pairs, 2), np.float32)
        extra.view(np.uint8).reshape(-1)[:pairs] = columns
        return np.concatenate([fine32, extra])

    @property
    def capacity(self) -> int:
        return self.coarse64.shape[0] * FINE_ROWS

    def ensure(self, positions: int) -> None:
        """Grow so that positions ``[0, positions)`` are covered (doubling, never shrinking)."""
        if positions <= self.capacity:
            return
        if positions > MAX_POSITIONS:
            raise ValueError(
                f"position {positions - 1} is beyond the supported range [0, {MAX_POSITIONS})"
            )
        with self._lock:
            needed = -(-positions // FINE_ROWS)
            rows = max(_MIN_COARSE_ROWS, self.coarse64.shape[0])
            while rows < needed:
                rows *= 2
            rows = min(rows, MAX_POSITIONS // FINE_ROWS)
            if rows <= self.coarse64.shape[0]:
                return
            coarse_positions = np.arange(rows, dtype=np.float64)[:, None] * FINE_ROWS
            coarse64 = self._in_order(_cos_sin(coarse_positions * self.inv_freq, self.amplitude))
            # Readers check `capacity` (from coarse64) without the lock, then index either
            # table: publish coarse32 first so that both cover what capacity promises.
            self.coarse32 = coarse64.astype(np.float32)
            self.coarse64 = coarse64

    def device_tables(self, device: int, positions: int) -> tuple[int, int, int]:
        """(fine_ptr, coarse_ptr, capacity) of float32 tables on ``device`` covering
        ``positions``. Uploads (synchronously, so any stream may read them) when stale."""
        self.ensure(positions)
        entry = self._device.get(device)
        if entry is None or entry[1].shape[0] != self.coarse32.shape[0]:
            with self._lock:
                entry = self._device.get(device)
                if entry is None or entry[1].shape[0] != self.coarse32.shape[0]:
                    cp = cupy()
                    with cp.cuda.Device(device):
                        fine = cp.asarray(self.device_fine32)
                        coarse = cp.asarray(self.coarse32)
                        cp.cuda.runtime.deviceSynchronize()
                    if entry is not None:
                        self._retired.append(entry)
                    entry = (fine, coarse)
                    self._device[device] = entry
        fine, coarse = entry
        return fine.data.ptr, coarse.data.ptr, coarse.shape[0] * FINE_ROWS

    def host_cos_sin(self, positions: np.ndarray, float64: bool) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin of shape ``positions.shape + (rotary_dim/2,)``, combined from the two
        levels exactly as the kernels do (float32), or in float64 for float64 data."""
        self.ensure(int(positions.max(initial=0)) + 1)
        fine, coarse = (self.fine64, self.coarse64) if float64 else (self.fine32, self.coarse32)
        f = fine[positions & (FINE_ROWS - 1)]
        c = coarse[positions >> FINE_BITS]
        cos = c[..., 0] * f[..., 0] - c[..., 1] * f[..., 1]
        sin = c[..., 1] * f[..., 0] + c[..., 0] * f[..., 1]
        return cos, sin

    def device_capacity(self, device: int) -> int:
        """Positions the float32 copy on ``device`` covers (0 before the first upload)."""
        entry = self._device.get(device)
        return 0 if entry is None else entry[1].shape[0] * FINE_ROWS

    def bytes(self) -> dict[str, Any]:
        """Host bytes; live device bytes per device; and bytes of device copies replaced by
        growth but kept, because a launch in flight or a captured CUDA graph may read them."""
        host = sum(
            a.nbytes for a in (self.fine64, self.coarse64, self.device_fine32, self.coarse32)
        )  # (fine32 is a view of device_fine32)
        device = {dev: fine.nbytes + coarse.nbytes for dev, (fine, coarse) in self._device.items()}
        retired: dict[int, int] = {}
        for fine, coarse in self._retired:
            dev = fine.device.id
            retired[dev] = retired.get(dev, 0) + fine.nbytes + coarse.nbytes
        return {"host": host, "device": device, "device_retired": retired}


_registry: dict[tuple[Scheme, int, tuple[int, ...] | None], RotaryTable] = {}
_registry_lock = ForkSafeLock()


def shared_table(
    scheme: Scheme, rotary_dim: int, pair_order: tuple[int, ...] | None = None
) -> RotaryTable:
    """The one table of (scheme, rotary_dim, pair_order) in this process, created on first
    use."""
    build = lambda: RotaryTable(scheme, rotary_dim, pair_order)  # noqa: E731
    return build_once(_registry, _registry_lock, (scheme, rotary_dim, pair_order), build)


def existing_table(
    scheme: Scheme, rotary_dim: int, pair_order: tuple[int, ...] | None = None
) -> RotaryTable | None:
    """The table of (scheme, rotary_dim, pair_order) if this process has made it."""
    return _registry.get((scheme, rotary_dim, pair_order))


def combined_bytes(tables: list[RotaryTable]) -> dict[str, Any]:
    """:meth:`RotaryTable.bytes` of several tables, added up (host; per device)."""
    total: dict[str, Any] = {"host": 0, "device": {}, "device_retired": {}}
    for table in tables:
        sizes = table.bytes()
        total["host"] += sizes["host"]
        for key in ("device", "device_retired"):
            for device, count in sizes[key].items():
                total[key][device] = total[key].get(device, 0) + count
    return total


def table_bytes(rotary_dim: int, positions: int, permuted: bool = False) -> int:
    """Device bytes the float32 tables of one (scheme, rotary_dim, pair order) take for
    ``positions`` (``permuted``: in an order other than the natural one)."""
    coarse_rows = max(_MIN_COARSE_ROWS, -(-positions // FINE_ROWS))
    coarse_rows = 1 << (coarse_rows - 1).bit_length()  # tables grow by doubling
    fine_rows = FINE_ROWS + (_PAIR_COLUMN_ROWS if permuted else 0)
    return (fine_rows + coarse_rows) * (rotary_dim // 2) * 2 * 4


def table_cache_info() -> dict[str, Any]:
    """Entries of the shared table registry and the bytes they hold (host and per device)."""
    entries = []
    for (scheme, rotary_dim, pair_order), table in list(_registry.items()):
        sizes = table.bytes()
        entries.append(
            {
                "scheme": scheme,
                "rotary_dim": rotary_dim,
                "pair_order": pair_order,
                "positions": table.capacity,
                "device_positions": {dev: table.device_capacity(dev) for dev in sizes["device"]},
                "host_bytes": sizes["host"],
                "device_bytes": sizes["device"],
                "device_retired_bytes": sizes["device_retired"],
            }
        )
    return {
        "entries": entries,
        "host_bytes": sum(e["host_bytes"] for e in entries),
        "device_bytes": sum(
            sum(e["device_bytes"].values()) + sum(e["device_retired_bytes"].values())
            for e in entries
        ),
    }
