// Host side of the tensor-core forward (kernels in attention_forward_tc.cuh): the launches for the
// input dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>

#include "../kernel_choice.h"
#include "../kernels.h"
#include "launch.cuh"
#include "tensor_core.cuh"

namespace rudnn::cuda {

void attention_forward_tc(const AttentionProblem& pb, const at::Tensor& out, const at::Tensor& lse) {
  const c10::cuda::CUDAGuard guard(out.device());
  const at::Tensor kv_finite = keys_values_finite(pb);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(out.scalar_type(), "rudnn_attention_forward_tc", [&] {
    launch_forward_tc<scalar_t>(pb.params, forward_uses_wgmma(pb), out.data_ptr<scalar_t>(), lse.data_ptr<float>(),
                                kv_finite.defined() ? kv_finite.const_data_ptr<bool>() : nullptr);
  });
}

}  // namespace rudnn::cuda
