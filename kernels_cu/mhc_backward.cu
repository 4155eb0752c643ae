// mHC backward (SPEC section 8): the exact gradients of mhc.cu's pre and post.
//
// Compiled after mhc.cu's text (tileops_cupy._mhc prepends it: NVRTC gets no include path
// here), so these kernels use the forward's conversions (Io, split_bf16), PTX wrappers
// (cp.async, mma.sync, streaming loads and stores), 8-element helpers (Raw8, unpack8,
// store8, load_raw8) and tensor-core pieces (build_piece_slot, mma_x_phi) as they are. The geometry defines (BWD_*) follow mhc.cu in the module
// text, so they never touch the forward's names.
//
// Pre backward, five kernels per call (six where the first pass has many splits: one module
// per x dtype and n), or for small batches the five as the stages of one cooperative kernel
// (mhc_bwd_fused, at the end):
//   mhc_bwd_pieces  phi as bf16 B fragments of h = x @ phi, one column block per block.
//   mhc_bwd_stats   the first pass over x, grad_x_res (gxr) and grad_x_layer (gxl), a tile of
//                   128 tokens by every k_splits-th block of columns c of every stream: h on
//                   the tensor cores (phi in three exact bf16 pieces, as the forward), and
//                   sum(x*x), dh_pre[k] = sum_c gxl[c]*x_k[c] and dM[i,k] = sum_c gxr_i[c]*x_k[c]
//                   on the tensor cores too for 16-bit x and n <= 4 (TokenProducts), else in
//                   float32 FMA, into per-split partial sums. Where its stages take a row in runs
//                   shorter than a 128-byte line (bf16 n = 4: 64 bytes), they ask L2 for the
//                   whole line (cp_async16_fill_line).
//   mhc_bwd_splits  (many splits only) the partials summed into the first split's, one thread
//                   per (row of stats, token).
//   mhc_bwd_token   one thread per token: the partials summed in a fixed order, the gates and
//                   the Sinkhorn steps recomputed (each step's input kept in a scratch, or, when
//                   repeat*n*n is large, every ~sqrt(repeat)-th and one segment's at a time),
//                   then the chain rule back to dh = dloss/dh [Q], the coefficient of x in the
//                   row norm's gradient, and the token's grad_b and grad_alpha terms.
//   mhc_bwd_grad    the second pass: grad_x = h_pre[k]*gxl + sum_i M[i,k]*gxr_i + (dh @ phi^T)_k
//                   + c_r*x, one rounding, and grad_phi = x^T @ dh, both products on the tensor
//                   cores (dh and phi in bf16 pieces). Each block takes an equal static share of
//                   the (column chunk, token tile) items and keeps grad_phi of its chunk in
//                   registers, flushed to a per-(chunk, block) partial.
//   mhc_bwd_reduce  grad_phi's partials, grad_b and grad_alpha summed in a fixed order.
// Nothing is accumulated with atomics: two runs give the same bits.
//
// Post backward (mhc_post_bwd) is one pass, one block per row: grad_x_layer_out and grad_h_post
// (a fixed-order block reduction). grad_x_res is grad_x_out itself (x_res enters x_out with
// weight 1), so nothing copies it.

struct alignas(16) F4 {
  float x, y, z, w;
};
struct alignas(8) F2 {
  float x, y;
};

// 8 consecutive elements of a shared-memory row in their storage format (16-byte aligned).
template <typename T>
__device__ __forceinline__ void smem_raw8(const typename Io<T>::elem* p, Raw8<T>& r) {
  constexpr int WORDS = sizeof(typename Io<T>::elem) == 2 ? 1 : 2;
#pragma unroll
  for (int h = 0; h < WORDS; ++h) r.w[h] = ((const U4*)p)[h];
}

// COUNT consecutive elements of a shared-memory row as floats, in 16- (or 8-) byte loads.
template <typename T, int COUNT>
__device__ __forceinline__ void smem_floats(const typename Io<T>::elem* p, float (&v)[COUNT]) {
  typedef typename Io<T>::elem E;
  constexpr int PER_WORD = 4 / (int)sizeof(E);
  constexpr int WORDS = COUNT / PER_WORD;
  static_assert(WORDS % 2 == 0, "rows are read 8 bytes at a time at least");
  u32 w[WORDS];
  if constexpr (WORDS % 4 == 0) {
#pragma unroll
    for (int i = 0; i < WORDS / 4; ++i) {
      const U4 u = ((const U4*)p)[i];
      w[4 * i] = u.x, w[4 * i + 1] = u.y, w[4 * i + 2] = u.z, w[4 * i + 3] = u.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < WORDS / 2; ++i) {
      const U2 u = ((const U2*)p)[i];
      w[2 * i] = u.x, w[2 * i + 1] = u.y;
    }
  }
#pragma unroll
  for (int i = 0; i < WORDS; ++i) {
    if constexpr (PER_WORD == 2) {
      v[2 * i] = word_low<T>(w[i]);
      v[2 * i + 1] = word_high<T>(w[i]);
    } else {
      v[i] = __uint_as_float(w[i]);
    }
  }
}

// Four 8x8 matrices of 16-bit elements from shared memory, transposed: lane l gives the
// address of row l%8 of matrix l/8 and receives, of each matrix, its elements (2(l%4), l/4)
// and (2(l%4)+1, l/4) in one register (the first in the low half).
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem))
               : "memory");
}

// Four 8x8 matrices of 16-bit elements from shared memory: lane l gives the address of row
// l%8 of matrix l/8 and receives, of each matrix, its elements (l/4, 2(l%4)) and
// (l/4, 2(l%4)+1) in one register (the first in the low half).
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem))
               : "memory");
}

// d += a @ b on the tensor cores for A and B fragments in x's own 16-bit type: the products
// are exact, the sums float32.
template <typename T>
__device__ __forceinline__ void mma_own_16816(float (&d)[4], const u32 (&a)[4], U2 b) {
  static_assert(sizeof(typename Io<T>::elem) == 2, "16-bit x only");
  if constexpr (Io<T>::x_pieces == 1) {  // bf16
    mma_bf16_16816(d, a, b);
  } else {  // fp16
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
  }
}

// ================================================================== pre backward
#ifdef BWD_N

// One by-value parameter for every pre-backward kernel (tileops_cupy reads its fields from
// here, as mhc.cu's PreParams).
// (Pointers in the order a relaunch rewrites them, _mhc._PRE_BWD_RELAUNCH: one run.)
struct PreBwdParams {
  const void* x;             // [batch, n*c_x], rows x_stride elements apart, columns dense
  const float* phi;          // [n*c_x, Q] through (phi_stride_k, phi_stride_q)
  const float* bias;         // [Q] through bias_stride
  const void* grad_x_res;    // [batch, n*c_x] in x's dtype, rows gxr_stride apart
  const void* grad_x_layer;  // [batch, c_x] in x's dtype, rows gxl_stride apart
  const float* grad_h_post;  // [batch, n] through (ghp_stride_row, ghp_stride_col)
  float* grad_phi;           // [n*c_x, Q], contiguous
  void* grad_x;              // [batch, n*c_x] in x's dtype, contiguous
  float* grad_b;             // [Q]
  float* grad_alpha;         // [3]: pre, post, res
  unsigned int* counter;     // scratch [2], zero between launches: mhc_bwd_fused's barriers
  u32* pieces;               // scratch: phi as B fragments, column block by column block
  float* stats;              // scratch [k_splits][W][batch]: h, sum(x*x), dh_pre, dM
  float* coef;               // scratch [batch][CW4]: h_pre, M, c_r, scale
  u16* dh_pieces;            // scratch [batch][DP][QP16]: dloss/dh in bf16 pieces
  float* per_token;          // scratch [Q + 3][batch]: dloss/dlogit (grad_b), grad_alpha terms
  float* phi_partial;        // scratch [chunks][slot_cap][PG][Q]: grad_phi per (chunk, block)
  float* sinkhorn;           // scratch [slots][n*n][batch]: Sinkhorn checkpoints and steps
  i64 x_stride, gxr_stride, gxl_stride, ghp_stride_row, ghp_stride_col;
  i64 phi_stride_k, phi_stride_q, bias_stride;
  i64 batch, c_x, k_splits;
  i64 grad_items, grad_blocks, slot_cap;
  int vector_io, repeat, segment;
  int stats_stages, grad_stages;  // cp.async pipeline depths of the two passes
  int token_splits;  // partials mhc_bwd_token sums: k_splits, or 1 (mhc_bwd_splits)
  float alpha_pre, alpha_post, alpha_res, eps;
};

static_assert(sizeof(PreBwdParams) == 296, "PreBwdParams changed size: update this number");

constexpr int BWD_BLOCK = BWD_THREADS;  // threads of mhc_bwd_pieces, _stats and _grad

// Layout of one module's kernels (x dtype T, n = N). The Python side computes the stage
// sizes from the same rules and passes them as defines; the asserts keep the two in step.
template <typename T, int N>
struct BwdGeo {
  static_assert(N == BWD_N, "the BWD_ defines of this module describe another n");
  typedef typename Io<T>::elem E;
  static constexpr int ES = (int)sizeof(E);
  static constexpr int VEC = 16 / ES;  // elements per 16-byte access
  static constexpr int Q = N * N + 2 * N;
  static constexpr int NN = N * N;
  static constexpr int NT = (Q + 7) / 8;           // 8-wide tiles of q
  static constexpr int QP16 = (Q + 15) / 16 * 16;  // q padded to whole 16-deep k-steps
  static constexpr int KQ = QP16 / 16;
  static constexpr int XP = Io<T>::x_pieces;

  // mhc_bwd_stats: a stage is CS columns of each of the n streams; stage position
  // k*CS + j holds column j of stream k, padded with zeros to whole 16-deep k-steps
  static constexpr int TILE = BWD_STATS_TILE;
  static constexpr int CS = BWD_C_STAGE;
  static constexpr int P = (N * CS + 15) / 16 * 16;
  static constexpr int KS = P / 16;
  static constexpr int XS_PITCH = P + 8;  // elements: a fragment's 8 rows fall in distinct banks
  static constexpr int LS_PITCH = CS + VEC;
  static constexpr int HC = CS / 2;  // columns of one product thread (two per token)
  static constexpr int W = Q + 1 + N + NN;  // stats row: h, sum(x*x), dh_pre, dM
  static constexpr int PW = 1 + N + NN;     // product sums of one token
  // sum(x*x), dh_pre and dM on the tensor cores (TokenProducts) for 16-bit x and up to four
  // streams (two tokens' rows fill one product), else in float32 FMA
  static constexpr bool MMA_PRODUCTS = ES == 2 && N <= 4;
  static constexpr int PIECE_WORDS = KS * NT * 3 * 32 * 2;
  static constexpr int XS_BYTES = TILE * XS_PITCH * ES;
  static constexpr int LS_BYTES = TILE * LS_PITCH * ES;
  static constexpr int STATS_STAGE = 2 * XS_BYTES + LS_BYTES + PIECE_WORDS * 4;
  static constexpr int STATS_EPILOGUE = TILE * (2 * NT * 4 + PW) * 4;

  // mhc_bwd_grad: a chunk is CG columns of each stream (PG positions k*CG + j)
  static constexpr int GTILE = BWD_GRAD_TILE;
  static constexpr int CG = BWD_C_GRAD;
  static constexpr int PG = N * CG;
  static constexpr int GX_PITCH = PG + VEC;  // an odd number of 16-byte units: ldmatrix rows
  static constexpr int GL_PITCH = CG + VEC;  // fall in distinct banks
  static constexpr int DP = ES == 4 ? 3 : 2;  // bf16 pieces of dh: enough for x's dtype
  static constexpr int DH_ROW = DP * QP16;    // u16 per token in the dh_pieces scratch
  static constexpr int DH_PITCH = DH_ROW + 8;
  static constexpr int CW4 = (N + NN + 2 + 3) / 4 * 4;  // coefficient row: h_pre, M, c_r, scale
  static constexpr int D_PITCH = PG + 8;                // floats
  static constexpr int GX_BYTES = GTILE * GX_PITCH * ES;
  static constexpr int GL_BYTES = GTILE * GL_PITCH * ES;
  static constexpr int DH_BYTES = GTILE * DH_PITCH * 2;
  // the stage's coefficient rows at an odd number of 16-byte units: (c)'s warps read up to 8
  // tokens' rows at one offset, which fell in 2 (CW4 = 24: n = 4) or 4 (CW4 = 32: n = 5)
  // rows of one bank
  static constexpr int CF_PITCH = CW4 / 4 % 2 ? CW4 : CW4 + 4;
  static constexpr int CF_BYTES = GTILE * CF_PITCH * 4;
  static constexpr int GRAD_STAGE = 2 * GX_BYTES + GL_BYTES + DH_BYTES + CF_BYTES;
  static constexpr int D_BYTES = GTILE * D_PITCH * 4;
  static constexpr int MTK = PG / 16, MT_W = (MTK + 7) / 8;  // grad_phi m-tiles (positions)
  static constexpr int NTK = PG / 8, NW = (NTK + 7) / 8;     // dh @ phi^T n-tiles (positions)
  static constexpr int XPG = XP == 1 ? 1 : 2;  // x pieces for grad_phi (hi + mid is plenty)

  static_assert(STATS_STAGE == BWD_STATS_STAGE_BYTES, "stats stage: tileops_cupy._mhc differs");
  static_assert(GRAD_STAGE == BWD_GRAD_STAGE_BYTES, "grad stage: tileops_cupy._mhc differs");
  static_assert(D_BYTES == BWD_GRAD_D_BYTES, "grad D buffer: tileops_cupy._mhc differs");
  static_assert(STATS_EPILOGUE <= 2 * STATS_STAGE, "the stats epilogue reuses two stages");
  static_assert(BWD_BLOCK == 2 * TILE && TILE == 128, "stats: 8 warps, 2 threads per token");
  static_assert(GTILE == 32, "grad: two 16-token m-tiles per item");
  static_assert(CS % VEC == 0 && CS % 2 == 0 && CG % 16 == 0 && CG % VEC == 0, "widths");
  static_assert(!MMA_PRODUCTS || CS % 16 == 0, "TokenProducts: whole 16-column k-steps");
};

// ------------------------------------------------------------------ phi fragments

// Block b: the B fragments of h = x @ phi for stats column block b (columns b*CS .. of every
// stream), each phi value split into three bf16 pieces; 0 past phi. Layout as mhc.cu's
// build_piece_slot: [k-step][n-tile][piece][lane] x (b0, b1).
template <typename T, int N>
__device__ __forceinline__ void pieces_block(const PreBwdParams& p, i64 block) {
  typedef BwdGeo<T, N> G;
  constexpr int Q = G::Q, NT = G::NT, CS = G::CS;
  const i64 c0 = block * CS;
  u32* dst = p.pieces + block * G::PIECE_WORDS;
  auto phi_at = [&](int pos, int q) -> float {
    const int k = pos / CS;
    const i64 c = c0 + (pos - k * CS);
    if (k >= N || c >= p.c_x || q >= Q) return 0.f;
    return p.phi[(k * p.c_x + c) * p.phi_stride_k + q * p.phi_stride_q];
  };
  for (int slot = threadIdx.x; slot < G::KS * NT * 64; slot += BWD_BLOCK)
    build_piece_slot<NT>(dst, slot, phi_at);
}

template <typename T, int N>
__global__ void __launch_bounds__(BWD_BLOCK) mhc_bwd_pieces(const PreBwdParams p) {
  pieces_block<T, N>(p, blockIdx.x);
}

// ------------------------------------------------------------------ first pass

// The kernel's dynamic shared memory (16-byte aligned): its cp.async stages, then the
// buffers its epilogue reuses them for.
__device__ __forceinline__ unsigned char* dynamic_smem_bytes() {
  extern __shared__ U4 dynamic_smem[];
  return (unsigned char*)dynamic_smem;
}

// threadIdx.x in a block of BWD_BLOCK threads (every launch of the two passes). Stated, warp
// < 8 is known and the tile loops' bounds (warp + 8 * i < tiles) fold away where the tiles
// are a multiple of 8; unstated, each HMMA under one ran predicated behind a WARPSYNC (4% of
// mhc_bwd_grad's instructions).
__device__ __forceinline__ int block_thread() {
  const int tid = (int)threadIdx.x;
  __builtin_assume(tid < BWD_BLOCK);
  return tid;
}

// for (i = block_thread(); i < COUNT; i += BWD_BLOCK) body(i), unrolled (COUNT is known
// here, the thread index is not: a plain loop compiles to a generic one with a remainder). The
// forward's twin, load_pieces_stage (mhc.cu), keeps its plain loop: unrolled there, its
// addresses stay live across mhc_project's K loop, which then spills at its 128-register
// cap (bf16 n = 4, sm_90: 24 bytes).
template <int COUNT, typename Body>
__device__ __forceinline__ void for_each_share(Body&& body) {
#pragma unroll
  for (int j = 0; j < (COUNT + BWD_BLOCK - 1) / BWD_BLOCK; ++j) {
    const int i = block_thread() + j * BWD_BLOCK;
    if (COUNT % BWD_BLOCK == 0 || i < COUNT) body(i);
  }
}

// cp_async16_fill that has L2 fetch the whole 128-byte line around the copy, for a pass whose
// stages take a row in shorter runs: the next stages then find their bytes in L2, where DRAM
// served the same line's sectors a stage apart at about two thirds the speed (a 3-stage
// pipeline of 32-byte runs of 1152 rows a block, 302 MB, H200: 148 -> 116 µs; 128-byte runs
// without the hint 95-101 µs). Pre backward, bf16 n = 4 (32-byte runs then), same process:
// B4096 c_x4096 362 -> 347 µs, B16384 c_x7168 2069 -> 2002 µs, the same bits.
__device__ __forceinline__ void cp_async16_fill_line(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(smem_address(smem)),
               "l"(gmem), "r"(src_bytes)
               : "memory");
}

// The first sections of a stage of the two passes: rows row0 .. row0+TILE of x, then of
// grad_x_res (columns c0 .. c0+W of every stream k, at k*W in a row of XPITCH elements),
// then of grad_x_layer (columns c0 .. c0+W, rows LPITCH apart), zeros at columns >= c_end, so
// the padded products vanish. Rows past the batch: zeros too, or (KEEP_ROWS) left as they
// are, for a kernel that zeroed its shared memory once at its start.
template <typename T, int N, int TILE, int W, int XPITCH, int LPITCH, bool KEEP_ROWS>
__device__ __forceinline__ void stage_rows(const PreBwdParams& p, unsigned char* stage, i64 row0,
                                           i64 c0, i64 c_end) {
  typedef typename Io<T>::elem E;
  constexpr int VEC = 16 / (int)sizeof(E);
  constexpr int X_BYTES = TILE * XPITCH * (int)sizeof(E);
  E* xs = (E*)stage;
  E* gs = (E*)(stage + X_BYTES);
  E* ls = (E*)(stage + 2 * X_BYTES);
  const int tid = threadIdx.x;
  const E* x = (const E*)p.x;
  const E* gxr = (const E*)p.grad_x_res;
  const E* gxl = (const E*)p.grad_x_layer;
  if (p.vector_io) {
    // 16-byte copies, each wholly inside or outside [c0, c_end), zero-filled by the copy
    // itself outside. Thread tid takes SLOTS (row, 16-byte segment) pairs, ROW_STEP rows
    // apart, and each pair's n streams of x and gxr (or every PARTS-th stream, where the pairs
    // are fewer than the threads) and its gxl segment: the address arithmetic is done once a
    // pair, not once a copy (mhc_bwd_stats and _grad: H200 bf16 n=4 B4096 c_x4096 446 ->
    // 417 µs, B16384 c_x7168 2573 -> 2391 µs).
    // rows in runs shorter than a 128-byte line (the first pass's stages) ask L2 for the line
    constexpr bool SHORT_RUNS = W * (int)sizeof(E) < 128;
    auto copy16 = [](void* dst, const void* src, int bytes) {
      if constexpr (SHORT_RUNS) {
        cp_async16_fill_line(dst, src, bytes);
      } else {
        cp_async16_fill(dst, src, bytes);
      }
    };
    constexpr int SEGS = W / VEC, PAIRS = TILE * SEGS;
    constexpr bool WIDE = PAIRS >= BWD_BLOCK;
    static_assert(WIDE ? PAIRS % BWD_BLOCK == 0 : BWD_BLOCK % PAIRS == 0, "whole slots");
    constexpr int SLOTS = WIDE ? PAIRS / BWD_BLOCK : 1;
    constexpr int PARTS = WIDE ? 1 : BWD_BLOCK / PAIRS;
    constexpr int ROW_STEP = WIDE ? BWD_BLOCK / SEGS : TILE;
    const int pair = WIDE ? tid : tid % PAIRS, part = WIDE ? 0 : tid / PAIRS;
    const int r = pair / SEGS, seg = pair % SEGS;
    const i64 c = c0 + seg * VEC;
    const bool column_in = c < c_end;
#pragma unroll
    for (int i = 0; i < SLOTS; ++i) {
      const int rr = r + i * ROW_STEP;
      const i64 row = row0 + rr;
      if (KEEP_ROWS && row >= p.batch) continue;
      const bool copy = column_in && row < p.batch;
      const int bytes = copy ? 16 : 0;
      const E* xr = copy ? x + row * p.x_stride + c : x;
      const E* gr = copy ? gxr + row * p.gxr_stride + c : gxr;
      const i64 step = copy ? p.c_x : 0;
      const int at = rr * XPITCH + seg * VEC;
#pragma unroll
      for (int k = part; k < N; k += PARTS) {
        copy16(xs + at + k * W, xr + k * step, bytes);
        copy16(gs + at + k * W, gr + k * step, bytes);
      }
      if (part == 0)
        copy16(ls + rr * LPITCH + seg * VEC, copy ? gxl + row * p.gxl_stride + c : gxl, bytes);
    }
  } else {  // rows not 16-byte aligned: element by element
    for (int i = tid; i < TILE * N * W; i += BWD_BLOCK) {
      const int r = i / (N * W), rest = i - r * (N * W);
      const int k = rest / W, j = rest - k * W;
      const i64 row = row0 + r, c = c0 + j;
      if (KEEP_ROWS && row >= p.batch) continue;
      const bool inside = row < p.batch && c < c_end;
      xs[r * XPITCH + k * W + j] = inside ? x[row * p.x_stride + k * p.c_x + c] : E{};
      gs[r * XPITCH + k * W + j] = inside ? gxr[row * p.gxr_stride + k * p.c_x + c] : E{};
    }
    for (int i = tid; i < TILE * W; i += BWD_BLOCK) {
      const int r = i / W, j = i - r * W;
      const i64 row = row0 + r, c = c0 + j;
      if (KEEP_ROWS && row >= p.batch) continue;
      ls[r * LPITCH + j] = row < p.batch && c < c_end ? gxl[row * p.gxl_stride + c] : E{};
    }
  }
}

// The first pass's per-token products of 16-bit x for N <= 4 on the tensor cores: sum(x*x),
// dh_pre[k] = gxl . x_k and dM[i,k] = gxr_i . x_k, each a sum over the columns. Warp w takes
// tokens 16w .. 16w+15 of the tile. Two tokens (t, t+1) are one m16n8k16 product per 16
// columns: A's rows are gxr_0..3 of t, of t+1 (rows 0-7), then x_0..3 of t, of t+1 (8-15);
// B's columns are x_0..3 of t, of t+1, which is A's x half as ldmatrix gives it (no second
// load). C's diagonal 4x4 blocks then hold both tokens' dM (rows 0-7) and x_i . x_k (rows
// 8-15, whose diagonal sums to sum(x*x)). dh_pre of four tokens is one more product: A the x
// rows of two pairs, B gxl of eight tokens. Streams past N (N < 4) read stream N-1's row and
// their products are dropped. The products are exact and the sums float32, as in the FMA
// path. (Those FMAs and the bf16 unpacking they need were more than half of mhc_bwd_stats'
// instructions; pre backward, bf16 n = 4, H200, same process: B4096 c_x4096 347 -> 336 µs,
// B16384 c_x7168 2002 -> 1933 µs.)
template <typename T, int N>
struct TokenProducts {
  typedef BwdGeo<T, N> G;
  typedef typename G::E E;
  static_assert(G::MMA_PRODUCTS, "16-bit x and N <= 4");
  static constexpr int PAIRS = 8, GROUPS = 4;  // of the warp's 16 tokens
  float mix[PAIRS][4];                         // C of pair p: tokens 2p, 2p+1
  float pre[GROUPS][4];                        // C of group q: tokens 4q .. 4q+3

  __device__ __forceinline__ TokenProducts() {
#pragma unroll
    for (int p = 0; p < PAIRS; ++p) mix[p][0] = mix[p][1] = mix[p][2] = mix[p][3] = 0.f;
#pragma unroll
    for (int q = 0; q < GROUPS; ++q) pre[q][0] = pre[q][1] = pre[q][2] = pre[q][3] = 0.f;
  }

  // One stage: CS columns of each stream of xs, gs (x, gxr: XS_PITCH rows) and ls (gxl).
  __device__ __forceinline__ void add(const E* xs, const E* gs, const E* ls, int first_token,
                                      int lane) {
    const int row = lane & 7, matrix = lane >> 3;
    // this lane's ldmatrix row of a pair's A: row (matrix & 1) * 8 + row, columns
    // (matrix >> 1) * 8 ..; rows 0-7 gxr, 8-15 x, each token (row >> 2), stream (row & 3)
    const int stream = (row & 3) < N ? (row & 3) : N - 1;
    const E* pair_row = ((matrix & 1) ? xs : gs) + (first_token + (row >> 2)) * G::XS_PITCH +
                        stream * G::CS + (matrix >> 1) * 8;
    // and of gxl's B fragments: token (matrix >> 1) * 8 + row, columns (matrix & 1) * 8 ..
    const E* layer_row = ls + (first_token + (matrix >> 1) * 8 + row) * G::LS_PITCH + (matrix & 1) * 8;
#pragma unroll
    for (int kc = 0; kc < G::CS / 16; ++kc) {
      u32 gl[4];
      ldmatrix_x4(gl, layer_row + kc * 16);
#pragma unroll
      for (int q = 0; q < GROUPS; ++q) {
        u32 a0[4], a1[4];
        ldmatrix_x4(a0, pair_row + (4 * q) * G::XS_PITCH + kc * 16);
        ldmatrix_x4(a1, pair_row + (4 * q + 2) * G::XS_PITCH + kc * 16);
        mma_own_16816<T>(mix[2 * q], a0, U2{a0[1], a0[3]});
        mma_own_16816<T>(mix[2 * q + 1], a1, U2{a1[1], a1[3]});
        const u32 x_rows[4] = {a0[1], a1[1], a0[3], a1[3]};
        mma_own_16816<T>(pre[q], x_rows, (q & 2) ? U2{gl[2], gl[3]} : U2{gl[0], gl[1]});
      }
    }
  }

  // The warp's sums into prod [token][PW] (sum(x*x), dh_pre, dM), each entry written once.
  // C's entry (R, n) is lane 4*(R%8) + n/2's register (R >= 8 ? 2 : 0) + n%2.
  __device__ __forceinline__ void to_shared(float* prod, int first_token, int lane) const {
    const int g = lane >> 2, j = lane & 1;  // lanes 0 and 1 gather tokens 2p and 2p+1's sums
#pragma unroll
    for (int p = 0; p < PAIRS; ++p) {
      // token j's x_k . x_k: C (8 + 4j + k, 4j + k), summed in stream order
      float sumsq = 0.f;
#pragma unroll
      for (int k = 0; k < N; ++k)
        sumsq += __shfl_sync(0xffffffffu, mix[p][2 + (k & 1)], 18 * j + 4 * k + (k >> 1));
      if (lane < 2) prod[(first_token + 2 * p + j) * G::PW] = sumsq;
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // dM: C (4j + i, 4j + k), rows 0-7
        const int n = 2 * (lane & 3) + e, i = g & 3, k = n & 3;
        if ((g >> 2) == (n >> 2) && i < N && k < N)
          prod[(first_token + 2 * p + (g >> 2)) * G::PW + 1 + N + i * N + k] = mix[p][e];
      }
    }
#pragma unroll
    for (int q = 0; q < GROUPS; ++q) {
      // token 4q + R/4's dh_pre[R % 4]: C (R, 4(q % 2) + R/4)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = g + 8 * h, n = 2 * (lane & 3) + e, k = r & 3;
          if (n == 4 * (q & 1) + (r >> 2) && k < N)
            prod[(first_token + 4 * q + (r >> 2)) * G::PW + 1 + k] = pre[q][2 * h + e];
        }
    }
  }
};

// stats_block's tensor-core products where G::MMA_PRODUCTS, else nothing (the FMA path's
// registers): TokenProducts is only instantiated where it applies.
struct NoTokenProducts {};
template <bool MMA, typename Products>
struct ProductsIf {
  typedef Products type;
};
template <typename Products>
struct ProductsIf<false, Products> {
  typedef NoTokenProducts type;
};

// Grid: (tiles of 128 tokens) x k_splits; block b takes tile b / k_splits and column blocks
// (CS columns of every stream) split, split + k_splits, ... (split = b % k_splits), so a
// tile's splits read neighbouring runs of its rows at once (H100 against ranges of whole
// column blocks: float32 n4 B2048 c_x2048 201.5 -> 194.4 us, bf16 n8 B1024 c_x1280 248.3 ->
// 227.5, the same at bf16 n4 B4096 c_x4096). Warps as
// mhc_project: warp w takes tokens 32*(w%4) .. +32 (two m-tiles) and the k-steps of parity
// w/4. The per-token products: on the tensor cores (TokenProducts) warp w takes tokens
// 16w .. 16w+15; in FMA thread tid takes token tid%128 and half tid/128 of each stage's columns.
// Dynamic shared memory: `stages` stages of (x, gxr, gxl, phi fragments).
template <typename T, int N>
__device__ __forceinline__ void stats_block(const PreBwdParams& p, i64 block) {
  typedef BwdGeo<T, N> G;
  typedef typename G::E E;
  constexpr int Q = G::Q, NT = G::NT, KS = G::KS, CS = G::CS, HC = G::HC;
  constexpr int NN = G::NN, W = G::W, PW = G::PW, TILE = G::TILE, VEC = G::VEC;
  unsigned char* smem = dynamic_smem_bytes();
  const int tid = block_thread(), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tg = lane & 3;
  const int row_group = warp & 3, k_half = warp >> 2;
  const int token = tid & (TILE - 1), half = tid / TILE;
  const i64 tile = block / p.k_splits, split = block % p.k_splits;
  const i64 row0 = tile * TILE;
  const i64 c_end = p.c_x, column_blocks = (c_end + CS - 1) / CS;
  const int blocks = (int)((column_blocks - split + p.k_splits - 1) / p.k_splits);
  const int stages = p.stats_stages;

  // rows past the batch and the padding positions are never loaded: they must read as zeros
  for (int i = tid; i < stages * (G::STATS_STAGE / 16); i += BWD_BLOCK) ((U4*)smem)[i] = U4{0u, 0u, 0u, 0u};
  __syncthreads();

  auto stage_base = [&](int s) { return smem + s * G::STATS_STAGE; };
  auto load_block = [&](int b, int slot) {
    unsigned char* base = stage_base(slot);
    u32* pc = (u32*)(base + 2 * G::XS_BYTES + G::LS_BYTES);
    const i64 cb = (split + (i64)b * p.k_splits) * CS;
    const u32* src = p.pieces + (cb / CS) * G::PIECE_WORDS;
    for_each_share<G::PIECE_WORDS / 4>([&](int i) { cp_async16(pc + 4 * i, src + 4 * i); });
    stage_rows<T, N, TILE, CS, G::XS_PITCH, G::LS_PITCH, true>(p, base, row0, cb, c_end);
  };

  for (int s = 0; s < stages - 1; ++s) {
    if (s < blocks) load_block(s, s);
    cp_async_commit();
  }

  float acc[2][NT][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
  float sumsq = 0.f, pre[N], mix[NN];
  float no_sumsq[2][2];  // mma_x_phi leaves it alone: sum(x*x) is summed below
  typename ProductsIf<G::MMA_PRODUCTS, TokenProducts<T, N>>::type products;
#pragma unroll
  for (int k = 0; k < N; ++k) pre[k] = 0.f;
#pragma unroll
  for (int e = 0; e < NN; ++e) mix[e] = 0.f;

  for (int b = 0, slot = 0; b < blocks; ++b, slot = slot + 1 == stages ? 0 : slot + 1) {
    cp_async_wait_all_but(stages - 2);
    __syncthreads();  // block b's stage is in; every warp is done with block b-1
    if (b + stages - 1 < blocks)  // into the stage block b-1 used
      load_block(b + stages - 1, slot == 0 ? stages - 1 : slot - 1);
    cp_async_commit();
    const unsigned char* base = stage_base(slot);
    const E* xs = (const E*)base;
    const E* gs = (const E*)(base + G::XS_BYTES);
    const E* ls = (const E*)(base + 2 * G::XS_BYTES);
    const U2* frag = (const U2*)(base + 2 * G::XS_BYTES + G::LS_BYTES);

    // h += x @ phi on the tensor cores
    for (int ks = k_half; ks < KS; ks += 2)
      mma_x_phi<T, NT, G::XS_PITCH, false>(xs, frag, row_group * 32 + g, ks, tg, lane, acc, no_sumsq);

    // sum(x*x), dh_pre and dM of this thread's token and columns, in float32 FMA, or of the
    // warp's 16 tokens on the tensor cores
    if constexpr (G::MMA_PRODUCTS) {
      products.add(xs, gs, ls, 16 * warp, lane);
    } else {
      const E* xr = xs + token * G::XS_PITCH + half * HC;
      const E* gr = gs + token * G::XS_PITCH + half * HC;
      float gl[HC], gv[N][HC];
      smem_floats<T, HC>(ls + token * G::LS_PITCH + half * HC, gl);
#pragma unroll
      for (int i = 0; i < N; ++i) smem_floats<T, HC>(gr + i * CS, gv[i]);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        float xv[HC];
        smem_floats<T, HC>(xr + k * CS, xv);
#pragma unroll
        for (int j = 0; j < HC; ++j) {
          sumsq = fmaf(xv[j], xv[j], sumsq);
          pre[k] = fmaf(gl[j], xv[j], pre[k]);
#pragma unroll
          for (int i = 0; i < N; ++i) mix[i * N + k] = fmaf(gv[i][j], xv[j], mix[i * N + k]);
        }
      }
    }
  }

  // The two k halves (mma) and the two column halves (products) meet in shared memory.
  cp_async_wait_all_but(0);
  __syncthreads();
  constexpr int RED = 2 * NT * 4;
  float* red = (float*)smem + (row_group * 32 + lane) * RED;  // [128 lanes][RED]
  float* prod = (float*)smem + TILE * RED;                      // [128 tokens][PW]
  if (k_half == 1) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[(mt * NT + nt) * 4 + e] = acc[mt][nt][e];
  }
  if constexpr (G::MMA_PRODUCTS) {  // every entry once; sumsq, pre and mix stay zero
    products.to_shared(prod, 16 * warp, lane);
  } else if (half == 1) {
    float* mine = prod + token * PW;
    mine[0] = sumsq;
#pragma unroll
    for (int k = 0; k < N; ++k) mine[1 + k] = pre[k];
#pragma unroll
    for (int e = 0; e < NN; ++e) mine[1 + N + e] = mix[e];
  }
  __syncthreads();
  const i64 batch = p.batch;
  float* out = p.stats + split * W * batch;  // [W][batch] of this split
  if (k_half == 0) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const i64 row = row0 + row_group * 32 + mt * 16 + g + 8 * hh;
        if (row >= batch) continue;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int q = nt * 8 + 2 * tg + e;
            if (q < Q) out[q * batch + row] = acc[mt][nt][2 * hh + e] + red[(mt * NT + nt) * 4 + 2 * hh + e];
          }
      }
  }
  if (half == 0) {
    const i64 row = row0 + token;
    if (row < batch) {
      const float* other = prod + token * PW;
      out[Q * batch + row] = sumsq + other[0];
#pragma unroll
      for (int k = 0; k < N; ++k) out[(Q + 1 + k) * batch + row] = pre[k] + other[1 + k];
#pragma unroll
      for (int e = 0; e < NN; ++e) out[(Q + 1 + N + e) * batch + row] = mix[e] + other[1 + N + e];
    }
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(BWD_BLOCK, 1) mhc_bwd_stats(const PreBwdParams p) {
  wait_for_prerequisites();  // (each kernel after the first: it may be launched early, mhc.cu)
  stats_block<T, N>(p, blockIdx.x);
}

// ------------------------------------------------------------------ per token

// The divisors of one half of a Sinkhorn step as reciprocals, along rows (ROWS) or columns:
// the N entries summed in index order, plus eps. A sum that is exactly 0 (every entry 0 and
// eps 0) divides by 1, which keeps the zeros.
template <int N, bool ROWS>
__device__ __forceinline__ void sinkhorn_divisors(const float (&m)[N * N], float eps, float (&r)[N]) {
  float s[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float t = sum_in_order<N>([&](int k) { return m[ROWS ? i * N + k : k * N + i]; }) + eps;
    s[i] = t == 0.f ? 1.f : t;
  }
  reciprocals<N>(s, r);
}

// One Sinkhorn step as the forward's tile_coefficients takes it: rows, then columns, each
// division as a multiplication by the divisor's reciprocal.
template <int N>
__device__ __forceinline__ void sinkhorn_step(float (&m)[N * N], float eps) {
  float r[N];
  sinkhorn_divisors<N, true>(m, eps, r);
#pragma unroll
  for (int e = 0; e < N * N; ++e) m[e] *= r[e / N];
  sinkhorn_divisors<N, false>(m, eps, r);
#pragma unroll
  for (int e = 0; e < N * N; ++e) m[e] *= r[e % N];
}

// Back through one Sinkhorn step, in log form, from the output of its row step (`rows`) and
// step_out(e), its output: `u` = grad (.) matrix elementwise, for the step's output on entry
// and for its input on return. A step out = m / d, d = sum(m) + eps along the axis, has
// grad_m = (grad_out - sum(grad_out * out)) / d; times m that is u_m = u_out - out * sum(u_out):
// no division, so a near-empty row or column that the forward lifted (tiny entries over eps,
// step after step) never makes the gradient overflow float32 (as the host path). Where d was
// replaced by 1, m and out are all zero and the formula still holds.
template <int N, typename StepOut>
__device__ __forceinline__ void back_through_step(const float (&rows)[N * N], StepOut step_out,
                                                  float (&u)[N * N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) {  // back through the column step
    const float s = sum_in_order<N>([&](int i) { return u[i * N + k]; });
#pragma unroll
    for (int i = 0; i < N; ++i) u[i * N + k] = fmaf(-step_out(i * N + k), s, u[i * N + k]);
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {  // back through the row step
    const float s = sum_in_order<N>([&](int k) { return u[i * N + k]; });
#pragma unroll
    for (int k = 0; k < N; ++k) u[i * N + k] = fmaf(-rows[i * N + k], s, u[i * N + k]);
  }
}

// The gradient through one Sinkhorn step whose input is `a` (back_through_step). OUT_KEPT:
// `out` holds the step's output (the next step's input as the forward computed it: the same
// bits), so only the row step is computed again, off the chain through u, and `a` is kept;
// else the column step is computed again too, and `a` becomes the row step's output (in
// place: a copy spills at n = 8).
template <int N, bool OUT_KEPT>
__device__ __forceinline__ void sinkhorn_step_backward(float (&a)[N * N], float (&u)[N * N],
                                                       float eps,
                                                       const float (&out)[OUT_KEPT ? N * N : 1]) {
  float row_inv[N];
  sinkhorn_divisors<N, true>(a, eps, row_inv);
  if constexpr (OUT_KEPT) {
    float rows[N * N];
#pragma unroll
    for (int e = 0; e < N * N; ++e) rows[e] = a[e] * row_inv[e / N];
    back_through_step<N>(rows, [&](int e) { return out[e]; }, u);
  } else {
#pragma unroll
    for (int e = 0; e < N * N; ++e) a[e] *= row_inv[e / N];
    float col_inv[N];
    sinkhorn_divisors<N, false>(a, eps, col_inv);
    back_through_step<N>(a, [&](int e) { return a[e] * col_inv[e % N]; }, u);
  }
}

// Token t < batch, one thread, from the first `splits` partials of stats (k_splits, or 1
// where they were summed into the first already). `trace`: where its Sinkhorn matrices are
// kept, [slot][NN] floats `trace_stride` apart (the p.sinkhorn scratch, or shared memory).
template <typename T, int N>
__device__ __forceinline__ void token_chain(const PreBwdParams& p, i64 t, i64 splits, float* trace,
                                            i64 trace_stride) {
  typedef BwdGeo<T, N> G;
  typedef typename G::E E;
  constexpr int Q = G::Q, W = G::W, NN = G::NN, DP = G::DP, QP16 = G::QP16, CW4 = G::CW4;
  const i64 batch = p.batch;
  // Up to n = 4 the chain has registers to spare and keeps more in them (SMALL_N; beyond, the
  // same spilled the n = 6..8 kernels). Here: b and grad_h_post, loaded first beside the
  // partials. Read where they are used, each load comes after the emits' stores (which might
  // alias it for all the compiler knows) and waits out its own round trip.
  constexpr bool SMALL_N = N <= 4;
  auto load_bias = [&](int q) { return p.bias[q * p.bias_stride]; };
  auto load_post = [&](int i) { return p.grad_h_post[t * p.ghp_stride_row + i * p.ghp_stride_col]; };
  float early_bias[SMALL_N ? Q : 1], early_post[SMALL_N ? N : 1];
  if constexpr (SMALL_N) {
#pragma unroll
    for (int q = 0; q < Q; ++q) early_bias[q] = load_bias(q);
#pragma unroll
    for (int i = 0; i < N; ++i) early_post[i] = load_post(i);
  }
  auto bias = [&](int q) { return SMALL_N ? early_bias[q] : load_bias(q); };
  auto up_post = [&](int i) { return SMALL_N ? early_post[i] : load_post(i); };

  // the k_splits partials of h, sum(x*x), dloss/dh_pre and dloss/dM ([W] floats of a split,
  // [W][batch] a split, L2 reads: mhc_bwd_fused's blocks wrote them), summed split by split.
  // The loads of AHEAD splits are issued before any is added: one split at a time, the chain
  // waited an L2 round trip for each (mhc_bwd_token, bf16 n = 4, B256: 64 splits, 69 -> 63 us).
  constexpr int AHEAD = W <= 48 ? 4 : W <= 96 ? 2 : 1;
  float sums[W];
#pragma unroll
  for (int w = 0; w < W; ++w) sums[w] = 0.f;
  const float* src = p.stats + t;
  i64 s = 0;
  for (; s + AHEAD <= splits; s += AHEAD) {
    float v[AHEAD][W];
#pragma unroll
    for (int j = 0; j < AHEAD; ++j)
#pragma unroll
      for (int w = 0; w < W; ++w) v[j][w] = load_cg(src + ((s + j) * W + w) * batch);
#pragma unroll
    for (int j = 0; j < AHEAD; ++j)
#pragma unroll
      for (int w = 0; w < W; ++w) sums[w] += v[j][w];
  }
  for (; s < splits; ++s)
#pragma unroll
    for (int w = 0; w < W; ++w) sums[w] += load_cg(src + (s * W + w) * batch);
  float h[Q], sumsq = sums[Q], up_pre[N], up_mix[NN];
#pragma unroll
  for (int q = 0; q < Q; ++q) h[q] = sums[q];
#pragma unroll
  for (int k = 0; k < N; ++k) up_pre[k] = sums[Q + 1 + k];
#pragma unroll
  for (int e = 0; e < NN; ++e) up_mix[e] = sums[Q + 1 + N + e];

  // The row norm. sum(x*x) overflows to inf from |x| ~ 1e19 up (x finite): such a row is
  // read again and summed scaled by the power of two that brings its max |x| into [0.5, 1).
  float scale = 1.f;
  if (is_inf(sumsq)) {
    const E* xr = (const E*)p.x + t * p.x_stride;
    const i64 K = N * p.c_x;
    float peak = 0.f;
    for (i64 c = 0; c < K; ++c) peak = fmaxf(peak, fabsf(Io<T>::to_float(xr[c])));
    int exponent;
    frexpf(peak, &exponent);
    scale = ldexpf(1.f, -exponent);
    sumsq = 0.f;
    for (i64 c = 0; c < K; ++c) {
      const float v = Io<T>::to_float(xr[c]) * scale;
      sumsq = fmaf(v, v, sumsq);
    }
  }
  const float root_width = sqrtf((float)(N * p.c_x));
  const float rms = sqrtf(sumsq) / root_width / scale + 1e-4f;  // as the forward

  // logit q = alpha*h[q]/rms + b[q], by one reciprocal of rms: the chain's divisions would
  // each wait out a branch region of their own
  const float inv_rms = 1.f / rms;
  auto logit = [&](int q) {
    const float alpha = q < N ? p.alpha_pre : q < 2 * N ? p.alpha_post : p.alpha_res;
    return alpha * h[q] * inv_rms + bias(q);
  };

  float* coef = p.coef + t * CW4;
  u16* dh_out = p.dh_pieces + t * (DP * QP16);
  float* per_token = p.per_token + t;  // [Q + 3][batch]
  // The token's dh pieces and coefficient row: with SMALL_N gathered in registers and written
  // in 16-byte stores, the row once the forward's steps are done (but c_r, at the end), the
  // pieces at the end. Written where each is made, every 2-byte piece and float was a store
  // of its own, a row's length from the next lane's (clock64, bf16 n4: the emits and those
  // stores took 9.8K of the chain's 37K cycles; 3.8K with them gathered).
  constexpr int DH_WORDS = DP * QP16 / 2;
  static_assert(DH_WORDS % 4 == 0 && CW4 % 4 == 0, "whole 16-byte stores");
  u32 dh_words[SMALL_N ? DH_WORDS : 1] = {};
  float coef_row[SMALL_N ? CW4 : 1] = {};
  auto put_dh = [&](int j, int q, u32 bits) {
    if constexpr (SMALL_N) {
      dh_words[(j * QP16 + q) / 2] |= bits << (16 * (q & 1));
    } else {
      dh_out[j * QP16 + q] = (u16)bits;
    }
  };
  auto put_coef = [&](int e, float v) {
    if constexpr (SMALL_N) {
      coef_row[e] = v;
    } else {
      coef[e] = v;
    }
  };
  auto write_coef_row = [&]() {  // once its entries but c_r are made
    if constexpr (SMALL_N) {  // (beyond, coef_row is one float and each entry is stored as made)
#pragma unroll
      for (int e = 0; e < CW4; e += 4) {
        *(F4*)(coef + e) = F4{coef_row[e], coef_row[e + 1], coef_row[e + 2], coef_row[e + 3]};
      }
    }
  };
  float grad_alpha_pre = 0.f, grad_alpha_post = 0.f, grad_alpha_res = 0.f;
  float rms_sum = 0.f;  // sum over logits of dloss/dlogit * alpha*h/rms
  // `grad` = dloss/dlogit, final
  auto emit = [&](int q, float grad, float alpha, float& grad_alpha) {
    const float v = h[q] * inv_rms;  // dlogit/dalpha
    per_token[q * batch] = grad;
    grad_alpha = fmaf(grad, v, grad_alpha);
    rms_sum = fmaf(grad, alpha * v, rms_sum);
    u32 pieces[3];
    split_bf16<3>(grad * alpha * inv_rms, pieces);  // dloss/dh[q]
#pragma unroll
    for (int j = 0; j < DP; ++j) put_dh(j, q, pieces[j]);
  };

  // gates: h_pre = sigmoid(z), h_post = 2*sigmoid(z); sigmoid' = sigmoid(z)*sigmoid(-z), where
  // sigmoid(-z) = exp(-z)*sigmoid(z) while exp(-z) <= 1, else 1 - sigmoid(z) (no cancellation)
  float exp_neg[2 * N], one_plus_e[2 * N], gate[2 * N];
#pragma unroll
  for (int q = 0; q < 2 * N; ++q) {
    exp_neg[q] = expf(-logit(q));
    one_plus_e[q] = 1.f + exp_neg[q];
  }
  reciprocals<2 * N>(one_plus_e, gate);  // sigmoid(z) = 1 / (1 + exp(-z)), as the forward's
  auto gate_slope = [&](int q) {
    return gate[q] * (exp_neg[q] <= 1.f ? exp_neg[q] * gate[q] : 1.f - gate[q]);
  };
#pragma unroll
  for (int k = 0; k < N; ++k) {
    put_coef(k, gate[k]);
    emit(k, up_pre[k] * gate_slope(k), p.alpha_pre, grad_alpha_pre);
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    emit(N + i, 2.f * up_post(i) * gate_slope(N + i), p.alpha_post, grad_alpha_post);
  }

  // M = exp(L - rowmax(L)), then the Sinkhorn steps, input of every seg-th step kept
  float m[NN], row_max[N];
  u32 ties_at_max = 0;  // (SMALL_N) bit i*N+k: L[i,k] is its row's maximum
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float peak = __uint_as_float(0xff800000u);  // -inf
#pragma unroll
    for (int k = 0; k < N; ++k) {
      m[i * N + k] = logit(2 * N + i * N + k);
      peak = fmaxf(peak, m[i * N + k]);
    }
    row_max[i] = peak;
    if constexpr (SMALL_N) {
#pragma unroll
      for (int k = 0; k < N; ++k) ties_at_max |= (u32)(m[i * N + k] == peak) << (i * N + k);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) m[i * N + k] = expf(m[i * N + k] - peak);
  }
  const int repeat = p.repeat, seg = p.segment;
  const int checkpoints = (repeat + seg - 1) / seg;
  // [slot][NN]: the input of every seg-th step, then the inputs of one segment's other steps
  // (seg = 1 when every step's input fits: nothing is recomputed)
  auto save = [&](int slot, const float (&v)[NN]) {
#pragma unroll
    for (int e = 0; e < NN; ++e) trace[((i64)slot * NN + e) * trace_stride] = v[e];
  };
  auto restore = [&](int slot, float (&v)[NN]) {
#pragma unroll
    for (int e = 0; e < NN; ++e) v[e] = trace[((i64)slot * NN + e) * trace_stride];
  };
  for (int it = 0, phase = 0, slot = 0; it < repeat; ++it) {  // (no division a step)
    if (phase == 0) save(slot++, m);
    phase = phase + 1 == seg ? 0 : phase + 1;
    sinkhorn_step<N>(m, p.eps);
  }
#pragma unroll
  for (int e = 0; e < NN; ++e) put_coef(N + e, m[e]);  // the final matrix, for grad_x
  put_coef(N + NN + 1, scale);
#pragma unroll
  for (int e = N + NN + 2; e < CW4; ++e) put_coef(e, 0.f);
  write_coef_row();  // (c_r, at N + NN, is written last)

  // back through the Sinkhorn steps (log form: u = dloss/dM (.) M), one segment at a time
  // from its checkpoint. `a` holds the input of the step whose gradient is taken; the input
  // of the step before is loaded meanwhile wherever it is saved already (within a segment,
  // and from one segment to the next when they are one step long), so that the chain does
  // not wait a round trip for it. (Up to n = 6: three n*n matrices in registers spill beyond.)
  constexpr bool LOAD_AHEAD = N <= 6;
  // (SMALL_N) the output of the step whose gradient is taken: the final matrix, then each
  // step's input once its own gradient is taken (the step before's output)
  float u[NN], a[NN], out[SMALL_N ? NN : 1];
#pragma unroll
  for (int e = 0; e < NN; ++e) {
    u[e] = up_mix[e] * m[e];  // dloss/dM[i,k] * M[i,k]
    if constexpr (SMALL_N) out[e] = m[e];
  }
  for (int c = checkpoints - 1; c >= 0; --c) {
    const int first = c * seg, last = first + seg < repeat ? first + seg : repeat;
    auto slot_of = [&](int it) { return it == first ? c : checkpoints + it - first - 1; };
    if (seg > 1 || c == checkpoints - 1 || !LOAD_AHEAD) {
      restore(c, a);
      for (int it = first + 1; it < last; ++it) {  // the segment's other inputs, again
        sinkhorn_step<N>(a, p.eps);
        save(slot_of(it), a);
      }
    }
    for (int it = last - 1; it >= first; --it) {
      if constexpr (LOAD_AHEAD) {
        float before[NN];
        const bool ahead = it > first || (seg == 1 && c > 0);
        if (ahead) restore(it > first ? slot_of(it - 1) : c - 1, before);
        sinkhorn_step_backward<N, SMALL_N>(a, u, p.eps, out);
#pragma unroll
        for (int e = 0; e < NN; ++e) {
          if constexpr (SMALL_N) out[e] = a[e];
          if (ahead) a[e] = before[e];
        }
      } else {
        if (it < last - 1) restore(slot_of(it), a);
        sinkhorn_step_backward<N, SMALL_N>(a, u, p.eps, out);
      }
    }
  }

  // u is now dloss/d(L - rowmax(L)) (exp's derivative is M itself); the row max passes its
  // share to the row's maximum, split evenly among ties (torch.amax)
#pragma unroll
  for (int i = 0; i < N; ++i) {
    bool top[N];
    float total = 0.f;
    int ties = 0;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      // (the same expression as above, or its result kept: the same bits)
      top[k] = SMALL_N ? (ties_at_max >> (i * N + k)) & 1u : logit(2 * N + i * N + k) == row_max[i];
      total += u[i * N + k];
      ties += top[k];
    }
    const float share = total / (float)ties;
#pragma unroll
    for (int k = 0; k < N; ++k)
      emit(2 * N + i * N + k, u[i * N + k] - (top[k] ? share : 0.f), p.alpha_res, grad_alpha_res);
  }
#pragma unroll
  for (int q = Q; q < QP16; ++q)
#pragma unroll
    for (int j = 0; j < DP; ++j) put_dh(j, q, 0u);

  // rms = sqrt(sum(x*x))/sqrt(width) + 1e-4: drms/dx_j = x_j*scale / (sqrt(width)*sqrt(sumsq))
  // (sumsq scaled by scale^2); x = 0 everywhere gives 0 (the subgradient)
  const float grad_rms = -rms_sum / rms;
  const float denominator = root_width * sqrtf(sumsq);
  coef[N + NN] = denominator > 0.f ? grad_rms / denominator : 0.f;  // c_r
  if constexpr (SMALL_N) {  // (scratch rows: 16-byte aligned, DH_WORDS a multiple of 4)
#pragma unroll
    for (int w = 0; w < DH_WORDS; w += 4) {
      *(U4*)(dh_out + 2 * w) = U4{dh_words[w], dh_words[w + 1], dh_words[w + 2], dh_words[w + 3]};
    }
  }
  per_token[Q * batch] = grad_alpha_pre;
  per_token[(Q + 1) * batch] = grad_alpha_post;
  per_token[(Q + 2) * batch] = grad_alpha_res;
}

// The Sinkhorn trace in shared memory ([slot][NN][BWD_TOKEN_THREADS]) where the launch gives
// the block room for it (the plan does wherever that keeps every block resident at once),
// else in the p.sinkhorn scratch ([slot][NN][batch]): the backward steps read each matrix
// back in turn, and from L2 each read is a round trip the chain waits for.
template <typename T, int N>
__global__ void __launch_bounds__(BWD_TOKEN_THREADS) mhc_bwd_token(const PreBwdParams p) {
  wait_for_prerequisites();
  const i64 t = (i64)blockIdx.x * BWD_TOKEN_THREADS + threadIdx.x;
  if (t >= p.batch) return;
  if (dynamic_smem_size() > 0) {
    float* kept = (float*)dynamic_smem_bytes() + threadIdx.x;
    token_chain<T, N>(p, t, p.token_splits, kept, BWD_TOKEN_THREADS);
  } else {
    token_chain<T, N>(p, t, p.token_splits, p.sinkhorn + t, p.batch);
  }
}

// Element i of a split's [W][batch] partials, the k splits' summed into the first split's in
// split order (mhc_bwd_token's: the same bits). Where a batch has many splits, one thread
// per (row of stats, token) over many blocks sums them before mhc_bwd_token, instead of one
// thread per token summing its own (H200, bf16 n = 4, device time: B128 c_x7168, 112
// splits, mhc_bwd_token 82.1 us alone -> mhc_bwd_splits 11.5 + mhc_bwd_token 24.5).
template <typename T, int N>
__device__ __forceinline__ void sum_splits(const PreBwdParams& p, i64 i) {
  const i64 sums = (i64)BwdGeo<T, N>::W * p.batch;
  float total = 0.f;
#pragma unroll 16
  for (i64 split = 0; split < p.k_splits; ++split) total += load_cg(p.stats + split * sums + i);
  p.stats[i] = total;
}

template <typename T, int N>
__global__ void __launch_bounds__(BWD_REDUCE_THREADS) mhc_bwd_splits(const PreBwdParams p) {
  wait_for_prerequisites();
  const i64 i = (i64)blockIdx.x * BWD_REDUCE_THREADS + threadIdx.x;
  if (i < (i64)BwdGeo<T, N>::W * p.batch) sum_splits<T, N>(p, i);
}

// ------------------------------------------------------------------ second pass

// Item u = chunk * tiles + tile of mhc_bwd_grad, stepped one item at a time (no division).
struct ItemCursor {
  i64 chunk, tile;
  __device__ __forceinline__ ItemCursor(i64 u, i64 tiles) : chunk(u / tiles), tile(u - u / tiles * tiles) {}
  __device__ __forceinline__ void next(i64 tiles) {
    if (++tile == tiles) tile = 0, ++chunk;
  }
};

// Items: (column chunk, token tile of 32) pairs, chunk-major, `grad_items` of them; block j
// takes items [j*items/blocks, (j+1)*items/blocks). Per item: the tile's x, gxr, gxl (CG
// columns of every stream), dh pieces and coefficients stream through a cp.async pipeline;
//   (a) D = dh @ phi^T [32 tokens x PG] on the tensor cores, phi^T fragments of the chunk in
//       registers (warp w: position n-tiles w, w+8, ...), into shared memory;
//   (b) grad_phi[PG x Q] += x^T @ dh on the tensor cores (warp w: position m-tiles w, w+8,
//       ...), accumulated in registers while the chunk lasts;
//   (c) grad_x = h_pre[k]*gxl + sum_i M[i,k]*gxr_i + c_r*scale*x + D, one thread per 8
//       columns of a token (and group of streams), one rounding, 16-byte stores.
template <typename T, int N>
__device__ __forceinline__ void grad_block(const PreBwdParams& p, i64 block) {
  typedef BwdGeo<T, N> G;
  typedef typename G::E E;
  constexpr int Q = G::Q, NT = G::NT, KQ = G::KQ, QP16 = G::QP16, CG = G::CG, PG = G::PG;
  constexpr int DP = G::DP, VEC = G::VEC, NN = G::NN, TILE = G::GTILE, XPG = G::XPG;
  constexpr int MTK = G::MTK, MT_W = G::MT_W, NTK = G::NTK, NW = G::NW, CW4 = G::CW4;
  unsigned char* smem = dynamic_smem_bytes();
  const int tid = block_thread(), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tg = lane & 3;
  const int stages = p.grad_stages;
  const i64 batch = p.batch, c_x = p.c_x;
  const i64 tiles = (batch + TILE - 1) / TILE;
  const i64 items = p.grad_items, blocks = p.grad_blocks;
  const i64 u_begin = block * items / blocks;
  const int count = (int)((block + 1) * items / blocks - u_begin);
  float* D = (float*)(smem + stages * G::GRAD_STAGE);  // [TILE][D_PITCH]

  auto stage_base = [&](int s) { return smem + s * G::GRAD_STAGE; };
  // Items are loaded, and later used, in order: a cursor each walks their (chunk, tile)s.
  ItemCursor loading(u_begin, tiles), computing(u_begin, tiles);
  auto load_item = [&](int slot) {
    unsigned char* base = stage_base(slot);
    u16* dh = (u16*)(base + 2 * G::GX_BYTES + G::GL_BYTES);
    float* cf = (float*)(base + 2 * G::GX_BYTES + G::GL_BYTES + G::DH_BYTES);
    const i64 row0 = loading.tile * TILE, c0 = loading.chunk * CG;
    loading.next(tiles);
    stage_rows<T, N, TILE, CG, G::GX_PITCH, G::GL_PITCH, false>(p, base, row0, c0, c_x);
    constexpr int DH_SEGS = G::DH_ROW * 2 / 16, CF_SEGS = CW4 / 4;
    for_each_share<TILE * DH_SEGS>([&](int j) {
      const int r = j / DH_SEGS, seg = j - r * DH_SEGS;
      const i64 row = row0 + r;
      u16* dst = dh + r * G::DH_PITCH + seg * 8;
      if (row < batch)
        cp_async16(dst, p.dh_pieces + row * G::DH_ROW + seg * 8);
      else
        *(U4*)dst = U4{0u, 0u, 0u, 0u};
    });
    for_each_share<TILE * CF_SEGS>([&](int j) {
      const int r = j / CF_SEGS, seg = j - r * CF_SEGS;
      const i64 row = row0 + r;
      float* dst = cf + r * G::CF_PITCH + seg * 4;
      if (row < batch)
        cp_async16(dst, p.coef + row * CW4 + seg * 4);
      else
        *(U4*)dst = U4{0u, 0u, 0u, 0u};
    });
  };

  // phi^T as B fragments of (a) for one chunk: n = position nt*8 + g, k = q; DP pieces
  u32 bphi[NW][KQ][DP][2];
  auto load_phi = [&](i64 chunk) {
    const i64 c0 = chunk * CG;
#pragma unroll
    for (int nw = 0; nw < NW; ++nw) {
      const int nt = warp + 8 * nw;
      const int pos = nt * 8 + g, k = pos / CG;
      const i64 c = c0 + (pos - k * CG);
      const bool inside = nt < NTK && c < c_x;
      const i64 at = inside ? (k * c_x + c) * p.phi_stride_k : 0;
#pragma unroll
      for (int kq = 0; kq < KQ; ++kq)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int q = kq * 16 + hf * 8 + 2 * tg;
          const float v0 = inside && q < Q ? p.phi[at + q * p.phi_stride_q] : 0.f;
          const float v1 = inside && q + 1 < Q ? p.phi[at + (q + 1) * p.phi_stride_q] : 0.f;
          u32 lo[3], hi[3];
          split_bf16<3>(v0, lo);
          split_bf16<3>(v1, hi);
#pragma unroll
          for (int j = 0; j < DP; ++j) bphi[nw][kq][j][hf] = lo[j] | (hi[j] << 16);
        }
    }
  };

  float gacc[MT_W][NT][4];  // grad_phi of the current chunk: positions x q
  auto zero_gacc = [&]() {
#pragma unroll
    for (int mw = 0; mw < MT_W; ++mw)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) gacc[mw][nt][0] = gacc[mw][nt][1] = gacc[mw][nt][2] = gacc[mw][nt][3] = 0.f;
  };
  // Slot of this block among the blocks sharing `chunk`: its index minus that of the block
  // owning the chunk's first item (item u's block is ((u+1)*blocks - 1) / items).
  auto flush = [&](i64 chunk) {
    const i64 first = ((chunk * tiles + 1) * blocks - 1) / items;
    float* dst = p.phi_partial + (chunk * p.slot_cap + (block - first)) * (PG * Q);
#pragma unroll
    for (int mw = 0; mw < MT_W; ++mw) {
      const int mk = warp + 8 * mw;
      if (mk >= MTK) continue;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int pos = mk * 16 + g + 8 * (e >> 1), q = nt * 8 + 2 * tg + (e & 1);
          if (q < Q) dst[pos * Q + q] = gacc[mw][nt][e];
        }
    }
  };

  for (int s = 0; s < stages - 1; ++s) {
    if (s < count) load_item(s);
    cp_async_commit();
  }
  i64 chunk_now = -1;
  zero_gacc();
  for (int i = 0, slot = 0; i < count; ++i, slot = slot + 1 == stages ? 0 : slot + 1) {
    cp_async_wait_all_but(stages - 2);
    __syncthreads();  // item i's stage is in; every thread is done with item i-1 (and D)
    if (i + stages - 1 < count) load_item(slot == 0 ? stages - 1 : slot - 1);  // item i-1's stage
    cp_async_commit();
    const i64 chunk = computing.chunk, row0 = computing.tile * TILE, c0 = chunk * CG;
    computing.next(tiles);
    if (chunk != chunk_now) {
      if (chunk_now >= 0) flush(chunk_now);
      zero_gacc();
      load_phi(chunk);
      chunk_now = chunk;
    }
    const unsigned char* base = stage_base(slot);
    const E* xs = (const E*)base;
    const E* gs = (const E*)(base + G::GX_BYTES);
    const E* ls = (const E*)(base + 2 * G::GX_BYTES);
    const u16* dh = (const u16*)(base + 2 * G::GX_BYTES + G::GL_BYTES);
    const float* cf = (const float*)(base + 2 * G::GX_BYTES + G::GL_BYTES + G::DH_BYTES);

    // (a) D = dh @ phi^T: m = token, n = position, k = q; pieces (i, j) with i + j < DP
    {
      float dacc[2][NW][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nw = 0; nw < NW; ++nw) dacc[mt][nw][0] = dacc[mt][nw][1] = dacc[mt][nw][2] = dacc[mt][nw][3] = 0.f;
#pragma unroll
      for (int kq = 0; kq < KQ; ++kq) {
        u32 a[2][DP][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int j = 0; j < DP; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r)
              a[mt][j][r] = *(const u32*)(dh + (mt * 16 + g + (r & 1) * 8) * G::DH_PITCH + j * QP16 +
                                          kq * 16 + 2 * tg + (r >> 1) * 8);
#pragma unroll
        for (int nw = 0; nw < NW; ++nw) {
          if (warp + 8 * nw >= NTK) continue;
#pragma unroll
          for (int j = 0; j < DP; ++j) {
            const U2 bw = U2{bphi[nw][kq][j][0], bphi[nw][kq][j][1]};
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
              for (int i2 = 0; i2 < DP; ++i2)
                if (i2 + j < DP) mma_bf16_16816(dacc[mt][nw], a[mt][i2], bw);
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nw = 0; nw < NW; ++nw) {
          const int nt = warp + 8 * nw;
          if (nt >= NTK) continue;
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
            *(F2*)(D + (mt * 16 + g + 8 * hh) * G::D_PITCH + nt * 8 + 2 * tg) =
                F2{dacc[mt][nw][2 * hh], dacc[mt][nw][2 * hh + 1]};
        }
    }

    // (b) grad_phi += x^T @ dh: m = position, n = q, k = token; pieces (x i, dh j), i + j <= 1
#pragma unroll
    for (int kt = 0; kt < TILE / 16; ++kt) {
      const int t0 = kt * 16;
      u32 a[MT_W][XPG][4];
#pragma unroll
      for (int mw = 0; mw < MT_W; ++mw) {
        const int mk = warp + 8 * mw;
        if (mk >= MTK) continue;
        const int k0 = mk * 16;
        if constexpr (sizeof(E) == 2) {
          u32 w[4];
          ldmatrix_x4_trans(w, xs + (t0 + (lane & 7) + 8 * (lane >> 4)) * G::GX_PITCH + k0 +
                                   8 * ((lane >> 3) & 1));
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            if constexpr (XPG == 1) {
              a[mw][0][r] = w[r];
            } else {
              u32 p0[2], p1[2];
              split_bf16<2>(word_low<T>(w[r]), p0);
              split_bf16<2>(word_high<T>(w[r]), p1);
              a[mw][0][r] = p0[0] | (p1[0] << 16);
              a[mw][1][r] = p0[1] | (p1[1] << 16);
            }
          }
        } else {
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int pos = k0 + g + 8 * (r & 1), tok = t0 + 2 * tg + 8 * (r >> 1);
            u32 p0[2], p1[2];
            split_bf16<2>(Io<T>::to_float(xs[tok * G::GX_PITCH + pos]), p0);
            split_bf16<2>(Io<T>::to_float(xs[(tok + 1) * G::GX_PITCH + pos]), p1);
            a[mw][0][r] = p0[0] | (p1[0] << 16);
            a[mw][1][r] = p0[1] | (p1[1] << 16);
          }
        }
      }
#pragma unroll
      for (int np = 0; np < KQ; ++np) {  // two q n-tiles per ldmatrix
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          u32 b[4];
          ldmatrix_x4_trans(b, dh + (t0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * G::DH_PITCH + j * QP16 +
                                   np * 16 + 8 * (lane >> 4));
#pragma unroll
          for (int sub = 0; sub < 2; ++sub) {
            const int nt = 2 * np + sub;
            if (nt >= NT) continue;
            const U2 bw = U2{b[2 * sub], b[2 * sub + 1]};
#pragma unroll
            for (int mw = 0; mw < MT_W; ++mw) {
              if (warp + 8 * mw >= MTK) continue;
#pragma unroll
              for (int xp = 0; xp < XPG; ++xp)
                if (xp + j <= 1) mma_bf16_16816(gacc[mw][nt], a[mw][xp], bw);
            }
          }
        }
      }
    }
    __syncthreads();  // D is complete

    // (c) grad_x of 8 columns of one token, for a group of streams
    {
      // streams in groups of up to four; past n = 4 in as many groups as the tile's 8-column
      // runs leave threads for: fewer gxr rows and sums live a thread (bf16 n = 8: 4 streams a
      // thread -> 2, 24 spilled bytes -> 0; H100, B1024 c_x1280, whole call 255.3 -> 247.6 us).
      // float32 n = 4 lost with two groups (B2048 c_x2048 208.3 -> 209.5 us).
      constexpr int OCTS = CG / 8, SPREAD = BWD_BLOCK / (TILE * OCTS), FEW = (N + 3) / 4;
      constexpr int GROUPS = N <= 4 || SPREAD <= FEW ? FEW : SPREAD < N ? SPREAD : N;
      constexpr int KG = (N + GROUPS - 1) / GROUPS;
      for (int it = tid; it < TILE * GROUPS * OCTS; it += BWD_BLOCK) {
        const int o = it % OCTS, rg = it / OCTS, grp = rg % GROUPS, r = rg / GROUPS;
        const i64 row = row0 + r, c = c0 + o * 8;
        if (row >= batch || c >= c_x) continue;
        const int cnt = c_x - c < 8 ? (int)(c_x - c) : 8;
        const float* co = cf + r * G::CF_PITCH;
        Raw8<T> res[N];
#pragma unroll
        for (int i2 = 0; i2 < N; ++i2) smem_raw8<T>(gs + r * G::GX_PITCH + i2 * CG + o * 8, res[i2]);
        float layer[8];
        {
          Raw8<T> raw;
          smem_raw8<T>(ls + r * G::GL_PITCH + o * 8, raw);
          unpack8<T>(raw, layer);
        }
        const float c_r = co[N + NN], scale = co[N + NN + 1];
        E* out = (E*)p.grad_x + row * (N * c_x) + c;
#pragma unroll
        for (int kk = 0; kk < KG; ++kk) {
          const int k = grp * KG + kk;
          if (k >= N) continue;
          float o8[8];
          const float pre = co[k];
#pragma unroll
          for (int e = 0; e < 8; ++e) o8[e] = pre * layer[e];
#pragma unroll
          for (int i2 = 0; i2 < N; ++i2) {
            const float w = co[N + i2 * N + k];
            float v[8];
            unpack8<T>(res[i2], v);
#pragma unroll
            for (int e = 0; e < 8; ++e) o8[e] = fmaf(w, v[e], o8[e]);
          }
          {
            Raw8<T> raw;
            smem_raw8<T>(xs + r * G::GX_PITCH + k * CG + o * 8, raw);
            float v[8];
            unpack8<T>(raw, v);
#pragma unroll
            for (int e = 0; e < 8; ++e) o8[e] = fmaf(c_r, v[e] * scale, o8[e]);
          }
          const F4* d = (const F4*)(D + r * G::D_PITCH + k * CG + o * 8);
          const F4 d0 = d[0], d1 = d[1];
          o8[0] += d0.x, o8[1] += d0.y, o8[2] += d0.z, o8[3] += d0.w;
          o8[4] += d1.x, o8[5] += d1.y, o8[6] += d1.z, o8[7] += d1.w;
          if (p.vector_io && cnt == 8)
            store8<T>(out + k * c_x, o8);
          else
            store_some<T>(out + k * c_x, cnt, o8);
        }
      }
    }
  }
  if (chunk_now >= 0) flush(chunk_now);
  cp_async_wait_all_but(0);
}

template <typename T, int N>
__global__ void __launch_bounds__(BWD_BLOCK, 1) mhc_bwd_grad(const PreBwdParams p) {
  wait_for_prerequisites();
  grad_block<T, N>(p, blockIdx.x);
}

// ------------------------------------------------------------------ reductions

// Blocks [0, phi_blocks): grad_phi[kk, q], one thread each, the partials of its chunk in
// block order. Blocks phi_blocks + j, j < Q + 3: grad_b[j] (j < Q) or grad_alpha[j - Q], the
// per-token terms summed by a fixed tree.
// (THREADS threads a block, `sh` THREADS floats of shared memory.)
template <typename T, int N, int THREADS>
__device__ __forceinline__ void reduce_block(const PreBwdParams& p, i64 block, float* sh) {
  typedef BwdGeo<T, N> G;
  constexpr int Q = G::Q, CG = G::CG, PG = G::PG;
  const int tid = threadIdx.x;
  const i64 total = N * p.c_x * Q;
  const i64 phi_blocks = (total + THREADS - 1) / THREADS;
  if (block < phi_blocks) {
    const i64 idx = block * THREADS + tid;
    if (idx >= total) return;
    float s = 0.f;
    if (p.grad_items > 0) {  // an empty batch has no partials: grad_phi is 0
      const i64 kk = idx / Q, q = idx - kk * Q;
      const i64 k = kk / p.c_x, c = kk - k * p.c_x;
      const i64 chunk = c / CG, pos = k * CG + (c - chunk * CG);
      const i64 tiles = (p.batch + G::GTILE - 1) / G::GTILE;
      const i64 items = p.grad_items, blocks = p.grad_blocks;
      const i64 first = ((chunk * tiles + 1) * blocks - 1) / items;
      const i64 last = (((chunk + 1) * tiles) * blocks - 1) / items;
      const float* src = p.phi_partial + (chunk * p.slot_cap * PG + pos) * Q + q;
      for (i64 slot = 0; slot <= last - first; ++slot) s += src[slot * PG * Q];
    }
    p.grad_phi[idx] = s;
    return;
  }
  const int column = (int)(block - phi_blocks);  // block-uniform: the barriers hold
  float s = 0.f;
  for (i64 t = tid; t < p.batch; t += THREADS) s += p.per_token[column * p.batch + t];
  sh[tid] = s;
  __syncthreads();
#pragma unroll
  for (int width = THREADS / 2; width > 0; width >>= 1) {
    if (tid < width) sh[tid] += sh[tid + width];
    __syncthreads();
  }
  if (tid == 0) {
    if (column < Q)
      p.grad_b[column] = sh[0];
    else
      p.grad_alpha[column - Q] = sh[0];
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(BWD_REDUCE_THREADS) mhc_bwd_reduce(const PreBwdParams p) {
  wait_for_prerequisites();
  __shared__ float sh[BWD_REDUCE_THREADS];
  reduce_block<T, N, BWD_REDUCE_THREADS>(p, blockIdx.x, sh);
}

// ------------------------------------------------------------------ one launch

// The five kernels above as the stages of one cooperative launch (every block resident),
// for small batches, where five launches cost more host time than the work takes on the
// device. Each stage's blocks (threads, for the per-token stage) are dealt out to the grid
// in turn, the stats partials are summed over the whole grid before the per-token stage
// reads them, and the grid waits at a barrier between stages (counter[0] counts the
// arrivals); the last block out zeroes both counters for the next launch. The geometry
// (k_splits, grad_blocks) is the five kernels': the same sums in the same order, the same
// bits.
// Each stage a call of its own (not inlined): registers are allocated per stage, not
// across all five (inlined, n = 8 spilled 1.2 KB a thread).
template <typename T, int N>
__device__ __noinline__ void fused_pieces(const PreBwdParams& p, i64 block) { pieces_block<T, N>(p, block); }
template <typename T, int N>
__device__ __noinline__ void fused_stats(const PreBwdParams& p, i64 block) { stats_block<T, N>(p, block); }
template <typename T, int N>
__device__ __noinline__ void fused_token(const PreBwdParams& p, i64 t) {
  token_chain<T, N>(p, t, 1, p.sinkhorn + t, p.batch);
}
template <typename T, int N>
__device__ __noinline__ void fused_grad(const PreBwdParams& p, i64 block) { grad_block<T, N>(p, block); }

template <typename T, int N>
__global__ void __launch_bounds__(BWD_BLOCK, 1) mhc_bwd_fused(const PreBwdParams p) {
  typedef BwdGeo<T, N> G;
  const i64 grid = gridDim.x;
  const unsigned int blocks = gridDim.x;
  for (i64 b = blockIdx.x; b < (p.c_x + G::CS - 1) / G::CS; b += grid) fused_pieces<T, N>(p, b);
  grid_barrier(p.counter, 1 * blocks);
  for (i64 b = blockIdx.x; b < (p.batch + G::TILE - 1) / G::TILE * p.k_splits; b += grid) {
    fused_stats<T, N>(p, b);
    __syncthreads();  // the next block's stages overwrite this one's epilogue buffers
  }
  grid_barrier(p.counter, 2 * blocks);
  // the k splits' partials summed into the first split's over the whole grid (a small batch
  // has many splits: 80 at c_x 1280)
  const i64 sums = (i64)G::W * p.batch;
  for (i64 i = blockIdx.x * BWD_BLOCK + threadIdx.x; i < sums; i += grid * BWD_BLOCK)
    sum_splits<T, N>(p, i);
  grid_barrier(p.counter, 3 * blocks);
  for (i64 t = blockIdx.x * BWD_BLOCK + threadIdx.x; t < p.batch; t += grid * BWD_BLOCK)
    fused_token<T, N>(p, t);
  grid_barrier(p.counter, 4 * blocks);
  for (i64 b = blockIdx.x; b < p.grad_blocks; b += grid) {
    fused_grad<T, N>(p, b);
    __syncthreads();
  }
  grid_barrier(p.counter, 5 * blocks);
  const i64 reduce_blocks = (N * p.c_x * G::Q + BWD_BLOCK - 1) / BWD_BLOCK + G::Q + 3;
  float* sh = (float*)dynamic_smem_bytes();  // (free after the last barrier)
  for (i64 b = blockIdx.x; b < reduce_blocks; b += grid) reduce_block<T, N, BWD_BLOCK>(p, b, sh);
  // every block has left its last wait on counter[0] before it counts itself out here
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(p.counter + 1, 1u) == blocks - 1) {
    p.counter[0] = 0u;
    p.counter[1] = 0u;
  }
}

#endif  // BWD_N

// ================================================================== post backward
#ifdef BWD_POST_THREADS  // the post module (tileops_cupy._mhc.post_backward_module)

// One by-value parameter of mhc_post_bwd (tileops_cupy reads its fields from here).
struct PostBwdParams {
  const void* x_layer_out;  // [batch, c_x], rows layer_stride apart, columns dense
  const float* h_post;      // [batch, n] through (h_stride_row, h_stride_col)
  const void* grad_x_out;   // [batch, n*c_x], rows grad_stride apart, columns dense
  void* grad_x_layer_out;   // [batch, c_x], contiguous
  float* grad_h_post;       // [batch, n], contiguous
  i64 layer_stride, h_stride_row, h_stride_col, grad_stride;
  i64 batch, n, c_x, units;  // units = ceil(c_x / 8)
};

static_assert(sizeof(PostBwdParams) == 104, "PostBwdParams changed size: update this number");

// The sums of v[0..COUNT) over the block's threads, by a fixed tree: into out[] from
// thread 0. Every thread of the block calls it; `scratch` holds COUNT floats per warp.
template <int COUNT>
__device__ __forceinline__ void block_sums(const float (&v)[COUNT], float* scratch, float* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int i = 0; i < COUNT; ++i) {
    float s = v[i];
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) s += __shfl_xor_sync(0xffffffffu, s, d);
    if (lane == 0) scratch[warp * COUNT + i] = s;
  }
  __syncthreads();
  if (threadIdx.x < COUNT) {
    float s = 0.f;
    for (int w = 0; w < warps; ++w) s += scratch[w * COUNT + threadIdx.x];
    out[threadIdx.x] = s;
  }
  __syncthreads();  // scratch may be written again
}

// 8 elements at p: one 16-byte access when the rows allow it (`vector`), else the first
// `count` element by element.
template <typename T>
__device__ __forceinline__ void load8_or_some(const typename Io<T>::elem* p, bool vector, int count,
                                              float (&v)[8]) {
  if (vector)
    load8<T>(p, v);
  else
    load_some<T>(p, count, v);
}

template <typename T>
__device__ __forceinline__ void store8_or_some(typename Io<T>::elem* p, bool vector, int count,
                                               const float (&v)[8]) {
  if (vector)
    store8<T>(p, v);
  else
    store_some<T>(p, count, v);
}

// One block per row. N > 0: the n = N streams unrolled, one pass. N == 0: any n, grad_x_out
// read twice (a stream loop for grad_h_post, a column loop for grad_x_layer_out). VECTOR:
// every 8 columns one 16-byte access (c_x a multiple of 8, rows 16-byte aligned); a kernel
// of its own, as the element-wise fallback's registers cost the 16-byte path occupancy (H200,
// bf16 n=4: B4096 c_x4096 83.9% -> 87.5% of the copy ceiling, B16384 c_x7168 101.6 -> 104.6%).
template <typename T, int N, bool VECTOR>
__global__ void __launch_bounds__(BWD_POST_THREADS) mhc_post_bwd(const PostBwdParams p) {
  typedef typename Io<T>::elem E;
  __shared__ float scratch[BWD_POST_THREADS / 32 * (N > 0 ? N : 1)];
  const i64 row = blockIdx.x;
  const int tid = threadIdx.x;
  constexpr bool vector = VECTOR;
  const E* layer = (const E*)p.x_layer_out + row * p.layer_stride;
  const E* grad = (const E*)p.grad_x_out + row * p.grad_stride;
  E* out_layer = (E*)p.grad_x_layer_out + row * p.c_x;
  const float* gates = p.h_post + row * p.h_stride_row;
  float* out_gates = p.grad_h_post + row * p.n;
  if constexpr (N > 0) {
    float gate[N], dot[N];
#pragma unroll
    for (int i = 0; i < N; ++i) gate[i] = gates[i * p.h_stride_col], dot[i] = 0.f;
    for (i64 u = tid; u < p.units; u += BWD_POST_THREADS) {
      const i64 c0 = u * 8;
      const int count = p.c_x - c0 < 8 ? (int)(p.c_x - c0) : 8;
      float xl[8], acc[8];
      load8_or_some<T>(layer + c0, vector, count, xl);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = 0.f;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        float v[8];
        load8_or_some<T>(grad + i * p.c_x + c0, vector, count, v);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          acc[e] = fmaf(gate[i], v[e], acc[e]);
          dot[i] = fmaf(xl[e], v[e], dot[i]);
        }
      }
      store8_or_some<T>(out_layer + c0, vector, count, acc);
    }
    block_sums<N>(dot, scratch, out_gates);
  } else {
    for (i64 i = 0; i < p.n; ++i) {
      float dot = 0.f;
      for (i64 u = tid; u < p.units; u += BWD_POST_THREADS) {
        const i64 c0 = u * 8;
        const int count = p.c_x - c0 < 8 ? (int)(p.c_x - c0) : 8;
        float xl[8], v[8];
        load8_or_some<T>(layer + c0, vector, count, xl);
        load8_or_some<T>(grad + i * p.c_x + c0, vector, count, v);
#pragma unroll
        for (int e = 0; e < 8; ++e) dot = fmaf(xl[e], v[e], dot);
      }
      const float dots[1] = {dot};
      block_sums<1>(dots, scratch, out_gates + i);
    }
    for (i64 u = tid; u < p.units; u += BWD_POST_THREADS) {
      const i64 c0 = u * 8;
      const int count = p.c_x - c0 < 8 ? (int)(p.c_x - c0) : 8;
      float acc[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = 0.f;
      for (i64 i = 0; i < p.n; ++i) {
        float v[8];
        load8_or_some<T>(grad + i * p.c_x + c0, vector, count, v);
        const float gate = gates[i * p.h_stride_col];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = fmaf(gate, v[e], acc[e]);
      }
      store8_or_some<T>(out_layer + c0, vector, count, acc);
    }
  }
}

#endif  // BWD_POST_THREADS
