"""Every kernel instantiation the package ships compiles with NVRTC for sm_80 and sm_90,
with no GPU or driver present (this runs in CI), spills no more than it does today (ptxas's
report), and every launch picks one of them.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

import kernels_cu
from tileops_cupy import _catalogue, _cuda, _mhc, _rotate
from tileops_cupy._arrays import ITEMSIZE, Operand
from tileops_cupy._tables import FINE_ROWS, shared_table
from tileops_cupy.schemes import Standard, YaRN

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC comes with CuPy")

ARCHS = ("sm_80", "sm_90")
ROTATE_DTYPES = ("float16", "bfloat16", "float32")


CATALOGUE = _catalogue.shipped_modules()


def _spec_id(spec: _cuda.ModuleSpec) -> str:
    return f"{spec.source}:{spec.name_expressions[0]}"


def test_shipped_modules_are_distinct():
    assert CATALOGUE and len(CATALOGUE) == len(set(CATALOGUE))
    assert {spec.source for spec in CATALOGUE} == {"rope", "mhc", "mhc_backward"}


def test_catalogue_holds_every_rotate_module():
    for mode in _rotate.TABLE_MODES:
        for dtype in ROTATE_DTYPES:
            for rotary_dim in (*_rotate.SHIPPED_ROTARY_DIMS, 0):
                spec = _rotate.module_spec(dtype, rotary_dim, mode)
                assert spec in CATALOGUE, (dtype, rotary_dim, mode)


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Every (spec, arch) compiled once, in parallel over the CPUs (NVRTC holds the GIL, so
    processes): each is seconds of NVRTC work, and CI has two cores. Values are the lowered
    names or the exception, re-raised by the test of that (spec, arch)."""
    jobs = [(spec, arch) for spec in CATALOGUE for arch in ARCHS]
    context = multiprocessing.get_context("spawn")  # no fork of a process that holds torch
    with ProcessPoolExecutor(min(len(jobs), os.cpu_count() or 1), mp_context=context) as pool:
        futures = {job: pool.submit(_cuda.compile_without_device, *job) for job in jobs}
        return {job: future.exception() or future.result() for job, future in futures.items()}


def _built(compiled: dict, spec: _cuda.ModuleSpec, arch: str) -> _cuda.DevicelessBuild:
    """The build of (spec, arch), or its compile error raised."""
    build = compiled[(spec, arch)]
    if isinstance(build, BaseException):
        raise build
    return build


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", CATALOGUE, ids=_spec_id)
def test_compiles_without_a_device(compiled, spec, arch):
    build = _built(compiled, spec, arch)
    lowered = build.lowered
    assert set(lowered) == set(spec.name_expressions)
    for name, mangled in lowered.items():
        assert isinstance(mangled, str) and mangled.startswith("_Z"), (name, mangled)
    # distinct instantiations must not collapse into one symbol
    assert len(set(lowered.values())) == len(lowered)


# What ptxas (-v) reports spilled today, in bytes, per (arch, kernel); every other kernel
# spills nothing. The mHC kernels of n = 7, 8 sit at 255 registers; the 16-bit neox norm
# rotations (0-36 bytes on sm_90, the MRoPE ones most; up to 64 on sm_80, since the fused
# norm's rewrite of 2026-12-01 that took it from 48-54% to 67-77% of the copy ceiling) and
# the run-time rotary_dim plain ones at the caps chosen for occupancy (rope.cu; the MRoPE
# ones moved by up to 40 bytes either way when rope_rotate's token rows and table lookups
# became TokenRows and with_cos_sin, 2026-12-06); the
# one-launch pre backward (mhc_bwd_fused, n >= 6) around the calls of its stages, and the
# fused pre (mhc_project's FUSED instantiations, float32 x or n = 8) at one block's 255. A
# kernel that spills more than here ran out of registers: the rejected RoPE experiments of
# 2026-12-01 spilled 108-116 bytes and ran 25-30% slower. (Fewer is welcome: lower the entry.)
KNOWN_SPILLS = {
    ("sm_80", "mhc_bwd_fused<bfloat16_t, 8>"): 8,
    ("sm_80", "mhc_bwd_fused<float, 7>"): 32,
    ("sm_80", "mhc_bwd_fused<float, 8>"): 64,
    ("sm_80", "mhc_bwd_fused<half_t, 8>"): 8,
    ("sm_80", "mhc_post_bwd<half_t, 0, true>"): 8,
    ("sm_80", "mhc_pre_small<bfloat16_t, 5>"): 16,
    ("sm_80", "mhc_pre_small<float, 5>"): 16,
    ("sm_80", "mhc_pre_small<half_t, 5>"): 16,
    ("sm_80", "mhc_project<float, 8, 64, 3, true>"): 44,
    ("sm_80", "mhc_project<half_t, 8, 64, 3, true>"): 16,
    ("sm_80", "rope_rotate<bfloat16_t, true, 8, 0, 0, 1, 4>"): 32,
    ("sm_80", "rope_rotate<bfloat16_t, true, 8, 0, 1, 0, 4>"): 24,
    ("sm_80", "rope_rotate<bfloat16_t, true, 8, 0, 1, 1, 4>"): 64,
    ("sm_80", "rope_rotate<bfloat16_t, true, 8, 128, 0, 1, 4>"): 16,
    ("sm_80", "rope_rotate<bfloat16_t, true, 8, 128, 1, 1, 4>"): 60,
    ("sm_80", "rope_rotate<bfloat16_t, true, 8, 64, 0, 1, 4>"): 16,
    ("sm_80", "rope_rotate<bfloat16_t, true, 8, 64, 1, 1, 4>"): 60,
    ("sm_80", "rope_rotate<half_t, true, 8, 0, 0, 1, 4>"): 32,
    ("sm_80", "rope_rotate<half_t, true, 8, 0, 1, 0, 4>"): 24,
    ("sm_80", "rope_rotate<half_t, true, 8, 0, 1, 1, 4>"): 68,
    ("sm_80", "rope_rotate<half_t, true, 8, 128, 0, 1, 4>"): 16,
    ("sm_80", "rope_rotate<half_t, true, 8, 128, 1, 1, 4>"): 64,
    ("sm_80", "rope_rotate<half_t, true, 8, 64, 0, 1, 4>"): 16,
    ("sm_80", "rope_rotate<half_t, true, 8, 64, 1, 1, 4>"): 64,
    ("sm_90", "mhc_bwd_fused<bfloat16_t, 6>"): 8,
    ("sm_90", "mhc_bwd_fused<bfloat16_t, 8>"): 48,
    ("sm_90", "mhc_bwd_fused<float, 7>"): 68,
    ("sm_90", "mhc_bwd_fused<float, 8>"): 92,
    ("sm_90", "mhc_bwd_fused<half_t, 6>"): 48,
    ("sm_90", "mhc_bwd_fused<half_t, 8>"): 48,
    ("sm_90", "mhc_coefficients<bfloat16_t, 2>"): 16,  # (around its one call)
    ("sm_90", "mhc_coefficients<half_t, 2>"): 16,
    # 8 or 80 by the process's earlier NVRTC compiles (80 alone) since its first x stages
    # load before the phi fragments (programmatic dependent launch, 2026-12-03; 0 in one
    # process since the fused code left it, 2026-12-05)
    ("sm_90", "mhc_project<float, 8, 64, 3>"): 80,
    ("sm_90", "mhc_project<float, 7, 64, 3, true>"): 16,
    ("sm_90", "mhc_project<float, 8, 64, 3, true>"): 36,
    ("sm_90", "mhc_project<half_t, 8, 64, 3, true>"): 16,
    ("sm_90", "rope_rotate<bfloat16_t, true, 8, 0, 0, 0, 4>"): 8,
    ("sm_90", "rope_rotate<bfloat16_t, true, 8, 0, 0, 1, 4>"): 12,
    ("sm_90", "rope_rotate<bfloat16_t, true, 8, 0, 1, 0, 4>"): 40,
    ("sm_90", "rope_rotate<bfloat16_t, true, 8, 0, 1, 1, 4>"): 32,
    # The NORM_CHUNKS neox kernels of bf16 spilled 0, 0, 16, 16 before the tables' loads took
    # an L2 policy (load_kept_in_l2, 2026-12-07: its 64-bit policy register; half_t's MRoPE
    # ones went from 28 to 20)
    ("sm_90", "rope_rotate<bfloat16_t, true, 8, 128, 0, 1, 4>"): 16,
    ("sm_90", "rope_rotate<bfloat16_t, true, 8, 64, 0, 1, 4>"): 16,
    ("sm_90", "rope_rotate<bfloat16_t, true, 8, 128, 1, 1, 4>"): 28,
    ("sm_90", "rope_rotate<bfloat16_t, true, 8, 64, 1, 1, 4>"): 28,
    ("sm_90", "rope_rotate<half_t, true, 8, 0, 0, 1, 4>"): 8,
    ("sm_90", "rope_rotate<half_t, true, 8, 0, 1, 0, 4>"): 40,
    ("sm_90", "rope_rotate<half_t, true, 8, 0, 1, 1, 4>"): 28,
    ("sm_90", "rope_rotate<half_t, true, 8, 128, 1, 1, 4>"): 28,
    ("sm_90", "rope_rotate<half_t, true, 8, 64, 1, 1, 4>"): 28,
}  # fmt: skip
SPILL_SLACK = 8  # bytes: ptxas releases move these counts by a few


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", CATALOGUE, ids=_spec_id)
def test_no_kernel_spills_more_than_known(compiled, spec, arch):
    build = _built(compiled, spec, arch)
    for name, mangled in build.lowered.items():
        assert mangled in build.spill_stores, f"ptxas reported nothing for {name}"
        spilled, known = build.spill_stores[mangled], KNOWN_SPILLS.get((arch, name), 0)
        registers = build.registers.get(mangled)
        assert spilled <= known + SPILL_SLACK, (
            f"{name} ({arch}): {spilled} bytes spilled ({known} known), {registers} regs"
        )
        # A RoPE kernel's stack frame holds its spills and nothing else: an array kept in
        # local memory shows here alone (the MRoPE chunk kernel's three table rows did, 48
        # bytes and no spill, once their loads were inline assembly: 94.7 -> 88.5% of the
        # copy ceiling at N32768 on an H100). mHC's kernels keep small arrays there by design.
        if spec.source == "rope":
            frame = build.stack_frames[mangled]
            assert frame <= known + SPILL_SLACK, (
                f"{name} ({arch}): a {frame}-byte stack frame ({known} bytes of spills known)"
            )


def _ptx_kernels(spec: _cuda.ModuleSpec) -> dict[str, str]:
    """The PTX of each kernel of ``spec`` (compute_90) by its name expression, from its
    ``.entry`` line to its closing brace."""
    lowered, ptx, _ = _cuda.nvrtc_compile(spec, "compute_90")
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    kernels = {}
    for name, mangled in lowered.items():
        start = ptx.index(f".entry {mangled}(")
        kernels[name] = ptx[start : ptx.index("\n}\n", start)]
    return kernels


@pytest.mark.parametrize("n", (4, 6, 7))
def test_decode_pre_kernel_keeps_two_blocks_a_multiprocessor(n):
    """mhc_pre_small asks for two 256-thread blocks a multiprocessor up to n = 6 (at most 128
    registers): its plan puts about one wave of resident blocks in a grid, and left to itself
    a compiler may take more registers (CUDA 13.0's NVRTC gave n = 4 164: one block a
    multiprocessor, two waves). n = 7 and 8 would spill at 128 and ask for none."""
    kernel = _ptx_kernels(_mhc.pre_module("bfloat16", n))[f"mhc_pre_small<bfloat16_t, {n}>"]
    directives = kernel[kernel.index(")") : kernel.index("{")]
    assert ".maxntid 256, 1, 1" in directives
    assert (".minnctapersm 2" in directives) == (n <= 6), directives


def _rows(dtype: str, shape, strides, offset_elements: int = 0) -> _rotate.HeadRows:
    """Head rows of a fake device operand at a 256-byte aligned address plus an offset."""
    operand = Operand(
        obj=None,
        framework="cupy",
        device=0,
        dtype=dtype,
        shape=tuple(shape),
        strides=tuple(strides),
        ptr=1 << 20 | offset_elements * ITEMSIZE[dtype],
    )
    return _rotate.HeadRows(operand, tuple(shape), tuple(strides))


@pytest.mark.parametrize("norm", (False, True), ids=("rope", "qk-norm"))
@pytest.mark.parametrize("neox", (True, False), ids=("neox", "interleaved"))
@pytest.mark.parametrize("dtype", ROTATE_DTYPES)
def test_every_launch_picks_a_shipped_kernel(dtype, neox, norm):
    """For every (dtype, layout, rotary_dim, head_dim, alignment, fused norm or not, small or
    large launch) a launch can meet, the vector width and the (module, name expression) it
    selects are in the catalogue."""
    widths_seen, layouts_seen = set(), set()
    for head_dim in range(2, 258, 2):
        for rotary_dim in sorted({2, 16, 32, 64, 128, head_dim // 2 * 2, head_dim}):
            if not 2 <= rotary_dim <= head_dim or rotary_dim % 2:
                continue
            for offset in (0, 1, 2, 8):
                shape = (2, 3, 4, head_dim)
                source = _rows(dtype, shape, (3 * 4 * head_dim, 4 * head_dim, head_dim, 1), offset)
                output = _rows(dtype, shape, (3 * 4 * head_dim, 4 * head_dim, head_dim, 1))
                copy_tail = rotary_dim < head_dim
                aligned = _rotate._vector_width(
                    dtype, neox, rotary_dim, head_dim, copy_tail, [source, output]
                )
                for tokens, mode, in_place in itertools.product(
                    (1, 1 << 20),
                    _rotate.NORM_TABLE_MODES if norm else _rotate.TABLE_MODES,
                    (False, True),
                ):  # (a decode step's layout and a large launch's)
                    vec = _rotate.access_width(dtype, neox, mode, norm, 4 * tokens, aligned)
                    widths_seen.add(vec)
                    geometry = _rotate._geometry(
                        dtype, neox, vec, rotary_dim, head_dim, copy_tail, 4, tokens, norm,
                        in_place,
                    )  # fmt: skip
                    spec, name = _rotate._kernel(
                        dtype, neox, vec, rotary_dim, mode, geometry.norm, geometry.heads
                    )
                    layouts_seen.add(geometry.norm)
                    assert spec in CATALOGUE, (dtype, neox, rotary_dim, vec, mode, norm)
                    assert name in spec.name_expressions, (name, spec.name_expressions)
    wide = 16 // ITEMSIZE[dtype]
    narrow = {wide // 2} if neox and ITEMSIZE[dtype] == 2 and not norm else set()
    assert widths_seen == {wide, 1} | narrow, widths_seen
    layouts = {_rotate.NO_NORM} if not norm else {_rotate.NORM_CHUNKS}
    if norm and ITEMSIZE[dtype] == 2:
        layouts.add(_rotate.NORM_ROWS)
    assert layouts_seen == layouts, layouts_seen


def test_rows_layout_takes_in_place_rows_with_32_bit_offsets():
    """NORM_ROWS writes where it reads and addresses a token's rows by 32-bit offsets: a launch
    out of place, or with a head stride whose offsets pass 2**31 elements, keeps NORM_CHUNKS."""
    shape, strides = (1, 8, 4, 128), (8 * 4 * 128, 4 * 128, 128, 1)
    q, other = _rows("bfloat16", shape, strides), _rows("bfloat16", shape, strides, 4096)
    assert _rotate._rows_in_place([q, q])
    assert _rotate._rows_in_place([q, q, other, other])
    assert not _rotate._rows_in_place([q, other])
    assert not _rotate._rows_in_place([q, q, other, q])
    wide = _rows("bfloat16", shape, (strides[0], strides[1], 1 << 29, 1))  # 4 heads: 2**31
    assert not _rotate._rows_in_place([wide, wide])


def test_packs_layout_takes_mid_sized_launches():
    """rope_rotate_packs takes q, or q and k, at any positions and table mode, rotated whole at a
    shipped rotary_dim, 16-byte aligned, a multiple of a lane's rows of heads in each operand
    (four; two for the neox lanes of 32 bytes: _packs_lane), from _PACK_MIN_HEAD_ROWS head
    rows in all up to _PACK_MAX_HEAD_ROWS of the element size and layout (B1 S256, S8192 and
    B2 S2048 of 32 heads take it; B1 S255 and B8 S4096 do not, nor float32 neox B1 S16384,
    while float32 interleaved takes any size its 32-bit thread numbers reach; 32 q and 8 k
    heads count 40 a token); every other launch keeps rope_rotate. The kernel it names is
    shipped in that launch's module."""

    def takes(batch=1, seq=8192, heads=32, head_dim=128, rotary_dim=128, dtype="bfloat16",
              k_heads=0, offset=0, head_stride=None,
              neox=True, norm=False, table=_rotate.TWO_LEVEL):  # fmt: skip
        stride = head_stride or head_dim
        width = (heads + k_heads) * stride  # (q's heads then k's, of one fused row)
        strides = (seq * width, width, stride, 1)
        q = _rows(dtype, (batch, seq, heads, head_dim), strides, offset)
        rows = [q, _rows(dtype, (batch, seq, heads, head_dim), strides)]
        if k_heads:
            k = _rows(dtype, (batch, seq, k_heads, head_dim), strides, heads * stride)
            rows += [k, k]
        copy_tail = rotary_dim < head_dim
        aligned = _rotate._vector_width(dtype, neox, rotary_dim, head_dim, copy_tail, rows)
        return _rotate._packs_layout(dtype, neox, rotary_dim, norm, table, rows, aligned)

    assert takes() and takes(batch=2, seq=2048) and takes(dtype="float16")
    assert takes(dtype="float32") and takes(dtype="float32", batch=2, seq=2048)
    assert takes(dtype="float32", head_dim=64, rotary_dim=64)
    assert takes(seq=16384) and not takes(dtype="float32", seq=16384)  # _PACK_MAX_HEAD_ROWS
    assert not takes(batch=8, seq=4096, neox=False)  # (16-bit interleaved: the same bound)
    for batch in (1, 8, 32):  # float32 interleaved: 2**19, 2**20, 2**22 head rows
        assert takes(dtype="float32", batch=batch, seq=16384, neox=False)
        assert not takes(dtype="float32", batch=batch, seq=16384)
    # (8 threads a D128 row: 2**28 head rows are 2**31 threads, _PACK_MAX_THREADS)
    assert takes(dtype="float32", batch=(1 << 9) - 1, seq=1 << 14, neox=False)
    assert not takes(dtype="float32", batch=1 << 9, seq=1 << 14, neox=False)
    assert takes(head_dim=64, rotary_dim=64) and takes(heads=8, seq=1 << 14)
    assert takes(head_stride=192)  # (rows of a wider buffer: 32-bit head offsets)
    assert (
        takes(k_heads=8) and takes(seq=4096, k_heads=8) and takes(heads=4, k_heads=4, seq=1 << 14)
    )
    assert not takes(batch=8, seq=4096)  # _PACK_MAX_HEAD_ROWS
    assert not takes(seq=255, heads=24, k_heads=8) and takes(seq=256, heads=24, k_heads=8)
    assert not takes(batch=1, seq=255) and takes(batch=1, seq=256)  # _PACK_MIN_HEAD_ROWS
    assert not takes(k_heads=2, neox=False) and not takes(k_heads=6, neox=False)
    assert not takes(k_heads=2, norm=True) and not takes(k_heads=2, table=_rotate.MROPE)
    assert takes(k_heads=2) and takes(k_heads=6, table=_rotate.COS_SIN_CACHE)  # (two rows a lane)
    assert not takes(heads=30, seq=1 << 13, neox=False) and takes(heads=30, seq=1 << 13)
    assert not takes(heads=31, seq=1 << 13)
    assert not takes(rotary_dim=64) and not takes(head_dim=96, rotary_dim=96)
    assert not takes(offset=1)  # (one element in: not 16-byte aligned)
    # (any table mode: _packs_table says which it has, the plan passes the others by)
    assert not takes(head_stride=1 << 26)  # (32 heads: offsets past 2**31 elements)
    assert not takes(heads=4, k_heads=32, head_stride=1 << 26)  # (k's 32 heads: the same)
    for dtype, rotary_dim, neox, mode in itertools.product(
        ("bfloat16", "float16", "float32"),
        _rotate.SHIPPED_ROTARY_DIMS,
        (True, False),
        _rotate.TABLE_MODES,
    ):
        spec = _rotate.module_spec(dtype, rotary_dim, mode)
        assert spec in CATALOGUE
        assert _rotate._packs_name(dtype, neox, rotary_dim, mode, False) in spec.name_expressions
        if mode in _rotate.NORM_TABLE_MODES:  # the fused norm's: 16-bit rows
            normed = _rotate.module_spec(dtype, rotary_dim, mode, norm=True)
            assert normed in CATALOGUE
            with_norm = _rotate._packs_name(dtype, neox, rotary_dim, mode, True)
            assert (with_norm in normed.name_expressions) == (dtype != "float32")
            assert takes(
                dtype=dtype, head_dim=rotary_dim, rotary_dim=rotary_dim, neox=neox, norm=True,
            ) == (dtype != "float32")  # fmt: skip


def test_shared_layout_takes_large_sequential_launches():
    """rope_rotate_shared takes launches at sequential positions (the two-level tables, no
    ids) from _SHARED_MIN_HEAD_ROWS head rows, of 8 rows a token or more, rotated whole at a
    shipped rotary_dim, 16-byte aligned, whose sequences are each one run of rows; a block
    holds a chunk of each of up to 256 // chunks rows of one token, a token's rows spread
    evenly over its blocks (grid x), the tokens in grid rows of 65535 (y, the rows z). Per-
    token ids, MRoPE, a cos_sin_cache and the norm keep other layouts. The kernel it names is
    shipped in the two-level modules."""

    def geometry(batch=8, seq=4096, heads=32, head_dim=128, rotary_dim=128, dtype="bfloat16",
                 k_heads=0, neox=True, mode=_rotate.TWO_LEVEL, sequential=True, norm=False,
                 batch_stride=None, offset=0):  # fmt: skip
        width = (heads + k_heads) * head_dim
        strides = (batch_stride or seq * width, width, head_dim, 1)
        rows = [_rows(dtype, (batch, seq, heads, head_dim), strides, offset)] * 2
        if k_heads:
            rows += [_rows(dtype, (batch, seq, k_heads, head_dim), strides, heads * head_dim)] * 2
        aligned = _rotate._vector_width(dtype, neox, rotary_dim, head_dim, False, rows)
        return _rotate._shared_geometry(
            dtype, neox, rotary_dim, mode, sequential, norm, rows, aligned
        )  # fmt: skip

    assert geometry() == ((2, 32768, 1), (16, 16, 1))  # (bf16 neox: 4 pairs a thread)
    assert geometry(neox=False) == ((2, 32768, 1), (16, 16, 1))  # (8 elements a thread)
    assert geometry(dtype="float32") == ((2, 32768, 1), (16, 16, 1))
    assert geometry(dtype="float32", neox=False) == ((4, 32768, 1), (32, 8, 1))
    assert geometry(head_dim=64, rotary_dim=64) == ((1, 32768, 1), (8, 32, 1))
    assert geometry(heads=32, k_heads=8) == ((3, 32768, 1), (16, 14, 1))  # (40 rows: 14, 14, 12)
    assert geometry(heads=6, k_heads=2, head_dim=64, rotary_dim=64) == ((1, 32768, 1), (8, 8, 1))
    assert geometry(batch=1, seq=70000, heads=8) == ((1, 65535, 2), (16, 8, 1))
    assert geometry(batch=1, seq=1 << 14, heads=8) is not None  # (2**17 head rows)
    assert geometry(batch=1, seq=(1 << 14) - 1, heads=8) is None  # _SHARED_MIN_HEAD_ROWS
    assert geometry(batch=1, seq=1 << 15, heads=7) is None  # (a block's table for few rows)
    assert geometry(batch_stride=4096 * 32 * 128 + 128) is None  # (sequences apart)
    assert geometry(batch=1, batch_stride=1) is not None  # (one sequence: any batch stride)
    assert geometry(sequential=False) is None  # (per-token ids)
    assert geometry(mode=_rotate.MROPE) is None and geometry(mode=_rotate.COS_SIN_CACHE) is None
    assert geometry(norm=True) is None
    assert geometry(rotary_dim=64) is None and geometry(head_dim=96, rotary_dim=96) is None
    assert geometry(offset=1) is None  # (one element in: not 16-byte aligned)
    for dtype, rotary_dim, neox, mode in itertools.product(
        ("bfloat16", "float16", "float32"), _rotate.SHIPPED_ROTARY_DIMS, (True, False),
        _rotate.TABLE_MODES,
    ):  # fmt: skip
        shipped = _rotate.module_spec(dtype, rotary_dim, mode).name_expressions
        name = _rotate._shared_name(dtype, neox, rotary_dim)
        assert (name in shipped) == (mode == _rotate.TWO_LEVEL)


# (MEMORY_CLOCK_KHZ, MEMORY_BUS_BITS, MULTIPROCESSORS) as the driver reports them
H100_SXM, H200 = (2619000, 5120, 132), (3201000, 6016, 132)


@pytest.mark.parametrize(
    ("device", "shared"),
    [(H100_SXM, True), (H200, False), ((0, 5120, 132), False), (None, False)],
    ids=["H100", "H200", "no-memory-clock", "query-refused"],
)  # fmt: skip
def test_shared_layout_only_where_the_memory_asks_few_bytes_of_a_multiprocessor(
    monkeypatch, device, shared
):
    """The plan takes rope_rotate_shared only on a device whose DRAM bandwidth a
    multiprocessor is at most _SHARED_MAX_SM_BANDWIDTH (an H100's 25.4 GB/s: on an H200's
    36.5 it lost 5-6 points of the copy ceiling to the chunk layout), and not where the
    driver reports no memory clock or refuses the query; the chunk layout takes the launch
    elsewhere."""
    import cupy

    names = (_cuda.MEMORY_CLOCK_KHZ, _cuda.MEMORY_BUS_BITS, _cuda.MULTIPROCESSORS)
    attributes = dict(zip(names, device or (0, 0, 132), strict=True))

    def device_attribute(d, attribute):
        if device is None and attribute != _cuda.MULTIPROCESSORS:
            raise cupy.cuda.runtime.CUDARuntimeError(1)  # (cudaErrorInvalidValue)
        return attributes[attribute]

    monkeypatch.setattr(_cuda, "device_attribute", device_attribute)
    monkeypatch.setattr(_cuda, "cupy", lambda: cupy)  # (its errors, with no device here)
    monkeypatch.setattr(_cuda, "function", lambda spec, name, d: name)
    monkeypatch.setattr(_rotate, "_plans", {})
    width = 32 * 128
    rows = [_rows("bfloat16", (8, 4096, 32, 128), (4096 * width, width, 128, 1), 0)] * 2
    plan = _rotate._plan(128, _rotate.TWO_LEVEL, True, rows, False, None, _rotate.TWO_LEVEL, True)
    taken = plan.steps[0].kernel == _rotate._shared_name("bfloat16", True, 128)
    assert taken == shared, plan
    assert taken or plan.steps[0].kernel.startswith("rope_rotate<")


def test_mrope_takes_whole_rows_where_a_lane_takes_one_position_row():
    """rope_rotate_packs forms one position row a lane under MRoPE, so the plan gives it
    sectioned rows whose boundaries fall on lane boundaries (16 bytes: 4 pairs of 16-bit
    rows, 2 of float32) and interleaved rows whose pairs make whole groups of 4 of one row,
    one pair of each residue (Qwen3-VL's (24, 20, 20)); sections that split a lane's pairs,
    and interleaved ones that do not group, keep rope_rotate; calls without MRoPE are not
    affected."""

    def table(dtype, section, interleaved, rotary_dim=128):
        mode = _rotate.TWO_LEVEL if section is None else _rotate.MROPE
        return _rotate._packs_table(dtype, mode, rotary_dim, section, interleaved)

    mrope, grouped = _rotate.MROPE, _rotate.MROPE_GROUPED
    for dtype in ("bfloat16", "float16", "float32"):
        assert table(dtype, None, False) == _rotate.TWO_LEVEL
        assert table(dtype, (16, 24, 24), False) == table(dtype, (8, 12, 12), False) == mrope
        assert table(dtype, (17, 23, 24), False) is table(dtype, (9, 11, 12), False) is None
        assert table(dtype, (24, 20, 20), True) == grouped  # Qwen3-VL's
        assert table(dtype, (16, 8, 8), True, rotary_dim=64) == grouped
        # rows of 21 (j % 3 == 1: all of them), 26 or 10 pairs: no whole groups of 4
        assert table(dtype, (16, 24, 24), True) is table(dtype, (26, 18, 20), True) is None
        assert table(dtype, (12, 10, 10), True, rotary_dim=64) is None
    cache = _rotate._packs_table("bfloat16", _rotate.COS_SIN_CACHE, 128, None, False)
    assert cache == _rotate.COS_SIN_CACHE
    assert table("float32", (18, 22, 24), False) == mrope
    assert table("bfloat16", (18, 22, 24), False) is None
    assert table("float32", (16, 26, 22), False) == mrope
    assert table("float16", (16, 26, 22), False) is None


def test_grouped_pair_order_puts_each_lane_in_one_position_row():
    """The grouped tables' column order (rope.cu's GROUP_PAIRS): each pair once, column t
    pair order[t] with t % 4 == order[t] % 4, so every lane of 2 or 4 columns (16 bytes of
    float32 or of 16-bit rows) holds its own pairs' residues, all of one position row; the
    rows' pairs in increasing order, row 0's first."""
    for section, pairs in (((24, 20, 20), 64), ((16, 8, 8), 32)):
        order = np.array(_rotate.grouped_pair_order(section, pairs))
        rows = _rotate.mrope_rows(section, True, pairs)
        assert sorted(order) == list(range(pairs))
        assert (order % 4 == np.arange(pairs) % 4).all()
        for width in (2, 4):
            lanes = rows[order].reshape(-1, width)
            assert (lanes == lanes[:, :1]).all(), (section, width)
        groups = order.reshape(-1, 4)
        assert (np.diff(rows[groups[:, 0]]) >= 0).all()
        for row in range(3):
            in_row = np.sort(groups[rows[groups[:, 0]] == row], axis=1).ravel()
            assert (np.diff(in_row) > 0).all()
    assert _rotate.grouped_pair_order((12, 10, 10), 32) is None
    assert _rotate.grouped_pair_order((16, 24, 24), 64) is None


def test_grouped_tables_hold_the_natural_tables_bits():
    """A table in the grouped order holds the natural table's entries, bit for bit, at its
    columns (computed in the natural order, then moved): the grouped and the chunk layouts
    write the same bits."""
    order = _rotate.grouped_pair_order((24, 20, 20), 64)
    for scheme in (Standard(20013.0), YaRN(scale=8.0)):
        natural, grouped = shared_table(scheme, 128), shared_table(scheme, 128, order)
        assert grouped is not natural and grouped is shared_table(scheme, 128, order)
        for table in (natural, grouped):
            table.ensure(1 << 16)
        for name in ("fine64", "fine32", "coarse64", "coarse32"):
            expected = getattr(natural, name)[:, list(order)]
            np.testing.assert_array_equal(getattr(grouped, name), expected, err_msg=name)
        # on the device, the grouped fine table's row after the last a position indexes holds
        # each pair's column, a byte (the kernel's lanes read their pairs' sources there)
        assert natural.device_fine32.shape == (FINE_ROWS, 64, 2)
        device_fine = grouped.device_fine32
        assert device_fine.shape == (FINE_ROWS + 1, 64, 2)
        np.testing.assert_array_equal(device_fine[:FINE_ROWS], grouped.fine32)
        columns = device_fine[FINE_ROWS:].view(np.uint8).reshape(-1)
        assert [order[column] for column in columns[:64]] == list(range(64))
        assert not columns[64:].any()


def test_projection_shared_memory_is_the_kernels_own(monkeypatch):
    """What a launch of mhc_project asks for (_mhc._project_smem) and the scratch of phi's
    fragments (_mhc._fragment_bytes) are the kernel's own layout (mhc.cu project_smem_bytes,
    piece_words), for every compiled x dtype, n and pipeline: NVRTC evaluates the equalities
    appended to mhc.cu as static_asserts."""
    checks = []
    for dtype, n in itertools.product(_cuda.CUDA_TYPES, _mhc.CUDA_STREAMS):
        cuda_type = _cuda.CUDA_TYPES[dtype]
        checks.append(
            f"static_assert(piece_words<{n}>() * 4 == {_mhc._fragment_bytes(n, 64)}, "
            f'"{dtype} n={n}: fragments");'
        )
        for stage_k, stages in _mhc.project_pipelines(dtype, n):
            checks.append(
                f"static_assert(project_smem_bytes<{cuda_type}, {n}, {stage_k}, {stages}>() == "
                f"{_mhc._project_smem(dtype, n, (stage_k, stages))}, "
                f'"{dtype} n={n} ({stage_k}, {stages})");'
            )
    source = kernels_cu.source
    monkeypatch.setattr(
        kernels_cu,
        "source",
        lambda name: source(name) + ("\n".join(["", *checks]) if name == "mhc" else ""),
    )
    spec = _cuda.ModuleSpec("mhc", (), _mhc.pre_module("bfloat16", 4).defines)
    _cuda.nvrtc_compile(spec, "compute_90")  # (raises with NVRTC's log where one differs)


# --------------------------------------------------------------------------- argument structs


def test_param_structs_are_read_from_the_cuda_declarations():
    """Each kernel's argument struct is declared once, in C; the host reads its fields from
    that text and packs them with ``struct``'s native alignment. The packed size (padded to
    the struct's 8-byte alignment) must be the ``static_assert(sizeof(...))`` of the .cu
    file, which NVRTC checks against the C layout (test_compiles_without_a_device)."""
    import re

    _catalogue.shipped_modules()  # imports every primitive, each declaring its structs
    names = {s.c_name for s in _cuda.PARAM_STRUCTS}
    assert names >= {"RopeParams", "PreParams", "PostParams", "PreBwdParams", "PostBwdParams"}
    for declared in _cuda.PARAM_STRUCTS:
        assert declared.source is not None, declared.c_name
        text = kernels_cu.source(declared.source)
        pinned = re.search(r"static_assert\(sizeof\(" + declared.c_name + r"\) == (\d+)", text)
        assert pinned, f"{declared.source}.cu pins no size of {declared.c_name}"
        assert -(-declared.size // 8) * 8 == int(pinned[1]), declared.c_name
        assert declared.fields == _cuda.declared_fields(declared.source, declared.c_name)


def test_declared_fields_reads_every_form(monkeypatch):
    """The C forms the structs use, each to its struct code: pointers of any type (const,
    unsigned, typedef'd), long long and i64 (one name or a list), int, float, arrays;
    comments skipped. A type the host cannot pack is refused by name."""
    import kernels_cu

    text = """
    struct Probe {
      const void* a;          // [batch, n]; with a comment
      unsigned int* counter;
      const float2* table;
      long long strides[3];
      i64 b, c;  // two at once
      int d;
      float e;
    };
    struct Bad {
      double f;
    };
    """
    monkeypatch.setattr(kernels_cu, "source", lambda name: text)
    assert _cuda.declared_fields("probe", "Probe") == (
        ("a", "P"), ("counter", "P"), ("table", "P"), ("strides", "3q"), ("b", "q"),
        ("c", "q"), ("d", "i"), ("e", "f"),
    )  # fmt: skip
    with pytest.raises(ValueError, match="double"):
        _cuda.declared_fields("probe", "Bad")
    with pytest.raises(LookupError, match="Missing"):
        _cuda.declared_fields("probe", "Missing")


# --------------------------------------------------------------------------- the loader's cache


def _smallest_module() -> _cuda.ModuleSpec:
    return min(CATALOGUE, key=lambda spec: (len(spec.code), len(spec.name_expressions)))


def test_compile_options_keep_subnormals_and_ieee_float32():
    """The loader's own NVRTC call: no fast math, no flush to zero (CuPy's RawModule would
    add -ftz=true after any option of ours; the last one wins)."""
    assert "-ftz=false" in _cuda.COMPILE_OPTIONS
    assert not any("fast" in option or "ftz=true" in option for option in _cuda.COMPILE_OPTIONS)


def test_cubin_comes_back_whole():
    """CuPy's getCUBIN drops the image's last byte; ``_whole`` restores the ELF's length (the
    end of its last header table) and leaves a whole image unchanged."""
    _, cubin, _ = _cuda.nvrtc_compile(_smallest_module(), "sm_90")
    assert cubin[:4] == b"\x7fELF"
    assert _cuda._whole(cubin) == cubin
    assert _cuda._whole(cubin[:-1]) == cubin


def test_programmatic_launch_structs_have_the_driver_layout():
    """cuLaunchKernelEx's CUlaunchConfig and CUlaunchAttribute (cuda.h) as ctypes lays them
    out on a 64-bit host: the driver reads these bytes as they are."""
    import ctypes

    config, attribute = _cuda._LaunchConfig, _cuda._LaunchAttribute
    assert ctypes.sizeof(attribute) == 72 and attribute.value.offset == 8
    assert ctypes.sizeof(config) == 56
    assert (config.stream.offset, config.attrs.offset, config.num_attrs.offset) == (32, 40, 48)


def test_a_cooperative_step_is_neither_programmatic_nor_clustered():
    """cuLaunchKernelEx here carries the programmatic and cluster attributes alone: a
    cooperative step asking for either would silently lose its cooperative launch (and its
    co-residency check). A clustered grid is whole clusters."""
    for extra in ({"programmatic": True}, {"cluster": 2}):
        with pytest.raises(ValueError, match="cooperative launch step is neither"):
            _cuda.Step(None, (2, 1, 1), (1, 1, 1), cooperative=True, **extra)
    with pytest.raises(ValueError, match="not a whole number of clusters of 4"):
        _cuda.Step(None, (6, 1, 1), (1, 1, 1), cluster=4)


def test_launch_config_carries_the_asked_attributes():
    """A clustered step's config names the cluster's x dimension (CU_LAUNCH_ATTRIBUTE_
    CLUSTER_DIMENSION, 4), a programmatic one the stream serialization (6), in that order."""
    step = _cuda.Step(None, (32, 1, 1), (256, 1, 1), 4096, programmatic=True, cluster=16)
    config = _cuda.launch_config(step)
    assert (config.gx, config.bx, config.shared_mem, config.num_attrs) == (32, 256, 4096, 2)
    assert [config.attrs[i].id for i in range(2)] == [6, 4]
    assert list(config.attrs[0].value[:1]) == [1]
    assert list(config.attrs[1].value[:3]) == [16, 1, 1]
    assert _cuda.launch_config(_cuda.Step(None, (4, 1, 1), (256, 1, 1), cluster=4)).num_attrs == 1


def test_device_arch_falls_back_to_ptx_of_the_newest_known():
    from cupy_backends.cuda.libs import nvrtc

    known = nvrtc.getSupportedArchs()
    assert _cuda.device_arch("90") == "sm_90"
    assert _cuda.device_arch(str(max(known) + 1)) == f"compute_{max(known)}"


def test_image_cache_compiles_once_and_survives_a_bad_file(tmp_path, monkeypatch):
    """The first load compiles and stores; a second reads the file and compiles nothing; a
    truncated file costs a compile, never an error."""
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    spec = _smallest_module()
    compiles = []
    real = _cuda.nvrtc_compile

    def counting(*args, **kwargs):
        compiles.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(_cuda, "nvrtc_compile", counting)
    lowered, image = _cuda.cached_image(spec, "sm_90")
    assert set(lowered) == set(spec.name_expressions) and image[:4] == b"\x7fELF"
    (stored,) = (tmp_path / "tileops_cupy").iterdir()
    assert _cuda.cached_image(spec, "sm_90") == (lowered, image) and len(compiles) == 1
    stored.write_bytes(stored.read_bytes()[:10])
    assert _cuda.cached_image(spec, "sm_90") == (lowered, image) and len(compiles) == 2
    assert _cuda.cached_image(spec, "sm_80")[1] != image and len(compiles) == 3


def test_prewarmed_modules_are_found_in_the_cache(tmp_path, monkeypatch):
    """The prewarm (tools/prewarm.py, the conftest): a module compiled in another process is
    then loaded from the disk cache without a compile, and a second prewarm builds nothing."""
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    spec = _smallest_module()
    monkeypatch.setattr(_catalogue, "shipped_modules", lambda: [spec])
    assert _catalogue.prewarm("sm_80", 1) == (1, "sm_80")
    assert len(list((tmp_path / "tileops_cupy").iterdir())) == 1

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(_cuda, "nvrtc_compile", no_compile)
    lowered, image = _cuda.cached_image(spec, "sm_80")
    assert set(lowered) == set(spec.name_expressions) and image[:4] == b"\x7fELF"
    # with every file there, a second prewarm starts no process
    monkeypatch.setattr(multiprocessing, "get_context", no_compile)
    assert _catalogue.prewarm("sm_80", 1) == (1, "sm_80")


def test_norm_launch_shared_memory_is_bounded():
    """The fused norm stages 2 * head_dim float32 weights per block: head_dims past what a
    launch may take without opting in are refused before any launch, naming head_dim."""
    assert _rotate.norm_shared_bytes(128) == 1024
    assert _rotate.norm_shared_bytes(6144) == 48 * 1024
    with pytest.raises(ValueError, match="head_dim <= 6144.*got head_dim=6152"):
        _rotate.norm_shared_bytes(6152)


@pytest.mark.parametrize("norm", (False, True))
@pytest.mark.parametrize("mode", (_rotate.TWO_LEVEL, _rotate.MROPE))
def test_two_level_tables_load_under_l2_evict_last(mode, norm):
    """Every RoPE kernel reads the two-level tables through load_kept_in_l2 (common.cuh): an
    L2 evict-last policy, so the rows streamed through L2 do not push the tables out between
    the tokens that re-read them (H100, kernel_ab: bf16 B8 S4096 97.7 -> 99.0% of the copy
    ceiling). A bf16 kernel's float32 vector loads are table loads, so none goes without it."""
    for name, body in _ptx_kernels(_rotate.module_spec("bfloat16", 128, mode, norm=norm)).items():
        assert "createpolicy.fractional.L2::evict_last" in body, name
        hinted = re.findall(r"ld\.global\.L2::cache_hint\.v[24]\.f32", body)
        plain = re.findall(r"ld\.global\.v[24]\.f32", body)
        assert hinted and not plain, f"{name}: {len(plain)} table loads without the policy"
