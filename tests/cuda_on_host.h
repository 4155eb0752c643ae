// The CUDA subset kernels_cu/rope.cu uses, on the host (tests/test_rope_on_host_threads.py):
// one std::thread per CUDA thread, so the kernel's lane logic runs without a GPU. A warp
// shuffle goes through a barrier of the shuffling group (a block's x-lanes of one (y, z)),
// after checking the width and the mask the kernel passes. Replaces common.cuh: the 16-bit
// types convert in software (round to nearest even).
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(...)
struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim;
struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline void __threadfence_system() {}
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
struct half_t { u16 bits; };
struct bfloat16_t { u16 bits; };
inline float bits_float(u32 b) { float f; std::memcpy(&f, &b, 4); return f; }
inline u32 float_bits(float f) { u32 b; std::memcpy(&b, &f, 4); return b; }
inline float to_float(float v) { return v; }
inline float to_float(half_t v) { _Float16 h; std::memcpy(&h, &v.bits, 2); return (float)h; }
inline float to_float(bfloat16_t v) { return bits_float(u32(v.bits) << 16); }
template <typename T> T from_float(float v);
template <> inline float from_float<float>(float v) { return v; }
template <> inline half_t from_float<half_t>(float v) { _Float16 h = (_Float16)v; half_t r; std::memcpy(&r.bits, &h, 2); return r; }
template <> inline bfloat16_t from_float<bfloat16_t>(float v) {
  u32 b = float_bits(v);
  if (std::isnan(v)) return bfloat16_t{u16((b >> 16) | 0x40)};
  b += 0x7fff + ((b >> 16) & 1);
  return bfloat16_t{u16(b >> 16)};
}
struct Group {
  std::barrier<> bar;
  float slots[32];
  explicit Group(int n) : bar(n) {}
};
thread_local Group* my_group;
thread_local unsigned my_lane;
inline float __shfl_xor_sync(unsigned mask, float v, int offset, int width) {
  const unsigned thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned lane = thread & 31;
  const unsigned base = lane & ~unsigned(width - 1);
  const unsigned expected = width == 32 ? 0xffffffffu : ((1u << width) - 1) << base;
  if (unsigned(width) != blockDim.x || 32 % width || mask != expected || (width & (width - 1))) {
    std::fprintf(stderr, "bad shuffle: width %d blockDim.x %u mask %x expected %x\n", width,
                 blockDim.x, mask, expected);
    std::abort();
  }
  my_group->slots[my_lane] = v;
  my_group->bar.arrive_and_wait();
  const float r = my_group->slots[my_lane ^ unsigned(offset)];
  my_group->bar.arrive_and_wait();
  return r;
}
