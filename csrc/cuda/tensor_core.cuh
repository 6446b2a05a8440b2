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

// Raw products q.k to scores in the kernels' unit (times scale * unit), then the rules of
// apply_rules; `edge` as tile_on_edge says for this warp's tile.
template <typename scalar_t, int kMI, int kNB>
__device__ __forceinline__ void fragment_scores(const AttentionParams& p, float (&s)[kMI][kNB][4], int64_t b, int64_t h,
                                                int64_t row0, int64_t j0, bool edge) {
  const float unit = static_cast<float>(p.score_unit()), scale = static_cast<float>(p.scale) * unit;
  for_each_pair<kMI, kNB>(row0, j0, [&](int mi, int nb, int r, int64_t i, int64_t j) {
    float x[2] = {s[mi][nb][2 * r] * scale, s[mi][nb][2 * r + 1] * scale};
    apply_rules<2, scalar_t>(p, x, b, h, i, j, unit, edge);
    s[mi][nb][2 * r] = x[0];
    s[mi][nb][2 * r + 1] = x[1];
  });
}

// Zeroes the dropped elements of a fragment tile (SPEC 3's bits); kept ones are not rescaled.
template <int kMI, int kNB>
__device__ __forceinline__ void fragment_dropout(const AttentionParams& p, const DropoutRng& rng,
                                                 float (&x)[kMI][kNB][4], int64_t b, int64_t h, int64_t row0,
                                                 int64_t j0) {
  for_each_pair<kMI, kNB>(row0, j0, [&](int mi, int nb, int r, int64_t i, int64_t j) {
    if (i >= p.queries) return;
    float keep[2];
    dropout_run<2>(rng, p.shard.row_position(b, h, i) + static_cast<uint64_t>(j), keep);
    if (keep[0] == 0.0f) x[mi][nb][2 * r] = 0.0f;
    if (keep[1] == 0.0f) x[mi][nb][2 * r + 1] = 0.0f;
  });
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
