#include "attention_problem.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <c10/util/irange.h>

#include <cmath>
#include <cstdio>

#include "documents.h"

namespace rudnn {
namespace {

std::vector<int64_t> padded(at::IntArrayRef sizes, int64_t rank) {
  std::vector<int64_t> out(rank - static_cast<int64_t>(sizes.size()), 1);
  out.insert(out.end(), sizes.begin(), sizes.end());
  return out;
}

std::vector<int64_t> concat(at::IntArrayRef a, std::initializer_list<int64_t> b) {
  std::vector<int64_t> out(a.begin(), a.end());
  out.insert(out.end(), b);
  return out;
}

// Leading sizes N... of a tensor padded to `rank`, i.e. all but the last three (H, L/S, E).
std::vector<int64_t> batch_sizes(const at::Tensor& t, int64_t rank) {
  auto p = padded(t.sizes(), rank);
  return std::vector<int64_t>(p.begin(), p.end() - 3);
}

// Expands `t` (viewed at `rank` dims) to `full` and flattens the leading dims into one.
at::Tensor canonical(const at::Tensor& t, at::IntArrayRef full) {
  const int64_t rank = static_cast<int64_t>(full.size());
  at::Tensor view = t.reshape(padded(t.sizes(), rank)).expand(full);
  const int64_t batch = c10::multiply_integers(full.begin(), full.end() - 3);
  return view.reshape({batch, full[rank - 3], full[rank - 2], full[rank - 1]});
}

bool is_supported_dtype(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

Numerics parse_numerics(std::optional<std::string_view> numerics, at::ScalarType dtype) {
  if (!numerics.has_value()) {
    return (dtype == at::kHalf || dtype == at::kBFloat16) ? Numerics::kFlash : Numerics::kExact;
  }
  if (*numerics == "exact") return Numerics::kExact;
  if (*numerics == "flash") return Numerics::kFlash;
  TORCH_CHECK_VALUE(false, "numerics must be None, 'exact' or 'flash', but got '", *numerics, "'");
}

// Document ids (N..., n), broadcast to the batch dims, as (B, n) int64.
at::Tensor canonical_ids(const at::Tensor& ids, const std::vector<int64_t>& batch, int64_t n, const at::Device& device,
                         const char* name) {
  TORCH_CHECK_VALUE(at::isIntegralType(ids.scalar_type(), /*includeBool=*/false), name,
                    " must be an integer tensor, but got ", ids.scalar_type());
  TORCH_CHECK(ids.device() == device, name, " must be on the device of query (", device, "), but is on ", ids.device());
  const auto full = concat(batch, {n});
  const int64_t rank = static_cast<int64_t>(full.size());
  bool fits = ids.dim() >= 1 && ids.dim() <= rank && ids.size(-1) == n;
  const std::vector<int64_t> sizes = fits ? padded(ids.sizes(), rank) : std::vector<int64_t>{};
  for (int64_t d = 0; fits && d < rank - 1; ++d) fits = sizes[d] == 1 || sizes[d] == full[d];
  TORCH_CHECK_VALUE(fits, name, " of shape ", shape_text(ids.sizes()), " does not broadcast to ", shape_text(full),
                    " (N..., sequence length)");
  const int64_t rows = c10::multiply_integers(batch.begin(), batch.end());
  return ids.reshape(sizes).expand(full).reshape({rows, n}).to(at::kLong).contiguous();
}

// A RoPE table (..., rows, E) of rotary.py, broadcast to the canonical (B, H, rows, E) of its side.
at::Tensor canonical_rotary(const at::Tensor& table, const std::vector<int64_t>& full, const at::Device& device,
                            const char* name) {
  TORCH_CHECK_VALUE(table.scalar_type() == at::kFloat, name, " must be float32, but got ", table.scalar_type());
  TORCH_CHECK(table.device() == device, name, " must be on the device of query (", device, "), but is on ",
              table.device());
  const int64_t rank = static_cast<int64_t>(full.size());
  bool fits = table.dim() >= 2 && table.dim() <= rank && table.size(-1) == full.back();
  const std::vector<int64_t> sizes = fits ? padded(table.sizes(), rank) : std::vector<int64_t>{};
  for (int64_t d = 0; fits && d < rank - 1; ++d) fits = sizes[d] == 1 || sizes[d] == full[d];
  TORCH_CHECK_VALUE(fits, name, " of shape ", shape_text(table.sizes()), " does not broadcast to ", shape_text(full),
                    " (N..., heads, sequence length, head dim)");
  at::Tensor t = canonical(table, full);
  return t.stride(3) == 1 ? t : t.contiguous();
}

RotaryTable rotary_params(const at::Tensor& t, bool interleaved) {
  return t.defined() ? RotaryTable{t.const_data_ptr<float>(), strides_of(t), interleaved}
                     : RotaryTable{nullptr, {0, 0, 0, 0}, false};
}

}  // namespace

std::string number_text(int64_t n) { return std::to_string(n); }

std::string number_text(double x) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", x);
  return text;
}

std::string shape_text(at::IntArrayRef sizes) {
  std::string text = "[";
  for (size_t d = 0; d < sizes.size(); ++d) text += (d ? ", " : "") + number_text(sizes[d]);
  return text + "]";
}

Strides4 strides_of(const at::Tensor& t) {
  // Size-1 dims get stride 0: the same element whatever the index.
  auto s = [&](int d) { return t.size(d) == 1 ? int64_t{0} : t.stride(d); };
  return Strides4{s(0), s(1), s(2), s(3)};
}

DropoutShard make_shard(at::IntArrayRef shard, int64_t heads, int64_t queries, int64_t keys) {
  TORCH_CHECK_VALUE(shard.size() == 6,
                    "dropout shard must have 6 entries (global_heads, head_start, global_queries, "
                    "query_start, global_keys, key_start), but got ",
                    number_text(static_cast<int64_t>(shard.size())));
  const char* names[3] = {"heads", "queries", "keys"};
  const int64_t local[3] = {heads, queries, keys};
  int64_t resolved[6];
  for (int d = 0; d < 3; ++d) {
    const int64_t start = shard[2 * d + 1];
    const int64_t global = shard[2 * d] < 0 ? start + local[d] : shard[2 * d];
    TORCH_CHECK_VALUE(start >= 0, "dropout shard: ", names[d], " start must be >= 0, but got ", number_text(start));
    TORCH_CHECK_VALUE(start + local[d] <= global, "dropout shard: ", names[d], " start (", number_text(start),
                      ") + local ", names[d], " (", number_text(local[d]), ") exceeds global ", names[d], " (",
                      number_text(global), ")");
    resolved[2 * d] = global;
    resolved[2 * d + 1] = start;
  }
  return DropoutShard{resolved[0], resolved[1], resolved[2], resolved[3], resolved[4], resolved[5]};
}

void set_dropout_state(AttentionParams& p, const at::Tensor& state, double dropout_p, const at::Device& device) {
  TORCH_CHECK_VALUE(state.scalar_type() == at::kLong && state.numel() == 2 && state.device() == device,
                    "dropout state must be an int64 tensor holding (seed, offset) on ", device, ", but got ",
                    state.scalar_type(), " of ", number_text(state.numel()), " elements on ", state.device());
  TORCH_CHECK_VALUE(state.is_contiguous(), "dropout state must be contiguous");
  p.rng = DropoutRng{0, 0, static_cast<float>(dropout_p), dropout_p < 1.0 ? 1.0 / (1.0 - dropout_p) : 0.0};
  p.rng_state = state.const_data_ptr<int64_t>();
  if (device.is_cpu()) {
    p.rng.seed = static_cast<uint64_t>(p.rng_state[0]);
    p.rng.offset = static_cast<uint64_t>(p.rng_state[1]);
  }
}

at::Tensor gradient_to_input(const at::Tensor& grad, at::IntArrayRef full, at::IntArrayRef input_sizes) {
  const auto target = padded(input_sizes, static_cast<int64_t>(full.size()));
  return grad.reshape(full).sum_to_size(target).reshape(input_sizes);
}

AttentionProblem make_problem(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                              const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                              std::optional<double> scale, bool enable_gqa, std::optional<std::string_view> numerics,
                              at::IntArrayRef shard, const std::optional<at::Tensor>& query_documents,
                              const std::optional<at::Tensor>& key_documents,
                              const std::optional<at::Tensor>& query_rotary,
                              const std::optional<at::Tensor>& key_rotary, bool rotary_interleaved) {
  TORCH_CHECK(
      query.dim() >= 2 && key.dim() >= 2 && value.dim() >= 2,
      "Expected query, key, and value to all be at least 2 dimensional, but got query.dim: ", number_text(query.dim()),
      " key.dim: ", number_text(key.dim()), " and value.dim: ", number_text(value.dim()), " instead.");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && query.scalar_type() == value.scalar_type(),
              "Expected query, key, and value to have the same dtype, but got query.dtype: ", query.scalar_type(),
              " key.dtype: ", key.scalar_type(), " and value.dtype: ", value.scalar_type(), " instead.");
  TORCH_CHECK(is_supported_dtype(query.scalar_type()),
              "query, key and value must be float16, bfloat16, float32 or float64, but got ", query.scalar_type());
  TORCH_CHECK(query.device() == key.device() && query.device() == value.device(),
              "Expected query, key, and value to be on the same device, but got query.device: ", query.device(),
              " key.device: ", key.device(), " and value.device: ", value.device(), " instead.");
  TORCH_CHECK(key.size(-1) == query.size(-1), "key's last dimension (", number_text(key.size(-1)),
              ") must equal query's last dimension (", number_text(query.size(-1)), "): both are the head dim E");
  TORCH_CHECK(value.size(-2) == key.size(-2), "value's sequence length (size(-2) = ", number_text(value.size(-2)),
              ") must equal key's (", number_text(key.size(-2)), ")");
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, "dropout probability has to be between 0 and 1, but got ",
              number_text(dropout_p));
  TORCH_CHECK(!(is_causal && attn_mask.has_value()),
              "_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True");

  // Batch dims N... broadcast among query, key and value; dim -3 holds the heads.
  const int64_t rank = std::max<int64_t>({query.dim(), key.dim(), value.dim(), 3});
  const auto qb = batch_sizes(query, rank), kb = batch_sizes(key, rank), vb = batch_sizes(value, rank);
  const auto batch = at::infer_size(at::infer_size(qb, kb), vb);
  const int64_t hq = padded(query.sizes(), rank)[rank - 3];
  const int64_t hk = padded(key.sizes(), rank)[rank - 3];
  const int64_t hv = padded(value.sizes(), rank)[rank - 3];
  int64_t heads = hq;
  if (enable_gqa) {
    TORCH_CHECK(hk > 0 && hv > 0 && hq % hk == 0 && hq % hv == 0,
                "Number of heads in key and value must divide the number of heads in query, but got ", number_text(hq),
                " query heads, ", number_text(hk), " key heads and ", number_text(hv), " value heads");
  } else {
    const bool broadcasts =
        (hk == hq || hk == 1 || hq == 1) && (hv == hq || hv == 1 || hq == 1) && (hk == hv || hk == 1 || hv == 1);
    TORCH_CHECK(broadcasts, "query, key and value head counts (", number_text(hq), ", ", number_text(hk), ", ",
                number_text(hv), ") must be equal or 1; pass enable_gqa=True for grouped-query attention");
    heads = at::infer_size({hq}, at::infer_size({hk}, {hv}))[0];  // 1 broadcasts, also against 0
  }
  // Key and value share one head count Hkv that divides H; a count of 1 broadcasts.
  TORCH_CHECK(hk == hv || hk == 1 || hv == 1, "key and value head counts (", number_text(hk), " and ", number_text(hv),
              ") must be equal, or one of them 1");
  const int64_t kv_heads = at::infer_size({hk}, {hv})[0];

  const int64_t L = query.size(-2), S = key.size(-2), E = query.size(-1), Ev = value.size(-1);
  AttentionProblem pb;
  pb.q_full = concat(batch, {heads, L, E});
  pb.k_full = concat(batch, {kv_heads, S, E});
  pb.v_full = concat(batch, {kv_heads, S, Ev});
  pb.out_shape = concat(batch, {heads, L, Ev});
  pb.lse_shape = concat(batch, {heads, L});
  // 2-D inputs (L, E) give 2-D outputs, as in PyTorch.
  if (std::max({query.dim(), key.dim(), value.dim()}) == 2) {
    pb.out_shape = {L, Ev};
    pb.lse_shape = {L};
  }
  pb.q = canonical(query, pb.q_full);
  pb.k = canonical(key, pb.k_full);
  pb.v = canonical(value, pb.v_full);

  AttentionParams& p = pb.params;
  p.batch = pb.q.size(0);
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.queries = L;
  p.keys = S;
  p.head_dim = E;
  p.value_dim = Ev;
  p.mask_kind = MaskKind::kNone;
  p.mask_batch = p.mask_heads = p.mask_queries = p.mask_keys = 1;

  if (attn_mask.has_value()) {
    const at::Tensor& m = *attn_mask;
    TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == at::kFloat || m.scalar_type() == query.scalar_type(),
                "Expected attn_mask dtype to be bool or float or to match query dtype, but got attn_mask.dtype: ",
                m.scalar_type(), " and  query.dtype: ", query.scalar_type(), " instead.");
    TORCH_CHECK(m.device() == query.device(), "attn_mask must be on the device of query (", query.device(),
                "), but is on ", m.device());
    const auto attention = concat(batch, {heads, L, S});
    const int64_t full_rank = static_cast<int64_t>(attention.size());
    bool fits = m.dim() <= full_rank;
    std::vector<int64_t> mp = fits ? padded(m.sizes(), full_rank) : std::vector<int64_t>{};
    for (int64_t d = 0; fits && d < full_rank; ++d) fits = mp[d] == 1 || mp[d] == attention[d];
    TORCH_CHECK(fits, "attn_mask of shape ", shape_text(m.sizes()), " does not broadcast to the attention shape ",
                shape_text(attention), " (N..., heads, L, S)");
    // Broadcast batch dims stay size 1 (Bm = 1) unless some of them are full: then the batch
    // dims are expanded, never the (heads, L, S) part.
    bool any_batch = false;
    for (int64_t d = 0; d < full_rank - 3; ++d) any_batch |= mp[d] != 1;
    pb.mask_full = mp;
    if (any_batch) std::copy(batch.begin(), batch.end(), pb.mask_full.begin());
    pb.mask = canonical(m, pb.mask_full);
    p.mask_kind = m.scalar_type() == at::kBool             ? MaskKind::kBool
                  : m.scalar_type() == query.scalar_type() ? MaskKind::kFloat
                                                           : MaskKind::kFloat32;
    p.mask_batch = pb.mask.size(0);
    p.mask_heads = pb.mask.size(1);
    p.mask_queries = pb.mask.size(2);
    p.mask_keys = pb.mask.size(3);
  }

  p.q = pb.q.const_data_ptr();
  p.k = pb.k.const_data_ptr();
  p.v = pb.v.const_data_ptr();
  p.mask = pb.mask.defined() ? pb.mask.const_data_ptr() : nullptr;
  p.q_strides = strides_of(pb.q);
  p.k_strides = strides_of(pb.k);
  p.v_strides = strides_of(pb.v);
  p.mask_strides = pb.mask.defined() ? strides_of(pb.mask) : Strides4{0, 0, 0, 0};
  p.rng_state = nullptr;
  p.is_causal = is_causal;
  p.scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(E));
  p.numerics = parse_numerics(numerics, query.scalar_type());
  p.has_dropout = dropout_p > 0.0;
  p.rng = DropoutRng{0, 0, static_cast<float>(dropout_p), 0.0};
  p.shard = make_shard(shard, heads, L, S);

  p.key_windows = p.query_windows = nullptr;
  TORCH_CHECK_VALUE(query_documents.has_value() == key_documents.has_value(),
                    "document ids must be given for both queries and keys, or for neither");
  if (query_documents.has_value()) {
    // Documents carry causality within each one; the shard then only places dropout.
    TORCH_CHECK_VALUE(!is_causal || p.shard.query_start == p.shard.key_start,
                      "is_causal with document ids is causal within each document: a dropout_shard's "
                      "query_start and key_start must then be equal");
    const DocumentWindows w =
        document_windows(canonical_ids(*query_documents, batch, L, query.device(), "query document ids"),
                         canonical_ids(*key_documents, batch, S, query.device(), "key document ids"), is_causal);
    pb.key_windows = w.keys;
    pb.query_windows = w.queries;
    p.key_windows = w.keys.const_data_ptr<int32_t>();
    p.query_windows = w.queries.const_data_ptr<int32_t>();
    p.is_causal = false;
  }

  TORCH_CHECK_VALUE(query_rotary.has_value() == key_rotary.has_value(),
                    "RoPE tables must be given for both queries and keys, or for neither");
  if (query_rotary.has_value()) {
    TORCH_CHECK_VALUE(E % 2 == 0, "RoPE needs an even head dim, but got E = ", number_text(E));
    pb.q_rotary = canonical_rotary(*query_rotary, pb.q_full, query.device(), "query RoPE table");
    pb.k_rotary = canonical_rotary(*key_rotary, pb.k_full, query.device(), "key RoPE table");
  }
  p.q_rotary = rotary_params(pb.q_rotary, rotary_interleaved);
  p.k_rotary = rotary_params(pb.k_rotary, rotary_interleaved);
  return pb;
}

}  // namespace rudnn
