// Backward on the tensor cores by wgmma (sm_90a): attention_backward_tc.cuh's deterministic split
// (a query-owned dQ kernel, a key-owned dK/dV kernel, no atomics) with the block's four warps one
// warp group of 64 rows, the tiles in wgmma.cuh's swizzled panels (head-dim buckets of 64, 128,
// 192 and 256), and no fused RoPE.
//   dQ kernel: 64 query rows; K/V tiles of 64 keys, double-buffered where stream_buffers says.
//   S = Q K^T and dP = dO V^T come from shared memory together, and dS, rounded in registers, is
//   the left operand of dQ += dS K.
//   dK/dV kernel: 64 keys; it sweeps every head of the GQA group and every query tile of 64 rows
//   (Q, dO and their rows' statistics, buffered likewise). It forms S^T = K Q^T and dP^T = V dO^T,
//   the keys along the fragments' rows, so that P^T and dS^T in registers are the left operands of
//   dV += P^T dO and dK += dS^T Q, with no transposes; the score rules, mask and dropout bits read
//   the transposed fragments (tensor_core.cuh's kKeyRows). Heads wider than 128 run it twice, for
//   dK and for dV, as the mma.sync kernel does.
#pragma once

#include "backward.cuh"
#include "backward_fragments.cuh"
#include "launch.cuh"
#include "tensor_core.cuh"
#include "wgmma.cuh"

namespace rudnn::cuda {
namespace wgmma_backward {

constexpr int kTile = 64;  // rows of every tile: one warp group's product
using Tile = SwizzledTile<kTile>;

// Buffers of the operands each kernel streams (dQ owns Q and dO and streams K and V; dK/dV the
// other way round). Two let a block load the next tile during this one's products, but two blocks
// a multiprocessor hide more than that: where three 64-row tiles of 16-bit K+V columns (96 KiB up
// to 256 columns) would keep a second block out and two (up to 320) let it in, there is one.
constexpr int stream_buffers(int e, int ev) { return e + ev <= 256 || e + ev > 320 ? 2 : 1; }

// Bytes of either kernel's tiles: the owned tiles and the streamed buffers.
template <int kE, int kEv>
constexpr size_t tile_bytes() {
  return 2 * static_cast<size_t>(kTile) * (1 + stream_buffers(kE, kEv)) * (kE + kEv) + kPanelAlign;
}

// Blocks per multiprocessor, for the registers: the dK/dV kernel holds both accumulators beside
// the S^T and dP^T fragments (at head dim 128, 64 + 64 + 32 + 32 floats a thread).
constexpr int min_blocks(int e) { return e <= 64 ? 3 : e <= 128 ? 2 : 1; }

template <typename scalar_t, int kE, int kEv>
__global__ void __launch_bounds__(kTcThreads, min_blocks(kE))
    attention_dq_wgmma_kernel(const AttentionParams p, const BackwardArgs<float> a, scalar_t* __restrict__ dq) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.z, h = blockIdx.y, i0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t hk = h / p.group(), row0 = i0 + 16 * warp, rows = (b * p.heads + h) * p.queries;
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);
  const InputReads in = input_reads<scalar_t>(p, a.dout, a.dout_strides);

  extern __shared__ __align__(16) unsigned char smem_base[];
  scalar_t* sQ = reinterpret_cast<scalar_t*>(align_panels(smem_base));
  scalar_t* sDO = sQ + kTile * kE;
  const auto sK = [=](int buf) { return sDO + kTile * kEv + buf * kTile * (kE + kEv); };
  const auto sV = [=](int buf) { return sK(buf) + kTile * kE; };
  constexpr int kBuffers = stream_buffers(kE, kEv);
  unsigned char* sMask = reinterpret_cast<unsigned char*>(sK(kBuffers));

  const RowRange keys = document_keys(p, b, i0, kTile, kTile);
  int64_t key_end = keys.end;
  if (p.is_causal && a.kv_finite[b * p.kv_heads + hk]) {
    const int64_t last_row = min(i0 + kTile, p.queries) - 1;
    key_end = max(int64_t{0}, min(key_end, last_row + p.shard.query_start - p.shard.key_start + 1));
  }
  const auto load_keys = [&](int buf, int64_t j0) {
    tile_to_smem_async<scalar_t, kTile, kE, kTcThreads, Tile>(sK(buf), p.k, p.k_strides, b, hk, j0, key_end, E, in.k);
    tile_to_smem_async<scalar_t, kTile, kEv, kTcThreads, Tile>(sV(buf), p.v, p.v_strides, b, hk, j0, key_end, Ev,
                                                               in.v);
  };
  tile_to_smem_async<scalar_t, kTile, kE, kTcThreads, Tile>(sQ, p.q, p.q_strides, b, h, i0, p.queries, E, in.q);
  tile_to_smem_async<scalar_t, kTile, kEv, kTcThreads, Tile>(sDO, a.dout, a.dout_strides, b, h, i0, p.queries, Ev,
                                                             in.dout);
  load_keys(0, keys.begin);
  cp_async_commit();

  float lse[1][2], delta[1][2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = row0 + lane / 4 + 8 * r;
    lse[0][r] = i < p.queries ? a.lse_unit[rows + i] : INFINITY;
    delta[0][r] = i < p.queries ? a.delta[rows + i] : 0.0f;
  }
  const DropoutRng rng = device_rng(p);
  float acc[kE / 8][4] = {};
  for (int64_t j0 = keys.begin, tile = 0; j0 < key_end; j0 += kTile, ++tile) {
    const int buf = tile % kBuffers;
    cp_async_wait<0>();
    fence_async_shared();
    __syncthreads();  // this tile has landed, and every warp is done with the other buffer
    if (in.masked) {
      mask_tile_to_smem<scalar_t, kTile, kTile>(p, sMask, b, h, i0, j0, in.mask_async);
      cp_async_commit();
    }
    if (kBuffers == 2 && j0 + kTile < key_end) load_keys(buf ^ 1, j0 + kTile);
    cp_async_commit();
    float s[1][8][4], dp[1][8][4];
    wgmma_score_pair<scalar_t, kE, kEv, true>(s[0], sQ, sK(buf), dp[0], sDO, sV(buf));
    fragment_scores(p, s, b, row0, j0, tile_on_edge(p, b, row0, 16, j0, kTile));
    if (in.masked) {
      cp_async_wait<1>();
      __syncthreads();  // the mask tile is in
      fragment_add_mask<scalar_t, 1, 8, kTile>(p, s, sMask, 16 * warp, 0);
    }
    uint32_t keep[1] = {};
    if (p.has_dropout) fragment_keep_bits<1, 8>(p, rng, keep, b, h, row0, j0, in.dropout_aligned);
    fragment_gradients<true>(p, s, dp, lse, delta, keep);
    wgmma_fragments_times_tile<scalar_t, kTile, kE, false>(acc, dp[0], sK(buf));  // dQ_i += sum_j dS_ij K_j
    if (kBuffers == 1 && j0 + kTile < key_end) {
      __syncthreads();  // every warp is done with the one buffer
      load_keys(0, j0 + kTile);
      cp_async_commit();
    }
  }
  cp_async_wait<0>();
  store_rows_tc<scalar_t, kE>(acc, static_cast<float>(p.scale), dq + rows * E, row0, p.queries, E);
}

template <typename scalar_t, int kE, int kEv, int kGrads>
__global__ void __launch_bounds__(kTcThreads, min_blocks(kE))
    attention_dkdv_wgmma_kernel(const AttentionParams p, const BackwardArgs<float> a, scalar_t* __restrict__ dk,
                                scalar_t* __restrict__ dv, float* __restrict__ group_sums) {
  constexpr bool kWantK = kGrads & kGradK, kWantV = kGrads & kGradV;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.z, hk = blockIdx.y, j0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t kw0 = j0 + 16 * warp, key_rows = (b * p.kv_heads + hk) * p.keys;
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);
  const InputReads in = input_reads<scalar_t>(p, a.dout, a.dout_strides);

  extern __shared__ __align__(16) unsigned char smem_base[];
  scalar_t* sK = reinterpret_cast<scalar_t*>(align_panels(smem_base));
  scalar_t* sV = sK + kTile * kE;
  const auto sQ = [=](int buf) { return sV + kTile * kEv + buf * kTile * (kE + kEv); };
  const auto sDO = [=](int buf) { return sQ(buf) + kTile * kE; };
  constexpr int kBuffers = stream_buffers(kE, kEv);
  float* sStats = reinterpret_cast<float*>(sQ(kBuffers));  // [kBuffers][lse, delta][kTile]
  unsigned char* sMask = reinterpret_cast<unsigned char*>(sStats + kBuffers * 2 * kTile);

  // Query tiles outside the keys' documents, or before the causal frontier of the first key, see
  // none of these keys.
  const RowRange queries = document_queries(p, b, j0, kTile, kTile);
  int64_t first_tile = queries.begin / kTile;
  if (p.is_causal && a.kv_finite[b * p.kv_heads + hk]) {
    first_tile = max(first_tile, max(int64_t{0}, j0 - (p.shard.query_start - p.shard.key_start)) / kTile);
  }
  const int64_t tiles = (queries.end + kTile - 1) / kTile - first_tile, group = p.group();
  const int64_t steps = tiles > 0 ? tiles * group : 0;
  // Step u: head hk * group + u / tiles, query tile first_tile + u % tiles; its Q, dO and stats
  // go to buffer u % kBuffers.
  const auto load_step = [&](int64_t u) {
    const int buf = static_cast<int>(u % kBuffers);
    const int64_t h = hk * group + u / tiles, i0 = (first_tile + u % tiles) * kTile;
    tile_to_smem_async<scalar_t, kTile, kE, kTcThreads, Tile>(sQ(buf), p.q, p.q_strides, b, h, i0, p.queries, E, in.q);
    tile_to_smem_async<scalar_t, kTile, kEv, kTcThreads, Tile>(sDO(buf), a.dout, a.dout_strides, b, h, i0, p.queries,
                                                               Ev, in.dout);
    const int r = threadIdx.x % kTile;
    const int64_t i = i0 + r, at = (b * p.heads + h) * p.queries + i;
    float* stats = sStats + buf * 2 * kTile;
    if (threadIdx.x < kTile)
      stats[r] = i < p.queries ? a.lse_unit[at] : INFINITY;
    else
      stats[kTile + r] = i < p.queries ? a.delta[at] : 0.0f;
  };
  tile_to_smem_async<scalar_t, kTile, kE, kTcThreads, Tile>(sK, p.k, p.k_strides, b, hk, j0, p.keys, E, in.k);
  tile_to_smem_async<scalar_t, kTile, kEv, kTcThreads, Tile>(sV, p.v, p.v_strides, b, hk, j0, p.keys, Ev, in.v);
  if (steps > 0) load_step(0);
  cp_async_commit();

  const DropoutRng rng = device_rng(p);
  const float kept = p.has_dropout ? static_cast<float>(p.rng.keep_scale) : 1.0f;
  float acc_k[kWantK ? kE / 8 : 1][4] = {}, acc_v[kWantV ? kEv / 8 : 1][4] = {};
  for (int64_t u = 0; u < steps; ++u) {
    const int buf = static_cast<int>(u % kBuffers);
    const int64_t h = hk * group + u / tiles, i0 = (first_tile + u % tiles) * kTile;
    cp_async_wait<0>();
    fence_async_shared();
    __syncthreads();  // this step has landed, and every warp is done with the other buffer
    if (in.masked) {
      mask_tile_to_smem<scalar_t, kTile, kTile>(p, sMask, b, h, i0, j0, in.mask_async);
      cp_async_commit();
    }
    if (kBuffers == 2 && u + 1 < steps) load_step(u + 1);
    cp_async_commit();

    // The keep bits before the scores: Philox's registers would not fit beside their fragments.
    uint32_t keep = 0;
    if (p.has_dropout) fragment_keep_bits_key_rows<8>(p, rng, keep, b, h, i0, kw0, in.dropout_aligned);
    // This warp's 16 keys (rows) by the tile's 64 queries (columns).
    float st[1][8][4], dpt[1][8][4];
    wgmma_score_pair<scalar_t, kE, kEv, kWantK>(st[0], sK, sQ(buf), dpt[0], sV, sDO(buf));
    fragment_scores<1, 8, true>(p, st, b, i0, kw0, tile_on_edge(p, b, i0, kTile, kw0, 16));
    if (in.masked) {
      cp_async_wait<1>();
      __syncthreads();  // the mask tile is in
      fragment_add_mask<scalar_t, 1, 8, kTile, true>(p, st, sMask, 0, 16 * warp);
    }
    // Column 8 nb + 2 t + e is query i0 + 8 nb + 2 t + e: its lse and D from the step's statistics.
    const float* stats = sStats + buf * 2 * kTile + 2 * (lane % 4);
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
      const float2 lse = *reinterpret_cast<const float2*>(stats + 8 * nb);
      const float2 delta = *reinterpret_cast<const float2*>(stats + kTile + 8 * nb);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        element_gradient<kWantK>(p, st[0][nb][e], dpt[0][nb][e], e % 2 ? lse.y : lse.x, e % 2 ? delta.y : delta.x,
                                 (keep >> (4 * nb + e)) & 1, kept);
      }
    }
    // dV_j += sum_i (P∘M)_ij dO_i;  dK_j += sum_i dS_ij Q_i   (k runs over the tile's queries)
    uint32_t pt[kWantV ? 4 : 1][4], dst[kWantK ? 4 : 1][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if constexpr (kWantV) fragment_to_a<scalar_t>(pt[kk], st[0], kk, false);
      if constexpr (kWantK) fragment_to_a<scalar_t>(dst[kk], dpt[0], kk, false);
    }
    fence_fragments(acc_k);
    fence_fragments(acc_v);
    wgmma_begin();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if constexpr (kWantV) wgmma_issue_rs<scalar_t, kTile, kEv>(acc_v, pt[kk], kk, sDO(buf));
      if constexpr (kWantK) wgmma_issue_rs<scalar_t, kTile, kE>(acc_k, dst[kk], kk, sQ(buf));
    }
    wgmma_end();
    fence_fragments(acc_k);
    fence_fragments(acc_v);
    if (kBuffers == 1 && u + 1 < steps) {
      __syncthreads();  // every warp is done with the one buffer
      load_step(u + 1);
      cp_async_commit();
    }

    if (group_sums != nullptr && (u + 1) % tiles == 0) {
      const bool first = u + 1 == tiles, last = u + 1 == steps;
      float* sums = group_sums + key_rows * (E + Ev);
      if constexpr (kWantK) {
        add_group_sum<scalar_t, kE>(acc_k, static_cast<float>(p.scale), sums, E + Ev, dk + key_rows * E, kw0, p.keys, E,
                                    first, last);
      }
      if constexpr (kWantV) {
        add_group_sum<scalar_t, kEv>(acc_v, kept, sums + E, E + Ev, dv + key_rows * Ev, kw0, p.keys, Ev, first, last);
      }
    }
  }
  cp_async_wait<0>();
  if (group_sums != nullptr && steps > 0) return;
  if constexpr (kWantK) {
    store_rows_tc<scalar_t, kE>(acc_k, static_cast<float>(p.scale), dk + key_rows * E, kw0, p.keys, E);
  }
  if constexpr (kWantV) store_rows_tc<scalar_t, kEv>(acc_v, kept, dv + key_rows * Ev, kw0, p.keys, Ev);
}

// dQ, then dK and dV, for head-dim buckets of whole panels (group_sums: launch_backward_tc's).
template <typename scalar_t, int kE, int kEv>
void launch_backward_wgmma(const AttentionParams& p, const BackwardArgs<float>& a, float* group_sums, scalar_t* dq,
                           scalar_t* dk, scalar_t* dv) {
  static_assert(kE % 64 == 0 && kEv % 64 == 0, "wgmma tiles are whole 64-column panels");
  const size_t mask_bytes = mask_tile_bytes<scalar_t, kTile, kTile>(p.mask_kind);
  launch_threads(attention_dq_wgmma_kernel<scalar_t, kE, kEv>, tile_grid(p.queries, kTile, p.heads, p.batch),
                 kTcThreads, tile_bytes<kE, kEv>() + mask_bytes, p, a, dq);
  const size_t smem = tile_bytes<kE, kEv>() + stream_buffers(kE, kEv) * 2 * kTile * sizeof(float) + mask_bytes;
  const dim3 key_grid = tile_grid(p.keys, kTile, p.kv_heads, p.batch);
  if constexpr (kE <= 128 && kEv <= 128) {
    launch_threads(attention_dkdv_wgmma_kernel<scalar_t, kE, kEv, kGradKV>, key_grid, kTcThreads, smem, p, a, dk, dv,
                   group_sums);
  } else {
    launch_threads(attention_dkdv_wgmma_kernel<scalar_t, kE, kEv, kGradK>, key_grid, kTcThreads, smem, p, a, dk, dv,
                   group_sums);
    launch_threads(attention_dkdv_wgmma_kernel<scalar_t, kE, kEv, kGradV>, key_grid, kTcThreads, smem, p, a, dk, dv,
                   group_sums);
  }
}

}  // namespace wgmma_backward
}  // namespace rudnn::cuda
