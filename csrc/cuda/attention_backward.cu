// Backward on CUDA cores, deterministic: a query-owned kernel computes D and dQ, a key/value-owned
// kernel dK and dV over every query head of its GQA group, and a mask-owned kernel the gradient of
// a float mask. No atomics: every output element has one writer, which sums in a fixed order.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../kernels.h"
#include "common.cuh"
#include "launch.cuh"

namespace rudnn::cuda {
namespace {

// What every backward kernel reads besides the problem. lse_unit and delta: (B, H, L), contiguous.
template <typename acc_t>
struct BackwardArgs {
  const void* dout;  // (B, H, L, Ev)
  Strides4 dout_strides;
  const acc_t* lse_unit;  // lse * unit; +inf for rows with no keys, so that base^(s - lse) = 0
  acc_t* delta;           // D_i = sum_j P_ij dP_ij (minus dLSE_i)
  const acc_t* grad_lse;  // read by the dQ kernel when it computes D itself; else null
  const bool* kv_finite;  // (B, Hkv): K and V finite; null without causality
};

// Loads keys [j0, j0 + kTile) of head (b, hk) into sK and sV, then gives, for this warp's rows
// of sQ (times unit * scale) and sDO and for this lane's key, s = q.k and dp = dO.v.
template <typename scalar_t, int kRows, typename acc_t>
__device__ __forceinline__ void key_tile_products(const AttentionParams& p, int64_t b, int64_t hk, int64_t j0,
                                                  const acc_t* sQ, int ldq, const acc_t* sDO, int lddo, acc_t* sK,
                                                  int ldk, acc_t* sV, int ldv, acc_t (&s)[kRows],
                                                  acc_t (&dp)[kRows]) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  __syncthreads();  // the previous tile is consumed
  load_tile<scalar_t>(sK, ldk, p.k, p.k_strides, b, hk, j0, p.keys, static_cast<int>(p.head_dim), kTile);
  load_tile<scalar_t>(sV, ldv, p.v, p.v_strides, b, hk, j0, p.keys, static_cast<int>(p.value_dim), kTile);
  __syncthreads();
  dot_rows<kRows>(sQ + warp * kRows * ldq, ldq, sK + lane * ldk, ldq, s);
  dot_rows<kRows>(sDO + warp * kRows * lddo, lddo, sV + lane * ldv, lddo, dp);
}

// Query-owned: 32 rows of head (b, h) (16 in float64), a warp a quarter of them, lanes over keys.
//   D_i = sum_j P_ij dP_ij  (when not given: a first sweep over the keys, in the compute type)
//   dS_ij = P_ij (dP_ij - D_i);  dQ_i = scale * sum_j dS_ij K_j
//
// The generic backward (deterministic=False) is this kernel with dk_sum/dv_sum given: each warp
// then adds its rows' contributions to dK_j and dV_j with float atomics, and no dK/dV kernel runs
// (nor, in flash numerics, the per-head rounding of GQA's dK/dV).
//   dk_sum_j += sum_i dS_ij (unit * scale * Q_i);  dv_sum_j += sum_i (P∘M)_ij dO_i
template <typename scalar_t, typename B>
__global__ void __launch_bounds__(kThreads)
    attention_dq_kernel(const AttentionParams p, BackwardArgs<typename Compute<scalar_t>::type> a,
                        bool compute_delta, scalar_t* __restrict__ dq, typename Compute<scalar_t>::type* dk_sum,
                        typename Compute<scalar_t>::type* dv_sum) {
  using acc_t = typename Compute<scalar_t>::type;
  constexpr int kRows = rows_per_warp<acc_t>();
  constexpr int kTileRows = kWarps * kRows;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t b = blockIdx.z, h = blockIdx.y, i0 = static_cast<int64_t>(blockIdx.x) * kTileRows;
  const int64_t hk = h / p.group();
  const bool flash = p.numerics == Numerics::kFlash;
  const acc_t unit = static_cast<acc_t>(p.score_unit());
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);
  const int ldq = padded_cols(E), lddo = padded_cols(Ev);
  const int ldk = lane_row_stride<acc_t>(B::kWidth), ldv = lane_row_stride<acc_t>(Ev);

  extern __shared__ __align__(16) unsigned char smem[];
  acc_t* sQ = reinterpret_cast<acc_t*>(smem);  // kTileRows x ldq, times unit * scale
  acc_t* sDO = sQ + kTileRows * ldq;             // kTileRows x lddo
  acc_t* sK = sDO + kTileRows * lddo;            // kTile x ldk: lane rows, and lane chunks for dQ
  acc_t* sV = sK + kTile * ldk;                  // kTile x ldv
  acc_t* sW = sV + kTile * ldv + warp * 2 * kTile * kRows;  // this warp's dS, kTile x kRows
  acc_t* sPM = sW + kTile * kRows;                           // and its P∘M (generic backward)

  load_tile<scalar_t>(sQ, ldq, p.q, p.q_strides, b, h, i0, p.queries, E, kTileRows,
                      static_cast<acc_t>(p.scale) * unit);
  load_tile<scalar_t>(sDO, lddo, a.dout, a.dout_strides, b, h, i0, p.queries, Ev, kTileRows);
  const int64_t rows = (b * p.heads + h) * p.queries;
  acc_t lse[kRows], delta[kRows], acc[kRows][B::kChunks][B::kVec];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t i = min(i0 + warp * kRows + r, p.queries - 1);
    lse[r] = a.lse_unit[rows + i];
    delta[r] = compute_delta ? acc_t(0) : a.delta[rows + i];
#pragma unroll
    for (int c = 0; c < B::kChunks; ++c)
#pragma unroll
      for (int e = 0; e < B::kVec; ++e) acc[r][c][e] = 0;
  }
  const DropoutRng rng = device_rng(p);
  const int64_t last_row = min(i0 + kTileRows, p.queries) - 1;
  const bool can_skip = p.is_causal && a.kv_finite[b * p.kv_heads + hk];
  const int64_t diagonal = p.shard.query_start - p.shard.key_start;

  for (int pass = compute_delta ? 0 : 1; pass < 2; ++pass) {
    for (int64_t j0 = 0; j0 < p.keys; j0 += kTile) {
      if (can_skip && j0 - last_row > diagonal) break;
      const int64_t j = j0 + lane;
      acc_t s[kRows], dp[kRows];
      key_tile_products<scalar_t>(p, b, hk, j0, sQ, ldq, sDO, lddo, sK, ldk, sV, ldv, s, dp);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t i = i0 + warp * kRows + r;
        const acc_t prob = exp_base(adjust_score<scalar_t>(p, s[r], b, h, i, j, unit) - lse[r], flash);
        if (p.has_dropout) dp[r] *= dropout_multiplier<acc_t>(p, rng, b, h, i, j);
        if (pass == 0) {
          delta[r] += prob * dp[r];
        } else {
          const acc_t ds = prob * (dp[r] - delta[r]);
          sW[lane * kRows + r] = flash ? round_to<scalar_t>(ds) : ds;
          if (dk_sum != nullptr) sPM[lane * kRows + r] = (flash ? round_to<scalar_t>(prob) : prob) *
                                                         (p.has_dropout ? dropout_multiplier<acc_t>(p, rng, b, h, i, j)
                                                                        : acc_t(1));
        }
      }
      if (pass == 1) {
        __syncwarp();
        accumulate_rows<B, kRows>(acc, sW, sK, ldk, kTile, lane);
        if (dk_sum != nullptr && j < p.keys) {
          const int64_t key_row = (b * p.kv_heads + hk) * p.keys + j;
          const acc_t* q_rows = sQ + warp * kRows * ldq;
          const acc_t* dout_rows = sDO + warp * kRows * lddo;
          for (int d = 0; d < E; ++d) {
            acc_t x = 0;
#pragma unroll
            for (int r = 0; r < kRows; ++r) x = fma(sW[lane * kRows + r], q_rows[r * ldq + d], x);
            atomicAdd(dk_sum + key_row * E + d, x);
          }
          for (int d = 0; d < Ev; ++d) {
            acc_t x = 0;
#pragma unroll
            for (int r = 0; r < kRows; ++r) x = fma(sPM[lane * kRows + r], dout_rows[r * lddo + d], x);
            atomicAdd(dv_sum + key_row * Ev + d, x);
          }
        }
      }
    }
    if (pass == 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t i = i0 + warp * kRows + r;
        delta[r] = warp_sum(delta[r]);
        if (a.grad_lse != nullptr && i < p.queries) delta[r] -= a.grad_lse[rows + i];
        if (lane == 0 && i < p.queries) a.delta[rows + i] = delta[r];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t i = i0 + warp * kRows + r;
    if (i >= p.queries) continue;
    scalar_t* out = dq + (rows + i) * E;
#pragma unroll
    for (int c = 0; c < B::kChunks; ++c)
#pragma unroll
      for (int e = 0; e < B::kVec; ++e) {
        const int d = c * kWarpSize * B::kVec + lane * B::kVec + e;
        if (d < E) out[d] = static_cast<scalar_t>(acc[r][c][e] * static_cast<acc_t>(p.scale));
      }
  }
}

// Key/value-owned: 32 keys of head (b, hk) (16 in float64), a warp a quarter of them, lanes over
// the 32 query rows of a tile; loops over every query head of the group and every query tile.
//   dV_j = sum_{h, i} (P∘M)_ij dO_i;  dK_j = scale * sum_{h, i} dS_ij Q_i
// In flash numerics with GQA, each query head's dK/dV is rounded to the input dtype before the
// group sum, as FlashAttention's expanded-then-summed gradients are.
template <typename scalar_t, typename B>
__global__ void __launch_bounds__(kThreads)
    attention_dkdv_kernel(const AttentionParams p, BackwardArgs<typename Compute<scalar_t>::type> a,
                          bool round_per_head, scalar_t* __restrict__ dk, scalar_t* __restrict__ dv) {
  using acc_t = typename Compute<scalar_t>::type;
  constexpr int kKeys = rows_per_warp<acc_t>();
  constexpr int kTileKeys = kWarps * kKeys;
  constexpr int kSlots = kKeys * B::kChunks * B::kVec;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t b = blockIdx.z, hk = blockIdx.y, j0 = static_cast<int64_t>(blockIdx.x) * kTileKeys;
  const bool flash = p.numerics == Numerics::kFlash;
  const acc_t unit = static_cast<acc_t>(p.score_unit());
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);
  const int ldk = padded_cols(E), ldv = padded_cols(Ev);
  const int ldq = lane_row_stride<acc_t>(B::kWidth), lddo = lane_row_stride<acc_t>(B::kWidth);

  extern __shared__ __align__(16) unsigned char smem[];
  acc_t* sK = reinterpret_cast<acc_t*>(smem);  // kTileKeys x ldk, times unit * scale
  acc_t* sV = sK + kTileKeys * ldk;              // kTileKeys x ldv
  acc_t* sQ = sV + kTileKeys * ldv;              // kTile x ldq: lane rows, and lane chunks for dK
  acc_t* sDO = sQ + kTile * ldq;                 // kTile x lddo
  acc_t* sPM = sDO + kTile * lddo + warp * 2 * kTile * kKeys;  // this warp's P∘M, kTile x kKeys
  acc_t* sDS = sPM + kTile * kKeys;                              // this warp's dS, kTile x kKeys
  acc_t* sSum = sK + kTileKeys * ldk + kTileKeys * ldv + kTile * (ldq + lddo) + kWarps * 2 * kTile * kKeys +
                threadIdx.x * 2 * kSlots;  // per thread: rounded group sums of dK, dV (flash GQA only)

  load_tile<scalar_t>(sK, ldk, p.k, p.k_strides, b, hk, j0, p.keys, E, kTileKeys,
                      static_cast<acc_t>(p.scale) * unit);
  load_tile<scalar_t>(sV, ldv, p.v, p.v_strides, b, hk, j0, p.keys, Ev, kTileKeys);
  acc_t acc_k[kKeys][B::kChunks][B::kVec], acc_v[kKeys][B::kChunks][B::kVec];
  auto clear = [&] {
#pragma unroll
    for (int r = 0; r < kKeys; ++r)
#pragma unroll
      for (int c = 0; c < B::kChunks; ++c)
#pragma unroll
        for (int e = 0; e < B::kVec; ++e) acc_k[r][c][e] = acc_v[r][c][e] = 0;
  };
  clear();
  if (round_per_head) {
    for (int x = 0; x < 2 * kSlots; ++x) sSum[x] = 0;
  }
  const DropoutRng rng = device_rng(p);
  const int64_t diagonal = p.shard.query_start - p.shard.key_start;
  // Causal: query rows before first_row see none of these keys; skipped unless K or V is non-finite.
  const bool can_skip = p.is_causal && a.kv_finite[b * p.kv_heads + hk];
  const int64_t first_row = can_skip && j0 > diagonal ? (j0 - diagonal) / kTile * kTile : 0;

  for (int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
    const int64_t rows = (b * p.heads + h) * p.queries;
    for (int64_t i0 = first_row; i0 < p.queries; i0 += kTile) {
      __syncthreads();
      load_tile<scalar_t>(sQ, ldq, p.q, p.q_strides, b, h, i0, p.queries, E, kTile);
      load_tile<scalar_t>(sDO, lddo, a.dout, a.dout_strides, b, h, i0, p.queries, Ev, kTile);
      __syncthreads();
      const int64_t i = i0 + lane;
      const bool row = i < p.queries;
      const acc_t lse = row ? a.lse_unit[rows + i] : acc_t(INFINITY);
      const acc_t delta = row ? a.delta[rows + i] : acc_t(0);
      acc_t s[kKeys], dp[kKeys];
      dot_rows<kKeys>(sK + warp * kKeys * ldk, ldk, sQ + lane * ldq, ldk, s);
      dot_rows<kKeys>(sV + warp * kKeys * ldv, ldv, sDO + lane * lddo, ldv, dp);
#pragma unroll
      for (int r = 0; r < kKeys; ++r) {
        const int64_t j = j0 + warp * kKeys + r;
        acc_t prob = exp_base(adjust_score<scalar_t>(p, s[r], b, h, i, j, unit) - lse, flash);
        const acc_t m = p.has_dropout ? dropout_multiplier<acc_t>(p, rng, b, h, i, j) : acc_t(1);
        const acc_t ds = prob * (dp[r] * m - delta);
        sDS[lane * kKeys + r] = flash ? round_to<scalar_t>(ds) : ds;
        if (flash) prob = round_to<scalar_t>(prob);
        sPM[lane * kKeys + r] = prob * m;
      }
      __syncwarp();
      accumulate_rows<B, kKeys>(acc_v, sPM, sDO, lddo, kTile, lane);
      accumulate_rows<B, kKeys>(acc_k, sDS, sQ, ldq, kTile, lane);
    }
    if (round_per_head) {
      int x = 0;
#pragma unroll
      for (int r = 0; r < kKeys; ++r)
#pragma unroll
        for (int c = 0; c < B::kChunks; ++c)
#pragma unroll
          for (int e = 0; e < B::kVec; ++e, ++x) {
            sSum[x] += round_to<scalar_t>(acc_k[r][c][e] * static_cast<acc_t>(p.scale));
            sSum[kSlots + x] += round_to<scalar_t>(acc_v[r][c][e]);
          }
      clear();
    }
  }
  int x = 0;
#pragma unroll
  for (int r = 0; r < kKeys; ++r) {
    const int64_t j = j0 + warp * kKeys + r;
#pragma unroll
    for (int c = 0; c < B::kChunks; ++c)
#pragma unroll
      for (int e = 0; e < B::kVec; ++e, ++x) {
        const int d = c * kWarpSize * B::kVec + lane * B::kVec + e;
        if (j >= p.keys) continue;
        const int64_t key_row = (b * p.kv_heads + hk) * p.keys + j;
        const acc_t gk = round_per_head ? sSum[x] : acc_k[r][c][e] * static_cast<acc_t>(p.scale);
        const acc_t gv = round_per_head ? sSum[kSlots + x] : acc_v[r][c][e];
        if (d < E) dk[key_row * E + d] = static_cast<scalar_t>(gk);
        if (d < Ev) dv[key_row * Ev + d] = static_cast<scalar_t>(gv);
      }
  }
}

// Mask-owned: a block owns a 32 x 32 tile of the mask's rows and keys (all of a broadcast dim)
// and visits, in a fixed order, every (b, h, i, j) that reads it:  dMask = sum dS_ij.
// dS stays in the compute type in both numerics (FlashAttention has no mask gradient).
template <typename scalar_t, typename B>
__global__ void __launch_bounds__(kThreads)
    attention_dmask_kernel(const AttentionParams p, BackwardArgs<typename Compute<scalar_t>::type> a,
                           typename Compute<scalar_t>::type* __restrict__ dmask) {
  using acc_t = typename Compute<scalar_t>::type;
  constexpr int kRows = rows_per_warp<acc_t>();
  constexpr int kTileRows = kWarps * kRows;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t bm = blockIdx.z / p.mask_heads, hm = blockIdx.z % p.mask_heads;
  const bool all_rows = p.mask_queries == 1, all_keys = p.mask_keys == 1;
  const int64_t own_i0 = static_cast<int64_t>(blockIdx.y) * kTileRows, own_j0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const acc_t unit = static_cast<acc_t>(p.score_unit());
  const bool flash = p.numerics == Numerics::kFlash;
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);
  const int ldq = padded_cols(E), lddo = padded_cols(Ev);
  const int ldk = lane_row_stride<acc_t>(E), ldv = lane_row_stride<acc_t>(Ev);

  extern __shared__ __align__(16) unsigned char smem[];
  acc_t* sQ = reinterpret_cast<acc_t*>(smem);
  acc_t* sDO = sQ + kTileRows * ldq;
  acc_t* sK = sDO + kTileRows * lddo;
  acc_t* sV = sK + kTile * ldk;
  acc_t* sRed = sV + kTile * ldv;  // kWarps x kTile: partial sums across warps

  acc_t total[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) total[r] = 0;
  const DropoutRng rng = device_rng(p);
  for (int64_t b = (p.mask_batch == 1 ? 0 : bm); b < (p.mask_batch == 1 ? p.batch : bm + 1); ++b) {
    for (int64_t h = (p.mask_heads == 1 ? 0 : hm); h < (p.mask_heads == 1 ? p.heads : hm + 1); ++h) {
      const int64_t hk = h / p.group(), rows = (b * p.heads + h) * p.queries;
      for (int64_t i0 = all_rows ? 0 : own_i0; i0 < (all_rows ? p.queries : own_i0 + 1); i0 += kTileRows) {
        __syncthreads();
        load_tile<scalar_t>(sQ, ldq, p.q, p.q_strides, b, h, i0, p.queries, E, kTileRows,
                            static_cast<acc_t>(p.scale) * unit);
        load_tile<scalar_t>(sDO, lddo, a.dout, a.dout_strides, b, h, i0, p.queries, Ev, kTileRows);
        for (int64_t j0 = all_keys ? 0 : own_j0; j0 < (all_keys ? p.keys : own_j0 + 1); j0 += kTile) {
          const int64_t j = j0 + lane;
          acc_t s[kRows], dp[kRows];
          key_tile_products<scalar_t>(p, b, hk, j0, sQ, ldq, sDO, lddo, sK, ldk, sV, ldv, s, dp);
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            const int64_t i = i0 + warp * kRows + r;
            if (i >= p.queries || j >= p.keys) continue;
            const acc_t prob = exp_base(adjust_score<scalar_t>(p, s[r], b, h, i, j, unit) - a.lse_unit[rows + i],
                                        flash);
            const acc_t m = p.has_dropout ? dropout_multiplier<acc_t>(p, rng, b, h, i, j) : acc_t(1);
            total[r] += prob * (dp[r] * m - a.delta[rows + i]);
          }
        }
      }
    }
  }
  // Sum over the broadcast dims: keys within the warp, rows across the block.
  if (all_keys) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) total[r] = warp_sum(total[r]);
  }
  const int64_t mrow = (bm * p.mask_heads + hm) * p.mask_queries;
  if (all_rows) {
    acc_t column = 0;
#pragma unroll
    for (int r = 0; r < kRows; ++r) column += total[r];
    __syncthreads();
    sRed[warp * kTile + lane] = column;
    __syncthreads();
    if (warp == 0) {
      acc_t sum = 0;
      for (int w = 0; w < kWarps; ++w) sum += sRed[w * kTile + lane];
      const int64_t j = own_j0 + lane;
      if ((all_keys && lane == 0) || (!all_keys && j < p.keys)) dmask[mrow * p.mask_keys + (all_keys ? 0 : j)] = sum;
    }
    return;
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t i = own_i0 + warp * kRows + r, j = own_j0 + lane;
    if (i >= p.queries) continue;
    if (all_keys) {
      if (lane == 0) dmask[mrow + i] = total[r];
    } else if (j < p.keys) {
      dmask[(mrow + i) * p.mask_keys + j] = total[r];
    }
  }
}

template <typename scalar_t, typename B>
void launch_backward(const AttentionProblem& pb, BackwardArgs<typename Compute<scalar_t>::type> a, bool compute_delta,
                     const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv, const at::Tensor& dmask,
                     bool deterministic) {
  using acc_t = typename Compute<scalar_t>::type;
  const AttentionParams& p = pb.params;
  constexpr int kRows = rows_per_warp<acc_t>(), kTileRows = kWarps * kRows;
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);
  const size_t dq_smem = sizeof(acc_t) * (kTileRows * (padded_cols(E) + padded_cols(Ev)) +
                                          kTile * (lane_row_stride<acc_t>(B::kWidth) + lane_row_stride<acc_t>(Ev)) +
                                          kWarps * 2 * kTile * kRows);
  const dim3 dq_grid = tile_grid(p.queries, kTileRows, p.heads, p.batch);
  if (!deterministic) {
    const at::Tensor dk_sum = at::zeros(dk.sizes(), dk.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    const at::Tensor dv_sum = at::zeros(dv.sizes(), dv.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    launch(attention_dq_kernel<scalar_t, B>, dq_grid, dq_smem, p, a, compute_delta, dq.data_ptr<scalar_t>(),
           dk_sum.data_ptr<acc_t>(), dv_sum.data_ptr<acc_t>());
    dk.copy_(dk_sum.div_(p.score_unit()));  // sQ holds unit * scale * Q
    dv.copy_(dv_sum);
  } else {
    launch(attention_dq_kernel<scalar_t, B>, dq_grid, dq_smem, p, a, compute_delta, dq.data_ptr<scalar_t>(),
           static_cast<acc_t*>(nullptr), static_cast<acc_t*>(nullptr));
  }

  // Rounding to the input dtype changes nothing for float32/float64.
  const bool round_per_head = p.numerics == Numerics::kFlash && p.group() > 1 && sizeof(scalar_t) < sizeof(acc_t);
  const size_t kv_smem =
      sizeof(acc_t) * (kTileRows * (padded_cols(E) + padded_cols(Ev)) + 2 * kTile * lane_row_stride<acc_t>(B::kWidth) +
                       kWarps * 2 * kTile * kRows +
                       (round_per_head ? kThreads * 2 * kRows * B::kChunks * B::kVec : 0));
  if (deterministic) {
    launch(attention_dkdv_kernel<scalar_t, B>, tile_grid(p.keys, kTileRows, p.kv_heads, p.batch), kv_smem, p, a,
           round_per_head, dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>());
  }

  if (dmask.defined()) {
    const size_t mask_smem = sizeof(acc_t) * (kTileRows * (padded_cols(E) + padded_cols(Ev)) +
                                              kTile * (lane_row_stride<acc_t>(E) + lane_row_stride<acc_t>(Ev)) +
                                              kWarps * kTile);
    const int64_t key_tiles = p.mask_keys == 1 ? 1 : (p.keys + kTile - 1) / kTile;
    const int64_t row_tiles = p.mask_queries == 1 ? 1 : (p.queries + kTileRows - 1) / kTileRows;
    TORCH_CHECK(row_tiles <= 65535 && p.mask_batch * p.mask_heads <= 65535,
                "rudnn's CUDA mask gradient takes at most ", 65535 * kTileRows, " queries and 65535 mask ",
                "(batch x heads), but got ", p.queries, " and ", p.mask_batch * p.mask_heads);
    const dim3 grid(static_cast<unsigned>(key_tiles), static_cast<unsigned>(row_tiles),
                    static_cast<unsigned>(p.mask_batch * p.mask_heads));
    launch(attention_dmask_kernel<scalar_t, B>, grid, mask_smem, p, a, dmask.data_ptr<acc_t>());
  }
}

}  // namespace

void attention_backward_cuda(const AttentionProblem& pb, const at::Tensor& grad_out, const at::Tensor& out,
                             const at::Tensor& lse, const std::optional<at::Tensor>& grad_lse, const at::Tensor& dq,
                             const at::Tensor& dk, const at::Tensor& dv, const at::Tensor& dmask,
                             bool deterministic) {
  const AttentionParams& p = pb.params;
  check_cuda_problem(p);
  const c10::cuda::CUDAGuard guard(dq.device());
  const at::ScalarType acc = pb.q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const bool flash = p.numerics == Numerics::kFlash;
  if (p.batch * p.heads * p.queries == 0) {
    dk.zero_();
    dv.zero_();
    if (dmask.defined()) dmask.zero_();
    return;
  }
  // lse * unit, with +inf where lse is -inf (rows with no keys), so that base^(s - lse) = 0.
  at::Tensor lse_unit = lse.to(acc) * p.score_unit();
  lse_unit.masked_fill_(lse_unit == -INFINITY, INFINITY);
  lse_unit = lse_unit.contiguous();
  // Flash numerics take D_i = rowsum(dO ∘ O) from the rounded output, as FlashAttention does.
  // Exact numerics form D_i = sum_j P_ij dP_ij in the dQ kernel's first sweep over the keys, from
  // the same dP as dS then uses: rows whose dS must cancel (one key, say) cancel exactly.
  const bool from_output = flash;
  at::Tensor delta, grad_lse_rows;
  if (from_output) {
    delta = (grad_out.to(acc) * out.to(acc)).sum(-1);
    if (grad_lse.has_value()) delta = delta - grad_lse->to(acc);
    delta = delta.contiguous();
  } else {
    delta = at::empty({p.batch, p.heads, p.queries}, lse.options().dtype(acc));
    if (grad_lse.has_value()) grad_lse_rows = grad_lse->to(acc).contiguous();
  }
  const at::Tensor kv_finite = keys_values_finite(pb);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dq.scalar_type(), "rudnn_attention_backward_cuda", [&] {
    using acc_t = typename Compute<scalar_t>::type;
    BackwardArgs<acc_t> a{grad_out.const_data_ptr(),
                          strides_of(grad_out),
                          lse_unit.const_data_ptr<acc_t>(),
                          delta.data_ptr<acc_t>(),
                          grad_lse_rows.defined() ? grad_lse_rows.const_data_ptr<acc_t>() : nullptr,
                          kv_finite.defined() ? kv_finite.const_data_ptr<bool>() : nullptr};
    dispatch_bucket(std::max(p.head_dim, p.value_dim), [&](auto bucket) {
      launch_backward<scalar_t, decltype(bucket)>(pb, a, !from_output, dq, dk, dv, dmask, deterministic);
    });
  });
}

}  // namespace rudnn::cuda
