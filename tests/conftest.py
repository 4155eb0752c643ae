"""Shared test fixtures: the `gpu` marker skips cleanly on machines without a CUDA device."""

import zlib

import numpy as np
import pytest

from tileops_cupy._arrays import cuda_available

HAS_CUDA = cuda_available()


# A run of this many GPU tests launches kernels from most of the catalogue. Compiled at their
# first launches, one after another, they cost minutes on a fresh machine (the mHC backward
# file alone spent over 240 s on an H100 host's 16 CPUs): the whole catalogue is compiled
# first, in parallel processes (tools/prewarm.py; about 50 s there, and under a second, with
# no process started, where the cache already holds it).
PREWARM_FROM_GPU_TESTS = 100


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (CuPy with a driver and a GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    gpu_tests = sum("gpu" in item.keywords for item in session.items)
    if not HAS_CUDA or gpu_tests < PREWARM_FROM_GPU_TESTS:
        return
    from tileops_cupy import _catalogue

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    try:
        modules, arch = _catalogue.prewarm()
    except Exception as error:  # the tests then compile at their launches (and report it)
        if reporter is not None:
            reporter.write_line(f"kernel cache not prewarmed: {error!r}")
        return
    if reporter is not None:
        reporter.write_line(f"kernel cache: {modules} modules built or found for {arch}")


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test id so failures reproduce."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)
