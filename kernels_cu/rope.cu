// Rotary position embedding: one kernel family for every RoPE op, both directions, and the
// in-place Q/K component.
//
// Work layout: blockIdx.x covers `threadDim.z` tokens; threadIdx.x is a chunk of a head row
// (VEC pairs of a neox row, or VEC interleaved elements), threadIdx.y strides over the heads
// of q then k. cos/sin of a chunk are formed once per token and reused for every head.
// Where cos/sin come from is the TABLE template argument (TABLE_* below): the two-level
// tables, the same at a position row chosen per pair (MRoPE), or the caller's cos_sin_cache.
// Two other layouts take launches the plan (tileops_cupy._rotate) gives them: mid sizes,
// whole rows in 16-byte packs (rope_rotate_packs); large launches at sequential positions,
// one chunk of one row a thread with a token's cos/sin formed once a block in shared memory
// (rope_rotate_shared, on devices of an H100's memory bandwidth a multiprocessor or less).
//
// Fused QK-RMSNorm (the NORM instantiations): each head row is first scaled, in float32, by
// 1/sqrt(mean(x*x) + eps) over its whole head_dim and by (weight + offset) per column, then
// rotated, then rounded once. The x-lanes of one (token, head) are a power-of-two group inside
// a warp (the launch plan makes blockDim.x so): the sum of squares is reduced with shuffles in
// that group before any of the row is written, so the rows may be rotated in place. Two lane
// layouts (the NORM template argument): NORM_CHUNKS, any view, x-lanes over chunks of pairs as
// the plain rotation; NORM_ROWS, large in-place launches of whole-row rotations, one 16-byte
// pack of a row a lane (rotate_rows_in_place).
//
// The 16-bit float types and their conversions: common.cuh, prepended by the loader.

// VEC elements moved as one access (16 bytes when VEC * sizeof(T) == 16).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T>
constexpr bool IS_BF16 = false;
template <>
constexpr bool IS_BF16<bfloat16_t> = true;

// Element e of a loaded pack as float. bf16 elements are read through the 32-bit word that
// holds two of them (word_low / word_high, common.cuh): the upper one is then a mask, where
// extracting it first cost a second instruction. (The fused norm is bound by instruction
// issue: N32768 went from 76.4% to 78.6% of the copy ceiling.)
template <typename T, int VEC>
__device__ __forceinline__ float element_float(const Pack<T, VEC>& pack, int e) {
  if constexpr (IS_BF16<T> && VEC % 2 == 0) {
    u32 word;
    memcpy(&word, &pack.v[e & ~1], 4);
    return e & 1 ? word_high<T>(word) : word_low<T>(word);
  } else {
    return to_float(pack.v[e]);
  }
}

// One operand of the launch: q or k, read from `in`, written to `out` (may alias `in`).
struct Rows {
  const char* in;
  char* out;
};

// This thread's index in its block, x fastest: the order in which CUDA packs a block's threads
// into warps.
__device__ __forceinline__ int thread_in_block() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

// FINE_BITS: positions below 2**FINE_BITS index the fine table (defined by the host,
// tileops_cupy._tables, which builds the tables).

// The per-sequence offset of sequence b (0 without offsets).
__device__ __forceinline__ long long sequence_offset(const void* offsets, int offsets_is_int64,
                                                     int b) {
  if (offsets == nullptr) return 0;
  return offsets_is_int64 ? static_cast<const long long*>(offsets)[b]
                          : static_cast<long long>(static_cast<const int*>(offsets)[b]);
}

// A position within [0, position_limit): out-of-range positions raise the error flag and are
// clamped, so no table is ever read out of bounds.
__device__ __forceinline__ long long bounded_position(long long position,
                                                      long long position_limit,
                                                      volatile int* error_flag) {
  if (position < 0 || position >= position_limit) {
    *error_flag = 1;
    __threadfence_system();
    position = position < 0 ? 0 : position_limit - 1;
  }
  return position;
}

// Position of token (b, s): offset + per-sequence offset + (explicit id or s), bounded.
__device__ __forceinline__ long long token_position(const void* ids, int ids_is_int64,
                                                    const void* offsets, int offsets_is_int64,
                                                    long long position_offset, int b, int s,
                                                    long long token, long long position_limit,
                                                    volatile int* error_flag) {
  long long position = position_offset + sequence_offset(offsets, offsets_is_int64, b);
  if (ids != nullptr) {
    position += ids_is_int64 ? static_cast<const long long*>(ids)[token]
                             : static_cast<long long>(static_cast<const int*>(ids)[token]);
  } else {
    position += s;
  }
  return bounded_position(position, position_limit, error_flag);
}

// The pairs of one chunk of a head row (VEC pairs of a neox row, or VEC interleaved elements):
// their columns, cos/sin, and the rotation of loaded data. SPLIT: the two members of each pair
// come from two loads (neox, or interleaved read one element at a time when the view is not
// pair-aligned); otherwise one load holds both.
template <typename T, bool NEOX, int VEC>
struct Chunk {
  static constexpr bool SPLIT = NEOX || VEC == 1;
  static constexpr int PAIRS = SPLIT ? VEC : VEC / 2;
  static constexpr int LOADS = SPLIT ? 2 : 1;
  typedef Pack<T, VEC> Data[LOADS];
  int column[LOADS];  // first column of each load
  float cos_v[PAIRS], sin_v[PAIRS];

  // The columns alone (form() adds cos/sin): what a load needs.
  __device__ __forceinline__ Chunk(int chunk, int pairs) {
    column[0] = NEOX ? chunk * VEC : 2 * chunk * PAIRS;
    if constexpr (SPLIT) column[1] = NEOX ? pairs + chunk * VEC : column[0] + 1;
  }

  // cos_sin_of(pair) gives the pair's (cos, sin) at this token (the table mode's lookup)
  template <typename CosSinOf>
  __device__ __forceinline__ Chunk(int chunk, int pairs, CosSinOf cos_sin_of, float sin_sign)
      : Chunk(chunk, pairs) {
    form(chunk, cos_sin_of, sin_sign);
  }

  template <typename CosSinOf>
  __device__ __forceinline__ void form(int chunk, CosSinOf cos_sin_of, float sin_sign) {
    const int first_pair = chunk * PAIRS;
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
      const float2 cs = cos_sin_of(first_pair + i);
      cos_v[i] = cs.x;
      sin_v[i] = cs.y * sin_sign;
    }
  }

  __device__ __forceinline__ void load(const T* in, Data& data) const {
#pragma unroll
    for (int l = 0; l < LOADS; ++l) {
      data[l] = *reinterpret_cast<const Pack<T, VEC>*>(in + column[l]);
    }
  }

  // Rotate `data` into `out`; NORM first scales each element by scale * (its column's weight).
  template <bool NORM>
  __device__ __forceinline__ void rotate_store(const Data& data, T* out, float scale,
                                               const float (&weight)[LOADS][VEC]) const {
    Pack<T, VEC> y[LOADS];
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
      const int e1 = SPLIT ? i : 2 * i;      // element of load 0 holding x1
      const int e2 = SPLIT ? i : 2 * i + 1;  // element of load LOADS-1 holding x2
      float x1 = element_float(data[0], e1);
      float x2 = element_float(data[LOADS - 1], e2);
      if constexpr (NORM) {
        x1 *= scale * weight[0][e1];
        x2 *= scale * weight[LOADS - 1][e2];
      }
      y[0].v[e1] = from_float<T>(fmaf(x1, cos_v[i], -x2 * sin_v[i]));
      y[LOADS - 1].v[e2] = from_float<T>(fmaf(x2, cos_v[i], x1 * sin_v[i]));
    }
#pragma unroll
    for (int l = 0; l < LOADS; ++l) *reinterpret_cast<Pack<T, VEC>*>(out + column[l]) = y[l];
  }
};

// What the NORM instantiations need beyond the rotation (unused by the others).
struct RowNorm {
  // (weight + offset) in float32 of every column, q's row then k's: the block's shared copy
  // (stage_norm_weights), so one path reads float32 and data-typed weights alike, and a
  // weight read is not ordered behind the row stores it might alias, as a global load is.
  const float* weights;
  float eps;
  int q_heads;        // rows below this are q's (q's weight), the rest k's
  int rotate_chunks;  // chunks of pairs in a row
  int tail_chunks;    // VEC-wide chunks past rotary_dim
  int rotary_dim;
  int head_dim;
  float inverse_head_dim;  // 1/head_dim: exact for the usual power-of-two head_dims
  unsigned group_mask;     // the lanes of this thread's row group (group_mask_of())
  bool has_others;         // some lane holds more of a row than its first chunk
  bool live;               // this thread's token exists (a thread past the last one stays
                           // for the reductions: the warp shuffles with a constant mask)
  bool full_warps;         // the block is whole warps (else shuffles name the group's lanes)

  // The lanes (a power-of-two group of blockDim.x <= 32, aligned in the warp) sharing
  // this thread's row.
  __device__ __forceinline__ static unsigned group_mask_of() {
    const unsigned lanes = blockDim.x;
    const unsigned lane = thread_in_block() & 31;
    return lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1) << (lane & ~(lanes - 1));
  }

  // (weight + offset) of VEC columns from `column`, of k's weight when is_k
  template <typename T, int VEC>
  __device__ __forceinline__ void weights_of(bool is_k, int column, float (&w)[VEC]) const {
    const float* from = weights + (is_k ? head_dim : 0) + column;
    if constexpr (VEC % 4 == 0) {  // 16-byte shared loads: the plan makes head_dim and column
#pragma unroll                     // multiples of VEC for these widths
      for (int i = 0; i < VEC; i += 4) {
        const float4 four = *reinterpret_cast<const float4*>(from + i);
        w[i] = four.x, w[i + 1] = four.y, w[i + 2] = four.z, w[i + 3] = four.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) w[i] = from[i];
    }
  }

  template <typename T, bool NEOX, int VEC>
  __device__ __forceinline__ void chunk_weights(const Chunk<T, NEOX, VEC>& c, bool is_k,
                                                float (&w)[Chunk<T, NEOX, VEC>::LOADS][VEC]) const {
#pragma unroll
    for (int l = 0; l < Chunk<T, NEOX, VEC>::LOADS; ++l) weights_of<T, VEC>(is_k, c.column[l], w[l]);
  }

  template <typename T, int VEC>
  __device__ __forceinline__ static float squares(const Pack<T, VEC>& x) {
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) sum = fmaf(element_float(x, i), element_float(x, i), sum);
    return sum;
  }

  // Sum of squares of what this lane holds of row `in` beyond its first chunk (the chunks of
  // later rounds, when a row has more chunks than the group has lanes, and the tail), read
  // before anything of the row is written.
  template <typename T, bool NEOX, int VEC, typename CosSinOf>
  __device__ __forceinline__ float other_squares(const T* in, int pairs,
                                                 CosSinOf cos_sin_of) const {
    float sum = 0.f;
    for (int chunk = threadIdx.x + blockDim.x; chunk < rotate_chunks; chunk += blockDim.x) {
      const Chunk<T, NEOX, VEC> c(chunk, pairs, cos_sin_of, 1.f);  // (its columns only)
      typename Chunk<T, NEOX, VEC>::Data data;
      c.load(in, data);
#pragma unroll
      for (int l = 0; l < Chunk<T, NEOX, VEC>::LOADS; ++l) sum += squares<T, VEC>(data[l]);
    }
    for (int t = threadIdx.x; t < tail_chunks; t += blockDim.x) {
      sum += squares<T, VEC>(*reinterpret_cast<const Pack<T, VEC>*>(in + rotary_dim + t * VEC));
    }
    return sum;
  }

  // The sum over the group: a butterfly whose depth is picked once (blockDim.x is the same
  // for the whole block); each xor offset is below the group's width, so every exchange stays
  // inside the group. FULL: every lane of the warp is here (a constant mask: a shuffle with a
  // run-time mask costs five more instructions, to check the warp's convergence).
  template <bool FULL>
  __device__ __forceinline__ float group_sum(float sum) const {
    const unsigned mask = FULL ? 0xffffffffu : group_mask;
    switch (blockDim.x) {
      case 32:
        sum += __shfl_xor_sync(mask, sum, 16);
        [[fallthrough]];
      case 16:
        sum += __shfl_xor_sync(mask, sum, 8);
        [[fallthrough]];
      case 8:
        sum += __shfl_xor_sync(mask, sum, 4);
        [[fallthrough]];
      case 4:
        sum += __shfl_xor_sync(mask, sum, 2);
        [[fallthrough]];
      case 2:
        sum += __shfl_xor_sync(mask, sum, 1);
        break;
      default:
        break;
    }
    return sum;
  }

  // 1/rms of a row from each lane's share of its sum of squares (every lane of the group
  // ends with the same sum: each butterfly step adds the same two values in either order).
  // rsqrtf (within 2 float32 units) where 1/sqrtf(sum/head_dim) cost three IEEE slow-path
  // calls a row, most of the kernel's instructions; the contract allows 4e-6 relative.
  __device__ __forceinline__ float inverse_rms(float sum) const {
    sum = full_warps ? group_sum<true>(sum) : group_sum<false>(sum);
    return rsqrtf(fmaf(sum, inverse_head_dim, eps));
  }

  // Write what this lane holds of the row beyond its first chunk: the later rounds' chunks
  // (normalised and rotated) and the tail (normalised only).
  template <typename T, bool NEOX, int VEC, typename CosSinOf>
  __device__ __forceinline__ void write_others(const T* in, T* out, bool is_k, float scale,
                                               int pairs, CosSinOf cos_sin_of,
                                               float sin_sign) const {
    typedef Chunk<T, NEOX, VEC> C;
    for (int chunk = threadIdx.x + blockDim.x; chunk < rotate_chunks; chunk += blockDim.x) {
      const C c(chunk, pairs, cos_sin_of, sin_sign);
      float w[C::LOADS][VEC];
      chunk_weights(c, is_k, w);
      typename C::Data data;
      c.load(in, data);
      c.template rotate_store<true>(data, out, scale, w);
    }
    for (int t = threadIdx.x; t < tail_chunks; t += blockDim.x) {
      const int column = rotary_dim + t * VEC;
      float w[VEC];
      weights_of<T, VEC>(is_k, column, w);
      const Pack<T, VEC> x = *reinterpret_cast<const Pack<T, VEC>*>(in + column);
      Pack<T, VEC> y;
#pragma unroll
      for (int i = 0; i < VEC; ++i) y.v[i] = from_float<T>(element_float(x, i) * (scale * w[i]));
      *reinterpret_cast<Pack<T, VEC>*>(out + column) = y;
    }
  }
};

// Rotate one chunk of every head row of a token: cos/sin formed once, heads loaded HEADS at a
// time (their loads issued before the first use), in rounds over the block's y-lanes
// (tileops_cupy._rotate picks HEADS by dtype, layout and launch size, and sizes the launch by
// it). NORM: the chunk is this lane's first (threadIdx.x); the lane also handles the rest of
// its share of each row (RowNorm), and a lane past the last chunk still joins the rows'
// reductions.
template <typename T, bool NEOX, int VEC, bool NORM, int HEADS, typename CosSinOf, typename RowIn,
          typename RowOut>
__device__ __forceinline__ void rotate_chunk(int chunk, int pairs, CosSinOf cos_sin_of,
                                             float sin_sign, int total_heads, RowIn row_in,
                                             RowOut row_out, const RowNorm& norm) {
  typedef Chunk<T, NEOX, VEC> C;
  const bool active = !NORM || (chunk < norm.rotate_chunks && norm.live);
  const bool others = NORM && norm.has_others && norm.live;
  const C c(active ? chunk : 0, pairs, cos_sin_of, sin_sign);

  // (the same number of rounds for every thread of the block: NORM's shuffles need the
  // whole warp at each)
  for (int first = 0; first < total_heads; first += blockDim.y * HEADS) {
    const int h0 = first + threadIdx.y;
    typename C::Data data[HEADS];
#pragma unroll
    for (int u = 0; u < HEADS; ++u) {
      const int h = h0 + u * blockDim.y;
      if (h < total_heads && active) c.load(row_in(h), data[u]);
    }
    float scale[HEADS];  // NORM: 1/rms of each row
    if constexpr (NORM) {
#pragma unroll
      for (int u = 0; u < HEADS; ++u) {
        const int h = h0 + u * blockDim.y;  // the same for every lane of the group
        float sum = 0.f;
        if (h < total_heads) {
          if (active) {
#pragma unroll
            for (int l = 0; l < C::LOADS; ++l) sum += RowNorm::squares<T, VEC>(data[u][l]);
          }
          if (others) sum += norm.other_squares<T, NEOX, VEC>(row_in(h), pairs, cos_sin_of);
        }
        scale[u] = norm.inverse_rms(sum);
      }
    }
#pragma unroll
    for (int u = 0; u < HEADS; ++u) {
      const int h = h0 + u * blockDim.y;
      if (h >= total_heads) break;
      const bool is_k = NORM && h >= norm.q_heads;
      if (others) {
        norm.write_others<T, NEOX, VEC>(row_in(h), row_out(h), is_k, scale[u], pairs,
                                        cos_sin_of, sin_sign);
      }
      if (active) {
        // NORM: the row's weights, read here from shared memory rather than held for q and
        // k from the start: holding both cost 70 registers a thread, half the occupancy
        float weight[C::LOADS][VEC];
        if constexpr (NORM) norm.chunk_weights(c, is_k, weight);
        c.template rotate_store<NORM>(data[u], row_out(h), scale[u], weight);
      }
    }
  }
}

// Lane layouts of the fused norm (rope_rotate's NORM argument; 0: no norm).
constexpr int NORM_CHUNKS = 1;
constexpr int NORM_ROWS = 2;

// NORM_ROWS: the fused norm in place on 16-bit rows of ROTARY_DIM elements, all of them
// rotated, 16-byte aligned. Each lane holds one 16-byte pack of a row (LANES lanes a row, 16
// for a bf16 D128 head; blockDim.x == LANES, a warp is one token's rows) and a neox pair's
// other half is the pack LANES/2 lanes away, its elements fetched by shuffle once normalised:
// one load and one store a lane per row, where NORM_CHUNKS holds both halves in every lane.
// Rows are taken HEADS at a time, the next round's loads issued before this round's
// arithmetic. The packs are 32-bit words end to end, loaded without a branch (a round past
// the last row reloads the last row and writes nothing): 16-bit element packs made the
// compiler repack halves right after each load, which waited for it and left one load in
// flight a lane (64.2 / 72.4% below). Every
// lane of a warp takes every round (the shuffles name the whole warp); a lane past the last
// token reads its block's last token and writes nothing. Measured on an H200 (32q/8kv D128
// bf16, packed tokens, % of the copy ceiling at N8192 / N32768): NORM_CHUNKS 68.2 / 78.7%,
// this layout 78.1 / 91.7%, and 79.2 / 92.8% since neox lanes shuffle normalised elements
// (_rotate says why its block, registers and HEADS).
struct alignas(16) RowPack {
  u32 word[4];
};

// 1/rms of a row of ROW_LENGTH elements spread over aligned groups of LANES lanes, VEC of them
// in each lane's x: the lane's sum of squares in index order, then a butterfly over its group
// (every lane of the group ends with the same sum, bit for bit: each step adds a pair in both
// orders, and float addition commutes). Every lane of the warp must call it.
template <int LANES, int ROW_LENGTH, int VEC>
__device__ __forceinline__ float inverse_rms_of_row(const float (&x)[VEC], float eps) {
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < VEC; ++i) sum = fmaf(x[i], x[i], sum);
#pragma unroll
  for (int offset = LANES / 2; offset > 0; offset /= 2) {
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  }
  return rsqrtf(fmaf(sum, 1.f / ROW_LENGTH, eps));
}

template <typename T, bool NEOX, int ROTARY_DIM, int HEADS, typename CosSinOf>
__device__ __forceinline__ void rotate_rows_in_place(T* q_token, T* k_token, int q_head_stride,
                                                     int k_head_stride, int q_heads,
                                                     int total_heads, CosSinOf cos_sin_of,
                                                     float sin_sign, const float* weights,
                                                     float eps, bool live) {
  static_assert(sizeof(T) == 2, "NORM_ROWS takes 16-bit rows");
  constexpr int VEC = 8;                 // elements a pack
  constexpr int LANES = ROTARY_DIM / VEC;
  constexpr int PAIRS = NEOX ? VEC : VEC / 2;  // pairs whose cos/sin this lane needs
  static_assert(LANES <= 32 && (LANES & (LANES - 1)) == 0, "a row is a power-of-two group");
  const int lane = threadIdx.x;
  const int column = lane * VEC;
  // neox: the first half's lanes hold x1 (y1 = x1 cos - x2 sin), the second half's x2
  // (y2 = x2 cos + x1 sin); the sign goes into sin, an exact product
  const float own_sign = NEOX && lane < LANES / 2 ? -sin_sign : sin_sign;
  float cos_v[PAIRS], sin_v[PAIRS];
#pragma unroll
  for (int i = 0; i < PAIRS; ++i) {
    const float2 cs = cos_sin_of(NEOX ? (lane % (LANES / 2)) * VEC + i : lane * PAIRS + i);
    cos_v[i] = cs.x;
    sin_v[i] = cs.y * own_sign;
  }
  // this lane's pack of row h: q's rows then k's, chosen by selects (no branch)
  auto pack_of = [&](int h) {
    const bool is_q = h < q_heads;
    T* const first = is_q ? q_token : k_token;
    const int index = is_q ? h : h - q_heads;
    return reinterpret_cast<RowPack*>(first + index * (is_q ? q_head_stride : k_head_stride) +
                                      column);
  };
  const int step = blockDim.y * HEADS;
  auto load_round = [&](int first, RowPack (&packs)[HEADS]) {
#pragma unroll
    for (int u = 0; u < HEADS; ++u) {
      const int h = first + threadIdx.y + u * blockDim.y;
      packs[u] = *pack_of(min(h, total_heads - 1));
    }
  };
  RowPack next[HEADS];
  load_round(0, next);
  for (int first = 0; first < total_heads; first += step) {
    RowPack data[HEADS];
#pragma unroll
    for (int u = 0; u < HEADS; ++u) data[u] = next[u];
    if (first + step < total_heads) load_round(first + step, next);
#pragma unroll
    for (int u = 0; u < HEADS; ++u) {
      const int h = first + threadIdx.y + u * blockDim.y;
      float x[VEC];
#pragma unroll
      for (int w = 0; w < VEC / 2; ++w) {
        x[2 * w] = word_low<T>(data[u].word[w]);
        x[2 * w + 1] = word_high<T>(data[u].word[w]);
      }
      const float scale = inverse_rms_of_row<LANES, ROTARY_DIM>(x, eps);
      // x * (scale * weight) of this lane's columns (a round past the last row: the last
      // row's weights, staged whether or not there is k); a neox lane takes its partner
      // half's the same way, already scaled (the lanes of a row hold the same sum, so the
      // same scale, bit for bit), where shuffling the raw words cost every lane the
      // partner's unpacking, weights and products again
      const bool of_q = min(h, total_heads - 1) < q_heads;
      const float4* weight =
          reinterpret_cast<const float4*>(weights + (of_q ? 0 : ROTARY_DIM) + column);
      float scaled[VEC];
#pragma unroll
      for (int i = 0; i < VEC; i += 4) {
        const float4 w = weight[i / 4];
        scaled[i] = x[i] * (scale * w.x), scaled[i + 1] = x[i + 1] * (scale * w.y);
        scaled[i + 2] = x[i + 2] * (scale * w.z), scaled[i + 3] = x[i + 3] * (scale * w.w);
      }
      float other[VEC];  // neox: the partner lane's scaled elements (every lane shuffles)
      if constexpr (NEOX) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          other[i] = __shfl_xor_sync(0xffffffffu, scaled[i], LANES / 2);
        }
      }
      if (h < total_heads && live) {
        float y[VEC];
#pragma unroll
        for (int i = 0; i < PAIRS; ++i) {
          if constexpr (NEOX) {
            y[i] = fmaf(scaled[i], cos_v[i], other[i] * sin_v[i]);
          } else {
            const float x1 = scaled[2 * i], x2 = scaled[2 * i + 1];
            y[2 * i] = fmaf(x1, cos_v[i], -x2 * sin_v[i]);
            y[2 * i + 1] = fmaf(x2, cos_v[i], x1 * sin_v[i]);
          }
        }
        RowPack out;
#pragma unroll
        for (int w = 0; w < VEC / 2; ++w) out.word[w] = pack_word<T>(y[2 * w], y[2 * w + 1]);
        *pack_of(h) = out;
      }
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
  // fused QK-RMSNorm (NORM instantiations): [head_dim] weights, each float32 or the data's type
  const void* q_norm_weight;
  const void* k_norm_weight;
  float norm_eps;
  float norm_weight_offset;
  int q_norm_weight_is_float32;
  int k_norm_weight_is_float32;
};

static_assert(sizeof(RopeParams) == 280, "RopeParams changed size: update this number");

// NORM: the block copies (weight + offset) of q's row, then k's, into `shared` as float32
// (RowNorm::weights; the launch gives 2 * head_dim floats of dynamic shared memory).
template <typename T>
__device__ __forceinline__ void stage_norm_weights(const RopeParams& p, int head_dim,
                                                   float* shared) {
  const int threads = blockDim.x * blockDim.y * blockDim.z;
  const int thread = thread_in_block();
  const int rows = p.k_norm_weight != nullptr ? 2 : 1;
  for (int i = thread; i < rows * head_dim; i += threads) {
    const bool is_k = i >= head_dim;
    const int column = is_k ? i - head_dim : i;
    const void* weight = is_k ? p.k_norm_weight : p.q_norm_weight;
    const bool is_float32 = is_k ? p.k_norm_weight_is_float32 : p.q_norm_weight_is_float32;
    const float w = is_float32 ? static_cast<const float*>(weight)[column]
                               : to_float(static_cast<const T*>(weight)[column]);
    shared[i] = w + p.norm_weight_offset;
  }
  __syncthreads();
}

// Where cos/sin of (token, pair) come from: the two-level tables at the token's position; the
// same at one of three position rows chosen per pair (MRoPE); or the caller's cos_sin_cache.
constexpr int TABLE_TWO_LEVEL = 0;
constexpr int TABLE_MROPE = 1;
constexpr int TABLE_COS_SIN_CACHE = 2;
// rope_rotate_packs alone: MRoPE whose lanes take their pairs' cos/sin in groups of one
// position row each (GROUP_PAIRS), from tables whose pairs are in the groups' order.
constexpr int TABLE_MROPE_GROUPED = 3;

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

// MRoPE with interleaved sections in rope_rotate_packs. There a lane rotates PAIRS consecutive
// pairs, which mrope_row spreads over up to three position rows: formed where they are, a
// lane's cos/sin took three positions and a row select a pair (1.7x the plain kernel's
// instructions, the performance log). Instead the pairs of each position row, in increasing
// order, make groups of GROUP_PAIRS (row 0's first, then row 1's, then row 2's), and grouped
// tables (tileops_cupy._rotate.grouped_pair_order) hold pair j at column
// (its group) * GROUP_PAIRS + j % GROUP_PAIRS: a lane's PAIRS consecutive columns (PAIRS
// divides GROUP_PAIRS, for every dtype) are pairs of one position row, so it forms their
// cos/sin as the plain kernel does (one position, 16-byte table loads), and every lane then
// takes each of its own pairs' from the lane that formed it, by shuffles. The host plans this
// only where each row's pairs fill whole groups holding one pair of each residue mod
// GROUP_PAIRS (Qwen3-VL's (24, 20, 20) at D128, for one), so a pair keeps its column's
// residue: entry j % PAIRS of the lane holding pair j. The column of each pair is a byte of
// the row after the grouped fine table (tileops_cupy._tables: RotaryTable.device_fine32):
// one load, where its closed form from the sections took a fifth of the kernel's
// instructions. GROUP_PAIRS is defined by the host (tileops_cupy._rotate, which orders the
// grouped tables).

// the position row of the pairs at column c of the grouped tables (a whole group's: one row):
// rows 0 and 1 hold PAIRS_OF_ROW - min(PAIRS_OF_ROW / 3, section[2]) pairs between them, row 1
// min((PAIRS_OF_ROW + 1) / 3, section[1]) (mrope_row's counts)
template <int PAIRS_OF_ROW>
__device__ __forceinline__ int grouped_row_of_column(int c, const int (&section)[3]) {
  const int row1 = min((PAIRS_OF_ROW + 1) / 3, section[1]);
  const int rows01 = PAIRS_OF_ROW - min(PAIRS_OF_ROW / 3, section[2]);
  return c < rows01 - row1 ? 0 : c < rows01 ? 1 : 2;
}

// the columns of the grouped tables that hold pairs first .. first + N - 1 (N divides
// GROUP_PAIRS, first a multiple of N): N bytes, at byte `first` of the row after the fine table
template <int N, int PAIRS_OF_ROW>
__device__ __forceinline__ void grouped_columns(const float2* fine, int first, int (&column)[N]) {
  static_assert(GROUP_PAIRS % N == 0 && N <= 4, "one aligned load of N bytes");
  const unsigned char* columns =
      reinterpret_cast<const unsigned char*>(fine + (1 << FINE_BITS) * PAIRS_OF_ROW) + first;
  const unsigned bytes = N == 4   ? *reinterpret_cast<const unsigned*>(columns)
                         : N == 2 ? *reinterpret_cast<const unsigned short*>(columns)
                                  : *columns;
#pragma unroll
  for (int i = 0; i < N; ++i) column[i] = (bytes >> (8 * i)) & 0xff;
}

// The rows of both two-level tables at one position; cos/sin of pair j by angle addition.
struct TwoLevelRows {
  const float2* fine;
  const float2* coarse;

  __device__ __forceinline__ TwoLevelRows(const float2* fine_table, const float2* coarse_table,
                                          long long position, int pairs)
      : fine(fine_table + (position & ((1 << FINE_BITS) - 1)) * pairs),
        coarse(coarse_table + (position >> FINE_BITS) * pairs) {}

  // (cos, sin) of hi*1024 + lo from the coarse entry (c_cos, c_sin) and the fine (f_cos, f_sin)
  __device__ __forceinline__ static float2 angle_sum(float c_cos, float c_sin, float f_cos,
                                                     float f_sin) {
    return make_float2(fmaf(c_cos, f_cos, -c_sin * f_sin), fmaf(c_sin, f_cos, c_cos * f_sin));
  }

  // pair j of the rows at `fine` and `coarse`
  __device__ __forceinline__ static float2 cos_sin_at(const float2* fine, const float2* coarse,
                                                      int j) {
    const float2 f = load_kept_in_l2(fine + j);
    const float2 c = load_kept_in_l2(coarse + j);
    return angle_sum(c.x, c.y, f.x, f.y);
  }

  __device__ __forceinline__ float2 cos_sin(int j) const { return cos_sin_at(fine, coarse, j); }

  // pairs j and j + 1 (j even) from one 16-byte load of each table
  __device__ __forceinline__ void cos_sin_two(int j, float2& first, float2& second) const {
    const float4 f = load_kept_in_l2(reinterpret_cast<const float4*>(fine + j));
    const float4 c = load_kept_in_l2(reinterpret_cast<const float4*>(coarse + j));
    first = angle_sum(c.x, c.y, f.x, f.y);
    second = angle_sum(c.z, c.w, f.z, f.w);
  }
};

// One token of a launch: its rows (q's heads, then k's) and its positions. The token's part of
// each address is formed once (a full 64-bit address per row cost a fifth of rope_rotate's
// instructions); the choice between q and k is a select, not a branch.
template <typename T>
struct TokenRows {
  const RopeParams& p;
  int q_heads, batch, seq;
  long long token;
  int b, s;
  const T* q_in;  // row 0 of the token's q and k
  T* q_out;
  const T* k_in;
  T* k_out;

  __device__ __forceinline__ TokenRows(const RopeParams& params, long long t)
      : p(params), q_heads(params.q_heads), batch(params.batch), seq(params.seq), token(t),
        b(static_cast<int>(t / seq)), s(static_cast<int>(t - static_cast<long long>(b) * seq)) {
    q_in = static_cast<const T*>(p.q_in) + b * p.q_in_stride[0] + s * p.q_in_stride[1];
    q_out = static_cast<T*>(p.q_out) + b * p.q_out_stride[0] + s * p.q_out_stride[1];
    k_in = static_cast<const T*>(p.k_in) + b * p.k_in_stride[0] + s * p.k_in_stride[1];
    k_out = static_cast<T*>(p.k_out) + b * p.k_out_stride[0] + s * p.k_out_stride[1];
  }

  __device__ __forceinline__ const T* in(int h) const {
    const bool is_q = h < q_heads;
    return (is_q ? q_in : k_in) +
           (is_q ? h : h - q_heads) * (is_q ? p.q_in_stride[2] : p.k_in_stride[2]);
  }

  __device__ __forceinline__ T* out(int h) const {
    const bool is_q = h < q_heads;
    return (is_q ? q_out : k_out) +
           (is_q ? h : h - q_heads) * (is_q ? p.q_out_stride[2] : p.k_out_stride[2]);
  }

  // position row `row` of the token (rows other than 0 exist under MRoPE only)
  __device__ __forceinline__ long long position(int row) const {
    const long long id = token + row * (static_cast<long long>(batch) * seq);
    return token_position(p.ids, p.ids_is_int64, p.offsets, p.offsets_is_int64,
                          p.position_offset, b, s, id, p.position_limit, p.error_flag);
  }
};

// f(cos_sin_of), where cos_sin_of(j) is (cos, sin) of the token's pair j in the TABLE mode
// (of `pairs` pairs a row): the two-level tables at its position, at a position row chosen per
// pair (MRoPE), or the caller's cos_sin_cache row.
template <int TABLE, typename T, typename F>
__device__ __forceinline__ void with_cos_sin(const TokenRows<T>& token, int pairs, F f) {
  const RopeParams& p = token.p;
  const long long position = token.position(0);
  if constexpr (TABLE == TABLE_TWO_LEVEL) {
    const TwoLevelRows rows(p.fine, p.coarse, position, pairs);
    f([=](int j) { return rows.cos_sin(j); });
  } else if constexpr (TABLE == TABLE_MROPE) {
    const TwoLevelRows rows[3] = {TwoLevelRows(p.fine, p.coarse, position, pairs),
                                  TwoLevelRows(p.fine, p.coarse, token.position(1), pairs),
                                  TwoLevelRows(p.fine, p.coarse, token.position(2), pairs)};
    f([&](int j) {
      // the table pointers selected, not the rows: selecting between rows (references),
      // NVRTC kept them in local memory once their loads were inline assembly
      // (load_kept_in_l2): 16 local loads a chunk, MRoPE N32768 94.7 -> 88.5% on an H100
      const int row = mrope_row(j, p.mrope_section, p.mrope_interleaved);
      const float2* fine = row == 0 ? rows[0].fine : row == 1 ? rows[1].fine : rows[2].fine;
      const float2* coarse = row == 0 ? rows[0].coarse : row == 1 ? rows[1].coarse : rows[2].coarse;
      return TwoLevelRows::cos_sin_at(fine, coarse, j);
    });
  } else {
    const float* cache_row = p.cos_sin_cache + position * (2 * pairs);
    f([=](int j) { return make_float2(cache_row[j], cache_row[pairs + j]); });
  }
}

// Blocks of ROPE_THREADS (NORM_ROWS: ROPE_ROWS_THREADS); the minimum blocks per SM cap the
// registers (defines from tileops_cupy._rotate, which sizes the launch and says why): some
// 16-bit neox kernels spill up to 36 bytes (sm_90: the MRoPE norm ones at the norm's cap, the
// run-time rotary_dim ones at the plain cap; tests/test_nvrtc.py keeps the counts); more
// registers cost more than spills. NORM: 0, or the fused norm's lane layout (NORM_CHUNKS,
// NORM_ROWS). HEADS: the heads a thread loads at once (rotate_chunk, rotate_rows_in_place).
template <typename T, bool NEOX, int VEC, int ROTARY_DIM, int TABLE, int NORM, int HEADS>
__global__ void __launch_bounds__(NORM == NORM_ROWS ? ROPE_ROWS_THREADS : ROPE_THREADS,
                                  NORM == NORM_ROWS ? ROPE_ROWS_MIN_BLOCKS
                                  : NORM            ? ROPE_NORM_MIN_BLOCKS
                                                    : ROPE_MIN_BLOCKS)
    rope_rotate(const RopeParams p) {
  const int q_heads = p.q_heads, k_heads = p.k_heads;
  const int tail_chunks = p.tail_chunks;
  const int rotary_dim = ROTARY_DIM > 0 ? ROTARY_DIM : p.rotary_dim;
  const int pairs = rotary_dim / 2;
  const int rotate_chunks = pairs / (NEOX || VEC == 1 ? VEC : VEC / 2);

  extern __shared__ __align__(16) float norm_weights[];  // NORM: stage_norm_weights
  if constexpr (NORM) stage_norm_weights<T>(p, rotary_dim + tail_chunks * VEC, norm_weights);

  const long long tokens = static_cast<long long>(p.batch) * p.seq;
  const long long thread_token = static_cast<long long>(blockIdx.x) * blockDim.z + threadIdx.z;
  const bool live = thread_token < tokens;
  if (!NORM && !live) return;
  // NORM: a thread past the last token stays for its warp's shuffles, reading the last token
  // (always in bounds) and writing nothing
  const TokenRows<T> token(p, live ? thread_token : tokens - 1);
  const int total_heads = q_heads + k_heads;
  auto row_in = [&](int h) { return token.in(h); };
  auto row_out = [&](int h) { return token.out(h); };

  // Columns at or past rotary_dim are copied unchanged (out-of-place launches only; NORM
  // writes them normalised).
  for (int chunk = rotate_chunks + threadIdx.x; !NORM && chunk < rotate_chunks + tail_chunks;
       chunk += blockDim.x) {
    const int column = rotary_dim + (chunk - rotate_chunks) * VEC;
    for (int h = threadIdx.y; h < total_heads; h += blockDim.y) {
      *reinterpret_cast<Pack<T, VEC>*>(row_out(h) + column) =
          *reinterpret_cast<const Pack<T, VEC>*>(row_in(h) + column);
    }
  }

  with_cos_sin<TABLE>(token, pairs, [&](auto cos_sin_of) {
    if constexpr (NORM == NORM_ROWS) {
      static_assert(ROTARY_DIM > 0, "NORM_ROWS rows are ROTARY_DIM elements, all rotated");
      rotate_rows_in_place<T, NEOX, ROTARY_DIM, HEADS>(
          token.q_out, token.k_out, static_cast<int>(p.q_out_stride[2]),
          static_cast<int>(p.k_out_stride[2]), q_heads, total_heads, cos_sin_of, p.sin_sign,
          norm_weights, p.norm_eps, live);
    } else if constexpr (NORM) {  // each lane: its first chunk, the rest of its share of every row
      const int head_dim = rotary_dim + tail_chunks * VEC;
      const RowNorm norm{norm_weights, p.norm_eps, q_heads, rotate_chunks, tail_chunks,
                         rotary_dim, head_dim, 1.f / head_dim, RowNorm::group_mask_of(),
                         rotate_chunks > static_cast<int>(blockDim.x) || tail_chunks > 0, live,
                         blockDim.x * blockDim.y * blockDim.z % 32 == 0};
      rotate_chunk<T, NEOX, VEC, true, HEADS>(threadIdx.x, pairs, cos_sin_of, p.sin_sign,
                                              total_heads, row_in, row_out, norm);
    } else {
      for (int chunk = threadIdx.x; chunk < rotate_chunks; chunk += blockDim.x) {
        rotate_chunk<T, NEOX, VEC, false, HEADS>(chunk, pairs, cos_sin_of, p.sin_sign,
                                                 total_heads, row_in, row_out, RowNorm{});
      }
    }
  });
}

// ------------------------------------------------------------------ cos/sin shared by a block

// The plain rotation of large launches at sequential positions (tileops_cupy._rotate's
// _shared_geometry says which): one chunk of one head row a thread (VEC pairs of a neox row,
// two accesses; or VEC interleaved elements, one), no loop, as a copy kernel moves its bytes;
// a block holds blockDim.y rows of one token (q's heads, then k's): the token's blocks are
// grid x (adjacent in launch order), the token blockIdx.z * gridDim.y + blockIdx.y (a grid
// of 65535 tokens a row), so a thread's place takes no division.
// The token's cos/sin are formed once a block into shared memory, a pair a thread, while the
// rows' loads are in flight: forming them per thread costs a thread more table traffic than
// its row (a thread per 16 bytes with per-thread cos/sin: 43.6% of the copy ceiling at bf16
// B8 S4096, the performance log), and holding several rows a thread to share them
// (rope_rotate, rope_rotate_packs) keeps fewer threads in flight. Every thread of a block
// waits for its table, so the few threads that form it hold up the block's bytes: at bf16
// B8 S4096 the batch index by a 64-bit division and a loop over pairs cost 1.6 points of the
// ceiling, positions read as ids (a load before the table's) lose to rope_rotate (the plan
// keeps them there), and the general position path (ids, offsets, the bound) cost a point
// against s + offset alone (98.5 against 99.5%: the table threads now take the sequential
// path alone). On a faster memory (an H200) a thread's 16 bytes in flight are too few: the
// plan keeps this layout to devices whose DRAM asks little of each multiprocessor (an H100).
// A thread's own work is kept to its loads, its stores and the rotation: the plan takes
// operands whose sequences are one run of rows (stride[0] == seq * stride[1], or one
// sequence), so a row's address is the token's index times stride[1]; the token's batch and
// seq indices (its position) are formed by the threads that form the table alone. Rows
// rotated whole at ROTARY_DIM (no tail).
template <typename T, bool NEOX, int VEC, int ROTARY_DIM>
__global__ void __launch_bounds__(ROPE_SHARED_THREADS, ROPE_SHARED_MIN_BLOCKS)
    rope_rotate_shared(const RopeParams p) {
  typedef Chunk<T, NEOX, VEC> C;
  constexpr int PAIRS = ROTARY_DIM / 2;
  static __shared__ float2 cos_sin[PAIRS];  // (static: one for all threads on host threads too)
  const unsigned token_index = blockIdx.z * gridDim.y + blockIdx.y;
  // the grid's last row of tokens may be partial (a whole block returns: no barrier missed)
  if (token_index >= static_cast<unsigned>(p.batch) * static_cast<unsigned>(p.seq)) return;
  const long long token = token_index;
  const int q_heads = p.q_heads, total_heads = q_heads + p.k_heads;
  const int h = blockIdx.x * blockDim.y + threadIdx.y;
  const bool is_q = h < q_heads;
  const long long head = is_q ? h : h - q_heads;
  const T* in = static_cast<const T*>(is_q ? p.q_in : p.k_in) +
                token * (is_q ? p.q_in_stride[1] : p.k_in_stride[1]) +
                head * (is_q ? p.q_in_stride[2] : p.k_in_stride[2]);
  const C columns(threadIdx.x, PAIRS);
  typename C::Data data;
  if (h < total_heads) columns.load(in, data);
  // a pair a thread (the plan's blocks hold PAIRS threads or more)
  const int thread = threadIdx.x + threadIdx.y * blockDim.x;
  if (thread < PAIRS) {
    // the plan's positions are sequential (no ids); the host has bounded offset + s, so only
    // per-sequence offsets (device values) take the bound: the path every thread of the block
    // waits for is kept short
    const unsigned seq = static_cast<unsigned>(p.seq), b = token_index / seq;
    long long position = p.position_offset + sequence_offset(p.offsets, p.offsets_is_int64, b) +
                         (token_index - b * seq);
    if (p.offsets != nullptr) position = bounded_position(position, p.position_limit, p.error_flag);
    cos_sin[thread] = TwoLevelRows(p.fine, p.coarse, position, PAIRS).cos_sin(thread);
  }
  __syncthreads();
  if (h >= total_heads) return;
  T* out = static_cast<T*>(is_q ? p.q_out : p.k_out) +
           token * (is_q ? p.q_out_stride[1] : p.k_out_stride[1]) +
           head * (is_q ? p.q_out_stride[2] : p.k_out_stride[2]);
  C chunk = columns;
  chunk.form(threadIdx.x, [&](int j) { return cos_sin[j]; }, p.sin_sign);
  const float no_weight[C::LOADS][VEC] = {};
  chunk.template rotate_store<false>(data, out, 1.f, no_weight);
}

// ------------------------------------------------------------------ whole rows, one pack a lane

// Element i of a 16-byte pack of T (16-bit: two a word, the first in the low half), as float.
template <typename T>
__device__ __forceinline__ float pack_element(const RowPack& pack, int i) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(pack.word[i]);
  } else {
    return i % 2 ? word_high<T>(pack.word[i / 2]) : word_low<T>(pack.word[i / 2]);
  }
}

// Word w of the 16-byte pack of T that holds the floats y, each rounded once.
template <typename T>
__device__ __forceinline__ u32 pack_word_of(const float* y, int w) {
  if constexpr (sizeof(T) == 4) {
    return __float_as_uint(y[w]);
  } else {
    return pack_word<T>(y[2 * w], y[2 * w + 1]);
  }
}

// The plain rotation of mid-sized launches of the common case, and of float32 interleaved
// launches of any size (tileops_cupy._rotate's _packs_layout says which): q, or q and k, at
// sequential or per-token positions, rows of ROTARY_DIM elements rotated whole, cos/sin from
// the two-level tables (under MRoPE at the one position row of a lane's pairs, where the
// sections fall on lane boundaries) or a caller's cos_sin_cache (TABLE). A row is LANES lanes
// of LANE_BYTES (VEC elements) each: a neox lane holds VEC/2 elements of each half (two
// accesses of LANE_BYTES / 2, 8 or 16 bytes: tileops_cupy._rotate's _packs_lane says which
// and why), so both members of its pairs; an interleaved lane one 16-byte pack. A lane takes
// ROWS rows of one operand of its token (group, group + groups, ...: the same columns,
// so its cos/sin are formed once for them; the two-level tables by 16-byte loads of two
// pairs), their loads issued before the position is read. A token's row groups are q's, then
// k's. Threads are numbered flat: beyond its rows a lane does two 32-bit divisions, one q/k
// select and the position, where rope_rotate's lanes also pay for 64-bit row indices, 8-byte
// table loads and rounds. Holding both halves, a neox lane needs VEC/2 pairs' cos/sin, not
// VEC, and no shuffle: the chain from a token's id through its table rows is half as long,
// which is what let per-token positions take this layout (_rotate has the measurements).
// NORM (16-bit rows): the fused QK-RMSNorm first, each row's sum of squares reduced over its
// LANES lanes (aligned groups of consecutive lanes: a token's rows are whole groups) by
// shuffles before any write, the weights of the lane's columns of its operand read once.
template <typename T, bool NEOX, int ROTARY_DIM, int LANE_BYTES, int ROWS, int TABLE, bool NORM>
__global__ void __launch_bounds__(ROPE_PACK_THREADS, ROPE_PACK_MIN_BLOCKS)
    rope_rotate_packs(const RopeParams p) {
  constexpr int VEC = LANE_BYTES / sizeof(T);  // elements a lane
  constexpr int HALF = VEC / 2;                // neox: elements a lane in each half of a row
  constexpr int PAIRS = VEC / 2;               // pairs a lane rotates
  constexpr int PACKS = LANE_BYTES / 16;       // 16-byte packs a lane holds of a row
  constexpr int LANES = ROTARY_DIM / VEC;      // lanes of a row, a power of two up to 32
  static_assert(LANES <= 32 && (LANES & (LANES - 1)) == 0, "a row is a warp or less");
  static_assert(LANE_BYTES == 16 || (LANE_BYTES == 32 && NEOX), "32 bytes: 16 of each half");
  // row groups of a token: q's, then k's (k_heads = 0 without k)
  const unsigned q_groups = static_cast<unsigned>(p.q_heads) / ROWS;
  const unsigned per_token = (q_groups + static_cast<unsigned>(p.k_heads) / ROWS) * LANES;
  const unsigned threads = static_cast<unsigned>(p.batch) * static_cast<unsigned>(p.seq) * per_token;
  const unsigned flat = blockIdx.x * ROPE_PACK_THREADS + threadIdx.x;
  // Lanes that shuffle (NORM; GROUPED: the grouped MRoPE tables) name the whole warp, since a
  // mask of the row's lanes made each shuffle a loop (bf16 D128 GROUPED: 488 SASS
  // instructions so, 416 with the whole warp, the sectioned kernel's 384). There a lane past
  // the last row stays for its warp's shuffles (the blocks are whole warps), reading the last
  // row (always in bounds) and writing nothing; such lanes make whole row groups of their
  // own. Elsewhere no lane waits on another (no shuffles, no barriers), and they leave.
  constexpr bool GROUPED = TABLE == TABLE_MROPE_GROUPED;
  constexpr bool SHUFFLES = NORM || GROUPED;
  if (!SHUFFLES && flat >= threads) return;
  const bool live = flat < threads;
  const unsigned thread = live ? flat : threads - 1;
  const unsigned token = thread / per_token;
  const unsigned in_token = thread - token * per_token;
  const int lane = static_cast<int>(in_token % LANES);
  const unsigned token_group = in_token / LANES;
  const bool of_k = token_group >= q_groups;
  const int group = static_cast<int>(of_k ? token_group - q_groups : token_group);
  // rows of the operand between a lane's rows
  const int groups = of_k ? p.k_heads / ROWS : static_cast<int>(q_groups);
  const unsigned seq = static_cast<unsigned>(p.seq);
  const int b = static_cast<int>(token / seq);
  const int s = static_cast<int>(token - static_cast<unsigned>(b) * seq);

  // the rows first: their loads are in flight while the position and table are read (head
  // strides within 32 bits: the plan checks). Element i of a lane is at column
  // lane * VEC + i (interleaved), or lane * HALF + i of the first half and i - HALF of the
  // second (neox).
  const int in_head = static_cast<int>(of_k ? p.k_in_stride[2] : p.q_in_stride[2]);
  const int out_head = static_cast<int>(of_k ? p.k_out_stride[2] : p.q_out_stride[2]);
  const int column = NEOX ? lane * HALF : lane * VEC;
  const T* in = static_cast<const T*>(of_k ? p.k_in : p.q_in) +
                b * (of_k ? p.k_in_stride[0] : p.q_in_stride[0]) +
                s * (of_k ? p.k_in_stride[1] : p.q_in_stride[1]) + group * in_head + column;
  T* out = static_cast<T*>(of_k ? p.k_out : p.q_out) +
           b * (of_k ? p.k_out_stride[0] : p.q_out_stride[0]) +
           s * (of_k ? p.k_out_stride[1] : p.q_out_stride[1]) + group * out_head + column;
  // the column of the lane's element i (i % HALF == 0 for neox)
  auto column_of = [&](int i) {
    return NEOX ? (i < HALF ? column + i : ROTARY_DIM / 2 + column + i - HALF) : column + i;
  };
  RowPack data[ROWS][PACKS];  // (32-byte neox lanes: the first half's pack, then the second's)
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const T* row = in + r * groups * in_head;
    if constexpr (PACKS == 2) {
      data[r][0] = *reinterpret_cast<const RowPack*>(row);
      data[r][1] = *reinterpret_cast<const RowPack*>(row + ROTARY_DIM / 2);
    } else if constexpr (NEOX) {
      const uint2 first = *reinterpret_cast<const uint2*>(row);
      const uint2 second = *reinterpret_cast<const uint2*>(row + ROTARY_DIM / 2);
      data[r][0].word[0] = first.x, data[r][0].word[1] = first.y;
      data[r][0].word[2] = second.x, data[r][0].word[3] = second.y;
    } else {
      data[r][0] = *reinterpret_cast<const RowPack*>(row);
    }
  }

  const int first_pair = lane * PAIRS;
  // MRoPE: the position row of the lane's pairs, all in one section (planned only so:
  // _rotate's _packs_table), or (GROUPED: interleaved sections) of the lane's columns of the
  // grouped tables, which hold other pairs than its own (GROUP_PAIRS)
  int source_column[GROUPED ? PAIRS : 1];  // GROUPED: the columns holding the lane's pairs
  if constexpr (GROUPED) {
    grouped_columns<PAIRS, ROTARY_DIM / 2>(p.fine, first_pair, source_column);
  }
  const long long tokens = static_cast<long long>(p.batch) * p.seq;
  const int position_row =
      TABLE == TABLE_MROPE ? mrope_row(first_pair, p.mrope_section, 0)
      : GROUPED            ? grouped_row_of_column<ROTARY_DIM / 2>(first_pair, p.mrope_section)
                           : 0;
  const long long id = token + position_row * tokens;
  const long long position = token_position(p.ids, p.ids_is_int64, p.offsets, p.offsets_is_int64,
                                            p.position_offset, b, s, id, p.position_limit,
                                            p.error_flag);
  float cos_v[PAIRS], sin_v[PAIRS];
  auto keep = [&](int i, float2 cos_sin) {
    cos_v[i] = cos_sin.x, sin_v[i] = cos_sin.y * p.sin_sign;
  };
  if constexpr (TABLE != TABLE_COS_SIN_CACHE) {
    const TwoLevelRows rows(p.fine, p.coarse, position, ROTARY_DIM / 2);
#pragma unroll
    for (int i = 0; i < PAIRS; i += 2) {
      float2 first, second;
      rows.cos_sin_two(first_pair + i, first, second);
      keep(i, first), keep(i + 1, second);
    }
  } else {
    const float* cache_row = p.cos_sin_cache + position * ROTARY_DIM;
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
      keep(i, make_float2(cache_row[first_pair + i], cache_row[ROTARY_DIM / 2 + first_pair + i]));
    }
  }
  if constexpr (GROUPED) {  // its own pair first_pair + i is entry i of the lane holding it
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
      const int from = static_cast<unsigned>(source_column[i]) / PAIRS;  // the lane holding it
      cos_v[i] = __shfl_sync(0xffffffffu, cos_v[i], from, LANES);
      sin_v[i] = __shfl_sync(0xffffffffu, sin_v[i], from, LANES);
    }
  }
  float weight[NORM ? VEC : 1];  // NORM: (weight + offset) of the lane's columns, its operand
  if constexpr (NORM) {
    const void* w = of_k ? p.k_norm_weight : p.q_norm_weight;
    const bool w_float32 = of_k ? p.k_norm_weight_is_float32 : p.q_norm_weight_is_float32;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const int c = column_of(i);  // (element loads: the weights may sit at any alignment)
      weight[i] = (w_float32 ? static_cast<const float*>(w)[c]
                             : to_float(static_cast<const T*>(w)[c])) + p.norm_weight_offset;
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float x[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      x[i] = pack_element<T>(data[r][i / (VEC / PACKS)], i % (VEC / PACKS));
    }
    if constexpr (NORM) {
      const float scale = inverse_rms_of_row<LANES, ROTARY_DIM>(x, p.norm_eps);
#pragma unroll
      for (int i = 0; i < VEC; ++i) x[i] = x[i] * (scale * weight[i]);
    }
    float y[VEC];
#pragma unroll
    for (int j = 0; j < PAIRS; ++j) {  // the pair (x0, x1) at elements (a, c) of the lane
      const int a = NEOX ? j : 2 * j, c = NEOX ? j + HALF : 2 * j + 1;
      y[a] = fmaf(x[a], cos_v[j], -x[c] * sin_v[j]);
      y[c] = fmaf(x[c], cos_v[j], x[a] * sin_v[j]);
    }
    if (SHUFFLES && !live) continue;
    T* const row = out + r * groups * out_head;
    if constexpr (PACKS == 2) {
      store_16_bytes(row, pack_word_of<T>(y, 0), pack_word_of<T>(y, 1), pack_word_of<T>(y, 2),
                     pack_word_of<T>(y, 3));
      store_16_bytes(row + ROTARY_DIM / 2, pack_word_of<T>(y, 4), pack_word_of<T>(y, 5),
                     pack_word_of<T>(y, 6), pack_word_of<T>(y, 7));
    } else if constexpr (NEOX) {
      store_8_bytes(row, pack_word_of<T>(y, 0), pack_word_of<T>(y, 1));
      store_8_bytes(row + ROTARY_DIM / 2, pack_word_of<T>(y, 2), pack_word_of<T>(y, 3));
    } else {
      store_16_bytes(row, pack_word_of<T>(y, 0), pack_word_of<T>(y, 1), pack_word_of<T>(y, 2),
                     pack_word_of<T>(y, 3));
    }
  }
}
