// Host side of the tensor-core backward (kernels in attention_backward_tc.cuh): the buffer of D,
// which the dQ kernel forms, the launches for the input dtype, the mask gradient's included, and
// GQA's group sums of the per-head dK and dV.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <array>

#include "../kernel_choice.h"
#include "backward.cuh"

namespace rudnn::cuda {

void attention_backward_tc(const AttentionProblem& pb, BackwardTensors& t, const std::optional<at::Tensor>& grad_lse,
                           const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv, const at::Tensor& dmask) {
  const AttentionParams& p = pb.params;
  t.delta = at::empty({p.batch, p.heads, p.queries}, dq.options().dtype(at::kFloat));
  if (grad_lse.has_value()) t.grad_lse = grad_lse->to(at::kFloat).contiguous();
  const BackwardArgs<float> a = backward_args<float>(t);
  // Under GQA the kernels write each query head's dK and dV, rounded to the input dtype (flash
  // numerics: SPEC section 4); ATen sums them over the group in float32. A block per query head
  // rather than one sweeping the group: eight times the blocks at a group of eight, and no sums
  // held across heads.
  const bool grouped = p.group() > 1;
  const at::Tensor dk_heads = grouped ? at::empty({p.batch, p.heads, p.keys, p.head_dim}, dk.options()) : dk;
  const at::Tensor dv_heads = grouped ? at::empty({p.batch, p.heads, p.keys, p.value_dim}, dv.options()) : dv;
  // The mask gradient with fused RoPE stays on CUDA cores, whose tile loads rotate Q and K, as does
  // that of a mask constant along the keys (only under a key shard: mask_gradient_tc.cuh).
  const bool dmask_tc = dmask.defined() && !p.rotary() && p.mask_keys > 1;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(dq.scalar_type(), "rudnn_attention_backward_tc", [&] {
    launch_backward_tc<scalar_t>(p, a, backward_uses_wgmma(pb), dq.data_ptr<scalar_t>(), dk_heads.data_ptr<scalar_t>(),
                                 dv_heads.data_ptr<scalar_t>());
    if (dmask_tc) launch_mask_gradient_tc<scalar_t>(p, a, backward_uses_wgmma(pb), dmask.data_ptr<float>());
  });
  if (grouped) {
    const std::array<int64_t, 2> groups{p.kv_heads, p.group()};
    // One kernel each, accumulating in float32 (ATen's accumulator for reduced types), rounded once.
    at::Tensor dk_out = dk, dv_out = dv;  // sum_out takes its output by non-const reference
    at::sum_out(dk_out, dk_heads.unflatten(1, groups), 2);
    at::sum_out(dv_out, dv_heads.unflatten(1, groups), 2);
  }
  if (dmask.defined() && !dmask_tc) mask_gradient_cuda(pb, t, dmask);
}

}  // namespace rudnn::cuda
