// RoPE inside the CUDA kernels: Q and K rows are turned on their way into shared memory, so the
// rotated tensors are never written out; the gradients are turned back on the host (rotary.h).
// Pairs turn in float32 (float64 for float64 inputs) and are rounded to the input dtype, as a
// separately rotated input (rudnn.apply_rotary) would be. No torch includes.
#pragma once

#include "common.cuh"

namespace rudnn::cuda {

__device__ __forceinline__ const float* rotary_row(const RotaryTable& t, int64_t b, int64_t h, int64_t row) {
  return t.data + b * t.strides.batch + h * t.strides.head + row * t.strides.row;
}

// Column c of a head dim E: its pair's other column, the pair's index, and whether c comes first
// (y_first = x_first cos - x_second sin, y_second = x_first sin + x_second cos).
struct RotaryColumn {
  int partner, pair;
  bool first;
};
__device__ __forceinline__ RotaryColumn rotary_column(int c, int E, bool interleaved) {
  const int half = E / 2;
  if (interleaved) return {c ^ 1, c / 2, (c & 1) == 0};
  return c < half ? RotaryColumn{c + half, c, true} : RotaryColumn{c - half, c - half, false};
}

// x (column c of a row) turned, given its partner's value and the row's table row.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t turned(acc_t x, acc_t partner, const RotaryColumn& col, const float* angles,
                                        int E) {
  const acc_t cos = static_cast<acc_t>(angles[col.pair]), sin = static_cast<acc_t>(angles[E / 2 + col.pair]);
  return round_to<scalar_t>(col.first ? x * cos - partner * sin : partner * sin + x * cos);
}

// Rows [0, kRows) of a tile of 16-bit elements in shared memory (row r at tile + r ld), the rows
// row0 + r of head (b, h), turned in place; rows at or past `rows` are left as they are.
template <typename scalar_t, int kRows, int kThreadCount>
__device__ __forceinline__ void rotate_tile(scalar_t* tile, int ld, const RotaryTable& t, int64_t b, int64_t h,
                                            int64_t row0, int64_t rows, int E) {
  const int half = E / 2;
#pragma unroll 1
  for (int idx = threadIdx.x; idx < kRows * half; idx += kThreadCount) {
    const int r = idx / half, pair = idx % half;
    if (row0 + r >= rows) break;  // idx only grows, and so does r
    const float* angles = rotary_row(t, b, h, row0 + r);
    const float cos = angles[pair], sin = angles[half + pair];
    const int c1 = t.interleaved ? 2 * pair : pair, c2 = t.interleaved ? 2 * pair + 1 : pair + half;
    scalar_t* x = tile + r * ld;
    const float x1 = static_cast<float>(x[c1]), x2 = static_cast<float>(x[c2]);
    x[c1] = static_cast<scalar_t>(x1 * cos - x2 * sin);
    x[c2] = static_cast<scalar_t>(x1 * sin + x2 * cos);
  }
}

}  // namespace rudnn::cuda
