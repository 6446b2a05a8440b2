// Backward on CUDA cores, deterministic by default: a query-owned kernel computes dQ (and D where
// it must be formed from P and dP), a key/value-owned kernel dK and dV over every query head of
// its GQA group. Every output element has one writer, which sums in a fixed order. Where the key
// tiles of a head fit on the GPU at once (no causality or documents), the key/value-owned kernel
// adds dQ itself, each query tile's parts in a fixed order (per band of key tiles, the bands'
// sums added by ATen), and the query-owned kernel runs only where it forms D; with
// deterministic=False it adds dQ with float atomics, in any order.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../kernel_choice.h"
#include "../kernels.h"
#include "backward.cuh"
#include "launch.cuh"

namespace rudnn::cuda {
namespace {

// How the query-owned kernel runs. form_delta: a first sweep over the keys forms D;
// cache_tiles > 0: that sweep keeps each key tile's P and dP∘M in shared memory (the row's keys
// fit), so the second sweep reads them instead of recomputing both products; write_dq: false
// stops after the first sweep.
struct DqMode {
  bool form_delta;
  int cache_tiles;
  bool write_dq;
};

// Query-owned: kBM rows of head (b, h) against every key tile of its key/value head.
//   D_i = sum_j P_ij dP_ij   (first sweep, when formed here)
//   dS_ij = P_ij (dP_ij - D_i);  dQ_i = scale * sum_j dS_ij K_j
template <typename scalar_t, typename Cfg, typename acc_t = typename Compute<scalar_t>::type>
__global__ void __launch_bounds__(kThreads, Cfg::kMinBlocks)
    attention_dq_kernel(const AttentionParams p, const BackwardArgs<acc_t> a, const DqMode mode,
                        scalar_t* __restrict__ dq) {
  constexpr int kTM = Cfg::kTM, kTN = Cfg::kTN, kBM = Cfg::kBM, kBN = Cfg::kBN, kLd = Cfg::kLd;
  constexpr int kSlots = kTM * kTN * kThreads;  // one value per element of the score tile
  const int ty = grid_row(), tx = grid_col();
  const int64_t b = blockIdx.z, h = blockIdx.y, i0 = static_cast<int64_t>(blockIdx.x) * kBM;
  const int64_t hk = h / p.group();
  const bool flash = p.numerics == Numerics::kFlash;
  const acc_t unit = static_cast<acc_t>(p.score_unit());
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);

  extern __shared__ __align__(16) unsigned char smem[];
  acc_t* sQ = reinterpret_cast<acc_t*>(smem);  // kBM x kLd: Q times unit * scale
  acc_t* sDO = sQ + kBM * kLd;                   // kBM x kLd
  acc_t* sK = sDO + kBM * kLd;                   // 2 buffers of kBN x kLd, rows permuted
  acc_t* sV = sK + 2 * kBN * kLd;                // kBN x kLd, rows permuted
  acc_t* sDS = sV + kBN * kLd;                   // kBN x kLdWeights: dS^T
  acc_t* cache = sDS + kBN * Cfg::kLdWeights + threadIdx.x;  // per key tile: this thread's P, then dP∘M

  load_tile<scalar_t, Cfg, kBM, false>(sQ, p.q, p.q_strides, b, h, i0, p.queries, E,
                                       static_cast<acc_t>(p.scale) * unit, p.q_rotary);
  load_tile<scalar_t, Cfg, kBM, false>(sDO, a.dout, a.dout_strides, b, h, i0, p.queries, Ev, acc_t(1));
  const int64_t rows = (b * p.heads + h) * p.queries;
  acc_t lse[kTM], delta[kTM], acc[kTM][Cfg::kOutCols];
#pragma unroll
  for (int r = 0; r < kTM; ++r) {
    const int64_t i = min(i0 + ty * kTM + r, p.queries - 1);
    lse[r] = a.lse_unit[rows + i];
    delta[r] = mode.form_delta ? acc_t(0) : a.delta[rows + i];
  }
  clear<Cfg>(acc);
  const DropoutRng rng = device_rng(p);
  const int64_t last_row = min(i0 + kBM, p.queries) - 1;
  const RowRange keys = document_keys(p, b, i0, kBM, kBN);
  const int64_t key_end = p.is_causal && a.kv_finite[b * p.kv_heads + hk]
                              ? min(keys.end, last_row + p.shard.query_start - p.shard.key_start + 1)
                              : keys.end;
  const bool k_async = streams_async<scalar_t, acc_t>(p.k, p.k_strides, E, p.k_rotary);
  const bool v_async = streams_async<scalar_t, acc_t>(p.v, p.v_strides, Ev);
  // K has two buffers: the next tile's copies in from the start of this one. V has one: the next
  // tile's copies in once this one's products have read it, while dS and dQ are formed.
  const auto stream_k = [&](int64_t j0, int buffer) {
    stream_tile<scalar_t, Cfg>(sK + buffer * kBN * kLd, p.k, p.k_strides, b, hk, j0, p.keys, E, k_async, p.k_rotary);
  };
  const auto stream_v = [&](int64_t j0) {
    stream_tile<scalar_t, Cfg>(sV, p.v, p.v_strides, b, hk, j0, p.keys, Ev, v_async);
  };

  for (int pass = mode.form_delta ? 0 : 1; pass < 2; ++pass) {
    const bool cached = pass == 1 && mode.cache_tiles > 0;
    __syncthreads();  // the previous sweep is done with the tiles
    if (keys.begin < key_end) {
      stream_k(keys.begin, 0);
      if (!cached) stream_v(keys.begin);
      cp_async_commit();
    }
    int tile = 0, buffer = 0;
    for (int64_t j0 = keys.begin; j0 < key_end; j0 += kBN, ++tile, buffer ^= 1) {
      const bool more = j0 + kBN < key_end;
      cp_async_wait<0>();
      __syncthreads();  // this tile's K and V have landed; every thread is done with the other K buffer and dS
      if (more) stream_k(j0 + kBN, buffer ^ 1);
      cp_async_commit();
      const acc_t* tK = sK + buffer * kBN * kLd;
      // P_ij = base^(s_ij - lse_i);  dP_ij = M_ij dO_i.v_j   (keys j = j0 + tx kTN + c)
      acc_t prob[kTM][kTN], dpm[kTM][kTN];
      acc_t* slot = cache + static_cast<int64_t>(tile) * 2 * kSlots;
      if (cached) {
#pragma unroll
        for (int x = 0; x < kTM * kTN; ++x) {
          prob[x / kTN][x % kTN] = slot[x * kThreads];
          dpm[x / kTN][x % kTN] = slot[kSlots + x * kThreads];
        }
      } else {
        query_tile_probabilities<scalar_t, Cfg>(p, rng, b, h, i0, j0, sQ, sDO, tK, sV, lse, prob, dpm);
        if (more) {
          __syncthreads();  // every thread is done with this V
          stream_v(j0 + kBN);
          cp_async_commit();
        }
      }
      if (pass == 0) {
#pragma unroll
        for (int x = 0; x < kTM * kTN; ++x) {
          delta[x / kTN] += prob[x / kTN][x % kTN] * dpm[x / kTN][x % kTN];
          if (mode.cache_tiles > 0) {
            slot[x * kThreads] = prob[x / kTN][x % kTN];
            slot[kSlots + x * kThreads] = dpm[x / kTN][x % kTN];
          }
        }
        continue;
      }
      // dS_ij = P_ij (dP_ij - D_i), rounded to the input dtype in flash numerics
#pragma unroll
      for (int r = 0; r < kTM; ++r)
#pragma unroll
        for (int c = 0; c < kTN; ++c) {
          const acc_t ds = prob[r][c] * (dpm[r][c] - delta[r]);
          prob[r][c] = flash ? round_to<scalar_t>(ds) : ds;
        }
      store_weights<kTM, kTN, Cfg::kLdWeights>(sDS, prob);
      __syncthreads();
      // dQ_i += sum_j dS_ij K_j
      gemm_nn<Cfg, kTM, kBN, Cfg::kLdWeights>(acc, sDS, tK);
    }
    if (pass == 0) {
#pragma unroll
      for (int r = 0; r < kTM; ++r) {
        const int64_t i = i0 + ty * kTM + r;
        delta[r] = sum16(delta[r]);
        if (a.grad_lse != nullptr && i < p.queries) delta[r] -= a.grad_lse[rows + i];
        if (tx == 0 && i < p.queries) a.delta[rows + i] = delta[r];
      }
      if (!mode.write_dq) return;
    }
  }
  store_rows<Cfg, kTM>(
      dq, E,
      [&](int r) {
        const int64_t i = i0 + ty * kTM + r;
        return i < p.queries ? rows + i : int64_t{-1};
      },
      [&](int r, int c) { return acc[r][c] * static_cast<acc_t>(p.scale); });
}

// Of the steps s' < s at which the key tiles of a head reach query tile t (key tile (t - s') mod
// `tiles`, where it is one of the `key_tiles`), how many have one: the parts added before step s's.
__device__ __forceinline__ int turns_before(uint32_t t, uint32_t s, uint32_t key_tiles, uint32_t tiles) {
  // #{x in [0, y) : x mod tiles < key_tiles}, over the unwrapped key tiles t - s + 1 .. t (+ tiles)
  const auto upto = [&](uint32_t y) { return y / tiles * key_tiles + min(y % tiles, key_tiles); };
  return static_cast<int>(upto(t + tiles + 1) - upto(t + tiles + 1 - s));
}

__device__ __forceinline__ int load_acquire(const int* flag) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
  return v;
}
__device__ __forceinline__ void store_release(int* flag, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flag), "r"(v) : "memory");
}

// The first (batch, key/value head) of a launch of the key/value-owned kernel: blockIdx.z and
// blockIdx.y count from it.
struct HeadOffset {
  int64_t batch, head;
};

// Key/value-owned: kBM keys of head (b, hk) against every query tile of every query head of the
// group; thread (ty, tx) holds keys ty kTM + r and queries tx kTN + c of each score tile.
//   dV_j = sum_{h, i} (P∘M)_ij dO_i;  dK_j = scale * sum_{h, i} dS_ij Q_i
// group_sums (flash numerics with GQA, (B, Hkv, S, E + Ev)): each query head's dK, dV rounded to
// the input dtype and summed over the group, as FlashAttention's expanded-then-summed gradients
// are; null otherwise. dq_sum ((bands, B, H, L, E), zeros): unit * dQ, added in place by every key
// tile; null where the query-owned kernel writes dQ.
// dq_turns ((bands, B, Hkv, query tiles), zeros): where not null, the key tiles of a head add their
// dQ parts in a fixed order, so that dQ is deterministic. The key tiles fall in bands of as many as
// there are query tiles, each band with its own sum; key tile x of a band takes the query tiles in
// turn from tile x on (all of them: no causality or documents), so that at each step the key tiles
// of a band add to distinct query tiles; a tile's counter says how many parts it holds, and a key
// tile waits for its own turn (turns_before). All the key tiles of a head must be resident at once
// (launch_backward's grid).
template <typename scalar_t, typename Cfg, typename acc_t = typename Compute<scalar_t>::type>
__global__ void __launch_bounds__(kThreads, Cfg::kMinBlocks)
    attention_dkdv_kernel(const AttentionParams p, const BackwardArgs<acc_t> a, const HeadOffset first,
                          scalar_t* __restrict__ dk, scalar_t* __restrict__ dv, acc_t* __restrict__ group_sums,
                          acc_t* __restrict__ dq_sum, int* __restrict__ dq_turns) {
  constexpr int kTM = Cfg::kTM, kTN = Cfg::kTN, kBM = Cfg::kBM, kBN = Cfg::kBN, kLd = Cfg::kLd;
  constexpr int kLdW = Cfg::kLdWeights;
  const int ty = grid_row(), tx = grid_col();
  const int64_t b = first.batch + blockIdx.z, hk = first.head + blockIdx.y, j0 = static_cast<int64_t>(blockIdx.x) * kBM;
  const bool flash = p.numerics == Numerics::kFlash;
  const acc_t unit = static_cast<acc_t>(p.score_unit()), scale = static_cast<acc_t>(p.scale);
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);

  extern __shared__ __align__(16) unsigned char smem[];
  acc_t* sK = reinterpret_cast<acc_t*>(smem);  // kBM x kLd: K times unit * scale
  acc_t* sV = sK + kBM * kLd;                    // kBM x kLd
  acc_t* sQ = sV + kBM * kLd;                    // kBN x kLd, rows permuted
  acc_t* sDO = sQ + kBN * kLd;                   // kBN x kLd, rows permuted
  acc_t* sPM = sDO + kBN * kLd;                  // kBN x kLdW: P∘M, query rows by keys
  acc_t* sDS = sPM + kBN * kLdW;                 // kBN x kLdW: dS
  acc_t* sLse = sDS + kBN * kLdW;                // kBN, at the permuted rows
  acc_t* sDelta = sLse + kBN;                    // kBN

  load_tile<scalar_t, Cfg, kBM, false>(sK, p.k, p.k_strides, b, hk, j0, p.keys, E, scale * unit, p.k_rotary);
  load_tile<scalar_t, Cfg, kBM, false>(sV, p.v, p.v_strides, b, hk, j0, p.keys, Ev, acc_t(1));
  acc_t acc_k[kTM][Cfg::kOutCols], acc_v[kTM][Cfg::kOutCols];
  clear<Cfg>(acc_k);
  clear<Cfg>(acc_v);
  const DropoutRng rng = device_rng(p);
  const bool aligned = dropout_blocks_aligned(p);  // key runs from multiples of kTM
  const int64_t diagonal = p.shard.query_start - p.shard.key_start;
  // Causal: query rows before first_row see none of these keys; skipped unless K or V is non-finite.
  const bool can_skip = p.is_causal && a.kv_finite[b * p.kv_heads + hk];
  const RowRange queries = document_queries(p, b, j0, kBM, kBN);
  const int64_t first_row = max(queries.begin, can_skip && j0 > diagonal ? (j0 - diagonal) / kBN * kBN : 0);
  const int64_t key_rows = (b * p.kv_heads + hk) * p.keys;
  const int64_t j = j0 + ty * kTM;  // this thread's first key

  // Query tile t: head hk group() + t / per_head, rows from first_row + (t % per_head) kBN. Shared
  // memory holds one Q and one dO tile: the next tile's Q (with its LSE and D) copies in once dK
  // has read this one's, its dO once dV has.
  const int64_t per_head = queries.end > first_row ? (queries.end - first_row + kBN - 1) / kBN : 0;
  const int64_t tiles = per_head * p.group();
  // The query tile of step `step`: in turn from this key tile's own where the key tiles take turns.
  const int64_t band = dq_turns != nullptr && tiles > 0 ? blockIdx.x / tiles : 0;
  const int64_t band_tiles = min(tiles, static_cast<int64_t>(gridDim.x) - band * tiles);
  const auto tile_at = [&](int64_t step) {
    if (dq_turns == nullptr) return step;
    const int64_t t = blockIdx.x - band * tiles + step;
    return t < tiles ? t : t - tiles;
  };
  const bool q_async = streams_async<scalar_t, acc_t>(p.q, p.q_strides, E, p.q_rotary);
  const bool dout_async = streams_async<scalar_t, acc_t>(a.dout, a.dout_strides, Ev);
  const auto head_of = [&](int64_t t) { return hk * p.group() + t / per_head; };
  const auto row0_of = [&](int64_t t) { return first_row + t % per_head * kBN; };
  const auto stream_q = [&](int64_t t) {
    const int64_t h = head_of(t), i0 = row0_of(t);
    stream_tile<scalar_t, Cfg>(sQ, p.q, p.q_strides, b, h, i0, p.queries, E, q_async, p.q_rotary);
    if (threadIdx.x < kBN) {
      const int64_t i = i0 + threadIdx.x, at = (b * p.heads + h) * p.queries + min(i, p.queries - 1);
      const int bytes = i < p.queries ? static_cast<int>(sizeof(acc_t)) : 0;  // zeros past the rows
      cp_async_small(sLse + Cfg::permuted(threadIdx.x), a.lse_unit + at, bytes);
      cp_async_small(sDelta + Cfg::permuted(threadIdx.x), a.delta + at, bytes);
    }
    cp_async_commit();
  };
  const auto stream_dout = [&](int64_t t) {
    stream_tile<scalar_t, Cfg>(sDO, a.dout, a.dout_strides, b, head_of(t), row0_of(t), p.queries, Ev, dout_async);
    cp_async_commit();
  };
  if (tiles > 0) {
    stream_q(tile_at(0));
    stream_dout(tile_at(0));
  }

  for (int64_t step = 0; step < tiles; ++step) {
    const int64_t t = tile_at(step), h = head_of(t), i0 = row0_of(t), rows = (b * p.heads + h) * p.queries;
    const bool more = step + 1 < tiles;
    cp_async_wait<1>();
    __syncthreads();  // this tile's Q, LSE and D have landed (its dO may still be copying)
    // s = unit * scale * k_j.q_i and dp = v_j.dO_i, for keys j0 + ty kTM + r and queries i0 + tx kTN + c
    acc_t s[kTM][kTN] = {}, dp[kTM][kTN] = {};
    gemm_nt<Cfg>(s, sK, sQ, round_up(E, Cfg::kVec));
    cp_async_wait<0>();
    __syncthreads();  // this tile's dO has landed
    gemm_nt<Cfg>(dp, sV, sDO, round_up(Ev, Cfg::kVec));
    const bool edge = tile_on_edge(p, b, i0, kBN, j0, kBM);
#pragma unroll
    for (int c = 0; c < kTN; ++c) {
      const int64_t i = i0 + tx * kTN + c;
      const acc_t lse = sLse[tx + kThreadGrid * c], delta = sDelta[tx + kThreadGrid * c];
      acc_t score[kTM];
#pragma unroll
      for (int r = 0; r < kTM; ++r) score[r] = s[r][c];
      apply_rules<kTM, scalar_t>(p, score, b, h, i, j, unit, edge);
      acc_t keep[kTM];
      if (p.has_dropout) dropout_run<kTM>(rng, p.shard.row_position(b, h, i) + static_cast<uint64_t>(j), keep, aligned);
      // dS_ij = P_ij (M_ij dP_ij - D_i); flash numerics round dS and P to the input dtype
#pragma unroll
      for (int r = 0; r < kTM; ++r) {
        const acc_t prob = exp_base(score[r] - lse, flash);
        const acc_t m = p.has_dropout ? keep[r] : acc_t(1);
        const acc_t ds = prob * (dp[r][c] * m - delta);
        s[r][c] = (flash ? round_to<scalar_t>(prob) : prob) * m;
        dp[r][c] = flash ? round_to<scalar_t>(ds) : ds;
      }
    }
    store_weights<kTM, kTN, kLdW>(sPM, s);
    store_weights<kTM, kTN, kLdW>(sDS, dp);
    __syncthreads();
    // dK_j += sum_i dS_ij Q_i;  dV_j += sum_i (P∘M)_ij dO_i
    gemm_nn<Cfg, kTM, kBN, kLdW>(acc_k, sDS, sQ);
    if (more) {
      __syncthreads();  // every thread is done with this Q
      stream_q(tile_at(step + 1));
    }
    gemm_nn<Cfg, kTM, kBN, kLdW>(acc_v, sPM, sDO);
    if (more) {
      __syncthreads();  // every thread is done with this dO
      stream_dout(tile_at(step + 1));
    }
    if (dq_sum != nullptr) {
      // unit * dQ_i += sum_j dS_ij (unit * scale * K_j), for the permuted query rows ty kTN + r
      acc_t part[kTN][Cfg::kOutCols];
      clear<Cfg>(part);
      gemm_rows<Cfg, kTN, kBM, kLdW>(part, sDS, sK);
      int* turn = dq_turns != nullptr ? dq_turns + ((band * p.batch + b) * p.kv_heads + hk) * tiles + t : nullptr;
      const int my_turn = turn != nullptr && threadIdx.x == 0 ? turns_before(t, step, band_tiles, tiles) : 0;
      if (turn != nullptr) {
        if (threadIdx.x == 0) {
          while (load_acquire(turn) != my_turn) __nanosleep(100);
        }
        __syncthreads();  // the parts before this one are in dq_sum
      }
#pragma unroll
      for (int r = 0; r < kTN; ++r) {
        const int64_t i = i0 + Cfg::logical(ty * kTN + r);
        if (i >= p.queries) continue;
#pragma unroll
        for (int c = 0; c < Cfg::kOutCols; ++c) {
          const int d = Cfg::out_col(tx, c);
          if (d >= E) continue;
          acc_t* x = dq_sum + (band * p.batch * p.heads * p.queries + rows + i) * E + d;
          if (turn != nullptr) {
            __stcg(x, __ldcg(x) + part[r][c]);  // through L2, where the other key tiles' parts are
          } else {
            atomicAdd(x, part[r][c]);
          }
        }
      }
      if (turn != nullptr) {
        __syncthreads();  // every thread has added its part; thread 0's release publishes them all
        if (threadIdx.x == 0) store_release(turn, my_turn + 1);
      }
    }
    if (group_sums != nullptr && (t + 1) % per_head == 0) {
      const bool first = h == hk * p.group(), last = h == (hk + 1) * p.group() - 1;
#pragma unroll
      for (int r = 0; r < kTM; ++r) {
        const int64_t jr = j + r;
        if (jr >= p.keys) continue;
        acc_t* sums = group_sums + (key_rows + jr) * (E + Ev);
#pragma unroll
        for (int c = 0; c < Cfg::kOutCols; ++c) {
          const int d = Cfg::out_col(tx, c);
          if (d < E) {
            const acc_t x = (first ? acc_t(0) : sums[d]) + round_to<scalar_t>(acc_k[r][c] * scale);
            if (last) dk[(key_rows + jr) * E + d] = static_cast<scalar_t>(x);
            else sums[d] = x;
          }
          if (d < Ev) {
            const acc_t x = (first ? acc_t(0) : sums[E + d]) + round_to<scalar_t>(acc_v[r][c]);
            if (last) dv[(key_rows + jr) * Ev + d] = static_cast<scalar_t>(x);
            else sums[E + d] = x;
          }
        }
      }
      clear<Cfg>(acc_k);
      clear<Cfg>(acc_v);
    }
  }
  // With group sums the last head wrote dK and dV, unless no query row sees these keys: then the
  // zero accumulators below are the gradients.
  if (group_sums != nullptr && tiles > 0) return;
  const auto key_row = [&](int r) {
    const int64_t jr = j + r;
    return jr < p.keys ? key_rows + jr : int64_t{-1};
  };
  store_rows<Cfg, kTM>(dk, E, key_row, [&](int r, int c) { return acc_k[r][c] * scale; });
  store_rows<Cfg, kTM>(dv, Ev, key_row, [&](int r, int c) { return acc_v[r][c]; });
}

template <typename scalar_t, typename Cfg>
void launch_backward(const AttentionProblem& pb, BackwardTensors& t, const at::Tensor& out,
                     const std::optional<at::Tensor>& grad_lse, const at::Tensor& dq, const at::Tensor& dk,
                     const at::Tensor& dv, const at::Tensor& dmask, bool deterministic) {
  using acc_t = typename Compute<scalar_t>::type;
  const AttentionParams& p = pb.params;
  const at::TensorOptions acc_options = dq.options().dtype(c10::CppTypeToScalarType<acc_t>::value);

  // D_i = sum_j P_ij dP_ij. Flash numerics take rowsum(dO ∘ O) from the rounded output, as
  // FlashAttention does. Exact numerics form it in the dQ kernel from the same P and dP as dS,
  // so that rows whose dS cancels (a single key, say) cancel exactly: in one sweep where every
  // key tile's P and dP∘M fit in shared memory beside the tiles, in two sweeps otherwise; float32
  // and float64 inputs, whose output is not rounded below the compute type, take rowsum(dO ∘ O)
  // instead of the second sweep.
  const size_t dq_smem = sizeof(acc_t) * ((2 * Cfg::kBM + 3 * Cfg::kBN) * Cfg::kLd + Cfg::kBN * Cfg::kLdWeights);
  const size_t cache_per_tile = sizeof(acc_t) * 2 * Cfg::kTM * Cfg::kTN * kThreads;
  const int64_t key_tiles = (p.keys + Cfg::kBN - 1) / Cfg::kBN;
  const bool exact = p.numerics == Numerics::kExact;
  const bool cache = exact && deterministic && dq_smem + key_tiles * cache_per_tile <= max_shared_memory();
  const bool form_delta = exact && (cache || !std::is_same_v<scalar_t, acc_t>);
  const size_t kv_smem = sizeof(acc_t) * (2 * (Cfg::kBM + Cfg::kBN) * Cfg::kLd + 2 * Cfg::kBN * Cfg::kLdWeights +
                                          2 * Cfg::kBN);
  const auto kv_kernel = attention_dkdv_kernel<scalar_t, Cfg>;

  // Rounding to the input dtype changes nothing for float32/float64.
  const bool round_per_head = p.numerics == Numerics::kFlash && p.group() > 1 && !std::is_same_v<scalar_t, acc_t>;
  // The key tiles add dQ in turns (dQ's products once, not twice: the query-owned kernel recomputes
  // P and dP) where every key tile of a head sees every query tile and a head's key tiles fit on the
  // GPU at once. Each band of as many key tiles as query tiles (each step's are distinct) adds to
  // its own dQ sum, L x E per band: memory linear in S.
  const int64_t query_tiles = (p.queries + Cfg::kBN - 1) / Cfg::kBN * p.group();
  const int64_t resident = deterministic && !cache && !round_per_head && !p.is_causal && p.key_windows == nullptr &&
                                   p.query_windows == nullptr
                               ? resident_blocks(kv_kernel, kThreads, kv_smem)
                               : 0;
  const bool turns = resident >= key_tiles && key_tiles > 0;
  if (form_delta) {
    t.delta = at::empty({p.batch, p.heads, p.queries}, acc_options);
    if (grad_lse.has_value()) t.grad_lse = grad_lse->to(acc_options.dtype()).contiguous();
  } else {
    t.delta = (t.grad_out.to(acc_options.dtype()) * out.to(acc_options.dtype())).sum(-1);
    if (grad_lse.has_value()) t.delta = t.delta - grad_lse->to(acc_options.dtype());
    t.delta = t.delta.contiguous();
  }
  const BackwardArgs<acc_t> a = backward_args<acc_t>(t);
  const bool dq_kernel_writes = deterministic && !turns;
  const DqMode mode{form_delta, cache ? static_cast<int>(key_tiles) : 0, dq_kernel_writes};
  if (form_delta || dq_kernel_writes) {
    launch(attention_dq_kernel<scalar_t, Cfg>, tile_grid(p.queries, Cfg::kBM, p.heads, p.batch),
           dq_smem + mode.cache_tiles * cache_per_tile, p, a, mode, dq.data_ptr<scalar_t>());
  }

  const at::Tensor group_sums =
      round_per_head ? at::empty({p.batch, p.kv_heads, p.keys, p.head_dim + p.value_dim}, acc_options) : at::Tensor();
  const int64_t bands = turns ? (key_tiles + query_tiles - 1) / query_tiles : 1;
  const at::Tensor dq_sum =
      dq_kernel_writes ? at::Tensor() : at::zeros({bands, p.batch, p.heads, p.queries, p.head_dim}, acc_options);
  const at::Tensor dq_turns =
      turns ? at::zeros({bands, p.batch, p.kv_heads, query_tiles}, dq.options().dtype(at::kInt)) : at::Tensor();
  // Taking turns, a launch holds as many heads as fit on the GPU beside each other: heads of whole
  // batch entries, or of one entry where its heads do not fit. A single key tile waits for no one.
  const int64_t fit = turns && key_tiles > 1 ? resident / key_tiles : p.batch * p.kv_heads;
  const int64_t head_step = std::min(fit, p.kv_heads), batch_step = std::max<int64_t>(fit / p.kv_heads, 1);
  for (int64_t b = 0; b < p.batch; b += batch_step) {
    for (int64_t h = 0; h < p.kv_heads; h += head_step) {
      launch(kv_kernel,
             tile_grid(p.keys, Cfg::kBM, std::min(head_step, p.kv_heads - h), std::min(batch_step, p.batch - b)),
             kv_smem, p, a, HeadOffset{b, h}, dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(),
             round_per_head ? group_sums.data_ptr<acc_t>() : nullptr,
             dq_kernel_writes ? nullptr : dq_sum.data_ptr<acc_t>(), turns ? dq_turns.data_ptr<int>() : nullptr);
    }
  }
  if (!dq_kernel_writes) dq.copy_((bands > 1 ? dq_sum.sum(0) : dq_sum[0]).div_(p.score_unit()));
  if (dmask.defined()) mask_gradient_cuda(pb, t, dmask);
}

}  // namespace

void attention_backward_cuda(const AttentionProblem& pb, const at::Tensor& grad_out, const at::Tensor& out,
                             const at::Tensor& lse, const std::optional<at::Tensor>& grad_lse, const at::Tensor& dq,
                             const at::Tensor& dk, const at::Tensor& dv, const at::Tensor& dmask,
                             bool deterministic) {
  const AttentionParams& p = pb.params;
  check_cuda_problem(p);
  const c10::cuda::CUDAGuard guard(dq.device());
  if (p.batch * p.heads * p.queries == 0) {  // no query row reads a key: zero key/value gradients
    dk.zero_();
    dv.zero_();
    if (dmask.defined()) dmask.zero_();
    return;
  }
  BackwardTensors t;
  t.grad_out = grad_out;
  t.out = out;
  t.lse_unit = lse.to(pb.q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat) * p.score_unit();
  t.lse_unit.masked_fill_(t.lse_unit == -INFINITY, INFINITY);
  t.lse_unit = t.lse_unit.contiguous();
  t.kv_finite = keys_values_finite(pb);
  if (backward_kernels(pb).tensor_cores) {
    attention_backward_tc(pb, t, grad_lse, dq, dk, dv, dmask);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dq.scalar_type(), "rudnn_attention_backward_cuda", [&] {
    using acc_t = typename Compute<scalar_t>::type;
    dispatch_width(std::max(p.head_dim, p.value_dim), [&](auto width) {
      launch_backward<scalar_t, TileConfig<acc_t, decltype(width)::value>>(pb, t, out, grad_lse, dq, dk, dv, dmask,
                                                                            deterministic);
    });
  });
}

}  // namespace rudnn::cuda
