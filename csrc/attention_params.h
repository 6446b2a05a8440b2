// One description of an attention problem, read by every kernel. No ATen inside.
#pragma once

#include <cstdint>

#include "philox.h"

#if defined(__CUDACC__)
#define RUDNN_HOST_DEVICE_FN __host__ __device__
#else
#define RUDNN_HOST_DEVICE_FN
#endif

namespace rudnn {

// kFloat: a mask of the inputs' dtype; kFloat32: a float32 mask with inputs of another dtype.
constexpr double kLog2e = 1.4426950408889634;

enum class MaskKind : int32_t { kNone = 0, kBool = 1, kFloat = 2, kFloat32 = 3 };

// SPEC section 4: "exact" keeps everything between score and output in float32 (float64 for
// float64 inputs); "flash" reproduces FlashAttention's rounding points.
enum class Numerics : int32_t { kExact = 0, kFlash = 1 };

// Element strides of a canonical (batch, head, row, column) tensor.
struct Strides4 {
  int64_t batch, head, row, col;
};

// Whether rows of `cols` elements of `element_bytes` each of a canonical tensor can be copied in
// 16-byte chunks (the kernels' cp.async): contiguous rows of whole chunks, on 16 bytes.
RUDNN_HOST_DEVICE_FN inline bool rows_in_16_byte_chunks(const void* base, const Strides4& s, int64_t cols,
                                                        int64_t element_bytes) {
  const int64_t n = 16 / element_bytes;
  return s.col == 1 && cols % n == 0 && s.row % n == 0 && s.head % n == 0 && s.batch % n == 0 &&
         reinterpret_cast<uintptr_t>(base) % 16 == 0;
}

// RoPE fused into attention: float32 (B, H, rows, E) whose row holds the cosines of the row's E/2
// angles, then their sines (rotary.py's table), and its element strides; data null: no rotation.
// Pair p is columns (2p, 2p + 1) when interleaved, (p, p + E/2) otherwise.
struct RotaryTable {
  const float* data;
  Strides4 strides;
  bool interleaved;
};

// Canonical problem: query (B, H, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev),
// mask (Bm, Hm, Lm, Sm) with each mask size either 1 (broadcast) or the full size.
struct AttentionParams {
  int64_t batch, heads, kv_heads, queries, keys, head_dim, value_dim;
  int64_t mask_batch, mask_heads, mask_queries, mask_keys;
  MaskKind mask_kind;
  bool is_causal;  // key j takes part only if key_start + j <= query_start + i
  double scale;
  Numerics numerics;
  bool has_dropout;
  DropoutRng rng;
  DropoutShard shard;  // also places the problem for causality

  // The canonical inputs (host or device memory) and their element strides; the mask's strides
  // are 0 along the dims it broadcasts over, so kernels index it like the full (B, H, L, S).
  const void *q, *k, *v, *mask;
  Strides4 q_strides, k_strides, v_strides, mask_strides;
  // CUDA: (seed, offset) of the dropout generator in device memory, read by the kernels so that
  // CUDA graphs replay with the generator's current state. rng.seed/offset hold them on the CPU.
  const int64_t* rng_state;
  // Packed documents (documents.h), null without: key_windows[2 (b L + i) + {0, 1}] = [lo, hi),
  // the keys query row i sees; query_windows[2 (b S + j) + {0, 1}], the query rows that see key j.
  // They carry the documents' causality; is_causal is then false.
  const int32_t *key_windows, *query_windows;
  // RoPE, both sides or neither: kernels turn Q and K as they read them, never writing them out.
  RotaryTable q_rotary, k_rotary;

  RUDNN_HOST_DEVICE_FN bool rotary() const { return q_rotary.data != nullptr; }
  RUDNN_HOST_DEVICE_FN int64_t group() const { return heads / kv_heads; }
  // Kernels keep scores in the base of their exponential: e (exact), or 2 with log2(e) folded in
  // (flash, as FlashAttention's exp2).
  RUDNN_HOST_DEVICE_FN double score_unit() const { return numerics == Numerics::kFlash ? kLog2e : 1.0; }
};

}  // namespace rudnn
