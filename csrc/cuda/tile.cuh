// Register-tiled products on shared-memory tiles, for the CUDA-core attention kernels.
//
// A block is a 16 x 16 grid of threads. A product of two tiles gives a (16 kTM) x (16 kTN) score
// tile; thread (ty, tx) holds a kTM x kTN micro-tile of it: rows ty * kTM + r of the first operand
// and rows tx + 16 c of the second. A row of scores thus lives in the 16 lanes of one ty, which
// share a warp (grid_row, grid_col).
// Tiles whose rows are the second operand's are stored permuted (logical row tx * kTN + c at
// physical row tx + 16 c): a thread's columns are then consecutive keys, which share Philox
// draws and mask bytes, while the lanes of a load read distinct rows, free of bank conflicts.
// No torch includes.
#pragma once

#include "rotary.cuh"

namespace rudnn::cuda {

constexpr int kThreadGrid = 16;
constexpr int kThreads = kThreadGrid * kThreadGrid;

// Where thread (ty, tx) sits: warp w holds ty = 2w and 2w + 1 with every tx, at lane
// tx % 8 + 8 (ty % 2) + 16 (tx / 8). Shared memory serves a 16-byte load one half-warp at a time;
// a half-warp of 8 tx and two ty reads 8 distinct rows of a second-operand tile (one wavefront)
// where 16 tx of one ty would read 16 (two), which kept the products at two thirds of the FMA rate.
__device__ __forceinline__ int grid_row() { return static_cast<int>(threadIdx.x / 32 * 2 + (threadIdx.x >> 3 & 1)); }
__device__ __forceinline__ int grid_col() { return static_cast<int>((threadIdx.x & 7) | (threadIdx.x >> 1 & 8)); }

// Reductions over the 16 lanes of one ty, a row of a score tile: lane masks 16, 4, 2, 1 are tx's
// bits 3 to 0, so the sums keep the order of a plain tree over tx.
template <typename T>
__device__ __forceinline__ T max16(T x) {
  x = max_nan(x, __shfl_xor_sync(0xffffffffu, x, 16));
#pragma unroll
  for (int o = 4; o > 0; o /= 2) x = max_nan(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
template <typename T>
__device__ __forceinline__ T sum16(T x) {
  x += __shfl_xor_sync(0xffffffffu, x, 16);
#pragma unroll
  for (int o = 4; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Tile shapes for a compute type and a head-dim bucket kWidth (the larger of E and Ev, at most).
// Micro-tiles of 4 x 4 give 16 FMAs per pair of 16-byte shared loads; they shrink for wide heads
// and float64 so that the backward's six tiles fit in shared memory (227 KB) and its
// accumulators in registers.
template <typename acc_t, int kWidthArg>
struct TileConfig {
  static constexpr int kWidth = kWidthArg;
  static constexpr bool kIsDouble = sizeof(acc_t) == 8;
  static constexpr int kMicro = kIsDouble ? (kWidth <= 64 ? 4 : kWidth <= 128 ? 2 : 1) : (kWidth <= 128 ? 4 : 2);
  static constexpr int kTM = kMicro, kTN = kMicro;  // micro-tile rows and columns
  static constexpr int kBM = kThreadGrid * kTM, kBN = kThreadGrid * kTN;
  static constexpr int kVec = 16 / static_cast<int>(sizeof(acc_t));  // elements of one 16-byte access
  // Row stride of (rows x head dim) tiles: 16-byte rows an odd number of 16-byte units apart, so
  // that the 8 rows one 16-byte load phase reads fall in distinct banks.
  static constexpr int kLd = kWidth + kVec;
  static constexpr int kLdWeights = kBM + kVec;       // weight tiles: kBN rows of kBM
  static constexpr int kOutCols = kWidth / kThreadGrid;  // head-dim columns a thread accumulates
  // Two blocks of the narrow float kernels fit on a multiprocessor; ask the compiler for it.
  static constexpr int kMinBlocks = !kIsDouble && kWidth <= 64 ? 2 : 1;
  static_assert(kOutCols % kVec == 0, "head-dim columns come in 16-byte chunks");

  __host__ __device__ static constexpr int permuted(int row) { return row % kTN * kThreadGrid + row / kTN; }
  __host__ __device__ static constexpr int logical(int row) { return row % kThreadGrid * kTN + row / kThreadGrid; }
  // Head-dim column of a thread's accumulator c: 16-byte chunks of kVec columns, one per lane.
  __host__ __device__ static constexpr int out_col(int tx, int c) {
    return c / kVec * kThreadGrid * kVec + tx * kVec + c % kVec;
  }
};

__host__ __device__ constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }

template <typename T, int N>
struct VecType;
template <>
struct VecType<float, 4> {
  using type = float4;
};
template <>
struct VecType<float, 2> {
  using type = float2;
};
template <>
struct VecType<float, 1> {
  using type = float;
};
template <>
struct VecType<double, 2> {
  using type = double2;
};
template <>
struct VecType<double, 1> {
  using type = double;
};

// N consecutive elements of shared memory aligned to min(16, N * sizeof(T)) bytes, in the
// widest accesses that alignment allows.
template <int N, typename T>
__device__ __forceinline__ void load_vec(const T* src, T (&x)[N]) {
  constexpr int kStep = N * sizeof(T) >= 16 ? 16 / sizeof(T) : N;
  using V = typename VecType<T, kStep>::type;
#pragma unroll
  for (int i = 0; i < N; i += kStep) {
    const V v = *reinterpret_cast<const V*>(src + i);
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int j = 0; j < kStep; ++j) x[i + j] = e[j];
  }
}
template <int N, typename T>
__device__ __forceinline__ void store_vec(T* dst, const T (&x)[N]) {
  constexpr int kStep = N * sizeof(T) >= 16 ? 16 / sizeof(T) : N;
  using V = typename VecType<T, kStep>::type;
#pragma unroll
  for (int i = 0; i < N; i += kStep) {
    V v;
    T* e = reinterpret_cast<T*>(&v);
#pragma unroll
    for (int j = 0; j < kStep; ++j) e[j] = x[i + j];
    *reinterpret_cast<V*>(dst + i) = v;
  }
}

// Rows [row0, row0 + kRows) of head (b, h) of a (B, H, rows, cols) tensor into a row-major shared
// tile of stride Cfg::kLd, in the compute type, turned by `rotary` where it has a table, times
// `factor`. With kPermute (second-operand tiles, kRows = kBN) row r lands at physical row
// permuted(r). Rows past `rows` and columns past `cols` (up to kWidth) are zero, so that padding
// adds nothing to the products.
template <typename scalar_t, typename Cfg, int kRows, bool kPermute, typename acc_t>
__device__ __forceinline__ void load_tile(acc_t* tile, const void* base, const Strides4& s, int64_t b, int64_t h,
                                          int64_t row0, int64_t rows, int cols, acc_t factor,
                                          const RotaryTable& rotary = RotaryTable{}) {
  constexpr int kGroups = Cfg::kWidth / 4;  // four columns per load
  static_assert(!kPermute || kRows == Cfg::kBN, "permuted tiles are second-operand tiles");
  static_assert(kRows * kGroups % kThreads == 0, "every thread loads the same number of groups");
#pragma unroll
  for (int it = 0; it < kRows * kGroups / kThreads; ++it) {
    const int x = it * kThreads + threadIdx.x;
    const int r = x / kGroups, d = x % kGroups * 4;
    acc_t v[4] = {0, 0, 0, 0};
    if (row0 + r < rows && d < cols) {
      const scalar_t* src = at_row<scalar_t>(base, s, b, h, row0 + r) + d * s.col;
      const bool vector =
          s.col == 1 && d + 4 <= cols && reinterpret_cast<uintptr_t>(src) % (4 * sizeof(scalar_t)) == 0;
      if (vector) {
        load4_global<scalar_t>(src, v);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (d + e < cols) v[e] = static_cast<acc_t>(src[e * s.col]);
        }
      }
      if (rotary.data != nullptr) {  // the partners come from global memory (L1): these kernels are the fallback
        const scalar_t* row = src - d * s.col;
        const float* angles = rotary_row(rotary, b, h, row0 + r);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (d + e >= cols) continue;
          const RotaryColumn col = rotary_column(d + e, cols, rotary.interleaved);
          v[e] = turned<scalar_t>(v[e], static_cast<acc_t>(row[col.partner * s.col]), col, angles, cols);
        }
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] *= factor;
    store_vec<4>(tile + (kPermute ? Cfg::permuted(r) : r) * Cfg::kLd + d, v);
  }
}

// Whether a streamed operand's tiles can go global -> shared by cp.async: its rows are 16-byte
// chunks already in the compute type, and there is no rotation to apply on the way.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ bool streams_async(const void* base, const Strides4& s, int cols,
                                              const RotaryTable& rotary = RotaryTable{}) {
  return std::is_same_v<scalar_t, acc_t> && rotary.data == nullptr &&
         rows_in_16_byte_chunks(base, s, cols, sizeof(acc_t));
}

// A streamed second-operand tile (kBN rows from row0, stored permuted): with `async`
// (streams_async) by cp.async in the caller's next group, so that it lands while the block
// computes; otherwise through load_tile. Zeros past `rows` and `cols` either way.
template <typename scalar_t, typename Cfg, typename acc_t>
__device__ __forceinline__ void stream_tile(acc_t* tile, const void* base, const Strides4& s, int64_t b, int64_t h,
                                            int64_t row0, int64_t rows, int cols, bool async,
                                            const RotaryTable& rotary = RotaryTable{}) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    if (async) {
      // A thread keeps one 16-byte column chunk and steps down the rows by kStep, a multiple of
      // kTN: its rows' permuted places are then kStep / kTN apart.
      constexpr int kChunks = Cfg::kWidth / Cfg::kVec, kStep = kThreads / kChunks;
      static_assert(kThreads % kChunks == 0 && kStep % Cfg::kTN == 0, "a thread's rows stay kStep apart");
      const int r0 = threadIdx.x / kChunks, d = threadIdx.x % kChunks * Cfg::kVec;
      const int64_t left = rows - row0 - r0;  // rows of this thread's column left to copy
      const acc_t* src = at_row<acc_t>(base, s, b, h, row0 + r0) + d;
      acc_t* dst = tile + Cfg::permuted(r0) * Cfg::kLd + d;
#pragma unroll
      for (int it = 0; it < Cfg::kBN / kStep; ++it) {
        const bool valid = it * kStep < left && d < cols;
        cp_async16(dst + it * (kStep / Cfg::kTN) * Cfg::kLd, valid ? src : static_cast<const acc_t*>(base),
                   valid ? 16 : 0);
        src += kStep * s.row;
      }
      return;
    }
  }
  load_tile<scalar_t, Cfg, Cfg::kBN, true>(tile, base, s, b, h, row0, rows, cols, acc_t(1), rotary);
}

// acc[r][c] += sum_{k < n} A[ty kTM + r][k] * B[tx + 16 c][k]: A and B row-major tiles of stride
// kLd, n a multiple of kVec (the tiles are zero past their columns).
template <typename Cfg, typename acc_t>
__device__ __forceinline__ void gemm_nt(acc_t (&acc)[Cfg::kTM][Cfg::kTN], const acc_t* A, const acc_t* B, int n) {
  constexpr int kV = Cfg::kVec;
  const int ty = grid_row(), tx = grid_col();
  const acc_t* a_rows = A + ty * Cfg::kTM * Cfg::kLd;
  const acc_t* b_rows = B + tx * Cfg::kLd;
#pragma unroll 2
  for (int k = 0; k < n; k += kV) {
    acc_t a[Cfg::kTM][kV], bv[Cfg::kTN][kV];
#pragma unroll
    for (int r = 0; r < Cfg::kTM; ++r) load_vec<kV>(a_rows + r * Cfg::kLd + k, a[r]);
#pragma unroll
    for (int c = 0; c < Cfg::kTN; ++c) load_vec<kV>(b_rows + c * kThreadGrid * Cfg::kLd + k, bv[c]);
#pragma unroll
    for (int e = 0; e < kV; ++e)
#pragma unroll
      for (int r = 0; r < Cfg::kTM; ++r)
#pragma unroll
        for (int c = 0; c < Cfg::kTN; ++c) acc[r][c] = fma(a[r][e], bv[c][e], acc[r][c]);
  }
}

// acc[r][c] += sum_{k < kK} At[k][ty kRows + r] * B[k][out_col(tx, c)]: At a weight tile of stride
// kLdA whose rows are the product's k, B a row-major tile of stride kLd.
template <typename Cfg, int kRows, int kK, int kLdA, typename acc_t>
__device__ __forceinline__ void gemm_nn(acc_t (&acc)[kRows][Cfg::kOutCols], const acc_t* At, const acc_t* B) {
  constexpr int kV = Cfg::kVec, kChunks = Cfg::kOutCols / kV;
  const int ty = grid_row(), tx = grid_col();
  const acc_t* a_col = At + ty * kRows;
  const acc_t* b_col = B + tx * kV;
#pragma unroll 4
  for (int k = 0; k < kK; ++k) {
    acc_t a[kRows], bv[kChunks][kV];
    load_vec<kRows>(a_col + k * kLdA, a);
#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch) load_vec<kV>(b_col + k * Cfg::kLd + ch * kThreadGrid * kV, bv[ch]);
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int ch = 0; ch < kChunks; ++ch)
#pragma unroll
        for (int e = 0; e < kV; ++e) acc[r][ch * kV + e] = fma(a[r], bv[ch][e], acc[r][ch * kV + e]);
  }
}

// acc[r][c] += sum_{k < kK} A[ty kRows + r][k] * B[k][out_col(tx, c)]: A a tile of stride kLdA
// whose rows are the product's rows (a weight tile, read across), B a row-major tile of stride kLd.
template <typename Cfg, int kRows, int kK, int kLdA, typename acc_t>
__device__ __forceinline__ void gemm_rows(acc_t (&acc)[kRows][Cfg::kOutCols], const acc_t* A, const acc_t* B) {
  constexpr int kV = Cfg::kVec, kChunks = Cfg::kOutCols / kV;
  const int ty = grid_row(), tx = grid_col();
  const acc_t* a_rows = A + ty * kRows * kLdA;
  const acc_t* b_col = B + tx * kV;
#pragma unroll 2
  for (int k = 0; k < kK; k += kV) {
    acc_t a[kRows][kV];
#pragma unroll
    for (int r = 0; r < kRows; ++r) load_vec<kV>(a_rows + r * kLdA + k, a[r]);
#pragma unroll
    for (int e = 0; e < kV; ++e) {
      acc_t bv[kChunks][kV];
#pragma unroll
      for (int ch = 0; ch < kChunks; ++ch) load_vec<kV>(b_col + (k + e) * Cfg::kLd + ch * kThreadGrid * kV, bv[ch]);
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int ch = 0; ch < kChunks; ++ch)
#pragma unroll
          for (int x = 0; x < kV; ++x) acc[r][ch * kV + x] = fma(a[r][e], bv[ch][x], acc[r][ch * kV + x]);
    }
  }
}

// Column c of a thread's micro-tile (kRows consecutive rows) into a weight tile of stride kLdA:
// At[physical row tx + 16 c][ty kRows + r] = x[r][c].
template <int kRows, int kCols, int kLdA, typename acc_t>
__device__ __forceinline__ void store_weights(acc_t* At, const acc_t (&x)[kRows][kCols]) {
  const int ty = grid_row(), tx = grid_col();
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    acc_t column[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) column[r] = x[r][c];
    store_vec<kRows>(At + (tx + kThreadGrid * c) * kLdA + ty * kRows, column);
  }
}

template <typename Cfg, int kRows, typename acc_t>
__device__ __forceinline__ void clear(acc_t (&acc)[kRows][Cfg::kOutCols]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < Cfg::kOutCols; ++c) acc[r][c] = 0;
}

// A thread's head-dim accumulators into a contiguous (rows, cols) output: row_of(r) is the output
// row of accumulator row r (negative: not written), value(r, c) the value of accumulator (r, c).
template <typename Cfg, int kRows, typename scalar_t, typename RowOf, typename Value>
__device__ __forceinline__ void store_rows(scalar_t* out, int cols, RowOf row_of, Value value) {
  const int tx = grid_col();
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row_of(r);
    if (row < 0) continue;
#pragma unroll
    for (int c = 0; c < Cfg::kOutCols; ++c) {
      const int d = Cfg::out_col(tx, c);
      if (d < cols) out[row * cols + d] = static_cast<scalar_t>(value(r, c));
    }
  }
}

}  // namespace rudnn::cuda
