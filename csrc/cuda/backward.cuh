// What the backward kernels (attention_backward.cu, mask_gradient.cu) read besides the problem.
#pragma once

#include <ATen/ATen.h>

#include "../attention_problem.h"
#include "common.cuh"

namespace rudnn::cuda {

// Host side: the tensors, in the compute type where they are statistics.
struct BackwardTensors {
  at::Tensor grad_out;   // (B, H, L, Ev)
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
  const acc_t* lse_unit;  // base^(s - lse_unit) = 0 on rows with no keys
  acc_t* delta;           // written by the dQ kernel when it forms D
  const acc_t* grad_lse;
  const bool* kv_finite;
};

template <typename acc_t>
BackwardArgs<acc_t> backward_args(const BackwardTensors& t) {
  return BackwardArgs<acc_t>{t.grad_out.const_data_ptr(),
                             strides_of(t.grad_out),
                             t.lse_unit.const_data_ptr<acc_t>(),
                             t.delta.data_ptr<acc_t>(),
                             t.grad_lse.defined() ? t.grad_lse.const_data_ptr<acc_t>() : nullptr,
                             t.kv_finite.defined() ? t.kv_finite.const_data_ptr<bool>() : nullptr};
}

// dMask (the canonical mask's shape, compute type) from D and the saved statistics.
void mask_gradient_cuda(const AttentionProblem& pb, const BackwardTensors& t, const at::Tensor& dmask);

}  // namespace rudnn::cuda
