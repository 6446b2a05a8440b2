// The tensor-core backward's kernels for float16 inputs, the mask gradient's included.
#include "attention_backward_tc.cuh"
#include "mask_gradient_tc.cuh"

namespace rudnn::cuda {
template void launch_backward_tc<c10::Half>(const AttentionParams&, const BackwardArgs<float>&, bool, c10::Half*,
                                           c10::Half*, c10::Half*);
template void launch_mask_gradient_tc<c10::Half>(const AttentionParams&, const BackwardArgs<float>&, bool, float*);
}  // namespace rudnn::cuda
