// The CUDA subset kernels_cu/rope.cu uses, on the host (tests/test_rope_on_host_threads.py):
// one std::thread per CUDA thread, blocks one after another (launch_on_threads), so the
// kernel's lane logic runs without a GPU. __syncthreads is a barrier of the block; a warp
// shuffle goes through a barrier of the lanes its mask names, which must be the whole warp
// (32 threads of the block) or the caller's x-lane group of one (y, z), with the partner
// lane inside it; a lane that has returned from the kernel must not be named. Dynamic
// shared memory is one array the includer defines (blocks do not overlap in time).
// Replaces common.cuh: the 16-bit types convert in software (round to nearest even).
#include <barrier>
#include <functional>
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
#define __shared__
#define __align__(n) __attribute__((aligned(n)))
struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
struct float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline float2 make_float2(float x, float y) { return float2{x, y}; }
struct alignas(8) uint2 { unsigned x, y; };
inline void __threadfence_system() {}
inline float rsqrtf(float v) { return 1.f / std::sqrt(v); }
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
struct half_t { u16 bits; };
struct bfloat16_t { u16 bits; };
inline float bits_float(u32 b) { float f; std::memcpy(&f, &b, 4); return f; }
inline u32 float_bits(float f) { u32 b; std::memcpy(&b, &f, 4); return b; }
inline float __uint_as_float(u32 b) { return bits_float(b); }
inline u32 __float_as_uint(float f) { return float_bits(f); }
using std::memcpy;
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
template <typename T> float word_low(u32 word) { T v; v.bits = u16(word & 0xffffu); return to_float(v); }
template <typename T> float word_high(u32 word) { T v; v.bits = u16(word >> 16); return to_float(v); }
template <typename T> u32 pack_word(float low, float high) {
  return u32(from_float<T>(low).bits) | u32(from_float<T>(high).bits) << 16;
}
inline void store_16_bytes(void* to, u32 w0, u32 w1, u32 w2, u32 w3) {
  const u32 words[4] = {w0, w1, w2, w3};
  std::memcpy(to, words, 16);
}
inline void store_8_bytes(void* to, u32 w0, u32 w1) {
  const u32 words[2] = {w0, w1};
  std::memcpy(to, words, 8);
}
// an L2 eviction policy means nothing on the host: a plain load
template <typename T> inline T load_kept_in_l2(const T* from) { return *from; }
inline int min(int a, int b) { return a < b ? a : b; }
// The lanes a barrier joins: the 32 of a warp or the x-lanes of one (y, z).
struct Lanes {
  std::barrier<> bar;
  explicit Lanes(int n) : bar(n) {}
};
struct Block {
  std::barrier<> all;                         // __syncthreads
  std::vector<std::unique_ptr<Lanes>> warps;  // per warp (only whole warps)
  std::vector<std::unique_ptr<Lanes>> groups; // per (y, z)
  std::vector<float> slots;                   // a shuffle's value, per thread
  std::vector<char> exited;                   // per thread
  explicit Block(unsigned threads) : all(threads), slots(threads), exited(threads) {}
};
thread_local Block* my_block;

inline unsigned linear_thread() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

inline void __syncthreads() { my_block->all.arrive_and_wait(); }

[[noreturn]] inline void bad_shuffle(const char* why, unsigned mask, int offset) {
  std::fprintf(stderr, "bad shuffle (%s): mask %x offset %d block (%u, %u, %u) thread %u\n",
               why, mask, offset, blockDim.x, blockDim.y, blockDim.z, linear_thread());
  std::abort();
}

// A shuffle among the lanes of `mask` (a whole warp, or the x-lanes of one (y, z)), each
// reading lane source(lane) of them.
template <typename Source>
inline float shuffle(unsigned mask, float v, int width, int offset, Source source) {
  const unsigned thread = linear_thread(), lane = thread & 31, warp_base = thread - lane;
  const unsigned x_lanes = blockDim.x, group_base = lane & ~(x_lanes - 1);
  const unsigned group_mask = x_lanes >= 32 ? 0xffffffffu : ((1u << x_lanes) - 1) << group_base;
  const unsigned threads = blockDim.x * blockDim.y * blockDim.z;
  const unsigned from = source(lane);
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0) bad_shuffle("width", mask, offset);
  if (from >= 32 || !(mask >> from & 1)) bad_shuffle("partner outside the mask", mask, offset);
  Lanes* lanes;
  if (mask == 0xffffffffu && warp_base + 32 <= threads) {
    lanes = my_block->warps[thread / 32].get();
  } else if (width == 32 && mask == group_mask && (x_lanes & (x_lanes - 1)) == 0 &&
             32 % x_lanes == 0) {
    lanes = my_block->groups[threadIdx.y + blockDim.y * threadIdx.z].get();
  } else {
    bad_shuffle("mask is neither a whole warp nor the x-lane group", mask, offset);
  }
  my_block->slots[thread] = v;
  lanes->bar.arrive_and_wait();
  for (unsigned l = 0; l < 32; ++l) {
    if ((mask >> l & 1) && my_block->exited[warp_base + l]) {
      bad_shuffle("a named lane has returned", mask, offset);
    }
  }
  const float r = my_block->slots[warp_base + from];
  lanes->bar.arrive_and_wait();
  return r;
}

inline float __shfl_xor_sync(unsigned mask, float v, int offset, int width = 32) {
  if (width != 32) bad_shuffle("width other than 32", mask, offset);
  return shuffle(mask, v, width, offset, [&](unsigned lane) { return lane ^ unsigned(offset); });
}

// srcLane of the lane's aligned group of `width` lanes, as CUDA's (within the group's mask)
inline float __shfl_sync(unsigned mask, float v, int source, int width = 32) {
  return shuffle(mask, v, width, source, [&](unsigned lane) {
    return (lane & ~unsigned(width - 1)) + (unsigned(source) & unsigned(width - 1));
  });
}

inline u32 __shfl_xor_sync(unsigned mask, u32 v, int offset, int width = 32) {
  return __float_as_uint(__shfl_xor_sync(mask, __uint_as_float(v), offset, width));
}

// Run `kernel` (the body of one CUDA thread) over a grid of `grid` blocks of `block`, one
// block at a time (x fastest, as CUDA numbers them), one std::thread per CUDA thread. A
// thread that returns leaves every barrier (as an exited CUDA thread no longer holds up
// __syncthreads). A kernel's static __shared__ arrays are static there: one for all blocks.
inline void launch_on_threads(dim3 grid, dim3 block, const std::function<void()>& kernel) {
  gridDim = grid;
  blockDim = block;
  const unsigned threads = block.x * block.y * block.z;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block state(threads);
        for (unsigned w = 0; w + 32 <= threads; w += 32) state.warps.emplace_back(new Lanes(32));
        for (unsigned g = 0; g < block.y * block.z; ++g)
          state.groups.emplace_back(new Lanes(block.x));
        std::vector<std::thread> workers;
        for (unsigned z = 0; z < block.z; ++z)
          for (unsigned y = 0; y < block.y; ++y)
            for (unsigned x = 0; x < block.x; ++x)
              workers.emplace_back([&, x, y, z] {
                threadIdx = dim3{x, y, z};
                blockIdx = dim3{bx, by, bz};
                my_block = &state;
                kernel();
                const unsigned thread = linear_thread();
                state.exited[thread] = 1;
                state.all.arrive_and_drop();
                if (thread / 32 < state.warps.size())
                  state.warps[thread / 32]->bar.arrive_and_drop();
                state.groups[y + block.y * z]->bar.arrive_and_drop();
              });
        for (auto& worker : workers) worker.join();
      }
}
