// Device kernels behind the ops. Host code (attention_ops.cpp) validates and allocates;
// these only compute. Tensors are the canonical ones of AttentionProblem.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "attention_problem.h"

namespace rudnn {

// out: (B, H, L, Ev) in the input dtype; lse: (B, H, L) float32 (float64 for float64 inputs).
void attention_forward_cpu(const AttentionProblem& pb, const at::Tensor& out, const at::Tensor& lse);

// grad_out, out: (B, H, L, Ev); lse, grad_lse: (B, H, L). Writes dq, dk, dv (canonical shapes)
// and, when defined, dmask of the canonical mask's shape (Bm, Hm, Lm, Sm).
void attention_backward_cpu(const AttentionProblem& pb, const at::Tensor& grad_out, const at::Tensor& out,
                            const at::Tensor& lse, const std::optional<at::Tensor>& grad_lse,
                            const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                            const at::Tensor& dmask);

// out: (batch, heads, queries, keys), contiguous; element = keep ? 1/(1-p) : 0.
void dropout_mask_cpu(const DropoutRng& rng, const DropoutShard& shard, const at::Tensor& out);

}  // namespace rudnn

#ifdef RUDNN_WITH_CUDA
namespace rudnn::cuda {

void attention_forward_cuda(const AttentionProblem& pb, const at::Tensor& out, const at::Tensor& lse);
// The tensor-core kernels (float16/bfloat16), for problems kernel_choice.h admits; the *_cuda
// entry points pick them.
void attention_forward_tc(const AttentionProblem& pb, const at::Tensor& out, const at::Tensor& lse);
void attention_backward_cuda(const AttentionProblem& pb, const at::Tensor& grad_out, const at::Tensor& out,
                             const at::Tensor& lse, const std::optional<at::Tensor>& grad_lse, const at::Tensor& dq,
                             const at::Tensor& dk, const at::Tensor& dv, const at::Tensor& dmask, bool deterministic);
// out: (batch, heads, queries, keys), contiguous; (seed, offset) read from `state` on the device.
void dropout_mask_cuda(const DropoutRng& rng, const at::Tensor& state, const DropoutShard& shard,
                       const at::Tensor& out);
// grad (B, H, rows, E), contiguous: the gradient of a rotated input turned back, in place, to that
// of the input before RoPE (the table's inverse rotation).
void turn_back_cuda(const at::Tensor& grad, const RotaryTable& table);
// A fresh (seed, offset) on the device from its PyTorch generator, advanced past `counters` Philox
// counters; read on the device, so that it is right under CUDA graph capture too.
at::Tensor draw_dropout_state_cuda(const at::Device& device, uint64_t counters);

}  // namespace rudnn::cuda
#endif
