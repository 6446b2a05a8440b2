// Counter-based Philox4x32-10 and the dropout decision of SPEC section 3.
// Compiled for host and device so that CPU and CUDA produce the same bits.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define RUDNN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define RUDNN_HOST_DEVICE inline
#endif

namespace rudnn {

struct Philox4 {
  uint32_t x[4];
};

RUDNN_HOST_DEVICE uint32_t mulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// a ^ b ^ c: on the device one three-input logic instruction, which ptxas otherwise splits in two.
RUDNN_HOST_DEVICE uint32_t xor3(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0x96;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
#else
  return a ^ b ^ c;
#endif
}

// Standard Philox4x32-10: counter (c0, c1) = 64-bit `counter`, c2 = c3 = 0,
// key (k0, k1) = 64-bit `seed`. Counter 0, key 0 gives 6627e8d5 e169c58d bc57ac4c 9b00dbd8.
RUDNN_HOST_DEVICE Philox4 philox4x32_10(uint64_t counter, uint64_t seed) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = mulhi32(kM0, c0), lo0 = kM0 * c0;
    const uint32_t hi1 = mulhi32(kM1, c2), lo1 = kM1 * c2;
    c0 = xor3(hi1, c1, k0);
    c1 = lo1;
    c2 = xor3(hi0, c3, k1);
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// Dropout draws for element positions: one Philox block serves four positions.
struct DropoutRng {
  uint64_t seed;
  uint64_t offset;
  float p;            // drop probability; the comparison is in float32
  double keep_scale;  // 1 / (1 - p), the multiplier of a kept element (cast to the compute type)

  // Block of position `pos`: counter offset + pos / 4 (64-bit, wrapping).
  RUDNN_HOST_DEVICE Philox4 block(uint64_t pos) const {
    return philox4x32_10(offset + (pos >> 2), seed);
  }
  // u = (word >> 8) * 2^-24; kept when p < 1 and u >= p.
  RUDNN_HOST_DEVICE bool keep(uint32_t word) const {
    const float u = static_cast<float>(word >> 8) * (1.0f / 16777216.0f);
    return p < 1.0f && u >= p;
  }
  // The same decision as an integer threshold: keep(word) == (word >> 8) >= keep_threshold(), since
  // (word >> 8) * 2^-24 is exact and p * 2^24 is exact in float32.
  RUDNN_HOST_DEVICE uint32_t keep_threshold() const {
    return p < 1.0f ? static_cast<uint32_t>(ceilf(p * 16777216.0f)) : 16777216u;
  }
  RUDNN_HOST_DEVICE bool keep_at(uint64_t pos) const {
    return keep(block(pos).x[pos & 3]);
  }
};

// pos = ((b * GH + head_start + h) * GL + query_start + i) * GS + key_start + j  (SPEC 3).
struct DropoutShard {
  int64_t global_heads, head_start;
  int64_t global_queries, query_start;
  int64_t global_keys, key_start;

  // Position of element (b, h, i, 0) shifted by key_start: add the local key index j.
  RUDNN_HOST_DEVICE uint64_t row_position(int64_t b, int64_t h, int64_t i) const {
    return static_cast<uint64_t>(((b * global_heads + head_start + h) * global_queries + query_start + i) *
                                     global_keys + key_start);
  }
};

}  // namespace rudnn
