// What the tensor-core kernels share: block shape, head-dim buckets, and the score rules and
// dropout applied to a warp's fragment tile of scores (mma.cuh's C layout).
#pragma once

#include <type_traits>

#include "mma.cuh"

namespace rudnn::cuda {

constexpr int kTcWarps = 4;
constexpr int kTcThreads = 32 * kTcWarps;

// f(kE, kEv) for the smallest head-dim bucket holding E and Ev (multiples of 8, at most 256):
// E = Ev in {32, 64, 96, 128, 192, 256} and E = 192, Ev = 128; other pairs take the bucket of
// the wider one, the columns past E and Ev zero-filled in shared memory. Products run over the
// whole bucket: a runtime bound in their unrolled loops would keep the compiler from issuing the
// next fragment loads ahead of the branch.
template <typename F>
void dispatch_tc_dims(int64_t E, int64_t Ev, F&& f) {
  const int64_t w = std::max(E, Ev);
  if (w <= 32) {
    f(std::integral_constant<int, 32>{}, std::integral_constant<int, 32>{});
  } else if (w <= 64) {
    f(std::integral_constant<int, 64>{}, std::integral_constant<int, 64>{});
  } else if (w <= 96) {
    f(std::integral_constant<int, 96>{}, std::integral_constant<int, 96>{});
  } else if (w <= 128) {
    f(std::integral_constant<int, 128>{}, std::integral_constant<int, 128>{});
  } else if (w <= 192 && Ev <= 128) {
    f(std::integral_constant<int, 192>{}, std::integral_constant<int, 128>{});
  } else if (w <= 192) {
    f(std::integral_constant<int, 192>{}, std::integral_constant<int, 192>{});
  } else {
    f(std::integral_constant<int, 256>{}, std::integral_constant<int, 256>{});
  }
}

// The tensor-core forward's launches for one input dtype (attention_forward_tc.cuh, instantiated
// in attention_forward_tc_bf16.cu and attention_forward_tc_f16.cu); kv_finite: keys_values_finite;
// wgmma: the products by wgmma where the head-dim bucket allows (kernel_choice.h).
template <typename scalar_t>
void launch_forward_tc(const AttentionParams& p, bool wgmma, scalar_t* out, float* lse, const bool* kv_finite);

// The tensor-core kernels keep scores in base 2 (exp2, log2(e) folded into the scale) in both
// numerics; LSE leaves them in natural units.
constexpr float kTcUnit = static_cast<float>(kLog2e);

// Raw products q.k to scores (times scale * kTcUnit); on `edge` tiles (tile_on_edge) -inf past
// the problem's bounds and for keys of other documents, -inf added beyond the causal frontier
// (apply_rules' rules). The rules run in 32-bit tile coordinates (row x = i - row0, key y =
// j - j0), so that the edge path holds few registers beside the fragments. kKeyRows: the
// fragments' rows are keys from j0 and their columns query rows from row0 (S^T, kMI = 1).
template <int kMI, int kNB, bool kKeyRows = false>
__device__ __forceinline__ void fragment_scores(const AttentionParams& p, float (&s)[kMI][kNB][4], int64_t b,
                                                int64_t row0, int64_t j0, bool edge) {
  static_assert(!kKeyRows || kMI == 1, "S^T fragments of 16 keys");
  const float scale = static_cast<float>(p.scale) * kTcUnit;
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mi][nb][e] *= scale;
  if (!edge) return;
  constexpr int64_t kFar = int64_t{1} << 30;  // beyond any tile coordinate
  const auto near = [](int64_t v) { return static_cast<int>(min(max(v, -kFar), kFar)); };
  const int rows = near(p.queries - row0), keys = near(p.keys - j0);
  // Key y of row x lies beyond the causal frontier where y - x > frontier.
  const int frontier = p.is_causal ? near(p.shard.query_start - p.shard.key_start + row0 - j0) : INT_MAX;
  const int lane = threadIdx.x % 32;
  // Keys [lo, last) of the tile are in row x's document and bounds.
  const auto row_keys = [&](int x, int& lo, int& last) {
    int hi = INT_MAX;
    lo = INT_MIN;
    if (p.key_windows != nullptr && x < rows) {
      const int2 window = key_window(p, b, row0 + x);
      lo = near(window.x - j0), hi = near(window.y - j0);
    }
    last = min(min(keys, hi), x < rows ? INT_MAX : 0);
  };
  const auto rule = [&](float& v, int x, int y, int lo, int last) {
    if (y >= last || y < lo) {
      v = -INFINITY;
    } else if (y - x > frontier) {
      v += -INFINITY;
    }
  };
  if constexpr (kKeyRows) {
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int x = 8 * nb + 2 * (lane % 4) + e;
        int lo, last;
        row_keys(x, lo, last);
#pragma unroll
        for (int r = 0; r < 2; ++r) rule(s[0][nb][2 * r + e], x, lane / 4 + 8 * r, lo, last);
      }
  } else {
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int x = 16 * mi + lane / 4 + 8 * r;
        int lo, last;
        row_keys(x, lo, last);
#pragma unroll
        for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
          for (int e = 0; e < 2; ++e) rule(s[mi][nb][2 * r + e], x, 8 * nb + 2 * (lane % 4) + e, lo, last);
      }
  }
}

// A mask tile in shared memory holds the mask's own elements (bool, the inputs' 16-bit type, or
// float32), rows of kCols keys padded so that rows stay 16-byte aligned and the pairs a half-warp
// reads in fragment_add_mask fall in distinct banks.
__host__ __device__ constexpr int mask_tile_ld(int cols, int element_bytes) {
  return cols * element_bytes + (element_bytes == 4 ? 32 : 16);
}
template <typename scalar_t>
__host__ __device__ constexpr int mask_element_bytes(MaskKind kind) {
  return kind == MaskKind::kBool ? 1 : kind == MaskKind::kFloat32 ? 4 : static_cast<int>(sizeof(scalar_t));
}
template <typename scalar_t, int kRows, int kCols>
constexpr size_t mask_tile_bytes(MaskKind kind) {
  return kind == MaskKind::kNone ? 0
                                 : static_cast<size_t>(kRows) * mask_tile_ld(kCols, mask_element_bytes<scalar_t>(kind));
}

// Query rows [i0, i0 + kRows) by keys [j0, j0 + kCols) of the mask (head h) into a mask tile; zeros
// past the problem's bounds, where the edge rules of fragment_scores decide. Rows that are 16-byte
// aligned and contiguous (`async`) go by cp.async in the caller's next group; other layouts
// (broadcast or strided keys) are read element by element through the broadcast strides. kThreads:
// the block's.
template <typename scalar_t, int kRows, int kCols, int kThreads = kTcThreads>
__device__ __forceinline__ void mask_tile_to_smem(const AttentionParams& p, unsigned char* tile, int64_t b, int64_t h,
                                                  int64_t i0, int64_t j0, bool async) {
  const Strides4& ms = p.mask_strides;
  const int bytes = mask_element_bytes<scalar_t>(p.mask_kind), ld = mask_tile_ld(kCols, bytes);
  const unsigned char* mask = static_cast<const unsigned char*>(p.mask);
  if (async && i0 + kRows <= p.queries && j0 + kCols <= p.keys) {
    // A whole tile, the common case: the element size a compile-time constant, so that a thread's
    // chunk column and row step are too, and no bound is checked.
    const auto whole_tile = [&](auto element_bytes) {
      constexpr int kBytes = decltype(element_bytes)::value, kChunks = kCols * kBytes / 16;
      constexpr int kLd = mask_tile_ld(kCols, kBytes);
      static_assert(kThreads % kChunks == 0 && kRows % (kThreads / kChunks) == 0, "whole rows per pass");
      constexpr int kStep = kThreads / kChunks;
      const int r0 = threadIdx.x / kChunks, c = threadIdx.x % kChunks;
      const unsigned char* src = mask + (b * ms.batch + h * ms.head + (i0 + r0) * ms.row + j0) * kBytes + 16 * c;
      unsigned char* dst = tile + r0 * kLd + 16 * c;
      const int64_t step = kStep * ms.row * kBytes;
#pragma unroll
      for (int k = 0; k < kRows / kStep; ++k, src += step) cp_async16(dst + k * kStep * kLd, src);
    };
    if (bytes == 1) {
      whole_tile(std::integral_constant<int, 1>{});
    } else if (bytes == 2) {
      whole_tile(std::integral_constant<int, 2>{});
    } else {
      whole_tile(std::integral_constant<int, 4>{});
    }
    return;
  }
  if (async) {
    const int chunks = kCols * bytes / 16;
#pragma unroll 1
    for (int idx = threadIdx.x; idx < kRows * chunks; idx += kThreads) {
      const int r = idx / chunks, c = idx % chunks;
      const int64_t i = i0 + r, j = j0 + c * 16 / bytes;
      const int valid = i < p.queries ? static_cast<int>(max(int64_t{0}, min(int64_t{16}, (p.keys - j) * bytes))) : 0;
      const int64_t at = b * ms.batch + h * ms.head + i * ms.row + j;
      cp_async16(tile + r * ld + 16 * c, valid > 0 ? mask + at * bytes : mask, valid);
    }
    return;
  }
#pragma unroll 1
  for (int idx = threadIdx.x; idx < kRows * kCols; idx += kThreads) {
    const int r = idx / kCols, c = idx % kCols;
    const int64_t i = i0 + r, j = j0 + c;
    const bool valid = i < p.queries && j < p.keys;
    const int64_t at = b * ms.batch + h * ms.head + i * ms.row + j * ms.col;
    unsigned char* dst = tile + r * ld + c * bytes;
    if (bytes == 1)
      *dst = valid ? mask[at] : 0;
    else if (bytes == 2)
      *reinterpret_cast<uint16_t*>(dst) = valid ? reinterpret_cast<const uint16_t*>(mask)[at] : 0;
    else
      *reinterpret_cast<uint32_t*>(dst) = valid ? reinterpret_cast<const uint32_t*>(mask)[at] : 0;
  }
}

// Whether mask_tile_to_smem can copy the mask's rows by cp.async.
template <typename scalar_t>
__device__ __forceinline__ bool mask_rows_async(const AttentionParams& p) {
  const int64_t bytes = mask_element_bytes<scalar_t>(p.mask_kind);
  const Strides4& ms = p.mask_strides;
  return ms.col == 1 && reinterpret_cast<uintptr_t>(p.mask) % 16 == 0 && (ms.row * bytes) % 16 == 0 &&
         (ms.head * bytes) % 16 == 0 && (ms.batch * bytes) % 16 == 0;
}

// The mask's rule (apply_rules') on a fragment tile: -inf added where a bool mask excludes the
// key, kTcUnit * mask added for a float one; the fragment's first row and key are the tile's
// (row, col). kKeyRows: fragments of S^T (fragment_scores'), read across the tile's rows.
template <typename scalar_t, int kMI, int kNB, int kCols, bool kKeyRows = false>
__device__ __forceinline__ void fragment_add_mask(const AttentionParams& p, float (&s)[kMI][kNB][4],
                                                  const unsigned char* tile, int row, int col) {
  const int lane = threadIdx.x % 32;
  if constexpr (kKeyRows) {
    static_assert(kMI == 1, "S^T fragments of 16 keys");
    // Element (nb, 2 r + e) is query row row + 8 nb + 2 t + e, key col + g + 8 r.
    const auto each = [&](int bytes, auto add) {
      const int ld = mask_tile_ld(kCols, bytes);
      const unsigned char* at = tile + (row + 2 * (lane % 4)) * ld + (col + lane / 4) * bytes;
#pragma unroll
      for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int e = 0; e < 2; ++e) add(s[0][nb][2 * r + e], at + (8 * nb + e) * ld + 8 * r * bytes);
    };
    if (p.mask_kind == MaskKind::kBool) {
      each(1, [](float& x, const unsigned char* m) {
        if (*m == 0) x += -INFINITY;
      });
    } else if (p.mask_kind == MaskKind::kFloat32) {
      each(4, [](float& x, const unsigned char* m) { x += kTcUnit * *reinterpret_cast<const float*>(m); });
    } else {
      each(static_cast<int>(sizeof(scalar_t)),
           [](float& x, const unsigned char* m) {
             x += kTcUnit * static_cast<float>(*reinterpret_cast<const scalar_t*>(m));
           });
    }
    return;
  }
  // Element (mi, nb, r) of this lane lies (16 mi + 8 r) rows and 8 nb keys past its first one.
  const auto each = [&](int bytes, auto add_pair) {
    const int ld = mask_tile_ld(kCols, bytes);
    const unsigned char* at = tile + (row + lane / 4) * ld + (col + 2 * (lane % 4)) * bytes;
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int nb = 0; nb < kNB; ++nb) add_pair(s[mi][nb] + 2 * r, at + (16 * mi + 8 * r) * ld + 8 * nb * bytes);
  };
  if (p.mask_kind == MaskKind::kBool) {
    each(1, [](float* x, const unsigned char* m) {
      const uint32_t keep = *reinterpret_cast<const uint16_t*>(m);
      if ((keep & 0xff) == 0) x[0] += -INFINITY;
      if ((keep >> 8) == 0) x[1] += -INFINITY;
    });
  } else if (p.mask_kind == MaskKind::kFloat32) {
    each(4, [](float* x, const unsigned char* m) {
      const float2 v = *reinterpret_cast<const float2*>(m);
      x[0] += kTcUnit * v.x;
      x[1] += kTcUnit * v.y;
    });
  } else {
    each(static_cast<int>(sizeof(scalar_t)), [](float* x, const unsigned char* m) {
      const scalar_t* v = reinterpret_cast<const scalar_t*>(m);
      x[0] += kTcUnit * static_cast<float>(v[0]);
      x[1] += kTcUnit * static_cast<float>(v[1]);
    });
  }
}

// How a tensor-core kernel reads its inputs: which operands go by cp.async (the others element by
// element), whether and how a mask tile is read, whether lanes share dropout blocks.
struct InputReads {
  bool q, k, v, dout, masked, mask_async, dropout_aligned;
};
template <typename scalar_t>
__device__ __forceinline__ InputReads input_reads(const AttentionParams& p, const void* dout = nullptr,
                                                  const Strides4& dout_strides = {}) {
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);
  const bool masked = p.mask_kind != MaskKind::kNone;
  return {rows_in_16_byte_chunks(p.q, p.q_strides, E, sizeof(scalar_t)),
          rows_in_16_byte_chunks(p.k, p.k_strides, E, sizeof(scalar_t)),
          rows_in_16_byte_chunks(p.v, p.v_strides, Ev, sizeof(scalar_t)),
          dout != nullptr && rows_in_16_byte_chunks(dout, dout_strides, Ev, sizeof(scalar_t)),
          masked,
          masked && mask_rows_async<scalar_t>(p),
          dropout_blocks_aligned(p)};
}

// SPEC 3's keep decision of every element of a fragment tile, as bits: bit 4 nb + e of bits[mi] is
// that of s[mi][nb][e]. The keys j, j + 1 of lanes 4g + t and 4g + (t ^ 1) share a Philox block
// when `aligned` (dropout_blocks_aligned and j0 a multiple of 4): the even lane draws it for row g,
// the odd lane for row g + 8, and they swap the halves the other needs.
template <int kMI, int kNB>
__device__ __forceinline__ void fragment_keep_bits(const AttentionParams& p, const DropoutRng& rng,
                                                   uint32_t (&bits)[kMI], int64_t b, int64_t h, int64_t row0,
                                                   int64_t j0, bool aligned) {
  static_assert(kNB <= 8, "four bits per 8-key block");
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, odd = t & 1;
  const uint32_t threshold = rng.keep_threshold();
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi) {
    bits[mi] = 0;
    const int64_t i = row0 + 16 * mi + g;
    if (aligned) {
      const uint64_t pos = p.shard.row_position(b, h, i + 8 * odd) + static_cast<uint64_t>(j0 + 2 * t);
      // Two Philox blocks in flight: at two warps a scheduler one block's chain of dependent
      // multiplies would leave it idle.
#pragma unroll 2
      for (int nb = 0; nb < kNB; ++nb) {
        const Philox4 x = rng.block(pos + 8 * nb);
        uint32_t k = 0;
#pragma unroll
        for (int w = 0; w < 4; ++w) k |= static_cast<uint32_t>((x.x[w] >> 8) >= threshold) << w;
        const uint32_t mine = odd ? k >> 2 : k & 3, theirs = odd ? k & 3 : k >> 2;
        const uint32_t other = __shfl_xor_sync(0xffffffffu, theirs, 1);  // the partner's row, this lane's keys
        bits[mi] |= (odd ? other | mine << 2 : mine | other << 2) << (4 * nb);
      }
    } else {
#pragma unroll 1
      for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float keep[2];
          dropout_run<2>(rng, p.shard.row_position(b, h, i + 8 * r) + static_cast<uint64_t>(j0 + 8 * nb + 2 * t), keep);
          bits[mi] |= (static_cast<uint32_t>(keep[0] != 0.0f) | static_cast<uint32_t>(keep[1] != 0.0f) << 1)
                      << (4 * nb + 2 * r);
        }
      }
    }
  }
}

// fragment_keep_bits for S^T fragments (fragment_scores' kKeyRows): bit 4 nb + 2 r + e of bits is
// that of s[nb][2 r + e], query row0 + 8 nb + 2 t + e, key j0 + g + 8 r. Aligned (j0 a multiple of
// 4), lane 4 g + t draws the Philox block of query row0 + 8 nb + g and keys j0 + 4 t .. j0 + 4 t + 3,
// and each lane gathers its four bits from the lanes that drew them.
template <int kNB>
__device__ __forceinline__ void fragment_keep_bits_key_rows(const AttentionParams& p, const DropoutRng& rng,
                                                            uint32_t& bits, int64_t b, int64_t h, int64_t row0,
                                                            int64_t j0, bool aligned) {
  static_assert(kNB <= 8, "four bits per 8-query block");
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const uint32_t threshold = rng.keep_threshold();
  bits = 0;
  if (aligned) {
    const uint64_t key = static_cast<uint64_t>(j0 + 4 * t);
#pragma unroll 2  // two Philox blocks in flight, as in fragment_keep_bits
    for (int nb = 0; nb < kNB; ++nb) {
      const Philox4 x = rng.block(p.shard.row_position(b, h, row0 + 8 * nb + g) + key);
      uint32_t k = 0;
#pragma unroll
      for (int w = 0; w < 4; ++w) k |= static_cast<uint32_t>((x.x[w] >> 8) >= threshold) << w;
      uint32_t mine = 0;
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          // Query 2 t + e's block holding key g + 8 r: drawn by lane 4 (2 t + e) + g / 4 + 2 r.
          const uint32_t drawn = __shfl_sync(0xffffffffu, k, 4 * (2 * t + e) + g / 4 + 2 * r);
          mine |= (drawn >> (g % 4) & 1) << (2 * r + e);
        }
      bits |= mine << (4 * nb);
    }
  } else {
#pragma unroll 1
    for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float keep[1];
          const uint64_t pos =
              p.shard.row_position(b, h, row0 + 8 * nb + 2 * t + e) + static_cast<uint64_t>(j0 + g + 8 * r);
          dropout_run<1>(rng, pos, keep, true);  // one position: one block
          bits |= static_cast<uint32_t>(keep[0] != 0.0f) << (4 * nb + 2 * r + e);
        }
  }
}

// The A fragment (16 rows by keys [16 kk, 16 kk + 16)) of a C-fragment tile, rounded to 16 bits;
// with `low`, the rounding error instead (pack2_low).
template <typename scalar_t, int kNB>
__device__ __forceinline__ void fragment_to_a(uint32_t (&a)[4], const float (&c)[kNB][4], int kk, bool low) {
  const float* x = c[2 * kk];
  const float* y = c[2 * kk + 1];
  if (low) {
    a[0] = pack2_low<scalar_t>(x[0], x[1]), a[1] = pack2_low<scalar_t>(x[2], x[3]);
    a[2] = pack2_low<scalar_t>(y[0], y[1]), a[3] = pack2_low<scalar_t>(y[2], y[3]);
  } else {
    a[0] = pack2<scalar_t>(x[0], x[1]), a[1] = pack2<scalar_t>(x[2], x[3]);
    a[2] = pack2<scalar_t>(y[0], y[1]), a[3] = pack2<scalar_t>(y[2], y[3]);
  }
}

}  // namespace rudnn::cuda
