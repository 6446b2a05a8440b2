// The rudnn operators: schemas, and the host side of each op (validate, allocate, launch).
// Fake (meta) implementations and autograd live in python/rudnn/ops.py.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ExpandUtils.h>
#include <Python.h>
#include <torch/library.h>

#include <mutex>

#include "attention_problem.h"
#include "kernel_choice.h"
#include "kernels.h"
#include "rotary.h"

namespace rudnn {
namespace {

// Philox counters a call may use: one per four positions of the global (B, GH, GL, GS) problem.
uint64_t dropout_counters(const AttentionParams& p) {
  const DropoutShard& s = p.shard;
  const uint64_t positions = static_cast<uint64_t>(p.batch) * s.global_heads * s.global_queries * s.global_keys;
  return (positions + 3) / 4;
}

// (seed, offset) for a call that was given none, from the device's default generator, which is
// advanced past the counters the call uses: torch.manual_seed repeats runs and two calls differ.
at::Tensor draw_dropout_state(const at::Device& device, uint64_t counters) {
#ifdef RUDNN_WITH_CUDA
  if (device.is_cuda()) return cuda::draw_dropout_state_cuda(device, counters);
#endif
  TORCH_CHECK(device.is_cpu(), "rudnn: no kernels for device ", device);
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  uint64_t seed;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    seed = at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
  }
  return at::tensor({static_cast<int64_t>(seed), int64_t{0}}, at::kLong);
}

at::ScalarType stats_dtype(at::ScalarType input) { return input == at::kDouble ? at::kDouble : at::kFloat; }

void check_like(const at::Tensor& t, at::IntArrayRef shape, at::ScalarType dtype, const at::Device& device,
                const char* name) {
  TORCH_CHECK(t.sizes() == shape, name, " must have shape ", shape_text(shape), ", but got ", shape_text(t.sizes()));
  TORCH_CHECK(t.scalar_type() == dtype && t.device() == device, name, " must be ", dtype, " on ", device, ", but is ",
              t.scalar_type(), " on ", t.device());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
    double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa,
    std::optional<c10::string_view> numerics, const std::optional<at::Tensor>& dropout_state, at::IntArrayRef shard,
    bool /*deterministic: carried to the backward*/, const std::optional<at::Tensor>& query_documents,
    const std::optional<at::Tensor>& key_documents, const std::optional<at::Tensor>& query_rotary,
    const std::optional<at::Tensor>& key_rotary, bool rotary_interleaved) {
  AttentionProblem pb = make_problem(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, numerics,
                                     shard, query_documents, key_documents, query_rotary, key_rotary,
                                     rotary_interleaved);
  AttentionParams& p = pb.params;
  at::Tensor state = at::empty({0}, query.options().dtype(at::kLong));
  if (p.has_dropout) {
    state =
        dropout_state.has_value() ? dropout_state->clone() : draw_dropout_state(query.device(), dropout_counters(p));
    set_dropout_state(p, state, dropout_p, query.device());
  }
  at::Tensor out = at::empty({p.batch, p.heads, p.queries, p.value_dim}, query.options());
  at::Tensor lse = at::empty({p.batch, p.heads, p.queries}, query.options().dtype(stats_dtype(query.scalar_type())));
#ifdef RUDNN_WITH_CUDA
  if (query.is_cuda()) {
    cuda::attention_forward_cuda(pb, out, lse);
  } else
#endif
  {
    attention_forward_cpu(pb, out, lse);
  }
  return {out.view(pb.out_shape), lse.view(pb.lse_shape), state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& attn_mask, const at::Tensor& out,
    const at::Tensor& lse, double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa,
    std::optional<c10::string_view> numerics, const at::Tensor& dropout_state, at::IntArrayRef shard, bool mask_grad,
    bool deterministic, const std::optional<at::Tensor>& query_documents,
    const std::optional<at::Tensor>& key_documents, const std::optional<at::Tensor>& query_rotary,
    const std::optional<at::Tensor>& key_rotary, bool rotary_interleaved) {
  AttentionProblem pb = make_problem(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, numerics,
                                     shard, query_documents, key_documents, query_rotary, key_rotary,
                                     rotary_interleaved);
  AttentionParams& p = pb.params;
  if (p.has_dropout) set_dropout_state(p, dropout_state, dropout_p, query.device());
  const at::ScalarType stats = stats_dtype(query.scalar_type());
  check_like(grad_out, pb.out_shape, query.scalar_type(), query.device(), "grad_out");
  check_like(out, pb.out_shape, query.scalar_type(), query.device(), "out");
  check_like(lse, pb.lse_shape, stats, query.device(), "lse");
  if (grad_lse.has_value()) check_like(*grad_lse, pb.lse_shape, stats, query.device(), "grad_lse");
  TORCH_CHECK(!mask_grad || p.mask_kind == MaskKind::kFloat || p.mask_kind == MaskKind::kFloat32,
              "mask_grad needs a floating-point attn_mask");

  const std::vector<int64_t> rows{p.batch, p.heads, p.queries};
  const std::vector<int64_t> values{p.batch, p.heads, p.queries, p.value_dim};
  std::optional<at::Tensor> grad_lse_rows;
  if (grad_lse.has_value()) grad_lse_rows = grad_lse->reshape(rows);
  at::Tensor dq = at::empty(pb.q.sizes(), query.options());
  at::Tensor dk = at::empty(pb.k.sizes(), key.options());
  at::Tensor dv = at::empty(pb.v.sizes(), value.options());
  // A mask constant along the keys adds a constant to each row's scores, which the softmax ignores:
  // its gradient is exactly the LSE's (0 in a row with no keys), summed over the mask's broadcast
  // dims, whatever the numerics. The kernels' sum of dS over the row would only leave rounding. Not
  // under a key shard, whose probabilities do not sum to one.
  const bool row_constant = mask_grad && p.mask_keys == 1 && p.shard.global_keys == p.keys;
  at::Tensor dmask;
  if (mask_grad && !row_constant) dmask = at::empty(pb.mask.sizes(), query.options().dtype(stats));
#ifdef RUDNN_WITH_CUDA
  if (query.is_cuda()) {
    cuda::attention_backward_cuda(pb, grad_out.reshape(values), out.reshape(values), lse.reshape(rows), grad_lse_rows,
                                  dq, dk, dv, dmask, deterministic);
  } else
#endif
  {  // the CPU backward is deterministic whatever `deterministic` says
    attention_backward_cpu(pb, grad_out.reshape(values), out.reshape(values), lse.reshape(rows), grad_lse_rows, dq, dk,
                           dv, dmask);
  }
  at::Tensor dmask_out = at::empty({0}, query.options());
  if (row_constant) {
    const at::Tensor g = grad_lse_rows.has_value()
                             ? at::where(lse.reshape(rows).isneginf(), at::zeros({}, lse.options()), *grad_lse_rows)
                             : at::zeros(rows, lse.options());
    dmask = at::sum_to(g.unsqueeze(-1), pb.mask.sizes());
  }
  if (mask_grad) {
    dmask_out = gradient_to_input(dmask, pb.mask_full, attn_mask->sizes()).to(attn_mask->scalar_type());
  }
  if (p.rotary()) {  // the kernels' dQ and dK are those of the rotated Q and K
#ifdef RUDNN_WITH_CUDA
    if (query.is_cuda()) {
      cuda::turn_back_cuda(dq, p.q_rotary);
      cuda::turn_back_cuda(dk, p.k_rotary);
    } else
#endif
    {
      dq = rotate(dq, pb.q_rotary, p.q_rotary.interleaved, /*inverse=*/true);
      dk = rotate(dk, pb.k_rotary, p.k_rotary.interleaved, /*inverse=*/true);
    }
  }
  return {gradient_to_input(dq, pb.q_full, query.sizes()), gradient_to_input(dk, pb.k_full, key.sizes()),
          gradient_to_input(dv, pb.v_full, value.sizes()), dmask_out};
}

at::Tensor dropout_mask(const at::Tensor& dropout_state, at::IntArrayRef size, double p, at::IntArrayRef shard,
                        at::ScalarType dtype) {
  TORCH_CHECK_VALUE(size.size() == 4 && size[0] >= 0 && size[1] >= 0 && size[2] >= 0 && size[3] >= 0,
                    "dropout_mask size must be 4 non-negative sizes (batch, heads, queries, keys), but got ",
                    shape_text(size));
  TORCH_CHECK_VALUE(p >= 0.0 && p <= 1.0, "dropout probability has to be between 0 and 1, but got ", number_text(p));
  TORCH_CHECK_VALUE(at::isFloatingType(dtype), "dropout_mask dtype must be a floating-point type, but got ", dtype);
  const DropoutShard sh = make_shard(shard, size[1], size[2], size[3]);
  AttentionParams params{};
  set_dropout_state(params, dropout_state, p, dropout_state.device());
  at::Tensor out = at::empty(size, dropout_state.options().dtype(dtype));
#ifdef RUDNN_WITH_CUDA
  if (out.is_cuda()) {
    cuda::dropout_mask_cuda(params.rng, dropout_state, sh, out);
    return out;
  }
#endif
  dropout_mask_cpu(params.rng, sh, out);
  return out;
}

// [forward, backward]: which kernels these inputs get and why (kernel_choice.h).
std::vector<std::string> explain(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                 const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                                 std::optional<double> scale, bool enable_gqa,
                                 std::optional<c10::string_view> numerics,
                                 const std::optional<at::Tensor>& query_rotary,
                                 const std::optional<at::Tensor>& key_rotary, bool rotary_interleaved) {
  const AttentionProblem pb = make_problem(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                           numerics, {-1, 0, -1, 0, -1, 0}, std::nullopt, std::nullopt, query_rotary,
                                           key_rotary, rotary_interleaved);
  std::string backward = explain_backward(pb);
  const bool float_mask = pb.params.mask_kind == MaskKind::kFloat || pb.params.mask_kind == MaskKind::kFloat32;
  if (float_mask && pb.params.mask_keys == 1) {
    backward += "; the float mask's gradient, where asked for, is the LSE's (the mask is constant along the keys)";
  } else if (query.is_cuda() && float_mask) {
    const bool tensor_cores = backward_kernels(pb).tensor_cores;
    backward += std::string("; the float mask's gradient, where asked for, by its ") +
                (tensor_cores && !pb.params.rotary() ? "tensor-core kernel" : "CUDA-core kernel");
  }
  return {explain_forward(pb), backward};
}

}  // namespace

TORCH_LIBRARY(rudnn, m) {
  m.def(
      "attention_forward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float dropout_p, "
      "bool is_causal, float? scale, bool enable_gqa, str? numerics, Tensor? dropout_state, int[] shard, "
      "bool deterministic=True, Tensor? query_documents=None, Tensor? key_documents=None, "
      "Tensor? query_rotary=None, Tensor? key_rotary=None, bool rotary_interleaved=False) "
      "-> (Tensor out, Tensor lse, Tensor dropout_state)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor query, Tensor key, Tensor value, "
      "Tensor? attn_mask, Tensor out, Tensor lse, float dropout_p, bool is_causal, float? scale, "
      "bool enable_gqa, str? numerics, Tensor dropout_state, int[] shard, bool mask_grad, bool deterministic=True, "
      "Tensor? query_documents=None, Tensor? key_documents=None, Tensor? query_rotary=None, "
      "Tensor? key_rotary=None, bool rotary_interleaved=False) "
      "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_attn_mask)");
  m.def("dropout_mask(Tensor dropout_state, int[] size, float p, int[] shard, ScalarType dtype) -> Tensor");
  m.def(
      "explain(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float dropout_p, bool is_causal, "
      "float? scale, bool enable_gqa, str? numerics, Tensor? query_rotary=None, Tensor? key_rotary=None, "
      "bool rotary_interleaved=False) -> str[]");
  m.impl("explain", c10::DispatchKey::CompositeExplicitAutograd, &explain);
}

TORCH_LIBRARY_IMPL(rudnn, CPU, m) {
  m.impl("attention_forward", &attention_forward);
  m.impl("attention_backward", &attention_backward);
  m.impl("dropout_mask", &dropout_mask);
}

#ifdef RUDNN_WITH_CUDA
TORCH_LIBRARY_IMPL(rudnn, CUDA, m) {
  m.impl("attention_forward", &attention_forward);
  m.impl("attention_backward", &attention_backward);
  m.impl("dropout_mask", &dropout_mask);
}
#endif

}  // namespace rudnn

// `import rudnn._C` loads the library above; the module itself holds nothing.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
