// The tensor-core backward's kernels for bfloat16 inputs, the mask gradient's included.
#include "attention_backward_tc.cuh"
#include "mask_gradient_tc.cuh"

namespace rudnn::cuda {
template void launch_backward_tc<c10::BFloat16>(const AttentionParams&, const BackwardArgs<float>&, bool,
                                                c10::BFloat16*, c10::BFloat16*, c10::BFloat16*);
template void launch_mask_gradient_tc<c10::BFloat16>(const AttentionParams&, const BackwardArgs<float>&, bool, float*);
}  // namespace rudnn::cuda
