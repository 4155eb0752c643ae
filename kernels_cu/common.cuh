// What every kernel source shares, prepended to each by the loader (tileops_cupy._cuda):
// integer shorthands, the 16-bit float types and their exact conversions, wide stores, and
// loads that ask L2 to keep op-state tables.
//
// Header-free on purpose (no cuda_fp16.h / cuda_bf16.h): NVRTC then needs no toolkit
// headers, and the conversions below are the exact PTX instructions those headers emit.
// The Python side names these types in one map (tileops_cupy._cuda.CUDA_TYPES).

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// 16-bit float storage: the bits, nothing else (arithmetic is float32 everywhere).
struct half_t {
  u16 bits;
};
struct bfloat16_t {
  u16 bits;
};

__device__ __forceinline__ float bf16_bits_to_float(u32 bits) { return __uint_as_float(bits << 16); }

__device__ __forceinline__ u16 float_to_bf16_bits(float f) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));  // round to nearest even, sm_80+
  return r;
}

__device__ __forceinline__ float fp16_bits_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ u16 float_to_fp16_bits(float f) {
  u16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));  // round to nearest even
  return r;
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(half_t v) { return fp16_bits_to_float(v.bits); }
__device__ __forceinline__ float to_float(bfloat16_t v) { return bf16_bits_to_float(v.bits); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ half_t from_float<half_t>(float v) {
  return half_t{float_to_fp16_bits(v)};
}
template <>
__device__ __forceinline__ bfloat16_t from_float<bfloat16_t>(float v) {
  return bfloat16_t{float_to_bf16_bits(v)};
}

// Two elements of a 16-bit type in one 32-bit word (element 0 in the low half): each as a
// float, and two floats rounded to the type into one word (cvt.rn.*x2 rounds each half to
// nearest even, as from_float does).
template <typename T>
__device__ __forceinline__ float word_low(u32 word);
template <typename T>
__device__ __forceinline__ float word_high(u32 word);
template <typename T>
__device__ __forceinline__ u32 pack_word(float low, float high);
template <>
__device__ __forceinline__ float word_low<bfloat16_t>(u32 word) {
  return __uint_as_float(word << 16);
}
template <>
__device__ __forceinline__ float word_high<bfloat16_t>(u32 word) {
  return __uint_as_float(word & 0xffff0000u);
}
template <>
__device__ __forceinline__ float word_low<half_t>(u32 word) {
  return fp16_bits_to_float(static_cast<u16>(word & 0xffffu));
}
template <>
__device__ __forceinline__ float word_high<half_t>(u32 word) {
  return fp16_bits_to_float(static_cast<u16>(word >> 16));
}
template <>
__device__ __forceinline__ u32 pack_word<bfloat16_t>(float low, float high) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(high), "f"(low));
  return r;
}
template <>
__device__ __forceinline__ u32 pack_word<half_t>(float low, float high) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(high), "f"(low));
  return r;
}

// Four 32-bit words to 16-byte-aligned global memory in one access. Assigned as a struct or a
// uint4 through a pointer cast, NVRTC 13 split such a store into four 4-byte stores (a quarter
// of each sector a store, four times the store instructions: rope_rotate_packs ran at 80% of
// the copy ceiling where its loads allowed 97%).
__device__ __forceinline__ void store_16_bytes(void* to, u32 w0, u32 w1, u32 w2, u32 w3) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(to), "r"(w0), "r"(w1), "r"(w2),
               "r"(w3)
               : "memory");
}

// Two 32-bit words to 8-byte-aligned global memory in one access (as store_16_bytes).
__device__ __forceinline__ void store_8_bytes(void* to, u32 w0, u32 w1) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(to), "r"(w0), "r"(w1) : "memory");
}

// A load of op-state tables (RoPE's cos/sin; mhc.cu's cp_async16_kept_in_l2 takes the same
// policy for mHC pre's phi fragments) that asks L2 to keep their lines, under an evict-last
// policy: every token of a launch re-reads them, and the rows it streams through L2 (each
// read once) would otherwise push them out between those reads. The rows keep plain loads:
// read once, they gain only inside a benchmark's flush (the performance log). What stays is
// what a call touches: RoPE's fine table (512 KB at D128) and a coarse row (512 bytes) for
// each 1024 positions in use, mHC's phi fragments (2.25 MB at n4 c_x4096). The lines are
// const for the kernel, so the loads carry no memory clobber and may be scheduled freely.
// H100, bf16 B8 S4096 H32 D128 (the performance log, forty-first session): a TileOPs-shaped
// kernel reading our two-level float32 tables 189.7 us plain, 181.6 so (a copy: 181.5).
__device__ __forceinline__ unsigned long long keep_in_l2_policy() {
  unsigned long long policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ float2 load_kept_in_l2(const float2* from) {
  float2 v;
  asm("ld.global.L2::cache_hint.v2.f32 {%0, %1}, [%2], %3;"
      : "=f"(v.x), "=f"(v.y)
      : "l"(from), "l"(keep_in_l2_policy()));
  return v;
}

__device__ __forceinline__ float4 load_kept_in_l2(const float4* from) {
  float4 v;
  asm("ld.global.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;"
      : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
      : "l"(from), "l"(keep_in_l2_policy()));
  return v;
}
