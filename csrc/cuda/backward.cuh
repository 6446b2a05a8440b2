// What the backward kernels (attention_backward.cu, mask_gradient.cu) read besides the problem.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "../attention_problem.h"
#include "tile.cuh"

namespace rudnn::cuda {

// Host side: the tensors, in the compute type where they are statistics.
struct BackwardTensors {
  at::Tensor grad_out;   // (B, H, L, Ev)
  at::Tensor out;        // (B, H, L, Ev): the forward's output, for D
  at::Tensor lse_unit;   // (B, H, L), contiguous: lse * unit, +inf for rows with no keys
  at::Tensor delta;      // (B, H, L), contiguous: D_i = sum_j P_ij dP_ij - dLSE_i
  at::Tensor grad_lse;   // (B, H, L), contiguous, or undefined: subtracted where a kernel forms D
  at::Tensor kv_finite;  // (B, Hkv) bool, or undefined without causality
};

// Device side: the same, as pointers and strides.
template <typename acc_t>
struct BackwardArgs {
  const void* dout;
  Strides4 dout_strides;
  const void* out;
  Strides4 out_strides;
  const acc_t* lse_unit;  // base^(s - lse_unit) = 0 on rows with no keys
  acc_t* delta;           // written by the dQ kernel when it forms D
  const acc_t* grad_lse;
  const bool* kv_finite;
};

template <typename acc_t>
BackwardArgs<acc_t> backward_args(const BackwardTensors& t) {
  return BackwardArgs<acc_t>{t.grad_out.const_data_ptr(),
                             strides_of(t.grad_out),
                             t.out.const_data_ptr(),
                             strides_of(t.out),
                             t.lse_unit.const_data_ptr<acc_t>(),
                             t.delta.data_ptr<acc_t>(),
                             t.grad_lse.defined() ? t.grad_lse.const_data_ptr<acc_t>() : nullptr,
                             t.kv_finite.defined() ? t.kv_finite.const_data_ptr<bool>() : nullptr};
}

// P_ij = base^(s_ij - lse_i) and M_ij dP_ij (dP_ij = dO_i.v_j) for this thread's query rows
// i0 + ty kTM + r and keys j0 + tx kTN + c, from the tiles in shared memory: sQ (times unit *
// scale) and sDO (query rows), sK and sV (key rows, permuted). lse: lse * unit of the rows.
template <typename scalar_t, typename Cfg, typename acc_t>
__device__ __forceinline__ void query_tile_probabilities(const AttentionParams& p, const DropoutRng& rng, int64_t b,
                                                         int64_t h, int64_t i0, int64_t j0, const acc_t* sQ,
                                                         const acc_t* sDO, const acc_t* sK, const acc_t* sV,
                                                         const acc_t (&lse)[Cfg::kTM],
                                                         acc_t (&prob)[Cfg::kTM][Cfg::kTN],
                                                         acc_t (&dpm)[Cfg::kTM][Cfg::kTN]) {
  constexpr int kTM = Cfg::kTM, kTN = Cfg::kTN;
  const int ty = grid_row(), tx = grid_col();
  const bool flash = p.numerics == Numerics::kFlash;
  const acc_t unit = static_cast<acc_t>(p.score_unit());
  acc_t s[kTM][kTN] = {}, dp[kTM][kTN] = {};
  gemm_nt<Cfg>(s, sQ, sK, round_up(static_cast<int>(p.head_dim), Cfg::kVec));
  gemm_nt<Cfg>(dp, sDO, sV, round_up(static_cast<int>(p.value_dim), Cfg::kVec));
  const int64_t j = j0 + tx * kTN;
  const bool edge = tile_on_edge(p, b, i0, Cfg::kBM, j0, Cfg::kBN);
  const bool aligned = dropout_blocks_aligned(p);  // j0 is a multiple of kBN
#pragma unroll
  for (int r = 0; r < kTM; ++r) {
    const int64_t i = i0 + ty * kTM + r;
    apply_rules<kTN, scalar_t>(p, s[r], b, h, i, j, unit, edge);
    acc_t keep[kTN];
    if (p.has_dropout) dropout_run<kTN>(rng, p.shard.row_position(b, h, i) + static_cast<uint64_t>(j), keep, aligned);
#pragma unroll
    for (int c = 0; c < kTN; ++c) {
      prob[r][c] = exp_base(s[r][c] - lse[r], flash);
      dpm[r][c] = p.has_dropout ? dp[r][c] * keep[c] : dp[r][c];
    }
  }
}

// The tensor-core backward (attention_backward_tc.cu) for problems backward_kernels admits: dQ
// (its kernel forming D = rowsum(dO ∘ O) into t.delta), dK, dV and, when defined, dMask.
void attention_backward_tc(const AttentionProblem& pb, BackwardTensors& t, const std::optional<at::Tensor>& grad_lse,
                           const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv, const at::Tensor& dmask);

// Its kernels' launches for one input dtype (attention_backward_tc.cuh, instantiated in
// attention_backward_tc_bf16.cu and attention_backward_tc_f16.cu): dK and dV per query head.
template <typename scalar_t>
void launch_backward_tc(const AttentionParams& p, const BackwardArgs<float>& a, bool wgmma, scalar_t* dq,
                        scalar_t* dk, scalar_t* dv);

// dMask (the canonical mask's shape, compute type) from D and the saved statistics, on CUDA cores.
void mask_gradient_cuda(const AttentionProblem& pb, const BackwardTensors& t, const at::Tensor& dmask);

// The same on the tensor cores for one input dtype (mask_gradient_tc.cuh; no fused RoPE), dmask
// float32.
template <typename scalar_t>
void launch_mask_gradient_tc(const AttentionParams& p, const BackwardArgs<float>& a, bool wgmma, float* dmask);

// Both mask-gradient kernels' grid: blocks own tile_rows x tile_keys pieces of the mask's rows and
// keys (one along a broadcast dim), blockIdx.z the mask's (batch, head).
inline dim3 mask_gradient_grid(const AttentionParams& p, int tile_rows, int tile_keys) {
  const int64_t key_tiles = p.mask_keys == 1 ? 1 : (p.keys + tile_keys - 1) / tile_keys;
  const int64_t row_tiles = p.mask_queries == 1 ? 1 : (p.queries + tile_rows - 1) / tile_rows;
  TORCH_CHECK(row_tiles <= 65535 && p.mask_batch * p.mask_heads <= 65535, "rudnn's CUDA mask gradient takes at most ",
              std::to_string(65535 * tile_rows), " queries and 65535 mask (batch x heads), but got ",
              std::to_string(p.queries), " and ", std::to_string(p.mask_batch * p.mask_heads));
  return dim3(static_cast<unsigned>(key_tiles), static_cast<unsigned>(row_tiles),
              static_cast<unsigned>(p.mask_batch * p.mask_heads));
}

}  // namespace rudnn::cuda
