// Manifold-constrained hyper-connections (mHC, TileOPs semantics): the pre-layer reduction
// and the post-layer mix. Header-free: NVRTC here has no toolkit headers, so 16-bit floats
// are converted with inline PTX and the tensor-core product is inline PTX `mma.sync`.
//
// Pre is one kernel per call for small batches (decode; _mhc._pre_plan says how small): on
// sm_90 mhc_pre_cluster (thread block clusters, below) where a block's slice of x is small,
// else mhc_pre_small (below); otherwise four kernels, one when the batch is up to 256 tokens:
//   mhc_phi_pieces  phi as bf16 B fragments (below), once per call.
//   mhc_project  h = x @ phi and sum(x*x) for a tile of 128 tokens over one range of K.
//                phi is split into three bf16 pieces (hi + mid + lo == phi exactly), x into
//                one (bf16), two (fp16) or three (fp32) pieces, and every piece product whose
//                weight is at least 2^-16 goes through the bf16 tensor cores with float32
//                accumulation: float32-accurate h at tensor-core speed (TF32 alone is not).
//                x and phi fragments stream through a cp.async pipeline into a scratch
//                [k_splits, batch, Q+1] of partial sums (the Q+1-th is sum(x*x)).
//   mhc_coefficients  COEF_ROWS tokens a block: the partials summed in a fixed order, then
//                every token's gates and Sinkhorn matrix (n*n lanes a token; one thread a
//                token in the largest batches), into a scratch [batch, n + n*n] and h_post.
//   mhc_apply    one pass over the rows, one thread per 8 columns: x_layer and x_res.
// On sm_90, from 512 tokens, mhc_project and mhc_apply start and load their first x while
// the kernel before them runs (programmatic dependent launch, below).
// In its FUSED instantiation (up to 256 tokens) the blocks of one cooperative mhc_project launch
// split K over every multiprocessor (each block splitting its own range of phi into
// fragments: no mhc_phi_pieces launch), meet at a grid barrier, compute the coefficients of
// a run of tokens each, meet again, and apply them to a share of the columns: one launch,
// and no host synchronisation anywhere.
//
// Post (mhc_post) is one pass: each thread reads 8 columns of x_layer_out once and reuses
// them for the n streams of x_res.

struct alignas(16) U4 {
  u32 x, y, z, w;
};
struct alignas(8) U2 {
  u32 x, y;
};

// ------------------------------------------------------------------ conversions and PTX

// (the 16-bit float types and their conversions: common.cuh, prepended by the loader)

template <typename T>
struct Io;

template <>
struct Io<bfloat16_t> {
  typedef u16 elem;
  static constexpr int x_pieces = 1;  // bf16 x is exact in the bf16 tensor cores
  static __device__ __forceinline__ float to_float(u16 v) { return bf16_bits_to_float(v); }
  static __device__ __forceinline__ u16 from_float(float f) { return float_to_bf16_bits(f); }
};

template <>
struct Io<half_t> {
  typedef u16 elem;
  static constexpr int x_pieces = 2;  // 11 significant bits: bf16 hi + bf16 lo is exact
  static __device__ __forceinline__ float to_float(u16 v) { return fp16_bits_to_float(v); }
  static __device__ __forceinline__ u16 from_float(float f) { return float_to_fp16_bits(f); }
};

template <>
struct Io<float> {
  typedef float elem;
  static constexpr int x_pieces = 3;  // 24 significant bits: three bf16 pieces are exact
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from_float(float f) { return f; }
};

// v == pieces[0] + pieces[1] + pieces[2] exactly (each rounding error is a float32 value
// with at most 16, then 8, significant bits left).
template <int P>
__device__ __forceinline__ void split_bf16(float v, u32 (&pieces)[P]) {
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const u16 bits = float_to_bf16_bits(v);
    pieces[i] = bits;
    v -= bf16_bits_to_float(bits);
  }
}

__device__ __forceinline__ u32 smem_address(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_address(smem)), "l"(gmem)
               : "memory");
}

// cp_async16 under an L2 evict-last policy (common.cuh's keep_in_l2_policy): for the phi
// fragments, which every tile's block re-reads while x streams through L2 once. H100, bf16
// n4, device us (kernel_ab, two rounds): B4096 c_x4096 172.1 -> 170.5, c_x7168 282.5 ->
// 280.5, B16384 c_x7168 1060.7 -> 1059.6, every pre row from B512 0.1-1% faster.
__device__ __forceinline__ void cp_async16_kept_in_l2(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(
                   smem_address(smem)),
               "l"(gmem), "l"(keep_in_l2_policy())
               : "memory");
}

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_address(smem)), "l"(gmem)
               : "memory");
}

// 16 (4) bytes of which the first src_bytes are copied and the rest zero-filled; with
// src_bytes 0 nothing is read (callers still pass a valid address).
__device__ __forceinline__ void cp_async16_fill(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_address(smem)), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async4_fill(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_address(smem)), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void cp_async_wait_all_but(int pending) {
  // wait_group takes an immediate; the pipeline depth is a launch parameter (2..4 stages)
  if (pending <= 0)
    asm volatile("cp.async.wait_group 0;" ::: "memory");
  else if (pending == 1)
    asm volatile("cp.async.wait_group 1;" ::: "memory");
  else
    asm volatile("cp.async.wait_group 2;" ::: "memory");
}

__device__ __forceinline__ float load_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// s[r] + the terms at base + r * column_step + k * stride for k = first, first + step, ...
// below end, added in k order, for each of ROUND columns r < columns (a column past them
// reads column 0's terms and its s[r] is left as it was). Eight loads a column, of every
// column, are issued before any is added: a loop that tests its bound between loads issues
// each one after the add of the one before, and in-order issue waits on that add, so every
// term cost an L2 round trip of its own (and a column after another, one each). Past the end
// the address is clamped to the last term (read, not added).
template <int ROUND>
__device__ __forceinline__ void add_strided(float (&s)[ROUND], const float* base, i64 column_step,
                                            int columns, i64 first, i64 end, i64 step, i64 stride) {
  for (i64 k0 = first; k0 < end; k0 += 8 * step) {
    float v[ROUND][8];
#pragma unroll
    for (int r = 0; r < ROUND; ++r) {
      const float* column = base + (r < columns ? r : 0) * column_step;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const i64 k = k0 + j * step;
        v[r][j] = load_cg(column + (k < end ? k : end - 1) * stride);
      }
    }
#pragma unroll
    for (int r = 0; r < ROUND; ++r)
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (r < columns && k0 + j * step < end) s[r] += v[r][j];
  }
}

// One column's add_strided.
__device__ __forceinline__ float add_strided(float s, const float* base, i64 first, i64 end, i64 step,
                                             i64 stride) {
  float sums[1] = {s};
  add_strided<1>(sums, base, 0, 1, first, end, step, stride);
  return sums[0];
}

__device__ __forceinline__ unsigned int load_acquire(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

__device__ __forceinline__ void store_release(unsigned int* p, unsigned int v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Programmatic dependent launch (sm_90 and newer): the host launches mhc_project (not
// fused), mhc_coefficients and mhc_apply with programmatic stream serialization
// (_mhc._pre_plan, from 512 tokens), so their blocks start once every block of the kernel
// before them has called launch_dependents (or exited), not once that kernel has finished:
// the launch gap, and mhc_project's and mhc_apply's first loads of x (which no kernel of the
// call writes), overlap it. mhc_project never calls it, so mhc_coefficients' blocks start as
// its last ones exit (a trigger at mhc_project's start, whose early coefficient and mix
// blocks then took SMs and DRAM from it, was slower); mhc_coefficients calls it after its
// wait, so mhc_apply's blocks start no earlier than before.
// mhc_backward.cu's pre backward kernels after the first are launched the same way, each
// waiting before anything else, so only the launch gap goes.
// wait_for_prerequisites returns once the kernel before has finished and its writes are
// visible; nothing it writes may be read before. Both are no-ops in a kernel launched
// without the attribute, and compiled out before sm_90.
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prerequisites() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ U4 load_stream16(const void* p) {
  U4 r;
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// Outputs are written once and not read again by this kernel: evict-first keeps them from
// pushing inputs out of L2.
__device__ __forceinline__ void store_stream16(void* p, U4 v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const u32 (&a)[4], U2 b) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
}

template <typename T>
__device__ __forceinline__ void store8(typename Io<T>::elem* p, const float (&v)[8]) {
  if constexpr (sizeof(typename Io<T>::elem) == 2) {
    u32 words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      words[i] = pack_word<T>(v[2 * i], v[2 * i + 1]);
    store_stream16(p, U4{words[0], words[1], words[2], words[3]});
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      store_stream16(p + 4 * h, U4{__float_as_uint(v[4 * h]), __float_as_uint(v[4 * h + 1]),
                                   __float_as_uint(v[4 * h + 2]), __float_as_uint(v[4 * h + 3])});
  }
}

// The first `count` (< 8) elements, element by element, for rows that are not 16-byte aligned.
template <typename T>
__device__ __forceinline__ void load_some(const typename Io<T>::elem* p, int count, float (&v)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = e < count ? Io<T>::to_float(p[e]) : 0.f;
}

template <typename T>
__device__ __forceinline__ void store_some(typename Io<T>::elem* p, int count, const float (&v)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (e < count) p[e] = Io<T>::from_float(v[e]);
}

__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + expf(-z)); }

// CUDA's correctly rounded reciprocal `1.f / s` is MUFU.RCP and one Newton step, behind a check
// of s's biased exponent (0, 253, 254 or 255: zero, subnormal, near the top, inf or NaN) and a
// branch to a slow path. fast_reciprocal is that fast path alone, bit for bit `1.f / s` where
// the check passes (reciprocal_is_fast); NaN gives NaN.
__device__ __forceinline__ bool reciprocal_is_fast(float s) {
  return ((__float_as_uint(s) + 0x1800000u) & 0x7f800000u) > 0x1ffffffu;
}

__device__ __forceinline__ float fast_reciprocal(float s) {
  float a;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(a) : "f"(s));
  return fmaf(a, fmaf(-s, a, 1.f), a);
}

// 1 / s[k] for every k, bit for bit as `1.f / s[k]`. Compiled one division at a time, each
// sits in a branch region of its own, so N reciprocals issue one after another (a chain of
// them is pure latency); one check for all N lets them issue together.
template <int N>
__device__ __forceinline__ void reciprocals(const float (&s)[N], float (&r)[N]) {
  bool fast = true;
#pragma unroll
  for (int k = 0; k < N; ++k) fast &= reciprocal_is_fast(s[k]);
  if (fast) {
#pragma unroll
    for (int k = 0; k < N; ++k) r[k] = fast_reciprocal(s[k]);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) r[k] = 1.f / s[k];
  }
}

// ------------------------------------------------------------------ parameters

// One by-value parameter per launch. tileops_cupy reads the fields from this declaration
// (_cuda.ParamStruct.declared) and packs them by name; the static_asserts pin the size its
// packing must have (tests/test_nvrtc.py compares them).
struct PreParams {
  const void* x;          // [batch, n*c_x], rows x_stride elements apart, columns dense
  const float* phi;       // [n*c_x, Q] through (phi_stride_k, phi_stride_q)
  const float* bias;      // [Q] through bias_stride
  float* partial;         // scratch [k_splits, batch, Q+1] (small: slices, see there)
  unsigned int* counter;  // COUNTER_GROUPS words, zeroed by mhc_phi_pieces (else see there)
  float* coef;            // scratch [batch, n + n*n]: h_pre, then M row-major
  u32* pieces;            // scratch: phi as bf16 B fragments, K block by K block (mhc_phi_pieces)
  void* x_res;            // [batch, n*c_x], contiguous
  void* x_layer;          // [batch, c_x], contiguous
  float* h_post;          // [batch, n], contiguous
  i64 x_stride, phi_stride_k, phi_stride_q, bias_stride;
  i64 batch, c_x, k_range, k_splits;
  int vector_io, repeat, phi_dense;  // phi_dense: [n*c_x, Q] rows packed, 16-byte aligned
  float alpha_pre, alpha_post, alpha_res, eps;
  // mhc_pre_cluster: tokens a cluster, columns a block, clusters splitting K for one group of
  // tokens (1: a cluster takes all of K)
  int cluster_rows, cluster_columns, cluster_groups;
  int unused[2];  // (192 bytes: _cuda.ParamStruct packs no tail padding)
};

static_assert(sizeof(PreParams) == 192, "PreParams changed size: update this number");

struct PostParams {
  const void* x_layer_out;  // [batch, c_x], rows layer_stride apart, columns dense
  const float* h_post;      // [batch, n] through (h_stride_row, h_stride_col)
  const void* x_res;        // [batch, n*c_x], rows res_stride apart, columns dense
  void* out;                // [batch, n*c_x], contiguous
  i64 layer_stride, h_stride_row, h_stride_col, res_stride;
  i64 batch, n, c_x, units;  // units = ceil(c_x / 8): one thread per 8 columns of a row
  int vector_io, unused;
};

static_assert(sizeof(PostParams) == 104, "PostParams changed size: update this number");

template <int N>
struct Dims {
  static constexpr int Q = N * N + 2 * N;  // h width: n pre gates, n post gates, n*n residual
  static constexpr int QP = Q + 1;         // partial row: h, then sum(x*x)
  static constexpr int NT = (Q + 7) / 8;   // mma n-tiles (8 columns of h each)
  static constexpr int NC = N + N * N;     // per-token coefficients: h_pre, then M row-major
};

// Launch geometry: defines from tileops_cupy._mhc (_GEOMETRY), which sizes the launches by
// the same numbers.
//   TILE_ROWS        tokens per mhc_project block: 4 warp rows of 32 tokens
//   BLOCK_K          K elements of one block of phi fragments (mhc_phi_pieces' blocks; 4 mma
//                    k-steps). mhc_project's pipeline stages are 1 or 2 of them wide and 2 or
//                    3 deep (its STAGE_K and STAGES template arguments, which the plan picks)
//   PROJECT_THREADS, APPLY_THREADS, POST_THREADS  threads per block of each kernel
//                    (mhc_coefficients: PROJECT_THREADS)
//   COEF_ROWS        tokens per mhc_coefficients block (COEF_TOKEN_ROWS: one thread a token)
//   COUNTER_GROUPS   counter words before mhc_pre_small's per-group ones: [0], [1] fused
//                    mhc_project: blocks past the two grid barriers, [2] blocks finished
//                    (small: see there)
//   CLUSTER_BLOCKS   the most blocks an mhc_pre_cluster cluster has (16: sm_90's largest,
//                    non-portable)
static_assert(TILE_ROWS == 128 && PROJECT_THREADS == 256, "mhc_project's warp layout");
static_assert(BLOCK_K == 64, "4 k-steps a fragment block (split_phi, piece_words)");
static_assert(COUNTER_GROUPS >= 3, "counters");
static_assert(CLUSTER_BLOCKS >= 1 && CLUSTER_BLOCKS <= 16, "sm_90 clusters");


// ------------------------------------------------------------------ coefficients and mix

// h and sum(x*x) of rows row0 .. row0+rows-1: the k_splits partials summed in a fixed order
// (deterministic), into sh_h [rows][Q+1]. Every thread of the block calls it. ROUND: the
// (row, column) pairs a thread sums at once where each takes all the splits (every load of
// the round in flight before any add: a pair after another waited an L2 round trip each).
template <int N, int ROUND = 1>
__device__ void sum_partials(const PreParams& p, i64 row0, int rows, float* sh_h, float* sh_scratch) {
  constexpr int QP = Dims<N>::QP;
  const int tid = threadIdx.x, threads = blockDim.x;
  const int pairs = rows * QP;
  const i64 split_step = p.batch * QP;
  if (pairs * 2 > threads) {  // one thread per (row, column), all splits in order
    for (int pair = tid; pair < pairs; pair += ROUND * threads) {
      // the r with pair + r * threads < pairs (one column: always; said so, it folds away)
      const int columns = ROUND == 1 ? 1 : (pairs - pair + threads - 1) / threads;
      float sums[ROUND] = {};
      add_strided<ROUND>(sums, p.partial + row0 * QP + pair, threads, columns, 0, p.k_splits, 1,
                         split_step);
#pragma unroll
      for (int r = 0; r < ROUND; ++r)
        if (r < columns) sh_h[pair + r * threads] = sums[r];
    }
  } else {  // few columns, many splits (decode): spread the splits, then add in a fixed order
    // Thread (pair, sub) sums splits sub, sub + per_pair, ...; consecutive threads take
    // consecutive pairs of one split, so that a warp's loads share lines.
    const int per_pair = threads / pairs;
    const int pair = tid % pairs, sub = tid / pairs;
    float s = 0.f;
    if (sub < per_pair)
      s = add_strided(0.f, p.partial + row0 * QP + pair, sub, p.k_splits, per_pair, split_step);
    sh_scratch[tid] = s;
    __syncthreads();
    if (tid < pairs) {
      float t = 0.f;
      for (int j = 0; j < per_pair; ++j) t += sh_scratch[j * pairs + tid];
      sh_h[tid] = t;
    }
  }
  __syncthreads();
}

__device__ __forceinline__ bool is_inf(float v) {
  return (__float_as_uint(v) & 0x7fffffffu) == 0x7f800000u;
}

// sh_h[t][Q] of rows row0 .. row0+rows-1 turned from sum(x*x) into sqrt(sum(x*x) / width).
// A row whose sum overflowed to inf (|x| from ~1e19 up in a 128-wide row; x finite) is read
// again and summed scaled by the power of two that brings its max |x| into [0.5, 1), then the
// root is scaled back: exact steps, so the RMS is finite for every finite x, while every other
// row keeps the very bits of the unscaled sum. One warp per row; every thread calls it.
template <typename T, int N>
__device__ void rows_rms(const PreParams& p, float* sh_h, i64 row0, int rows) {
  constexpr int Q = Dims<N>::Q, QP = Dims<N>::QP;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const float width = (float)(N * p.c_x);
  for (int t = warp; t < rows; t += warps) {  // warp-uniform: the shuffles below see all lanes
    const float sumsq = sh_h[t * QP + Q];
    float rms = sqrtf(sumsq) / sqrtf(width);
    if (is_inf(sumsq)) {
      const typename Io<T>::elem* x = (const typename Io<T>::elem*)p.x + (row0 + t) * p.x_stride;
      const i64 K = N * p.c_x;
      float peak = 0.f;
      for (i64 c = lane; c < K; c += 32) peak = fmaxf(peak, fabsf(Io<T>::to_float(x[c])));
#pragma unroll
      for (int d = 16; d > 0; d >>= 1) peak = fmaxf(peak, __shfl_xor_sync(0xffffffffu, peak, d));
      int exponent;
      frexpf(peak, &exponent);  // peak = m * 2^exponent, m in [0.5, 1)
      const float scale = ldexpf(1.f, -exponent);
      float s = 0.f;
      for (i64 c = lane; c < K; c += 32) {
        const float v = Io<T>::to_float(x[c]) * scale;
        s = fmaf(v, v, s);
      }
#pragma unroll
      for (int d = 16; d > 0; d >>= 1) s += __shfl_xor_sync(0xffffffffu, s, d);
      rms = sqrtf(s) / sqrtf(width) / scale;
    }
    __syncwarp();
    if (lane == 0) sh_h[t * QP + Q] = rms;
  }
  __syncthreads();
}

// entry(0) + entry(1) + ... + entry(N-1) in index order (as on the host), begun from the first
// term rather than from 0.f: one dependent add fewer on a Sinkhorn step's chain (n = 4, the
// matrix in registers: a half-step 113 -> 100 cycles measured alone, a B1 decode call 12.0 ->
// 11.5 us; H100, the performance log, 2026-12-07). 0.f + x is x for every x but -0, so only
// the sign of a zero sum can change: -0 where every term is -0, which Sinkhorn entries (+0 or
// more) never are.
template <int N, typename Entry>
__device__ __forceinline__ float sum_in_order(Entry entry) {
  float s = entry(0);
#pragma unroll
  for (int k = 1; k < N; ++k) s += entry(k);
  return s;
}

// Whether eps keeps every Sinkhorn divisor in fast_reciprocal's range: each is a sum of
// entries within [0, 1] plus eps, so from eps = 2**-125 on (and below 2**124: n + eps then
// stays below 2**126, the range's top) the steps skip the check (one lane an entry, n = 4: a
// half-step 123 -> 95 cycles measured alone, the performance log, 2026-12-04).
__device__ __forceinline__ bool sinkhorn_fast(float eps) { return eps >= 0x1p-125f && eps < 0x1p124f; }

// 1 / divisor of a Sinkhorn step. A sum of non-negative entries plus eps is 0 only when every
// entry is 0 (eps = 0 and the exponentials underflowed): dividing by 1 keeps those zeros, not
// 0/0.
__device__ __forceinline__ float sinkhorn_inverse(bool fast, float divisor) {
  return fast ? fast_reciprocal(divisor) : 1.f / (divisor == 0.f ? 1.f : divisor);
}

// `repeat` Sinkhorn steps of one token's matrix held whole in registers: each half-step
// divides every row (then every column) by its sum in index order plus eps (as on the host),
// as a multiplication by the divisor's reciprocal (as in the backward's sinkhorn_step); a
// half-step's n reciprocals issue together.
template <int N>
__device__ __forceinline__ void sinkhorn_in_registers(float (&M)[N][N], int repeat, float eps, bool fast) {
  auto half_step = [&](auto reciprocal, bool rows) {
    float scale[N];
#pragma unroll
    for (int a = 0; a < N; ++a) {
      const float s = sum_in_order<N>([&](int b) { return rows ? M[a][b] : M[b][a]; });
      scale[a] = reciprocal(s + eps);
    }
#pragma unroll
    for (int r = 0; r < N; ++r)
#pragma unroll
      for (int k = 0; k < N; ++k) M[r][k] *= scale[rows ? r : k];
  };
  auto steps = [&](auto reciprocal) {
    for (int it = 0; it < repeat; ++it) {
      half_step(reciprocal, true);
      half_step(reciprocal, false);
    }
  };
  if (fast)
    steps([](float divisor) { return fast_reciprocal(divisor); });
  else
    steps([](float divisor) { return sinkhorn_inverse(false, divisor); });
}

// One token's logits and gates from its h row (h, then the RMS; see rows_rms) and b at `bias`,
// `stride` floats apart: the forward's expressions, in one place, so both coefficient layouts
// (tile_coefficients, token_coefficients) write the same bits.
template <int N>
struct TokenLogits {
  const float* h;
  float rms;
  const float* bias;
  i64 stride;
  __device__ __forceinline__ TokenLogits(const float* h_row, const float* b, i64 b_stride)
      : h(h_row), rms(h_row[Dims<N>::Q] + 1e-4f), bias(b), stride(b_stride) {}
  __device__ __forceinline__ float logit(float alpha, int j) const {
    return alpha * h[j] / rms + bias[j * stride];
  }
  __device__ __forceinline__ float pre(const PreParams& p, int i) const {
    return sigmoid(logit(p.alpha_pre, i));
  }
  __device__ __forceinline__ float post(const PreParams& p, int i) const {
    return 2.f * sigmoid(logit(p.alpha_post, N + i));
  }
  __device__ __forceinline__ float residual(const PreParams& p, int i, int k) const {
    return logit(p.alpha_res, 2 * N + i * N + k);
  }
};

// Gates and Sinkhorn matrix of `rows` tokens from sh_h [rows][Q+1] (h, then the RMS from
// rows_rms), into coef [rows][n + n*n] and, unless it is null, h_post [rows][n] (shared or
// global memory: the tokens' own rows of either), with b at `bias` (global memory, or a copy
// in shared memory made while the data loaded). A decode token's 20 Sinkhorn
// steps are pure latency. For n*n <= 32 one lane per entry forms the logits and
// exponentials, then every lane of the token gathers the whole matrix and runs the steps in
// registers (sinkhorn_in_registers), keeping its own entry: no shuffle round trip a
// half-step (one lane an entry with n shuffles a half-step measured 0.5-1.1 us more a call,
// H100, B1-B128 n4). Otherwise one lane per row (column sums by n*n shuffles), each division
// a multiplication by the divisor's reciprocal too. Not inlined: one compiled body for every
// caller.
template <int N>
__device__ __attribute__((noinline)) void tile_coefficients(const PreParams& p, const float* sh_h,
                                                             int rows, float* coef, float* h_post,
                                                             const float* bias, i64 bias_stride) {
  constexpr int QP = Dims<N>::QP, NC = Dims<N>::NC;
  constexpr bool PER_ENTRY = N * N <= 32;
  constexpr int LANES = PER_ENTRY ? N * N : N;  // lanes of one token
  constexpr int PER_WARP = 32 / LANES;
  constexpr int R = PER_ENTRY ? 1 : N;  // entries a lane holds: its own, or its row's m[k]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int slot = lane / LANES, e = lane - slot * LANES;
  const int group = slot * LANES;  // first lane of this token's group
  const int i = PER_ENTRY ? e / N : e, k0 = PER_ENTRY ? e - (e / N) * N : 0;
  const float eps = p.eps;
  const int repeat = p.repeat;
  const bool fast = sinkhorn_fast(eps);
  for (int t0 = warp * PER_WARP; t0 < rows; t0 += warps * PER_WARP) {  // warp-uniform
    const int t = t0 + slot;
    const bool active = slot < PER_WARP && t < rows;  // idle lanes shadow token t0
    const TokenLogits<N> token(sh_h + (active ? t : t0) * QP, bias, bias_stride);
    const float pre = token.pre(p, i);
    const float post = token.post(p, i);
    float m[R];
#pragma unroll
    for (int r = 0; r < R; ++r) m[r] = token.residual(p, i, k0 + r);
    // the row's max, then the exponentials
    float row_max = __uint_as_float(0xff800000u);  // -inf
    if constexpr (PER_ENTRY) {
#pragma unroll
      for (int k = 0; k < N; ++k)
        row_max = fmaxf(row_max, __shfl_sync(0xffffffffu, m[0], (group + i * N + k) & 31));
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) row_max = fmaxf(row_max, m[k]);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) m[r] = expf(m[r] - row_max);
    if constexpr (PER_ENTRY) {
      float M[N][N];
#pragma unroll
      for (int r = 0; r < N; ++r)
#pragma unroll
        for (int k = 0; k < N; ++k) M[r][k] = __shfl_sync(0xffffffffu, m[0], (group + r * N + k) & 31);
      sinkhorn_in_registers<N>(M, repeat, eps, fast);
#pragma unroll
      for (int r = 0; r < N; ++r)
#pragma unroll
        for (int k = 0; k < N; ++k)
          if (r == i && k == k0) m[0] = M[r][k];
    } else {
      for (int it = 0; it < repeat; ++it) {
        const float s = sum_in_order<N>([&](int k) { return m[k]; });
        const float row = sinkhorn_inverse(fast, s + eps);
#pragma unroll
        for (int k = 0; k < N; ++k) m[k] *= row;
        float col[N];
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const float c = sum_in_order<N>(
              [&](int src) { return __shfl_sync(0xffffffffu, m[k], (group + src) & 31); });
          col[k] = sinkhorn_inverse(fast, c + eps);
        }
#pragma unroll
        for (int k = 0; k < N; ++k) m[k] *= col[k];
      }
    }
    if (active) {
      float* dst = coef + t * NC;
      if (k0 == 0) {
        dst[i] = pre;
        if (h_post != nullptr) h_post[t * N + i] = post;
      }
#pragma unroll
      for (int r = 0; r < R; ++r) dst[N + i * N + k0 + r] = m[r];
    }
  }
}

// tile_coefficients of many tokens (mhc_coefficients, n*n <= 32): one thread a token, the
// same arithmetic in the same order (the same bits). There every lane of a token runs its
// whole chain anyway, so n*n lanes a token issued n*n copies of every Sinkhorn step: at 4096
// tokens and more the multiprocessors' issue slots, not the chain's latency, set the time.
template <int N>
__device__ __forceinline__ void token_coefficients(const PreParams& p, const float* sh_h, int rows,
                                                   float* coef, float* h_post, const float* bias,
                                                   i64 bias_stride) {
  constexpr int QP = Dims<N>::QP, NC = Dims<N>::NC;
  const bool fast = sinkhorn_fast(p.eps);
  for (int t = threadIdx.x; t < rows; t += blockDim.x) {
    const TokenLogits<N> token(sh_h + t * QP, bias, bias_stride);
    float M[N][N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      float row_max = __uint_as_float(0xff800000u);  // -inf
#pragma unroll
      for (int k = 0; k < N; ++k) {
        M[i][k] = token.residual(p, i, k);
        row_max = fmaxf(row_max, M[i][k]);
      }
#pragma unroll
      for (int k = 0; k < N; ++k) M[i][k] = expf(M[i][k] - row_max);
    }
    float* dst = coef + t * NC;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      dst[i] = token.pre(p, i);
      if (h_post != nullptr) h_post[t * N + i] = token.post(p, i);
    }
    sinkhorn_in_registers<N>(M, p.repeat, p.eps, fast);
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int k = 0; k < N; ++k) dst[N + i * N + k] = M[i][k];
  }
}

// The coefficients of rows row0 .. row0+rows-1 from mhc_project's partials: summed, the
// RMS, then the gates and Sinkhorn matrix. Every thread of the block calls it.
// b is read at `bias`, `bias_stride` floats apart (p.bias, or a copy in shared memory).
// ROUND: sum_partials'; PER_TOKEN: token_coefficients instead of tile_coefficients.
template <typename T, int N, int ROUND = 1, bool PER_TOKEN = false>
__device__ __forceinline__ void partials_to_coefficients(const PreParams& p, i64 row0, int rows,
                                                         float* sh_h, float* sh_scratch,
                                                         const float* bias, i64 bias_stride) {
  sum_partials<N, ROUND>(p, row0, rows, sh_h, sh_scratch);
  rows_rms<T, N>(p, sh_h, row0, rows);
  float* const coef = p.coef + row0 * Dims<N>::NC;
  if constexpr (PER_TOKEN)
    token_coefficients<N>(p, sh_h, rows, coef, p.h_post + row0 * N, bias, bias_stride);
  else
    tile_coefficients<N>(p, sh_h, rows, coef, p.h_post + row0 * N, bias, bias_stride);
}

// 8 consecutive elements in their storage format: one 16-byte word for 16-bit types, two
// for float.
template <typename T>
struct Raw8 {
  U4 w[sizeof(typename Io<T>::elem) == 2 ? 1 : 2];
};

template <typename T>
__device__ __forceinline__ void load_raw8(const typename Io<T>::elem* p, bool vector, int count,
                                          Raw8<T>& r) {
  typedef typename Io<T>::elem E;
  constexpr int WORDS = sizeof(E) == 2 ? 1 : 2;
  if (vector) {
#pragma unroll
    for (int h = 0; h < WORDS; ++h) r.w[h] = load_stream16(p + h * (16 / sizeof(E)));
  } else {
    E e[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = i < count ? p[i] : E{};
    if constexpr (sizeof(E) == 2) {
      r.w[0] = U4{e[0] | ((u32)e[1] << 16), e[2] | ((u32)e[3] << 16), e[4] | ((u32)e[5] << 16),
                  e[6] | ((u32)e[7] << 16)};
    } else {
      r.w[0] = U4{__float_as_uint(e[0]), __float_as_uint(e[1]), __float_as_uint(e[2]),
                  __float_as_uint(e[3])};
      r.w[1] = U4{__float_as_uint(e[4]), __float_as_uint(e[5]), __float_as_uint(e[6]),
                  __float_as_uint(e[7])};
    }
  }
}

template <typename T>
__device__ __forceinline__ void unpack8(const Raw8<T>& r, float (&v)[8]) {
  if constexpr (sizeof(typename Io<T>::elem) == 2) {
    const u32 words[4] = {r.w[0].x, r.w[0].y, r.w[0].z, r.w[0].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = word_low<T>(words[i]);
      v[2 * i + 1] = word_high<T>(words[i]);
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      v[4 * h] = __uint_as_float(r.w[h].x);
      v[4 * h + 1] = __uint_as_float(r.w[h].y);
      v[4 * h + 2] = __uint_as_float(r.w[h].z);
      v[4 * h + 3] = __uint_as_float(r.w[h].w);
    }
  }
}

// 8 consecutive elements as floats. p is 16-byte aligned.
template <typename T>
__device__ __forceinline__ void load8(const typename Io<T>::elem* p, float (&v)[8]) {
  Raw8<T> r;
  load_raw8<T>(p, true, 8, r);
  unpack8<T>(r, v);
}

// x of 8 columns (c0 .. c0+7) of one token in all N streams, in its raw format: what
// mix_unit turns into x_layer and x_res.
template <typename T, int N>
__device__ __forceinline__ void load_unit(const PreParams& p, i64 row, i64 c0, Raw8<T> (&raw)[N]) {
  typedef typename Io<T>::elem E;
  const E* x = (const E*)p.x + row * p.x_stride + c0;
  const int count = p.c_x - c0 < 8 ? (int)(p.c_x - c0) : 8;
#pragma unroll
  for (int k = 0; k < N; ++k) load_raw8<T>(x + k * p.c_x, p.vector_io, count, raw[k]);
}

// x_layer and x_res for 8 columns (c0 .. c0+7) of one token from its x (load_unit) and its
// coefficients at coef (h_pre then M). x is held in its raw format and widened per use, and
// the weights are read as they are needed: few registers, so many threads keep loads in
// flight. `coherent`: the coefficients were written by this very launch, so they bypass L1.
template <typename T, int N, bool coherent>
__device__ __forceinline__ void mix_unit(const PreParams& p, i64 row, i64 c0, const Raw8<T> (&raw)[N],
                                         const float* coef) {
  typedef typename Io<T>::elem E;
  const int count = p.c_x - c0 < 8 ? (int)(p.c_x - c0) : 8;
  E* layer = (E*)p.x_layer + row * p.c_x + c0;
  E* res = (E*)p.x_res + row * (N * p.c_x) + c0;
  // coherent: all the weights loaded at once (one round trip; the loads are volatile, so
  // loading each where it is used would wait for them one by one)
  float weights[coherent ? Dims<N>::NC : 1];
  if (coherent) {
#pragma unroll
    for (int j = 0; j < Dims<N>::NC; ++j) weights[j] = load_cg(coef + j);
  }
#pragma unroll
  for (int i = 0; i <= N; ++i) {  // i == 0: x_layer with h_pre; i > 0: x_res stream i-1 with M
    const int w = i == 0 ? 0 : N + (i - 1) * N;
    E* out = i == 0 ? layer : res + (i - 1) * p.c_x;
    float o[8];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float wk = coherent ? weights[w + k] : coef[w + k];
      float v[8];
      unpack8<T>(raw[k], v);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] = k == 0 ? wk * v[e] : fmaf(wk, v[e], o[e]);
    }
    if (p.vector_io)
      store8<T>(out, o);
    else
      store_some<T>(out, count, o);
  }
}

template <typename T, int N, bool coherent>
__device__ __forceinline__ void apply_unit(const PreParams& p, i64 row, i64 c0, const float* coef) {
  Raw8<T> raw[N];
  load_unit<T, N>(p, row, c0, raw);
  mix_unit<T, N, coherent>(p, row, c0, raw, coef);
}

// ------------------------------------------------------------------ projection

// The 16x16 A fragment at (row, col) of a row-major tile of x (PITCH elements a row), split
// into Io<T>::x_pieces exact bf16 pieces: a0 (g, k), a1 (g+8, k), a2 (g, k+8), a3 (g+8, k+8).
// SUMSQ: adds the squares of its 8 elements to sumsq[0] (token g) and sumsq[1] (token g+8).
// The projection here and the backward's first pass (mhc_backward.cu) share it.
template <typename T, int PITCH, bool SUMSQ>
__device__ __forceinline__ void x_fragment(const typename Io<T>::elem* stage, int row, int col,
                                           u32 (&a)[Io<T>::x_pieces][4], float (&sumsq)[2]) {
  constexpr int XP = Io<T>::x_pieces;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const typename Io<T>::elem* src = stage + (row + (r & 1) * 8) * PITCH + col + (r >> 1) * 8;
    float f0 = 0.f, f1 = 0.f;
    if constexpr (XP == 1) {
      const u32 w = *(const u32*)src;
      a[0][r] = w;
      if constexpr (SUMSQ) {
        f0 = word_low<T>(w);
        f1 = word_high<T>(w);
      }
    } else {
      if constexpr (sizeof(typename Io<T>::elem) == 2) {
        const u32 w = *(const u32*)src;
        f0 = word_low<T>(w);
        f1 = word_high<T>(w);
      } else {
        const U2 w = *(const U2*)src;
        f0 = __uint_as_float(w.x);
        f1 = __uint_as_float(w.y);
      }
      u32 p0[XP], p1[XP];
      split_bf16<XP>(f0, p0);
      split_bf16<XP>(f1, p1);
#pragma unroll
      for (int i = 0; i < XP; ++i) a[i][r] = p0[i] | (p1[i] << 16);
    }
    if constexpr (SUMSQ) {
      sumsq[r & 1] = fmaf(f0, f0, sumsq[r & 1]);
      sumsq[r & 1] = fmaf(f1, f1, sumsq[r & 1]);
    }
  }
}

// acc[mt][nt] += (x @ phi) of k-step ks for two m-tiles of 16 tokens (rows row, row + 16 of
// the x tile; the thread's column pair 2*tg) on the bf16 tensor cores: x's pieces times phi's
// three pieces (frag: build_piece_slot's layout), leaving out the products below float32's
// precision (xp + piece > 2). SUMSQ: x_fragment's squares into sumsq[mt]. The projection here
// and the backward's first pass share it.
template <typename T, int NT, int PITCH, bool SUMSQ>
__device__ __forceinline__ void mma_x_phi(const typename Io<T>::elem* stage, const U2* frag, int row, int ks,
                                          int tg, int lane, float (&acc)[2][NT][4], float (&sumsq)[2][2]) {
  constexpr int XP = Io<T>::x_pieces;
  u32 a[2][XP][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
    x_fragment<T, PITCH, SUMSQ>(stage, row + mt * 16, ks * 16 + 2 * tg, a[mt], sumsq[mt]);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int piece = 0; piece < 3; ++piece) {
      const U2 bw = frag[((ks * NT + nt) * 3 + piece) * 32 + lane];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int xp = 0; xp < XP; ++xp)
          if (xp + piece <= 2) mma_bf16_16816(acc[mt][nt], a[mt][xp], bw);
    }
  }
}

// One slot of B fragments, each phi value split into three bf16 pieces, from phi_at(kk, q)
// (kk within the K block; 0 outside phi). Slot = (kstep, n-tile, lane, half): two consecutive
// K rows of one h column. Layout: [kstep][n-tile NT][piece 3][lane 32] x (b0, b1), one 8-byte
// load per mma. The backward's mhc_bwd_pieces builds its fragments with it too.
// (kk, q): where a slot's phi values lie, rows kk and kk + 1 of column q.
template <int NT>
__device__ __forceinline__ void piece_slot_position(int slot, int& kk, int& q) {
  const int half = slot & 1, lane = (slot >> 1) & 31, rest = slot >> 6;
  q = rest % NT * 8 + (lane >> 2);
  kk = rest / NT * 16 + half * 8 + 2 * (lane & 3);
}

// A slot's two phi values (rows kk and kk + 1), split and stored.
template <int NT>
__device__ __forceinline__ void store_piece_slot(u32* pieces, int slot, float first, float second) {
  const int half = slot & 1, lane = (slot >> 1) & 31, rest = slot >> 6;
  const int nt = rest % NT, ks = rest / NT;
  u32 lo[3], hi[3];
  split_bf16<3>(first, lo);
  split_bf16<3>(second, hi);
#pragma unroll
  for (int piece = 0; piece < 3; ++piece)
    pieces[(((ks * NT + nt) * 3 + piece) * 32 + lane) * 2 + half] = lo[piece] | (hi[piece] << 16);
}

template <int NT, typename PhiAt>
__device__ __forceinline__ void build_piece_slot(u32* pieces, int slot, PhiAt phi_at) {
  int kk, q;
  piece_slot_position<NT>(slot, kk, q);
  store_piece_slot<NT>(pieces, slot, phi_at(kk, q), phi_at(kk + 1, q));
}

template <int N>
__host__ __device__ constexpr int piece_words() {
  return 4 * Dims<N>::NT * 3 * 32 * 2;  // u32 words of one K block's B fragments
}

// The B fragments of BLOCKS K blocks from k0 (a multiple of BLOCK_K), split from phi itself,
// one K block after another at dst (load_pieces_stage's layout): NT slots per thread a K
// block, every phi value loaded before any is stored (one round trip for the run).
template <int N, int BLOCKS>
__device__ __forceinline__ void split_phi(const PreParams& p, u32* dst, i64 k0) {
  constexpr int Q = Dims<N>::Q, NT = Dims<N>::NT;
  const i64 K = N * p.c_x;
  float first[BLOCKS][NT], second[BLOCKS][NT];
#pragma unroll
  for (int blk = 0; blk < BLOCKS; ++blk)
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      int kk, q;
      piece_slot_position<NT>(i * PROJECT_THREADS + threadIdx.x, kk, q);
      const i64 k = k0 + blk * BLOCK_K + kk;
      const float* at = p.phi + k * p.phi_stride_k + q * p.phi_stride_q;
      first[blk][i] = k < K && q < Q ? at[0] : 0.f;
      second[blk][i] = k + 1 < K && q < Q ? at[p.phi_stride_k] : 0.f;
    }
#pragma unroll
  for (int blk = 0; blk < BLOCKS; ++blk)
#pragma unroll
    for (int i = 0; i < NT; ++i)
      store_piece_slot<NT>(dst + blk * piece_words<N>(), i * PROJECT_THREADS + threadIdx.x,
                           first[blk][i], second[blk][i]);
}

// phi as B fragments, once per call, one K block per block: every mhc_project block then
// streams them instead of splitting phi again for each tile. K ranges are whole K blocks,
// so a block's fragments never mix two ranges. (Not launched for a fused mhc_project, whose
// blocks split their own K ranges' fragments.)
// It also zeroes the counters: it runs first on the stream, so mhc_project finds them at
// zero, and the scratch can be fresh memory from the caller's allocator on every call (what
// CUDA-graph capture and concurrent streams need).
template <int N>
__global__ void __launch_bounds__(PROJECT_THREADS) mhc_phi_pieces(const PreParams p) {
  launch_dependents();  // mhc_project's blocks may start and load x
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < COUNTER_GROUPS; i += blockDim.x) p.counter[i] = 0u;
  }
  split_phi<N, 1>(p, p.pieces + (i64)blockIdx.x * piece_words<N>(), (i64)blockIdx.x * BLOCK_K);
}

// The B fragments of STAGE_K columns of K from k0 (consecutive K blocks: one run, laid out
// k-step after k-step as one block of STAGE_K / 16 k-steps) into a shared-memory stage.
template <int N, int STAGE_K>
__device__ __forceinline__ void load_pieces_stage(const PreParams& p, u32* dst, i64 k0) {
  constexpr int WORDS = STAGE_K / BLOCK_K * piece_words<N>();
  const u32* src = p.pieces + (k0 / BLOCK_K) * piece_words<N>();
  for (int c = threadIdx.x; c < WORDS / 4; c += PROJECT_THREADS)
    cp_async16_kept_in_l2(dst + 4 * c, src + 4 * c);
}

// One thread's share of every x stage of a tile (STAGE_K columns of TILE_ROWS rows, rows
// PITCH elements apart): the same 16-byte segment column of SLOTS rows r, r + ROW_STEP, ...
// in each stage, so a stage only adds its K offset (the address arithmetic, not the copies,
// was most of the K loop's instructions). A segment past the batch or the K range is
// zero-filled by the copy itself. Rows of x that are not 16-byte vectors (vector_io 0) go
// element by element.
template <typename T, int STAGE_K, int PITCH>
struct XStageLoader {
  typedef typename Io<T>::elem E;
  static constexpr int PER_SEG = 16 / sizeof(E), SEGS = STAGE_K / PER_SEG;
  static constexpr int ROW_STEP = PROJECT_THREADS / SEGS, SLOTS = TILE_ROWS / ROW_STEP;
  static_assert(PROJECT_THREADS % SEGS == 0 && TILE_ROWS % ROW_STEP == 0, "whole slots");
  const E* x;      // x itself: the valid address a zero-filling copy names
  const E* first;  // slot 0's segment at K offset 0
  i64 row_step;    // elements from one slot's row to the next
  int dst, seg_k;  // slot 0's element offset in a stage; the segment's K offset
  u32 live;        // bit i: slot i's row is inside the batch

  __device__ __forceinline__ XStageLoader(const PreParams& p, i64 row0) {
    const int r = threadIdx.x / SEGS;
    seg_k = threadIdx.x % SEGS * PER_SEG;
    x = (const E*)p.x;
    first = x + (row0 + r) * p.x_stride + seg_k;
    row_step = ROW_STEP * p.x_stride;
    dst = r * PITCH + seg_k;
    live = 0u;
#pragma unroll
    for (int i = 0; i < SLOTS; ++i) live |= (row0 + r + i * ROW_STEP < p.batch ? 1u : 0u) << i;
  }

  __device__ __forceinline__ void load(const PreParams& p, E* stage, i64 row0, i64 k0, i64 k_end) const {
    if (p.vector_io) {
      const bool in_range = k0 + seg_k < k_end;
#pragma unroll
      for (int i = 0; i < SLOTS; ++i) {
        const bool copy = in_range && (live >> i & 1u);
        cp_async16_fill(stage + dst + i * ROW_STEP * PITCH, copy ? first + i * row_step + k0 : x,
                        copy ? 16 : 0);
      }
      return;
    }
    for (int s = threadIdx.x; s < TILE_ROWS * STAGE_K; s += PROJECT_THREADS) {
      const int r = s / STAGE_K, c = s % STAGE_K;
      const i64 row = row0 + r;
      if (row >= p.batch) continue;  // stays zero from the kernel's start
      const i64 k = k0 + c;
      stage[r * PITCH + c] = k < k_end ? x[row * p.x_stride + k] : E{};
    }
  }
};

// Spins (one thread) until *word >= target, with acquire ordering. Bounded: a block that never
// arrives would otherwise hang the device; after ~2 s it traps.
__device__ __forceinline__ void wait_until_at_least(const unsigned int* word, unsigned int target) {
  for (unsigned int spins = 0; load_acquire(word) < target; ++spins) {
    if (spins > (1u << 24)) __trap();
    asm volatile("nanosleep.u32 64;");
  }
}

// Every block of a cooperative launch adds itself to `count` and waits here until it reaches
// `arrivals` (gridDim.x for a counter used once; k * gridDim.x at its k-th use).
__device__ __forceinline__ void grid_barrier(unsigned int* count, unsigned int arrivals) {
  __threadfence();  // this thread's writes are visible device-wide before the count moves
  __syncthreads();
  if (threadIdx.x == 0) {
    atomicAdd(count, 1u);
    wait_until_at_least(count, arrivals);
  }
  __syncthreads();
}

// Dynamic shared memory of mhc_project<T, N, STAGE_K, STAGES>: STAGES stages of x (TILE_ROWS
// rows of STAGE_K elements, 8 of padding each), then STAGES stages of phi's B fragments.
// (tileops_cupy._mhc._project_smem asks for as much at launch; tests/test_nvrtc.py holds the
// two equal for every compiled pipeline.)
template <typename T, int N, int STAGE_K, int STAGES>
__host__ __device__ constexpr int project_smem_bytes() {
  return STAGES * (TILE_ROWS * (STAGE_K + 8) * (int)sizeof(typename Io<T>::elem) +
                   STAGE_K / BLOCK_K * piece_words<N>() * 4);
}

// Grid: (batch tiles of 128 tokens) x k_splits blocks; block b takes tile b / k_splits and
// K range [split * k_range, (split+1) * k_range), a multiple of STAGE_K. Warp w: tokens
// 32*(w%4) .. +32 (two mma m-tiles) and the k-steps of half w/4 of every stage.
// FUSED: the whole of mHC pre in one cooperative launch (the file's header), an
// instantiation of its own so that the large-batch kernels carry none of its code (behind a
// run-time flag it cost them 20-24 more bytes of spills).
// The pipeline: STAGES stages of STAGE_K columns (BLOCK_K or 2*BLOCK_K: a row's run of x a
// stage, 128 or 256 bytes for 16-bit x; DRAM serves longer runs faster). Shared memory:
// project_smem_bytes' layout.
template <typename T, int N, int STAGE_K, int STAGES, bool FUSED = false>
// Two blocks per multiprocessor where the registers allow (bf16 x, n <= 4) and shared memory
// does (stages of at most 256 columns in all): twice the warps to hide the pipeline's
// latencies. One block elsewhere, with the registers of one: (128, 3), which shared memory
// holds once a multiprocessor, spilled 8 bytes at the two-block bound and ran slower (H200,
// bf16 n4, us: B4096 c_x4096 145.8 -> 143.0, B16384 c_x7168 877.7 -> 845.2 at one block's).
// FUSED: one block, whose registers hold its phi splits and coefficient chains unspilled
// (at the two-block bound it spilled 40 bytes; few blocks are what a small batch needs).
__global__ void __launch_bounds__(PROJECT_THREADS, !FUSED && N <= 4 && Io<T>::x_pieces == 1 &&
                                                           STAGE_K * STAGES <= 256 ? 2 : 1)
    mhc_project(const PreParams p) {
  static_assert(STAGE_K % BLOCK_K == 0 && STAGES >= 2, "whole fragment blocks, a pipeline");
  typedef typename Io<T>::elem E;
  constexpr int Q = Dims<N>::Q, QP = Dims<N>::QP, NT = Dims<N>::NT, NC = Dims<N>::NC;
  // 8 elements (16 or 32 bytes) of padding a row put the 8 rows of a fragment load in
  // distinct banks
  constexpr int PITCH = STAGE_K + 8;
  constexpr int STEPS = STAGE_K / 16;               // mma k-steps a stage
  constexpr int X_STAGE = TILE_ROWS * PITCH;        // elements
  constexpr int X_BYTES = STAGES * X_STAGE * (int)sizeof(E);
  constexpr int PIECES = STAGE_K / BLOCK_K * piece_words<N>();  // u32 words a stage
  static_assert(X_BYTES + STAGES * PIECES * 4 == project_smem_bytes<T, N, STAGE_K, STAGES>(),
                "the layout below is project_smem_bytes'");
  extern __shared__ U4 dynamic_smem[];
  __shared__ float sh_scratch[PROJECT_THREADS];
  __shared__ float sbias[Q];  // fused: b, copied while the first stages load

  unsigned char* smem = (unsigned char*)dynamic_smem;
  E* x_stages = (E*)smem;
  u32* piece_stages = (u32*)(smem + X_BYTES);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tg = lane & 3;
  const int row_group = warp & 3, k_half = warp >> 2;
  const i64 tile = blockIdx.x / p.k_splits, split = blockIdx.x % p.k_splits;
  const i64 row0 = tile * TILE_ROWS;
  const i64 K = N * p.c_x;
  const i64 k_begin = split * p.k_range;
  const i64 k_end = k_begin + p.k_range < K ? k_begin + p.k_range : K;
  const int blocks = (int)((k_end - k_begin + STAGE_K - 1) / STAGE_K);  // stages to stream

  if (!p.vector_io) {  // element rows past the batch are never loaded: they must read as zeros
    for (int i = tid; i < X_BYTES / 16; i += PROJECT_THREADS) dynamic_smem[i] = U4{0u, 0u, 0u, 0u};
    __syncthreads();  // the zeros land before the first stage's stores into the same rows
  }

  const XStageLoader<T, STAGE_K, PITCH> x_loader(p, row0);
  auto load_x = [&](int blk) {
    x_loader.load(p, x_stages + blk % STAGES * X_STAGE, row0, k_begin + (i64)blk * STAGE_K, k_end);
  };
  // mhc_phi_pieces' fragments, or (fused: one launch a call) the block's own, split from phi
  // while its x is in flight
  auto load_pieces = [&](int blk) {
    u32* stage = piece_stages + blk % STAGES * PIECES;
    const i64 k0 = k_begin + (i64)blk * STAGE_K;
    if constexpr (FUSED)
      split_phi<N, STAGE_K / BLOCK_K>(p, stage, k0);
    else
      load_pieces_stage<N, STAGE_K>(p, stage, k0);
  };
  // The first stages' x, then mhc_phi_pieces' fragments (and counters) once it is done (the
  // first commit group so holds every first stage's x: a stage is still whole when waited).
  // Fused, the first stages' fragments are split in one run where a thread's share fits its
  // registers (the stages lie end to end; n <= 4), else stage by stage; b is copied beside.
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < blocks) load_x(s);
  if constexpr (FUSED) {
    if (tid < Q) cp_async4(sbias + tid, p.bias + tid * p.bias_stride);
    constexpr int RUN = NT * (STAGES - 1) * STAGE_K / BLOCK_K <= 12 ? STAGES - 1 : 1;
    for (int s = 0; s < STAGES - 1; s += RUN)
      split_phi<N, RUN * STAGE_K / BLOCK_K>(p, piece_stages + s * PIECES, k_begin + (i64)s * STAGE_K);
  }
  wait_for_prerequisites();
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < blocks && !FUSED) load_pieces(s);
    cp_async_commit();
  }

  float acc[2][NT][4];
  float sumsq[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    sumsq[mt][0] = sumsq[mt][1] = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
  }

  for (int b = 0; b < blocks; ++b) {
    cp_async_wait_all_but(STAGES - 2);
    __syncthreads();  // block b's stage is in; every warp is done with block b-1
    if (b + STAGES - 1 < blocks) {  // into the stage b-1 used
      load_x(b + STAGES - 1);
      load_pieces(b + STAGES - 1);
    }
    cp_async_commit();
    const U2* frag = (const U2*)(piece_stages + (b % STAGES) * PIECES);
    const E* stage = x_stages + (b % STAGES) * X_STAGE;
#pragma unroll
    for (int kq = 0; kq < STEPS / 2; ++kq) {
      const int ks = k_half * (STEPS / 2) + kq;
      mma_x_phi<T, NT, PITCH, true>(stage, frag, row_group * 32 + g, ks, tg, lane, acc, sumsq);
    }
  }

  // The two k halves of each token group meet in shared memory (the x stages are free now).
  cp_async_wait_all_but(0);
  __syncthreads();
  constexpr int RED_WORDS = 2 * NT * 4 + 4;
  float* red = (float*)smem + (row_group * 32 + lane) * RED_WORDS;
  if (k_half == 1) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[(mt * NT + nt) * 4 + e] = acc[mt][nt][e];
      red[2 * NT * 4 + mt * 2] = sumsq[mt][0];
      red[2 * NT * 4 + mt * 2 + 1] = sumsq[mt][1];
    }
  }
  __syncthreads();
  if (k_half == 0) {
    float* out = p.partial + split * p.batch * QP;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float s = sumsq[mt][h] + red[2 * NT * 4 + mt * 2 + h];
        s += __shfl_xor_sync(0xffffffffu, s, 1);  // the 4 lanes of a quad hold one token
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        const i64 row = row0 + row_group * 32 + mt * 16 + g + 8 * h;
        if (row < p.batch) {
          float* dst = out + row * QP;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int q = nt * 8 + 2 * tg + e;
              if (q < Q) dst[q] = acc[mt][nt][2 * h + e] + red[(mt * NT + nt) * 4 + 2 * h + e];
            }
          if (tg == 0) dst[Q] = s;
        }
      }
    }
  }
  if constexpr (!FUSED) return;  // mhc_coefficients takes it from here

  // Small batch, every block co-resident (cooperative launch): once all partials are in,
  // block j computes the coefficients of its run of consecutive rows, all at once (one
  // Sinkhorn chain a token, side by side: a block taking its rows one after another paid a
  // chain per row); once those are all published, every thread of the grid applies them to
  // its share of (row, 8 columns). The last block out zeroes the counters: the scratch is
  // the stream's workspace (_mhc), where the next launch finds them zeroed.
  float* sh_h = (float*)smem;  // free: every thread is past the barrier's __syncthreads
  grid_barrier(&p.counter[0], gridDim.x);
  const i64 run = (p.batch + gridDim.x - 1) / gridDim.x, first = blockIdx.x * run;
  if (first < p.batch)  // (block-uniform)
    partials_to_coefficients<T, N>(p, first, (int)(p.batch - first < run ? p.batch - first : run),
                                   sh_h, sh_scratch, sbias, 1);
  grid_barrier(&p.counter[1], gridDim.x);
  const i64 units = (p.c_x + 7) / 8;
  for (i64 item = (i64)blockIdx.x * PROJECT_THREADS + tid; item < p.batch * units;
       item += (i64)gridDim.x * PROJECT_THREADS) {
    const i64 row = item / units, u = item - row * units;
    apply_unit<T, N, true>(p, row, u * 8, p.coef + row * NC);
  }
  __syncthreads();  // (every thread of the block is past both barriers)
  if (tid == 0 && atomicAdd(&p.counter[2], 1u) == gridDim.x - 1)
    p.counter[0] = p.counter[1] = p.counter[2] = 0u;
}

// The coefficients of COEF_ROWS tokens from mhc_project's partials, every token's Sinkhorn
// chain at once. They are a chain of latencies, not work: the last block of each projection
// tile used to take its 128 tokens alone, eight rounds of 16 chains on 8 warps while the
// rest of the device idled (H200, B4096 n4 c_x4096: projection 109 us, now 69 us and this
// kernel 12 us). PER_TOKEN (n <= 5, the plan's largest batches): COEF_TOKEN_ROWS tokens a
// block, one thread a token (token_coefficients), where n*n lanes a token issue n*n copies of
// each chain and fill the issue slots. H100, bf16 n4, this kernel's device time, n*n lanes ->
// one thread: B4096 c_x4096 12.8 -> 9.3 us, B8192 22.0 -> 11.4, B16384 c_x7168 35.8 -> 19.7,
// n2 B4096 8.2 -> 5.7; but B512 10.4 -> 13.6, B1024 c_x7168 9.3 -> 10.9, B300 9.1 -> 12.2
// (where the slots are free, half as many blocks, each token's logits and exponentials one
// thread's, take longer: not profiled).
template <typename T, int N, bool PER_TOKEN = false>
__global__ void __launch_bounds__(PROJECT_THREADS) mhc_coefficients(const PreParams p) {
  static_assert(!PER_TOKEN || N * N <= 32, "one thread a token holds its whole matrix");
  constexpr int QP = Dims<N>::QP;
  constexpr int ROWS = PER_TOKEN ? COEF_TOKEN_ROWS : COEF_ROWS;
  // PER_TOKEN: a thread's (row, column) sums of the block's partials, up to 4 (registers), in
  // flight at once (32 rows of 25 sums at n = 4: 800 for 256 threads, one round trip)
  constexpr int PAIRS = (ROWS * QP + PROJECT_THREADS - 1) / PROJECT_THREADS;
  constexpr int ROUND = !PER_TOKEN ? 1 : PAIRS < 4 ? PAIRS : 4;
  __shared__ float sh_h[ROWS * QP];
  __shared__ float sh_scratch[PROJECT_THREADS];
  wait_for_prerequisites();  // mhc_project's partials
  launch_dependents();       // mhc_apply's blocks may start and load x
  const i64 row0 = (i64)blockIdx.x * ROWS;
  const int rows = p.batch - row0 < ROWS ? (int)(p.batch - row0) : ROWS;
  partials_to_coefficients<T, N, ROUND, PER_TOKEN>(p, row0, rows, sh_h, sh_scratch, p.bias,
                                                   p.bias_stride);
}

// One thread per 8 columns of a row, last rows first: mhc_project streamed x in increasing
// token order, so the lines of the last tiles are the likeliest still in L2.
template <typename T, int N>
__global__ void __launch_bounds__(APPLY_THREADS) mhc_apply(const PreParams p) {
  const i64 units = (p.c_x + 7) / 8;
  const unsigned long long item = (unsigned long long)blockIdx.x * APPLY_THREADS + threadIdx.x;
  if (item >= (unsigned long long)(p.batch * units)) return;
  // the host keeps batch * units below 2**32, so the division is 32-bit
  const u32 r = (u32)item / (u32)units;
  const i64 u = (i64)item - (i64)r * units;
  const i64 row = p.batch - 1 - r;
  Raw8<T> raw[N];
  load_unit<T, N>(p, row, u * 8, raw);  // x is the caller's: in flight before the wait
  wait_for_prerequisites();             // mhc_coefficients' coefficients
  mix_unit<T, N, false>(p, row, u * 8, raw, p.coef + row * Dims<N>::NC);
}

// ------------------------------------------------------------------ pre, small batches

// Small batches (decode) run the whole of mHC pre in one ordinary launch (mhc_pre_small):
// no phi fragments, no cooperative launch, no grid barrier. Each block takes a ticket (an
// atomic counter) and its role from it, so a block that waits on others only waits on
// lower tickets, which are resident or done: progress needs no co-residency.
//   tickets [0, groups * k_splits)  projection: group g = ticket / k_splits (SMALL_ROWS
//       tokens), K range ticket % k_splits: h = x @ phi and sum(x*x) in float32 on the CUDA
//       cores, into slice `split` of partial. The partials are summed in a fixed order
//       (deterministic): by the group's last block to finish, in one pass, where the
//       group's sums are narrow enough for one pass to take every split (sum_slices_reach:
//       decode, a few tokens); else by a two-level tree: the last block of each
//       SMALL_FAN_IN splits to finish sums theirs into slice k_splits + (split /
//       SMALL_FAN_IN), and the last of those sums them. That block computes the group's
//       gates, Sinkhorn matrices and h_post (the large-batch path's routines), then raises
//       the group's flag. Each sum has every thread's loads in flight at once (16-byte
//       loads): a reduction is one round trip, and a level fewer is one fewer wait.
//   later tickets  mix: one thread per 8 columns of a row, as mhc_apply; x is loaded before
//       waiting on the flags of the groups its rows belong to.
// The last block to finish zeroes the counters, so the next launch on the stream finds them
// zeroed: the scratch is a per-stream workspace that persists between calls (_mhc).
// partial: slices of batch * (Q+1) floats rounded up to 4 (16-byte aligned), each a
// [batch, Q+1] of sums. Counters: [0] tickets, [1] blocks finished, then SMALL_FAN_IN + 2
// per group g at COUNTER_GROUPS + g * (SMALL_FAN_IN + 2): the splits finished of each
// SMALL_FAN_IN (one level: the first counts every split), the fan-in sums finished, the flag.
template <typename T, int N>
struct Small {
  typedef typename Io<T>::elem E;
  static constexpr int Q = Dims<N>::Q;
  static constexpr int ROUNDS = (Q + 31) / 32;                      // lane = h column (mod 32)
  static constexpr int X_PITCH = SMALL_CHUNK + 16 / (int)sizeof(E);  // 16-byte aligned rows
  static constexpr int X_WORDS = SMALL_ROWS * X_PITCH * (int)sizeof(E) / 4;
  static constexpr int PHI_WORDS = (SMALL_CHUNK * Q + 3) / 4 * 4;  // [SMALL_CHUNK][Q] packed
  static constexpr int STAGE_WORDS = X_WORDS + PHI_WORDS;
  static constexpr int FIT = 43 * 1024 / (4 * STAGE_WORDS);  // stages in 43 KB of static smem
  static constexpr int PIPELINE = FIT > 3 ? 3 : FIT;  // (five measured no faster)
  static constexpr int SMEM_WORDS = PIPELINE * STAGE_WORDS;
  static_assert(PIPELINE >= 2, "two pipeline stages must fit");
  static_assert(SMEM_WORDS >= SMALL_ROWS * Dims<N>::QP + 3, "sh_h reuses the stages");
  static_assert(SMEM_WORDS >= 8 * ROUNDS * 32, "the k-split reduction reuses the stages");
};
static_assert(SMALL_ROWS == 32 && SMALL_CHUNK == 32 && PROJECT_THREADS == 256,
              "mhc_pre_small's layout: 8 threads of 4 columns per row, 8 warps");

// One chunk of SMALL_CHUNK K elements of the group's rows (raw, zero past k_end) and of phi
// (float32 [SMALL_CHUNK][Q], zero past k_end) into a stage, asynchronously.
template <typename T, int N>
__device__ __forceinline__ void small_stage(const PreParams& p, u32* stage, i64 row0, int rows,
                                            i64 k0, i64 k_end) {
  typedef Small<T, N> S;
  typedef typename S::E E;
  constexpr int Q = S::Q;
  const E* x = (const E*)p.x;
  E* xs = (E*)stage;
  float* phis = (float*)(stage + S::X_WORDS);
  if (p.vector_io) {  // k_end is a multiple of 8: a 16-byte segment is wholly in or out
    constexpr int PER_SEG = 16 / sizeof(E), SEGS = SMALL_CHUNK / PER_SEG;
    for (int s = threadIdx.x; s < rows * SEGS; s += PROJECT_THREADS) {
      const int r = s / SEGS, j = s - r * SEGS;
      const i64 k = k0 + j * PER_SEG;
      const bool in = k < k_end;
      cp_async16_fill(xs + r * S::X_PITCH + j * PER_SEG, in ? x + (row0 + r) * p.x_stride + k : x,
                      in ? 16 : 0);
    }
  } else {
    for (int s = threadIdx.x; s < rows * SMALL_CHUNK; s += PROJECT_THREADS) {
      const int r = s / SMALL_CHUNK, j = s - r * SMALL_CHUNK;
      const i64 k = k0 + j;
      xs[r * S::X_PITCH + j] = k < k_end ? x[(row0 + r) * p.x_stride + k] : E{};
    }
  }
  const i64 kc = k_end - k0 < SMALL_CHUNK ? k_end - k0 : SMALL_CHUNK;  // rows of phi in range
  if (p.phi_dense) {  // the chunk's rows are contiguous: 16-byte copies, the tail zero-filled
    const i64 valid = kc > 0 ? kc * Q : 0;
    const float* src = p.phi + k0 * Q;
    for (int f = 4 * threadIdx.x; f < S::PHI_WORDS; f += 4 * PROJECT_THREADS) {
      const i64 left = valid - f;
      const int bytes = left >= 4 ? 16 : left > 0 ? 4 * (int)left : 0;
      cp_async16_fill(phis + f, bytes ? src + f : p.phi, bytes);
    }
  } else {
    for (int f = threadIdx.x; f < S::PHI_WORDS; f += PROJECT_THREADS) {
      const int kk = f / Q, q = f - kk * Q;
      const bool in = kk < kc;
      cp_async4_fill(phis + f, in ? p.phi + (k0 + kk) * p.phi_stride_k + q * p.phi_stride_q : p.phi,
                     in ? 4 : 0);
    }
  }
}

// 4 consecutive elements (8- or 16-byte aligned) of a stage row as floats.
template <typename T>
__device__ __forceinline__ void small_load4(const typename Io<T>::elem* p, float (&v)[4]) {
  if constexpr (sizeof(typename Io<T>::elem) == 2) {
    const U2 w = *(const U2*)p;
    v[0] = word_low<T>(w.x);
    v[1] = word_high<T>(w.x);
    v[2] = word_low<T>(w.y);
    v[3] = word_high<T>(w.y);
  } else {
    const U4 w = *(const U4*)p;
    v[0] = __uint_as_float(w.x);
    v[1] = __uint_as_float(w.y);
    v[2] = __uint_as_float(w.z);
    v[3] = __uint_as_float(w.w);
  }
}

// This block's writes are done; counts it on `arrived` and tells whether it was the last of
// `expected` (then the others' writes are visible to it). Every thread calls it.
// (The block's barrier orders its threads' writes before thread 0's release fence and count,
// as in a cooperative grid sync: one fence per block, and acq_rel, not the sequentially
// consistent fence of __threadfence.)
__device__ __forceinline__ bool small_arrive(unsigned int* arrived, int expected, int* is_last) {
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_gpu();
    *is_last = atomicAdd(arrived, 1u) == (unsigned int)expected - 1u;
    if (*is_last) fence_acq_rel_gpu();
  }
  __syncthreads();
  return *is_last;
}

__device__ __forceinline__ float4 load_cg4(const float* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p));
  return v;
}

// Threads of sum_slices that share one 4-float column of `floats` floats.
__device__ __forceinline__ int threads_per_column(int floats) {
  const int columns = (floats + 3) / 4;
  return columns >= PROJECT_THREADS ? 1 : PROJECT_THREADS / columns;
}

// The most slices of `floats` floats that sum_slices adds in one pass (SMALL_FAN_IN a thread).
__device__ __forceinline__ int sum_slices_reach(int floats) {
  return SMALL_FAN_IN * threads_per_column(floats);
}

// dst[0 .. floats) = the sum of `count` (<= sum_slices_reach(floats)) slices src + s * stride,
// in a fixed order (each thread sums its slices in order, then the threads of a column in
// order). src and stride are 16-byte aligned; reads run to `floats` rounded up to 4 (inside
// the slice). dst: shared or global memory, 16-byte aligned. Every thread calls it; `tmp`
// holds PROJECT_THREADS float4s.
__device__ void sum_slices(const float* src, i64 stride, int count, int floats, float* dst, float4* tmp) {
  const int columns = (floats + 3) / 4, tid = threadIdx.x;
  const int per = threads_per_column(floats);  // threads a column
  const int sub = tid % per, col = tid / per, span = PROJECT_THREADS / per;
  for (int c0 = 0; c0 < columns; c0 += span) {  // block-uniform
    const int c = c0 + col;
    float4 total = make_float4(0.f, 0.f, 0.f, 0.f);
    if (col < span && c < columns) {
      float4 v[SMALL_FAN_IN];
#pragma unroll
      for (int i = 0; i < SMALL_FAN_IN; ++i) {  // every load issued before any sum
        const int s = sub + i * per;
        v[i] = s < count ? load_cg4(src + s * stride + 4 * c) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int i = 0; i < SMALL_FAN_IN; ++i) {
        total.x += v[i].x;
        total.y += v[i].y;
        total.z += v[i].z;
        total.w += v[i].w;
      }
    }
    tmp[tid] = total;
    __syncthreads();
    if (tid < span && c0 + tid < columns) {
      float4 t = tmp[tid * per];
      for (int j = 1; j < per; ++j) {
        const float4 u = tmp[tid * per + j];
        t.x += u.x;
        t.y += u.y;
        t.z += u.z;
        t.w += u.w;
      }
      float* d = dst + 4 * (c0 + tid);
      const int valid = floats - 4 * (c0 + tid);  // the last column may be partial: its
      if (valid >= 4) {                           // neighbours belong to another group
        *(float4*)d = t;
      } else {
        d[0] = t.x;
        if (valid > 1) d[1] = t.y;
        if (valid > 2) d[2] = t.z;
      }
    }
    __syncthreads();
  }
}

// The projection of one (group, K range) into partial, then, in the group's last block,
// its coefficients and flag.
template <typename T, int N>
__device__ __forceinline__ void small_project(const PreParams& p, u32* smem, float* sh_scratch,
                                              int* is_last, i64 ticket) {
  typedef Small<T, N> S;
  typedef typename S::E E;
  constexpr int Q = S::Q, QP = Dims<N>::QP, ROUNDS = S::ROUNDS;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const i64 group = ticket / p.k_splits, split = ticket - group * p.k_splits;
  const i64 row0 = group * SMALL_ROWS;
  const int rows = p.batch - row0 < SMALL_ROWS ? (int)(p.batch - row0) : SMALL_ROWS;
  const i64 K = N * p.c_x;
  const i64 k_begin = split * p.k_range;
  const i64 k_end = k_begin + p.k_range < K ? k_begin + p.k_range : K;
  const int chunks = (int)((k_end - k_begin + SMALL_CHUNK - 1) / SMALL_CHUNK);
  // Warps over (row, K) : with 8 rows or more each warp takes rows w, w+8, ... of the
  // whole chunk; with fewer, the warps of one row split the chunk's K (k_warps ways).
  int row_warps = 8;
  while (row_warps > 1 && row_warps / 2 >= rows) row_warps /= 2;
  const int k_warps = 8 / row_warps;
  const int warp_row = warp % row_warps, k_part = warp / row_warps;
  const int k_len = SMALL_CHUNK / k_warps, k_lo = k_part * k_len;

  for (int c = 0; c < S::PIPELINE - 1; ++c) {
    if (c < chunks)
      small_stage<T, N>(p, smem + c * S::STAGE_WORDS, row0, rows, k_begin + (i64)c * SMALL_CHUNK, k_end);
    cp_async_commit();
  }
  float acc[ROUNDS][4];
#pragma unroll
  for (int j = 0; j < ROUNDS; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float sumsq = 0.f;  // thread tid < rows * 8: row tid / 8, 4 columns of each chunk
  for (int c = 0; c < chunks; ++c) {
    cp_async_wait_all_but(S::PIPELINE - 2);
    __syncthreads();  // chunk c is in; every warp is done with chunk c - 1
    if (c + S::PIPELINE - 1 < chunks)
      small_stage<T, N>(p, smem + ((c + S::PIPELINE - 1) % S::PIPELINE) * S::STAGE_WORDS, row0, rows,
                        k_begin + (i64)(c + S::PIPELINE - 1) * SMALL_CHUNK, k_end);
    cp_async_commit();
    const u32* stage = smem + (c % S::PIPELINE) * S::STAGE_WORDS;
    const E* xs = (const E*)stage;
    const float* phis = (const float*)(stage + S::X_WORDS);
    if (tid < rows * 8) {
      float v[4];
      small_load4<T>(xs + (tid >> 3) * S::X_PITCH + 4 * (tid & 7), v);
#pragma unroll
      for (int e = 0; e < 4; ++e) sumsq = fmaf(v[e], v[e], sumsq);
    }
    // (mhc_pre_cluster's loop is this one with sum(x*x) added: as one shared inline step,
    // this kernel spilled 40-136 bytes at n = 5, 6 under ptxas, 0 as it is)
    for (int kk = k_lo; kk < k_lo + k_len; kk += 4) {
      float w[ROUNDS][4];
#pragma unroll
      for (int j = 0; j < ROUNDS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) w[j][e] = lane + 32 * j < Q ? phis[(kk + e) * Q + lane + 32 * j] : 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = warp_row + row_warps * i;
        if (r < rows) {  // warp-uniform
          float v[4];
          small_load4<T>(xs + r * S::X_PITCH + kk, v);
#pragma unroll
          for (int j = 0; j < ROUNDS; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][i] = fmaf(v[e], w[j][e], acc[j][i]);
        }
      }
    }
  }
  cp_async_wait_all_but(0);
  __syncthreads();  // the stages are free
  float* red = (float*)smem;
  if (k_part > 0) {  // k_warps > 1 only when rows <= row_warps: one row per warp, in acc[.][0]
#pragma unroll
    for (int j = 0; j < ROUNDS; ++j) red[((k_part - 1) * row_warps + warp_row) * ROUNDS * 32 + j * 32 + lane] = acc[j][0];
  }
#pragma unroll
  for (int d = 1; d < 8; d <<= 1) sumsq += __shfl_xor_sync(0xffffffffu, sumsq, d);
  __syncthreads();
  const i64 slice = (p.batch * QP + 3) & ~(i64)3;  // floats: 16-byte aligned slices
  float* out = p.partial + split * slice + row0 * QP;
  if (k_part == 0) {
    for (int kp = 1; kp < k_warps; ++kp)  // a fixed order: deterministic
#pragma unroll
      for (int j = 0; j < ROUNDS; ++j) acc[j][0] += red[((kp - 1) * row_warps + warp_row) * ROUNDS * 32 + j * 32 + lane];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = warp_row + row_warps * i;
      if (r < rows)
#pragma unroll
        for (int j = 0; j < ROUNDS; ++j)
          if (lane + 32 * j < Q) out[r * QP + lane + 32 * j] = acc[j][i];
    }
  }
  if (tid < rows * 8 && (tid & 7) == 0) out[(tid >> 3) * QP + Q] = sumsq;

  // The partials' sum: the group's last block sums every split in one pass where it can;
  // else the last of each SMALL_FAN_IN splits sums theirs, and the last of those sums the
  // fan-in sums. Then that block makes the coefficients.
  unsigned int* counters = p.counter + COUNTER_GROUPS + group * (SMALL_FAN_IN + 2);
  float* sh_h = (float*)smem;
  const float* group_partial = p.partial + row0 * QP;
  if (p.k_splits <= sum_slices_reach(rows * QP)) {  // group-uniform: one level
    if (!small_arrive(counters, (int)p.k_splits, is_last)) return;
    sum_slices(group_partial, slice, (int)p.k_splits, rows * QP, sh_h, (float4*)sh_scratch);
  } else {
    const i64 fan_ins = (p.k_splits + SMALL_FAN_IN - 1) / SMALL_FAN_IN;
    const i64 fan_in = split / SMALL_FAN_IN, first = fan_in * SMALL_FAN_IN;
    const int count = (int)(p.k_splits - first < SMALL_FAN_IN ? p.k_splits - first : SMALL_FAN_IN);
    if (!small_arrive(counters + fan_in, count, is_last)) return;
    sum_slices(group_partial + first * slice, slice, count, rows * QP,
               p.partial + (p.k_splits + fan_in) * slice + row0 * QP, (float4*)sh_scratch);
    if (!small_arrive(counters + SMALL_FAN_IN, (int)fan_ins, is_last)) return;
    sum_slices(group_partial + p.k_splits * slice, slice, (int)fan_ins, rows * QP, sh_h,
               (float4*)sh_scratch);
  }
  rows_rms<T, N>(p, sh_h, row0, rows);
  tile_coefficients<N>(p, sh_h, rows, p.coef + row0 * Dims<N>::NC, p.h_post + row0 * N, p.bias,
                       p.bias_stride);
  __syncthreads();  // every thread's coefficients before thread 0's release
  if (tid == 0) store_release(counters + SMALL_FAN_IN + 1, 1u);
}

// The mix of one block's share of (row, 8 columns) units, once its groups' flags are up.
template <typename T, int N>
__device__ __forceinline__ void small_mix(const PreParams& p, i64 block) {
  const i64 units = (p.c_x + 7) / 8;
  const i64 first = block * PROJECT_THREADS, item = first + threadIdx.x;
  const bool active = item < p.batch * units;
  const i64 row = active ? item / units : 0, c0 = (item - row * units) * 8;
  Raw8<T> raw[N];
  if (active) load_unit<T, N>(p, row, c0, raw);  // in flight while the projection finishes
  if (threadIdx.x == 0) {
    const i64 last = first + PROJECT_THREADS - 1 < p.batch * units ? first + PROJECT_THREADS - 1 : p.batch * units - 1;
    for (i64 g = first / units / SMALL_ROWS; g <= last / units / SMALL_ROWS; ++g)
      wait_until_at_least(p.counter + COUNTER_GROUPS + g * (SMALL_FAN_IN + 2) + SMALL_FAN_IN + 1, 1u);
  }
  __syncthreads();
  if (active) mix_unit<T, N, true>(p, row, c0, raw, p.coef + row * Dims<N>::NC);
}

// Grid: groups * k_splits projection blocks, about as many as are resident at once (the
// driver's occupancy, _mhc._pre_plan), then ceil(batch * units / PROJECT_THREADS) mix blocks.
// Two blocks a multiprocessor up to n = 6 (at most 128 registers; more spill): left to
// itself, the NVRTC of CUDA 13.0 gave n = 4 164 registers, one block a multiprocessor, and a
// B1 grid of 161 blocks took two waves (H200: B1 c_x1280 26.8 -> 23.7 us, B4 c_x7168 33.6 ->
// 29.2 us under ncu).
template <typename T, int N>
__global__ void __launch_bounds__(PROJECT_THREADS, N <= 6 ? 2 : 1) mhc_pre_small(const PreParams p) {
  __shared__ __align__(16) u32 smem[Small<T, N>::SMEM_WORDS];
  __shared__ float4 sh_scratch[PROJECT_THREADS];
  __shared__ int ticket, is_last;
  if (threadIdx.x == 0) ticket = (int)atomicAdd(p.counter, 1u);
  __syncthreads();
  const i64 groups = (p.batch + SMALL_ROWS - 1) / SMALL_ROWS;
  const i64 projection_blocks = groups * p.k_splits;
  if (ticket < projection_blocks)
    small_project<T, N>(p, smem, (float*)sh_scratch, &is_last, ticket);
  else
    small_mix<T, N>(p, ticket - projection_blocks);
  __syncthreads();  // (the block's counter reads are all behind it)
  if (threadIdx.x == 0 && atomicAdd(p.counter + 1, 1u) == gridDim.x - 1) {
    // every other block is done with the counters: zero them for the next launch
    for (i64 i = 0; i < COUNTER_GROUPS + groups * (SMALL_FAN_IN + 2); ++i) p.counter[i] = 0u;
  }
}

// ------------------------------------------------------------------ pre, thread block clusters

// Decode-sized batches on sm_90 run as one launch of thread block clusters (mhc_pre_cluster):
// cluster g takes tokens [g * cluster_rows, ...), and its block of rank r the columns
// [r * cluster_columns, ...) of every stream of them. A block copies its x and phi slices
// into shared memory at once (every load in flight together: a decode step waits for one
// round trip, not a pipeline), projects them (h and sum(x*x) over its columns, float32 on
// the CUDA cores), then the cluster meets at a barrier and every block sums the blocks'
// partials, rank by rank, out of their shared memory (distributed shared memory): the same
// order, so the same bits, in every block. Each block then computes the tokens' gates and
// Sinkhorn matrices itself and mixes its own columns from the x it holds. No scratch, no
// counters, no flag: the cluster's blocks run at once by construction, and the only waits
// are two cluster barriers (the second keeps each block's partials alive until every
// block has read them). Where one cluster a group of tokens does not fit (its slice of x,
// or more clusters than are resident), K is split over cluster_groups clusters of a token
// group, and the last of them to arrive finishes the tokens (a ticket counter).
// Shared memory (dynamic; _mhc.cluster_smem_bytes sizes it, and the kernel traps on less):
//   phi   [n * cluster_columns][Q] float32: the block's K rows, stream by stream
//   part  [cluster_rows][Q+1]: this block's partial h and sum(x*x), read by the cluster
//   sh_h  [cluster_rows][Q+1]: the cluster's sums
//   coef  [cluster_rows][n + n*n]: h_pre, then M
//   red   [cluster_rows][8 warps][RED_STRIDE]: each warp's sums (h, then sum(x*x))
//   xs    [cluster_rows][n * cluster_columns] of x's type: row r holds stream k's columns
//         at k * cols (cols: the block's own count), so a row's K elements are contiguous
template <int N>
struct ClusterLayout {
  static constexpr int Q = Dims<N>::Q, QP = Dims<N>::QP, NC = Dims<N>::NC;
  static constexpr int WARPS = PROJECT_THREADS / 32;
  static constexpr int P = (QP + 31) / 32 * 32;  // a thread's sums, padded for warp_halving_sum
  __device__ static int floats4(int floats) { return (floats + 3) & ~3; }  // 16-byte sections
  static constexpr int RED_STRIDE = (QP + 3) & ~3;
  int part, sh_h, coef, red, xs, bytes;  // float offsets of each section; total bytes
  __device__ ClusterLayout(int rows, int columns, int elem_bytes) {
    part = N * columns * Q;
    sh_h = part + floats4(rows * QP);
    coef = sh_h + floats4(rows * QP);
    red = coef + floats4(rows * NC);
    xs = red + rows * WARPS * RED_STRIDE;
    bytes = 4 * xs + rows * N * columns * elem_bytes;
  }
};

// Half of v's P sums (P a multiple of 32) added to the partner lane's at each of five
// levels (recursive halving): lane l ends with the warp's sums of entries
// [l * P/32, (l+1) * P/32) in v[0 .. P/32), each added in a fixed tree. 31P/32 shuffles,
// where a butterfly of every entry takes 5P.
template <int C, int P>
__device__ __forceinline__ void halve(float (&v)[P], bool upper, int offset) {
#pragma unroll
  for (int i = 0; i < C / 2; ++i) {
    const float send = upper ? v[i] : v[i + C / 2];
    const float keep = upper ? v[i + C / 2] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
  }
}

template <int P>
__device__ __forceinline__ void warp_halving_sum(float (&v)[P], int lane) {
  static_assert(P % 32 == 0, "five halvings");
  halve<P>(v, lane & 16, 16);
  halve<P / 2>(v, lane & 8, 8);
  halve<P / 4>(v, lane & 4, 4);
  halve<P / 8>(v, lane & 2, 2);
  halve<P / 16>(v, lane & 1, 1);
}

// This thread's value of a PTX special register (the cluster ones: sm_90).
#define SPECIAL_REGISTER(function, name)          \
  __device__ __forceinline__ u32 function() {     \
    u32 r;                                        \
    asm("mov.u32 %0, %%" name ";" : "=r"(r));     \
    return r;                                     \
  }
SPECIAL_REGISTER(dynamic_smem_size, "dynamic_smem_size")  // bytes the launch gave the block
#if __CUDA_ARCH__ >= 900
SPECIAL_REGISTER(cluster_rank, "cluster_ctarank")      // this block's rank in its cluster
SPECIAL_REGISTER(cluster_blocks, "cluster_nctarank")   // blocks in the cluster
SPECIAL_REGISTER(cluster_index, "clusterid.x")         // the cluster's index in the grid
#endif
#undef SPECIAL_REGISTER

#if __CUDA_ARCH__ >= 900

// Every thread of every block of the cluster: arrive (this block's shared-memory writes
// released to the cluster), then wait for all (theirs acquired). Split, so that work
// between the two overlaps the others' arrival.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}

// Arrive without releasing anything: for "done reading the others' shared memory", whose
// loads have completed (their values were used) before it. (A release here, which waits
// for this block's writes to be visible to the cluster, cost ~0.5 us a decode step.)
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// `count` mbarriers in shared memory that bulk copies complete: each initialised for one
// arrival (the thread that announces its bytes), made visible to the copies (the async
// proxy) and to the block before any copy is issued.
__device__ __forceinline__ void bulk_barrier_init(unsigned long long* barriers, int count) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < count; ++i)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(barriers + i)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

// One thread: `bytes` in all are coming to `barrier` by bulk copies (its one arrival).
__device__ __forceinline__ void bulk_expect(unsigned long long* barrier, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(barrier)),
               "r"(bytes)
               : "memory");
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory by
// the copy engine of the multiprocessor (TMA), counted on `barrier`: one instruction for a
// whole run. (H200, B1 n4 bf16, against 16-byte cp.async: c_x4096 18.5 -> 17.5 us, c_x1280
// and c_x7168 unchanged.)
__device__ __forceinline__ void bulk_copy(void* smem, const void* gmem, u32 bytes,
                                          unsigned long long* barrier) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_address(smem)),
      "l"(gmem), "r"(bytes), "r"(smem_address(barrier))
      : "memory");
}

// Every thread: until the barrier's first phase completes (every announced byte landed).
__device__ __forceinline__ void bulk_wait(unsigned long long* barrier) {
  asm volatile(
      "{ .reg .pred done; WAIT: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0; @!done bra WAIT; }" ::"r"(
          smem_address(barrier))
      : "memory");
}

// The 32-bit word at `local` (this block's shared memory) in the shared memory of block
// `rank`, and the same as a float.
__device__ __forceinline__ u32 load_peer_word(const void* local, u32 rank) {
  u32 address, v;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(address) : "r"(smem_address(local)), "r"(rank));
  asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(address) : "memory");
  return v;
}

__device__ __forceinline__ float load_peer(const float* local, u32 rank) {
  return __uint_as_float(load_peer_word(local, rank));
}
#endif

// The block's slices of x (rows x n streams x cols) and of phi (n * cols rows of Q) into
// shared memory, asynchronously: where x rows are 16-byte aligned and phi packed, bulk
// copies, stream by stream (phi's rows of the stream, then each token's run of it), each
// stream's counted on its own barrier of `barriers` [N], so that the projection starts on a
// stream while the next ones still land; otherwise 16- and 4-byte cp.async copies (one
// commit group). Returns whether the bulk copies were used (the caller waits on the
// barriers, else on the commit group).
template <typename T, int N>
__device__ __forceinline__ bool cluster_load(const PreParams& p, const ClusterLayout<N>& at, float* smem,
                                             unsigned long long* barriers, i64 row0, int rows, i64 c_lo,
                                             int cols) {
  typedef typename Io<T>::elem E;
  constexpr int Q = Dims<N>::Q;
  const int tid = threadIdx.x;
  const E* x = (const E*)p.x + row0 * p.x_stride + c_lo;
  E* xs = (E*)(smem + at.xs);
  const int pitch = N * p.cluster_columns;
  float* phis = smem;
  if (p.vector_io && p.phi_dense) {  // c_x, c_lo and cols multiples of 8: runs of 16 bytes
    if (tid == 0) {  // (one thread, so that the copies are issued in stream order)
      const u32 x_run = cols * (int)sizeof(E), phi_run = cols * Q * 4;
      for (int k = 0; k < N; ++k) {
        bulk_expect(barriers + k, (u32)rows * x_run + phi_run);
        if (cols > 0) {
          bulk_copy(phis + k * cols * Q, p.phi + (k * p.c_x + c_lo) * Q, phi_run, barriers + k);
          for (int r = 0; r < rows; ++r)
            bulk_copy(xs + r * pitch + k * cols, x + r * p.x_stride + k * p.c_x, x_run, barriers + k);
        }
      }
    }
    return true;
  }
  if (p.vector_io) {
    constexpr int PER = 16 / (int)sizeof(E);
    const int segs = cols / PER, row_segs = N * segs;
    for (int s = tid; s < rows * row_segs; s += PROJECT_THREADS) {
      const int r = s / row_segs, rest = s - r * row_segs, k = rest / segs, j = rest - k * segs;
      cp_async16(xs + r * pitch + k * cols + j * PER, x + r * p.x_stride + k * p.c_x + j * PER);
    }
  } else {
    const int row_elems = N * cols;
    for (int s = tid; s < rows * row_elems; s += PROJECT_THREADS) {
      const int r = s / row_elems, rest = s - r * row_elems, k = rest / cols, c = rest - k * cols;
      xs[r * pitch + rest] = x[r * p.x_stride + k * p.c_x + c];
    }
  }
  if (p.phi_dense) {  // a stream's cols rows are contiguous, and (c_lo * Q) a multiple of 8
    const int words = cols * Q / 4;  // cols is a multiple of 8
    for (int s = tid; s < N * words; s += PROJECT_THREADS) {
      const int k = s / words, j = s - k * words;
      cp_async16(phis + k * cols * Q + 4 * j, p.phi + (k * p.c_x + c_lo) * Q + 4 * j);
    }
  } else {
    for (int s = tid; s < N * cols * Q; s += PROJECT_THREADS) {
      const int f = s / Q, q = s - f * Q, k = f / cols, c = f - k * cols;
      cp_async4(phis + s, p.phi + (k * p.c_x + c_lo + c) * p.phi_stride_k + q * p.phi_stride_q);
    }
  }
  cp_async_commit();
  return false;
}

// Grid: cluster_groups clusters of `blocks` (<= CLUSTER_BLOCKS) blocks per cluster_rows tokens
// (_mhc._cluster_plan: as many clusters as are resident at once, so one wave); the block of
// rank r in the token group's cluster g takes slice g * blocks + r of K. cluster_rows <= 32;
// c_x a multiple of 8 (cluster_columns too). With cluster_groups > 1 the scratch holds
// [token groups][cluster_groups][cluster_rows][Q+1] sums and counter[token group] is zero
// at the start, and is left zero.
template <typename T, int N>
__global__ void __launch_bounds__(PROJECT_THREADS, 1) mhc_pre_cluster(const PreParams p) {
#if __CUDA_ARCH__ >= 900
  typedef typename Io<T>::elem E;
  typedef ClusterLayout<N> L;
  constexpr int Q = L::Q, QP = L::QP, NC = L::NC;
  extern __shared__ __align__(16) float smem[];
  __shared__ float sbias[Q];  // b, for tile_coefficients
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const u32 rank = cluster_rank(), blocks = cluster_blocks();
  const int groups = p.cluster_groups;
  const i64 token_group = cluster_index() / groups;
  const int k_group = (int)(cluster_index() - token_group * groups);
  const i64 row0 = token_group * p.cluster_rows;
  const int rows = p.batch - row0 < p.cluster_rows ? (int)(p.batch - row0) : p.cluster_rows;
  // slice s of K: columns [s * cluster_columns, ...) of every stream (none past c_x)
  auto slice_columns = [&](i64 c_lo) {
    return p.c_x - c_lo < p.cluster_columns ? (p.c_x > c_lo ? (int)(p.c_x - c_lo) : 0)
                                            : p.cluster_columns;
  };
  const i64 c_lo = ((i64)k_group * blocks + rank) * p.cluster_columns;
  const int cols = slice_columns(c_lo);
  const L at(p.cluster_rows, p.cluster_columns, (int)sizeof(E));
  if (at.bytes > (int)dynamic_smem_size()) __trap();  // the host sized it otherwise
  __shared__ __align__(8) unsigned long long barriers[N];  // one a stream (cluster_load)
  bulk_barrier_init(barriers, N);
  const bool bulk = cluster_load<T, N>(p, at, smem, barriers, row0, rows, c_lo, cols);

  // b for the coefficients, read now, while the slices load: read there, from DRAM, it cost
  // a decode step ~0.7 us
  if (tid < Q) sbias[tid] = p.bias[tid * p.bias_stride];
  const float* phis = smem;
  const E* xs = (const E*)(smem + at.xs);
  const int pitch = N * p.cluster_columns;
  float* red = smem + at.red;
  if (!bulk) {
    cp_async_wait_all_but(0);
    __syncthreads();
  }
  // The projection: each thread takes K elements tid, tid + PROJECT_THREADS, ... of a row,
  // stream by stream, each as soon as its copies have landed (H200, B1 n4 bf16 c_x7168
  // against one wait for all: 15.1-15.8 -> 14.0-14.1 us; the same bits), with every column
  // of h and sum(x*x) in its registers: independent FMAs, where one lane per column of h
  // chained them (c_x7168: 7.4 -> 2.2 us, c_x1280 1.9 -> 1.0); then the warp's sums by
  // recursive halving (each lane ends with L::P / 32 of them), and the warps' in order
  // (deterministic).
  for (int r = 0; r < rows; ++r) {
    float v[L::P];
#pragma unroll
    for (int q = 0; q < L::P; ++q) v[q] = 0.f;
    for (int stream = 0; stream < N; ++stream) {
      if (bulk && r == 0) bulk_wait(barriers + stream);
      const int first = stream * cols;  // (k = first + c is this thread's when k % threads == tid)
      for (int k = first + (tid - first % PROJECT_THREADS + PROJECT_THREADS) % PROJECT_THREADS;
           k < first + cols; k += PROJECT_THREADS) {
        const float xv = Io<T>::to_float(xs[r * pitch + k]);
        const float* row = phis + k * Q;
        if constexpr (Q % 4 == 0) {  // rows of whole 16-byte words
#pragma unroll
          for (int q = 0; q < Q; q += 4) {
            const float4 w = *reinterpret_cast<const float4*>(row + q);
            v[q] = fmaf(xv, w.x, v[q]);
            v[q + 1] = fmaf(xv, w.y, v[q + 1]);
            v[q + 2] = fmaf(xv, w.z, v[q + 2]);
            v[q + 3] = fmaf(xv, w.w, v[q + 3]);
          }
        } else {
#pragma unroll
          for (int q = 0; q < Q; ++q) v[q] = fmaf(xv, row[q], v[q]);
        }
        v[Q] = fmaf(xv, xv, v[Q]);
      }
    }
    warp_halving_sum<L::P>(v, lane);
#pragma unroll
    for (int j = 0; j < L::P / 32; ++j) {
      const int q = lane * (L::P / 32) + j;
      if (q < QP) red[(r * L::WARPS + warp) * L::RED_STRIDE + q] = v[j];
    }
  }
  __syncthreads();
  float* part = smem + at.part;
  for (int i = tid; i < rows * QP; i += PROJECT_THREADS) {
    const int r = i / QP, q = i - r * QP;
    const float* sums = red + r * L::WARPS * L::RED_STRIDE + q;
    float s = sums[0];
#pragma unroll
    for (int w = 1; w < L::WARPS; ++w) s += sums[w * L::RED_STRIDE];
    part[i] = s;
  }
  cluster_arrive();  // this block's partials, to the cluster
  cluster_wait();    // every block's

  // The cluster's sums, rank by rank (every block the same order: the same bits), loads
  // first, all in flight.
  float* sh_h = smem + at.sh_h;
  for (int i = tid; i < rows * QP; i += PROJECT_THREADS) {
    float v[CLUSTER_BLOCKS];
#pragma unroll
    for (int b = 0; b < CLUSTER_BLOCKS; ++b) v[b] = b < (int)blocks ? load_peer(part + i, b) : 0.f;
    float s = v[0];
#pragma unroll
    for (int b = 1; b < CLUSTER_BLOCKS; ++b) s += v[b];  // (+0.f past the cluster: exact)
    sh_h[i] = s;
  }
  __syncthreads();
  if (groups > 1) {
    // K split over `groups` clusters: each puts its sums in the scratch, and the last of
    // them to arrive adds all of them, in k_group order (the same bits whichever is last),
    // and finishes the tokens while the others leave. No cluster waits for another, so
    // none needs the others resident.
    __shared__ u32 arrived_last;  // rank 0's, read by the cluster
    const int sums = p.cluster_rows * QP;
    float* partials = p.partial + token_group * groups * sums;
    if (rank == 0) {
      for (int i = tid; i < rows * QP; i += PROJECT_THREADS) partials[k_group * sums + i] = sh_h[i];
      __threadfence();  // the sums before the ticket
      __syncthreads();
      if (tid == 0) {
        const u32 ticket = atomicAdd(p.counter + token_group, 1u);
        arrived_last = ticket == (u32)groups - 1;
        if (arrived_last) {
          p.counter[token_group] = 0;  // left zeroed for the stream's next launch
          __threadfence();             // the others' sums after their tickets
        }
      }
    }
    cluster_arrive();  // done reading the others' partials; rank 0's arrived_last, released
    cluster_wait();
    const bool finish = load_peer_word(&arrived_last, 0) != 0;
    cluster_arrive_relaxed();  // done reading rank 0's arrived_last (it waits for this to exit)
    if (!finish) {
      cluster_wait();
      return;
    }
    for (int i = tid; i < rows * QP; i += PROJECT_THREADS)
      sh_h[i] = add_strided(load_cg(partials + i), partials + i, 1, groups, 1, sums);
    __syncthreads();
  } else {
    cluster_arrive_relaxed();  // done reading the others' partials (they wait for it to exit)
  }
  rows_rms<T, N>(p, sh_h, row0, rows);
  float* coef = smem + at.coef;
  tile_coefficients<N>(p, sh_h, rows, coef, rank == 0 ? p.h_post + row0 * N : nullptr, sbias, 1);
  __syncthreads();

  // The mix: this block's slice of every k_group's columns, x from shared memory for its
  // own slice and from global memory (L2, where the other clusters just read it from) for
  // the others'.
  for (int g = 0; g < groups; ++g) {
    const i64 g_lo = ((i64)g * blocks + rank) * p.cluster_columns;
    const int units = slice_columns(g_lo) / 8;
    for (int u = tid; u < rows * units; u += PROJECT_THREADS) {
      const int r = u / units, c = (u - r * units) * 8;
      Raw8<T> raw[N];
      if (g == k_group) {
#pragma unroll
        for (int k = 0; k < N; ++k) raw[k] = *(const Raw8<T>*)(xs + r * pitch + k * cols + c);
      } else {
        load_unit<T, N>(p, row0 + r, g_lo + c, raw);
      }
      mix_unit<T, N, false>(p, row0 + r, g_lo + c, raw, coef + r * NC);
    }
  }
  cluster_wait();  // no block leaves while another may still read its shared memory
#else
  __trap();  // launched on sm_90 and newer only (_mhc._pre_plan)
#endif
}

// ------------------------------------------------------------------ post

// x_out[row, i*c_x + c] = h_post[row, i] * x_layer_out[row, c] + x_res[row, i*c_x + c]
template <typename T>
__global__ void __launch_bounds__(POST_THREADS) mhc_post(const PostParams p) {
  typedef typename Io<T>::elem E;
  const unsigned long long item = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (item >= (unsigned long long)(p.batch * p.units)) return;
  // the host keeps batch * units below 2**32, so the division is 32-bit
  const u32 row = (u32)item / (u32)p.units;
  const i64 c0 = ((i64)item - (i64)row * p.units) * 8;
  const int count = p.c_x - c0 < 8 ? (int)(p.c_x - c0) : 8;
  const E* layer = (const E*)p.x_layer_out + row * p.layer_stride + c0;
  const E* res = (const E*)p.x_res + row * p.res_stride + c0;
  E* out = (E*)p.out + row * (p.n * p.c_x) + c0;
  float xl[8];
  if (p.vector_io)
    load8<T>(layer, xl);
  else
    load_some<T>(layer, count, xl);
  // The streams four at a time, each group's loads issued before its first store: a load
  // placed after a store waits for it (the compiler cannot tell that out and x_res never
  // overlap). Held raw (16 bytes a stream for 16-bit types), so the group costs few registers.
  for (i64 i0 = 0; i0 < p.n; i0 += 4) {
    Raw8<T> raw[4];
    float h[4];
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      if (i0 + g < p.n) {
        h[g] = p.h_post[row * p.h_stride_row + (i0 + g) * p.h_stride_col];
        load_raw8<T>(res + (i0 + g) * p.c_x, p.vector_io, count, raw[g]);
      }
    }
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      if (i0 + g < p.n) {
        float v[8];
        unpack8<T>(raw[g], v);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = fmaf(h[g], xl[e], v[e]);
        if (p.vector_io)
          store8<T>(out + (i0 + g) * p.c_x, v);
        else
          store_some<T>(out + (i0 + g) * p.c_x, count, v);
      }
    }
  }
}
