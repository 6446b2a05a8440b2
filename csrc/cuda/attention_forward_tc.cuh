// Forward on the tensor cores (float16/bfloat16, mma.sync m16n8k16): a block of four warps owns
// kBM query rows of one head, each warp 16 kMI of them; key/value tiles of kBN rows stream
// through shared memory by cp.async, K of the next tile loading while this tile's softmax and
// P V run. Scores, probabilities and the output stay in registers: the score fragments, rounded
// to 16 bits, are the A operand of P V (mma.cuh). A mask comes in as a float tile per key tile
// (tensor_core.cuh), dropout as keep bits drawn once per Philox block. launch_forward_tc is
// instantiated once per input dtype (attention_forward_tc_bf16.cu, attention_forward_tc_f16.cu),
// so that the two halves compile in parallel.
#pragma once

#include "launch.cuh"
#include "rotary.cuh"
#include "tensor_core.cuh"
#include "wgmma.cuh"

namespace rudnn::cuda {
namespace tc_forward {

// kWgmma: the products by wgmma (wgmma.cuh), the block's four warps one warp group of 64 rows, the
// tiles in swizzled panels (whole panels: head-dim buckets of 64, 128, 192 and 256). Up to E = 128
// its key tiles are 128 wide, so that Q K^T reads 64 rows of Q from shared memory per 128 keys (at
// 64 keys an m64n64k16 from shared memory reads as many bytes per cycle as the multiprocessor
// serves) and the softmax's row reductions and the barriers come half as often; kSplit's second
// fragments of P keep 64.
// kGroups = 2 is the fused-RoPE shape of more than one 64-row block by wgmma: two warp groups of 64
// rows share each K tile, so that it is turned once per 128 rows, and K is double-buffered, so
// that the next tile is turned while this one's P V products run. The fused-RoPE shape of one
// 64-row block by wgmma has a turner: a second warp group loads and turns the K tiles into two
// buffers while the first computes with the previous tile.
template <int kE, int kEv, bool kWgmma = false, bool kSplit = false, int kGroups = 1, bool kRotary = false>
struct ForwardShape {
  static_assert(kGroups == 1 || kWgmma, "warp groups are wgmma's");
  static constexpr bool kTurner = kRotary && kWgmma && kGroups == 1;
  static constexpr int kComputeThreads = kTcThreads * kGroups, kThreads = kComputeThreads + kTurner * kTcThreads;
  // 16-row fragments per warp: mma.sync reads each K/V fragment for two where the registers allow.
  static constexpr int kMI = kE <= 128 && !kWgmma ? 2 : 1;
  static constexpr int kBM = 16 * kMI * kTcWarps * kGroups, kBN = kWgmma && kE <= 128 && !kSplit ? 128 : 64;
  static constexpr int kNB = kBN / 8, kKBuffers = kGroups == 2 || kTurner ? 2 : 1;
  static constexpr int kLdK = kWgmma ? kE : tc_ld<kE>(), kLdV = kWgmma ? kEv : tc_ld<kEv>();
  using LayoutQ = std::conditional_t<kWgmma, SwizzledTile<kBM>, PaddedTile<kE>>;
  using LayoutK = std::conditional_t<kWgmma, SwizzledTile<kBN>, PaddedTile<kE>>;
  using LayoutV = std::conditional_t<kWgmma, SwizzledTile<kBN>, PaddedTile<kEv>>;
  static constexpr size_t kAlign = kWgmma ? kPanelAlign : 0;  // slack to align the panels
  static constexpr size_t kSmem =
      2 * (static_cast<size_t>(kBM + kKBuffers * kBN) * kLdK + static_cast<size_t>(kBN) * kLdV) + kAlign;
  static_assert(!kWgmma || (kE % 64 == 0 && kEv % 64 == 0), "wgmma tiles are whole 64-column panels");
  // RoPE: each K tile's table rows come by cp.async with the tile, where they fit beside two blocks
  // per multiprocessor; wider heads, and the wgmma kernels (128-key tiles), read them from global
  // memory as they turn the tile, prefetched into L1 a tile ahead.
  static constexpr bool kTableInSmem = kRotary && kE <= 128 && !kWgmma;
  static constexpr size_t kTableBytes = static_cast<size_t>(kBN) * kE * sizeof(float);
};

// RoPE's table pieces in flight per thread (rotary.cuh's kBatch): one, since more spill the
// accumulators beside them (bf16, E = 128, bytes spilled: four pieces 624, one 112).
constexpr int kTurnBatch = 1;

// Named barriers of the kernel with a turner: the computing group's own; the turner's; K buffer x
// turned (kKeysTurned + x) and free again (kKeysFree + x).
constexpr int kComputeBarrier = 1, kTurnerBarrier = 2, kKeysTurned = 3, kKeysFree = 5;

// Blocks per multiprocessor the kernel is compiled for. E = 192, Ev = 128: shared memory holds
// three, and the plain kernel fits their register share (168) without spilling; left free it took
// 189 registers, so two. The wgmma kernels (one warp group of 64 rows, 128 keys) fit three blocks'
// share at head dim 64 and two at 128 without spilling; with RoPE (two groups, or one and a
// turner), one.
constexpr int forward_min_blocks(int e, int ev, bool rotary, bool split, bool wgmma) {
  if (wgmma && rotary) return 1;
  if (wgmma && e <= 128) return e <= 64 ? 3 : 2;
  return e == 192 && ev == 128 && !rotary && !split ? 3 : 1;
}

// s = Q K^T for a warp's 16 kMI rows of the Q tile by the kNB 8-key blocks of the K tile.
template <typename scalar_t, int kMI, int kNB, int kE, int kLdK>
__device__ __forceinline__ void queries_times_keys(float (&s)[kMI][kNB][4], const scalar_t* sQ, const scalar_t* sK) {
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int ks = 0; ks < kE / 16; ++ks) {
    uint32_t a[kMI][4];
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi) load_a<kLdK>(a[mi], sQ, warp * 16 * kMI + 16 * mi, 16 * ks);
#pragma unroll
    for (int nb = 0; nb < kNB; nb += 2) {
      uint32_t bk[4];
      load_b<kLdK>(bk, sK, 8 * nb, 16 * ks);
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi) {
        mma16816<scalar_t>(s[mi][nb], a[mi], bk[0], bk[1]);
        mma16816<scalar_t>(s[mi][nb + 1], a[mi], bk[2], bk[3]);
      }
    }
  }
}

// o += P V for a warp's 16 kMI rows, P rounded to 16 bits; with kSplit also (P - round(P)) V.
template <typename scalar_t, int kMI, int kNB, int kEv, int kLdV, bool kSplit>
__device__ __forceinline__ void probabilities_times_v(float (&o)[kMI][kEv / 8][4], const float (&s)[kMI][kNB][4],
                                                      const scalar_t* sV) {
#pragma unroll
  for (int kk = 0; kk < kNB / 2; ++kk) {
    uint32_t a[kMI][4], a_low[kMI][4];
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi) {
      fragment_to_a<scalar_t>(a[mi], s[mi], kk, false);
      if constexpr (kSplit) fragment_to_a<scalar_t>(a_low[mi], s[mi], kk, true);
    }
#pragma unroll
    for (int nv = 0; nv < kEv / 16; ++nv) {
      uint32_t bv[4];
      load_b_trans<kLdV>(bv, sV, 16 * nv, 16 * kk);
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi) {
        mma16816<scalar_t>(o[mi][2 * nv], a[mi], bv[0], bv[1]);
        mma16816<scalar_t>(o[mi][2 * nv + 1], a[mi], bv[2], bv[3]);
        if constexpr (kSplit) {
          mma16816<scalar_t>(o[mi][2 * nv], a_low[mi], bv[0], bv[1]);
          mma16816<scalar_t>(o[mi][2 * nv + 1], a_low[mi], bv[2], bv[3]);
        }
      }
    }
  }
}

// K tile j of head (b, hk) by cp.async, by threads kFirst .. kFirst + kLoaders - 1, with its RoPE
// table rows: into shared memory where Shape keeps them there, else prefetched into L1 for the turn.
template <typename scalar_t, int kE, typename Shape, bool kRotary, int kLoaders, int kFirst = 0>
__device__ __forceinline__ void load_key_tile(const AttentionParams& p, const InputReads& in, scalar_t* sK,
                                              float* sTable, int64_t b, int64_t hk, int64_t j, int64_t end) {
  const int E = static_cast<int>(p.head_dim);
  tile_to_smem_async<scalar_t, Shape::kBN, kE, kLoaders, typename Shape::LayoutK, kFirst>(sK, p.k, p.k_strides, b, hk,
                                                                                         j, end, E, in.k);
  if constexpr (Shape::kTableInSmem) {
    table_to_smem_async<Shape::kBN, kLoaders, kFirst>(sTable, p.k_rotary, b, hk, j, end, E);
  } else if constexpr (kRotary) {
    prefetch_table_rows<Shape::kBN, kLoaders, kFirst>(p.k_rotary, b, hk, j, end, E);
  }
}

// The turner group's work: K tiles [begin, end) of head (b, hk), each loaded into buffer
// tile % 2 once the computing group is done with the tile two before, turned, and published
// (kKeysTurned); the next tile loads while this one is turned.
template <typename scalar_t, int kE, typename Shape>
__device__ __forceinline__ void turn_key_tiles(const AttentionParams& p, const InputReads& in, scalar_t* sK,
                                               int64_t b, int64_t hk, int64_t begin, int64_t end) {
  constexpr int kBN = Shape::kBN, kFirst = Shape::kComputeThreads;
  using LayoutK = typename Shape::LayoutK;
  const int E = static_cast<int>(p.head_dim);
  const auto buffer = [&](int64_t tile) { return sK + (tile % 2) * kBN * Shape::kLdK; };
  const auto load = [&](int64_t tile, int64_t j) {
    load_key_tile<scalar_t, kE, Shape, true, kTcThreads, kFirst>(p, in, buffer(tile), nullptr, b, hk, j, end);
  };
  if (begin < end) load(0, begin);
  cp_async_commit();
  for (int64_t j = begin, tile = 0; j < end; j += kBN, ++tile) {
    if (j + kBN < end) {
      if (tile >= 1) barrier_sync(kKeysFree + (tile + 1) % 2, Shape::kThreads);
      load(tile + 1, j + kBN);
    }
    cp_async_commit();
    cp_async_wait<1>();
    barrier_sync(kTurnerBarrier, kTcThreads);  // every turner thread's part of this tile has landed
    rotate_tile_global<scalar_t, kBN, kTcThreads, LayoutK, kTurnBatch, kFirst>(buffer(tile), p.k_rotary, b, hk, j, end,
                                                                              E);
    fence_async_shared();  // the turned tile, for the tensor cores
    barrier_arrive(kKeysTurned + tile % 2, Shape::kThreads);
  }
  cp_async_wait<0>();
}

// kRotary: RoPE fused (p.rotary()); kSplit: "exact" numerics (P V's split products). Template
// flags, so that the kernels without them keep their registers for the fragments (the code of
// either alone made the E = 128 kernel spill). kWgmma, kGroups: ForwardShape's; RoPE by wgmma on one
// group has a turner.
template <typename scalar_t, int kE, int kEv, bool kRotary, bool kSplit, bool kWgmma, int kGroups>
__global__ void __launch_bounds__(ForwardShape<kE, kEv, kWgmma, kSplit, kGroups, kRotary>::kThreads,
                                  forward_min_blocks(kE, kEv, kRotary, kSplit, kWgmma))
    attention_forward_tc_kernel(const AttentionParams p, scalar_t* __restrict__ out, float* __restrict__ lse,
                                const bool* __restrict__ kv_finite) {
  using Shape = ForwardShape<kE, kEv, kWgmma, kSplit, kGroups, kRotary>;
  constexpr bool kTurner = Shape::kTurner;
  using LayoutQ = typename Shape::LayoutQ;
  using LayoutK = typename Shape::LayoutK;
  using LayoutV = typename Shape::LayoutV;
  constexpr int kMI = Shape::kMI, kBM = Shape::kBM, kBN = Shape::kBN, kNB = Shape::kNB;
  constexpr int kThreads = Shape::kComputeThreads, kLdK = Shape::kLdK, kLdV = Shape::kLdV;
  // RoPE's two groups: the next K tile lands in the other buffer and is turned during this one.
  constexpr bool kAhead = kRotary && kGroups == 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = threadIdx.x / kTcThreads;
  const int64_t b = blockIdx.z, h = blockIdx.y;
  // Causal blocks run from the longest rows down, so that the last wave is of short ones.
  const int64_t i0 = static_cast<int64_t>(p.is_causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * kBM;
  const int64_t hk = h / p.group(), row0 = i0 + warp * 16 * kMI;
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);
  const InputReads in = input_reads<scalar_t>(p);

  extern __shared__ __align__(16) unsigned char smem_base[];
  unsigned char* smem = smem_base;
  if constexpr (kWgmma) smem = align_panels(smem_base);
  scalar_t* sQ = reinterpret_cast<scalar_t*>(smem);
  const auto sK = [=](int buf) { return sQ + kBM * kLdK + buf * kBN * kLdK; };
  scalar_t* sV = sK(Shape::kKBuffers);
  unsigned char* sMask = reinterpret_cast<unsigned char*>(sV + kBN * kLdV);
  float* sTable = reinterpret_cast<float*>(sMask + mask_tile_bytes<scalar_t, kBM, kBN>(p.mask_kind));
  constexpr bool kTableInSmem = Shape::kTableInSmem;

  // Tiles past the causal frontier are skipped unless K or V holds a non-finite value.
  const RowRange keys = visible_keys(p, kv_finite, b, hk, i0, kBM, kBN);
  const int64_t key_end = keys.end;
  if constexpr (kTurner) {
    if (wg == kGroups) return turn_key_tiles<scalar_t, kE, Shape>(p, in, sK(0), b, hk, keys.begin, key_end);
  }
  // The block's barrier, but for the turner's threads.
  const auto sync_compute = [&] {
    if constexpr (kTurner) {
      barrier_sync(kComputeBarrier, kThreads);
    } else {
      __syncthreads();
    }
  };
  tile_to_smem_async<scalar_t, kBM, kE, kThreads, LayoutQ>(sQ, p.q, p.q_strides, b, h, i0, p.queries, E, in.q);
  if constexpr (kRotary) cp_async_commit();  // Q alone, turned below while the first K tile loads
  const auto load_keys = [&](int buf, int64_t j) {
    load_key_tile<scalar_t, kE, Shape, kRotary, kThreads>(p, in, sK(buf), sTable, b, hk, j, key_end);
  };
  if constexpr (!kTurner) load_keys(0, keys.begin);
  cp_async_commit();

  // m: running maximum of a row; l: this lane's part of its running denominator.
  float o[kMI][kEv / 8][4] = {}, m[kMI][2], l[kMI][2] = {};
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi) m[mi][0] = m[mi][1] = -INFINITY;
  const DropoutRng rng = device_rng(p);
  if constexpr (kRotary) {  // RoPE: Q once, before the loop, where no fragment of P is live
    cp_async_wait<1>();
    sync_compute();
    rotate_tile_global<scalar_t, kBM, kThreads, LayoutQ, kTurnBatch>(sQ, p.q_rotary, b, h, i0, p.queries, E);
  }

  // Keep bits per 64 keys, four bits per 8-key block in a word. By wgmma the first key tile's are
  // drawn before the loop and each next tile's while this one's P V products run; by mma.sync,
  // whose products keep the warp busy, each tile's after its scores.
  uint32_t keep[kNB / 8][kMI];
  const auto draw_keep = [&](int64_t j) {  // writes every word, so that none is carried across tiles by mma.sync
#pragma unroll
    for (int half = 0; half < kNB / 8; ++half) {
      if (p.has_dropout && j < key_end) {
        fragment_keep_bits<kMI, 8>(p, rng, keep[half], b, h, row0, j + 64 * half, in.dropout_aligned);
      } else {
#pragma unroll
        for (int mi = 0; mi < kMI; ++mi) keep[half][mi] = 0;
      }
    }
  };
  if constexpr (kWgmma) draw_keep(keys.begin);
  const int64_t tiles = (key_end - keys.begin + kBN - 1) / kBN;
  for (int64_t j0 = keys.begin, tile = 0; j0 < key_end; j0 += kBN, ++tile) {
    const int buf = static_cast<int>(tile % Shape::kKBuffers);
    sync_compute();  // every warp is done with the previous V and mask tile (and K buffer)
    if (in.masked) {
      mask_tile_to_smem<scalar_t, kBM, kBN, kThreads>(p, sMask, b, h, i0, j0, in.mask_async);
      cp_async_commit();
    }
    tile_to_smem_async<scalar_t, kBN, kEv, kThreads, LayoutV>(sV, p.v, p.v_strides, b, hk, j0, key_end, Ev, in.v);
    cp_async_commit();
    if constexpr (kAhead) {
      if (j0 + kBN < key_end) load_keys(buf ^ 1, j0 + kBN);
      cp_async_commit();
    }
    // Q (without RoPE, waited for above with it), this K (but the turner's) and this mask tile; V
    // (and the next K) may still be landing.
    cp_async_wait<kAhead ? 2 : 1>();
    if constexpr (kWgmma) fence_async_shared();
    sync_compute();
    if constexpr (kTurner) {
      barrier_sync(kKeysTurned + buf, Shape::kThreads);
    } else if constexpr (kRotary) {  // RoPE: each K tile as it lands, where not turned ahead
      if (!kAhead || tile == 0) {
        if constexpr (kTableInSmem) {
          rotate_tile_smem<scalar_t, kBN, kThreads, LayoutK, kTurnBatch>(sK(buf), sTable, p.k_rotary.interleaved, j0,
                                                                         key_end, E);
        } else {
          rotate_tile_global<scalar_t, kBN, kThreads, LayoutK, kTurnBatch>(sK(buf), p.k_rotary, b, hk, j0, key_end,
                                                                           E);
        }
        if constexpr (kWgmma) fence_async_shared();  // the turned tile, for the tensor cores
        __syncthreads();
      }
    }

    float s[kMI][kNB][4] = {};
    if constexpr (kWgmma) {
      wgmma_scores<scalar_t, kBM, kBN, kE>(s[0], sQ + LayoutQ::offset(64 * wg, 0), sK(buf));
    } else {
      queries_times_keys<scalar_t, kMI, kNB, kE, kLdK>(s, sQ, sK(buf));
    }
    if constexpr (kTurner) {
      if (tile + 2 < tiles) barrier_arrive(kKeysFree + buf, Shape::kThreads);  // the turner's next tile here
    } else if constexpr (!kAhead) {
      __syncthreads();  // every warp is done with this K
      if (j0 + kBN < key_end) load_keys(0, j0 + kBN);
      cp_async_commit();
    }

    fragment_scores(p, s, b, row0, j0, tile_on_edge(p, b, row0, 16 * kMI, j0, kBN));
    if (in.masked) fragment_add_mask<scalar_t, kMI, kNB, kBN>(p, s, sMask, warp * 16 * kMI, 0);
    if constexpr (!kWgmma) draw_keep(j0);
    // m' = max(m, max_j s_ij);  l' = l 2^(m - m') + sum_j P_ij;  o' = o 2^(m - m') + (P∘M) V
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float row_max = -INFINITY;
#pragma unroll
        for (int nb = 0; nb < kNB; ++nb) row_max = max_nan(row_max, max_nan(s[mi][nb][2 * r], s[mi][nb][2 * r + 1]));
        const float m_next = max_nan(m[mi][r], max4(row_max));
        const float m_safe = m_next == -INFINITY ? 0.0f : m_next;  // no key yet: keep P finite
        const float rescale = exp2_ftz(m[mi][r] - m_safe);
        m[mi][r] = m_next;
        float sum = 0;
#pragma unroll
        for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            s[mi][nb][e] = exp2_ftz(s[mi][nb][e] - m_safe);
            sum += s[mi][nb][e];
            if (p.has_dropout && !((keep[nb / 8][mi] >> (4 * (nb % 8) + e)) & 1)) s[mi][nb][e] = 0.0f;
          }
        }
        l[mi][r] = l[mi][r] * rescale + sum;
#pragma unroll
        for (int c = 0; c < kEv / 8; ++c) o[mi][c][2 * r] *= rescale, o[mi][c][2 * r + 1] *= rescale;
      }
    }

    cp_async_wait<kTurner ? 0 : 1>();  // this V (the last group the turner's block commits)
    if constexpr (kWgmma) fence_async_shared();
    sync_compute();
    // Zero weights still multiply V: NaN/inf in V reach the row, as in PyTorch's math path.
    // "exact" adds the product of P's rounding error, so that P reaches V at float32 accuracy.
    if constexpr (kWgmma) {
      wgmma_fragments_times_tile<scalar_t, kBN, kEv, kSplit>(o[0], s[0], sV, [&] {
        draw_keep(j0 + kBN);
        if constexpr (kAhead) {  // the next K tile, published by the next step's fence and barrier
          if (j0 + kBN < key_end) {
            cp_async_wait<0>();
            __syncthreads();  // every thread's part of it has landed
            rotate_tile_global<scalar_t, kBN, kThreads, LayoutK, kTurnBatch>(sK(buf ^ 1), p.k_rotary, b, hk, j0 + kBN,
                                                                             key_end, E);
          }
        }
      });
    } else {
      probabilities_times_v<scalar_t, kMI, kNB, kEv, kLdV, kSplit>(o, s, sV);
    }
  }
  cp_async_wait<0>();

  // o_i = acc_i / l_i (a row with no keys keeps acc: zeros, or NaN from V);  lse_i = m_i + log l_i
  const int t = lane % 4;
  const float kept = p.has_dropout ? static_cast<float>(p.rng.keep_scale) : 1.0f;
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = row0 + 16 * mi + lane / 4 + 8 * r;
      const float total = sum4(l[mi][r]);
      if (i >= p.queries) continue;
      const float m_safe = m[mi][r] == -INFINITY ? 0.0f : m[mi][r];
      if (t == 0) lse[(b * p.heads + h) * p.queries + i] = m_safe / kTcUnit + logf(total);
      const float denominator = total > 0 ? total : 1.0f;
      const float factor = kSplit ? kept / denominator : kept * (1.0f / denominator);
      scalar_t* row = out + ((b * p.heads + h) * p.queries + i) * Ev;
#pragma unroll
      for (int c = 0; c < kEv / 8; ++c) {
        store_pair(row, 8 * c + 2 * t, Ev, o[mi][c][2 * r] * factor, o[mi][c][2 * r + 1] * factor);
      }
    }
  }
}

}  // namespace tc_forward

template <typename scalar_t>
void launch_forward_tc(const AttentionParams& p, bool wgmma, scalar_t* out, float* lse, const bool* kv_finite) {
  using namespace tc_forward;
  dispatch_tc_dims(p.head_dim, p.value_dim, [&](auto e, auto ev) {
    dispatch_flag(p.rotary(), [&](auto rotary) {
      dispatch_flag(p.numerics == Numerics::kExact, [&](auto split) {
        constexpr int kE = decltype(e)::value, kEv = decltype(ev)::value;
        constexpr bool kRotary = decltype(rotary)::value, kSplit = decltype(split)::value;
        const auto launch = [&](auto with_wgmma, auto groups) {
          constexpr bool kWgmma = decltype(with_wgmma)::value;
          constexpr int kGroups = decltype(groups)::value;
          using Shape = ForwardShape<kE, kEv, kWgmma, kSplit, kGroups, kRotary>;
          launch_threads(attention_forward_tc_kernel<scalar_t, kE, kEv, kRotary, kSplit, kWgmma, kGroups>,
                         tile_grid(p.queries, Shape::kBM, p.heads, p.batch), Shape::kThreads,
                         Shape::kSmem + mask_tile_bytes<scalar_t, Shape::kBM, Shape::kBN>(p.mask_kind) +
                             (Shape::kTableInSmem ? Shape::kTableBytes : 0),
                         p, out, lse, kv_finite);
        };
        using One = std::integral_constant<int, 1>;
#ifdef RUDNN_WGMMA
        if constexpr (kE % 64 == 0 && kEv % 64 == 0) {
          if constexpr (kRotary && kE <= 128 && kEv <= 128) {  // RoPE past one block of 64 rows: two groups
            if (wgmma && p.queries > 64) return launch(std::true_type{}, std::integral_constant<int, 2>{});
          }
          if (wgmma) return launch(std::true_type{}, One{});
        }
#endif
        launch(std::false_type{}, One{});
      });
    });
  });
}

}  // namespace rudnn::cuda
