// Packed documents (SPEC 6): per-token document ids turned into the windows the kernels read.
#pragma once

#include <ATen/core/Tensor.h>

namespace rudnn {

// keys: (B, L, 2) int32, the keys [lo, hi) that each query row sees; queries: (B, S, 2) int32, the
// query rows [lo, hi) that see each key. Both are non-decreasing along the rows, so the rows of a
// tile see the keys [lo of its first row, hi of its last) and the kernels skip every other tile.
struct DocumentWindows {
  at::Tensor keys, queries;
};

// query_ids (B, L), key_ids (B, S): integer ids, non-decreasing along the sequence (documents
// packed one after another); a query sees the keys with its id. causal: aligned within each
// document, the k-th key of a document seen by the document's queries from the k-th on.
DocumentWindows document_windows(const at::Tensor& query_ids, const at::Tensor& key_ids, bool causal);

}  // namespace rudnn
