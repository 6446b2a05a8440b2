// The tensor-core forward's kernels for bfloat16 inputs.
#include "attention_forward_tc.cuh"

namespace rudnn::cuda {
template void launch_forward_tc<c10::BFloat16>(const AttentionParams&, bool, c10::BFloat16*, float*, const bool*);
}  // namespace rudnn::cuda
