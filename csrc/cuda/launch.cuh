// Host-side helpers for launching the CUDA kernels: grids, shared-memory limits, head-dim buckets.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>

#include "../attention_problem.h"
#include "common.cuh"

namespace rudnn::cuda {

inline void check_cuda_problem(const AttentionParams& p) {
  TORCH_CHECK(std::max(p.head_dim, p.value_dim) <= Bucket256::kWidth,
              "rudnn's CUDA kernels take head dims up to ", Bucket256::kWidth, ", but got E = ", p.head_dim,
              " and Ev = ", p.value_dim);
  TORCH_CHECK(p.batch <= 65535 && p.heads <= 65535, "rudnn's CUDA kernels take at most 65535 batch entries and ",
              "heads, but got ", p.batch, " and ", p.heads);
}

// Blocks over (row tiles, heads, batch).
inline dim3 tile_grid(int64_t rows, int tile_rows, int64_t heads, int64_t batch) {
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
  TORCH_CHECK(tiles < (int64_t{1} << 31), "too many rows for one launch: ", rows);
  return dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(heads), static_cast<unsigned>(batch));
}

template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, size_t smem, Args... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  kernel<<<grid, kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The smallest bucket whose width holds `width` columns.
template <typename F>
void dispatch_bucket(int64_t width, F&& f) {
  if (width <= Bucket64::kWidth) {
    f(Bucket64{});
  } else if (width <= Bucket128::kWidth) {
    f(Bucket128{});
  } else {
    f(Bucket256{});
  }
}

// (B, Hkv) bool: every value of the head's K and V is finite, so that tiles causality excludes
// can be skipped (a sum overflowing to inf only costs the skipping). Undefined without causality.
inline at::Tensor keys_values_finite(const AttentionProblem& pb) {
  if (!pb.params.is_causal) return at::Tensor();
  const at::ScalarType acc = pb.v.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::isfinite(pb.k.sum({2, 3}, /*keepdim=*/false, acc) + pb.v.sum({2, 3}, /*keepdim=*/false, acc))
      .contiguous();
}

}  // namespace rudnn::cuda
