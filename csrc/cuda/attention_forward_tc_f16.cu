// The tensor-core forward's kernels for float16 inputs.
#include "attention_forward_tc.cuh"

namespace rudnn::cuda {
template void launch_forward_tc<c10::Half>(const AttentionParams&, bool, c10::Half*, float*, const bool*);
}  // namespace rudnn::cuda
