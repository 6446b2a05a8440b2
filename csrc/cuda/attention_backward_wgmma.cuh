// Backward on the tensor cores by wgmma (sm_90a): attention_backward_tc.cuh's deterministic split
// (a query-owned dQ kernel, a key-owned dK/dV kernel, no atomics) with each four warps of a block
// one warp group of 64 rows (two groups sharing the streamed tiles for the widest heads and with
// RoPE: max_groups), the tiles in wgmma.cuh's swizzled panels (head-dim buckets of 64, 128, 192
// and 256). With RoPE fused (kRotary), each kernel turns its owned Q or K tiles once and each
// streamed K or Q tile in shared memory (rotary.cuh) before the tensor cores read it: where the
// tiles are double-buffered, the next one during this one's last products (turn_ahead).
//   dQ kernel: 64 query rows a group; K/V tiles of 64 keys, double-buffered where stream_buffers
//   says. S = Q K^T and dP = dO V^T come from shared memory together, and dS, rounded in
//   registers, is the left operand of dQ += dS K.
//   dK/dV kernel: 64 keys a group of one query head; it sweeps every query tile of 64 rows (Q,
//   dO and their rows' statistics, buffered likewise). It forms S^T = K Q^T and dP^T = V dO^T,
//   the keys along the fragments' rows, so that P^T and dS^T in registers are the left operands
//   of dV += P^T dO and dK += dS^T Q, with no transposes; the score rules, mask and dropout bits
//   read the transposed fragments (tensor_core.cuh's kKeyRows). Heads wider than 128 run it
//   twice, for dK and for dV, as the mma.sync kernel does.
#pragma once

#include "backward.cuh"
#include "backward_fragments.cuh"
#include "launch.cuh"
#include "rotary.cuh"
#include "tensor_core.cuh"
#include "wgmma.cuh"

namespace rudnn::cuda {
namespace wgmma_backward {

constexpr int kTile = 64;  // rows of every tile: one warp group's product
using Tile = SwizzledTile<kTile>;
// RoPE's table pieces in flight per thread (rotary.cuh's kBatch): one, since beside the
// accumulators more spill (bf16 dK/dV kernel, head dim 64 / 128: one 40 / 14 bytes, as without
// RoPE; two 120 / 32; four 508 / 60).
constexpr int kTurnBatch = 1;

// Rows [row0, row0 + kTile) of head `head` of the tensor `table` turns (RoPE); for the owned tiles,
// group 0's rows, group g's following 64 g further on.
struct TurnedRows {
  const RotaryTable& table;
  int64_t head, row0, rows;
};

// RoPE in a step of a wgmma backward kernel: on the first step each group's owned tile and the
// step's streamed tile, turned in shared memory and published to the tensor cores. With two
// buffers, the later steps' streamed tiles were turned ahead, during the step before.
template <typename scalar_t, int kGroups, int kBuffers, typename OwnedTile>
__device__ __forceinline__ void turn_step(bool first, OwnedTile owned_tile, const TurnedRows& owned,
                                          scalar_t* streamed_tile, const TurnedRows& streamed, int64_t b, int E) {
  constexpr int kThreads = kTcThreads * kGroups;
  if (kBuffers == 2 && !first) return;
  if (first) {
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      rotate_tile_global<scalar_t, kTile, kThreads, Tile, kTurnBatch>(owned_tile(g), owned.table, b, owned.head,
                                                                      owned.row0 + kTile * g, owned.rows, E);
    }
  }
  rotate_tile_global<scalar_t, kTile, kThreads, Tile, kTurnBatch>(streamed_tile, streamed.table, b, streamed.head,
                                                                  streamed.row0, streamed.rows, E);
  fence_async_shared();
  __syncthreads();  // the turned tiles are in, for the tensor cores
}

// The next step's streamed tile, landing in the other buffer, turned while this step's last
// products run: the next step's opening fence and barrier publish it to the tensor cores.
template <typename scalar_t, int kGroups>
__device__ __forceinline__ void turn_ahead(scalar_t* next_tile, const TurnedRows& next, int64_t b, int E) {
  cp_async_wait<0>();
  __syncthreads();  // every thread's part of the next tile has landed
  rotate_tile_global<scalar_t, kTile, kTcThreads * kGroups, Tile, kTurnBatch>(next_tile, next.table, b, next.head,
                                                                              next.row0, next.rows, E);
}

// Warp groups of a block, each owning 64 rows (dQ owns Q and dO and streams K and V; dK/dV the
// other way round): where one block of one group fills a multiprocessor's shared memory (K+V
// wider than 320 columns), two groups share its streamed tiles, twice the warps at the same bytes.
// With RoPE two groups share them up to 256 columns too, so that each streamed tile is turned
// once for 128 owned rows rather than 64.
constexpr int max_groups(int e, int ev, bool rotary) { return e + ev > 320 || (rotary && e + ev <= 256) ? 2 : 1; }

// Buffers of the streamed tiles. Two let a block load the next tile during this one's products,
// but two blocks (or groups) a multiprocessor hide more than that: where three 64-row tiles of
// 16-bit K+V columns (96 KiB up to 256 columns) would keep a second block out and two (up to 320)
// let it in, and beside a second wide group, there is one. Up to 256 columns, two groups' owned
// tiles and two buffers take 128 KiB.
constexpr int stream_buffers(int e, int ev, int groups) {
  return e + ev <= 256 || (groups == 1 && e + ev > 320) ? 2 : 1;
}

// Bytes of either kernel's tiles: the owned tiles and the streamed buffers.
template <int kE, int kEv, int kGroups>
constexpr size_t tile_bytes() {
  return 2 * static_cast<size_t>(kTile) * (kGroups + stream_buffers(kE, kEv, kGroups)) * (kE + kEv) + kPanelAlign;
}

// Blocks per multiprocessor, for the registers: the dK/dV kernel holds both accumulators beside
// the S^T and dP^T fragments (at head dim 128, 64 + 64 + 32 + 32 floats a thread).
constexpr int min_blocks(int e, int groups) { return groups == 2 || e > 128 ? 1 : e <= 64 ? 3 : 2; }

template <typename scalar_t, int kE, int kEv, int kGroups, bool kRotary>
__global__ void __launch_bounds__(kTcThreads * kGroups, min_blocks(kE, kGroups))
    attention_dq_wgmma_kernel(const AttentionParams p, const BackwardArgs<float> a, scalar_t* __restrict__ dq) {
  constexpr int kThreads = kTcThreads * kGroups, kBlockRows = kTile * kGroups;
  const int wg = threadIdx.x / kTcThreads, warp = threadIdx.x / 32 % 4;
  const int64_t b = blockIdx.z, h = blockIdx.y, block_i0 = static_cast<int64_t>(blockIdx.x) * kBlockRows;
  const int64_t hk = h / p.group(), row0 = block_i0 + kTile * wg + 16 * warp;
  const int64_t rows = (b * p.heads + h) * p.queries;
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);
  const InputReads in = input_reads<scalar_t>(p, a.dout, a.dout_strides);

  // Each group's Q and dO tiles, then the streamed K and V.
  extern __shared__ __align__(16) unsigned char smem_base[];
  scalar_t* base = reinterpret_cast<scalar_t*>(align_panels(smem_base));
  const auto sQ = [=](int g) { return base + g * kTile * (kE + kEv); };
  const auto sDO = [=](int g) { return sQ(g) + kTile * kE; };
  const auto sK = [=](int buf) { return sQ(kGroups) + buf * kTile * (kE + kEv); };
  const auto sV = [=](int buf) { return sK(buf) + kTile * kE; };
  constexpr int kBuffers = stream_buffers(kE, kEv, kGroups);
  unsigned char* sMask = reinterpret_cast<unsigned char*>(sK(kBuffers));

  const RowRange keys = visible_keys(p, a.kv_finite, b, hk, block_i0, kBlockRows, kTile);
  const int64_t key_end = keys.end;
  const auto load_keys = [&](int buf, int64_t j0) {
    tile_to_smem_async<scalar_t, kTile, kE, kThreads, Tile>(sK(buf), p.k, p.k_strides, b, hk, j0, key_end, E, in.k);
    tile_to_smem_async<scalar_t, kTile, kEv, kThreads, Tile>(sV(buf), p.v, p.v_strides, b, hk, j0, key_end, Ev, in.v);
    if constexpr (kRotary) prefetch_table_rows<kTile, kThreads>(p.k_rotary, b, hk, j0, key_end, E);
  };
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const int64_t i0 = block_i0 + kTile * g;
    tile_to_smem_async<scalar_t, kTile, kE, kThreads, Tile>(sQ(g), p.q, p.q_strides, b, h, i0, p.queries, E, in.q);
    tile_to_smem_async<scalar_t, kTile, kEv, kThreads, Tile>(sDO(g), a.dout, a.dout_strides, b, h, i0, p.queries, Ev,
                                                             in.dout);
  }
  load_keys(0, keys.begin);
  cp_async_commit();

  float lse[1][2], delta[1][2];
  fragment_row_values(p, a.lse_unit, rows, row0, INFINITY, lse);
  form_fragment_delta<scalar_t, kEv>(p, a, b, h, rows, row0, delta);
  const DropoutRng rng = device_rng(p);
  // Each key tile's keep bits drawn before it, the next tile's while this one's dQ products run.
  uint32_t keep[1] = {};
  const auto draw_keep = [&](int64_t j) {
    if (p.has_dropout && j < key_end) fragment_keep_bits<1, 8>(p, rng, keep, b, h, row0, j, in.dropout_aligned);
  };
  draw_keep(keys.begin);
  float acc[kE / 8][4] = {};
  for (int64_t j0 = keys.begin, tile = 0; j0 < key_end; j0 += kTile, ++tile) {
    const int buf = tile % kBuffers;
    cp_async_wait<0>();
    fence_async_shared();
    __syncthreads();  // this tile has landed, and every warp is done with the other buffer
    if (in.masked) {
      mask_tile_to_smem<scalar_t, kBlockRows, kTile, kThreads>(p, sMask, b, h, block_i0, j0, in.mask_async);
      cp_async_commit();
    }
    if (kBuffers == 2 && j0 + kTile < key_end) load_keys(buf ^ 1, j0 + kTile);
    cp_async_commit();
    if constexpr (kRotary) {  // RoPE: each group's Q once, each K tile as it lands
      turn_step<scalar_t, kGroups, kBuffers>(tile == 0, sQ, {p.q_rotary, h, block_i0, p.queries}, sK(buf),
                                             {p.k_rotary, hk, j0, key_end}, b, E);
    }
    float s[1][8][4], dp[1][8][4];
    wgmma_score_pair<scalar_t, kE, kEv, true>(s[0], sQ(wg), sK(buf), dp[0], sDO(wg), sV(buf));
    fragment_scores(p, s, b, row0, j0, tile_on_edge(p, b, row0, 16, j0, kTile));
    if (in.masked) {
      cp_async_wait<1>();
      __syncthreads();  // the mask tile is in
      fragment_add_mask<scalar_t, 1, 8, kTile>(p, s, sMask, kTile * wg + 16 * warp, 0);
    }
    fragment_gradients<true>(p, s, dp, lse, delta, keep);
    // dQ_i += sum_j dS_ij K_j
    wgmma_fragments_times_tile<scalar_t, kTile, kE, false>(acc, dp[0], sK(buf), [&] {
      draw_keep(j0 + kTile);
      if constexpr (kRotary && kBuffers == 2) {
        const int64_t next = j0 + kTile;
        if (next < key_end) turn_ahead<scalar_t, kGroups>(sK(buf ^ 1), {p.k_rotary, hk, next, key_end}, b, E);
      }
    });
    if (kBuffers == 1 && j0 + kTile < key_end) {
      __syncthreads();  // every warp is done with the one buffer
      load_keys(0, j0 + kTile);
      cp_async_commit();
    }
  }
  cp_async_wait<0>();
  store_rows_tc<scalar_t, kE>(acc, static_cast<float>(p.scale), dq + rows * E, row0, p.queries, E);
}

template <typename scalar_t, int kE, int kEv, int kGroups, int kGrads, bool kRotary>
__global__ void __launch_bounds__(kTcThreads * kGroups, min_blocks(kE, kGroups))
    attention_dkdv_wgmma_kernel(const AttentionParams p, const BackwardArgs<float> a, scalar_t* __restrict__ dk,
                                scalar_t* __restrict__ dv) {
  constexpr bool kWantK = kGrads & kGradK, kWantV = kGrads & kGradV;
  constexpr int kThreads = kTcThreads * kGroups, kBlockKeys = kTile * kGroups;
  const int wg = threadIdx.x / kTcThreads, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / p.group();
  const int64_t block_j0 = static_cast<int64_t>(blockIdx.x) * kBlockKeys, kw0 = block_j0 + kTile * wg + 16 * warp;
  const int64_t key_rows = (b * gridDim.y + h) * p.keys;  // of dK and dV, per query head under GQA
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);
  const InputReads in = input_reads<scalar_t>(p, a.dout, a.dout_strides);

  // Each group's K and V tiles, the streamed Q and dO, the statistics, the mask.
  extern __shared__ __align__(16) unsigned char smem_base[];
  scalar_t* base = reinterpret_cast<scalar_t*>(align_panels(smem_base));
  const auto sK = [=](int g) { return base + g * kTile * (kE + kEv); };
  const auto sV = [=](int g) { return sK(g) + kTile * kE; };
  const auto sQ = [=](int buf) { return sK(kGroups) + buf * kTile * (kE + kEv); };
  const auto sDO = [=](int buf) { return sQ(buf) + kTile * kE; };
  constexpr int kBuffers = stream_buffers(kE, kEv, kGroups);
  float* sStats = reinterpret_cast<float*>(sQ(kBuffers));
  unsigned char* sMask = reinterpret_cast<unsigned char*>(sStats + kBuffers * 2 * kTile);  // stats [buf][lse, D][row]

  const KeySweep sweep = key_sweep(p, a, b, hk, block_j0, kBlockKeys, kTile);
  const int64_t first_tile = sweep.first, steps = sweep.tiles;
  // Step u's Q, dO and stats go to buffer u % kBuffers.
  const auto load_step = [&](int64_t u) {
    const int buf = static_cast<int>(u % kBuffers);
    const int64_t i0 = (first_tile + u) * kTile;
    tile_to_smem_async<scalar_t, kTile, kE, kThreads, Tile>(sQ(buf), p.q, p.q_strides, b, h, i0, p.queries, E, in.q);
    tile_to_smem_async<scalar_t, kTile, kEv, kThreads, Tile>(sDO(buf), a.dout, a.dout_strides, b, h, i0, p.queries,
                                                             Ev, in.dout);
    if constexpr (kRotary) prefetch_table_rows<kTile, kThreads>(p.q_rotary, b, h, i0, p.queries, E);
    rows_statistics_to_smem<kTile>(p, a, sStats + buf * 2 * kTile, b, h, i0);
  };
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const int64_t j0 = block_j0 + kTile * g;
    tile_to_smem_async<scalar_t, kTile, kE, kThreads, Tile>(sK(g), p.k, p.k_strides, b, hk, j0, p.keys, E, in.k);
    tile_to_smem_async<scalar_t, kTile, kEv, kThreads, Tile>(sV(g), p.v, p.v_strides, b, hk, j0, p.keys, Ev, in.v);
  }
  if (steps > 0) load_step(0);
  cp_async_commit();

  const DropoutRng rng = device_rng(p);
  const float kept = p.has_dropout ? static_cast<float>(p.rng.keep_scale) : 1.0f;
  // Each step's keep bits drawn away from its score fragments, beside which Philox's registers
  // would not fit: the first step's before the loop, each next one's while this one's dK/dV
  // products run.
  uint32_t keep = 0;
  const auto draw_keep = [&](int64_t u) {
    if (p.has_dropout && u < steps) {
      fragment_keep_bits_key_rows<8>(p, rng, keep, b, h, (first_tile + u) * kTile, kw0, in.dropout_aligned);
    }
  };
  draw_keep(0);
  float acc_k[kWantK ? kE / 8 : 1][4] = {}, acc_v[kWantV ? kEv / 8 : 1][4] = {};
  for (int64_t u = 0; u < steps; ++u) {
    const int buf = static_cast<int>(u % kBuffers);
    const int64_t i0 = (first_tile + u) * kTile;
    cp_async_wait<0>();
    fence_async_shared();
    __syncthreads();  // this step has landed, and every warp is done with the other buffer
    if (in.masked) {
      mask_tile_to_smem<scalar_t, kTile, kBlockKeys, kThreads>(p, sMask, b, h, i0, block_j0, in.mask_async);
      cp_async_commit();
    }
    if (kBuffers == 2 && u + 1 < steps) load_step(u + 1);
    cp_async_commit();
    if constexpr (kRotary) {  // RoPE: each group's K once, each Q tile as it lands
      turn_step<scalar_t, kGroups, kBuffers>(u == 0, sK, {p.k_rotary, hk, block_j0, p.keys}, sQ(buf),
                                             {p.q_rotary, h, i0, p.queries}, b, E);
    }

    // This warp's 16 keys (rows) by the tile's 64 queries (columns).
    float st[1][8][4], dpt[1][8][4];
    wgmma_score_pair<scalar_t, kE, kEv, kWantK>(st[0], sK(wg), sQ(buf), dpt[0], sV(wg), sDO(buf));
    fragment_scores<1, 8, true>(p, st, b, i0, kw0, tile_on_edge(p, b, i0, kTile, kw0, 16));
    if (in.masked) {
      cp_async_wait<1>();
      __syncthreads();  // the mask tile is in
      fragment_add_mask<scalar_t, 1, 8, kBlockKeys, true>(p, st, sMask, 0, kTile * wg + 16 * warp);
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
    if constexpr (kWantV) fence_fragments(pt);
    if constexpr (kWantK) fence_fragments(dst);
    wgmma_begin();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if constexpr (kWantV) wgmma_issue_rs<scalar_t, kTile, kEv>(acc_v, pt[kk], kk, sDO(buf));
      if constexpr (kWantK) wgmma_issue_rs<scalar_t, kTile, kE>(acc_k, dst[kk], kk, sQ(buf));
    }
    draw_keep(u + 1);
    if constexpr (kRotary && kBuffers == 2) {
      if (u + 1 < steps) turn_ahead<scalar_t, kGroups>(sQ(buf ^ 1), {p.q_rotary, h, i0 + kTile, p.queries}, b, E);
    }
    wgmma_end();
    fence_fragments(acc_k);
    fence_fragments(acc_v);
    if constexpr (kWantV) fence_fragments(pt);
    if constexpr (kWantK) fence_fragments(dst);
    if (kBuffers == 1 && u + 1 < steps) {
      __syncthreads();  // every warp is done with the one buffer
      load_step(u + 1);
      cp_async_commit();
    }
  }
  cp_async_wait<0>();
  if constexpr (kWantK) {
    store_rows_tc<scalar_t, kE>(acc_k, static_cast<float>(p.scale), dk + key_rows * E, kw0, p.keys, E);
  }
  if constexpr (kWantV) store_rows_tc<scalar_t, kEv>(acc_v, kept, dv + key_rows * Ev, kw0, p.keys, Ev);
}

// Dynamic shared memory of the dQ kernel and of the dK/dV kernel.
template <typename scalar_t, int kE, int kEv, int kGroups>
size_t dq_smem(MaskKind mask) {
  return tile_bytes<kE, kEv, kGroups>() + mask_tile_bytes<scalar_t, kTile * kGroups, kTile>(mask);
}
template <typename scalar_t, int kE, int kEv, int kGroups>
size_t dkdv_smem(MaskKind mask) {
  return tile_bytes<kE, kEv, kGroups>() + stream_buffers(kE, kEv, kGroups) * 2 * kTile * sizeof(float) +
         mask_tile_bytes<scalar_t, kTile, kTile * kGroups>(mask);
}

// dQ, then dK and dV (per query head: launch_backward_tc's), with kGroups warp groups a block.
template <typename scalar_t, int kE, int kEv, int kGroups, bool kRotary>
void launch_backward_groups(const AttentionParams& p, const BackwardArgs<float>& a, scalar_t* dq, scalar_t* dk,
                            scalar_t* dv) {
  constexpr int kThreads = kTcThreads * kGroups, kBlockRows = kTile * kGroups;
  launch_threads(attention_dq_wgmma_kernel<scalar_t, kE, kEv, kGroups, kRotary>,
                 tile_grid(p.queries, kBlockRows, p.heads, p.batch), kThreads,
                 dq_smem<scalar_t, kE, kEv, kGroups>(p.mask_kind), p, a, dq);
  const dim3 key_grid = tile_grid(p.keys, kBlockRows, p.heads, p.batch);
  const auto launch_dkdv = [&](auto grads) {
    launch_threads(attention_dkdv_wgmma_kernel<scalar_t, kE, kEv, kGroups, decltype(grads)::value, kRotary>, key_grid,
                   kThreads, dkdv_smem<scalar_t, kE, kEv, kGroups>(p.mask_kind), p, a, dk, dv);
  };
  if constexpr (kE <= 128 && kEv <= 128) {
    launch_dkdv(std::integral_constant<int, kGradKV>{});
  } else {
    launch_dkdv(std::integral_constant<int, kGradK>{});
    launch_dkdv(std::integral_constant<int, kGradV>{});
  }
}

// The backward for head-dim buckets of whole panels, with max_groups' warp groups a block; for
// the widest heads, one group where two groups' shared memory does not fit beside their mask
// tiles (a float32 mask's may not at 256).
template <typename scalar_t, int kE, int kEv>
void launch_backward_wgmma(const AttentionParams& p, const BackwardArgs<float>& a, scalar_t* dq, scalar_t* dk,
                           scalar_t* dv) {
  static_assert(kE % 64 == 0 && kEv % 64 == 0, "wgmma tiles are whole 64-column panels");
  dispatch_flag(p.rotary(), [&](auto rotary) {
    constexpr bool kRotary = decltype(rotary)::value;
    constexpr int kGroups = max_groups(kE, kEv, kRotary);
    if constexpr (max_groups(kE, kEv, false) == 2) {  // the widest heads, whose one group fills shared memory
      const size_t need =
          std::max(dq_smem<scalar_t, kE, kEv, 2>(p.mask_kind), dkdv_smem<scalar_t, kE, kEv, 2>(p.mask_kind));
      if (need > max_shared_memory()) return launch_backward_groups<scalar_t, kE, kEv, 1, kRotary>(p, a, dq, dk, dv);
    }
    launch_backward_groups<scalar_t, kE, kEv, kGroups, kRotary>(p, a, dq, dk, dv);
  });
}

}  // namespace wgmma_backward
}  // namespace rudnn::cuda
