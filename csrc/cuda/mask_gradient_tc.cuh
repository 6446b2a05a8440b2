// Gradient of a float mask on the tensor cores (float16/bfloat16, the tensor-core backward's
// numerics): dMask = dS summed over the dims the mask broadcasts along. A block owns a 64 x 64
// tile of the mask's rows and keys (all rows if they broadcast) and visits, in a fixed order, every
// (b, h, query tile) that reads it: deterministic, no atomics. A mask constant along the keys never
// comes here (attention_ops.cpp takes the LSE's gradient; under a key shard, the CUDA-core
// kernel). Each visit recomputes S = Q K^T and dP = dO V^T with mma.sync, each warp 16 rows by the
// tile's 64 keys, and adds dS = P (M dP - D), kept in float32 from the float32 products, to the
// warp's running sum (the CUDA-core kernel in mask_gradient.cu does the same on CUDA cores, and
// takes fused RoPE). On sm_90a a wgmma kernel (by_wgmma below) does the same over larger tiles.
// launch_mask_gradient_tc is instantiated once per input dtype beside the backward
// (attention_backward_tc_bf16.cu, attention_backward_tc_f16.cu).
#pragma once

#include "attention_backward_tc.cuh"
#include "wgmma.cuh"

namespace rudnn::cuda {
namespace tc_mask_gradient {

constexpr int kTile = 64;  // mask rows and keys of a warp group's products
constexpr int kNB = kTile / 8;

// The (b, h, query tile) visits of a block owning kRows mask rows (all of them when the mask
// broadcasts along the queries): one value each along the dims the mask does not broadcast, the
// query tile running fastest.
struct Visit {
  int64_t b, h, i0;
};
template <int kRows>
struct MaskVisits {
  int64_t heads, row_tiles, count;
  bool all_rows;
  __device__ explicit MaskVisits(const AttentionParams& p)
      : heads(p.mask_heads == 1 ? p.heads : 1),
        row_tiles(p.mask_queries == 1 ? (p.queries + kRows - 1) / kRows : 1),
        count((p.mask_batch == 1 ? p.batch : 1) * heads * row_tiles),
        all_rows(p.mask_queries == 1) {}
  // The first row the block owns, where the mask has rows.
  __device__ int64_t own_i0() const { return static_cast<int64_t>(blockIdx.y) * kRows; }
  __device__ Visit operator()(const AttentionParams& p, int64_t u) const {
    const int64_t it = u % row_tiles, bh = u / row_tiles;
    return Visit{p.mask_batch == 1 ? bh / heads : blockIdx.z / p.mask_heads,
                 p.mask_heads == 1 ? bh % heads : blockIdx.z % p.mask_heads, all_rows ? it * kRows : own_i0()};
  }
};

// Adds a warp's dS fragment (16 rows from row0, 64 keys from j0) to its running sum; padding rows
// and keys of a partial tile add nothing, whatever inf or NaN the inputs hold.
__device__ __forceinline__ void add_inside(const AttentionParams& p, float (&total)[kNB][4],
                                           const float (&ds)[kNB][4], int64_t row0, int64_t j0) {
  const int lane = threadIdx.x % 32;
  const int rows_in = static_cast<int>(min(int64_t{16}, max(int64_t{0}, p.queries - row0)));
  const int keys_in = static_cast<int>(min(int64_t{kTile}, max(int64_t{0}, p.keys - j0)));
#pragma unroll
  for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool inside = lane / 4 + 8 * (e / 2) < rows_in && 8 * nb + 2 * (lane % 4) + e % 2 < keys_in;
      total[nb][e] += inside ? ds[nb][e] : 0.0f;
    }
}

// A block's sums into dmask, each warp's kChunks 64-key tiles from j0 by its 16 rows from row0: as
// they are where the mask has rows; else summed over the broadcast rows in a fixed order, across
// each warp's eight lane groups, then across the block's warps through sRed (kThreads / 32 x 64
// kChunks floats, free once every warp is done with the tiles).
template <int kChunks, int kThreads>
__device__ __forceinline__ void store_mask_gradient(const AttentionParams& p, const float (&total)[kChunks][kNB][4],
                                                    float* __restrict__ dmask, float* sRed, bool all_rows,
                                                    int64_t row0, int64_t j0) {
  constexpr int kKeys = kTile * kChunks, kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t base = blockIdx.z * p.mask_queries * p.mask_keys;
  if (!all_rows) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = row0 + g + 8 * r;
      if (i >= p.queries) continue;
#pragma unroll
      for (int c = 0; c < kChunks; ++c)
#pragma unroll
        for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t j = j0 + kTile * c + 8 * nb + 2 * t + e;
            if (j < p.keys) dmask[base + i * p.mask_keys + j] = total[c][nb][2 * r + e];
          }
    }
    return;
  }
  __syncthreads();  // every warp is done with the tiles sRed overlays
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x = total[c][nb][e] + total[c][nb][2 + e];
        x += __shfl_xor_sync(0xffffffffu, x, 4);
        x += __shfl_xor_sync(0xffffffffu, x, 8);
        x += __shfl_xor_sync(0xffffffffu, x, 16);
        if (g == 0) sRed[(threadIdx.x / 32) * kKeys + kTile * c + 8 * nb + 2 * t + e] = x;
      }
  __syncthreads();
  for (int k = threadIdx.x; k < kKeys; k += kThreads) {
    float x = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) x += sRed[w * kKeys + k];
    if (j0 + k < p.keys) dmask[base + j0 + k] = x;
  }
}

template <int kE, int kEv>
struct MaskGradientShape {
  static constexpr int kLdK = tc_ld<kE>(), kLdV = tc_ld<kEv>();
  // Q, dO, K and V tiles of 64 rows; the next visit's copy in while this one's dS is formed.
  static constexpr size_t kSmem = 2 * 2 * static_cast<size_t>(kTile) * (kLdK + kLdV);
};

template <typename scalar_t, int kE, int kEv>
__global__ void __launch_bounds__(kTcThreads)
    attention_dmask_tc_kernel(const AttentionParams p, const BackwardArgs<float> a, float* __restrict__ dmask) {
  using Shape = MaskGradientShape<kE, kEv>;
  constexpr int kLdK = Shape::kLdK, kLdV = Shape::kLdV;
  const int warp = threadIdx.x / 32;
  const MaskVisits<kTile> visits(p);
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);
  const InputReads in = input_reads<scalar_t>(p, a.dout, a.dout_strides);

  extern __shared__ __align__(16) unsigned char smem[];
  scalar_t* sQ = reinterpret_cast<scalar_t*>(smem);
  scalar_t* sDO = sQ + kTile * kLdK;
  scalar_t* sK = sDO + kTile * kLdV;
  scalar_t* sV = sK + kTile * kLdK;
  unsigned char* sMask = smem + Shape::kSmem;

  const auto load = [&](const Visit& v) {
    const int64_t hk = v.h / p.group();
    tile_to_smem_async<scalar_t, kTile, kE, kTcThreads>(sQ, p.q, p.q_strides, v.b, v.h, v.i0, p.queries, E, in.q);
    tile_to_smem_async<scalar_t, kTile, kEv, kTcThreads>(sDO, a.dout, a.dout_strides, v.b, v.h, v.i0, p.queries, Ev,
                                                         in.dout);
    tile_to_smem_async<scalar_t, kTile, kE, kTcThreads>(sK, p.k, p.k_strides, v.b, hk, j0, p.keys, E, in.k);
    tile_to_smem_async<scalar_t, kTile, kEv, kTcThreads>(sV, p.v, p.v_strides, v.b, hk, j0, p.keys, Ev, in.v);
    mask_tile_to_smem<scalar_t, kTile, kTile>(p, sMask, v.b, v.h, v.i0, j0, in.mask_async);
    cp_async_commit();
  };

  const DropoutRng rng = device_rng(p);
  float total[1][kNB][4] = {};
  if (visits.count > 0) load(visits(p, 0));
  for (int64_t u = 0; u < visits.count; ++u) {
    const Visit v = visits(p, u);
    const int64_t row0 = v.i0 + 16 * warp, rows = (v.b * p.heads + v.h) * p.queries;
    float lse[1][2], delta[1][2];
    fragment_row_values(p, a.lse_unit, rows, row0, INFINITY, lse);
    fragment_row_values(p, a.delta, rows, row0, 0.0f, delta);  // as the dQ kernel stored it
    cp_async_wait<0>();
    __syncthreads();  // this visit's tiles are in
    float s[1][kNB][4] = {}, dp[1][kNB][4] = {};
    tc_backward::gemm_smem_nt<scalar_t, 1, kNB, kE, kLdK, kLdK>(s, sQ, 16 * warp, sK, 0);
    tc_backward::gemm_smem_nt<scalar_t, 1, kNB, kEv, kLdV, kLdV>(dp, sDO, 16 * warp, sV, 0);
    fragment_scores(p, s, v.b, row0, j0, tile_on_edge(p, v.b, row0, 16, j0, kTile));
    fragment_add_mask<scalar_t, 1, kNB, kTile>(p, s, sMask, 16 * warp, 0);
    __syncthreads();  // every warp is done with the tiles
    if (u + 1 < visits.count) load(visits(p, u + 1));
    uint32_t keep[1] = {};
    if (p.has_dropout) fragment_keep_bits<1, kNB>(p, rng, keep, v.b, v.h, row0, j0, in.dropout_aligned);
    fragment_gradients<true>(p, s, dp, lse, delta, keep);
    add_inside(p, total[0], dp[0], row0, j0);
  }
  cp_async_wait<0>();
  store_mask_gradient<1, kTcThreads>(p, total, dmask, reinterpret_cast<float*>(smem), visits.all_rows,
                                     visits.own_i0() + 16 * warp, j0);
}

// By wgmma (sm_90a), for head-dim buckets of whole panels: a block of kGroups warp groups owns
// 64 kGroups mask rows by kChunks 64-key tiles, and for each (b, h, query tile) it visits, Q and dO
// come in once while the K/V tiles of its key chunks stream through two buffers. The kernel is
// bound by what it moves from L2 (per visit the mma.sync kernel moves four tiles for two 64 x 64
// products); here Q and dO serve kChunks key tiles and, with two groups, K and V serve 128 rows.
// Each chunk's running sum stays in registers (32 floats a thread each; four chunks spill).
namespace by_wgmma {

constexpr int kChunks = 2;  // key tiles a block owns: kChunks x 8 x 4 floats of sums a thread
constexpr int groups(int e, int ev) { return e + ev <= 256 ? 2 : 1; }
using Tile = SwizzledTile<kTile>;

// Q and dO of every group, two buffers of K and V, the mask tile of a chunk.
template <typename scalar_t, int kE, int kEv>
size_t smem(MaskKind mask) {
  constexpr int kGroups = groups(kE, kEv);
  return 2 * static_cast<size_t>(kTile) * (kGroups + 2) * (kE + kEv) + kPanelAlign +
         mask_tile_bytes<scalar_t, kTile * kGroups, kTile>(mask);
}

template <typename scalar_t, int kE, int kEv>
__global__ void __launch_bounds__(kTcThreads * groups(kE, kEv), 1)
    attention_dmask_wgmma_kernel(const AttentionParams p, const BackwardArgs<float> a, float* __restrict__ dmask) {
  constexpr int kGroups = groups(kE, kEv), kThreads = kTcThreads * kGroups, kRows = kTile * kGroups;
  static_assert(kChunks % 2 == 0, "every visit starts at buffer 0");
  const int wg = threadIdx.x / kTcThreads, warp = threadIdx.x / 32 % 4;
  const MaskVisits<kRows> visits(p);
  const int64_t own_j0 = static_cast<int64_t>(blockIdx.x) * kTile * kChunks;  // of the block's first key tile
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);
  const InputReads in = input_reads<scalar_t>(p, a.dout, a.dout_strides);

  extern __shared__ __align__(16) unsigned char smem_base[];
  scalar_t* base = reinterpret_cast<scalar_t*>(align_panels(smem_base));
  const auto sQ = [=](int g) { return base + g * kTile * (kE + kEv); };
  const auto sDO = [=](int g) { return sQ(g) + kTile * kE; };
  const auto sK = [=](int buf) { return sQ(kGroups) + buf * kTile * (kE + kEv); };
  const auto sV = [=](int buf) { return sK(buf) + kTile * kE; };
  unsigned char* sMask = reinterpret_cast<unsigned char*>(sK(2));

  const auto load_queries = [&](const Visit& v) {
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int64_t i0 = v.i0 + kTile * g;
      tile_to_smem_async<scalar_t, kTile, kE, kThreads, Tile>(sQ(g), p.q, p.q_strides, v.b, v.h, i0, p.queries, E,
                                                              in.q);
      tile_to_smem_async<scalar_t, kTile, kEv, kThreads, Tile>(sDO(g), a.dout, a.dout_strides, v.b, v.h, i0,
                                                               p.queries, Ev, in.dout);
    }
  };
  const auto load_keys = [&](const Visit& v, int chunk, int buf) {
    const int64_t hk = v.h / p.group(), j0 = own_j0 + kTile * chunk;
    tile_to_smem_async<scalar_t, kTile, kE, kThreads, Tile>(sK(buf), p.k, p.k_strides, v.b, hk, j0, p.keys, E, in.k);
    tile_to_smem_async<scalar_t, kTile, kEv, kThreads, Tile>(sV(buf), p.v, p.v_strides, v.b, hk, j0, p.keys, Ev,
                                                             in.v);
  };

  const DropoutRng rng = device_rng(p);
  float total[kChunks][kNB][4] = {};
  if (visits.count > 0) {
    load_queries(visits(p, 0));
    load_keys(visits(p, 0), 0, 0);
  }
  cp_async_commit();
  for (int64_t u = 0; u < visits.count; ++u) {
    const Visit v = visits(p, u);
    const int64_t row0 = v.i0 + kTile * wg + 16 * warp, rows = (v.b * p.heads + v.h) * p.queries;
    float lse[1][2], delta[1][2];
    fragment_row_values(p, a.lse_unit, rows, row0, INFINITY, lse);
    fragment_row_values(p, a.delta, rows, row0, 0.0f, delta);  // as the dQ kernel stored it
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int buf = c % 2;
      const int64_t j0 = own_j0 + kTile * c;
      cp_async_wait<0>();
      fence_async_shared();
      __syncthreads();  // this chunk's tiles have landed, and every warp is done with the other buffer
      mask_tile_to_smem<scalar_t, kRows, kTile, kThreads>(p, sMask, v.b, v.h, v.i0, j0, in.mask_async);
      cp_async_commit();
      if (c + 1 < kChunks) {
        load_keys(v, c + 1, buf ^ 1);
      } else if (u + 1 < visits.count) {
        load_keys(visits(p, u + 1), 0, buf ^ 1);
      }
      cp_async_commit();
      float s[1][kNB][4], dp[1][kNB][4];
      wgmma_score_pair<scalar_t, kE, kEv, true>(s[0], sQ(wg), sK(buf), dp[0], sDO(wg), sV(buf));
      fragment_scores(p, s, v.b, row0, j0, tile_on_edge(p, v.b, row0, 16, j0, kTile));
      cp_async_wait<1>();
      __syncthreads();  // the mask tile is in
      fragment_add_mask<scalar_t, 1, kNB, kTile>(p, s, sMask, kTile * wg + 16 * warp, 0);
      uint32_t keep[1] = {};
      if (p.has_dropout) fragment_keep_bits<1, kNB>(p, rng, keep, v.b, v.h, row0, j0, in.dropout_aligned);
      fragment_gradients<true>(p, s, dp, lse, delta, keep);
      add_inside(p, total[c], dp[0], row0, j0);
      if (c + 1 == kChunks && u + 1 < visits.count) {
        __syncthreads();  // every warp is done with this visit's Q and dO
        load_queries(visits(p, u + 1));
        cp_async_commit();
      }
    }
  }
  cp_async_wait<0>();
  store_mask_gradient<kChunks, kThreads>(p, total, dmask, reinterpret_cast<float*>(base), visits.all_rows,
                                         visits.own_i0() + kTile * wg + 16 * warp, own_j0);
}

}  // namespace by_wgmma
}  // namespace tc_mask_gradient

// wgmma: by the wgmma kernel where the bucket allows (RUDNN_WGMMA builds on sm_90a).
template <typename scalar_t>
void launch_mask_gradient_tc(const AttentionParams& p, const BackwardArgs<float>& a, bool wgmma, float* dmask) {
  using namespace tc_mask_gradient;
  dispatch_tc_dims(p.head_dim, p.value_dim, [&](auto e, auto ev) {
    constexpr int kE = decltype(e)::value, kEv = decltype(ev)::value;
#ifdef RUDNN_WGMMA
    if constexpr (kE % 64 == 0 && kEv % 64 == 0) {
      if (wgmma) {
        constexpr int kGroups = by_wgmma::groups(kE, kEv);
        return launch_threads(by_wgmma::attention_dmask_wgmma_kernel<scalar_t, kE, kEv>,
                              mask_gradient_grid(p, kTile * kGroups, kTile * by_wgmma::kChunks), kTcThreads * kGroups,
                              by_wgmma::smem<scalar_t, kE, kEv>(p.mask_kind), p, a, dmask);
      }
    }
#endif
    launch_threads(attention_dmask_tc_kernel<scalar_t, kE, kEv>, mask_gradient_grid(p, kTile, kTile), kTcThreads,
                   MaskGradientShape<kE, kEv>::kSmem + mask_tile_bytes<scalar_t, kTile, kTile>(p.mask_kind), p, a,
                   dmask);
  });
}

}  // namespace rudnn::cuda
