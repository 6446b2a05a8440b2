#include "rotary.h"

#include <ATen/ATen.h>

namespace rudnn {

at::Tensor rotate(const at::Tensor& x, const at::Tensor& table, bool interleaved, bool inverse) {
  const int64_t E = x.size(-1), half = E / 2;
  const at::ScalarType compute = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor xc = x.to(compute), t = table.to(compute);
  const at::Tensor cos = t.narrow(-1, 0, half), sin = inverse ? -t.narrow(-1, half, half) : t.narrow(-1, half, half);
  const at::Tensor first = interleaved ? xc.slice(-1, 0, E, 2) : xc.narrow(-1, 0, half);
  const at::Tensor second = interleaved ? xc.slice(-1, 1, E, 2) : xc.narrow(-1, half, half);
  const at::Tensor y1 = first * cos - second * sin, y2 = first * sin + second * cos;
  const at::Tensor y = interleaved ? at::stack({y1, y2}, -1).flatten(-2) : at::cat({y1, y2}, -1);
  return y.to(x.scalar_type());
}

}  // namespace rudnn
