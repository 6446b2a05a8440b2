// Host side of the tensor-core backward (kernels in attention_backward_tc.cuh): the buffers of D,
// which the dQ kernel forms, and of the group sums GQA rounds into, the launches for the input
// dtype, the mask gradient's included.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include "../kernel_choice.h"
#include "backward.cuh"

namespace rudnn::cuda {

void attention_backward_tc(const AttentionProblem& pb, BackwardTensors& t, const std::optional<at::Tensor>& grad_lse,
                           const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv, const at::Tensor& dmask) {
  const AttentionParams& p = pb.params;
  t.delta = at::empty({p.batch, p.heads, p.queries}, dq.options().dtype(at::kFloat));
  if (grad_lse.has_value()) t.grad_lse = grad_lse->to(at::kFloat).contiguous();
  const BackwardArgs<float> a = backward_args<float>(t);
  const at::Tensor group_sums = p.group() > 1 ? at::empty({p.batch, p.kv_heads, p.keys, p.head_dim + p.value_dim},
                                                          dq.options().dtype(at::kFloat))
                                              : at::Tensor();
  // The mask gradient with fused RoPE stays on CUDA cores, whose tile loads rotate Q and K, as does
  // that of a mask constant along the keys (only under a key shard: mask_gradient_tc.cuh).
  const bool dmask_tc = dmask.defined() && !p.rotary() && p.mask_keys > 1;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(dq.scalar_type(), "rudnn_attention_backward_tc", [&] {
    launch_backward_tc<scalar_t>(p, a, uses_wgmma(pb), group_sums.defined() ? group_sums.data_ptr<float>() : nullptr,
                                 dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>());
    if (dmask_tc) launch_mask_gradient_tc<scalar_t>(p, a, dmask.data_ptr<float>());
  });
  if (dmask.defined() && !dmask_tc) mask_gradient_cuda(pb, t, dmask);
}

}  // namespace rudnn::cuda
