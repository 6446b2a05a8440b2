// Hopper warp-group products (sm_90a wgmma.mma_async) for the tensor-core kernels. A warp group is
// the block's four warps; warp w holds rows 16 w .. 16 w + 15 of the group's 64-row product in
// mma.cuh's C layout, so the score rules, the softmax and fragment_to_a of the mma.sync kernels
// apply to its fragments unchanged. Operands in shared memory are read by the tensor cores through
// matrix descriptors, without ldmatrix: tiles are stored in panels of 64 columns whose 128-byte
// rows have their 16-byte chunks permuted (the 128-byte swizzle of wgmma's canonical layouts).
// Compiled only where the build targets sm_90a (RUDNN_WGMMA); the host launches these products
// only there.
#pragma once

#include "tensor_core.cuh"

namespace rudnn::cuda {

// Element offset of (r, c) in a tile of kRows rows by 16-bit columns, panel by panel: panel c / 64
// holds every row's 64 columns, chunk (c / 8) % 8 of row r at chunk position ((c / 8) % 8) ^ (r % 8).
// Panels start 1024-byte aligned when the tile does (kRows a multiple of 8).
template <int kRows>
struct SwizzledTile {
  __device__ static constexpr int offset(int r, int c) {
    return c / 64 * (kRows * 64) + r * 64 + ((c / 8 % 8) ^ (r % 8)) * 8 + c % 8;
  }
};

// The first 1024-byte boundary at or after a kernel's dynamic shared memory, where its swizzled
// tiles start (their launches ask for kPanelAlign bytes of slack).
constexpr size_t kPanelAlign = 1024;
__device__ __forceinline__ unsigned char* align_panels(unsigned char* smem) {
  return smem + (kPanelAlign - smem_address(smem) % kPanelAlign) % kPanelAlign;
}

// Descriptor of a 128-byte-swizzled operand starting at `start`: `leading` bytes between panels
// where the operand's 64-column panels run along M/N (V, read transposed), `stride` between groups
// of 8 rows.
__device__ __forceinline__ uint64_t wgmma_descriptor(const void* start, uint32_t leading, uint32_t stride) {
  return (uint64_t{smem_address(start)} & 0x3FFFF) >> 4 | uint64_t{leading >> 4} << 16 |
         uint64_t{stride >> 4} << 32 | uint64_t{1} << 62;
}

// Shared-memory writes by the threads (cp.async included) become visible to the tensor cores'
// asynchronous reads only through this fence, before the barrier that publishes them.
__device__ __forceinline__ void fence_async_shared() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Named barriers between warp groups of one block (0 is __syncthreads'): `threads` of the block
// arrive, and those that sync wait until all have. An arrival publishes the arriving thread's
// earlier shared-memory writes to the threads that sync.
__device__ __forceinline__ void barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Keeps the compiler from moving reads and writes of x across the asynchronous products: float
// accumulators, or uint32_t A fragments, which the products read until they are waited for.
template <typename T, int N>
__device__ __forceinline__ void fence_fragments(T (&x)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (std::is_same_v<T, float>) {
        asm volatile("" : "+f"(x[i][e])::"memory");
      } else {
        asm volatile("" : "+r"(x[i][e])::"memory");
      }
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The accumulators of one instruction: 8 (n64) or 16 (n128) 8-column blocks of 4 floats per
// thread, as asm operands and as the instruction's register list.
#define RUDNN_WGMMA_D8 \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), \
  "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
  "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
  "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
  "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define RUDNN_WGMMA_D16 \
  RUDNN_WGMMA_D8, "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), \
  "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), \
  "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), \
  "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), \
  "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
#define RUDNN_WGMMA_R8 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21," \
  " %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define RUDNN_WGMMA_R16 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21," \
  " %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41," \
  " %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61," \
  " %62, %63}"
// D (+)= A B with the accumulate predicate taken from operand `scale` (always 1 here: the callers
// zero their accumulators); `operands`: A, B, scale-d and the immediates (scale-a, scale-b, then
// transposes).
#define RUDNN_WGMMA_ASM(shape, type, regs, scale, operands) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" #scale ", 0;\nwgmma.mma_async.sync.aligned." shape ".f32." type "." type \
  " " regs ", " operands ";\n}\n"

// Q K^T: A and B in shared memory, both K-major.
template <typename scalar_t>
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    asm volatile(RUDNN_WGMMA_ASM("m64n64k16", "bf16", RUDNN_WGMMA_R8, 34, "%32, %33, p, 1, 1, 0, 0")
                 : RUDNN_WGMMA_D8
                 : "l"(desc_a), "l"(desc_b), "r"(1));
  } else {
    asm volatile(RUDNN_WGMMA_ASM("m64n64k16", "f16", RUDNN_WGMMA_R8, 34, "%32, %33, p, 1, 1, 0, 0")
                 : RUDNN_WGMMA_D8
                 : "l"(desc_a), "l"(desc_b), "r"(1));
  }
}
// Q K^T over 128 keys: both K-major.
#define RUDNN_WGMMA_SS_N128(type)                                                                     \
  asm volatile(RUDNN_WGMMA_ASM("m64n128k16", type, RUDNN_WGMMA_R16, 66, "%64, %65, p, 1, 1, 0, 0") \
               : RUDNN_WGMMA_D16                                                                   \
               : "l"(desc_a), "l"(desc_b), "r"(1))
template <typename scalar_t>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    RUDNN_WGMMA_SS_N128("bf16");
  } else {
    RUDNN_WGMMA_SS_N128("f16");
  }
}
// P V: A in registers (mma.cuh's A fragment), B in shared memory read transposed.
template <typename scalar_t>
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    asm volatile(RUDNN_WGMMA_ASM("m64n64k16", "bf16", RUDNN_WGMMA_R8, 37, "{%32, %33, %34, %35}, %36, p, 1, 1, 1")
                 : RUDNN_WGMMA_D8
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  } else {
    asm volatile(RUDNN_WGMMA_ASM("m64n64k16", "f16", RUDNN_WGMMA_R8, 37, "{%32, %33, %34, %35}, %36, p, 1, 1, 1")
                 : RUDNN_WGMMA_D8
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  }
}
template <typename scalar_t>
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    asm volatile(RUDNN_WGMMA_ASM("m64n128k16", "bf16", RUDNN_WGMMA_R16, 69, "{%64, %65, %66, %67}, %68, p, 1, 1, 1")
                 : RUDNN_WGMMA_D16
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  } else {
    asm volatile(RUDNN_WGMMA_ASM("m64n128k16", "f16", RUDNN_WGMMA_R16, 69, "{%64, %65, %66, %67}, %68, p, 1, 1, 1")
                 : RUDNN_WGMMA_D16
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  }
}
__device__ __forceinline__ void wgmma_begin() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// Waits for this warp group's products issued so far.
__device__ __forceinline__ void wgmma_end() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
#else
// Other targets: never launched (the host checks RUDNN_WGMMA and the device).
template <typename scalar_t, int N>
__device__ __forceinline__ void wgmma_ss_n64(float (&)[N][4], uint64_t, uint64_t) { __trap(); }
template <typename scalar_t>
__device__ __forceinline__ void wgmma_ss_n128(float (&)[16][4], uint64_t, uint64_t) { __trap(); }
template <typename scalar_t, int N>
__device__ __forceinline__ void wgmma_rs_n64(float (&)[N][4], const uint32_t (&)[4], uint64_t) { __trap(); }
template <typename scalar_t, int N>
__device__ __forceinline__ void wgmma_rs_n128(float (&)[N][4], const uint32_t (&)[4], uint64_t) { __trap(); }
__device__ __forceinline__ void wgmma_begin() {}
__device__ __forceinline__ void wgmma_end() {}
#endif

// d (this warp's 16 of 64 rows by kN columns) += A B^T over the depth kDepth, issued but not
// waited for; A (kRowsA rows) and B (kN rows) in swizzled tiles, both read along their rows. A
// 16-column step moves 32 bytes within a panel's swizzled rows.
template <typename scalar_t, int kRowsA, int kN, int kDepth>
__device__ __forceinline__ void wgmma_issue_nt(float (&d)[kN / 8][4], const scalar_t* sA, const scalar_t* sB) {
  static_assert(kN == 64 || kN == 128, "products of 64 or 128 columns");
#pragma unroll
  for (int ks = 0; ks < kDepth / 16; ++ks) {
    const uint64_t desc_a = wgmma_descriptor(sA + SwizzledTile<kRowsA>::offset(0, 16 * ks), 16, 1024);
    const uint64_t desc_b = wgmma_descriptor(sB + SwizzledTile<kN>::offset(0, 16 * ks), 16, 1024);
    if constexpr (kN == 128) {
      wgmma_ss_n128<scalar_t>(d, desc_a, desc_b);
    } else {
      wgmma_ss_n64<scalar_t>(d, desc_a, desc_b);
    }
  }
}

// o += X W for this warp's 16 rows, issued: X (16 columns, k in [16 kk, 16 kk + 16)) as an A
// fragment, W (kRowsW rows by the bucket kCols) a swizzled tile read transposed: its panels run
// along the product's columns, 128-column products where kCols allows.
template <typename scalar_t, int kRowsW, int kCols>
__device__ __forceinline__ void wgmma_issue_rs(float (&o)[kCols / 8][4], const uint32_t (&a)[4], int kk,
                                               const scalar_t* sW) {
  constexpr int kChunk = kCols % 128 == 0 ? 128 : 64;
  constexpr uint32_t kPanelBytes = kRowsW * 128;
#pragma unroll
  for (int c = 0; c < kCols / kChunk; ++c) {
    const uint64_t desc = wgmma_descriptor(sW + SwizzledTile<kRowsW>::offset(16 * kk, kChunk * c), kPanelBytes, 1024);
    auto& chunk = *reinterpret_cast<float(*)[kChunk / 8][4]>(&o[kChunk / 8 * c]);
    if constexpr (kChunk == 128) {
      wgmma_rs_n128<scalar_t>(chunk, a, desc);
    } else {
      wgmma_rs_n64<scalar_t>(chunk, a, desc);
    }
  }
}

// s (this warp's 16 of 64 rows by kN keys) = Q K^T over the bucket kE; Q (kRowsQ rows) and K (kN
// rows) in swizzled tiles.
template <typename scalar_t, int kRowsQ, int kN, int kE>
__device__ __forceinline__ void wgmma_scores(float (&s)[kN / 8][4], const scalar_t* sQ, const scalar_t* sK) {
#pragma unroll
  for (int c = 0; c < kN / 8; ++c) s[c][0] = s[c][1] = s[c][2] = s[c][3] = 0.0f;
  fence_fragments(s);
  wgmma_begin();
  wgmma_issue_nt<scalar_t, kRowsQ, kN, kE>(s, sQ, sK);
  wgmma_end();
  fence_fragments(s);
}

// The backward's two score products of 64-row tiles, issued together: s = A B^T over kDepth and,
// kSecond, d = C D^T over kDepth2 (S and dP, or S^T and dP^T).
template <typename scalar_t, int kDepth, int kDepth2, bool kSecond>
__device__ __forceinline__ void wgmma_score_pair(float (&s)[8][4], const scalar_t* sA, const scalar_t* sB,
                                                 float (&d)[8][4], const scalar_t* sC, const scalar_t* sD) {
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    s[c][0] = s[c][1] = s[c][2] = s[c][3] = 0.0f;
    d[c][0] = d[c][1] = d[c][2] = d[c][3] = 0.0f;
  }
  fence_fragments(s);
  fence_fragments(d);
  wgmma_begin();
  wgmma_issue_nt<scalar_t, 64, 64, kDepth>(s, sA, sB);
  if constexpr (kSecond) wgmma_issue_nt<scalar_t, 64, 64, kDepth2>(d, sC, sD);
  wgmma_end();
  fence_fragments(s);
  fence_fragments(d);
}

// o += X W for this warp's 16 rows, X (kN columns: P, or dS) rounded to 16 bits; with kSplit also
// (X - round(X)) W. W: a swizzled tile of kN rows by the bucket kCols (V, or K). `during` runs
// while the products are in flight (the next tile's dropout bits: Philox on the integer units
// beside the tensor cores); it must not write what they read.
template <typename scalar_t, int kN, int kCols, bool kSplit, typename During>
__device__ __forceinline__ void wgmma_fragments_times_tile(float (&o)[kCols / 8][4], const float (&s)[kN / 8][4],
                                                           const scalar_t* sW, During&& during) {
  constexpr int kParts = kSplit ? 2 : 1;
  // The fragments the products read are written before the fence that orders them for the tensor
  // cores, and kept until the products are waited for: fenced on both sides.
  uint32_t a[kN / 16][kParts][4];
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk)
#pragma unroll
    for (int part = 0; part < kParts; ++part) fragment_to_a<scalar_t>(a[kk][part], s, kk, part == 1);
  fence_fragments(o);
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) fence_fragments(a[kk]);
  wgmma_begin();
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk)
#pragma unroll
    for (int part = 0; part < kParts; ++part) wgmma_issue_rs<scalar_t, kN, kCols>(o, a[kk][part], kk, sW);
  during();
  wgmma_end();
  fence_fragments(o);
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) fence_fragments(a[kk]);
}

}  // namespace rudnn::cuda
