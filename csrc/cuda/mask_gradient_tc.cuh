// Gradient of a float mask on the tensor cores (float16/bfloat16, the tensor-core backward's
// numerics): dMask = dS summed over the dims the mask broadcasts along. A block owns a 64 x 64
// tile of the mask's rows and keys (all rows if they broadcast) and visits, in a fixed order, every
// (b, h, query tile) that reads it: deterministic, no atomics. A mask constant along the keys never
// comes here (attention_ops.cpp takes the LSE's gradient; under a key shard, the CUDA-core
// kernel). Each visit recomputes S = Q K^T and dP = dO V^T with mma.sync, each warp 16 rows by the
// tile's 64 keys, and adds dS = P (M dP - D), kept in float32 from the float32 products, to the
// warp's running sum (the CUDA-core kernel in mask_gradient.cu does the same on CUDA cores, and
// takes fused RoPE).
// launch_mask_gradient_tc is instantiated once per input dtype beside the backward
// (attention_backward_tc_bf16.cu, attention_backward_tc_f16.cu).
#pragma once

#include "attention_backward_tc.cuh"

namespace rudnn::cuda {
namespace tc_mask_gradient {

constexpr int kTile = 64;  // mask rows and keys a block owns
constexpr int kNB = kTile / 8;

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
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t bm = blockIdx.z / p.mask_heads, hm = blockIdx.z % p.mask_heads;
  const bool all_rows = p.mask_queries == 1;
  const int64_t own_i0 = static_cast<int64_t>(blockIdx.y) * kTile, own_j0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);
  const InputReads in = input_reads<scalar_t>(p, a.dout, a.dout_strides);

  extern __shared__ __align__(16) unsigned char smem[];
  scalar_t* sQ = reinterpret_cast<scalar_t*>(smem);
  scalar_t* sDO = sQ + kTile * kLdK;
  scalar_t* sK = sDO + kTile * kLdV;
  scalar_t* sV = sK + kTile * kLdK;
  unsigned char* sMask = smem + Shape::kSmem;

  // Visit u: batch, head and query tile, the last running fastest; one value each along the dims the
  // mask does not broadcast.
  const int64_t batches = p.mask_batch == 1 ? p.batch : 1, heads = p.mask_heads == 1 ? p.heads : 1;
  const int64_t row_tiles = all_rows ? (p.queries + kTile - 1) / kTile : 1;
  const int64_t visits = batches * heads * row_tiles;
  struct Visit {
    int64_t b, h, i0, j0;
  };
  const auto visit = [&](int64_t u) {
    const int64_t it = u % row_tiles, bh = u / row_tiles;
    return Visit{p.mask_batch == 1 ? bh / heads : bm, p.mask_heads == 1 ? bh % heads : hm,
                 all_rows ? it * kTile : own_i0, own_j0};
  };
  const auto load = [&](const Visit& v) {
    const int64_t hk = v.h / p.group();
    tile_to_smem_async<scalar_t, kTile, kE, kTcThreads>(sQ, p.q, p.q_strides, v.b, v.h, v.i0, p.queries, E, in.q);
    tile_to_smem_async<scalar_t, kTile, kEv, kTcThreads>(sDO, a.dout, a.dout_strides, v.b, v.h, v.i0, p.queries, Ev,
                                                         in.dout);
    tile_to_smem_async<scalar_t, kTile, kE, kTcThreads>(sK, p.k, p.k_strides, v.b, hk, v.j0, p.keys, E, in.k);
    tile_to_smem_async<scalar_t, kTile, kEv, kTcThreads>(sV, p.v, p.v_strides, v.b, hk, v.j0, p.keys, Ev, in.v);
    mask_tile_to_smem<scalar_t, kTile, kTile>(p, sMask, v.b, v.h, v.i0, v.j0, in.mask_async);
    cp_async_commit();
  };

  const DropoutRng rng = device_rng(p);
  float total[1][kNB][4] = {};
  if (visits > 0) load(visit(0));
  for (int64_t u = 0; u < visits; ++u) {
    const Visit v = visit(u);
    const int64_t row0 = v.i0 + 16 * warp, rows = (v.b * p.heads + v.h) * p.queries;
    float lse[1][2], delta[1][2];
    fragment_row_values(p, a.lse_unit, rows, row0, INFINITY, lse);
    fragment_row_values(p, a.delta, rows, row0, 0.0f, delta);  // as the dQ kernel stored it
    cp_async_wait<0>();
    __syncthreads();  // this visit's tiles are in
    float s[1][kNB][4] = {}, dp[1][kNB][4] = {};
    tc_backward::gemm_smem_nt<scalar_t, 1, kNB, kE, kLdK, kLdK>(s, sQ, 16 * warp, sK, 0);
    tc_backward::gemm_smem_nt<scalar_t, 1, kNB, kEv, kLdV, kLdV>(dp, sDO, 16 * warp, sV, 0);
    fragment_scores(p, s, v.b, row0, v.j0, tile_on_edge(p, v.b, row0, 16, v.j0, kTile));
    fragment_add_mask<scalar_t, 1, kNB, kTile>(p, s, sMask, 16 * warp, 0);
    __syncthreads();  // every warp is done with the tiles
    if (u + 1 < visits) load(visit(u + 1));
    uint32_t keep[1] = {};
    if (p.has_dropout) fragment_keep_bits<1, kNB>(p, rng, keep, v.b, v.h, row0, v.j0, in.dropout_aligned);
    fragment_gradients<true>(p, s, dp, lse, delta, keep);
    // Padding rows and keys of a partial tile add nothing, whatever inf or NaN the inputs hold.
    const int rows_in = static_cast<int>(min(int64_t{16}, max(int64_t{0}, p.queries - row0)));
    const int keys_in = static_cast<int>(min(int64_t{kTile}, p.keys - v.j0));
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool inside = lane / 4 + 8 * (e / 2) < rows_in && 8 * nb + 2 * (lane % 4) + e % 2 < keys_in;
        total[0][nb][e] += inside ? dp[0][nb][e] : 0.0f;
      }
  }
  cp_async_wait<0>();

  // Sums over the broadcast rows in a fixed order: across the warp's eight lane groups, then across
  // the warps.
  const int g = lane / 4, t = lane % 4;
  const int64_t base = blockIdx.z * p.mask_queries * p.mask_keys;
  if (!all_rows) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = own_i0 + 16 * warp + g + 8 * r;
      if (i >= p.queries) continue;
#pragma unroll
      for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t j = own_j0 + 8 * nb + 2 * t + e;
          if (j < p.keys) dmask[base + i * p.mask_keys + j] = total[0][nb][2 * r + e];
        }
    }
    return;
  }
  float* sRed = reinterpret_cast<float*>(smem);  // [warp][key]
  __syncthreads();  // every warp is done with the last visit's tiles
#pragma unroll
  for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float x = total[0][nb][e] + total[0][nb][2 + e];
      x += __shfl_xor_sync(0xffffffffu, x, 4);
      x += __shfl_xor_sync(0xffffffffu, x, 8);
      x += __shfl_xor_sync(0xffffffffu, x, 16);
      if (g == 0) sRed[warp * kTile + 8 * nb + 2 * t + e] = x;
    }
  __syncthreads();
  if (threadIdx.x < kTile) {
    float x = 0;
#pragma unroll
    for (int w = 0; w < kTcWarps; ++w) x += sRed[w * kTile + threadIdx.x];
    const int64_t j = own_j0 + threadIdx.x;
    if (j < p.keys) dmask[base + j] = x;
  }
}

}  // namespace tc_mask_gradient

template <typename scalar_t>
void launch_mask_gradient_tc(const AttentionParams& p, const BackwardArgs<float>& a, float* dmask) {
  using namespace tc_mask_gradient;
  dispatch_tc_dims(p.head_dim, p.value_dim, [&](auto e, auto ev) {
    constexpr int kE = decltype(e)::value, kEv = decltype(ev)::value;
    launch_threads(attention_dmask_tc_kernel<scalar_t, kE, kEv>, mask_gradient_grid(p, kTile, kTile), kTcThreads,
                   MaskGradientShape<kE, kEv>::kSmem + mask_tile_bytes<scalar_t, kTile, kTile>(p.mask_kind), p, a,
                   dmask);
  });
}

}  // namespace rudnn::cuda
