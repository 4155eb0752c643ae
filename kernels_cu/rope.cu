// Rotary position embedding: one kernel family for every RoPE op, both directions, and the
// in-place Q/K component.
//
// Work layout: blockIdx.x covers `threadDim.z` tokens; threadIdx.x is a chunk of a head row
// (VEC pairs of a neox row, or VEC interleaved elements), threadIdx.y strides over the heads
// of q then k. cos/sin of a chunk are formed once per token and reused for every head.
// Where cos/sin come from is the TABLE template argument (TABLE_* below): the existing
// paths compile exactly as before, the MRoPE and cos_sin_cache modes are other instantiations.
//
// The 16-bit float types and their conversions: common.cuh, prepended by the loader.

// VEC elements moved as one access (16 bytes when VEC * sizeof(T) == 16).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// One operand of the launch: q or k, read from `in`, written to `out` (may alias `in`).
struct Rows {
  const char* in;
  char* out;
};

constexpr int FINE_BITS = 10;
// HEADS_IN_FLIGHT (a define from tileops_cupy._rotate, which sizes the launch by it): loads
// of this many heads are issued before the first use

// Position of token (b, s): offset + per-sequence offset + (explicit id or s). Out-of-range
// positions raise the error flag and are clamped, so no table is ever read out of bounds.
__device__ __forceinline__ long long token_position(const void* ids, int ids_is_int64,
                                                    const void* offsets, int offsets_is_int64,
                                                    long long position_offset, int b, int s,
                                                    long long token, long long position_limit,
                                                    volatile int* error_flag) {
  long long position = position_offset;
  if (offsets != nullptr) {
    position += offsets_is_int64 ? static_cast<const long long*>(offsets)[b]
                                 : static_cast<long long>(static_cast<const int*>(offsets)[b]);
  }
  if (ids != nullptr) {
    position += ids_is_int64 ? static_cast<const long long*>(ids)[token]
                             : static_cast<long long>(static_cast<const int*>(ids)[token]);
  } else {
    position += s;
  }
  if (position < 0 || position >= position_limit) {
    *error_flag = 1;
    __threadfence_system();
    position = position < 0 ? 0 : position_limit - 1;
  }
  return position;
}

// Rotate one chunk of every head row of a token: cos/sin formed once, heads loaded
// HEADS_IN_FLIGHT at a time so that several 16-byte loads are in flight per thread.
// cos_sin_of(pair) gives the pair's (cos, sin) at this token (the table mode's lookup).
template <typename T, bool NEOX, int VEC, typename CosSinOf, typename RowIn, typename RowOut>
__device__ __forceinline__ void rotate_chunk(int chunk, int pairs, CosSinOf cos_sin_of,
                                             float sin_sign, int total_heads, RowIn row_in,
                                             RowOut row_out) {
  // Pairs this thread rotates: neox pairs (j, j + pairs); interleaved pairs (2j, 2j+1).
  // SPLIT: the two members of each pair come from two loads (neox, or interleaved read one
  // element at a time when the view is not pair-aligned); otherwise one load holds both.
  constexpr bool SPLIT = NEOX || VEC == 1;
  constexpr int PAIRS = SPLIT ? VEC : VEC / 2;
  constexpr int LOADS = SPLIT ? 2 : 1;
  const int first_pair = chunk * PAIRS;
  float cos_v[PAIRS], sin_v[PAIRS];
#pragma unroll
  for (int i = 0; i < PAIRS; ++i) {
    const float2 cs = cos_sin_of(first_pair + i);
    cos_v[i] = cs.x;
    sin_v[i] = cs.y * sin_sign;
  }

  const int x1_col = NEOX ? chunk * VEC : 2 * first_pair;
  const int x2_col = NEOX ? pairs + chunk * VEC : x1_col + 1;  // read only when SPLIT

  for (int h0 = threadIdx.y; h0 < total_heads; h0 += blockDim.y * HEADS_IN_FLIGHT) {
    Pack<T, VEC> data[HEADS_IN_FLIGHT][LOADS];
#pragma unroll
    for (int u = 0; u < HEADS_IN_FLIGHT; ++u) {
      const int h = h0 + u * blockDim.y;
      if (h < total_heads) {
        const T* in = row_in(h);
        data[u][0] = *reinterpret_cast<const Pack<T, VEC>*>(in + x1_col);
        if (SPLIT) data[u][LOADS - 1] = *reinterpret_cast<const Pack<T, VEC>*>(in + x2_col);
      }
    }
#pragma unroll
    for (int u = 0; u < HEADS_IN_FLIGHT; ++u) {
      const int h = h0 + u * blockDim.y;
      if (h >= total_heads) break;
      Pack<T, VEC> y1, y2;
#pragma unroll
      for (int i = 0; i < PAIRS; ++i) {
        const float x1 = to_float(SPLIT ? data[u][0].v[i] : data[u][0].v[2 * i]);
        const float x2 = to_float(SPLIT ? data[u][LOADS - 1].v[i] : data[u][0].v[2 * i + 1]);
        const float r1 = fmaf(x1, cos_v[i], -x2 * sin_v[i]);
        const float r2 = fmaf(x2, cos_v[i], x1 * sin_v[i]);
        if (SPLIT) {
          y1.v[i] = from_float<T>(r1);
          y2.v[i] = from_float<T>(r2);
        } else {
          y1.v[2 * i] = from_float<T>(r1);
          y1.v[2 * i + 1] = from_float<T>(r2);
        }
      }
      T* out = row_out(h);
      *reinterpret_cast<Pack<T, VEC>*>(out + x1_col) = y1;
      if (SPLIT) *reinterpret_cast<Pack<T, VEC>*>(out + x2_col) = y2;
    }
  }
}

// One launch's arguments, passed by value as a single struct (one packed buffer from the host
// instead of thirty boxed scalars: that is most of the host cost of a decode-sized call).
// tileops_cupy/_rotate.py reads the fields from this declaration and packs them by name.
struct RopeParams {
  // What a repeated call of one layout changes comes first, in one run, so that the host
  // patches it with one write (tileops_cupy.rope RELAUNCH_*): the operands' addresses,
  // the positions' addresses and the position offset.
  // q: [batch, seq, q_heads, head_dim] read from q_in, written to q_out (may alias);
  // k: the same with k_heads (0 when there is no k).
  const void* q_in;
  void* q_out;
  const void* k_in;
  void* k_out;
  // positions: offset + offsets[b] + (ids[b*seq + s] or s), each bounded by position_limit
  const void* ids;
  const void* offsets;
  long long position_offset;
  // element strides (batch, seq, head) of each operand
  long long q_in_stride[3];
  long long q_out_stride[3];
  long long k_in_stride[3];
  long long k_out_stride[3];
  int* error_flag;
  // fine[lo][pair] = (cos, sin)(lo*inv); coarse[hi][pair] = a*(cos, sin)(hi*1024*inv)
  const float2* fine;
  const float2* coarse;
  long long position_limit;
  int q_heads;
  int k_heads;
  int batch;
  int seq;
  int rotary_dim;
  int tail_chunks;
  int ids_is_int64;
  int offsets_is_int64;
  float sin_sign;
  // TABLE_MROPE: ids holds 3 rows of batch*seq positions (temporal, height, width); pair j
  // takes the row mrope_row gives from the section sizes and the interleaved flag
  int mrope_section[3];
  int mrope_interleaved;
  // TABLE_COS_SIN_CACHE: the caller's float32 [position_limit, rotary_dim] table, cos of
  // pair j at column j, sin at column rotary_dim/2 + j
  const float* cos_sin_cache;
};

static_assert(sizeof(RopeParams) == 248, "RopeParams changed size: update this number");

// Where cos/sin of (token, pair) come from: the two-level tables at the token's position; the
// same at one of three position rows chosen per pair (MRoPE); or the caller's cos_sin_cache.
constexpr int TABLE_TWO_LEVEL = 0;
constexpr int TABLE_MROPE = 1;
constexpr int TABLE_COS_SIN_CACHE = 2;

// The position row of frequency pair j under MRoPE: sectioned (Qwen2-VL), block i of the
// three sections takes row i; interleaved (Qwen3-VL), j takes row 1 if j % 3 == 1 and
// j < 3*h, row 2 if j % 3 == 2 and j < 3*w, else row 0.
__device__ __forceinline__ int mrope_row(int j, const int (&section)[3], int interleaved) {
  if (interleaved) {
    const int lane = j % 3;  // (selects, not section[lane]: no run-time index into params)
    const int bound = lane == 1 ? section[1] : section[2];
    return lane != 0 && j < 3 * bound ? lane : 0;
  }
  return (j >= section[0]) + (j >= section[0] + section[1]);
}

// The rows of both two-level tables at one position; cos/sin of pair j by angle addition.
struct TwoLevelRows {
  const float2* fine;
  const float2* coarse;

  __device__ __forceinline__ TwoLevelRows(const float2* fine_table, const float2* coarse_table,
                                          long long position, int pairs)
      : fine(fine_table + (position & ((1 << FINE_BITS) - 1)) * pairs),
        coarse(coarse_table + (position >> FINE_BITS) * pairs) {}

  __device__ __forceinline__ float2 cos_sin(int j) const {
    const float2 f = fine[j];
    const float2 c = coarse[j];
    return make_float2(fmaf(c.x, f.x, -c.y * f.y), fmaf(c.y, f.x, c.x * f.y));
  }
};

template <typename T, bool NEOX, int VEC, int ROTARY_DIM, int TABLE>
__global__ void rope_rotate(const RopeParams p) {
  const T* q_in = static_cast<const T*>(p.q_in);
  T* q_out = static_cast<T*>(p.q_out);
  const T* k_in = static_cast<const T*>(p.k_in);
  T* k_out = static_cast<T*>(p.k_out);
  const int q_heads = p.q_heads, k_heads = p.k_heads, batch = p.batch, seq = p.seq;
  const int tail_chunks = p.tail_chunks;
  const float2* fine = p.fine;
  const float2* coarse = p.coarse;
  const int rotary_dim = ROTARY_DIM > 0 ? ROTARY_DIM : p.rotary_dim;
  const int pairs = rotary_dim / 2;
  const int rotate_chunks = pairs / (NEOX || VEC == 1 ? VEC : VEC / 2);

  const long long token = static_cast<long long>(blockIdx.x) * blockDim.z + threadIdx.z;
  if (token >= static_cast<long long>(batch) * seq) return;
  const int b = static_cast<int>(token / seq);
  const int s = static_cast<int>(token - static_cast<long long>(b) * seq);

  const int total_heads = q_heads + k_heads;
  auto row_in = [&](int h) -> const T* {
    return h < q_heads ? q_in + b * p.q_in_stride[0] + s * p.q_in_stride[1] + h * p.q_in_stride[2]
                       : k_in + b * p.k_in_stride[0] + s * p.k_in_stride[1] +
                             (h - q_heads) * p.k_in_stride[2];
  };
  auto row_out = [&](int h) -> T* {
    return h < q_heads ? q_out + b * p.q_out_stride[0] + s * p.q_out_stride[1] +
                             h * p.q_out_stride[2]
                       : k_out + b * p.k_out_stride[0] + s * p.k_out_stride[1] +
                             (h - q_heads) * p.k_out_stride[2];
  };

  // Columns at or past rotary_dim are copied unchanged (out-of-place launches only).
  for (int chunk = rotate_chunks + threadIdx.x; chunk < rotate_chunks + tail_chunks;
       chunk += blockDim.x) {
    const int column = rotary_dim + (chunk - rotate_chunks) * VEC;
    for (int h = threadIdx.y; h < total_heads; h += blockDim.y) {
      *reinterpret_cast<Pack<T, VEC>*>(row_out(h) + column) =
          *reinterpret_cast<const Pack<T, VEC>*>(row_in(h) + column);
    }
  }

  // position row `row` of the token (rows other than 0 exist under MRoPE only)
  auto position_of_row = [&](int row) {
    const long long id = token + row * (static_cast<long long>(batch) * seq);
    return token_position(p.ids, p.ids_is_int64, p.offsets, p.offsets_is_int64,
                          p.position_offset, b, s, id, p.position_limit, p.error_flag);
  };
  auto rotate_all = [&](auto cos_sin_of) {
    for (int chunk = threadIdx.x; chunk < rotate_chunks; chunk += blockDim.x) {
      rotate_chunk<T, NEOX, VEC>(chunk, pairs, cos_sin_of, p.sin_sign, total_heads, row_in,
                                 row_out);
    }
  };
  const long long position = position_of_row(0);
  if constexpr (TABLE == TABLE_TWO_LEVEL) {
    const TwoLevelRows rows(fine, coarse, position, pairs);
    rotate_all([=](int j) { return rows.cos_sin(j); });
  } else if constexpr (TABLE == TABLE_MROPE) {
    const TwoLevelRows rows[3] = {TwoLevelRows(fine, coarse, position, pairs),
                                  TwoLevelRows(fine, coarse, position_of_row(1), pairs),
                                  TwoLevelRows(fine, coarse, position_of_row(2), pairs)};
    rotate_all([&](int j) {
      const int row = mrope_row(j, p.mrope_section, p.mrope_interleaved);
      return (row == 0 ? rows[0] : row == 1 ? rows[1] : rows[2]).cos_sin(j);
    });
  } else {
    const float* cache_row = p.cos_sin_cache + position * rotary_dim;
    rotate_all([=](int j) { return make_float2(cache_row[j], cache_row[pairs + j]); });
  }
}
