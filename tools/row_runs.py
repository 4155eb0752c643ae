"""How fast DRAM serves a pass over x against the length of each row's run a stage, at
saturation (GPU only; ``python tools/row_runs.py``).

128 blocks of 256 threads (one a multiprocessor, as ``mhc_project`` and ``mhc_bwd_stats``)
read 134 MB laid out as mHC x at B4096 c_x4096 n4 bf16: 4096 token rows of 32 KB, 4 streams
of 8 KB each. Block b takes tile b // 4 (128 rows) and split b % 4; stage after stage it
reads, of each of its rows, a run of R bytes of each of S streams at the same columns (S = 4:
the stats pass's pattern; S = 1: one stream, as the projection's K ranges), the four splits
of a tile at neighbouring runs. Every load of U stages is issued before any is used (no
bound test between them: about 32 loads of 16 bytes in flight a thread). Timed as the bench
times (L2 flushed by a 256 MB write, CUDA events, median of 30), against the best flat read
of the same bytes. The performance log's thirty-first session says what it found.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

SOURCE = r"""
template <int LOG_RUN16, int STREAMS, int U>
__global__ void __launch_bounds__(256)
    runs(const uint4* __restrict__ x, int stages, unsigned* out) {
  constexpr int RUN16 = 1 << LOG_RUN16, ROW16 = 32768 / 16, STREAM16 = ROW16 / 4;
  constexpr int E = 128 * STREAMS * RUN16 / 256;  // loads a thread a stage
  const int tile = blockIdx.x >> 2, split = blockIdx.x & 3;
  const uint4* base = x + (long long)tile * 128 * ROW16;
  int offset[E];
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const int i = threadIdx.x + j * 256, run = i >> LOG_RUN16;
    offset[j] = run / STREAMS * ROW16 + run % STREAMS * STREAM16 + (i & (RUN16 - 1));
  }
  unsigned acc = 0;
  for (int s = 0; s < stages; s += U) {
    uint4 v[U][E];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < E; ++j)
        v[u][j] = __ldg(base + offset[j] + (((s + u) * 4 + split) << LOG_RUN16));
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < E; ++j) acc ^= v[u][j].x ^ v[u][j].y ^ v[u][j].z ^ v[u][j].w;
  }
  if (acc == 0x12345678u) out[0] = acc;  // (never: keeps the loads)
}

extern "C" __global__ void flat(const uint4* __restrict__ x, long long per_block16,
                                unsigned* out) {
  const uint4* base = x + blockIdx.x * per_block16;
  unsigned acc = 0;
  for (long long e = threadIdx.x; e < per_block16; e += 8 * blockDim.x) {
    uint4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __ldg(base + e + j * blockDim.x);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}
"""
ROW_BYTES, ROWS = 32768, 4096
CASES = ((64, 4), (128, 4), (256, 4), (64, 1), (128, 1), (256, 1), (512, 1), (1024, 1))


def _stages_in_flight(run: int, streams: int) -> int:
    """U: stages whose loads a thread issues together (about 32 loads)."""
    return max(1, 32 // (128 * streams * (run // 16) // 256))


def _kernel_name(run: int, streams: int) -> str:
    return f"runs<{(run // 16).bit_length() - 1}, {streams}, {_stages_in_flight(run, streams)}>"


def main() -> None:
    names = [_kernel_name(run, streams) for run, streams in CASES]
    module = cp.RawModule(code=SOURCE, name_expressions=[*names, "flat"])
    flat = module.get_function("flat")
    x = cp.random.randint(0, 2**31, (ROWS * ROW_BYTES // 4,), dtype=cp.int32)
    out = cp.zeros(1, cp.uint32)
    flush = cp.empty(256 << 20, cp.uint8)

    def time_us(launch, reps: int = 30) -> float:
        start, end = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(reps):
            flush.fill(0)
            start.record()
            launch()
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
        return float(np.median(times))

    a = cp.empty(512 << 20, cp.uint8)
    b = cp.empty_like(a)
    ceiling = 2 * a.nbytes / time_us(lambda: b.__setitem__(Ellipsis, a)) / 1e3
    print(f"copy ceiling (512 MiB, read + write) {ceiling:.0f} GB/s")
    best = 0.0
    for blocks in (128, 264, 1056):
        per_block = np.int64(x.nbytes // 16 // blocks)
        us = time_us(lambda blocks=blocks, n=per_block: flat((blocks,), (256,), (x, n, out)))
        best = max(best, x.nbytes / us / 1e3)
        print(f"flat read by {blocks} blocks: {us:.1f} us, {x.nbytes / us / 1e3:.0f} GB/s")
    for (run, streams), name in zip(CASES, names, strict=True):
        kernel = module.get_function(name)
        stages = np.int32(ROW_BYTES // streams // run // 4)
        us = time_us(lambda kernel=kernel, stages=stages: kernel((128,), (256,), (x, stages, out)))
        speed = x.nbytes / us / 1e3
        print(
            f"runs of {run:4d} B x {streams} streams: {us:6.1f} us, {speed:.0f} GB/s, "
            f"{100 * speed / best:.1f}% of the best flat read"
        )


if __name__ == "__main__":
    main()
