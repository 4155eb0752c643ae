"""Shared test fixtures: the `gpu` marker skips cleanly on machines without a CUDA device."""

import zlib

import numpy as np
import pytest

from tileops_cupy._arrays import cuda_available

HAS_CUDA = cuda_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (CuPy with a driver and a GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test id so failures reproduce."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)
