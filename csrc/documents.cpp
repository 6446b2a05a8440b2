#include "documents.h"

#include <ATen/ATen.h>

namespace rudnn {
namespace {

void check_sorted(const at::Tensor& ids, const char* name) {
  const int64_t n = ids.size(1);
  if (n < 2 || ids.size(0) == 0) return;
  const bool descends = (ids.narrow(1, 1, n - 1) < ids.narrow(1, 0, n - 1)).any().item<bool>();
  TORCH_CHECK_VALUE(!descends, name, " must be non-decreasing along the sequence (documents packed one after another)");
}

// Each row's index within its document: its index minus that of its document's first row.
at::Tensor position_in_document(const at::Tensor& ids) {
  const at::Tensor first = at::searchsorted(ids, ids, /*out_int32=*/true, /*right=*/false);
  return at::arange(ids.size(1), first.options()).unsqueeze(0) - first;
}

}  // namespace

DocumentWindows document_windows(const at::Tensor& query_ids, const at::Tensor& key_ids, bool causal) {
  check_sorted(query_ids, "query document ids");
  check_sorted(key_ids, "key document ids");
  at::Tensor key_lo = at::searchsorted(key_ids, query_ids, /*out_int32=*/true, /*right=*/false);
  at::Tensor key_hi = at::searchsorted(key_ids, query_ids, true, true);
  at::Tensor query_lo = at::searchsorted(query_ids, key_ids, true, false);
  const at::Tensor query_hi = at::searchsorted(query_ids, key_ids, true, true);
  if (causal) {
    key_hi = at::minimum(key_hi, key_lo + position_in_document(query_ids) + 1);
    query_lo = at::minimum(query_lo + position_in_document(key_ids), query_hi);
  }
  return {at::stack({key_lo, key_hi}, -1).contiguous(), at::stack({query_lo, query_hi}, -1).contiguous()};
}

}  // namespace rudnn
