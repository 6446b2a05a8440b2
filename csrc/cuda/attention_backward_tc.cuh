// Backward on the tensor cores (float16/bfloat16, flash numerics), deterministic, in the seed's
// split: a query-owned kernel for dQ and a key-owned kernel for dK and dV, neither with atomics.
// Both recompute P = base^(s - lse) and dS = P (M dP - D) per tile in registers, with
// D = rowsum(dO ∘ O) - dLSE from the rounded output (FlashAttention's D), which the dQ kernel forms.
//   dQ kernel: four warps own 32 query rows each (16 for heads wider than 64, whose accumulators
//   take the registers); K/V tiles of 32 keys (64) are double-buffered.
//   dK/dV kernel: four warps own 16 keys each of one query head; it sweeps every query tile of 64
//   rows (double-buffered Q, dO and their rows' statistics), a few 16-row fragments at a time,
//   and turns P and dS into the left operands of P^T dO and dS^T Q with movmatrix transposes.
//   Heads wider than 128 run it twice, for dK and for dV, each accumulator alone in registers.
// launch_backward_tc is instantiated once per input dtype (attention_backward_tc_bf16.cu,
// attention_backward_tc_f16.cu), so that the two halves compile in parallel.
#pragma once

#include "attention_backward_wgmma.cuh"
#include "backward.cuh"
#include "backward_fragments.cuh"
#include "launch.cuh"
#include "rotary.cuh"
#include "tensor_core.cuh"

namespace rudnn::cuda {
namespace tc_backward {

constexpr int kRowsPerTile = 64;  // the dK/dV kernel's key and query tiles

// The dQ kernel's: a warp's 16 kMI rows take fewer shared-memory loads per product the more rows
// it holds (the K/V fragments serve every one of them); past head dim 64 the accumulators of 32
// rows spill.
template <int kE, int kEv>
struct DqShape {
  static constexpr int kMI = kE <= 64 && kEv <= 64 ? 2 : 1;
  static constexpr int kBM = 16 * kMI * kTcWarps, kBN = kMI == 2 ? 32 : 64, kNB = kBN / 8;
  static constexpr int kLdK = tc_ld<kE>(), kLdV = tc_ld<kEv>();
  static constexpr size_t kSmem =
      2 * (static_cast<size_t>(kBM) * (kLdK + kLdV) + 2 * static_cast<size_t>(kBN) * (kLdK + kLdV));
};

template <int kE, int kEv>
struct BackwardShape {
  static constexpr int kLdK = tc_ld<kE>(), kLdV = tc_ld<kEv>();
  // One tile of each operand the block owns, two of each it streams (row-major 16-bit tiles).
  static constexpr size_t kTileBytes = 2 * static_cast<size_t>(kRowsPerTile) * (kLdK + kLdV);
  static constexpr size_t kSmem = 3 * kTileBytes + 2 * 2 * kRowsPerTile * sizeof(float);
  // 16-row fragments of a query tile per pass: scores and dS of fewer rows at a time leave the
  // registers to both accumulators (all four at once spill at head dims 96 and 128). Wider heads
  // hold one accumulator per launch and take the whole tile: passes would reload K or V for each.
  static constexpr int kPassFragments = kE <= 64 || kE > 128 ? 4 : 2;
};

// acc[kMI][kNB][4] += A B for a warp's 16 kMI rows: A from shared tile sA (rows by k, rows from
// a_row0), B^T from sB (columns by k, columns from b_col0); k over the whole bucket kDepth.
template <typename scalar_t, int kMI, int kNB, int kDepth, int kLdA, int kLdB>
__device__ __forceinline__ void gemm_smem_nt(float (&acc)[kMI][kNB][4], const scalar_t* sA, int a_row0,
                                             const scalar_t* sB, int b_col0) {
#pragma unroll
  for (int ks = 0; ks < kDepth / 16; ++ks) {
    uint32_t a[kMI][4];
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi) load_a<kLdA>(a[mi], sA, a_row0 + 16 * mi, 16 * ks);
#pragma unroll
    for (int nb = 0; nb < kNB; nb += 2) {
      uint32_t bb[4];
      load_b<kLdB>(bb, sB, b_col0 + 8 * nb, 16 * ks);
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi) {
        mma16816<scalar_t>(acc[mi][nb], a[mi], bb[0], bb[1]);
        mma16816<scalar_t>(acc[mi][nb + 1], a[mi], bb[2], bb[3]);
      }
    }
  }
}

// acc[kMI][kCols / 8][4] += A B with A given as fragments of 16 kMI rows by k in [16 kk, 16 kk + 16)
// and B from a shared tile stored k by columns; every column of the bucket.
template <typename scalar_t, int kMI, int kCols, int kLd>
__device__ __forceinline__ void mma_a_smem_kn(float (&acc)[kMI][kCols / 8][4], const uint32_t (&a)[kMI][4],
                                              const scalar_t* sB, int kk) {
#pragma unroll
  for (int nv = 0; nv < kCols / 16; ++nv) {
    uint32_t bb[4];
    load_b_trans<kLd>(bb, sB, 16 * nv, 16 * kk);
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi) {
      mma16816<scalar_t>(acc[mi][2 * nv], a[mi], bb[0], bb[1]);
      mma16816<scalar_t>(acc[mi][2 * nv + 1], a[mi], bb[2], bb[3]);
    }
  }
}

template <typename scalar_t, int kE, int kEv>
__global__ void __launch_bounds__(kTcThreads)
    attention_dq_tc_kernel(const AttentionParams p, const BackwardArgs<float> a, scalar_t* __restrict__ dq) {
  using Shape = DqShape<kE, kEv>;
  constexpr int kLdK = Shape::kLdK, kLdV = Shape::kLdV, kMI = Shape::kMI, kBM = Shape::kBM, kBN = Shape::kBN;
  constexpr int kNB = Shape::kNB;
  const int warp = threadIdx.x / 32;
  const int64_t b = blockIdx.z, h = blockIdx.y, i0 = static_cast<int64_t>(blockIdx.x) * kBM;
  const int64_t hk = h / p.group(), row0 = i0 + 16 * kMI * warp, rows = (b * p.heads + h) * p.queries;
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);
  const InputReads in = input_reads<scalar_t>(p, a.dout, a.dout_strides);

  extern __shared__ __align__(16) unsigned char smem[];
  scalar_t* sQ = reinterpret_cast<scalar_t*>(smem);
  scalar_t* sDO = sQ + kBM * kLdK;
  // Buffer `buf` of the streamed K and V tiles (offsets, not an array of pointers, which would live
  // in local memory).
  const auto sK = [=](int buf) { return sDO + kBM * kLdV + buf * kBN * (kLdK + kLdV); };
  const auto sV = [=](int buf) { return sK(buf) + kBN * kLdK; };
  unsigned char* sMask = smem + Shape::kSmem;

  const RowRange keys = visible_keys(p, a.kv_finite, b, hk, i0, kBM, kBN);
  const int64_t key_end = keys.end;
  tile_to_smem_async<scalar_t, kBM, kE, kTcThreads>(sQ, p.q, p.q_strides, b, h, i0, p.queries, E, in.q);
  tile_to_smem_async<scalar_t, kBM, kEv, kTcThreads>(sDO, a.dout, a.dout_strides, b, h, i0, p.queries, Ev, in.dout);
  tile_to_smem_async<scalar_t, kBN, kE, kTcThreads>(sK(0), p.k, p.k_strides, b, hk, keys.begin, key_end, E, in.k);
  tile_to_smem_async<scalar_t, kBN, kEv, kTcThreads>(sV(0), p.v, p.v_strides, b, hk, keys.begin, key_end, Ev, in.v);
  cp_async_commit();

  float lse[kMI][2], delta[kMI][2];
  fragment_row_values(p, a.lse_unit, rows, row0, INFINITY, lse);
  form_fragment_delta<scalar_t, kEv>(p, a, b, h, rows, row0, delta);
  const DropoutRng rng = device_rng(p);
  float acc[kMI][kE / 8][4] = {};
  for (int64_t j0 = keys.begin, tile = 0; j0 < key_end; j0 += kBN, ++tile) {
    const int buf = tile % 2;
    cp_async_wait<0>();
    __syncthreads();  // this tile has landed, and every warp is done with the other buffer
    if (in.masked) {
      mask_tile_to_smem<scalar_t, kBM, kBN>(p, sMask, b, h, i0, j0, in.mask_async);
      cp_async_commit();
    }
    if (j0 + kBN < key_end) {
      tile_to_smem_async<scalar_t, kBN, kE, kTcThreads>(sK(buf ^ 1), p.k, p.k_strides, b, hk, j0 + kBN, key_end, E,
                                                        in.k);
      tile_to_smem_async<scalar_t, kBN, kEv, kTcThreads>(sV(buf ^ 1), p.v, p.v_strides, b, hk, j0 + kBN, key_end, Ev,
                                                         in.v);
      if (p.rotary()) prefetch_table_rows<kBN, kTcThreads>(p.k_rotary, b, hk, j0 + kBN, key_end, E);
    }
    cp_async_commit();
    if (p.rotary()) {  // RoPE: Q once, each K tile as it lands
      if (tile == 0) {
        rotate_tile_global<scalar_t, kBM, kTcThreads, PaddedTile<kE>>(sQ, p.q_rotary, b, h, i0, p.queries, E);
      }
      rotate_tile_global<scalar_t, kBN, kTcThreads, PaddedTile<kE>>(sK(buf), p.k_rotary, b, hk, j0, key_end, E);
      __syncthreads();
    }
    float s[kMI][kNB][4] = {}, dp[kMI][kNB][4] = {};
    gemm_smem_nt<scalar_t, kMI, kNB, kE, kLdK, kLdK>(s, sQ, 16 * kMI * warp, sK(buf), 0);
    gemm_smem_nt<scalar_t, kMI, kNB, kEv, kLdV, kLdV>(dp, sDO, 16 * kMI * warp, sV(buf), 0);
    fragment_scores(p, s, b, row0, j0, tile_on_edge(p, b, row0, 16 * kMI, j0, kBN));
    if (in.masked) {
      cp_async_wait<1>();
      __syncthreads();  // the mask tile is in
      fragment_add_mask<scalar_t, kMI, kNB, kBN>(p, s, sMask, 16 * kMI * warp, 0);
    }
    uint32_t keep[kMI] = {};
    if (p.has_dropout) fragment_keep_bits<kMI, kNB>(p, rng, keep, b, h, row0, j0, in.dropout_aligned);
    fragment_gradients<true>(p, s, dp, lse, delta, keep);
    // dQ_i += sum_j dS_ij K_j
#pragma unroll
    for (int kk = 0; kk < kNB / 2; ++kk) {
      uint32_t ds[kMI][4];
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi) fragment_to_a<scalar_t>(ds[mi], dp[mi], kk, false);
      mma_a_smem_kn<scalar_t, kMI, kE, kLdK>(acc, ds, sK(buf), kk);
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi) {
    store_rows_tc<scalar_t, kE>(acc[mi], static_cast<float>(p.scale), dq + rows * E, row0 + 16 * mi, p.queries, E);
  }
}

// The A fragment of X^T (16 keys by queries [16 mi, 16 mi + 16)) from a query-major C tile
// x[mi][0..1] of this warp's 16 keys, rounded to 16 bits.
template <typename scalar_t>
__device__ __forceinline__ void transposed_a(uint32_t (&a)[4], const float (&x)[2][4]) {
  a[0] = movmatrix_trans(pack2<scalar_t>(x[0][0], x[0][1]));
  a[1] = movmatrix_trans(pack2<scalar_t>(x[1][0], x[1][1]));
  a[2] = movmatrix_trans(pack2<scalar_t>(x[0][2], x[0][3]));
  a[3] = movmatrix_trans(pack2<scalar_t>(x[1][2], x[1][3]));
}

// kRotary: RoPE fused (p.rotary()), a template flag for the registers, as in the forward.
template <typename scalar_t, int kE, int kEv, int kGrads, bool kRotary>
__global__ void __launch_bounds__(kTcThreads)
    attention_dkdv_tc_kernel(const AttentionParams p, const BackwardArgs<float> a, scalar_t* __restrict__ dk,
                             scalar_t* __restrict__ dv) {
  using Shape = BackwardShape<kE, kEv>;
  constexpr int kLdK = Shape::kLdK, kLdV = Shape::kLdV, kBM = kRowsPerTile, kMI = kBM / 16;
  constexpr int kPI = Shape::kPassFragments;
  const int warp = threadIdx.x / 32;
  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / p.group();
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kRowsPerTile;
  const int64_t kw0 = j0 + 16 * warp, key_rows = (b * gridDim.y + h) * p.keys;  // per query head under GQA
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);
  const InputReads in = input_reads<scalar_t>(p, a.dout, a.dout_strides);

  extern __shared__ __align__(16) unsigned char smem[];
  scalar_t* sK = reinterpret_cast<scalar_t*>(smem);
  scalar_t* sV = sK + kRowsPerTile * kLdK;
  // Buffer `buf` of the streamed Q and dO tiles.
  const auto sQ = [=](int buf) { return sV + kRowsPerTile * kLdV + buf * kBM * (kLdK + kLdV); };
  const auto sDO = [=](int buf) { return sQ(buf) + kBM * kLdK; };
  float* sStats = reinterpret_cast<float*>(sK + 3 * kRowsPerTile * (kLdK + kLdV));  // [2][lse, delta][kBM]
  unsigned char* sMask = smem + Shape::kSmem;

  const KeySweep sweep = key_sweep(p, a, b, hk, j0, kRowsPerTile, kBM);
  const int64_t first_tile = sweep.first, steps = sweep.tiles;
  // Step u's Q, dO and stats go to buffer u % 2.
  const auto load_step = [&](int64_t u) {
    const int buf = static_cast<int>(u % 2);
    const int64_t i0 = (first_tile + u) * kBM;
    tile_to_smem_async<scalar_t, kBM, kE, kTcThreads>(sQ(buf), p.q, p.q_strides, b, h, i0, p.queries, E, in.q);
    tile_to_smem_async<scalar_t, kBM, kEv, kTcThreads>(sDO(buf), a.dout, a.dout_strides, b, h, i0, p.queries, Ev,
                                                       in.dout);
    if constexpr (kRotary) prefetch_table_rows<kBM, kTcThreads>(p.q_rotary, b, h, i0, p.queries, E);
    rows_statistics_to_smem<kBM>(p, a, sStats + buf * 2 * kBM, b, h, i0);
  };
  tile_to_smem_async<scalar_t, kRowsPerTile, kE, kTcThreads>(sK, p.k, p.k_strides, b, hk, j0, p.keys, E, in.k);
  tile_to_smem_async<scalar_t, kRowsPerTile, kEv, kTcThreads>(sV, p.v, p.v_strides, b, hk, j0, p.keys, Ev, in.v);
  if (steps > 0) load_step(0);
  cp_async_commit();

  const DropoutRng rng = device_rng(p);
  const int lane = threadIdx.x % 32;
  const float kept = p.has_dropout ? static_cast<float>(p.rng.keep_scale) : 1.0f;
  constexpr bool kWantK = kGrads & kGradK, kWantV = kGrads & kGradV;
  float acc_k[1][kWantK ? kE / 8 : 1][4] = {}, acc_v[1][kWantV ? kEv / 8 : 1][4] = {};
  for (int64_t u = 0; u < steps; ++u) {
    const int buf = static_cast<int>(u % 2);
    const int64_t i0 = (first_tile + u) * kBM;
    cp_async_wait<0>();
    __syncthreads();  // this step has landed, and every warp is done with the other buffer
    if (in.masked) {
      mask_tile_to_smem<scalar_t, kBM, kRowsPerTile>(p, sMask, b, h, i0, j0, in.mask_async);
      cp_async_commit();
    }
    if (u + 1 < steps) load_step(u + 1);
    cp_async_commit();
    if constexpr (kRotary) {  // RoPE: K once, each Q tile as it lands
      if (u == 0) {
        rotate_tile_global<scalar_t, kRowsPerTile, kTcThreads, PaddedTile<kE>>(sK, p.k_rotary, b, hk, j0, p.keys, E);
      }
      rotate_tile_global<scalar_t, kBM, kTcThreads, PaddedTile<kE>>(sQ(buf), p.q_rotary, b, h, i0, p.queries, E);
      __syncthreads();
    }

    if (in.masked) {
      cp_async_wait<1>();
      __syncthreads();  // the mask tile is in
    }
    const float* stats = sStats + buf * 2 * kBM;
#pragma unroll 1
    for (int pass = 0; pass < kMI / kPI; ++pass) {
      const int x0 = 16 * kPI * pass;
      float s[kPI][2][4] = {}, dp[kPI][2][4] = {};
      gemm_smem_nt<scalar_t, kPI, 2, kE, kLdK, kLdK>(s, sQ(buf), x0, sK, 16 * warp);
      if constexpr (kWantK) gemm_smem_nt<scalar_t, kPI, 2, kEv, kLdV, kLdV>(dp, sDO(buf), x0, sV, 16 * warp);
      float lse[kPI][2], delta[kPI][2];
#pragma unroll
      for (int mi = 0; mi < kPI; ++mi)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          lse[mi][r] = stats[x0 + 16 * mi + lane / 4 + 8 * r];
          delta[mi][r] = stats[kBM + x0 + 16 * mi + lane / 4 + 8 * r];
        }
      fragment_scores(p, s, b, i0 + x0, kw0, tile_on_edge(p, b, i0 + x0, 16 * kPI, kw0, 16));
      if (in.masked) fragment_add_mask<scalar_t, kPI, 2, kRowsPerTile>(p, s, sMask, x0, 16 * warp);
      uint32_t keep[kPI] = {};
      if (p.has_dropout) fragment_keep_bits<kPI, 2>(p, rng, keep, b, h, i0 + x0, kw0, in.dropout_aligned);
      fragment_gradients<kWantK>(p, s, dp, lse, delta, keep);
      // dV_j += sum_i (P∘M)_ij dO_i;  dK_j += sum_i dS_ij Q_i   (k runs over the pass's queries)
#pragma unroll
      for (int mi = 0; mi < kPI; ++mi) {
        uint32_t at[1][4];
        if constexpr (kWantV) {
          transposed_a<scalar_t>(at[0], s[mi]);
          mma_a_smem_kn<scalar_t, 1, kEv, kLdV>(acc_v, at, sDO(buf), kPI * pass + mi);
        }
        if constexpr (kWantK) {
          transposed_a<scalar_t>(at[0], dp[mi]);
          mma_a_smem_kn<scalar_t, 1, kE, kLdK>(acc_k, at, sQ(buf), kPI * pass + mi);
        }
      }
    }
  }
  cp_async_wait<0>();
  if constexpr (kWantK)
    store_rows_tc<scalar_t, kE>(acc_k[0], static_cast<float>(p.scale), dk + key_rows * E, kw0, p.keys, E);
  if constexpr (kWantV) store_rows_tc<scalar_t, kEv>(acc_v[0], kept, dv + key_rows * Ev, kw0, p.keys, Ev);
}

}  // namespace tc_backward

// dQ, then dK and dV: (B, H, S, E) and (B, H, S, Ev), each query head's under GQA (its sum over
// the group is the caller's); wgmma: by attention_backward_wgmma.cuh's kernels where the bucket
// allows.
template <typename scalar_t>
void launch_backward_tc(const AttentionParams& p, const BackwardArgs<float>& a, bool wgmma, scalar_t* dq,
                        scalar_t* dk, scalar_t* dv) {
  using namespace tc_backward;
  dispatch_tc_dims(p.head_dim, p.value_dim, [&](auto e, auto ev) {
    constexpr int kE = decltype(e)::value, kEv = decltype(ev)::value;
#ifdef RUDNN_WGMMA
    if constexpr (kE % 64 == 0 && kEv % 64 == 0) {
      if (wgmma) return wgmma_backward::launch_backward_wgmma<scalar_t, kE, kEv>(p, a, dq, dk, dv);
    }
#endif
    using Dq = DqShape<kE, kEv>;
    launch_threads(attention_dq_tc_kernel<scalar_t, kE, kEv>, tile_grid(p.queries, Dq::kBM, p.heads, p.batch),
                   kTcThreads, Dq::kSmem + mask_tile_bytes<scalar_t, Dq::kBM, Dq::kBN>(p.mask_kind), p, a, dq);
    const size_t smem =
        BackwardShape<kE, kEv>::kSmem + mask_tile_bytes<scalar_t, kRowsPerTile, kRowsPerTile>(p.mask_kind);
    const dim3 key_grid = tile_grid(p.keys, kRowsPerTile, p.heads, p.batch);
    dispatch_flag(p.rotary(), [&](auto rotary) {
      constexpr bool kRotary = decltype(rotary)::value;
      if constexpr (kE <= 128 && kEv <= 128) {
        launch_threads(attention_dkdv_tc_kernel<scalar_t, kE, kEv, kGradKV, kRotary>, key_grid, kTcThreads, smem, p,
                       a, dk, dv);
      } else {
        launch_threads(attention_dkdv_tc_kernel<scalar_t, kE, kEv, kGradK, kRotary>, key_grid, kTcThreads, smem, p, a,
                       dk, dv);
        launch_threads(attention_dkdv_tc_kernel<scalar_t, kE, kEv, kGradV, kRotary>, key_grid, kTcThreads, smem, p, a,
                       dk, dv);
      }
    });
  });
}

}  // namespace rudnn::cuda
