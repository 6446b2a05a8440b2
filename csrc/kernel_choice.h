// Which kernels run a problem, and why: read by the CUDA dispatch and by rudnn.explain, so that
// what explain says is what runs.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "attention_problem.h"

namespace rudnn {

struct KernelChoice {
  bool tensor_cores;
  std::string why;  // the kernel family and the reason, for people
};

KernelChoice forward_kernels(const AttentionProblem& pb);
KernelChoice backward_kernels(const AttentionProblem& pb);

// Whether the tensor-core kernels can read `t` in place: 16-byte aligned rows of contiguous
// elements (cp.async moves 16 bytes at a time).
bool tensor_core_operand(const at::Tensor& t);

}  // namespace rudnn
