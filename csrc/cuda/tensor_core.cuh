// What the tensor-core kernels share: block shape, head-dim buckets, and the score rules and
// dropout applied to a warp's fragment tile of scores (mma.cuh's C layout).
#pragma once

#include <type_traits>

#include "mma.cuh"

namespace rudnn::cuda {

constexpr int kTcWarps = 4;
constexpr int kTcThreads = 32 * kTcWarps;

// f(kE, kEv) for the smallest head-dim bucket holding E and Ev (multiples of 8, at most 256):
// E = Ev in {32, 64, 96, 128, 192, 256} and E = 192, Ev = 128; other pairs take the bucket of
// the wider one, the columns past E and Ev zero-filled in shared memory and skipped in products.
template <typename F>
void dispatch_tc_dims(int64_t E, int64_t Ev, F&& f) {
  const int64_t w = std::max(E, Ev);
  if (w <= 32) {
    f(std::integral_constant<int, 32>{}, std::integral_constant<int, 32>{});
  } else if (w <= 64) {
    f(std::integral_constant<int, 64>{}, std::integral_constant<int, 64>{});
  } else if (w <= 96) {
    f(std::integral_constant<int, 96>{}, std::integral_constant<int, 96>{});
  } else if (w <= 128) {
    f(std::integral_constant<int, 128>{}, std::integral_constant<int, 128>{});
  } else if (w <= 192 && Ev <= 128) {
    f(std::integral_constant<int, 192>{}, std::integral_constant<int, 128>{});
  } else if (w <= 192) {
    f(std::integral_constant<int, 192>{}, std::integral_constant<int, 192>{});
  } else {
    f(std::integral_constant<int, 256>{}, std::integral_constant<int, 256>{});
  }
}

// f(mi, nb, r, i, j) for each pair of a warp's fragment tile s[kMI][kNB][4] of query rows
// [row0, row0 + 16 kMI) and keys [j0, j0 + 8 kNB): elements s[mi][nb][2r], s[mi][nb][2r + 1] are
// query i = row0 + 16 mi + g + 8 r and keys j, j + 1 with j = j0 + 8 nb + 2 t (lane = 4 g + t).
template <int kMI, int kNB, typename F>
__device__ __forceinline__ void for_each_pair(int64_t row0, int64_t j0, F&& f) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int nb = 0; nb < kNB; ++nb) f(mi, nb, r, row0 + 16 * mi + lane / 4 + 8 * r, j0 + 8 * nb + 2 * (lane % 4));
}

// The tensor-core kernels keep scores in base 2 (exp2, log2(e) folded into the scale) in both
// numerics; LSE leaves them in natural units.
constexpr float kTcUnit = static_cast<float>(kLog2e);

// Raw products q.k to scores (times scale * kTcUnit); on `edge` tiles (tile_on_edge) -inf past
// the problem's bounds and -inf added beyond the causal frontier (apply_rules' rules).
template <int kMI, int kNB>
__device__ __forceinline__ void fragment_scores(const AttentionParams& p, float (&s)[kMI][kNB][4], int64_t row0,
                                                int64_t j0, bool edge) {
  const float scale = static_cast<float>(p.scale) * kTcUnit;
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mi][nb][e] *= scale;
  if (!edge) return;
  const int64_t diagonal = p.shard.query_start - p.shard.key_start;
  for_each_pair<kMI, kNB>(row0, j0, [&](int mi, int nb, int r, int64_t i, int64_t j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& x = s[mi][nb][2 * r + e];
      if (i >= p.queries || j + e >= p.keys) {
        x = -INFINITY;
      } else if (p.is_causal && j + e - i > diagonal) {
        x += -INFINITY;
      }
    }
  });
}

// Row stride (floats) of a mask tile of kCols keys: a half-warp's 8-byte reads of one fragment
// fall in distinct banks.
template <int kCols>
constexpr int mask_tile_ld() {
  return kCols + 8;
}

// The mask's additive term (apply_rules' rule, times kTcUnit; a bool mask's exclusion as -inf) of
// query rows [i0, i0 + kRows) and keys [j0, j0 + kCols) into a float tile in shared memory, read
// through the mask's broadcast strides four keys at a time; 0 past the problem's bounds.
template <typename scalar_t, int kRows, int kCols>
__device__ __forceinline__ void mask_tile_to_smem(const AttentionParams& p, float* tile, int64_t b, int64_t h,
                                                  int64_t i0, int64_t j0) {
  constexpr int kQuads = kCols / 4;
  const Strides4& ms = p.mask_strides;
  for (int idx = threadIdx.x; idx < kRows * kQuads; idx += kTcThreads) {
    const int r = idx / kQuads, c = 4 * (idx % kQuads);
    const int64_t i = i0 + r, j = j0 + c;
    float4 add = {0.0f, 0.0f, 0.0f, 0.0f};
    if (i < p.queries && j < p.keys) {
      const int64_t at = b * ms.batch + h * ms.head + i * ms.row + j * ms.col, valid = p.keys - j;
      float x[4] = {};
      if (p.mask_kind == MaskKind::kBool) {
        bool keep[4] = {true, true, true, true};
        load_run<4>(static_cast<const bool*>(p.mask) + at, ms.col, valid, keep);
#pragma unroll
        for (int e = 0; e < 4; ++e) x[e] = keep[e] ? 0.0f : -INFINITY;
      } else if (p.mask_kind == MaskKind::kFloat32) {
        load_run<4>(static_cast<const float*>(p.mask) + at, ms.col, valid, x);
#pragma unroll
        for (int e = 0; e < 4; ++e) x[e] *= kTcUnit;
      } else {
        scalar_t m[4] = {scalar_t(0), scalar_t(0), scalar_t(0), scalar_t(0)};
        load_run<4>(static_cast<const scalar_t*>(p.mask) + at, ms.col, valid, m);
#pragma unroll
        for (int e = 0; e < 4; ++e) x[e] = kTcUnit * static_cast<float>(m[e]);
      }
      add = make_float4(x[0], x[1], x[2], x[3]);
    }
    *reinterpret_cast<float4*>(tile + r * mask_tile_ld<kCols>() + c) = add;
  }
}

// s += the mask tile's terms; the fragment's first row and key are the tile's (row, col).
template <int kMI, int kNB, int kLd>
__device__ __forceinline__ void fragment_add_mask(float (&s)[kMI][kNB][4], const float* tile, int row, int col) {
  for_each_pair<kMI, kNB>(row, col, [&](int mi, int nb, int r, int64_t i, int64_t j) {
    const float2 m = *reinterpret_cast<const float2*>(tile + i * kLd + j);
    s[mi][nb][2 * r] += m.x;
    s[mi][nb][2 * r + 1] += m.y;
  });
}

// Whether every query row's dropout positions start on a Philox block at every key tile, so that
// fragment_keep_bits can share each block between two lanes.
__device__ __forceinline__ bool dropout_blocks_aligned(const AttentionParams& p) {
  return p.shard.global_keys % 4 == 0 && p.shard.key_start % 4 == 0;
}

// SPEC 3's keep decision of every element of a fragment tile, as bits: bit 4 nb + e of bits[mi] is
// that of s[mi][nb][e]. The keys j, j + 1 of lanes 4g + t and 4g + (t ^ 1) share a Philox block
// when `aligned` (dropout_blocks_aligned and j0 a multiple of 4): the even lane draws it for row g,
// the odd lane for row g + 8, and they swap the halves the other needs.
template <int kMI, int kNB>
__device__ __forceinline__ void fragment_keep_bits(const AttentionParams& p, const DropoutRng& rng,
                                                   uint32_t (&bits)[kMI], int64_t b, int64_t h, int64_t row0,
                                                   int64_t j0, bool aligned) {
  static_assert(kNB <= 8, "four bits per 8-key block");
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, odd = t & 1;
  const uint32_t threshold = rng.keep_threshold();
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi) {
    bits[mi] = 0;
    const int64_t i = row0 + 16 * mi + g;
    if (aligned) {
      const uint64_t pos = p.shard.row_position(b, h, i + 8 * odd) + static_cast<uint64_t>(j0 + 2 * t);
#pragma unroll 1
      for (int nb = 0; nb < kNB; ++nb) {
        const Philox4 x = rng.block(pos + 8 * nb);
        uint32_t k = 0;
#pragma unroll
        for (int w = 0; w < 4; ++w) k |= static_cast<uint32_t>((x.x[w] >> 8) >= threshold) << w;
        const uint32_t mine = odd ? k >> 2 : k & 3, theirs = odd ? k & 3 : k >> 2;
        const uint32_t other = __shfl_xor_sync(0xffffffffu, theirs, 1);  // the partner's row, this lane's keys
        bits[mi] |= (odd ? other | mine << 2 : mine | other << 2) << (4 * nb);
      }
    } else {
#pragma unroll 1
      for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float keep[2];
          dropout_run<2>(rng, p.shard.row_position(b, h, i + 8 * r) + static_cast<uint64_t>(j0 + 8 * nb + 2 * t), keep);
          bits[mi] |= (static_cast<uint32_t>(keep[0] != 0.0f) | static_cast<uint32_t>(keep[1] != 0.0f) << 1)
                      << (4 * nb + 2 * r);
        }
      }
    }
  }
}

// The A fragment (16 rows by keys [16 kk, 16 kk + 16)) of a C-fragment tile, rounded to 16 bits;
// with `low`, the rounding error instead (pack2_low).
template <typename scalar_t, int kNB>
__device__ __forceinline__ void fragment_to_a(uint32_t (&a)[4], const float (&c)[kNB][4], int kk, bool low) {
  const float* x = c[2 * kk];
  const float* y = c[2 * kk + 1];
  if (low) {
    a[0] = pack2_low<scalar_t>(x[0], x[1]), a[1] = pack2_low<scalar_t>(x[2], x[3]);
    a[2] = pack2_low<scalar_t>(y[0], y[1]), a[3] = pack2_low<scalar_t>(y[2], y[3]);
  } else {
    a[0] = pack2<scalar_t>(x[0], x[1]), a[1] = pack2<scalar_t>(x[2], x[3]);
    a[2] = pack2<scalar_t>(y[0], y[1]), a[3] = pack2<scalar_t>(y[2], y[3]);
  }
}

}  // namespace rudnn::cuda
