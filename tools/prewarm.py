"""Compile every shipped kernel module into the disk cache (``$CUPY_CACHE_DIR/tileops_cupy``)
in parallel processes, before the GPU tests or an A/B on a fresh machine.

    python tools/prewarm.py                 # for GPU 0, a process a CPU
    python tools/prewarm.py --arch sm_90 -j 8

A test run compiles each module at the first launch of one of its kernels, one after
another: on a fresh H100 machine (16 CPUs) the GPU tests of mHC pre backward spent over 240
s compiling, where this builds the whole catalogue in about 50 s and the tests then took 44
s. The cache is the package's own, keyed by NVRTC version, architecture and source, so any
later process finds the modules built. With ``--arch`` no GPU is needed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tileops_cupy import _catalogue  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", help="NVRTC's architecture, e.g. sm_90 (default: GPU 0's)")
    parser.add_argument("-j", "--jobs", type=int, help="processes (default: one a CPU)")
    arguments = parser.parse_args()
    modules, arch = _catalogue.prewarm(arguments.arch, arguments.jobs)
    print(f"{modules} modules in the cache for {arch}")


if __name__ == "__main__":
    main()
