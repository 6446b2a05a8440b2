// Which kernels run a problem, and why: read by the CUDA dispatch and by rudnn.explain, so that
// what explain says is what runs.
#pragma once

#include <string>

#include "attention_problem.h"

namespace rudnn {

struct KernelChoice {
  bool tensor_cores;
  std::string why;  // the kernel family and the reason, for people
};

KernelChoice forward_kernels(const AttentionProblem& pb);
KernelChoice backward_kernels(const AttentionProblem& pb);

}  // namespace rudnn
