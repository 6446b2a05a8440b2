// Dropout multipliers on the CPU, shared by the dropout_mask op and the attention kernels.
#pragma once

#include <cstdint>

#include "philox.h"

namespace rudnn {

// out[j] = multiplier of the element at position row_position + j, for j in [0, n).
template <typename T>
inline void fill_dropout_row(const DropoutRng& rng, uint64_t row_position, int64_t n, T* out) {
  const T kept = static_cast<T>(rng.keep_scale);
  uint64_t block = ~uint64_t{0};
  Philox4 bits{};
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t pos = row_position + static_cast<uint64_t>(j);
    if ((pos >> 2) != block) {  // one Philox call serves four consecutive positions
      block = pos >> 2;
      bits = rng.block(pos);
    }
    out[j] = rng.keep(bits.x[pos & 3]) ? kept : static_cast<T>(0);
  }
}

}  // namespace rudnn
