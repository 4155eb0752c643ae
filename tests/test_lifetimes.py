"""How long the package's objects live, and what they carry with them.

- Every op and the Q/K component survive ``copy.copy``, ``copy.deepcopy`` and pickling (a
  model cloned for EMA or a reference policy, ``torch.save``, worker processes): the copy
  has the original's arguments, computes the same bits and records launches of its own.
- Ops built alike share one configuration, device error flag included: a function that
  ``torch.compile`` traced for one layer serves every layer built alike, without a
  recompile per layer; the flag's key is the same in every process.
- Objects made per call (``apply_rope(q, k, RoPE(...))`` in a forward, an mHC op rebuilt
  every step from learned alphas) leave nothing behind: behind the dispatcher they run on
  their configuration's twin, of which a bounded number are kept.
- An op called with a new layout every call (varying batch and sequence lengths) keeps a
  bounded number of recorded launches.
- A process forked while another thread holds one of the package's locks gets them
  unlocked."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import os
import pickle
import sys
import textwrap
import threading
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _cases import PLACES, assert_runs_in_own_process, to_place
from _oracle import to_host

from tileops_cupy import _cache, _rotate, _tables, rope, sequence_modeling
from tileops_cupy._cache import TWINS, LaunchRecords
from tileops_cupy.rope import (
    Llama31,
    LongRoPEBwdOp,
    RoPE,
    RoPEBwdOp,
    RoPEFwdOp,
    RoPENeoxPositionIdsFwdOp,
    YaRN,
    YaRNFwdOp,
    apply_rope,
)
from tileops_cupy.sequence_modeling import MHCPostBwdOp, MHCPostFwdOp, MHCPreBwdOp, MHCPreFwdOp

HEAD_DIM, HEADS, KV_HEADS, TOKENS = 64, 4, 2, 6
N, C_X, BATCH = 4, 32, 3
Q = N * N + 2 * N

COPIES: dict[str, Callable[[Any], Any]] = {
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
    "pickle": lambda op: pickle.loads(pickle.dumps(op)),
}


def _rows(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _component_prefill(component: RoPE, place: str, rng) -> tuple:
    q, k = _rows(rng, 2, TOKENS, HEADS * HEAD_DIM), _rows(rng, 2, TOKENS, KV_HEADS * HEAD_DIM)
    q, k = to_place(q, place), to_place(k, place)
    component.prefill(q, k, 3)
    return q, k


def _component_positions(component: RoPE, place: str, rng, norm: bool = False) -> tuple:
    shape = (3, TOKENS) if component.mrope_section else (TOKENS,)
    positions = to_place(rng.integers(0, 100, shape), place)
    q, k = _rows(rng, TOKENS, HEADS * HEAD_DIM), _rows(rng, TOKENS, KV_HEADS * HEAD_DIM)
    q, k = to_place(q, place), to_place(k, place)
    weight = to_place(_rows(rng, HEAD_DIM), place) if norm else None
    component.forward(q, k, positions=positions, q_norm_weight=weight, k_norm_weight=weight)
    return q, k


def _pre_inputs(rng, place):
    phi = _rows(rng, N * C_X, Q) / 16
    return tuple(to_place(a, place) for a in (phi, _rows(rng, BATCH, N * C_X), _rows(rng, Q)))


# name -> (make the op, run it on fresh data of a place: what it returns or wrote)
CASES: dict[str, tuple[Callable[[], Any], Callable[[Any, str, Any], tuple]]] = {
    "RoPEFwdOp": (
        lambda: RoPEFwdOp(rope_layout="interleaved", input_layout="2d", rotary_dim=32),
        lambda op, place, rng: (op(to_place(_rows(rng, 2, TOKENS, HEADS, HEAD_DIM), place)),),
    ),
    "RoPEBwdOp": (
        lambda: RoPEBwdOp(base=500.0),
        lambda op, place, rng: (op(to_place(_rows(rng, TOKENS, HEAD_DIM), place)),),
    ),
    "YaRNFwdOp": (
        lambda: YaRNFwdOp(scale=4.0),
        lambda op, place, rng: (op(to_place(_rows(rng, TOKENS, HEAD_DIM), place)),),
    ),
    "LongRoPEBwdOp": (
        lambda: LongRoPEBwdOp(rescale_factors=np.linspace(1, 4, HEAD_DIM // 2)),
        lambda op, place, rng: (op(to_place(_rows(rng, TOKENS, HEAD_DIM), place)),),
    ),
    "RoPENeoxPositionIdsFwdOp": (
        lambda: RoPENeoxPositionIdsFwdOp(max_position=100, rotary_dim=16),
        lambda op, place, rng: (
            op(
                to_place(_rows(rng, TOKENS, HEADS, HEAD_DIM), place),
                to_place(rng.integers(0, 100, TOKENS), place),
            ),
        ),
    ),
    "RoPE": (
        lambda: RoPE(HEAD_DIM, HEADS, KV_HEADS, scheme=Llama31(), max_position=100),
        _component_prefill,
    ),
    "RoPE-mrope": (
        lambda: RoPE(HEAD_DIM, HEADS, KV_HEADS, scheme=YaRN(), mrope_section=(8, 12, 12)),
        _component_positions,
    ),
    "RoPE-qk-norm": (
        lambda: RoPE(HEAD_DIM, HEADS, KV_HEADS, rope_layout="interleaved", norm_eps=1e-5),
        lambda op, place, rng: _component_positions(op, place, rng, norm=True),
    ),
    "MHCPreFwdOp": (
        lambda: MHCPreFwdOp(0.8, 1.2, 1.0, 20, 0.01),
        lambda op, place, rng: op(*_pre_inputs(rng, place)),
    ),
    "MHCPreBwdOp": (
        lambda: MHCPreBwdOp(0.8, 1.2, 1.0, 5),
        lambda op, place, rng: op(
            *_pre_inputs(rng, place),
            *(to_place(_rows(rng, *shape), place) for shape in ((BATCH, N * C_X), (BATCH, C_X))),
            to_place(_rows(rng, BATCH, N), place),
        ),
    ),
    "MHCPostFwdOp": (
        lambda: MHCPostFwdOp(),
        lambda op, place, rng: (
            op(*(to_place(_rows(rng, BATCH, w), place) for w in (C_X, N, N * C_X))),
        ),
    ),
    "MHCPostBwdOp": (
        lambda: MHCPostBwdOp(),
        lambda op, place, rng: op(
            *(to_place(_rows(rng, BATCH, w), place) for w in (C_X, N, N * C_X, N * C_X))
        ),
    ),
}


def _assert_same_bits(got: tuple, want: tuple, what: str) -> None:
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(to_host(g), to_host(w), equal_nan=True), what


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("name", list(CASES))
def test_a_copy_computes_what_the_original_does(name, how, place):
    make, run = CASES[name]
    op = make()
    run(op, place, np.random.default_rng(0))  # records its launch on the GPU
    twin = COPIES[how](op)
    assert type(twin) is type(op) and twin is not op
    assert repr(twin) == repr(op)
    assert twin._relaunches == {}, "a copy records its own launches"
    if hasattr(op, "_flag"):  # (RoPE ops: device errors of device positions)
        assert twin._flag is op._flag and twin.config == op.config, "built alike"
    for seed in (1, 2):  # the twin's first call plans its own launch; the second replays it
        _assert_same_bits(
            run(twin, place, np.random.default_rng(seed)),
            run(op, place, np.random.default_rng(seed)),
            f"{name} after {how}",
        )


def test_a_copy_keeps_what_a_subclass_adds():
    class Layer(RoPE):
        def __init__(self, *args, scale: float, **keywords):
            super().__init__(*args, **keywords)
            self.scale = scale

    layer = Layer(HEAD_DIM, HEADS, scale=0.5)
    twin = copy.deepcopy(layer)
    assert type(twin) is Layer and twin.scale == 0.5 and twin.table is layer.table


_UNPICKLE_ELSEWHERE = textwrap.dedent(
    """
    import pickle, sys
    import numpy as np
    rope, q, k, want_q, want_k = pickle.loads(open(sys.argv[1], "rb").read())
    rope.prefill(q, k, 7)
    assert np.array_equal(q, want_q) and np.array_equal(k, want_k)
    print("rotated like the original")
    """
)


def test_a_pickled_component_runs_in_another_process(tmp_path):
    rng = np.random.default_rng(3)
    rope = RoPE(HEAD_DIM, HEADS, KV_HEADS, scheme=Llama31(), max_position=1000)
    q, k = _rows(rng, 1, TOKENS, HEADS * HEAD_DIM), _rows(rng, 1, TOKENS, KV_HEADS * HEAD_DIM)
    want_q, want_k = rope.prefill(q.copy(), k.copy(), 7)
    path = tmp_path / "rope.pickle"
    path.write_bytes(pickle.dumps((rope, q, k, want_q, want_k)))
    assert_runs_in_own_process(_UNPICKLE_ELSEWHERE, str(path))


# --------------------------------------------------------------------------- objects made per call


def test_layers_built_alike_compile_once():
    torch = pytest.importorskip("torch")
    from torch._dynamo.testing import CompileCounter

    class Layer(torch.nn.Module):
        def __init__(self, **rope_arguments):
            super().__init__()
            self.project = torch.nn.Linear(HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM)
            self.rope = RoPE(HEAD_DIM, HEADS, KV_HEADS, max_position=64, **rope_arguments)
            self.seed = RoPEBwdOp(input_layout="2d", rotary_dim=32)

        def forward(self, x):
            qk = self.project(x)
            q, k = apply_rope(qk[..., : HEADS * HEAD_DIM], qk[..., HEADS * HEAD_DIM :], self.rope)
            return q.sum() + k.sum() + self.seed(q.unflatten(-1, (HEADS, HEAD_DIM))).sum()

    counter = CompileCounter()
    run = torch.compile(lambda layer, x: layer(x), backend=counter, fullgraph=True)
    x = torch.randn(2, TOKENS, HEAD_DIM)
    layers = [Layer() for _ in range(10)]  # past Dynamo's recompile limit (8)
    for layer in layers:
        torch.testing.assert_close(run(layer, x), layer(x))
    assert counter.frame_count == 1, "one graph for every layer built alike"
    assert len({layer.rope._flag for layer in layers}) == 1
    run(Layer(scheme=YaRN()), x)  # built otherwise: a configuration (and a flag) of its own
    assert counter.frame_count == 2


_FLAG_KEY_ELSEWHERE = textwrap.dedent(
    """
    import sys
    from tileops_cupy.rope import RoPE, RoPENeoxPositionIdsFwdOp
    print(RoPE(64, 4, 2).config[9], RoPENeoxPositionIdsFwdOp(max_position=8).config[-1])
    """
)


def test_flag_keys_are_the_same_in_every_process():
    keys = (RoPE(64, 4, 2).config[9], RoPENeoxPositionIdsFwdOp(max_position=8).config[-1])
    assert keys[0] != keys[1] and RoPE(64, 4, 1).config[9] != keys[0]
    for seed in ("0", "1"):  # str hashes differ between these processes; the keys do not
        printed = assert_runs_in_own_process(_FLAG_KEY_ELSEWHERE, env={"PYTHONHASHSEED": seed})
        assert tuple(map(int, printed.split())) == keys


def test_objects_made_per_call_leave_nothing_behind():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    x = torch.tensor(_rows(rng, TOKENS, HEADS * HEAD_DIM), dtype=torch.float64, requires_grad=True)
    phi, b = (torch.tensor(a) for a in _pre_inputs(rng, "cpu")[::2])
    mhc_x = torch.tensor(_rows(rng, BATCH, N * C_X), requires_grad=True)

    def step(i: int) -> None:
        ids = torch.arange(TOKENS) % 8
        RoPENeoxPositionIdsFwdOp(max_position=8)(
            x.view(TOKENS, HEADS, HEAD_DIM), ids
        ).sum().backward()
        q, _ = apply_rope(x, None, RoPE(HEAD_DIM, HEADS), positions=ids)
        q.sum().backward()
        alpha = 1.0 + i / 1000  # learned by the caller: a new op every step
        sum(o.sum() for o in MHCPreFwdOp(alpha, alpha, alpha, 3)(phi, mhc_x, b)).backward()

    twin_caches = (rope._seed_op, rope._component, sequence_modeling._rebuilt)
    for cache in twin_caches:
        cache.cache_clear()
    gc.collect()
    flags = len(_rotate._flags)
    for i in range(3 * TWINS):
        step(i)
    gc.collect()
    # what stays: one twin and one flag per configuration, whatever the number of steps
    seed_twins, component_twins, mhc_twins = (c.cache_info().currsize for c in twin_caches)
    assert seed_twins == 2  # (the op's forward, and its backward)
    assert component_twins == 1
    assert mhc_twins <= TWINS  # (a new alpha every step: the newest kept)
    assert len(_rotate._flags) <= flags + 3


class _FakeRuntime:
    """The two CuPy calls a flag cell needs, on host memory: hostAlloc counted per device."""

    hostAllocMapped, hostAllocPortable = 2, 1

    def __init__(self) -> None:
        self.pages: list[Any] = []  # (kept alive: cells point into them)
        self.device = None
        self.allocations: dict[int, int] = {}

    def hostAlloc(self, nbytes: int, flags: int) -> int:  # noqa: N802 (CuPy's name)
        assert flags == self.hostAllocMapped | self.hostAllocPortable
        page = (ctypes.c_byte * nbytes)(*([7] * nbytes))  # garbage, as fresh memory may hold
        self.pages.append(page)
        self.allocations[self.device] = self.allocations.get(self.device, 0) + 1
        return ctypes.addressof(page)


def test_flag_cells_of_objects_made_per_call_share_mapped_pages(monkeypatch):
    runtime = _FakeRuntime()

    @contextlib.contextmanager
    def device(index):
        runtime.device = index
        yield

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, Device=device))
    monkeypatch.setattr(_rotate, "cupy", lambda: fake_cupy)
    monkeypatch.setattr(_rotate, "_free_cells", {})
    flags = [_rotate.ErrorFlag() for _ in range(2 * _rotate._CELLS_A_PAGE + 1)]
    pointers = {device: [flag.pointer(device) for flag in flags] for device in (0, 1)}
    assert runtime.allocations == {0: 3, 1: 3}, "one mapped page per 1024 cells and device"
    every = pointers[0] + pointers[1]
    assert len(set(every)) == len(every), "no cell handed out twice"
    assert all(ctypes.c_int32.from_address(p).value == 0 for p in every), "cells start at 0"
    assert not any(flag.take() for flag in flags)
    ctypes.c_int32.from_address(pointers[1][5]).value = 1  # a kernel on device 1 meets an error
    assert [flag.take() for flag in flags].count(True) == 1 and not flags[5].take()


def test_launch_records_forget_the_oldest_layout():
    records = LaunchRecords()
    for layout in range(LaunchRecords.KEPT + 40):
        records[layout] = f"launch {layout}"
    assert len(records) == LaunchRecords.KEPT
    assert (
        min(records) == 40
        and records[LaunchRecords.KEPT + 39] == f"launch {LaunchRecords.KEPT + 39}"
    )
    records[100] = "again"  # a layout it holds: nothing forgotten
    assert len(records) == LaunchRecords.KEPT and min(records) == 40
    for name, (make, _) in CASES.items():
        assert type(make()._relaunches) is LaunchRecords, name


def test_launch_records_keep_their_bound_under_threads():
    """Threads recording launches of one op at once: each new record forgets the oldest
    under one lock, so no two forget the same one and both add theirs (which had left the
    bound behind for good: 270-760 records after 320k inserts from 16 threads)."""
    records = LaunchRecords()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (a thread switch between almost any two bytecodes)
    try:

        def insert(thread: int) -> None:
            for layout in range(5000):
                records[(thread, layout)] = layout

        threads = [threading.Thread(target=insert, args=(t,)) for t in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert len(records) == LaunchRecords.KEPT


@pytest.mark.gpu
def test_gpu_ops_keep_a_bounded_number_of_launches():
    """A trainer or server whose shapes change call after call: every layout right (the
    host path's float32 result, to the contract's float32 bound at these magnitudes), at
    most KEPT launches remembered per op."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    rope_op, post = RoPEFwdOp(), MHCPostFwdOp()
    for tokens in range(1, LaunchRecords.KEPT + 30):
        x = _rows(rng, tokens, HEAD_DIM)
        got = rope_op(torch.from_numpy(x).cuda())
        np.testing.assert_allclose(got.cpu().numpy(), rope_op(x), rtol=0, atol=1e-5)
        layer, gates, res = (_rows(rng, tokens, w) for w in (C_X, N, N * C_X))
        got = post(*(torch.from_numpy(a).cuda() for a in (layer, gates, res)))
        np.testing.assert_allclose(got.cpu().numpy(), post(layer, gates, res), rtol=0, atol=1e-5)
    assert len(rope_op._relaunches) == len(post._relaunches) == LaunchRecords.KEPT


@pytest.mark.gpu
def test_gpu_mhc_keeps_a_bounded_number_of_stream_workspaces():
    """mHC pre's one-launch plan for small batches (mhc_pre_small, taken where c_x is not a
    multiple of 8) keeps a zeroed workspace per stream; a server that makes streams as it
    goes holds exactly KEPT of them once it used more, and every call on a new stream
    matches the float64 oracle."""
    cupy = pytest.importorskip("cupy")
    from _mhc_oracle import assert_pre_matches, case_alphas, random_pre_case

    from tileops_cupy import _mhc

    rng = np.random.default_rng(6)
    streams = []  # (kept alive, so that no stream's handle is reused)
    for _ in range(LaunchRecords.KEPT + 20):
        case = random_pre_case(rng, N, 36, BATCH, "float32", repeat=4)
        op = MHCPreFwdOp(*case_alphas(case), case.repeat, case.eps)
        streams.append(cupy.cuda.Stream(non_blocking=True))
        with streams[-1]:
            outputs = op(*(cupy.asarray(a) for a in (case.phi, case.x, case.b)))
            outputs = [cupy.asnumpy(o, stream=streams[-1]) for o in outputs]
        streams[-1].synchronize()
        assert_pre_matches(case, outputs)
    assert len(_mhc._workspaces) == LaunchRecords.KEPT


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (fork in a threaded process)
def test_a_forked_child_is_not_held_by_locks_taken_at_the_fork():
    """A fork copies a lock as it is: held by another thread of the parent (a table
    growing, a table or module being built, a launch being recorded), it would stay held in
    the child, and the child's first call that needs it would wait forever. The parent
    holds them here across the fork; the child grows a table, builds another, records a
    launch and rotates, each within the alarm's 20 s."""
    table = _tables.shared_table(rope.Standard(), 6)
    held = (table._lock, _tables._registry_lock, _cache._records_lock)
    with contextlib.ExitStack() as stack:
        for lock in held:
            stack.enter_context(lock)
        pid = os.fork()
        if pid == 0:  # the child: a failure or a hang is its exit status
            status = 1
            try:
                import signal

                signal.alarm(20)
                table.ensure(1 << 20)
                _tables.shared_table(rope.Standard(), 10)
                LaunchRecords()["layout"] = "launch"
                q = np.ones((1, 3, 16), np.float32)
                RoPE(16, 1).prefill(q, None, 1 << 19)
                status = 0
            finally:
                os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
