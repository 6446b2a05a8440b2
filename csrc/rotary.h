// RoPE on whole tensors with ATen, for the CPU kernels' tiles and for turning the gradients of
// rotated Q and K back to the un-rotated inputs (CPU and CUDA alike).
#pragma once

#include <ATen/core/Tensor.h>

namespace rudnn {

// x (..., rows, E) with each pair turned by the angles of `table` (..., rows, E) (attention_params.h's
// RotaryTable layout, broadcast to x), or turned back with `inverse`; computed in float32 (float64
// for float64 x) and returned in x's dtype.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& table, bool interleaved, bool inverse);

}  // namespace rudnn
