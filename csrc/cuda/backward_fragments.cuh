// What the two tensor-core backwards (attention_backward_tc.cuh by mma.sync,
// attention_backward_wgmma.cuh by wgmma) do alike: the rows' statistics, a key tile's sweep over
// the query tiles, P and dS from a warp's scores, and the stores of the dQ, dK and dV accumulators.
#pragma once

#include "backward.cuh"
#include "tensor_core.cuh"

namespace rudnn::cuda {

// A per-row value (lse, or D) of a warp's fragment rows row0 + 16 mi + g (+ 8) of a head (its rows
// from `rows`), `past` beyond the queries (lse +inf, where P is then 0; D 0).
template <int kMI>
__device__ __forceinline__ void fragment_row_values(const AttentionParams& p, const float* values, int64_t rows,
                                                    int64_t row0, float past, float (&x)[kMI][2]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = row0 + 16 * mi + lane / 4 + 8 * r;
      x[mi][r] = i < p.queries ? values[rows + i] : past;
    }
}

// The dQ kernels' D of a warp's fragment rows row0 + 16 mi + g (+ 8) of head (b, h) (its rows from
// `rows`): rowsum(dO ∘ O) from the rounded output, as FlashAttention forms it, less dLSE, in
// float32, 0 past the queries. The warp owns these rows, so it stores them for the dK/dV and
// mask-gradient kernels that run after it and waits on no one. Each lane of a quad sums every
// fourth 8-column chunk of its two rows (Ev <= kEv), every load issued before the first returns,
// and the quad adds up.
template <typename scalar_t, int kEv, int kMI>
__device__ __forceinline__ void form_fragment_delta(const AttentionParams& p, const BackwardArgs<float>& a, int64_t b,
                                                    int64_t h, int64_t rows, int64_t row0, float (&delta)[kMI][2]) {
  const int lane = threadIdx.x % 32, t = lane % 4;
  const int Ev = static_cast<int>(p.value_dim);
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = row0 + 16 * mi + lane / 4 + 8 * r;
      float sum = 0.0f;
      if (i < p.queries) {
        const scalar_t* dout = at_row<scalar_t>(a.dout, a.dout_strides, b, h, i);
        const scalar_t* out = at_row<scalar_t>(a.out, a.out_strides, b, h, i);
#pragma unroll
        for (int c = 8 * t; c < kEv; c += 32) {
          if (c >= Ev) break;
          scalar_t x[8] = {}, y[8] = {};
          load_run<8>(dout + c * a.dout_strides.col, a.dout_strides.col, Ev - c, x);
          load_run<8>(out + c * a.out_strides.col, a.out_strides.col, Ev - c, y);
#pragma unroll
          for (int e = 0; e < 8; ++e) sum += static_cast<float>(x[e]) * static_cast<float>(y[e]);
        }
      }
      delta[mi][r] = sum;
    }
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = row0 + 16 * mi + lane / 4 + 8 * r;
      float& sum = delta[mi][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (i < p.queries) {
        if (a.grad_lse != nullptr) sum -= a.grad_lse[rows + i];
        if (t == 0) a.delta[rows + i] = sum;
      }
    }
}

// lse and D of query rows [i0, i0 + kRows) of head h into stats[0, kRows) and stats[kRows, 2 kRows),
// by the block's first 2 kRows threads: by cp.async in the caller's next group where every row is
// a query (the common case: a load the thread would otherwise wait on), else read and stored, past
// the last query as a row no key reaches (lse +inf, D 0).
template <int kRows>
__device__ __forceinline__ void rows_statistics_to_smem(const AttentionParams& p, const BackwardArgs<float>& a,
                                                        float* stats, int64_t b, int64_t h, int64_t i0) {
  if (threadIdx.x >= 2 * kRows) return;
  const bool second = threadIdx.x >= kRows;
  const int r = threadIdx.x % kRows;
  const int64_t i = i0 + r;
  const float* src = (second ? a.delta : a.lse_unit) + (b * p.heads + h) * p.queries + i;
  float* dst = stats + (second ? kRows : 0) + r;
  if (i0 + kRows <= p.queries) {
    cp_async_small(dst, src, 4);
  } else {
    *dst = i < p.queries ? *src : second ? 0.0f : INFINITY;
  }
}

// A key tile's sweep in the dK/dV kernels, for one query head: the query tiles of `tile_rows`
// rows that see keys [j0, j0 + keys) (their documents; causal: from the first key's frontier on).
struct KeySweep {
  int64_t first, tiles;
};
__device__ __forceinline__ KeySweep key_sweep(const AttentionParams& p, const BackwardArgs<float>& a, int64_t b,
                                              int64_t hk, int64_t j0, int keys, int tile_rows) {
  const RowRange queries = document_queries(p, b, j0, keys, tile_rows);
  int64_t first = queries.begin / tile_rows;
  if (p.is_causal && a.kv_finite[b * p.kv_heads + hk]) {
    first = max(first, max(int64_t{0}, j0 - (p.shard.query_start - p.shard.key_start)) / tile_rows);
  }
  return {first, max(int64_t{0}, (queries.end + tile_rows - 1) / tile_rows - first)};
}

// One element of fragment_gradients: the score x becomes P (0 where dropout drops it) and, with
// kWithDs, dp becomes dS = P (M dP - D); kept_bit: its keep bit, read only with dropout; kept:
// the multiplier of a kept element.
template <bool kWithDs>
__device__ __forceinline__ void element_gradient(const AttentionParams& p, float& x, float& dp, float lse, float delta,
                                                 bool kept_bit, float kept) {
  const float prob = exp2_ftz(x - lse);
  const bool dropped = p.has_dropout && !kept_bit;
  if constexpr (kWithDs) {
    const float m = p.has_dropout ? (dropped ? 0.0f : kept) : 1.0f;
    dp = prob * (dp * m - delta);
  }
  x = dropped ? 0.0f : prob;
}

// P (zero where dropout drops) into s and, kWithDs, dS = P (M dP - D) into dp, for a warp's
// fragment tile; lse and delta of the fragment's rows (lse * kTcUnit, +inf where a row has no keys
// or is past the end); keep: fragment_keep_bits of the tile, read only with dropout.
template <bool kWithDs, int kMI, int kNB>
__device__ __forceinline__ void fragment_gradients(const AttentionParams& p, float (&s)[kMI][kNB][4],
                                                   float (&dp)[kMI][kNB][4], const float (&lse)[kMI][2],
                                                   const float (&delta)[kMI][2], const uint32_t (&keep)[kMI]) {
  const float kept = static_cast<float>(p.rng.keep_scale);
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        element_gradient<kWithDs>(p, s[mi][nb][e], dp[mi][nb][e], lse[mi][e / 2], delta[mi][e / 2],
                                  (keep[mi] >> (4 * nb + e)) & 1, kept);
      }
}

// Stores a warp's 16-row accumulator (rows row0 + g, row0 + g + 8 of a contiguous tensor of
// `rows` rows) times `factor`.
template <typename scalar_t, int kCols>
__device__ __forceinline__ void store_rows_tc(const float (&acc)[kCols / 8][4], float factor, scalar_t* out,
                                              int64_t row0, int64_t rows, int cols) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = row0 + lane / 4 + 8 * r;
    if (i >= rows) continue;
#pragma unroll
    for (int c = 0; c < kCols / 8; ++c) {
      store_pair(out + i * cols, 8 * c + 2 * (lane % 4), cols, acc[c][2 * r] * factor, acc[c][2 * r + 1] * factor);
    }
  }
}

// Which of dK and dV a launch of the dK/dV kernel computes: wide heads take one launch for each,
// so that one accumulator fits in registers (dV needs neither dP nor dS).
enum KeyGrads : int { kGradK = 1, kGradV = 2, kGradKV = 3 };

}  // namespace rudnn::cuda
