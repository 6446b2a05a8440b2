#include "kernel_choice.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>

#ifdef RUDNN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace rudnn {
namespace {

constexpr int64_t kMaxTensorCoreWidth = 256;

// The reason the tensor-core kernels cannot take the problem, or "" where they can.
std::string tensor_core_obstacle(const AttentionProblem& pb) {
  const AttentionParams& p = pb.params;
  const at::ScalarType dtype = pb.q.scalar_type();
  if (dtype != at::kHalf && dtype != at::kBFloat16) {
    return std::string("the tensor-core kernels take float16/bfloat16, not ") + c10::toString(dtype);
  }
  if (const char* env = std::getenv("RUDNN_DISABLE_TENSOR_CORES"); env != nullptr && std::strcmp(env, "1") == 0) {
    return "RUDNN_DISABLE_TENSOR_CORES=1";
  }
#ifdef RUDNN_WITH_CUDA
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(pb.q.device().index());
  if (prop->major < 8) {
    return "the device is sm_" + std::to_string(prop->major * 10 + prop->minor) + "; mma.sync needs sm_80 or newer";
  }
#endif
  if (std::max(p.head_dim, p.value_dim) > kMaxTensorCoreWidth) {
    return "E and Ev must be at most " + std::to_string(kMaxTensorCoreWidth) + ", but are " +
           std::to_string(p.head_dim) + " and " + std::to_string(p.value_dim);
  }
  if (p.batch > 65535 || std::max(p.heads, p.kv_heads) > 65535) return "more than 65535 batch entries or heads";
  return "";
}

std::string features(const AttentionProblem& pb) {
  const AttentionParams& p = pb.params;
  std::string s = "E = " + std::to_string(p.head_dim) + ", Ev = " + std::to_string(p.value_dim);
  if (p.is_causal) s += ", causal";
  if (p.mask_kind == MaskKind::kBool) s += ", bool mask";
  if (p.mask_kind == MaskKind::kFloat || p.mask_kind == MaskKind::kFloat32) s += ", float mask";
  if (p.has_dropout) s += ", dropout";
  if (p.group() > 1) s += ", GQA group of " + std::to_string(p.group());
  if (p.rotary()) s += ", fused RoPE";
  s += p.numerics == Numerics::kFlash ? ", flash numerics" : ", exact numerics";
  return s;
}

// The operands the tensor-core kernels copy element by element rather than by cp.async.
std::string slow_operands(const AttentionProblem& pb) {
  const AttentionParams& p = pb.params;
  std::string names;
  const auto check = [&](const char* name, const void* base, const Strides4& s, int64_t cols) {
    if (!rows_in_16_byte_chunks(base, s, cols, pb.q.element_size())) {
      names += names.empty() ? name : std::string(", ") + name;
    }
  };
  check("query", p.q, p.q_strides, p.head_dim);
  check("key", p.k, p.k_strides, p.head_dim);
  check("value", p.v, p.v_strides, p.value_dim);
  if (names.empty()) return "";
  return "; " + names +
         " read element by element: rows that are not contiguous, 16-byte aligned and a multiple of 8 long";
}

std::string explanation(const AttentionProblem& pb, const KernelChoice& choice, const char* tensor_core_name,
                        const char* cuda_core_name) {
  if (!pb.q.is_cuda()) return "CPU kernels (" + features(pb) + ")";
  if (choice.tensor_cores) return std::string(tensor_core_name) + " (" + features(pb) + ")" + slow_operands(pb);
  return std::string(cuda_core_name) + " (" + features(pb) + "), because " + choice.obstacle;
}

}  // namespace

KernelChoice forward_kernels(const AttentionProblem& pb) {
  if (!pb.q.is_cuda()) return {false, "the inputs are on the CPU"};
  std::string obstacle = tensor_core_obstacle(pb);
  return {obstacle.empty(), std::move(obstacle)};
}

bool backward_uses_wgmma(const AttentionProblem& pb) {
#if defined(RUDNN_WITH_CUDA) && defined(RUDNN_WGMMA)
  const AttentionParams& p = pb.params;
  if (const char* env = std::getenv("RUDNN_DISABLE_WGMMA"); env != nullptr && std::strcmp(env, "1") == 0) return false;
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(pb.q.device().index());
  // dispatch_tc_dims' buckets of whole panels: 64 (widths 33-64), 128, 192 and 256 (widths above 96).
  const int64_t width = std::max(p.head_dim, p.value_dim);
  return prop->major == 9 && prop->minor == 0 && ((width > 32 && width <= 64) || width > 96);
#else
  (void)pb;
  return false;
#endif
}

bool forward_uses_wgmma(const AttentionProblem& pb) {
  const AttentionParams& p = pb.params;
  return backward_uses_wgmma(pb) && (!p.rotary() || p.queries <= 64 || std::max(p.head_dim, p.value_dim) <= 128);
}

KernelChoice backward_kernels(const AttentionProblem& pb) {
  KernelChoice choice = forward_kernels(pb);
  if (choice.tensor_cores && pb.params.numerics == Numerics::kExact) {
    choice = {false, "the tensor-core backward computes in flash numerics only"};
  }
  return choice;
}

std::string explain_forward(const AttentionProblem& pb) {
  const KernelChoice choice = forward_kernels(pb);
  return explanation(pb, choice,
                     choice.tensor_cores && forward_uses_wgmma(pb) ? "tensor-core forward (wgmma)"
                                                                   : "tensor-core forward (mma.sync)",
                     "CUDA-core forward");
}

std::string explain_backward(const AttentionProblem& pb) {
  const KernelChoice choice = backward_kernels(pb);
  return explanation(pb, choice,
                     choice.tensor_cores && backward_uses_wgmma(pb)
                         ? "tensor-core backward (wgmma: dQ, then dK/dV per key tile)"
                         : "tensor-core backward (mma.sync: dQ, then dK/dV per key tile)",
                     "CUDA-core backward");
}

}  // namespace rudnn
