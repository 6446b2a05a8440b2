// Tensor-core building blocks for float16/bfloat16 (sm80+): asynchronous tile copies into shared
// memory, ldmatrix/movmatrix fragment loads, and the m16n8k16 MMA with float32 accumulators.
//
// Fragments of mma.m16n8k16, for lane = 4 g + t of a warp:
//   A (16 x 16, rows by k): a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..), a[3] = (g+8, 2t+8..)
//   B (16 x 8, k by cols):  b[0] = (k 2t..2t+1, col g), b[1] = (k 2t+8.., col g)
//   C (16 x 8, float32):    c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..2t+1)
// so the C fragments of two neighbouring 8-column blocks, rounded to 16 bits, are the A fragment
// of their 16 columns: a score tile becomes the left operand of the next product in registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common.cuh"

namespace rudnn::cuda {

// Shared-memory tiles hold rows of kCols 16-bit elements padded by 16 bytes, so that the eight
// rows one ldmatrix reads fall in different banks.
template <int kCols>
constexpr int tc_ld() {
  return kCols + 8;
}
template <int kCols>
struct PaddedTile {
  __device__ static constexpr int offset(int r, int c) { return r * tc_ld<kCols>() + c; }
};

// rows [row0, row0 + kRows) x columns [0, kCols) of a canonical tensor into a tile (Layout: padded,
// or wgmma.cuh's swizzled panels; either keeps 16-byte chunks whole);
// rows past `rows` and columns past `cols` read as zeros. `async` (rows_in_16_byte_chunks): by cp.async in
// the caller's next group; where the threads cover whole rows, a thread keeps one column chunk and
// steps down the rows. Otherwise (any head dim, any strides) element by element. The copying
// threads: kThreadCount of the block's, from thread kFirst on.
template <typename scalar_t, int kRows, int kCols, int kThreadCount, typename Layout = PaddedTile<kCols>,
          int kFirst = 0>
__device__ __forceinline__ void tile_to_smem_async(scalar_t* tile, const void* base, const Strides4& s, int64_t b,
                                                   int64_t h, int64_t row0, int64_t rows, int cols, bool async) {
  constexpr int kChunks = kCols / 8;
  const int thread = static_cast<int>(threadIdx.x) - kFirst;
  if (!async) {
#pragma unroll 1
    for (int idx = thread; idx < kRows * kCols; idx += kThreadCount) {
      const int r = idx / kCols, c = idx % kCols;
      const bool valid = row0 + r < rows && c < cols;
      tile[Layout::offset(r, c)] = valid ? at_row<scalar_t>(base, s, b, h, row0 + r)[c * s.col] : scalar_t(0);
    }
  } else if constexpr (kThreadCount % kChunks == 0) {
    constexpr int kStep = kThreadCount / kChunks;
    const int r0 = thread / kChunks, c = thread % kChunks;
    const scalar_t* src = at_row<scalar_t>(base, s, b, h, row0 + r0) + c * 8;
    const bool column_valid = c * 8 < cols;
    // A whole tile, the common case, without a check per row. Both layouts repeat every 8 rows
    // (the swizzle's period) one offset apart, so a thread places its kPhases row phases once and
    // steps by a constant from them.
    constexpr int kPhases = kStep % 8 == 0 ? 1 : kStep % 4 == 0 ? 2 : kStep % 2 == 0 ? 4 : 8;
    if constexpr (kRows % (kStep * kPhases) == 0) {
      if (column_valid && row0 + kRows <= rows) {
        constexpr int kPeriodOffset = Layout::offset(kStep * kPhases, 0);
        scalar_t* dst[kPhases];
#pragma unroll
        for (int phase = 0; phase < kPhases; ++phase) dst[phase] = tile + Layout::offset(r0 + kStep * phase, c * 8);
        const int64_t step = kStep * s.row;
#pragma unroll
        for (int k = 0; k < kRows / kStep; ++k, src += step) {
          cp_async16(dst[k % kPhases] + k / kPhases * kPeriodOffset, src);
        }
        return;
      }
    }
#pragma unroll
    for (int r = r0; r < kRows; r += kStep, src += kStep * s.row) {
      const bool valid = column_valid && row0 + r < rows;
      cp_async16(tile + Layout::offset(r, c * 8), valid ? src : static_cast<const scalar_t*>(base), valid ? 16 : 0);
    }
  } else {
    for (int idx = thread; idx < kRows * kChunks; idx += kThreadCount) {
      const int r = idx / kChunks, c = idx % kChunks;
      const bool valid = row0 + r < rows && c * 8 < cols;
      const scalar_t* src =
          valid ? at_row<scalar_t>(base, s, b, h, row0 + r) + c * 8 : static_cast<const scalar_t*>(base);
      cp_async16(tile + Layout::offset(r, c * 8), src, valid ? 16 : 0);
    }
  }
}

// Four 8x8 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}
// The transpose of an 8x8 matrix held one 32-bit pair per lane, as ldmatrix leaves it.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// A fragment of rows [row0, row0 + 16) x k [k0, k0 + 16) of a row-major tile (rows by k).
template <int kLd, typename scalar_t>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const scalar_t* tile, int row0, int k0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(a, tile + (row0 + lane % 16) * kLd + k0 + (lane / 16) * 8);
}
// B fragments of two column blocks [n0, n0 + 8), [n0 + 8, n0 + 16) by k [k0, k0 + 16), from a tile
// stored columns by k (K for Q K^T): b[0..1] for the first block, b[2..3] for the second.
template <int kLd, typename scalar_t>
__device__ __forceinline__ void load_b(uint32_t (&b)[4], const scalar_t* tile, int n0, int k0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(b, tile + (n0 + lane % 8 + (lane / 16) * 8) * kLd + k0 + ((lane / 8) % 2) * 8);
}
// The same two B fragments from a tile stored k by columns (V for P V).
template <int kLd, typename scalar_t>
__device__ __forceinline__ void load_b_trans(uint32_t (&b)[4], const scalar_t* tile, int n0, int k0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4_trans(b, tile + (k0 + lane % 16) * kLd + n0 + (lane / 16) * 8);
}

template <typename scalar_t>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<scalar_t, c10::Half>, "tensor-core products take float16 or bfloat16");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded to the 16-bit type, the first in the low half (the lower column).
template <typename scalar_t>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    r = *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    r = *reinterpret_cast<const uint32_t*>(&v);
  }
  return r;
}
// The rounding error of pack2: x - float(round(x)) for both halves, rounded again. pack2(x) plus
// this carries x to about twice the 16-bit type's precision ("exact" numerics' split products).
template <typename scalar_t>
__device__ __forceinline__ uint32_t pack2_low(float lo, float hi) {
  return pack2<scalar_t>(lo - round_to<scalar_t>(lo), hi - round_to<scalar_t>(hi));
}

// 2^x with subnormal results flushed to zero: the kernels' probabilities are at most 1 and the
// largest of a row is at least 1/S, so nothing below 2^-126 counts.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Quad reductions: the four lanes 4g..4g+3 of a warp share the rows of a C fragment.
template <typename T>
__device__ __forceinline__ T max4(T x) {
  x = max_nan(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return max_nan(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
template <typename T>
__device__ __forceinline__ T sum4(T x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Stores a row pair of a C fragment (columns d, d + 1 of row `row`) to a contiguous output row of
// `cols` elements: one 4-byte store where rows are 4-byte aligned (cols even).
template <typename scalar_t>
__device__ __forceinline__ void store_pair(scalar_t* row, int d, int cols, float x0, float x1) {
  if (d + 1 < cols && cols % 2 == 0) {
    *reinterpret_cast<uint32_t*>(row + d) = pack2<scalar_t>(x0, x1);
  } else {
    if (d < cols) row[d] = static_cast<scalar_t>(x0);
    if (d + 1 < cols) row[d + 1] = static_cast<scalar_t>(x1);
  }
}

}  // namespace rudnn::cuda
