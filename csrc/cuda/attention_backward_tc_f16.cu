// The tensor-core backward's kernels for float16 inputs.
#include "attention_backward_tc.cuh"

namespace rudnn::cuda {
template void launch_backward_tc<c10::Half>(const AttentionParams&, const BackwardArgs<float>&, float*,
                                           c10::Half*, c10::Half*, c10::Half*);
}  // namespace rudnn::cuda
