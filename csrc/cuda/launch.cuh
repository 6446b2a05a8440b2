// Host-side helpers for launching the CUDA kernels: grids, shared-memory limits, head-dim buckets.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "../attention_problem.h"
#include "tile.cuh"

namespace rudnn::cuda {

// Numbers in error messages of CUDA translation units go through std::to_string: streaming them
// into c10::str from host code compiled by nvcc crashed on the GPU machine (seen with size_t).
using std::to_string;

constexpr int kMaxWidth = 256;  // the widest head-dim bucket

inline void check_cuda_problem(const AttentionParams& p) {
  TORCH_CHECK(std::max(p.head_dim, p.value_dim) <= kMaxWidth, "rudnn's CUDA kernels take head dims up to ",
              to_string(kMaxWidth), ", but got E = ", to_string(p.head_dim), " and Ev = ", to_string(p.value_dim));
  TORCH_CHECK(p.batch <= 65535 && std::max(p.heads, p.kv_heads) <= 65535,
              "rudnn's CUDA kernels take at most 65535 batch entries and heads, but got ", to_string(p.batch), " and ",
              to_string(p.heads));
}

// Blocks over (row tiles, heads, batch).
inline dim3 tile_grid(int64_t rows, int tile_rows, int64_t heads, int64_t batch) {
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
  TORCH_CHECK(tiles < (int64_t{1} << 31), "too many rows for one launch: ", to_string(rows));
  return dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(heads), static_cast<unsigned>(batch));
}

inline size_t max_shared_memory() { return at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin; }

// Past 48 KB a kernel gets its dynamic shared memory only once its limit is raised.
template <typename Kernel>
void allow_shared_memory(Kernel kernel, size_t smem) {
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
}

// How many blocks of the kernel (threads, smem) the whole GPU holds at once.
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int threads, size_t smem) {
  allow_shared_memory(kernel, smem);
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  return static_cast<int64_t>(per_sm) * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

template <typename Kernel, typename... Args>
void launch_threads(Kernel kernel, dim3 grid, int threads, size_t smem, Args... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  TORCH_CHECK(smem <= max_shared_memory(), "rudnn: this kernel needs ", to_string(smem),
              " bytes of shared memory per block, but the device offers ", to_string(max_shared_memory()));
  allow_shared_memory(kernel, smem);
  kernel<<<grid, threads, smem, at::cuda::getCurrentCUDAStream()>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// A CUDA-core kernel (tile.cuh's block of kThreads).
template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, size_t smem, Args... args) {
  launch_threads(kernel, grid, kThreads, smem, args...);
}

// f(std::integral_constant<int, W>) for the smallest head-dim bucket W that holds `width` columns.
template <typename F>
void dispatch_width(int64_t width, F&& f) {
  if (width <= 64) {
    f(std::integral_constant<int, 64>{});
  } else if (width <= 128) {
    f(std::integral_constant<int, 128>{});
  } else {
    f(std::integral_constant<int, kMaxWidth>{});
  }
}

// f(std::true_type{}) or f(std::false_type{}): a run-time flag as a kernel's template argument.
template <typename F>
void dispatch_flag(bool flag, F&& f) {
  if (flag) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
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
