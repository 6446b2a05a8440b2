// Which kernels run a problem, and why: read by the CUDA dispatch and by rudnn.explain, so that
// what explain says is what runs.
#pragma once

#include <string>

#include "attention_problem.h"

namespace rudnn {

// The dispatch's question, asked on every call: no text is built where the tensor cores run.
struct KernelChoice {
  bool tensor_cores;
  std::string obstacle;  // why the tensor-core kernels cannot take the problem; "" where they run
};

KernelChoice forward_kernels(const AttentionProblem& pb);
KernelChoice backward_kernels(const AttentionProblem& pb);
// Whether the tensor-core kernels take their products by wgmma (sm_90a builds on an sm_90 device,
// head-dim buckets of whole 64-column panels) rather than by mma.sync. With fused RoPE every query
// block turns each K tile it reads: up to head dim 128 the wgmma forward's blocks hold two warp
// groups (128 rows, as mma.sync's) past 64 queries, but wider heads' one group of 64 rows would
// turn K twice as often as mma.sync, so there the forward takes wgmma only where the queries fit
// one block (L <= 64: decoding, short chunks over a long cache).
bool forward_uses_wgmma(const AttentionProblem& pb);
bool backward_uses_wgmma(const AttentionProblem& pb);

// For people (rudnn.explain): the kernel family, the problem's features and the obstacle.
std::string explain_forward(const AttentionProblem& pb);
std::string explain_backward(const AttentionProblem& pb);

}  // namespace rudnn
