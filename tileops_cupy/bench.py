"""Benchmark: ``python -m tileops_cupy.bench [--json] [--only GROUP]... [--no-compile]``.

The method and the columns: ``_bench_harness``. Rows: ``_bench_rope`` (the seed ops),
``_bench_component`` (the in-place Q/K component), ``_bench_mhc`` (mHC pre/post and their
backward), ``_bench_dispatch`` (host cost per call as a ratio to a torch launch),
``_bench_peers`` (TileOPs, Liger and FlashInfer beside us, when they import), ``_bench_host``
(the NumPy path beside torch on the CPU; the only group that needs no GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from ._bench_harness import HEADER, copy_ceiling_gbs, format_row, torch_module
from ._bench_rope import cold_start, rope_rows

_GROUPS = ("rope", "component", "mhc", "dispatch", "peers", "host")


def _run(args: argparse.Namespace) -> tuple[float | None, list[dict], dict]:
    """Measure the rows ``args`` asks for, printing the table as they come."""
    torch = torch_module()
    only = set(args.only or _GROUPS)
    ceiling = None  # the device's copy ceiling; the host rows measure their own
    if only - {"host"}:
        ceiling = copy_ceiling_gbs()
        print(f"device: {torch.cuda.get_device_name()}  copy ceiling: {ceiling:.0f} GB/s")
    print(HEADER, flush=True)
    rows = []
    extra = {}
    if "rope" in only:
        extra["cold_start"] = cold_start()
        rows += rope_rows(ceiling, not args.no_compile)
    if "component" in only:
        from ._bench_component import component_rows

        rows += component_rows(ceiling, not args.no_compile)
    if "mhc" in only:
        from ._bench_mhc import mhc_rows

        rows += mhc_rows(ceiling, not args.no_compile)
    if "dispatch" in only:
        from ._bench_dispatch import dispatch_rows

        for row in dispatch_rows():
            print(format_row(row), flush=True)
            rows.append(row)
    if "peers" in only:
        from ._bench_peers import peer_rows

        rows += peer_rows(ceiling)
    if "host" in only:
        from ._bench_host import host_rows

        rows += host_rows()
    return ceiling, rows, extra


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", action="store_true", help="print the rows as JSON on stdout, the table on stderr"
    )
    parser.add_argument("--only", choices=_GROUPS, action="append")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile columns")
    args = parser.parse_args(argv)
    # with --json, stdout carries the JSON alone (for a pipe); the table goes to stderr
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
        ceiling, rows, extra = _run(args)
    if args.json:
        print(json.dumps({"copy_ceiling_gbs": ceiling, "rows": rows, **extra}, indent=1))


if __name__ == "__main__":
    main()
