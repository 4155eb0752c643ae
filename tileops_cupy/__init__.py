"""tileops-cupy: rotary position embeddings and manifold-constrained hyper-connections as
runtime-compiled CUDA kernels (CuPy/NVRTC), with a numpy path for machines without a GPU.

Submodules: :mod:`tileops_cupy.rope` (the RoPE ops and the in-place Q/K component),
:mod:`tileops_cupy.sequence_modeling` (mHC pre/post), :mod:`tileops_cupy.schemes`
(frequency schemes). Importing needs only numpy and ml_dtypes; CuPy is imported when a
CUDA array first arrives.
"""

import sys
from importlib import import_module

from ._arrays import BUILTIN, cuda_available

__version__ = "0.1.0"
__all__ = ["BUILTIN", "cuda_available", "rope", "schemes", "sequence_modeling", "__version__"]

# torch imported first: its custom ops registered now (10 ms), so that torch.export.load of a
# saved program finds them in any process that imports the package
if sys.modules.get("torch") is not None:
    import_module(f"{__name__}._torch_ops")


def __getattr__(name: str):
    if name in ("rope", "schemes", "sequence_modeling"):
        return import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
