// dQ and dK of the rotated Q and K turned back to the un-rotated inputs, in place: one thread per
// pair, the inverse rotation (rotary.cuh) in float32 (float64 for float64).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../kernels.h"
#include "rotary.cuh"

namespace rudnn::cuda {
namespace {

template <typename scalar_t, typename acc_t = typename Compute<scalar_t>::type>
__global__ void turn_back_kernel(scalar_t* __restrict__ x, const RotaryTable t, int64_t heads, int64_t rows, int E,
                                 int64_t pairs) {
  const int half = E / 2;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < pairs;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / half;  // of the contiguous (B, H, rows, E) gradient
    const int pair = static_cast<int>(idx % half);
    const int64_t i = row % rows, h = row / rows % heads, b = row / rows / heads;
    const float* angles = rotary_row(t, b, h, i);
    scalar_t* r = x + row * E;
    const int c1 = t.interleaved ? 2 * pair : pair, c2 = t.interleaved ? 2 * pair + 1 : pair + half;
    acc_t x1 = static_cast<acc_t>(r[c1]), x2 = static_cast<acc_t>(r[c2]);
    turn_pair<true>(x1, x2, static_cast<acc_t>(angles[pair]), static_cast<acc_t>(angles[half + pair]));
    r[c1] = static_cast<scalar_t>(x1);
    r[c2] = static_cast<scalar_t>(x2);
  }
}

}  // namespace

void turn_back_cuda(const at::Tensor& grad, const RotaryTable& table) {
  TORCH_INTERNAL_ASSERT(grad.is_contiguous() && grad.dim() == 4);
  const int64_t pairs = grad.numel() / 2;
  if (pairs == 0) return;
  const c10::cuda::CUDAGuard guard(grad.device());
  constexpr int kBlock = 256;
  const int64_t blocks = std::min<int64_t>((pairs + kBlock - 1) / kBlock, 65536);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "rudnn_turn_back", [&] {
    turn_back_kernel<scalar_t><<<blocks, kBlock, 0, at::cuda::getCurrentCUDAStream()>>>(
        grad.data_ptr<scalar_t>(), table, grad.size(1), grad.size(2), static_cast<int>(grad.size(3)), pairs);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace rudnn::cuda
