// Validation of user inputs and their canonical 4-D form. Every op goes through here, so every
// bad input is caught in one place and reported with the argument and the rule it breaks.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "attention_params.h"

namespace rudnn {

struct AttentionProblem {
  AttentionParams params;
  // q: (B, H, L, E), k: (B, Hkv, S, E), v: (B, Hkv, S, Ev), mask: (Bm, Hm, Lm, Sm) or undefined.
  // Views of the inputs; a copy is made only for broadcasts that no strides can express.
  at::Tensor q, k, v, mask;
  at::Tensor key_windows, query_windows;  // packed documents (documents.h), or undefined
  at::Tensor q_rotary, k_rotary;          // RoPE tables (B, H, L, E), (B, Hkv, S, E), or undefined
  std::vector<int64_t> out_shape;         // (N..., H, L, Ev)
  std::vector<int64_t> lse_shape;         // (N..., H, L)
  // Inputs broadcast to the problem, before the batch dims N... are flattened into B:
  // gradients of the canonical tensors are reshaped to these, then summed to the inputs' shapes.
  std::vector<int64_t> q_full, k_full, v_full, mask_full;
};

AttentionProblem make_problem(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                              const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                              std::optional<double> scale, bool enable_gqa, std::optional<std::string_view> numerics,
                              at::IntArrayRef shard, const std::optional<at::Tensor>& query_documents = std::nullopt,
                              const std::optional<at::Tensor>& key_documents = std::nullopt,
                              const std::optional<at::Tensor>& query_rotary = std::nullopt,
                              const std::optional<at::Tensor>& key_rotary = std::nullopt,
                              bool rotary_interleaved = false);

// Points the problem's dropout at a state tensor (seed, offset): int64, two elements, on the
// problem's device. On the CPU the values are read here; CUDA kernels read them on the device.
void set_dropout_state(AttentionParams& p, const at::Tensor& state, double dropout_p, const at::Device& device);

// Resolves a shard description [global_heads, head_start, global_queries, query_start,
// global_keys, key_start] (-1: the local size) for a problem of the given local sizes.
DropoutShard make_shard(at::IntArrayRef shard, int64_t heads, int64_t queries, int64_t keys);

// Numbers and sizes ("[2, 3, 4]") for error messages, formatted without iostreams: streaming a
// number into TORCH_CHECK's message crashes where the extension and libtorch load different C++
// runtimes (seen on the GPU machine's build).
std::string number_text(int64_t n);
std::string number_text(double x);
std::string shape_text(at::IntArrayRef sizes);

// Element strides of a 4-D tensor for the kernels, 0 along size-1 dims.
Strides4 strides_of(const at::Tensor& t);

// Gradient of a canonical tensor back to the shape of the input it came from.
at::Tensor gradient_to_input(const at::Tensor& grad, at::IntArrayRef full, at::IntArrayRef input_sizes);

}  // namespace rudnn
