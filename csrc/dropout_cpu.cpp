#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "dropout_cpu.h"
#include "kernels.h"

namespace rudnn {

void dropout_mask_cpu(const DropoutRng& rng, const DropoutShard& shard, const at::Tensor& out) {
  const int64_t heads = out.size(1), queries = out.size(2), keys = out.size(3);
  const int64_t rows = out.size(0) * heads * queries;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "rudnn_dropout_mask_cpu", [&] {
    scalar_t* data = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = r / (heads * queries), h = (r / queries) % heads, i = r % queries;
        fill_dropout_row(rng, shard.row_position(b, h, i), keys, data + r * keys);
      }
    });
  });
}

}  // namespace rudnn
