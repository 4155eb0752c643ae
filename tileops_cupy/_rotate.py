"""The rotation primitive every RoPE op and the Q/K component call: one contract, two bodies.

``rotate`` takes q (and optionally k) as ``[batch, seq, heads, head_dim]`` row views, where
each output goes (a new array, or the input itself for in-place), where the positions come
from (an offset, a per-sequence offsets tensor, per-token ids) and the shared table of the
op's scheme, and runs either the numpy body (host memory) or the CUDA body (one launch of
``kernels_cu/rope.cu`` for q and k together). With a :class:`RowNorm`, each head row is
first RMS-normalised over its whole head_dim and scaled by ``weight + offset`` (fused
QK-RMSNorm), in the same pass and with one rounding. Validation belongs to the callers; this
module only checks what the kernels need of the memory layout.
"""

from __future__ import annotations

import ctypes
import hashlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

import numpy as np

from . import _cuda
from ._arrays import ITEMSIZE, Operand, cupy, stream_handle
from ._cache import ForkSafeLock, build_once
from ._tables import FINE_BITS, RotaryTable, shared_table

__all__ = [
    "HeadRows", "Positions", "CosSinCache", "RowNorm", "rotate", "ErrorFlag", "error_flag",
    "configuration_flag",
]  # fmt: skip

SHIPPED_ROTARY_DIMS = (64, 128)  # compiled with rotary_dim as a constant; others use 0 (runtime)
# Measured on an H200 (bf16/fp32, B8 S4096 H32 D128): 128 threads and 4 heads per thread
# reach 95% of the copy ceiling; 256+ threads with 2 heads per thread lose up to 30%. 160
# threads make whole warps of GQA's 40-head rows too (two tokens of 8 x 10 lanes), where 128
# left 80-thread blocks with a half-empty warp: +2-5 points (H200, 32q/8kv D128 bf16).
_THREADS_PER_BLOCK = 160
# Each thread loads HEADS heads of its chunk at once (rope.cu's HEADS template argument) in
# rounds over the block's y-lanes, forming its token's cos/sin once for them all. Launches of
# fewer than _LARGE_LAUNCH_THREADS threads in a one-round layout take one round of 4 heads
# (more rounds would lengthen a decode step: 6.2 -> 8.5 us at B64 fp32 with four of one);
# larger ones take the rounds of _LARGE_LAUNCH_LAYOUT, measured on an H200 (D128, % of the
# copy ceiling):
# - (4, 2) by default. At 32768 tokens, 32q/8kv bf16, two rounds against one: MRoPE 75% ->
#   92%, per-token positions 90% -> 95%, the fused norm 45% -> 54%. Fewer heads at a time lose
#   for 16-bit types (bf16 B8 S4096 H32: 94.7% at (4, 2), 93.6% at (1, 4), 90.8% at (1, 8),
#   66-81% with one head a thread in one round) and the float32 interleaved rotation 1.5-3.8
#   points (B8 S4096 95.3 -> 93.8%).
# - (1, 4) for the float32 neox rotation: fewer loads a thread at a time is what a copy wants
#   (one 16-byte load and store a thread reach 99.2% of the ceiling, four of each 95.5%), and a
#   float32 neox chunk's 4 pairs of cos/sin are cheap to form for four heads. B8 S4096 H32
#   95.1 -> 98.0%, B1 S8192 88.3 -> 89.5%, per-token positions N32768 (32q/8kv) 96.2 -> 97.7%.
_LARGE_LAUNCH_THREADS = 1 << 18
# 16-bit neox rotations of two-level launches with at least _NARROW_NEOX_ROWS head rows
# (tokens x heads) move 8 bytes an access (4 pairs a chunk, rope.cu's VEC 4) rather than 16:
# a thread then holds its 4 heads' chunks in 70 registers, where 16-byte chunks need 95, so
# more warps share a multiprocessor (H32 D128: 7 blocks of 128 threads, not 4 of 160). H200
# (D128, % of the copy ceiling, 16-byte -> 8-byte accesses, two runs): bf16 B8 S4096 H32
# 95.4-95.9 -> 96.6-97.2, fp16 95.3 -> 96.8; per-token positions 32q/8kv N32768 95.9-96.2
# -> 95.8-96.1. Below it they gain nothing: bf16 B1 S8192 83.2 / 82.6 -> 82.9 / 83.2, B2
# S2048 70.6 / 68.8 -> 70.0 / 68.1, positions N8192 85.3 / 85.5 -> 86.0 / 85.0. MRoPE keeps
# 16 bytes (it chooses a position row per pair, twice as often per byte at 8: N8192 80.5 ->
# 70.8), as do the cos_sin_cache calls and the fused norm.
_NARROW_NEOX_ROWS = 1 << 20
_SMALL_LAUNCH_LAYOUT = (4, 1)  # (HEADS, rounds)
_LARGE_LAUNCH_LAYOUT = {("float32", True, False): (1, 4)}  # (dtype, neox, norm): (HEADS, rounds)
_DEFAULT_LARGE_LAUNCH_LAYOUT = (4, 2)
# Registers a thread may hold (ptxas -v, sm_90): the plain rotation needs 96; the norm 128,
# where it spills 8-28 bytes (it would take 144). Measured on an H200, fused norm at 8192 /
# 32768 tokens: 65/75% of the copy ceiling at 128; 52/59% at 144 (fewer blocks per SM);
# 60-61/69% at 96 with 2-3 heads in flight (heavier spills). rope.cu's launch bounds get
# them as minimum blocks of _THREADS_PER_BLOCK threads per multiprocessor (65536 registers).
_REGISTERS, _NORM_REGISTERS = 96, 128
# The fused norm's lane layouts (rope.cu's NORM template argument): NORM_CHUNKS takes any view;
# NORM_ROWS, one 16-byte pack of a row a lane, takes large in-place launches of 16-bit rows
# that are rotated whole, at a shipped rotary_dim (a compile-time row length), in blocks of
# _ROWS_THREADS (two tokens of whole-warp row groups) at 64 registers, _ROWS_HEADS rows a lane
# at a time. Measured on an H200 (32q/8kv D128 bf16, % of the copy ceiling at N8192 /
# N32768): NORM_CHUNKS 68.2 / 78.7%, NORM_ROWS 78.1 / 91.7%; at 4 rows a lane 66.2 / 78.9%,
# 72 registers 73.5 / 90.9%, 1 row at 48 registers 59.9 / 71.9%, blocks of 128 threads 76.5 /
# 90.4%, of 32 76.7 / 91.5%. (The same layout without the norm, for plain per-token positions:
# 81.1 / 93.7% against the chunk layout's 85.0 / 95.2%, so the plain rotation keeps its own.)
NO_NORM, NORM_CHUNKS, NORM_ROWS = 0, 1, 2
_ROWS_THREADS, _ROWS_REGISTERS, _ROWS_HEADS = 64, 64, 2
# The plain rotation's whole-row layout (rope.cu rope_rotate_packs): q, or q and k, at
# sequential or per-token positions, rotated whole at a shipped rotary_dim, any table mode
# (MRoPE where _packs_table allows), 16-byte rows, with the fused norm of 16-bit rows. 16 bytes
# of a row a lane (neox: 8 of each half, or 16 of each at _PACK_WIDE_ROWS: _packs_lane),
# _PACK_ROWS rows of one operand of a token a lane at once, blocks of _PACK_THREADS at 64
# registers (32 warps a multiprocessor).
# Measured on an H200 (D128, % of the copy ceiling, the chunk layout -> this one, in one
# process). bf16 q alone, H32: neox B1 S8192 82.4 -> 84.5, interleaved 81.3 -> 82.5,
# backward 82.4 -> 83.3; B2 S2048 67.7 -> 71.1, 67.0 -> 73.3, 69.5 -> 71.1; D64 B2 S2048
# 55.7 -> 59.5. bf16 q and k in place in a fused QKV row (32q/8kv, the component's prefill):
# N4096 75.7 -> 78.4, N8192 84.6 -> 86.7, N16384 91.7 -> 93.0. float32 q alone, H32: B1
# S8192 89.4 -> 89.7, 88.5 -> 89.8, 89.4 -> 90.2; B2 S2048 81.6 -> 82.3, 79.8 -> 82.6,
# 81.6 -> 82.6; D64 B2 S2048 67.1 -> 73.1. Per-token positions (bf16 q and k, 32q/8kv): N4096
# 72.5 -> 75.3, N8192 83.3 -> 87.0, N16384 91.0 -> 92.6, since a neox lane holds both halves
# of its columns (half the pairs' cos/sin to form after its token's id arrives; with one
# 16-byte pack of one half a lane and the partner half by shuffle, ids lost: 70.9, 82.5,
# 88.2). Where it lost, the chunk layout keeps the launch: from _PACK_MAX_HEAD_ROWS head rows
# (by element size and layout), where its rows are the chunk layout's again. Chunks -> packs,
# H32 D128, one process:
#   bf16 (2**20: B8 S4096; 2**21: B16 S4096, B4 S16384; 2**22: B32 S4096): neox 95.7 -> 95.7,
#     98.4 -> 97.8, 99.9 -> 98.6; interleaved 96.2 -> 95.2, 98.6 -> 97.2, 100.0 -> 98.0.
#   float32 neox (2**19: B1 S16384): 95.6 -> 94.9, B8 S4096 98.4 -> 96.4, 2**22 100.6 -> 98.6.
#   float32 interleaved ahead at every size measured, so bounded only by the kernel's 32-bit
#   thread numbers: 2**19 93.2 -> 94.9, 2**20 95.4 -> 96.4, 2**21 96.8 -> 98.1, 2**22 97.6 ->
#   98.5 (the backward the same).
_PACK_THREADS, _PACK_REGISTERS, _PACK_ROWS = 256, 64, 4
# A neox lane of the two-level tables or a caller's cos_sin_cache holds 16 bytes of each half
# of a row (one access each: 8 pairs of 16 bits, 4 of float32), _PACK_WIDE_ROWS rows at once:
# the 64 bytes of rows in flight that 8-byte halves hold at _PACK_ROWS, in half the accesses.
# H100 (D128, % of the copy ceiling, kernel_ab, medians of three runs of two or three rounds,
# 8-byte -> 16-byte halves, the same bits): bf16 B1 S8192 89.1 / 88.8 / 89.0 -> 89.5 / 90.5 /
# 90.4 (interleaved 89.2-90.2), B2 S2048 79.4 / 78.8 / 79.2 -> 79.4 / 81.5 / 81.3, B4 S8192
# H8 88.4 / 89.1 / 88.9 -> 88.7 / 89.6 / 89.0, float32 B1 S8192 95.4 / 95.5 / 95.3 -> 96.2 /
# 95.6 / 95.8; per-token positions (32q/8kv) N4096 81.4 / 83.1 / 81.9 -> 82.5 / 81.6 / 82.9,
# N8192 90.7 / 90.2 / 90.6 -> 91.0 / 90.3 / 90.1; the cos_sin_cache N8192 87.6 / 88.3 / 87.5
# -> 88.3 / 88.3 / 87.8. One row a lane lost (positions N8192 81.6: a lane forms 8 pairs'
# cos/sin for 32 bytes of rows), as did four (B1 S8192 85.6; 8 bytes of spills). The other
# lanes keep 8-byte halves: the grouped MRoPE tables (a lane takes its pairs' cos/sin from
# lanes of up to four), the fused norm (80 bytes of spills at 64 registers so), and the
# sectioned MRoPE (16-byte halves at lane boundaries of 8 pairs: N8192 90.4 -> 89.6).
_PACK_WIDE_ROWS = 2
# The layout's lower bound was 2**17 head rows, the smallest size measured when it landed. Below it
# too the layout leads (H100, kernel_ab, bf16 D128, % of the copy ceiling, two runs of two rounds,
# at S512 a third of three, chunks -> packs, the same bits): q alone B1 H32 S256 (2**13 head rows)
# neox 19.4 / 19.1 -> 19.9 / 19.9, interleaved 19.5 / 18.6 -> 21.1 / 21.2; S512 neox 32.1 / 30.7 /
# 30.8 -> 34.6 / 34.3 / 35.1, interleaved 33.5 / 32.1 / 33.5 -> 35.1 / 33.7 / 36.8; S1024 47.2 /
# 47.9 -> 51.2 / 49.4, 46.0 / 45.7 -> 51.0 / 51.9; S2048 61.7 / 63.4 -> 67.4 / 67.1, 59.5 / 59.0 ->
# 65.7 / 66.4. q and k in place in a fused QKV row (32q/8kv): a prefill N256 22.0 / 21.7 -> 24.1 /
# 23.3, N512 35.6 / 36.4 -> 40.0 / 38.2, N1024 53.0 / 52.6 -> 57.0 / 55.4, N2048 67.2 / 67.8 -> 71.4
# / 70.0; per-token positions N256 22.0 / 21.8 -> 22.4 / 22.5, N1024 52.9 / 52.5 -> 53.7 / 54.5;
# N1024 with the fused norm (other bits: a neox lane's sum of squares takes its columns of both
# halves) 39.9 / 40.4 -> 53.2 / 52.9, MRoPE sectioned 46.7 / 47.3 -> 54.9 / 54.6, interleaved (the
# grouped tables) 48.4 / 45.3 -> 52.1 / 53.0; the cos_sin_cache alone lost there, 53.0 / 53.8 ->
# 52.3 / 51.8 (N4096 80.4 -> 81.7: one bound for every mode). Below 2**13, at 128 tokens (the
# bound at 2**10, medians of five and six rounds, the same bits), q alone S128 neox 9.9 -> 11.8,
# interleaved 10.7 -> 11.2, q and k N128 11.4 -> 13.8 (positions) and 11.8 -> 13.3 (prefill):
# within the 3 points by which rows of identical code differed in that run; decode sizes not
# measured.
_PACK_MIN_HEAD_ROWS = 1 << 13
_PACK_MAX_HEAD_ROWS = {  # (element size, neox): exclusive (float32 interleaved: none of its own)
    (2, True): 1 << 20, (2, False): 1 << 20, (4, True): 1 << 19, (4, False): 1 << 62
}  # fmt: skip
_PACK_MAX_THREADS = 1 << 31  # rope_rotate_packs numbers its threads in 32 bits
# The plain rotation's shared-table layout (rope.cu rope_rotate_shared): one chunk of one head
# row a thread, blocks of up to _SHARED_THREADS threads holding rows of one token, whose cos/sin
# each block forms once into shared memory; two-level tables at sequential positions (no ids),
# rows rotated whole at a shipped rotary_dim, 16-byte-aligned rows, launches that
# rope_rotate_packs leaves to the chunk layout. A chunk is 4 pairs: a 16-bit neox chunk two
# 8-byte accesses, the rest 16-byte ones. Chunks -> shared on an H100 (kernel_ab, % of the
# copy ceiling, H32 D128 unless named): bf16 B8 S4096 neox 96.2 -> 98.1, interleaved 96.3 ->
# 97.7; float32 neox 97.2 -> 99.5; bf16 D64 93.0 -> 95.2. Where it lost, others keep the
# launch: rope_rotate_packs' mid sizes (packs -> shared: bf16 B1 S8192 88.9 -> 87.5, B2 S2048
# 78.5 -> 76.3; float32 interleaved B8 S4096 99.2 -> 96.8), per-token ids (32q/8kv, chunks ->
# shared: N32768 96.6 -> 95.1), the cos_sin_cache (N8192 88.3 -> 79.2) and MRoPE (N8192
# 84-89 -> 66-68), whose positions reach the table through loads that every thread of a
# block waits for. Only on devices whose DRAM asks each multiprocessor for no more than
# _SHARED_MAX_SM_BANDWIDTH bytes a second: a thread keeps 16 bytes in flight and waits at the
# block's barrier, too few bytes for a faster memory. On an H200 (4.8 TB/s over 132
# multiprocessors: 36.5 GB/s each; an H100 25.4) chunks -> shared lost at every row it took
# (kernel_ab, 36th session): bf16 B8 S4096 neox 95.7 -> 90.0, interleaved 95.6 -> 89.5, D64
# 90.7 -> 86.2; float32 neox 97.8 -> 97.7.
_SHARED_THREADS, _SHARED_REGISTERS = 256, 32
_SHARED_MIN_HEAD_ROWS = 1 << 17
_SHARED_MAX_SM_BANDWIDTH = 30e9
_SHARED_MIN_HEADS = 8  # rows a token, q's and k's (fewer: a block would form cos/sin for few rows)
_MAX_GRID_Y = _MAX_GRID_Z = 65535  # a launch's grid y and z (CUDA's limits)
_SHARED_BYTES = 48 * 1024  # dynamic shared memory any launch may take without opting in
# rope.cu's GROUP_PAIRS (a launch define, as FINE_BITS): the pairs of a group of the grouped
# tables, a multiple of every dtype's pairs a lane (16 bytes: 4 of 16 bits, 2 of float32), so
# one order serves them all
GROUP_PAIRS = 4
_DEFINES = (
    f"FINE_BITS={FINE_BITS}",
    f"GROUP_PAIRS={GROUP_PAIRS}",
    f"ROPE_THREADS={_THREADS_PER_BLOCK}",
    f"ROPE_MIN_BLOCKS={65536 // (_THREADS_PER_BLOCK * _REGISTERS)}",
    f"ROPE_NORM_MIN_BLOCKS={65536 // (_THREADS_PER_BLOCK * _NORM_REGISTERS)}",
    f"ROPE_ROWS_THREADS={_ROWS_THREADS}",
    f"ROPE_ROWS_MIN_BLOCKS={65536 // (_ROWS_THREADS * _ROWS_REGISTERS)}",
    f"ROPE_PACK_THREADS={_PACK_THREADS}",
    f"ROPE_PACK_MIN_BLOCKS={65536 // (_PACK_THREADS * _PACK_REGISTERS)}",
    f"ROPE_SHARED_THREADS={_SHARED_THREADS}",
    f"ROPE_SHARED_MIN_BLOCKS={65536 // (_SHARED_THREADS * _SHARED_REGISTERS)}",
)
ROPE_PARAMS = _cuda.ParamStruct.declared("rope", "RopeParams")
# Where the kernel finds cos/sin (rope.cu's TABLE template argument): the two-level tables at
# the token's position, the same at a position row chosen per pair (MRoPE), or a caller's
# cos_sin_cache. One module per mode, so a process compiles only the modes it uses.
TWO_LEVEL, MROPE, COS_SIN_CACHE = 0, 1, 2
TABLE_MODES = (TWO_LEVEL, MROPE, COS_SIN_CACHE)
# rope_rotate_packs' interleaved MRoPE (in the MROPE module): each lane forms the cos/sin of one
# group of pairs of one position row, from tables in the groups' order (grouped_pair_order),
# and takes its own pairs' by shuffles (rope.cu's GROUP_PAIRS says why).
MROPE_GROUPED = 3
NORM_TABLE_MODES = (TWO_LEVEL, MROPE)  # the cos_sin_cache calls take no fused norm
# rope_rotate_packs is compiled into every table mode's module. Measured on an H100 (bf16 q
# and k in place in a fused QKV row, 32q/8kv, D128; % of the copy ceiling, the chunk layout ->
# this one, one process): per-token positions N4096 78.2 -> 81.1, N8192 87.4 -> 90.2, N16384
# 92.3 -> 94.7 (fp16 86.8 -> 89.8, float32 93.0 -> 94.6, interleaved 87.6 -> 89.3); the
# cos_sin_cache 80.4 -> 81.7, 89.5 -> 89.6, 93.7 -> 93.3. MRoPE with every lane forming its
# pairs' three position rows lost: 74.4 -> 70.3, 84.7 -> 75.0, 91.0 -> 77.8 (interleaved rows
# at N8192 84.4 -> 77.4; ncu: 1.7x the plain kernel's instructions). So MRoPE takes it only
# where each lane forms its cos/sin at one position row (_packs_table), the plain kernel's
# work: where its pairs sit in one section, or (MROPE_GROUPED) where interleaved sections
# group, each lane forming a group's at one row and shuffling them to their pairs' lanes
# (H200, Qwen3-VL's (24, 20, 20), chunks -> grouped packs, bit-identical: N4096 65.5 -> 74.2,
# N8192 77.2 -> 84.8, N16384 85.8 -> 90.9, fp16 N8192 76.9 -> 84.9, float32 81.0 -> 91.1;
# N32768 past _PACK_MAX_HEAD_ROWS, 91.4 both; with the fused norm, NORM_ROWS -> packs, 73.3
# -> 80.3, other bits: a neox lane's sum of squares takes its columns of both halves);
# other interleaved sections keep the chunk layout. Sections (16, 24, 24)
# so, chunks -> packs on the H100, bit-identical: N4096 75.0 -> 81.9, N8192 84.3 -> 89.7,
# N16384 91.4 -> 94.7 (fp16 N8192 84.8 -> 89.4, float32 91.5 -> 95.2, interleaved layout 83.7
# -> 89.6, D64 (8, 12, 12) 73.6 -> 81.4); with the fused norm (NORM_ROWS -> packs) N4096
# 73.0 -> 79.9, N8192 82.1 -> 89.3, N16384 88.4 -> 93.6. For the other rows, cos/sin staged
# per block in shared memory won on an H100 and lost on an H200 (interleaved N16384 87.8 ->
# 82.8): not kept (docs/performance-log.md, seventeenth session).
# The fused QK-norm of 16-bit rows takes it too (its NORM argument) where the layout's size
# bounds allow, ahead of NORM_ROWS. H100, bf16 q and k 32q/8kv D128 in a fused QKV row,
# NORM_ROWS -> packs: N4096 75.2 -> 80.1, N8192 83.3 -> 89.9, N16384 89.9 -> 94.6;
# interleaved N8192 84.0 -> 89.7, fp16 81.8 -> 89.8, D64 76.0 -> 81.9; N32768 (past
# _PACK_MAX_HEAD_ROWS) is NORM_ROWS in both, 93.1.


@dataclass(frozen=True, slots=True)
class HeadRows:
    """An operand seen as ``[batch, seq, heads, head_dim]`` through element strides."""

    operand: Operand
    shape: tuple[int, int, int, int]
    strides: tuple[int, int, int, int]

    def host_view(self) -> np.ndarray:
        itemsize = self.operand.host.itemsize
        return np.lib.stride_tricks.as_strided(
            self.operand.host, self.shape, tuple(s * itemsize for s in self.strides)
        )


@dataclass(frozen=True, slots=True)
class Positions:
    """Position of token (b, s): ``offset + offsets[b] + (ids[b*seq + s] if ids else s)``.

    ``limit`` bounds every position (a device-side check raises ``flag`` and clamps);
    ``cover`` is how many positions the table must hold for this call (the highest
    position + 1 when known on the host, else ``limit``).

    MRoPE (``mrope_section`` set): ``ids`` holds three rows of ``batch*seq`` positions
    (temporal, height, width) and frequency pair j takes row ``mrope_rows(...)[j]``.
    """

    offset: int = 0
    offsets: Operand | None = None
    ids: Operand | None = None
    limit: int = 1 << 24
    cover: int = 1
    mrope_section: tuple[int, int, int] | None = None
    mrope_interleaved: bool = False

    def host_positions(self, batch: int, seq: int) -> np.ndarray:
        """``[batch, seq]`` int64 positions (``[3, batch, seq]`` under MRoPE)."""
        rows = (3,) if self.mrope_section is not None else ()
        positions = np.full((*rows, batch, seq), self.offset, dtype=np.int64)
        if self.offsets is not None:
            positions += self.offsets.host.astype(np.int64).reshape(batch, 1)
        if self.ids is not None:
            positions += self.ids.host.astype(np.int64).reshape(*rows, batch, seq)
        else:
            positions += np.arange(seq, dtype=np.int64)
        return positions


def mrope_rows(section: tuple[int, int, int], interleaved: bool, pairs: int) -> np.ndarray:
    """The position row (0 temporal, 1 height, 2 width) of each of ``pairs`` frequency
    pairs: sectioned (HF Qwen2-VL), block i of the three sections takes row i; interleaved
    (HF Qwen3-VL), pair j takes row 1 if j % 3 == 1 and j < 3*h, row 2 if j % 3 == 2 and
    j < 3*w, else row 0. (rope.cu's mrope_row is the same map.)"""
    j = np.arange(pairs)
    if not interleaved:
        return (j >= section[0]).astype(np.int64) + (j >= section[0] + section[1])
    lane = j % 3
    return np.where((lane > 0) & (j < 3 * np.asarray(section)[lane]), lane, 0)


@dataclass(frozen=True, slots=True)
class CosSinCache:
    """A caller's float32 ``[max_position, rotary_dim]`` table (cos of each pair, then sin;
    FlashInfer's ``cos_sin_cache`` layout) used in place of the two-level tables."""

    operand: Operand

    @property
    def rotary_dim(self) -> int:
        return self.operand.shape[1]

    @property
    def capacity(self) -> int:
        return self.operand.shape[0]

    def host_cos_sin(self, positions: np.ndarray, float64: bool) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin of shape ``positions.shape + (rotary_dim/2,)``: the cache's values."""
        rows = self.operand.host[positions]
        rows = rows.astype(np.float64) if float64 else rows
        pairs = self.rotary_dim // 2
        return rows[..., :pairs], rows[..., pairs:]


@dataclass(frozen=True, slots=True)
class RowNorm:
    """Fused RMSNorm of each head row before the rotation:
    ``x / sqrt(mean(x*x over head_dim) + eps) * (weight + weight_offset)`` in float32
    (float64 for float64 data), q's rows with ``q_weight``, k's with ``k_weight``
    (``[head_dim]``, float32 or the data's dtype, contiguous, where the data lives)."""

    q_weight: Operand
    k_weight: Operand | None
    eps: float
    weight_offset: float

    @property
    def weights(self) -> tuple[Operand, ...]:
        return (self.q_weight,) if self.k_weight is None else (self.q_weight, self.k_weight)


class ErrorFlag:
    """A host-mapped int32 per device that kernels set when they meet an out-of-range
    position. Reading it costs no device synchronisation; it is exact once the stream
    that ran the kernel has been synchronised."""

    def __init__(self) -> None:
        self._pointers: dict[int, int] = {}
        self._cells: tuple[ctypes.c_int32, ...] = ()  # the same memory, read on every call
        self._lock = ForkSafeLock()

    def pointer(self, device: int) -> int:
        """The flag's device-visible address on ``device`` (mapped on first use)."""
        return build_once(self._pointers, self._lock, device, lambda: self._map(device))

    def _map(self, device: int) -> int:
        pointer = _mapped_cell(device)
        self._cells += (ctypes.c_int32.from_address(pointer),)
        return pointer

    def take(self) -> bool:
        """True if any device's flag was raised since the last take (and clear it)."""
        raised = False
        for cell in self._cells:
            if cell.value:
                raised = True
                cell.value = 0
        return raised

    def raise_if_set(self, message: Callable[[], str]) -> None:
        """ValueError(``message()``) if a kernel raised the flag since the last look. Costs
        no synchronisation: a kernel still running is caught at a later look."""
        for cell in self._cells:  # (take(), inline: this runs on every call)
            if cell.value:
                self.take()
                raise ValueError(message())

    def check(self, message: Callable[[], str]) -> None:
        """Wait for every device this flag has seen, then :meth:`raise_if_set`."""
        if self._pointers:
            runtime = cupy().cuda.runtime
            previous = runtime.getDevice()
            try:
                for device in self._pointers:
                    runtime.setDevice(device)
                    runtime.deviceSynchronize()
            finally:
                runtime.setDevice(previous)
        self.raise_if_set(message)


_CELLS_A_PAGE = 1024  # flag cells one host-mapped allocation holds (4 KiB)
_free_cells: dict[int, list[int]] = {}  # device -> cells not handed out yet
_cells_lock = ForkSafeLock()


def _mapped_cell(device: int) -> int:
    """The address of a zeroed int32 in host-mapped memory that kernels on ``device`` may
    write, cut from a page allocated once per _CELLS_A_PAGE cells: an object made per call
    costs neither a cudaHostAlloc (slow, and serialising) nor a pinned page of its own.
    Never freed or handed out twice: a running kernel or a captured graph may write it."""
    with _cells_lock:
        cells = _free_cells.setdefault(device, [])
        if not cells:
            runtime = cupy().cuda.runtime
            with cupy().cuda.Device(device):
                flags = runtime.hostAllocMapped | runtime.hostAllocPortable
                page = runtime.hostAlloc(4 * _CELLS_A_PAGE, flags)
            ctypes.memset(page, 0, 4 * _CELLS_A_PAGE)
            cells.extend(page + 4 * i for i in reversed(range(_CELLS_A_PAGE)))
        return cells.pop()


_ANY_FLAG = ErrorFlag()  # for launches whose positions were validated on the host
# Each flag lives as long as an op holds it (the registry holds none), so objects made per
# call leave nothing behind. (The host-mapped cells of a dropped flag stay allocated: a
# kernel or a captured graph may still write them.)
_flags: weakref.WeakValueDictionary[int, ErrorFlag] = weakref.WeakValueDictionary()
_flags_lock = ForkSafeLock()


def error_flag(key: int) -> tuple[int, ErrorFlag]:
    """``(key, flag)``: the flag of ``key``, a new one if no op holds it. An op keeps its
    flag's key in the configuration its torch custom op carries, so the op behind the
    dispatcher raises the caller's flag."""
    with _flags_lock:
        flag = _flags.get(key)
        if flag is None:
            flag = _flags[key] = ErrorFlag()
        return key, flag


def configuration_flag(configuration: tuple, key: int | None = None) -> tuple[int, ErrorFlag]:
    """:func:`error_flag` of ``key``, or (None) of the key of ``configuration`` (an op's
    arguments by value): ops built alike share one flag, and its key is a digest of the
    configuration, the same in every process. So layers built alike carry equal
    configurations, and ``torch.compile`` traces one graph for them all instead of one per
    layer (a per-op key made every layer a recompile), and a graph cached or exported by
    one process names the same flag in the next. A device error then surfaces at the next
    call of any op of that configuration."""
    if key is None:
        digest = hashlib.blake2b(repr(configuration).encode(), digest_size=8).digest()
        key = int.from_bytes(digest, "little") >> 1  # (an int64 of the schema)
    return error_flag(key)


def rotate(
    table: RotaryTable | CosSinCache,
    neox: bool,
    inverse: bool,
    q: tuple[HeadRows, HeadRows],
    k: tuple[HeadRows, HeadRows] | None,
    positions: Positions,
    flag: ErrorFlag | None = None,
    stream=None,
    norm: RowNorm | None = None,
) -> _cuda.Launch | None:
    """Rotate ``q = (source, destination)`` and ``k`` (same form, or None) at ``positions``.

    The destination may be the source itself (in place). Columns past ``table.rotary_dim``
    are copied when the destination is another array (normalised, with ``norm``).
    ``inverse`` negates sin (backward). ``table``: the scheme's shared two-level table, or a
    caller's :class:`CosSinCache` (whose capacity then bounds the positions). Returns the
    CUDA launch (None on the host), which a caller may re-run for another call of the same
    layout, patching the fields that differ (addresses, offsets).
    """
    if q[0].operand.is_cuda:
        return _rotate_cuda(table, neox, inverse, q, k, positions, flag or _ANY_FLAG, stream, norm)
    for pair, weight in ((q, norm and norm.q_weight), (k, norm and norm.k_weight)):
        if pair is not None:
            _rotate_host(table, neox, inverse, pair, positions, norm, weight)
    return None


# --------------------------------------------------------------------------- host body


# Elements of x the host path rotates at a time: a chunk's float32 temporaries (each half of
# its rows, and their products) then stay in the CPU's caches, and the arrays numpy makes
# for them are reused rather than faulted in fresh. B1 S4096 H32 D128 on a 2-CPU host,
# whole tensor -> chunks of 2**12 / 2**14 / 2**15 / 2**16 / 2**18 elements, ms: bf16 124 ->
# 71 / 58 / 53 / 51 / 54, fp32 101 -> 63 / 47 / 40 / 42 / 47, bf16 with the fused norm 294
# -> 114 / 79 / 87 / 107 / 206. Every row's arithmetic is the same either way (the same
# bits: test_host_chunks_do_not_change_a_bit).
_HOST_CHUNK_ELEMENTS = 1 << 15


def _rotate_host(
    table: RotaryTable,
    neox: bool,
    inverse: bool,
    pair: tuple[HeadRows, HeadRows],
    positions: Positions,
    norm: RowNorm | None = None,
    weight: Operand | None = None,
) -> None:
    source, destination = pair
    batch, seq, heads, head_dim = source.shape
    float64 = source.operand.dtype == "float64"
    compute = np.float64 if float64 else np.float32
    cos, sin = table.host_cos_sin(positions.host_positions(batch, seq), float64)
    if positions.mrope_section is not None:  # [3, B, S, pairs]: each pair's own row
        pairs = table.rotary_dim // 2
        rows = mrope_rows(positions.mrope_section, positions.mrope_interleaved, pairs)
        cos, sin = (np.moveaxis(a[rows, :, :, np.arange(pairs)], 0, -1) for a in (cos, sin))
    cos = cos.astype(compute)[:, :, None, :]
    sin = (-sin if inverse else sin).astype(compute)[:, :, None, :]
    scale = None if norm is None else weight.host.astype(compute) + compute(norm.weight_offset)

    x = source.host_view()
    y = destination.host_view()
    tokens = max(1, _HOST_CHUNK_ELEMENTS // max(1, heads * head_dim))
    copy_tail = destination.operand.host is not source.operand.host
    for b in range(batch):
        for start in range(0, seq, tokens):
            chunk = np.s_[b, start : start + tokens]
            _rotate_host_rows(x[chunk], y[chunk], cos[chunk], sin[chunk], table.rotary_dim,
                              neox, compute, norm, scale, copy_tail)  # fmt: skip


def _rotate_host_rows(x, y, cos, sin, rotary_dim, neox, compute, norm, scale, copy_tail):
    """One chunk of :func:`_rotate_host`: rows ``x`` ``[tokens, heads, head_dim]`` rotated
    into ``y`` (which may be ``x`` itself) by ``cos``/``sin`` ``[tokens, 1, pairs]``; with
    ``norm``, every column normalised first (times ``scale``, the weight plus its offset)
    and rounded once at the end."""
    pairs = rotary_dim // 2
    dtype = y.dtype
    tail = np.s_[..., rotary_dim:]
    if norm is not None:  # every column normalised (and rounded once, below) before rotation
        x = x.astype(compute)
        squares = np.mean(np.square(x), axis=-1, keepdims=True)
        x = x * (compute(1) / np.sqrt(squares + compute(norm.eps))) * scale
    first = np.s_[..., :pairs] if neox else np.s_[..., 0:rotary_dim:2]
    second = np.s_[..., pairs:rotary_dim] if neox else np.s_[..., 1:rotary_dim:2]
    x1 = x[first].astype(compute)
    x2 = x[second].astype(compute)
    # everything is computed before anything is written, so in place is safe
    y1 = (x1 * cos - x2 * sin).astype(dtype)
    y2 = (x2 * cos + x1 * sin).astype(dtype)
    y_tail = x[tail].astype(dtype) if norm is not None else None
    y[first] = y1
    y[second] = y2
    if y_tail is not None:
        y[tail] = y_tail
    elif rotary_dim < x.shape[-1] and copy_tail:
        y[tail] = x[tail]


# --------------------------------------------------------------------------- CUDA body


def _large_launch_layout(dtype: str, neox: bool, norm: bool) -> tuple[int, int]:
    """(HEADS, rounds) of a large launch of one kind of kernel (_LARGE_LAUNCH_LAYOUT)."""
    return _LARGE_LAUNCH_LAYOUT.get((dtype, neox, norm), _DEFAULT_LARGE_LAUNCH_LAYOUT)


def _heads_choices(dtype: str, neox: bool, norm: bool) -> tuple[int, ...]:
    """The HEADS values compiled for one kind of kernel: every layout's that may pick it."""
    large_heads = _large_launch_layout(dtype, neox, norm)[0]
    return tuple(dict.fromkeys((_SMALL_LAUNCH_LAYOUT[0], large_heads)))


def _name(
    dtype: str, neox: bool, vec: int, rotary_dim: int, mode: int, norm: int, heads: int
) -> str:
    """The name expression of one instantiation (norm: 0, or the fused QK-RMSNorm's lane layout,
    NORM_CHUNKS or NORM_ROWS; heads: the heads a thread loads at once)."""
    flags = f"{str(neox).lower()}, {vec}, {rotary_dim}, {mode}, {int(norm)}, {heads}"
    return f"rope_rotate<{_cuda.CUDA_TYPES[dtype]}, {flags}>"


def _rows_layout_compiled(dtype: str, rotary_dim: int) -> bool:
    """Whether the fused norm's whole-row layout (NORM_ROWS) is compiled for this dtype and
    (compile-time) rotary_dim."""
    return ITEMSIZE[dtype] == 2 and rotary_dim in SHIPPED_ROTARY_DIMS


def module_spec(
    dtype: str, rotary_dim: int, mode: int = TWO_LEVEL, norm: bool = False
) -> _cuda.ModuleSpec:
    """The module holding every (layout, vector width, heads at once) instantiation of one
    dtype, rotary_dim (0 = rotary_dim passed at run time), table mode and norm flag (with
    it, both lane layouts of the fused norm where each is compiled): a process compiles only
    the modes it uses."""
    names = tuple(
        _name(dtype, neox, vec, rotary_dim, mode, layout, heads)
        for neox in (True, False)
        for vec, layout, heads in instantiations(dtype, neox, rotary_dim, norm, mode)
    )
    if _packs_compiled(dtype, rotary_dim, norm):
        tables = (mode, MROPE_GROUPED) if mode == MROPE else (mode,)
        names += tuple(
            _packs_name(dtype, neox, rotary_dim, table, norm)
            for table in tables
            for neox in (True, False)
        )
    if _shared_compiled(rotary_dim, mode, norm):
        names += tuple(_shared_name(dtype, neox, rotary_dim) for neox in (True, False))
    return _cuda.ModuleSpec("rope", names, _DEFINES)


def _shared_compiled(rotary_dim: int, mode: int, norm: bool) -> bool:
    """Whether rope_rotate_shared is compiled into this module (any dtype): the two-level
    tables at a shipped rotary_dim, no norm."""
    return rotary_dim in SHIPPED_ROTARY_DIMS and mode == TWO_LEVEL and not norm


def _shared_vec(dtype: str, neox: bool) -> int:
    """rope_rotate_shared's VEC: 4 pairs a chunk (a 16-bit neox chunk in two 8-byte accesses,
    every other chunk in 16-byte ones)."""
    return 4 if neox else 16 // ITEMSIZE[dtype]


def _shared_name(dtype: str, neox: bool, rotary_dim: int) -> str:
    flags = f"{str(neox).lower()}, {_shared_vec(dtype, neox)}, {rotary_dim}"
    return f"rope_rotate_shared<{_cuda.CUDA_TYPES[dtype]}, {flags}>"


def _packs_compiled(dtype: str, rotary_dim: int, norm: bool) -> bool:
    """Whether rope_rotate_packs is compiled into this module (any table mode): a shipped
    rotary_dim; with the norm, 16-bit rows."""
    return rotary_dim in SHIPPED_ROTARY_DIMS and (not norm or ITEMSIZE[dtype] == 2)


def _packs_lane(neox: bool, table: int, norm: bool) -> tuple[int, int]:
    """(bytes of a row a lane, rows a lane) of rope_rotate_packs (_PACK_WIDE_ROWS says why)."""
    if neox and not norm and table in (TWO_LEVEL, COS_SIN_CACHE):
        return 32, _PACK_WIDE_ROWS
    return 16, _PACK_ROWS


def _packs_name(dtype: str, neox: bool, rotary_dim: int, table: int, norm: bool) -> str:
    """(table: rope.cu's TABLE, the module's mode or MROPE_GROUPED)"""
    lane_bytes, rows = _packs_lane(neox, table, norm)
    flags = f"{str(neox).lower()}, {rotary_dim}, {lane_bytes}, {rows}, {table}"
    return f"rope_rotate_packs<{_cuda.CUDA_TYPES[dtype]}, {flags}, {str(norm).lower()}>"


def instantiations(
    dtype: str, neox: bool, rotary_dim: int, norm: bool, mode: int = TWO_LEVEL
) -> tuple[tuple[int, int, int], ...]:
    """(vector width, NORM, HEADS) of every kernel compiled for one dtype, rotation layout,
    rotary_dim, norm flag and table mode (a rotary_dim outside the shipped set has the
    run-time rotary_dim kernels: no NORM_ROWS)."""
    wide = 16 // ITEMSIZE[dtype]
    layout = NORM_CHUNKS if norm else NO_NORM
    widths = (wide, 1)
    if _narrows(dtype, neox, mode, norm):
        widths = (wide, wide // 2, 1)
    kernels = tuple(
        (vec, layout, heads) for vec in widths for heads in _heads_choices(dtype, neox, norm)
    )
    if norm and _rows_layout_compiled(dtype, rotary_dim):
        kernels += ((wide, NORM_ROWS, _ROWS_HEADS),)
    return kernels


def _narrows(dtype: str, neox: bool, mode: int, norm: bool) -> bool:
    """Whether large launches of this kind take half-width accesses (_NARROW_NEOX_ROWS)."""
    return neox and ITEMSIZE[dtype] == 2 and mode == TWO_LEVEL and not norm


def access_width(
    dtype: str, neox: bool, mode: int, norm: bool, head_rows: int, aligned_width: int
) -> int:
    """The vector width (rope.cu's VEC) of a launch of ``head_rows`` rows (tokens x heads)
    whose rows allow ``aligned_width`` (:func:`_vector_width`): half of it where a 16-byte
    access holds a 16-bit neox chunk that large launches hold better as two
    (_NARROW_NEOX_ROWS)."""
    wide = 16 // ITEMSIZE[dtype]
    if (
        aligned_width == wide
        and head_rows >= _NARROW_NEOX_ROWS
        and _narrows(dtype, neox, mode, norm)
    ):
        return wide // 2
    return aligned_width


@cache
def _kernel(
    dtype: str, neox: bool, vec: int, rotary_dim: int, mode: int, norm: int, heads: int
) -> tuple[_cuda.ModuleSpec, str]:
    """(module, name expression) of one instantiation (norm: 0, or the fused norm's lane
    layout; True is NORM_CHUNKS); rotary dims outside the shipped set use the run-time
    rotary_dim instantiation (never NORM_ROWS, which _geometry picks only at shipped ones)."""
    compiled_rotary_dim = rotary_dim if rotary_dim in SHIPPED_ROTARY_DIMS else 0
    spec = module_spec(dtype, compiled_rotary_dim, mode, norm != NO_NORM)
    return spec, _name(dtype, neox, vec, compiled_rotary_dim, mode, norm, heads)


def module_specs() -> list[_cuda.ModuleSpec]:
    """Every module this primitive may launch: each dtype and table mode at the shipped
    rotary dims and at the run-time one (0), with and without the fused norm."""
    return [
        module_spec(dtype, rotary_dim, mode, norm)
        for norm in (False, True)
        for mode in (NORM_TABLE_MODES if norm else TABLE_MODES)
        for dtype in _cuda.CUDA_TYPES
        for rotary_dim in (*SHIPPED_ROTARY_DIMS, 0)
    ]


def _vector_width(
    dtype: str,
    neox: bool,
    rotary_dim: int,
    head_dim: int,
    copy_tail: bool,
    rows: list[HeadRows],
) -> int:
    """16-byte accesses where every row, stride and column boundary allows; else one
    element per access (any view whose last dimension is contiguous)."""
    itemsize = ITEMSIZE[dtype]
    # OR-ing every byte offset that must be a multiple of the access size: one test per width
    offsets = (rotary_dim // 2 if neox else rotary_dim) * itemsize
    if copy_tail:
        offsets |= (head_dim - rotary_dim) * itemsize
    for r in rows:
        offsets |= r.operand.ptr
        for stride, size in zip(r.strides[:3], r.shape[:3], strict=True):
            if size > 1:
                offsets |= stride * itemsize
    wide = 16 // itemsize
    return wide if offsets % 16 == 0 else 1


@dataclass(frozen=True, slots=True)
class _LaunchPlan:
    """What a launch derives from shapes, strides and alignment alone, computed once per
    layout: at decode sizes this bookkeeping costs more than the kernel."""

    steps: tuple[_cuda.Step]
    tail_chunks: int
    grouped: bool = False  # rope_rotate_packs at MROPE_GROUPED: the grouped tables


_plans: dict[tuple, _LaunchPlan] = {}


class _Geometry(NamedTuple):
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    tail_chunks: int
    heads: int  # rope.cu's HEADS
    norm: int  # rope.cu's NORM: NO_NORM, NORM_CHUNKS or NORM_ROWS


def _geometry(
    dtype: str,
    neox: bool,
    vec: int,
    rotary_dim: int,
    head_dim: int,
    copy_tail: bool,
    total_heads: int,
    tokens: int,
    norm: bool,
    rows_in_place: bool = False,
) -> _Geometry:
    """(grid, block, tail_chunks, HEADS, NORM) of a launch: x-lanes over a head row's chunks, y
    over the heads (HEADS at a time, in the rounds of _SMALL_LAUNCH_LAYOUT or, for large
    launches, _LARGE_LAUNCH_LAYOUT), z over tokens. With the fused norm a row's x-lanes are a
    power-of-two group of at most 32 (one warp's shuffles reduce it; rope.cu); a large launch
    that the NORM_ROWS layout takes (``rows_in_place``: written where read, head offsets within
    32 bits; 16-byte packs; rows rotated whole at a shipped rotary_dim) has one lane a pack, a
    warp one token's rows."""
    rotate_chunks = (rotary_dim // 2) // (vec if neox or vec == 1 else vec // 2)
    tail_chunks = (head_dim - rotary_dim) // vec if copy_tail else 0
    chunks = min(max(rotate_chunks, tail_chunks), _THREADS_PER_BLOCK)
    if norm:
        chunks = min(1 << (chunks - 1).bit_length(), 32)
    heads, rounds = _SMALL_LAUNCH_LAYOUT
    if tokens * chunks * -(-total_heads // (heads * rounds)) >= _LARGE_LAUNCH_THREADS:
        if (
            norm
            and rows_in_place
            and vec * ITEMSIZE[dtype] == 16
            and rotary_dim == head_dim
            and _rows_layout_compiled(dtype, rotary_dim)
        ):
            lanes = rotary_dim // vec
            tokens_per_block = _ROWS_THREADS // 32
            grid = (-(-tokens // tokens_per_block), 1, 1)
            block = (lanes, 32 // lanes, tokens_per_block)
            return _Geometry(grid, block, 0, _ROWS_HEADS, NORM_ROWS)
        heads, rounds = _large_launch_layout(dtype, neox, norm)
    head_lanes = max(1, min(-(-total_heads // (heads * rounds)), _THREADS_PER_BLOCK // chunks))
    # (blockDim.z is at most 64)
    tokens_per_block = max(1, min(_THREADS_PER_BLOCK // (chunks * head_lanes), 64))
    grid = (-(-tokens // tokens_per_block), 1, 1)
    layout = NORM_CHUNKS if norm else NO_NORM
    return _Geometry(grid, (chunks, head_lanes, tokens_per_block), tail_chunks, heads, layout)


def norm_shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of a fused-norm launch: q's and k's weights staged per block as
    float32 (rope.cu's stage_norm_weights). Raises ValueError past what a launch may take."""
    shared = 2 * head_dim * 4
    if shared > _SHARED_BYTES:
        raise ValueError(
            f"the fused QK-norm on CUDA takes head_dim <= {_SHARED_BYTES // 8} (its weights "
            f"are staged in shared memory), got head_dim={head_dim}; use the host path"
        )
    return shared


def _rows_in_place(rows: list[HeadRows]) -> bool:
    """Whether NORM_ROWS may take a launch of these rows (pairs (in, out) of q, then k): each
    operand written where it is read, its rows addressed from the token's by 32-bit offsets."""
    return all(
        rows[i].operand.ptr == rows[i + 1].operand.ptr and rows[i].strides == rows[i + 1].strides
        for i in range(0, len(rows), 2)
    ) and all(abs(r.strides[2]) * r.shape[2] < 1 << 31 for r in rows)


def _plan(
    rotary_dim: int,
    mode: int,
    neox: bool,
    rows: list[HeadRows],
    copy_tail: bool,
    norm: RowNorm | None,
    packs_table: int | None,
    sequential: bool,
) -> _LaunchPlan:
    """The launch of one layout (computed once): rope_rotate_packs where it takes the launch
    (_packs_layout; ``packs_table``: :func:`_packs_table` of the call), else
    rope_rotate_shared where it does (_shared_geometry, on a device whose DRAM asks a
    multiprocessor for at most _SHARED_MAX_SM_BANDWIDTH; ``sequential``: the positions are
    no ids), else rope_rotate's geometry."""
    q_in = rows[0]
    dtype, device = q_in.operand.dtype, q_in.operand.device
    alignment = 0
    for r in rows:
        alignment |= r.operand.ptr & 15
    rows_in_place = norm is not None and _rows_in_place(rows)  # (only the norm has two layouts)
    key = (
        dtype, neox, rotary_dim, mode, device, copy_tail, alignment, norm is not None,
        rows_in_place, packs_table, sequential,
        tuple((r.shape, r.strides) for r in rows),
    )  # fmt: skip
    plan = _plans.get(key)
    if plan is not None:
        return plan
    batch, seq, q_heads, head_dim = q_in.shape
    copy_tail = copy_tail or norm is not None  # a normed tail is always written
    total_heads = q_heads + (rows[2].shape[2] if len(rows) > 2 else 0)
    aligned_width = _vector_width(dtype, neox, rotary_dim, head_dim, copy_tail, rows)
    normed = norm is not None
    if packs_table is not None and _packs_layout(
        dtype, neox, rotary_dim, normed, packs_table, rows, aligned_width
    ):  # fmt: skip
        lane = _packs_lane(neox, packs_table, normed)
        threads = _packs_threads(batch * seq * total_heads, rotary_dim, dtype, lane)
        name = _packs_name(dtype, neox, rotary_dim, packs_table, normed)
        kernel = _cuda.function(module_spec(dtype, rotary_dim, mode, normed), name, device)
        step = _cuda.Step(kernel, (-(-threads // _PACK_THREADS), 1, 1), (_PACK_THREADS, 1, 1), 0)
        plan = _LaunchPlan(steps=(step,), tail_chunks=0, grouped=packs_table == MROPE_GROUPED)
        return _remember_plan(key, plan)
    shared = None
    if 0 < _cuda.dram_bandwidth_per_multiprocessor(device) <= _SHARED_MAX_SM_BANDWIDTH:
        shared = _shared_geometry(
            dtype, neox, rotary_dim, mode, sequential, normed, rows, aligned_width
        )
    if shared is not None:
        name = _shared_name(dtype, neox, rotary_dim)
        kernel = _cuda.function(module_spec(dtype, rotary_dim, mode, False), name, device)
        step = _cuda.Step(kernel, *shared, 0)
        return _remember_plan(key, _LaunchPlan(steps=(step,), tail_chunks=0))
    vec = access_width(
        dtype, neox, mode, norm is not None, batch * seq * total_heads, aligned_width
    )  # fmt: skip
    geometry = _geometry(
        dtype, neox, vec, rotary_dim, head_dim, copy_tail, total_heads, batch * seq,
        norm is not None, rows_in_place,
    )  # fmt: skip
    spec, name = _kernel(dtype, neox, vec, rotary_dim, mode, geometry.norm, geometry.heads)
    shared = 0 if norm is None else norm_shared_bytes(head_dim)
    kernel = _cuda.function(spec, name, device)
    step = _cuda.Step(kernel, geometry.grid, geometry.block, shared)
    return _remember_plan(key, _LaunchPlan(steps=(step,), tail_chunks=geometry.tail_chunks))


def _remember_plan(key: tuple, plan: _LaunchPlan) -> _LaunchPlan:
    if len(_plans) > 4096:  # shapes churn (e.g. growing prefill chunks): start over
        _plans.clear()
    _plans[key] = plan
    return plan


def _packs_layout(
    dtype: str,
    neox: bool,
    rotary_dim: int,
    norm: bool,
    table: int,
    rows: list[HeadRows],
    aligned_width: int,
) -> bool:
    """Whether rope_rotate_packs takes a launch in the table mode it has for it (``table``:
    :func:`_packs_table`; _PACK_* above): q, or q and k (``rows``: their (in, out) pairs), at
    any positions, 16-byte-aligned rows rotated whole at a compiled rotary_dim, a multiple of
    a lane's rows (:func:`_packs_lane`) of heads in each operand, head offsets within 32
    bits, from _PACK_MIN_HEAD_ROWS head rows in all to _PACK_MAX_HEAD_ROWS of the dtype's
    element size and the layout, fewer than _PACK_MAX_THREADS threads."""
    if aligned_width * ITEMSIZE[dtype] != 16:
        return False
    batch, seq, _, head_dim = rows[0].shape
    head_rows = batch * seq * sum(r.shape[2] for r in rows[::2])
    lane = _packs_lane(neox, table, norm)
    return (
        rotary_dim == head_dim
        and _packs_compiled(dtype, rotary_dim, norm)
        and all(r.shape[2] % lane[1] == 0 for r in rows)
        and _PACK_MIN_HEAD_ROWS <= head_rows < _PACK_MAX_HEAD_ROWS[ITEMSIZE[dtype], neox]
        and _packs_threads(head_rows, rotary_dim, dtype, lane) < _PACK_MAX_THREADS
        and all(r.strides[2] > 0 and r.strides[2] * r.shape[2] < 1 << 31 for r in rows)
    )


def _shared_geometry(
    dtype: str,
    neox: bool,
    rotary_dim: int,
    mode: int,
    sequential: bool,
    norm: bool,
    rows: list[HeadRows],
    aligned_width: int,
) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
    """(grid, block) of rope_rotate_shared where it takes a launch that rope_rotate_packs
    does not (_SHARED_* above), else None: the two-level tables at ``sequential`` positions
    (no ids), no norm, 16-byte-aligned rows rotated whole at a compiled rotary_dim, every
    operand's sequences one run of rows (one sequence, or batch stride = seq * token stride:
    the kernel addresses a row by the token's index alone), at least _SHARED_MIN_HEADS rows a
    token and _SHARED_MIN_HEAD_ROWS in all. A block holds a chunk of each of up to
    _SHARED_THREADS // chunks rows of one token, a token's rows spread evenly over its
    blocks (grid x, adjacent in launch order), the tokens in rows of _MAX_GRID_Y (grid y, the
    rows z; the kernel numbers tokens in 32 bits)."""
    if (
        aligned_width * ITEMSIZE[dtype] != 16
        or not sequential
        or not _shared_compiled(rotary_dim, mode, norm)
    ):
        return None
    batch, seq, _, head_dim = rows[0].shape
    total_heads = sum(r.shape[2] for r in rows[::2])
    tokens = batch * seq
    if (
        rotary_dim != head_dim
        or total_heads < _SHARED_MIN_HEADS
        or tokens * total_heads < _SHARED_MIN_HEAD_ROWS
        or not all(batch == 1 or r.strides[0] == seq * r.strides[1] for r in rows)
    ):
        return None
    vec = _shared_vec(dtype, neox)
    chunks = (rotary_dim // 2) // (vec if neox else vec // 2)
    blocks_a_token = -(-total_heads // (_SHARED_THREADS // chunks))
    rows_a_block = -(-total_heads // blocks_a_token)
    token_rows = min(tokens, _MAX_GRID_Y)  # tokens a row of the grid (y), rows in z
    grid_rows = -(-tokens // token_rows)
    if grid_rows > _MAX_GRID_Z:
        return None
    # (a block forms its token's cos/sin a pair a thread: from 8 rows a token, each block holds
    # half the rows _SHARED_THREADS takes or more, so at least a row's pairs in threads)
    assert chunks * rows_a_block >= rotary_dim // 2, (chunks, rows_a_block)
    return (blocks_a_token, token_rows, grid_rows), (chunks, rows_a_block, 1)


def _packs_table(
    dtype: str, mode: int, rotary_dim: int, section: tuple[int, int, int] | None, interleaved: bool
) -> int | None:
    """The table mode (rope.cu's TABLE) rope_rotate_packs would rotate a call of table mode
    ``mode`` in, or None where it cannot: a lane (16 bytes: 8 // itemsize pairs of a row,
    neox or not) forms all its cos/sin at one position row. Under MRoPE that holds
    for sectioned rows whose boundaries fall on lane boundaries (Qwen2-VL's (16, 24, 24), for
    one: MROPE) and for interleaved rows whose pairs group (:func:`grouped_pair_order`:
    Qwen3-VL's (24, 20, 20), for one: MROPE_GROUPED)."""
    if mode != MROPE:
        return mode
    if interleaved:
        grouped = grouped_pair_order(section, rotary_dim // 2) is not None
        return MROPE_GROUPED if grouped else None
    pairs_a_lane = 8 // ITEMSIZE[dtype]
    first, second = section[0], section[0] + section[1]
    return MROPE if first % pairs_a_lane == 0 and second % pairs_a_lane == 0 else None


@cache
def grouped_pair_order(section: tuple[int, int, int], pairs: int) -> tuple[int, ...] | None:
    """The column order of the grouped tables of interleaved MRoPE rows (rope.cu's
    GROUP_PAIRS): the pairs of each position row in increasing order, row 0's first, cut into
    groups of GROUP_PAIRS, pair j at column ``group * GROUP_PAIRS + j % GROUP_PAIRS``; entry
    t of the result is the pair at column t. None where a row's pairs do not fill whole
    groups holding one pair of each residue mod GROUP_PAIRS."""
    rows = mrope_rows(section, True, pairs)
    if any(np.count_nonzero(rows == row) % GROUP_PAIRS for row in range(3)):
        return None
    in_order = np.concatenate([np.flatnonzero(rows == row) for row in range(3)])
    groups = in_order.reshape(-1, GROUP_PAIRS)
    if not (np.sort(groups % GROUP_PAIRS, axis=1) == np.arange(GROUP_PAIRS)).all():
        return None
    columns = np.arange(pairs) // GROUP_PAIRS * GROUP_PAIRS + in_order % GROUP_PAIRS
    order = np.empty(pairs, np.int64)
    order[columns] = in_order
    return tuple(int(j) for j in order)


def grouped_table_order(
    section: tuple[int, int, int] | None, interleaved: bool, rotary_dim: int, head_dim: int
) -> tuple[int, ...] | None:
    """The column order of the grouped table that rope_rotate_packs reads for these MRoPE
    rows (:func:`grouped_pair_order`), or None where no call of theirs takes it: no
    interleaved sections, sections that do not group, rows not rotated whole at a compiled
    rotary_dim."""
    if section is None or not interleaved:
        return None
    if rotary_dim != head_dim or rotary_dim not in SHIPPED_ROTARY_DIMS:
        return None
    return grouped_pair_order(section, rotary_dim // 2)


def _packs_threads(head_rows: int, rotary_dim: int, dtype: str, lane: tuple[int, int]) -> int:
    """Threads of a rope_rotate_packs launch of ``lane`` (:func:`_packs_lane`: bytes of a row
    a lane, rows a lane): a row's lanes for each lane's rows."""
    lane_bytes, rows = lane
    return head_rows // rows * (rotary_dim * ITEMSIZE[dtype] // lane_bytes)


def check_token_counts(batch: int, seq: int) -> None:
    """RopeParams holds batch and seq as 32-bit ints (the kernels' token arithmetic is 64-bit
    past them): a CUDA call with either at 2**31 or more is refused, before any launch."""
    if batch >= 2**31 or seq >= 2**31:
        raise ValueError(
            f"a CUDA call takes fewer than 2**31 sequences and tokens a sequence (packed "
            f"tokens count as one sequence), got batch {batch}, seq {seq}; split the call"
        )


def _rotate_cuda(
    table, neox, inverse, q, k, positions: Positions, flag: ErrorFlag, stream, norm=None
) -> _cuda.Launch:
    q_in, q_out = q
    batch, seq, q_heads, head_dim = q_in.shape
    check_token_counts(batch, seq)
    device = q_in.operand.device
    rotary_dim = table.rotary_dim
    copy_tail = rotary_dim < head_dim and q_out.operand.ptr != q_in.operand.ptr
    rows = [q_in, q_out] if k is None else [q_in, q_out, k[0], k[1]]
    section, interleaved = positions.mrope_section, positions.mrope_interleaved
    if isinstance(table, CosSinCache):
        mode = COS_SIN_CACHE
    else:
        mode = TWO_LEVEL if section is None else MROPE
    dtype = q_in.operand.dtype
    packs_table = _packs_table(dtype, mode, rotary_dim, section, interleaved)
    plan = _plan(rotary_dim, mode, neox, rows, copy_tail, norm, packs_table, positions.ids is None)
    if mode == COS_SIN_CACHE:
        fine_ptr, coarse_ptr, capacity = 0, 0, table.capacity
    else:
        fine_ptr, coarse_ptr, capacity = table.device_tables(device, positions.cover)
        order = grouped_table_order(section, interleaved, rotary_dim, head_dim)
        if order is not None:
            # both tables alike on the device whichever layout a call takes, so that a call
            # captured into a CUDA graph after any eager one uploads neither
            grouped = shared_table(table.scheme, rotary_dim, order)
            tables = grouped.device_tables(device, positions.cover)
            if plan.grouped:
                fine_ptr, coarse_ptr, capacity = tables
    k_weight = None if norm is None else norm.k_weight

    k_in, k_out = (None, None) if k is None else k  # k_heads = 0: the kernel never reads k
    ids, offsets = positions.ids, positions.offsets
    params = ROPE_PARAMS.pack(
        q_in=q_in.operand.ptr, q_out=q_out.operand.ptr,
        q_in_stride=q_in.strides[:3], q_out_stride=q_out.strides[:3],
        k_in=0 if k is None else k_in.operand.ptr, k_out=0 if k is None else k_out.operand.ptr,
        k_in_stride=(0, 0, 0) if k is None else k_in.strides[:3],
        k_out_stride=(0, 0, 0) if k is None else k_out.strides[:3],
        ids=0 if ids is None else ids.ptr, offsets=0 if offsets is None else offsets.ptr,
        error_flag=flag.pointer(device), fine=fine_ptr, coarse=coarse_ptr,
        position_offset=positions.offset, position_limit=min(positions.limit, capacity),
        q_heads=q_heads, k_heads=0 if k is None else k_in.shape[2], batch=batch, seq=seq,
        rotary_dim=rotary_dim, tail_chunks=plan.tail_chunks,
        ids_is_int64=ids is not None and ids.dtype == "int64",
        offsets_is_int64=offsets is not None and offsets.dtype == "int64",
        sin_sign=-1.0 if inverse else 1.0,
        mrope_section=positions.mrope_section or (0, 0, 0),
        mrope_interleaved=positions.mrope_interleaved,
        cos_sin_cache=table.operand.ptr if mode == COS_SIN_CACHE else 0,
        q_norm_weight=0 if norm is None else norm.q_weight.ptr,
        k_norm_weight=0 if k_weight is None else k_weight.ptr,
        norm_eps=0.0 if norm is None else norm.eps,
        norm_weight_offset=0.0 if norm is None else norm.weight_offset,
        q_norm_weight_is_float32=norm is not None and norm.q_weight.dtype != q_in.operand.dtype,
        k_norm_weight_is_float32=k_weight is not None and k_weight.dtype != q_in.operand.dtype,
    )  # fmt: skip
    if stream is None:
        stream = stream_handle(q_in.operand)
    return _cuda.launch(device, params, plan.steps, stream)
