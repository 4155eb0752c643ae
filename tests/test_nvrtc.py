"""Every kernel instantiation the package ships compiles with NVRTC for sm_80 and sm_90,
with no GPU or driver present (this runs in CI), and every launch picks one of them.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from tileops_cupy import _cuda, _rotate
from tileops_cupy._arrays import ITEMSIZE, Operand
from tileops_cupy._catalogue import shipped_modules

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC comes with CuPy")

ARCHS = ("sm_80", "sm_90")
ROTATE_DTYPES = ("float16", "bfloat16", "float32")


CATALOGUE = shipped_modules()


def _spec_id(spec: _cuda.ModuleSpec) -> str:
    return f"{spec.source}:{spec.name_expressions[0]}"


def test_shipped_modules_are_distinct():
    assert CATALOGUE and len(CATALOGUE) == len(set(CATALOGUE))
    assert {spec.source for spec in CATALOGUE} == {"rope", "mhc", "mhc_backward"}


def test_catalogue_holds_every_rotate_module():
    for dtype in ROTATE_DTYPES:
        for rotary_dim in (*_rotate.SHIPPED_ROTARY_DIMS, 0):
            assert _rotate.module_spec(dtype, rotary_dim) in CATALOGUE, (dtype, rotary_dim)


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


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", CATALOGUE, ids=_spec_id)
def test_compiles_without_a_device(compiled, spec, arch):
    lowered = compiled[(spec, arch)]
    if isinstance(lowered, BaseException):
        raise lowered
    assert set(lowered) == set(spec.name_expressions)
    for name, mangled in lowered.items():
        assert isinstance(mangled, str) and mangled.startswith("_Z"), (name, mangled)
    # distinct instantiations must not collapse into one symbol
    assert len(set(lowered.values())) == len(lowered)


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
    """For every (dtype, layout, rotary_dim, head_dim, alignment, fused norm or not) a launch
    can meet, the vector width and the (module, name expression) it selects are in the
    catalogue."""
    widths_seen = set()
    for head_dim in range(2, 258, 2):
        for rotary_dim in sorted({2, 16, 32, 64, 128, head_dim // 2 * 2, head_dim}):
            if not 2 <= rotary_dim <= head_dim or rotary_dim % 2:
                continue
            for offset in (0, 1, 2, 8):
                shape = (2, 3, 4, head_dim)
                source = _rows(dtype, shape, (3 * 4 * head_dim, 4 * head_dim, head_dim, 1), offset)
                output = _rows(dtype, shape, (3 * 4 * head_dim, 4 * head_dim, head_dim, 1))
                copy_tail = rotary_dim < head_dim
                vec = _rotate._vector_width(
                    dtype, neox, rotary_dim, head_dim, copy_tail, [source, output]
                )
                widths_seen.add(vec)
                spec, name = _rotate._kernel(dtype, neox, vec, rotary_dim, norm)
                assert spec in CATALOGUE, (dtype, neox, rotary_dim, vec)
                assert name in spec.name_expressions, (name, spec.name_expressions)
    wide = 16 // ITEMSIZE[dtype]
    assert widths_seen == {wide, 1}, widths_seen


# --------------------------------------------------------------------------- argument structs

_C_TYPES = {"long long": "q", "i64": "q", "int": "i", "float": "f"}


def _declared_fields(c_name: str) -> list[tuple[str, str]]:
    """(name, struct code) of every field of ``struct c_name`` in the kernels' sources."""
    import re

    import kernels_cu

    for source in sorted(Path(kernels_cu.__file__).parent.glob("*.cu")):
        text = source.read_text()
        found = re.search(r"struct\s+" + c_name + r"\s*\{(.*?)\};", text, re.S)
        if found is None:
            continue
        body = re.sub(r"//[^\n]*", "", found.group(1))
        fields = []
        for declaration in filter(None, (d.strip() for d in body.split(";"))):
            pointer = "*" in declaration
            words = declaration.replace("*", " ").replace(",", " , ").split()
            kind = next((code for c, code in _C_TYPES.items() if c in " ".join(words[:2])), None)
            type_words = 2 if words[:2] == ["long", "long"] else 1
            if words[0] in ("const", "unsigned"):
                type_words += 1
            names = " ".join(words[type_words:]).split(",")
            for name in (n.strip() for n in names):
                length = re.fullmatch(r"(\w+)\[(\d+)\]", name)
                if length:
                    fields.append((length.group(1), length.group(2) + kind))
                else:
                    fields.append((name, "P" if pointer else kind))
        return fields
    raise AssertionError(f"struct {c_name} is not declared in any kernels_cu/*.cu")


def test_param_structs_match_the_cuda_declarations():
    """Each kernel's argument struct is declared once in Python by field name and type; the
    C declaration must list the same fields in the same order with the same types."""
    shipped_modules()  # imports every primitive, each declaring its structs
    assert {s.c_name for s in _cuda.PARAM_STRUCTS} >= {"RopeParams", "PreParams", "PostParams"}
    for declared in _cuda.PARAM_STRUCTS:
        assert list(declared.fields) == _declared_fields(declared.c_name), declared.c_name
