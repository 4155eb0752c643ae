"""The CUDA rotation kernels (``kernels_cu/rope.cu``: ``rope_rotate``, fused QK-RMSNorm
included, ``rope_rotate_packs`` and ``rope_rotate_shared``), executed on the host: compiled
by the C++ compiler against ``cuda_on_host.h`` (one thread per CUDA thread, block barriers
and warp shuffles through std::barrier), launched with the geometry, vector width and
parameter struct the package computes (``_rotate._geometry``, ``_vector_width``,
``ROPE_PARAMS``), and compared with the float64 oracle.

What this adds to the GPU tests: every lane layout of the norm's reduction (groups of 1 to
32 lanes, rows with more chunks than lanes, tails, one-element accesses, blocks of whole
warps and of partial ones), the weights staged in shared memory, q-only launches,
the MRoPE and cos_sin_cache table modes, and the whole-row layout's shuffles and its idle
lanes past the last row, checked on any machine with g++ (C++20); the shuffle emulation
refuses a mask that names neither the whole warp nor the calling group, or
a lane that has returned. A build failure fails the tests (only a missing g++ skips). Not
covered: timing, memory ordering, the PTX conversions.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from _oracle import (
    MROPE_SECTIONS,
    assert_matches_oracle,
    assert_matches_reference,
    assert_norm_rope_matches_oracle,
    mrope_pair_positions,
    numpy_dtype,
    random_data,
    rms_norm_reference,
    rotate_reference,
    standard_frequencies,
)

import kernels_cu
from tileops_cupy import _rotate
from tileops_cupy._arrays import ITEMSIZE, Operand
from tileops_cupy._tables import shared_table
from tileops_cupy.schemes import Standard

SHAPES = ((128, 128), (128, 64), (64, 48), (256, 256), (64, 16), (64, 64))  # (head_dim, rotary_dim)
WEIGHTS = (None, ("data", 0.0), ("float32", 1.0), ("mixed", 1.0))  # (kind, norm_weight_offset)
HEADS, KV_HEADS, BATCH, SEQ, POSITION = 4, 2, 1, 3, 1000
EPS = 1e-6
HEADER = Path(__file__).with_name("cuda_on_host.h")

_SHIM = """
#include "cuda_on_host.h"
{defines}
{rope}

// the dynamic shared memory of rope_rotate (2 * head_dim floats at most: the norm's weights)
alignas(16) float norm_weights[2 * 6144];

#define GEOMETRY unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz
template <typename T, bool NEOX, int VEC, int RD, int TABLE, int NORM, int HEADS>
void run(const RopeParams& p, GEOMETRY) {{
  launch_on_threads(dim3{{gx, gy, gz}}, dim3{{bx, by, bz}},
                    [&] {{ rope_rotate<T, NEOX, VEC, RD, TABLE, NORM, HEADS>(p); }});
}}

template <typename T, bool NEOX, int RD, int LANE_BYTES, int ROWS, int TABLE, bool NORM>
void run_packs(const RopeParams& p, GEOMETRY) {{
  launch_on_threads(dim3{{gx, gy, gz}}, dim3{{bx, by, bz}},
                    [&] {{ rope_rotate_packs<T, NEOX, RD, LANE_BYTES, ROWS, TABLE, NORM>(p); }});
}}

template <typename T, bool NEOX, int VEC, int RD>
void run_shared(const RopeParams& p, GEOMETRY) {{
  launch_on_threads(dim3{{gx, gy, gz}}, dim3{{bx, by, bz}},
                    [&] {{ rope_rotate_shared<T, NEOX, VEC, RD>(p); }});
}}

typedef void (*Runner)(const RopeParams&, GEOMETRY);
extern "C" Runner runners[] = {{{runners}}};
"""


def _cases():
    for dtype, neox, shape, misaligned, weights, in_place in itertools.product(
        ("float32", "bfloat16", "float16"), (True, False), SHAPES, (False, True), WEIGHTS,
        (True, False),
    ):  # fmt: skip
        yield dtype, neox, *shape, misaligned, weights, in_place, True
        if in_place and not misaligned:  # q alone (k_heads 0: nothing of k may be read)
            yield dtype, neox, *shape, misaligned, weights, in_place, False


# the other table modes (MRoPE's per-pair position rows, a caller's cos_sin_cache): in
# place, q and k of their own arrays, head_dim 80 with rotary_dim 64 (an untouched tail); and
# the norm's NORM_ROWS layout under MRoPE (whole rows: head_dim 64, a large launch's layout)
TABLE_CASES = (
    (_rotate.MROPE, False, False),
    (_rotate.MROPE, True, False),
    (_rotate.COS_SIN_CACHE, False, False),
    (_rotate.MROPE, True, True),
)
TABLE_HEAD_DIM, TABLE_ROTARY_DIM, SECTION, CACHE_ROWS = 80, 64, (8, 12, 12), 100


def _name_expressions() -> list[str]:
    """Every instantiation the cases may pick (both vector widths), and rope_rotate_packs."""
    launches = [
        (dtype, neox, rotary_dim, _rotate.TWO_LEVEL, weights is not None)
        for dtype, neox, _, rotary_dim, _, weights, *_ in _cases()
    ]
    launches += [
        (dtype, neox, TABLE_ROTARY_DIM, mode, norm)
        for dtype, neox, (mode, norm, _) in itertools.product(
            ("float32", "bfloat16"), (True, False), TABLE_CASES
        )
    ]
    names = [  # (the packs and shared kernels each shipped module holds)
        name
        for dtype, rotary_dim, mode, norm in itertools.product(
            ("bfloat16", "float16", "float32"), _rotate.SHIPPED_ROTARY_DIMS, _rotate.TABLE_MODES,
            (False, True),
        )
        if not norm or mode in _rotate.NORM_TABLE_MODES
        for name in _rotate.module_spec(dtype, rotary_dim, mode, norm).name_expressions
        if name.startswith(("rope_rotate_packs<", "rope_rotate_shared<"))
    ]  # fmt: skip
    for dtype, neox, rotary_dim, mode, norm in launches:
        for vec, layout, heads in _rotate.instantiations(dtype, neox, rotary_dim, norm, mode):
            name = _rotate._kernel(dtype, neox, vec, rotary_dim, mode, layout, heads)[1]
            if name not in names:
                names.append(name)
    return names


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """{name expression: the host runner of that instantiation}."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("needs g++ (C++20) to run the kernel source on the host")
    names = _name_expressions()
    runners = ", ".join(re.sub(r"^rope_rotate", "&run", name) for name in names)
    folder = tmp_path_factory.mktemp("rope_on_host")
    source = folder / "rope_on_host.cpp"
    source.write_text(
        _SHIM.format(
            defines="\n".join(f"#define {d.replace('=', ' ', 1)}" for d in _rotate._DEFINES),
            rope=kernels_cu.source("rope"), runners=runners,
        )
    )  # fmt: skip
    shutil.copy(HEADER, folder / HEADER.name)
    library = folder / "rope_on_host.so"
    build = subprocess.run(
        [compiler, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-o", str(library),
         str(source)],
        capture_output=True, text=True,
    )  # fmt: skip
    if build.returncode:
        pytest.fail(f"g++ could not build the host kernels:\n{build.stderr[:3000]}")
    handle = ctypes.CDLL(str(library))
    table = (ctypes.c_void_p * len(names)).in_dll(handle, "runners")
    runner_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p, *[ctypes.c_uint] * 6)
    return {name: runner_type(table[i]) for i, name in enumerate(names)}


def _rows(dtype: str, pointer: int, heads: int, head_dim: int, strides) -> _rotate.HeadRows:
    shape = (BATCH, SEQ, heads, head_dim)
    operand = Operand(None, "numpy", 0, dtype, shape, (*strides, 1), pointer)
    return _rotate.HeadRows(operand, shape, (*strides, 1))


def _head_rows(arrays, dtype: str, shape, strides, first: int) -> list[_rotate.HeadRows]:
    """(in, out) head rows of ``shape`` in numpy ``arrays``, from element ``first`` of each."""
    rows = []
    for array in arrays:
        operand = Operand(
            None, "numpy", 0, dtype, shape, strides, array.ctypes.data + first * array.itemsize
        )
        rows.append(_rotate.HeadRows(operand, shape, strides))
    return rows


def _array_rows(arrays, dtype: str, heads: int, rotary_dim: int, first_head: int) -> list:
    """(in, out) rows of ``heads`` heads of ``rotary_dim`` elements from head ``first_head``
    of each contiguous [batch, seq, width] numpy array in ``arrays``."""
    batch, seq, width = arrays[0].shape
    shape, strides = (batch, seq, heads, rotary_dim), (seq * width, width, rotary_dim, 1)
    return _head_rows(arrays, dtype, shape, strides, first_head * rotary_dim)


def _launch(kernel, grid, block, q_rows, k_rows, flagged=False, **fields) -> None:
    """Run ``kernel`` on host threads over q's (in, out) and k's (in, out) rows, with
    ``fields`` of RopeParams over these defaults: BATCH x SEQ tokens, HEADS q heads and
    KV_HEADS k heads, no ids or offsets, no table, no norm. Its error flag must stay 0 (be
    raised when ``flagged``)."""
    flag = np.zeros(1, np.int32)
    defaults = dict(
        ids=0, offsets=0, error_flag=flag.ctypes.data, fine=0, coarse=0, position_offset=0,
        q_heads=HEADS, k_heads=KV_HEADS, batch=BATCH, seq=SEQ, ids_is_int64=0,
        offsets_is_int64=0, sin_sign=1.0, mrope_section=(0, 0, 0), mrope_interleaved=0,
        cos_sin_cache=0, q_norm_weight=0, k_norm_weight=0, norm_eps=EPS, norm_weight_offset=0.0,
        q_norm_weight_is_float32=0, k_norm_weight_is_float32=0,
    )  # fmt: skip
    params = _rotate.ROPE_PARAMS.pack(
        q_in=q_rows[0].operand.ptr, q_out=q_rows[1].operand.ptr,
        q_in_stride=q_rows[0].strides[:3], q_out_stride=q_rows[1].strides[:3],
        k_in=k_rows[0].operand.ptr, k_out=k_rows[1].operand.ptr,
        k_in_stride=k_rows[0].strides[:3], k_out_stride=k_rows[1].strides[:3],
        **{**defaults, **fields},
    )  # fmt: skip
    kernel(ctypes.create_string_buffer(params), *grid, *[1] * (3 - len(grid)), *block)
    assert flag[0] == flagged


def _run_case(
    kernels, rng, dtype, neox, head_dim, rotary_dim, misaligned, weights, in_place, with_k,
    heads=(HEADS, KV_HEADS),
):  # fmt: skip
    """Rotate q and k (GQA, ``heads`` = (q's, k's), two different counts; q alone without
    ``with_k``) of one fused QKV buffer (starting one element in when ``misaligned``), in
    place or into new arrays, with or without the norm; check every element, v and the
    buffer's other bytes. Returns the vector width and the launch's geometry."""
    q_heads, kv_heads = heads
    rotated_heads = (q_heads, kv_heads) if with_k else (q_heads,)
    item = ITEMSIZE[dtype]
    width = misaligned + (q_heads + 2 * kv_heads) * head_dim
    host = random_data(rng, (BATCH, SEQ, width), dtype)
    buffer = host.copy()
    q_col, k_col = int(misaligned), int(misaligned) + q_heads * head_dim
    outputs = {
        h: np.zeros((BATCH, SEQ, h * head_dim), numpy_dtype(dtype)) for h in (q_heads, kv_heads)
    }
    strides = (SEQ * width, width, head_dim)
    rows = []
    for col, heads in ((q_col, q_heads), (k_col, kv_heads)):
        source = _rows(dtype, buffer.ctypes.data + col * item, heads, head_dim, strides)
        out_strides = (SEQ * heads * head_dim, heads * head_dim, head_dim)
        out = _rows(dtype, outputs[heads].ctypes.data, heads, head_dim, out_strides)
        target = source if in_place else out
        rows += [source, target]
    rows = rows[: 2 * len(rotated_heads)]
    norm = weights is not None
    norm_weights, weight_is_float32 = {}, {}
    if norm:  # "mixed": q's weight in the data's type, k's float32
        for heads in rotated_heads:
            data_typed = weights[0] == "data" or (weights[0] == "mixed" and heads == q_heads)
            weight_dtype = dtype if data_typed else "float32"
            values = rng.uniform(0.5, 1.5, head_dim) - weights[1]
            norm_weights[heads] = values.astype(numpy_dtype(weight_dtype))
            weight_is_float32[heads] = weight_dtype != dtype
    copy_tail = (rotary_dim < head_dim and not in_place) or norm
    vec = _rotate.access_width(
        dtype, neox, _rotate.TWO_LEVEL, norm, BATCH * SEQ * sum(rotated_heads),
        _rotate._vector_width(dtype, neox, rotary_dim, head_dim, copy_tail, rows),
    )  # fmt: skip
    geometry = _rotate._geometry(
        dtype, neox, vec, rotary_dim, head_dim, copy_tail, sum(rotated_heads), BATCH * SEQ, norm,
        in_place,
    )  # fmt: skip
    grid, block, tail_chunks, at_once, layout = geometry
    k_rows = rows[2:] or [_rows(dtype, 0, 0, head_dim, (0, 0, 0))] * 2  # (k_heads 0: unread)
    table = shared_table(Standard(), rotary_dim)
    table.ensure(POSITION + SEQ)
    fine, coarse = (np.ascontiguousarray(t) for t in (table.fine32, table.coarse32))
    name = _rotate._kernel(dtype, neox, vec, rotary_dim, _rotate.TWO_LEVEL, layout, at_once)[1]
    _launch(
        kernels[name], grid, block, rows[:2], k_rows, fine=fine.ctypes.data, q_heads=q_heads,
        coarse=coarse.ctypes.data, position_offset=POSITION, position_limit=table.capacity,
        k_heads=kv_heads if with_k else 0, rotary_dim=rotary_dim, tail_chunks=tail_chunks,
        q_norm_weight=norm_weights[q_heads].ctypes.data if norm else 0,
        k_norm_weight=norm_weights[kv_heads].ctypes.data if norm and with_k else 0,
        norm_weight_offset=weights[1] if norm else 0.0,
        q_norm_weight_is_float32=norm and weight_is_float32[q_heads],
        k_norm_weight_is_float32=norm and with_k and weight_is_float32[kv_heads],
    )  # fmt: skip

    x64 = host.astype(np.float64)
    positions = (POSITION + np.arange(SEQ))[None, :, None]
    frequencies = standard_frequencies(rotary_dim)
    case = f"{dtype} neox={neox} D{head_dim}/{rotary_dim} vec={vec} block={block} k={with_k}"
    for col, heads in ((q_col, q_heads), (k_col, kv_heads))[: len(rotated_heads)]:
        shape = (BATCH, SEQ, heads, head_dim)
        x = x64[..., col : col + heads * head_dim].reshape(shape)
        y = buffer[..., col : col + heads * head_dim] if in_place else outputs[heads]
        y = y.astype(np.float64).reshape(shape)
        what = f"{case} heads={heads}"
        if norm:
            weight = norm_weights[heads].astype(np.float64)
            assert_norm_rope_matches_oracle(
                y, x, weight, EPS, weights[1], positions, frequencies, dtype, neox=neox, what=what
            )
        else:
            assert_matches_oracle(y, x, positions, frequencies, dtype, neox=neox, what=what)
    v_col = k_col + kv_heads * head_dim if with_k else k_col  # (without k: k and v unchanged)
    np.testing.assert_array_equal(buffer[..., v_col:], host[..., v_col:], err_msg=f"{case}: v")
    np.testing.assert_array_equal(buffer[..., :q_col], host[..., :q_col], err_msg=case)
    if not in_place:
        np.testing.assert_array_equal(buffer, host, err_msg=f"{case}: the source changed")
    return vec, geometry


@pytest.mark.parametrize("neox", (True, False), ids=("neox", "interleaved"))
@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "float16"))
def test_kernel_on_host_threads_matches_oracle(kernels, rng, dtype, neox):
    """Every shape, alignment, norm weight kind and direction of output of one dtype and
    layout; the cases must reach both vector widths and norm groups of 32 lanes and fewer."""
    widths, norm_lanes = set(), set()
    for case in _cases():
        if case[:2] == (dtype, neox):
            vec, geometry = _run_case(kernels, rng, *case)
            widths.add(vec)
            if case[5] is not None:
                norm_lanes.add(geometry.block[0])
    assert widths == {16 // ITEMSIZE[dtype], 1}
    assert 32 in norm_lanes and len(norm_lanes) > 1, norm_lanes


def test_launch_geometry_stays_within_cuda_limits():
    """Every block the launch plan makes is one CUDA launches (at most ROPE_THREADS threads,
    blockDim.z <= 64), covers every token, and gives the norm a power-of-two x-group of at
    most 32 lanes; over head dims, rotary dims, both vector widths, head and token counts."""
    for dtype, head_dim, vec, neox, norm, heads, tokens in itertools.product(
        ("bfloat16", "float32"), (16, 64, 128, 256, 512), (1, 8), (True, False), (False, True),
        (1, 2, 5, 40, 64), (1, 3, 64, 5000, 1 << 16),
    ):  # fmt: skip
        for rotary_dim, in_place in itertools.product(
            {2 * vec, head_dim // 2, head_dim}, (False, True)
        ):
            grid, block, _, _, layout = _rotate._geometry(
                dtype, neox, vec, rotary_dim, head_dim, True, heads, tokens, norm, in_place
            )
            assert math.prod(block) <= _rotate._THREADS_PER_BLOCK and block[2] <= 64, block
            assert grid[0] * block[2] >= tokens
            if norm:
                assert block[0] <= 32 and block[0] & (block[0] - 1) == 0, block
            if layout == _rotate.NORM_ROWS:  # a warp is one token's rows, blocks whole warps
                assert block[0] * block[1] == 32, block
                assert math.prod(block) == _rotate._ROWS_THREADS, block


@pytest.mark.parametrize("neox", (True, False), ids=("neox", "interleaved"))
@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float32"))
def test_large_launch_layout_on_host_threads(kernels, rng, monkeypatch, dtype, neox):
    """The layout of large launches, forced at host sizes, every shape, alignment and norm
    weight kind against the oracle: HEADS at a time in rounds, the last partly empty here
    (q and k's 6 heads on one y-lane in two rounds of four, or, float32's neox rotation, on
    two y-lanes in three rounds of one); 16-bit in-place norm of whole rows in NORM_ROWS (one
    pack a lane, 6 or 4 rows over 2 y-lanes of D128 or 4 of D64, two at a time, and the
    second token of the last block past the last one)."""
    monkeypatch.setattr(_rotate, "_LARGE_LAUNCH_THREADS", 0)
    plain_heads = 1 if (dtype, neox) == ("float32", True) else 4
    seen = set()
    for case in _cases():
        if case[:2] == (dtype, neox):
            _, geometry = _run_case(kernels, rng, *case)
            seen.add((geometry.norm, geometry.heads, geometry.block[:2]))
    layouts = {(_rotate.NO_NORM, plain_heads), (_rotate.NORM_CHUNKS, 4)}
    if ITEMSIZE[dtype] == 2:
        layouts.add((_rotate.NORM_ROWS, _rotate._ROWS_HEADS))
        assert {(_rotate.NORM_ROWS, 2, (16, 2)), (_rotate.NORM_ROWS, 2, (8, 4))} <= seen, seen
    assert {(layout, heads) for layout, heads, _ in seen} == layouts
    assert (_rotate.NO_NORM, plain_heads, 2 if plain_heads == 1 else 1) in {
        (layout, heads, block[1]) for layout, heads, block in seen
    }, seen


@pytest.mark.parametrize("large", (False, True), ids=("small", "large"))
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_narrow_neox_accesses_on_host_threads(kernels, rng, monkeypatch, dtype, large):
    """16-bit neox rotations of large two-level launches move 8 bytes an access
    (_rotate._NARROW_NEOX_ROWS, forced at host sizes; in a one-round and the large layout):
    every shape, alignment and output direction against the oracle; the fused norm keeps
    16-byte accesses."""
    monkeypatch.setattr(_rotate, "_NARROW_NEOX_ROWS", 0)
    if large:
        monkeypatch.setattr(_rotate, "_LARGE_LAUNCH_THREADS", 0)
    widths = {}
    for case in _cases():
        if case[:2] == (dtype, True):
            vec, _ = _run_case(kernels, rng, *case)
            widths.setdefault(case[5] is not None, set()).add(vec)
    assert widths == {False: {4, 1}, True: {8, 1}}, widths


@pytest.mark.parametrize("neox", (True, False), ids=("neox", "interleaved"))
def test_blocks_of_partial_warps_on_host_threads(kernels, rng, neox):
    """12 rows a token (3 head lanes): blocks that are not whole warps, where the norm's
    shuffles name the row's lanes rather than the warp; bf16, every case against the oracle."""
    partial = 0
    for case in _cases():
        if case[:2] == ("bfloat16", neox) and case[5] is not None and case[7]:
            block = _run_case(kernels, rng, *case, heads=(8, 4))[1].block
            partial += math.prod(block) % 32 != 0
    assert partial


# rope_rotate_packs' positions: sequential, per-token ids (int32, int64), MRoPE's three rows
# of ids in sections on lane boundaries ("mrope") or interleaved in sections whose pairs group
# ("mrope-grouped", from the grouped tables), the only MRoPE it is planned for
# (_rotate._packs_table), a cos_sin_cache at ids (every table mode)
PACK_POSITIONS = ("sequential", "int32", "int64", "mrope", "mrope-grouped", "cache")
# interleaved sections (by pairs of a row) whose pairs group: Qwen3-VL's at D128
GROUPED_SECTIONS = {64: (24, 20, 20), 32: (16, 8, 8)}


def _pack_positions(rng, kind: str, rotary_dim: int, batch: int, seq: int, offsets) -> dict:
    """The RopeParams fields of one kind of PACK_POSITIONS and what the oracle needs: per-head
    ``positions`` ([B, T, 1], or [B, T, 1, pairs] per pair) or a ``cache`` to read."""
    if kind == "sequential" or kind in ("int32", "int64"):
        table = shared_table(Standard(), rotary_dim)
        table.ensure(POSITION + 700 + 4000)
        fine, coarse = (np.ascontiguousarray(t) for t in (table.fine32, table.coarse32))
        ids = None if kind == "sequential" else rng.integers(0, 4000, (batch, seq)).astype(kind)
        tokens = np.arange(seq) if ids is None else ids
        fields = dict(
            fine=fine.ctypes.data, coarse=coarse.ctypes.data, position_offset=POSITION,
            position_limit=table.capacity, offsets=offsets.ctypes.data, offsets_is_int64=1,
            ids=0 if ids is None else ids.ctypes.data, ids_is_int64=int(kind == "int64"),
        )  # fmt: skip
        positions = (POSITION + offsets[:, None] + tokens)[..., None]
        return dict(mode=_rotate.TWO_LEVEL, fields=fields, keep=(fine, coarse, ids),
                    positions=positions, per_pair=False)  # fmt: skip
    if kind in ("mrope", "mrope-grouped"):
        pairs, grouped = rotary_dim // 2, kind == "mrope-grouped"
        section = GROUPED_SECTIONS[pairs] if grouped else MROPE_SECTIONS[pairs]["mrope"]
        order = None
        if grouped:
            order = _rotate.grouped_pair_order(section, pairs)
            assert order is not None and order != tuple(range(pairs)), section
        table = shared_table(Standard(), rotary_dim, order)
        table.ensure(1 << 16)
        fine, coarse = (np.ascontiguousarray(t) for t in (table.device_fine32, table.coarse32))
        ids = rng.integers(0, 1 << 16, (3, batch, seq)).astype(np.int64)
        fields = dict(
            fine=fine.ctypes.data, coarse=coarse.ctypes.data, position_limit=table.capacity,
            ids=ids.ctypes.data, ids_is_int64=1, mrope_section=section,
            mrope_interleaved=int(grouped),
        )  # fmt: skip
        positions = mrope_pair_positions(ids, section, grouped)[..., None, :]
        mode = _rotate.MROPE_GROUPED if grouped else _rotate.MROPE
        return dict(mode=mode, fields=fields, keep=(fine, coarse, ids),
                    positions=positions, per_pair=True)  # fmt: skip
    cache = rng.uniform(-1.5, 1.5, (CACHE_ROWS, rotary_dim)).astype(np.float32)
    ids = rng.integers(0, CACHE_ROWS, (batch, seq)).astype(np.int32)
    fields = dict(cos_sin_cache=cache.ctypes.data, position_limit=CACHE_ROWS, ids=ids.ctypes.data)
    return dict(mode=_rotate.COS_SIN_CACHE, fields=fields, keep=(cache, ids), cache=cache[ids])


def _launch_whole_rows(kernels, rng, dtype, neox, rotary_dim, shape, operands, in_place, case,
                       norm=False, shared=False, **fields):  # fmt: skip
    """One launch of a layout that rotates rows whole, rope_rotate_packs (``shared``:
    rope_rotate_shared, in the plan's geometry), over fresh data: ``shape`` (batch, seq),
    ``operands`` (q heads, k heads, k in an array of its own, else in q's rows), in place or
    into zeroed arrays; each array holds two more heads that nothing may touch. Returns (the
    rotated heads of each array {name: [(first head, heads)]}, the data as made {name:
    array}, the buffers launched on, the arrays written, the launch's threads)."""
    (batch, seq), (q_heads, k_heads, k_apart) = shape, operands
    rotated = {"q": [(0, q_heads)]}
    if k_heads:
        rotated.setdefault("k" if k_apart else "q", []).append((0 if k_apart else q_heads, k_heads))
    hosts = {
        name: random_data(rng, (batch, seq, (sum(h for _, h in runs) + 2) * rotary_dim), dtype)
        for name, runs in rotated.items()
    }
    buffers = {name: host.copy() for name, host in hosts.items()}
    results = buffers if in_place else {name: np.zeros_like(h) for name, h in hosts.items()}
    q_rows = _array_rows((buffers["q"], results["q"]), dtype, q_heads, rotary_dim, 0)
    k_rows = [_rows(dtype, 0, 0, rotary_dim, (0,) * 3)] * 2  # (k_heads 0: never read)
    if k_heads:
        k_array, k_first = ("k", 0) if k_apart else ("q", q_heads)
        k_arrays = (buffers[k_array], results[k_array])
        k_rows = _array_rows(k_arrays, dtype, k_heads, rotary_dim, k_first)
    aligned_width = 16 // ITEMSIZE[dtype]  # (16 bytes a lane)
    if shared:
        rows = q_rows + (k_rows if k_heads else [])
        grid, block = _rotate._shared_geometry(
            dtype, neox, rotary_dim, case["mode"], not case["fields"]["ids"], norm, rows,
            aligned_width,
        )  # fmt: skip
        threads = math.prod(grid) * math.prod(block)
        name = _rotate._shared_name(dtype, neox, rotary_dim)
    else:
        lane = _rotate._packs_lane(neox, case["mode"], norm)
        threads = _rotate._packs_threads(batch * seq * (q_heads + k_heads), rotary_dim, dtype, lane)
        grid, block = (-(-threads // _rotate._PACK_THREADS),), (_rotate._PACK_THREADS, 1, 1)
        name = _rotate._packs_name(dtype, neox, rotary_dim, case["mode"], norm)
    _launch(
        kernels[name], grid, block,
        q_rows, k_rows, q_heads=q_heads, k_heads=k_heads, batch=batch, seq=seq,
        rotary_dim=rotary_dim, tail_chunks=0, **case["fields"], **fields,
    )  # fmt: skip
    return rotated, hosts, buffers, results, threads


def _whole_rows_heads(launched, rotary_dim: int, what: str):
    """Each rotated run of a :func:`_launch_whole_rows` result as (its array's name, its first
    head, the source heads in float64 ``[B, T, heads, rotary_dim]``, the written heads, the
    same) after checking that nothing else was written: the two spare heads of each array as
    they were (zeros, out of place), and an out-of-place source unchanged."""
    rotated, hosts, buffers, results, _ = launched
    for array, runs in rotated.items():
        host, result = hosts[array], results[array]
        in_place = result is buffers[array]
        end = sum(heads for _, heads in runs) * rotary_dim
        untouched = host if in_place else np.zeros_like(host)
        np.testing.assert_array_equal(result[..., end:], untouched[..., end:], err_msg=what)
        if not in_place:
            np.testing.assert_array_equal(buffers[array], host, err_msg=f"{what}: source changed")
    for array, runs in rotated.items():
        for first, heads in runs:
            columns = slice(first * rotary_dim, (first + heads) * rotary_dim)
            shape = (*hosts[array].shape[:2], heads, rotary_dim)
            yield (
                array,
                first,
                *(
                    a[..., columns].astype(np.float64).reshape(shape)
                    for a in (hosts[array], results[array])
                ),
            )


@pytest.mark.parametrize("rotary_dim", _rotate.SHIPPED_ROTARY_DIMS)
@pytest.mark.parametrize("neox", (True, False), ids=("neox", "interleaved"))
@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float32"))
def test_packs_layout_on_host_threads(kernels, rng, dtype, neox, rotary_dim):
    """rope_rotate_packs (16 bytes of a row a lane: 8 elements of 16 bits or 4 of float32, a
    neox lane half of them from each half of the row; four rows of a token a lane; or, where
    _packs_lane says so, a neox lane 16 bytes of each half and two rows): q alone of 4 and 8
    heads (one and two row groups a token) and q with k in one launch (k's row groups after
    q's; k in q's rows, or in an array of its own with another token stride; 6 + 2 heads
    where a lane takes two rows), an odd token count (the last warp's lanes past the last row
    write nothing), per-sequence offsets, every kind of positions of PACK_POSITIONS (each
    table mode), both directions, in place and into new arrays (rows of wider ones: their
    last heads nothing may touch), every element against the oracle and nothing else
    written."""
    batch, seq = 3, 5
    partial_warps = 0
    # (q heads, k heads, k in an array of its own)
    operands = ((4, 0, False), (8, 0, False), (4, 4, False), (8, 4, False), (4, 8, False))
    operands += ((8, 4, True), (6, 2, True))
    offsets = np.array([0, 700, 3], np.int64)
    for (q_heads, k_heads, k_apart), inverse, in_place, kind in itertools.product(
        operands, (False, True), (False, True), PACK_POSITIONS
    ):
        if kind in ("mrope", "mrope-grouped", "cache") and inverse == in_place:
            continue  # (the other tables: half the direction and placement pairs)
        case = _pack_positions(rng, kind, rotary_dim, batch, seq, offsets)
        lane_rows = _rotate._packs_lane(neox, case["mode"], False)[1]
        if q_heads % lane_rows or k_heads % lane_rows:
            continue  # (whole row groups a token only)
        launched = _launch_whole_rows(
            kernels, rng, dtype, neox, rotary_dim, (batch, seq), (q_heads, k_heads, k_apart),
            in_place, case, sin_sign=-1.0 if inverse else 1.0,
        )  # fmt: skip
        partial_warps += launched[-1] % 32 != 0
        what = f"{dtype} neox={neox} D{rotary_dim} heads={q_heads}+{k_heads} "
        what += f"k_apart={k_apart} in_place={in_place} positions={kind}"
        for array, _, x64, y in _whole_rows_heads(launched, rotary_dim, what):
            if "cache" in case:
                row = case["cache"][:, :, None, :].astype(np.float64)
                cos, sin = row[..., : rotary_dim // 2], row[..., rotary_dim // 2 :]
                y64 = rotate_reference(x64, cos, sin, neox=neox, inverse=inverse)
                assert_matches_reference(y, y64, x64, rotary_dim, dtype, what=f"{what} {array}")
            else:
                assert_matches_oracle(
                    y, x64, case["positions"], standard_frequencies(rotary_dim), dtype,
                    neox=neox, inverse=inverse, per_pair=case["per_pair"], what=f"{what} {array}",
                )  # fmt: skip
    assert partial_warps or (dtype, rotary_dim) == ("float32", 128)  # (a row: a warp)


@pytest.mark.parametrize("rotary_dim", _rotate.SHIPPED_ROTARY_DIMS)
@pytest.mark.parametrize("neox", (True, False), ids=("neox", "interleaved"))
@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float32"))
def test_shared_layout_on_host_threads(kernels, rng, monkeypatch, dtype, neox, rotary_dim):
    """rope_rotate_shared (a chunk of one row a thread; a block's rows of one token, whose
    cos/sin the block forms once into shared memory, a pair a thread), in the plan's geometry
    (``_SHARED_MIN_HEAD_ROWS`` lowered to these calls, tokens in grid rows of 4 whose last is
    partial: ``_MAX_GRID_Y``): q alone, q with k in q's rows and apart, a token's rows over
    one block and over two (32 rows: 16-bit D128 blocks hold 16; float32 interleaved D128 a
    token of 12 rows in blocks of 6), sequential positions with per-sequence offsets (what
    the plan gives it), both directions, in place and into new arrays, every element against
    the oracle and nothing else written. Under 8 rows a token the plan keeps other layouts."""
    monkeypatch.setattr(_rotate, "_SHARED_MIN_HEAD_ROWS", 0)
    monkeypatch.setattr(_rotate, "_MAX_GRID_Y", 4)
    batch, seq = 3, 3
    offsets = np.array([0, 700, 3], np.int64)
    operands = ((8, 0, False), (24, 8, False), (4, 8, True), (8, 4, True))
    case = _pack_positions(rng, "sequential", rotary_dim, batch, seq, offsets)
    for (q_heads, k_heads, k_apart), inverse, in_place in itertools.product(
        operands, (False, True), (False, True)
    ):
        launched = _launch_whole_rows(
            kernels, rng, dtype, neox, rotary_dim, (batch, seq), (q_heads, k_heads, k_apart),
            in_place, case, shared=True, sin_sign=-1.0 if inverse else 1.0,
        )  # fmt: skip
        what = f"{dtype} neox={neox} D{rotary_dim} heads={q_heads}+{k_heads} "
        what += f"k_apart={k_apart} in_place={in_place} inverse={inverse} shared"
        for array, _, x64, y in _whole_rows_heads(launched, rotary_dim, what):
            assert_matches_oracle(
                y, x64, case["positions"], standard_frequencies(rotary_dim), dtype,
                neox=neox, inverse=inverse, what=f"{what} {array}",
            )  # fmt: skip
    few = _array_rows([np.zeros((1, 1 << 16, 7 * rotary_dim))] * 2, dtype, 7, rotary_dim, 0)
    width, mode = 16 // ITEMSIZE[dtype], _rotate.TWO_LEVEL
    assert _rotate._shared_geometry(dtype, neox, rotary_dim, mode, True, False, few, width) is None


@pytest.mark.parametrize("neox", (True, False), ids=("neox", "interleaved"))
@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
def test_shared_layout_positions_on_host_threads(kernels, rng, monkeypatch, dtype, neox):
    """rope_rotate_shared's two kinds of sequential positions: offset + s alone (no
    per-sequence offsets: the host has bounded them, as for the seed ops), and per-sequence
    offsets that take a sequence past the table's limit (device offsets are bounded by the
    kernel: the error flag is raised and the positions clamped, so no table row past the
    limit is read). Every element against the oracle at the clamped positions."""
    monkeypatch.setattr(_rotate, "_SHARED_MIN_HEAD_ROWS", 0)
    rotary_dim, batch, seq = 128, 3, 3
    for offsets_given, flagged in ((False, False), (True, True)):
        offsets = np.array([0, 6000, 3] if offsets_given else [0, 0, 0], np.int64)
        case = _pack_positions(rng, "sequential", rotary_dim, batch, seq, offsets)
        if offsets_given:  # sequence 1 runs from POSITION + 6000, past the table's last row
            limit = POSITION + 6000 + 1
            case["fields"]["position_limit"] = limit
            case["positions"] = np.minimum(case["positions"], limit - 1)
        else:
            case["fields"]["offsets"] = 0
        launched = _launch_whole_rows(
            kernels, rng, dtype, neox, rotary_dim, (batch, seq), (24, 8, False), True, case,
            shared=True, flagged=flagged,
        )  # fmt: skip
        what = f"{dtype} neox={neox} offsets={offsets_given} shared"
        for array, _, x64, y in _whole_rows_heads(launched, rotary_dim, what):
            assert_matches_oracle(
                y, x64, case["positions"], standard_frequencies(rotary_dim), dtype, neox=neox,
                what=f"{what} {array}",
            )  # fmt: skip


@pytest.mark.parametrize("rotary_dim", _rotate.SHIPPED_ROTARY_DIMS)
@pytest.mark.parametrize("neox", (True, False), ids=("neox", "interleaved"))
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_packs_norm_on_host_threads(kernels, rng, dtype, neox, rotary_dim):
    """rope_rotate_packs with the fused QK-RMSNorm (16-bit rows): each row's sum of squares
    over its lanes by shuffles, the weights of a lane's columns (float32 or the data's type,
    with an offset, read one element at a time: 16-byte-aligned or one element past), q
    alone and q with k (k in q's rows or apart), an odd token count (a last warp's lanes
    past the last row stay for the shuffles and write nothing), per-token ids and MRoPE
    sections, in place and into new arrays, every element against the float64 norm then
    rotation, and nothing else written."""
    batch, seq = 3, 5
    offsets = np.array([0, 700, 3], np.int64)
    partial_warps = 0
    for (q_heads, k_heads, k_apart), in_place, kind, (weight_kind, offset), aligned in (
        itertools.product(
            ((4, 0, False), (8, 4, False), (4, 8, True)), (False, True),
            ("int64", "mrope", "mrope-grouped"), (("float32", 0.0), ("data", 1.0)), (True, False),
        )
    ):  # fmt: skip
        case = _pack_positions(rng, kind, rotary_dim, batch, seq, offsets)
        weights = {}
        for name in ("q", "k"):
            w_dtype = np.dtype(np.float32 if weight_kind == "float32" else numpy_dtype(dtype))
            spare = rng.uniform(0.5, 1.5, rotary_dim + 16).astype(w_dtype)
            start = -spare.ctypes.data % 16 // w_dtype.itemsize + (not aligned)
            weights[name] = spare[start : start + rotary_dim]
        launched = _launch_whole_rows(
            kernels, rng, dtype, neox, rotary_dim, (batch, seq), (q_heads, k_heads, k_apart),
            in_place, case, norm=True, q_norm_weight=weights["q"].ctypes.data,
            k_norm_weight=weights["k"].ctypes.data if k_heads else 0,
            q_norm_weight_is_float32=int(weight_kind == "float32"),
            k_norm_weight_is_float32=int(weight_kind == "float32"), norm_eps=EPS,
            norm_weight_offset=offset,
        )  # fmt: skip
        partial_warps += launched[-1] % 32 != 0
        what = f"{dtype} neox={neox} D{rotary_dim} heads={q_heads}+{k_heads} "
        what += f"in_place={in_place} positions={kind} weights={weight_kind} aligned={aligned}"
        for array, first, x64, y in _whole_rows_heads(launched, rotary_dim, what):
            operand = "q" if array == "q" and first == 0 else "k"
            normed = rms_norm_reference(x64, weights[operand].astype(np.float64), EPS, offset)
            assert_matches_oracle(
                y, normed, case["positions"], standard_frequencies(rotary_dim), dtype, neox=neox,
                per_pair=case["per_pair"], what=f"{what} ({operand})", copied_tail=False,
            )  # fmt: skip
    assert partial_warps


@pytest.mark.parametrize(
    ("mode", "norm", "whole_rows"), TABLE_CASES, ids=("mrope", "mrope-norm", "cache", "mrope-rows")
)
@pytest.mark.parametrize("neox", (True, False), ids=("neox", "interleaved"))
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_table_modes_on_host_threads_match_oracle(
    kernels, rng, monkeypatch, dtype, neox, mode, norm, whole_rows
):
    """MRoPE (interleaved rows; with and without the norm, in both of the norm's layouts) and
    the cos_sin_cache table at per-token positions, in place, every element against the
    float64 oracle."""
    head_dim, rotary_dim, pairs = TABLE_HEAD_DIM, TABLE_ROTARY_DIM, TABLE_ROTARY_DIM // 2
    if whole_rows:
        head_dim = rotary_dim
        monkeypatch.setattr(_rotate, "_LARGE_LAUNCH_THREADS", 0)
    tokens = BATCH * SEQ
    data = {h: random_data(rng, (BATCH, SEQ, h, head_dim), dtype) for h in (HEADS, KV_HEADS)}
    x64 = {heads: array.astype(np.float64) for heads, array in data.items()}
    rows = []
    for heads, array in data.items():
        strides = tuple(stride // array.itemsize for stride in array.strides[:3])
        rows += [_rows(dtype, array.ctypes.data, heads, head_dim, strides)] * 2
    weights = {h: rng.uniform(0.5, 1.5, head_dim).astype(np.float32) for h in data} if norm else {}
    fine = coarse = cache = None
    if mode == _rotate.MROPE:
        table = shared_table(Standard(), rotary_dim)
        table.ensure(1 << 16)
        fine, coarse = (np.ascontiguousarray(t) for t in (table.fine32, table.coarse32))
        ids = rng.integers(0, 1 << 16, (3, tokens))
        limit = table.capacity
    else:
        cache = rng.uniform(-1.5, 1.5, (CACHE_ROWS, rotary_dim)).astype(np.float32)
        ids = rng.integers(0, CACHE_ROWS, tokens)
        limit = CACHE_ROWS
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    vec = _rotate.access_width(
        dtype, neox, mode, norm, tokens * (HEADS + KV_HEADS),
        _rotate._vector_width(dtype, neox, rotary_dim, head_dim, norm, rows),
    )  # fmt: skip
    grid, block, tail_chunks, heads, layout = _rotate._geometry(
        dtype, neox, vec, rotary_dim, head_dim, norm, HEADS + KV_HEADS, tokens, norm, True
    )
    expected = _rotate.NORM_ROWS if whole_rows and dtype == "bfloat16" else int(norm)
    assert layout == expected, (layout, expected)
    name = _rotate._kernel(dtype, neox, vec, rotary_dim, mode, layout, heads)[1]
    _launch(
        kernels[name], grid, block, rows[:2], rows[2:], ids=ids.ctypes.data,
        fine=0 if fine is None else fine.ctypes.data,
        coarse=0 if coarse is None else coarse.ctypes.data, position_limit=limit,
        rotary_dim=rotary_dim, tail_chunks=tail_chunks, ids_is_int64=1, mrope_section=SECTION,
        mrope_interleaved=1, cos_sin_cache=0 if cache is None else cache.ctypes.data,
        q_norm_weight=weights[HEADS].ctypes.data if norm else 0,
        k_norm_weight=weights[KV_HEADS].ctypes.data if norm else 0,
        q_norm_weight_is_float32=norm and dtype != "float32",
        k_norm_weight_is_float32=norm and dtype != "float32",
    )  # fmt: skip
    for heads, array in data.items():
        x = x64[heads]
        what = f"{dtype} neox={neox} vec={vec} block={block} heads={heads}"
        if mode == _rotate.MROPE:
            if norm:
                x = rms_norm_reference(x, weights[heads].astype(np.float64), EPS)
            positions = mrope_pair_positions(ids.reshape(3, BATCH, SEQ), SECTION, True)
            assert_matches_oracle(
                array.astype(np.float64), x, positions[..., None, :],
                standard_frequencies(rotary_dim), dtype, neox=neox, per_pair=True, what=what,
                copied_tail=not norm,
            )  # fmt: skip
        else:
            row = cache[ids.reshape(BATCH, SEQ)][..., None, :].astype(np.float64)
            y64 = rotate_reference(x, row[..., :pairs], row[..., pairs:], neox=neox)
            assert_matches_reference(array.astype(np.float64), y64, x, rotary_dim, dtype, what=what)
