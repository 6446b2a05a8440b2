// Device helpers shared by the CUDA attention kernels: compute types, the score rules (masks,
// causality, dropout), exponentials and reductions. No torch includes.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../attention_params.h"

namespace rudnn::cuda {

// float16/bfloat16/float32 compute in float32, float64 in float64.
template <typename scalar_t>
struct Compute {
  using type = float;
};
template <>
struct Compute<double> {
  using type = double;
};

__device__ __forceinline__ float exp_base(float x, bool base2) { return base2 ? exp2f(x) : expf(x); }
__device__ __forceinline__ double exp_base(double x, bool base2) { return base2 ? exp2(x) : exp(x); }
__device__ __forceinline__ float log_natural(float x) { return logf(x); }
__device__ __forceinline__ double log_natural(double x) { return log(x); }

// max that propagates NaN, as PyTorch's amax does (fmax would drop it and hide a NaN score).
template <typename T>
__device__ __forceinline__ T max_nan(T a, T b) {
  return (a != a || a > b) ? a : b;
}
// sm80+ has it as one instruction.
__device__ __forceinline__ float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || a > b) ? a : b;
#endif
}

// Rounds to the input dtype and back: FlashAttention's rounding points in "flash" numerics.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t round_to(acc_t x) {
  return static_cast<acc_t>(static_cast<scalar_t>(x));
}

template <typename scalar_t>
__device__ __forceinline__ const scalar_t* at_row(const void* base, const Strides4& s, int64_t b, int64_t h,
                                                   int64_t row) {
  return static_cast<const scalar_t*>(base) + b * s.batch + h * s.head + row * s.row;
}

// Four consecutive elements of a row in global memory, as one 8-, 16- or 32-byte load.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void load4_global(const scalar_t* src, acc_t (&x)[4]) {
  if constexpr (sizeof(scalar_t) == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    const scalar_t* e = reinterpret_cast<const scalar_t*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = static_cast<acc_t>(e[i]);
  } else if constexpr (sizeof(scalar_t) == 4) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else {
    const double2 lo = reinterpret_cast<const double2*>(src)[0], hi = reinterpret_cast<const double2*>(src)[1];
    x[0] = lo.x, x[1] = lo.y, x[2] = hi.x, x[3] = hi.y;
  }
}

// kN consecutive elements src[0], src[stride], ... with those at or past `valid` left as they are:
// one load where they are contiguous and aligned.
template <int kN, typename T>
__device__ __forceinline__ void load_run(const T* src, int64_t stride, int64_t valid, T (&x)[kN]) {
  constexpr int kBytes = kN * static_cast<int>(sizeof(T));
  if constexpr (kBytes == 1 || kBytes == 2 || kBytes == 4 || kBytes == 8 || kBytes == 16) {
    using V = std::conditional_t<kBytes == 1, uint8_t,
              std::conditional_t<kBytes == 2, uint16_t,
              std::conditional_t<kBytes == 4, uint32_t, std::conditional_t<kBytes == 8, uint2, uint4>>>>;
    if (stride == 1 && valid >= kN && reinterpret_cast<uintptr_t>(src) % kBytes == 0) {
      const V v = *reinterpret_cast<const V*>(src);
      const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int k = 0; k < kN; ++k) x[k] = e[k];
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    if (k < valid) x[k] = src[k * stride];
  }
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Global -> shared without passing through registers (sm80+): the first src_bytes of the copy from
// src, zeros after them.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_address(dst)), "l"(src));
}
// One 4- or 8-byte element (float or double), through L1.
template <typename T>
__device__ __forceinline__ void cp_async_small(T* dst, const T* src, int src_bytes) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "cp.async copies 4, 8 or 16 bytes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_address(dst)), "l"(src),
               "n"(static_cast<int>(sizeof(T))), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Packed documents: the keys [x, y) that query row i of batch b sees.
__device__ __forceinline__ int2 key_window(const AttentionParams& p, int64_t b, int64_t i) {
  return reinterpret_cast<const int2*>(p.key_windows)[b * p.queries + i];
}

// The score rules of kN consecutive keys j, j + 1, ... of query row i, on raw scores already
// multiplied by unit * scale: -inf for the padding of a partial tile and for keys of other
// documents; -inf added where causality or a bool mask excludes the key, as PyTorch's math path
// adds it, so that a NaN score stays NaN; + unit * mask for a float mask. `edge`: the run's tile
// crosses the problem's bounds, the causal frontier or a document's (tile_on_edge); elsewhere
// those checks are skipped.
template <int kN, typename scalar_t, typename acc_t>
__device__ __forceinline__ void apply_rules(const AttentionParams& p, acc_t (&s)[kN], int64_t b, int64_t h, int64_t i,
                                            int64_t j, acc_t unit, bool edge) {
  const acc_t neg_inf = -INFINITY;
  if (edge) {
    const int64_t diagonal = p.shard.query_start - p.shard.key_start;
    int2 window = make_int2(0, INT_MAX);
    if (p.key_windows != nullptr && i < p.queries) window = key_window(p, b, i);
#pragma unroll
    for (int e = 0; e < kN; ++e) {
      if (i >= p.queries || j + e >= p.keys || j + e < window.x || j + e >= window.y) {
        s[e] = neg_inf;
      } else if (p.is_causal && j + e - i > diagonal) {
        s[e] += neg_inf;
      }
    }
  }
  if (p.mask_kind == MaskKind::kNone || i >= p.queries) return;
  const Strides4& ms = p.mask_strides;
  const int64_t at = b * ms.batch + h * ms.head + i * ms.row + j * ms.col, valid = p.keys - j;
  if (p.mask_kind == MaskKind::kBool) {
    bool keep[kN];
#pragma unroll
    for (int e = 0; e < kN; ++e) keep[e] = true;
    load_run<kN>(static_cast<const bool*>(p.mask) + at, ms.col, valid, keep);
#pragma unroll
    for (int e = 0; e < kN; ++e) {
      if (!keep[e]) s[e] += neg_inf;
    }
  } else if (p.mask_kind == MaskKind::kFloat32) {
    float add[kN] = {};
    load_run<kN>(static_cast<const float*>(p.mask) + at, ms.col, valid, add);
#pragma unroll
    for (int e = 0; e < kN; ++e) s[e] += unit * static_cast<acc_t>(add[e]);
  } else {
    scalar_t add[kN];
#pragma unroll
    for (int e = 0; e < kN; ++e) add[e] = scalar_t(0);
    load_run<kN>(static_cast<const scalar_t*>(p.mask) + at, ms.col, valid, add);
#pragma unroll
    for (int e = 0; e < kN; ++e) s[e] += unit * static_cast<acc_t>(add[e]);
  }
}

// Whether a tile of query rows [i0, i0 + rows) of batch b and keys [j0, j0 + keys) needs
// apply_rules' edge checks: it crosses the end of the queries or keys, the causal frontier, or
// the window of one of its rows (the windows are monotone: the last row's starts last, the
// first row's ends first).
__device__ __forceinline__ bool tile_on_edge(const AttentionParams& p, int64_t b, int64_t i0, int rows, int64_t j0,
                                             int keys) {
  if (i0 + rows > p.queries || j0 + keys > p.keys) return true;
  if (p.is_causal && j0 + keys - 1 - i0 > p.shard.query_start - p.shard.key_start) return true;
  return p.key_windows != nullptr && (j0 < key_window(p, b, i0 + rows - 1).x || j0 + keys > key_window(p, b, i0).y);
}

// Rows [begin, end) of the other side that a tile's rows see through their documents, begin
// rounded down to a multiple of `align` so that tiles keep their places; everything without
// documents.
struct RowRange {
  int64_t begin, end;
};
__device__ __forceinline__ RowRange document_span(const int32_t* windows, int64_t first, int64_t last, int64_t all,
                                                  int align) {
  if (windows == nullptr) return {0, all};
  const int64_t begin = windows[2 * first], end = windows[2 * last + 1];
  return begin < end ? RowRange{begin / align * align, end} : RowRange{end, end};
}
// The keys that query rows [i0, i0 + rows) of batch b see.
__device__ __forceinline__ RowRange document_keys(const AttentionParams& p, int64_t b, int64_t i0, int rows,
                                                  int align) {
  const int64_t row0 = b * p.queries;
  return document_span(p.key_windows, row0 + i0, row0 + min(i0 + rows, p.queries) - 1, p.keys, align);
}
// The keys query rows [first, first + rows) of batch b (head group hk) see: their documents' (from
// a multiple of `align`) and, unless K or V holds a non-finite value (kv_finite), which PyTorch's
// math path carries into every row (NaN - inf, and zero weights times inf), those up to the
// causal frontier.
__device__ __forceinline__ RowRange visible_keys(const AttentionParams& p, const bool* kv_finite, int64_t b,
                                                 int64_t hk, int64_t first, int rows, int align) {
  RowRange keys = document_keys(p, b, first, rows, align);
  if (p.is_causal && kv_finite[b * p.kv_heads + hk]) {
    const int64_t last_row = min(first + rows, p.queries) - 1;
    keys.end = max(int64_t{0}, min(keys.end, last_row + p.shard.query_start - p.shard.key_start + 1));
  }
  return keys;
}
// The query rows that see keys [j0, j0 + keys) of batch b.
__device__ __forceinline__ RowRange document_queries(const AttentionParams& p, int64_t b, int64_t j0, int keys,
                                                     int align) {
  const int64_t key0 = b * p.keys;
  return document_span(p.query_windows, key0 + j0, key0 + min(j0 + keys, p.keys) - 1, p.queries, align);
}

__device__ __forceinline__ uint32_t philox_word(const Philox4& bits, uint32_t index) {
  return index == 0 ? bits.x[0] : index == 1 ? bits.x[1] : index == 2 ? bits.x[2] : bits.x[3];
}

// Whether every Philox block starts a run of four keys of one row (SPEC 3's positions are
// row_position + j): key runs from a multiple of four then share blocks without straddling.
__device__ __forceinline__ bool dropout_blocks_aligned(const AttentionParams& p) {
  return p.shard.global_keys % 4 == 0 && p.shard.key_start % 4 == 0;
}

// Dropout multipliers (0 or 1/(1-p), SPEC 3) of kN <= 4 consecutive positions pos0, pos0 + 1, ...:
// they span at most two Philox blocks, so a thread draws once or twice for all of them; once, with
// no branch, where `aligned` says pos0 is a multiple of kN in a run of whole blocks (kN divides 4
// and dropout_blocks_aligned holds).
template <int kN, typename acc_t>
__device__ __forceinline__ void dropout_run(const DropoutRng& rng, uint64_t pos0, acc_t (&m)[kN],
                                            bool aligned = false) {
  static_assert(kN >= 1 && kN <= 4, "a run spans at most two Philox blocks");
  const uint32_t threshold = rng.keep_threshold();  // keep(word) as one integer comparison
  const acc_t kept = static_cast<acc_t>(rng.keep_scale);
  const Philox4 first = rng.block(pos0);
  if (aligned) {
    const uint32_t index0 = kN == 4 ? 0 : static_cast<uint32_t>(pos0 & 3);
#pragma unroll
    for (int e = 0; e < kN; ++e) m[e] = (philox_word(first, index0 + e) >> 8) >= threshold ? kept : acc_t(0);
    return;
  }
  Philox4 second = first;
  if (((pos0 + kN - 1) >> 2) != (pos0 >> 2)) second = rng.block(pos0 + kN - 1);
#pragma unroll
  for (int e = 0; e < kN; ++e) {
    const uint64_t pos = pos0 + e;
    const uint32_t index = static_cast<uint32_t>(pos & 3);
    const uint32_t word = (pos >> 2) == (pos0 >> 2) ? philox_word(first, index) : philox_word(second, index);
    m[e] = (word >> 8) >= threshold ? kept : acc_t(0);
  }
}

// The dropout generator with its seed and offset read from device memory.
__device__ __forceinline__ DropoutRng device_rng(const AttentionParams& p) {
  DropoutRng rng = p.rng;
  if (p.has_dropout) {
    rng.seed = static_cast<uint64_t>(p.rng_state[0]);
    rng.offset = static_cast<uint64_t>(p.rng_state[1]);
  }
  return rng;
}

}  // namespace rudnn::cuda
