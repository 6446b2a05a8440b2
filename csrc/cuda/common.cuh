// Device helpers shared by the CUDA attention kernels: compute types, tiles in shared memory,
// the score rules (masks, causality, dropout) and warp reductions. No torch includes.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "../attention_params.h"

namespace rudnn::cuda {

constexpr int kWarpSize = 32;
constexpr int kWarps = 4;  // warps per block: a block works on one tile of 32 rows x 32 keys
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kTile = 32;

// float16/bfloat16/float32 compute in float32, float64 in float64.
template <typename scalar_t>
struct Compute {
  using type = float;
};
template <>
struct Compute<double> {
  using type = double;
};

// Rows a warp owns in a 32-row tile: 8 in float32, 4 in float64 (whose tiles have 16 rows),
// which keeps the per-thread accumulators within the register file.
template <typename acc_t>
constexpr int rows_per_warp() {
  return sizeof(acc_t) == 4 ? 8 : 4;
}

// Head-dim buckets: a thread holds kChunks x kVec consecutive-by-lane columns of a 32-lane row,
// column d = c * 32 * kVec + lane * kVec + e. One instantiation per bucket, not per head dim.
template <int kVecArg, int kChunksArg>
struct Bucket {
  static constexpr int kVec = kVecArg;
  static constexpr int kChunks = kChunksArg;
  static constexpr int kWidth = kVec * kChunks * kWarpSize;  // largest head dim it holds
};
using Bucket64 = Bucket<2, 1>;
using Bucket128 = Bucket<4, 1>;
using Bucket256 = Bucket<4, 2>;

__device__ __forceinline__ float exp_base(float x, bool base2) { return base2 ? exp2f(x) : expf(x); }
__device__ __forceinline__ double exp_base(double x, bool base2) { return base2 ? exp2(x) : exp(x); }
__device__ __forceinline__ float log_natural(float x) { return logf(x); }
__device__ __forceinline__ double log_natural(double x) { return log(x); }

// max that propagates NaN, as PyTorch's amax does (fmax would drop it and hide a NaN score).
template <typename T>
__device__ __forceinline__ T max_nan(T a, T b) {
  return (a != a || a > b) ? a : b;
}

template <typename T>
__device__ __forceinline__ T warp_max(T x) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o /= 2) x = max_nan(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Rounds to the input dtype and back: FlashAttention's rounding points in "flash" numerics.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t round_to(acc_t x) {
  return static_cast<acc_t>(static_cast<scalar_t>(x));
}

template <typename scalar_t>
__device__ __forceinline__ const scalar_t* at_row(const void* base, const Strides4& s, int64_t b, int64_t h,
                                                   int64_t row) {
  return static_cast<const scalar_t*>(base) + b * s.batch + h * s.head + row * s.row;
}

// Four consecutive elements of a row in global memory, as one 8-, 16- or 32-byte load.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void load4_global(const scalar_t* src, acc_t (&x)[4]) {
  if constexpr (sizeof(scalar_t) == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    const scalar_t* e = reinterpret_cast<const scalar_t*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = static_cast<acc_t>(e[i]);
  } else if constexpr (sizeof(scalar_t) == 4) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else {
    const double2 lo = reinterpret_cast<const double2*>(src)[0], hi = reinterpret_cast<const double2*>(src)[1];
    x[0] = lo.x, x[1] = lo.y, x[2] = hi.x, x[3] = hi.y;
  }
}

// Rows [row0, row0 + tile_rows) of head (b, h) of a (B, H, rows, cols) tensor into shared memory
// (tile_rows x ld, in the compute type, times `factor`). A warp per row, four columns per lane,
// one vector load each where the row is contiguous and aligned. Rows past `rows` and columns past
// `cols` are zero, so that padding adds nothing.
template <typename scalar_t, typename acc_t>
__device__ void load_tile(acc_t* tile, int ld, const void* base, const Strides4& s, int64_t b, int64_t h,
                          int64_t row0, int64_t rows, int cols, int tile_rows, acc_t factor = acc_t(1)) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (int r = warp; r < tile_rows; r += kWarps) {
    const bool valid = row0 + r < rows;
    const scalar_t* src = valid ? at_row<scalar_t>(base, s, b, h, row0 + r) : nullptr;
    for (int d = lane * 4; d < ld; d += kWarpSize * 4) {
      acc_t x[4] = {0, 0, 0, 0};
      if (valid) {
        const bool vector = s.col == 1 && d + 4 <= cols &&
                            reinterpret_cast<uintptr_t>(src + d) % (4 * sizeof(scalar_t)) == 0;
        if (vector) {
          load4_global<scalar_t>(src + d, x);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (d + e < cols) x[e] = static_cast<acc_t>(src[(d + e) * s.col]);
          }
        }
      }
      acc_t* dst = tile + r * ld + d;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (d + e < ld) dst[e] = x[e] * factor;  // float64 lane rows are 2 mod 4 elements long
      }
    }
  }
}

// Row stride (in elements) of a tile whose rows are read by different lanes in the same
// instruction: a multiple of 4 elements, with (stride * sizeof / 16) odd so that 16-byte reads of
// 8 consecutive rows hit distinct banks.
template <typename acc_t>
__host__ __device__ constexpr int lane_row_stride(int cols) {
  const int per16 = 16 / static_cast<int>(sizeof(acc_t));
  int stride = (cols + 3) / 4 * 4;
  if ((stride / per16) % 2 == 0) stride += per16;
  return stride;
}

// Columns padded to the bucket width: rows read whole by every lane (broadcast or lane chunks).
__host__ __device__ constexpr int padded_cols(int cols) { return (cols + 3) / 4 * 4; }

// N consecutive elements from 16-byte-aligned (N = 4) or 8/16-byte-aligned (N = 2) shared memory.
template <int N>
__device__ __forceinline__ void load_vec(const float* src, float (&x)[N]) {
  static_assert(N == 2 || N == 4, "vectors of 2 or 4");
  if constexpr (N == 4) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else {
    const float2 v = *reinterpret_cast<const float2*>(src);
    x[0] = v.x, x[1] = v.y;
  }
}
template <int N>
__device__ __forceinline__ void load_vec(const double* src, double (&x)[N]) {
  static_assert(N == 2 || N == 4, "vectors of 2 or 4");
#pragma unroll
  for (int e = 0; e < N; e += 2) {
    const double2 v = *reinterpret_cast<const double2*>(src + e);
    x[e] = v.x, x[e + 1] = v.y;
  }
}

// s[r] = dot(rows + r * ld_rows, lane_row) over n columns (a multiple of 4), for kRows rows read
// by the whole warp (broadcast) against a row owned by this lane: one lane-row read per 4 columns
// serves kRows dot products.
template <int kRows, typename acc_t>
__device__ __forceinline__ void dot_rows(const acc_t* rows, int ld_rows, const acc_t* lane_row, int n,
                                         acc_t (&s)[kRows]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) s[r] = 0;
  for (int d = 0; d < n; d += 4) {
    acc_t y[4];
    load_vec<4>(lane_row + d, y);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      acc_t x[4];
      load_vec<4>(rows + r * ld_rows + d, x);
#pragma unroll
      for (int e = 0; e < 4; ++e) s[r] = fma(x[e], y[e], s[r]);
    }
  }
}

// acc[r][c][e] += sum_jj w[jj][r] * tile[jj][c * 32 * kVec + lane * kVec + e] over `count` tile
// rows, with w[jj][r] = weights[jj * kRows + r]: a warp's kRows x count weights times the tile.
template <typename B, int kRows, typename acc_t>
__device__ __forceinline__ void accumulate_rows(acc_t (&acc)[kRows][B::kChunks][B::kVec], const acc_t* weights,
                                                const acc_t* tile, int ld, int count, int lane) {
  for (int jj = 0; jj < count; ++jj) {
    acc_t w[kRows];
#pragma unroll
    for (int r = 0; r < kRows; r += 4) {
      acc_t x[4];
      load_vec<4>(weights + jj * kRows + r, x);
#pragma unroll
      for (int e = 0; e < 4; ++e) w[r + e] = x[e];
    }
#pragma unroll
    for (int c = 0; c < B::kChunks; ++c) {
      acc_t v[B::kVec];
      load_vec<B::kVec>(tile + jj * ld + c * kWarpSize * B::kVec + lane * B::kVec, v);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int e = 0; e < B::kVec; ++e) acc[r][c][e] = fma(w[r], v[e], acc[r][c][e]);
      }
    }
  }
}

// The score rules of one element, on a raw score already multiplied by unit * scale: -inf for
// the padding of a partial tile; -inf added where the mask (bool) or causality excludes the key,
// as PyTorch's math path adds it, so that a NaN score stays NaN; + unit * mask for a float mask.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t adjust_score(const AttentionParams& p, acc_t s, int64_t b, int64_t h, int64_t i,
                                              int64_t j, acc_t unit) {
  const acc_t neg_inf = -INFINITY;
  if (i >= p.queries || j >= p.keys) return neg_inf;
  if (p.is_causal && j - i > p.shard.query_start - p.shard.key_start) s += neg_inf;
  if (p.mask_kind != MaskKind::kNone) {
    const Strides4& ms = p.mask_strides;
    const int64_t at = b * ms.batch + h * ms.head + i * ms.row + j * ms.col;
    if (p.mask_kind == MaskKind::kBool) {
      if (!static_cast<const bool*>(p.mask)[at]) s += neg_inf;
    } else if (p.mask_kind == MaskKind::kFloat32) {
      s += unit * static_cast<acc_t>(static_cast<const float*>(p.mask)[at]);
    } else {
      s += unit * static_cast<acc_t>(static_cast<const scalar_t*>(p.mask)[at]);
    }
  }
  return s;
}

// The dropout multiplier of element (b, h, i, j): 0 or 1/(1-p) (SPEC 3).
template <typename acc_t>
__device__ __forceinline__ acc_t dropout_multiplier(const AttentionParams& p, const DropoutRng& rng, int64_t b,
                                                    int64_t h, int64_t i, int64_t j) {
  return rng.keep_at(p.shard.row_position(b, h, i) + static_cast<uint64_t>(j)) ? static_cast<acc_t>(rng.keep_scale)
                                                                                 : acc_t(0);
}

// The dropout generator with its seed and offset read from device memory.
__device__ __forceinline__ DropoutRng device_rng(const AttentionParams& p) {
  DropoutRng rng = p.rng;
  if (p.has_dropout) {
    rng.seed = static_cast<uint64_t>(p.rng_state[0]);
    rng.offset = static_cast<uint64_t>(p.rng_state[1]);
  }
  return rng;
}

}  // namespace rudnn::cuda
