// RoPE inside the CUDA kernels: Q and K rows are turned on their way into shared memory, so the
// rotated tensors are never written out; the gradients are turned back once complete
// (turn_back_cuda). Pairs turn in float32 (float64 for float64 inputs) and are rounded to the
// input dtype, as a separately rotated input (rudnn.apply_rotary) would be. No torch includes.
#pragma once

#include "mma.cuh"

namespace rudnn::cuda {

__device__ __forceinline__ const float* rotary_row(const RotaryTable& t, int64_t b, int64_t h, int64_t row) {
  return t.data + b * t.strides.batch + h * t.strides.head + row * t.strides.row;
}

// Whether a table's rows can be read in 16-byte pieces: E a multiple of 8 (4 pairs per piece and
// side), rows 16-byte aligned.
__device__ __forceinline__ bool rotary_rows_vector(const RotaryTable& t, int E) {
  const Strides4& s = t.strides;
  return E % 8 == 0 && s.row % 4 == 0 && s.head % 4 == 0 && s.batch % 4 == 0 &&
         reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
}

// Column c of a head dim E: its pair's other column, the pair's index, and whether c comes first
// (y_first = x_first cos - x_second sin, y_second = x_first sin + x_second cos).
struct RotaryColumn {
  int partner, pair;
  bool first;
};
__device__ __forceinline__ RotaryColumn rotary_column(int c, int E, bool interleaved) {
  const int half = E / 2;
  if (interleaved) return {c ^ 1, c / 2, (c & 1) == 0};
  return c < half ? RotaryColumn{c + half, c, true} : RotaryColumn{c - half, c - half, false};
}

// x (column c of a row) turned, given its partner's value and the row's table row.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t turned(acc_t x, acc_t partner, const RotaryColumn& col, const float* angles,
                                        int E) {
  const acc_t cos = static_cast<acc_t>(angles[col.pair]), sin = static_cast<acc_t>(angles[E / 2 + col.pair]);
  return round_to<scalar_t>(col.first ? x * cos - partner * sin : partner * sin + x * cos);
}

// Pairs (x1, x2) turned by angles (cos, sin), or turned back with kInverse.
template <bool kInverse, typename T>
__device__ __forceinline__ void turn_pair(T& x1, T& x2, T cos, T sin) {
  const T s = kInverse ? -sin : sin;
  const T y1 = x1 * cos - x2 * s, y2 = x1 * s + x2 * cos;
  x1 = y1, x2 = y2;
}

// Rows [0, kRows) of a tile of 16-bit elements in shared memory (element (r, c) at
// Layout::offset(r, c): mma.cuh's padded rows or wgmma.cuh's swizzled panels, both of which keep
// aligned runs of 8 columns together) turned in place, row r by the table row angles(r) (global or
// shared memory); rows at or past `valid` are left as they are. Where `vector`, a thread turns four
// pairs at a time, and the table pieces of kBatch groups are read before any is used, so that
// their latencies overlap (each group holds 8 floats of them in registers). The turning threads:
// kThreadCount of the block's, from thread kFirst on.
template <typename scalar_t, int kRows, int kThreadCount, typename Layout, int kBatch, int kFirst, typename Angles>
__device__ __forceinline__ void rotate_tile(scalar_t* tile, bool interleaved, int valid, int E, bool vector,
                                            Angles angles) {
  const int half = E / 2, thread = static_cast<int>(threadIdx.x) - kFirst;
  if (!vector) {
#pragma unroll 1
    for (int idx = thread; idx < kRows * half; idx += kThreadCount) {
      const int r = idx / half, pair = idx % half;
      if (r >= valid) break;  // idx only grows, and so does r
      const float* a = angles(r);
      const int c1 = interleaved ? 2 * pair : pair, c2 = interleaved ? 2 * pair + 1 : pair + half;
      scalar_t& y1 = tile[Layout::offset(r, c1)];
      scalar_t& y2 = tile[Layout::offset(r, c2)];
      float x1 = static_cast<float>(y1), x2 = static_cast<float>(y2);
      turn_pair<false>(x1, x2, a[pair], a[half + pair]);
      y1 = static_cast<scalar_t>(x1);
      y2 = static_cast<scalar_t>(x2);
    }
    return;
  }
  const int groups = half / 4, total = min(valid, kRows) * groups;
#pragma unroll 1
  for (int base = thread; base < total; base += kBatch * kThreadCount) {
    float4 cos[kBatch], sin[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int idx = base + u * kThreadCount;
      if (idx < total) {
        const float* a = angles(idx / groups) + 4 * (idx % groups);
        cos[u] = *reinterpret_cast<const float4*>(a);
        sin[u] = *reinterpret_cast<const float4*>(a + half);
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int idx = base + u * kThreadCount;
      if (idx >= total) break;
      const int r = idx / groups, g = idx % groups;
      const float c[4] = {cos[u].x, cos[u].y, cos[u].z, cos[u].w}, s[4] = {sin[u].x, sin[u].y, sin[u].z, sin[u].w};
      if (interleaved) {  // columns 8g .. 8g + 7: one 16-byte piece
        uint4* at = reinterpret_cast<uint4*>(tile + Layout::offset(r, 8 * g));
        uint4 piece = *at;
        scalar_t* x = reinterpret_cast<scalar_t*>(&piece);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x1 = static_cast<float>(x[2 * e]), x2 = static_cast<float>(x[2 * e + 1]);
          turn_pair<false>(x1, x2, c[e], s[e]);
          x[2 * e] = static_cast<scalar_t>(x1), x[2 * e + 1] = static_cast<scalar_t>(x2);
        }
        *at = piece;
      } else {  // columns 4g .. 4g + 3 and their partners half + 4g ..: two 8-byte pieces
        uint2* first_at = reinterpret_cast<uint2*>(tile + Layout::offset(r, 4 * g));
        uint2* second_at = reinterpret_cast<uint2*>(tile + Layout::offset(r, half + 4 * g));
        uint2 first = *first_at, second = *second_at;
        scalar_t* x = reinterpret_cast<scalar_t*>(&first);
        scalar_t* y = reinterpret_cast<scalar_t*>(&second);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x1 = static_cast<float>(x[e]), x2 = static_cast<float>(y[e]);
          turn_pair<false>(x1, x2, c[e], s[e]);
          x[e] = static_cast<scalar_t>(x1), y[e] = static_cast<scalar_t>(x2);
        }
        *first_at = first;
        *second_at = second;
      }
    }
  }
}

// A tile of rows [row0, row0 + kRows) of head (b, h) turned with its table rows read straight from
// global memory (L1 where prefetch_table_rows ran a tile earlier): tiles a block turns once, the
// backward's streamed tiles, and the forward's K tiles of wide heads.
template <typename scalar_t, int kRows, int kThreadCount, typename Layout, int kBatch = 4, int kFirst = 0>
__device__ __forceinline__ void rotate_tile_global(scalar_t* tile, const RotaryTable& t, int64_t b, int64_t h,
                                                   int64_t row0, int64_t rows, int E) {
  const int valid = static_cast<int>(max(int64_t{0}, min(int64_t{kRows}, rows - row0)));
  rotate_tile<scalar_t, kRows, kThreadCount, Layout, kBatch, kFirst>(
      tile, t.interleaved, valid, E, rotary_rows_vector(t, E), [&](int r) { return rotary_row(t, b, h, row0 + r); });
}

// Table rows [row0, row0 + kRows) of head (b, h) fetched into L1 ahead of rotate_tile_global, so
// that turning a streamed tile, a tile later, waits on L1 rather than L2.
template <int kRows, int kThreadCount, int kFirst = 0>
__device__ __forceinline__ void prefetch_table_rows(const RotaryTable& t, int64_t b, int64_t h, int64_t row0,
                                                    int64_t rows, int E) {
  constexpr int kLine = 128 / sizeof(float);
  const int valid = static_cast<int>(max(int64_t{0}, min(int64_t{kRows}, rows - row0)));
  const int lines = (E + kLine - 1) / kLine;
#pragma unroll 1
  for (int idx = static_cast<int>(threadIdx.x) - kFirst; idx < valid * lines; idx += kThreadCount) {
    const float* at = rotary_row(t, b, h, row0 + idx / lines) + min(idx % lines * kLine, E - 1);
    asm volatile("prefetch.global.L1 [%0];\n" ::"l"(at));
  }
}

// Table rows [row0, row0 + kRows) of head (b, h) into shared memory (kRows x E floats) by cp.async
// in the caller's next group where rotary_rows_vector, element by element otherwise; rows past
// `rows` are not read. By kThreadCount of the block's threads, from thread kFirst on.
template <int kRows, int kThreadCount, int kFirst = 0>
__device__ __forceinline__ void table_to_smem_async(float* dst, const RotaryTable& t, int64_t b, int64_t h,
                                                    int64_t row0, int64_t rows, int E) {
  const int valid = static_cast<int>(max(int64_t{0}, min(int64_t{kRows}, rows - row0)));
  if (rotary_rows_vector(t, E)) {
    const int pieces = E / 4;
#pragma unroll 1
    for (int idx = static_cast<int>(threadIdx.x) - kFirst; idx < valid * pieces; idx += kThreadCount) {
      const int r = idx / pieces, c = idx % pieces;
      cp_async16(dst + r * E + 4 * c, rotary_row(t, b, h, row0 + r) + 4 * c, 16);
    }
    return;
  }
#pragma unroll 1
  for (int idx = static_cast<int>(threadIdx.x) - kFirst; idx < valid * E; idx += kThreadCount) {
    dst[idx] = rotary_row(t, b, h, row0 + idx / E)[idx % E];
  }
}

// A tile turned with its table rows in shared memory (table_to_smem_async's layout).
template <typename scalar_t, int kRows, int kThreadCount, typename Layout, int kBatch>
__device__ __forceinline__ void rotate_tile_smem(scalar_t* tile, const float* table, bool interleaved, int64_t row0,
                                                 int64_t rows, int E) {
  const int valid = static_cast<int>(max(int64_t{0}, min(int64_t{kRows}, rows - row0)));
  rotate_tile<scalar_t, kRows, kThreadCount, Layout, kBatch, 0>(tile, interleaved, valid, E, E % 8 == 0,
                                                             [&](int r) { return table + r * E; });
}

}  // namespace rudnn::cuda
