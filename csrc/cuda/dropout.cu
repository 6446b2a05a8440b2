// Dropout on CUDA: the mask kernel (one thread per four positions of a row) and the draw of a
// (seed, offset) pair from PyTorch's CUDA generator.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/detail/UnpackRaw.cuh>
#include <c10/cuda/CUDAGuard.h>

#include <mutex>

#include "../kernels.h"
#include "common.cuh"

namespace rudnn::cuda {
namespace {

// Thread t of row r writes keys [4t, 4t + 4): one Philox block serves up to two blocks' words.
template <typename scalar_t>
__global__ void dropout_mask_kernel(DropoutRng rng, const int64_t* __restrict__ state, DropoutShard shard,
                                    scalar_t* __restrict__ out, int64_t heads, int64_t queries, int64_t keys,
                                    int64_t rows) {
  const int64_t quad = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t quads_per_row = (keys + 3) / 4;
  if (quad >= rows * quads_per_row) return;
  rng.seed = static_cast<uint64_t>(state[0]);
  rng.offset = static_cast<uint64_t>(state[1]);
  const int64_t row = quad / quads_per_row, j0 = quad % quads_per_row * 4;
  const int64_t b = row / (heads * queries), h = row / queries % heads, i = row % queries;
  const uint64_t base = shard.row_position(b, h, i);
  const scalar_t kept = static_cast<scalar_t>(rng.keep_scale);
  uint64_t cached = ~uint64_t{0};
  Philox4 bits{};
  for (int64_t j = j0; j < min(j0 + 4, keys); ++j) {
    const uint64_t pos = base + static_cast<uint64_t>(j);
    if ((pos >> 2) != cached) {
      cached = pos >> 2;
      bits = rng.block(pos);
    }
    out[row * keys + j] = rng.keep(bits.x[pos & 3]) ? kept : scalar_t(0);
  }
}

// PyTorch's offset counts 32-bit draws (four per Philox counter) and its kernels' thread t reads
// counters (offset / 4 + n, t): rudnn's counters start at offset / 4, with the draw advanced by
// four per counter used, so neither rudnn nor PyTorch's next op reuses a counter.
__global__ void unpack_philox_kernel(at::PhiloxCudaState philox, int64_t* state) {
  const auto [seed, offset] = at::cuda::philox::unpack(philox);
  state[0] = static_cast<int64_t>(seed);
  state[1] = static_cast<int64_t>(offset / 4);
}

}  // namespace

void dropout_mask_cuda(const DropoutRng& rng, const at::Tensor& state, const DropoutShard& shard,
                       const at::Tensor& out) {
  const int64_t heads = out.size(1), queries = out.size(2), keys = out.size(3);
  const int64_t rows = out.size(0) * heads * queries;
  const int64_t threads = rows * ((keys + 3) / 4);
  if (threads == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  constexpr int kBlock = 256;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "rudnn_dropout_mask_cuda", [&] {
    dropout_mask_kernel<scalar_t><<<(threads + kBlock - 1) / kBlock, kBlock, 0, at::cuda::getCurrentCUDAStream()>>>(
        rng, state.const_data_ptr<int64_t>(), shard, out.data_ptr<scalar_t>(), heads, queries, keys, rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor draw_dropout_state_cuda(const at::Device& device, uint64_t counters) {
  const c10::cuda::CUDAGuard guard(device);
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(device.index()));
  at::PhiloxCudaState philox;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    philox = gen->philox_cuda_state(4 * counters);
  }
  at::Tensor state = at::empty({2}, at::TensorOptions().dtype(at::kLong).device(device));
  unpack_philox_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(philox, state.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return state;
}

}  // namespace rudnn::cuda
