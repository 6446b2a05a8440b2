// Forward on CUDA cores: a block owns kBM query rows of one head and streams key/value tiles of
// kBN rows through two shared-memory buffers, the next pair copying in while this one is used,
// with an online softmax; scores and P∘M V are register-tiled products (tile.cuh).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../kernel_choice.h"
#include "../kernels.h"
#include "launch.cuh"

namespace rudnn::cuda {
namespace {

template <typename scalar_t, typename Cfg, typename acc_t = typename Compute<scalar_t>::type>
__global__ void __launch_bounds__(kThreads, Cfg::kMinBlocks)
    attention_forward_kernel(const AttentionParams p, scalar_t* __restrict__ out, acc_t* __restrict__ lse,
                             const bool* __restrict__ kv_finite) {
  constexpr int kTM = Cfg::kTM, kTN = Cfg::kTN, kBM = Cfg::kBM, kBN = Cfg::kBN, kLd = Cfg::kLd;
  const int ty = grid_row(), tx = grid_col();
  const int64_t b = blockIdx.z, h = blockIdx.y, i0 = static_cast<int64_t>(blockIdx.x) * kBM;
  const int64_t hk = h / p.group();
  const bool flash = p.numerics == Numerics::kFlash;
  const acc_t unit = static_cast<acc_t>(p.score_unit());
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);

  extern __shared__ __align__(16) unsigned char smem[];
  acc_t* sQ = reinterpret_cast<acc_t*>(smem);  // kBM x kLd: Q times unit * scale
  acc_t* sK = sQ + kBM * kLd;                    // 2 buffers of kBN x kLd, rows permuted
  acc_t* sV = sK + 2 * kBN * kLd;                // 2 buffers of kBN x kLd, rows permuted
  acc_t* sP = sV + 2 * kBN * kLd;                // kBN x kLdWeights: (P∘M)^T

  load_tile<scalar_t, Cfg, kBM, false>(sQ, p.q, p.q_strides, b, h, i0, p.queries, E,
                                       static_cast<acc_t>(p.scale) * unit, p.q_rotary);
  // m: running maximum of each row; l: this thread's part of its running denominator.
  acc_t m[kTM], l[kTM], o[kTM][Cfg::kOutCols];
#pragma unroll
  for (int r = 0; r < kTM; ++r) m[r] = -INFINITY, l[r] = 0;
  clear<Cfg>(o);
  const DropoutRng rng = device_rng(p);
  const bool aligned = dropout_blocks_aligned(p);  // key runs from multiples of kTN
  // Tiles past the causal frontier are skipped unless K or V holds a non-finite value, which
  // PyTorch's math path carries into every row (NaN - inf, and zero weights times inf).
  const int64_t last_row = min(i0 + kBM, p.queries) - 1;
  const RowRange keys = document_keys(p, b, i0, kBM, kBN);
  const int64_t key_end = p.is_causal && kv_finite[b * p.kv_heads + hk]
                              ? min(keys.end, last_row + p.shard.query_start - p.shard.key_start + 1)
                              : keys.end;
  const bool k_async = streams_async<scalar_t, acc_t>(p.k, p.k_strides, E, p.k_rotary);
  const bool v_async = streams_async<scalar_t, acc_t>(p.v, p.v_strides, Ev);
  const auto stream_pair = [&](int64_t j0, int buffer) {
    stream_tile<scalar_t, Cfg>(sK + buffer * kBN * kLd, p.k, p.k_strides, b, hk, j0, p.keys, E, k_async, p.k_rotary);
    stream_tile<scalar_t, Cfg>(sV + buffer * kBN * kLd, p.v, p.v_strides, b, hk, j0, p.keys, Ev, v_async);
    cp_async_commit();
  };
  if (keys.begin < key_end) stream_pair(keys.begin, 0);

  int buffer = 0;
  for (int64_t j0 = keys.begin; j0 < key_end; j0 += kBN, buffer ^= 1) {
    cp_async_wait<0>();
    __syncthreads();  // this tile's K and V have landed; every thread is done with the other buffers and P
    if (j0 + kBN < key_end) stream_pair(j0 + kBN, buffer ^ 1);
    const acc_t* tK = sK + buffer * kBN * kLd;
    const acc_t* tV = sV + buffer * kBN * kLd;
    // s_ij = unit * scale * q_i.k_j, for keys j = j0 + tx kTN + c
    acc_t s[kTM][kTN] = {};
    gemm_nt<Cfg>(s, sQ, tK, round_up(E, Cfg::kVec));
    const int64_t j = j0 + tx * kTN;
    const bool edge = tile_on_edge(p, b, i0, kBM, j0, kBN);
    // m' = max(m, max_j s_ij);  l' = l base^(m - m') + sum_j P_ij;  o' = o base^(m - m') + (P∘M) V
#pragma unroll
    for (int r = 0; r < kTM; ++r) {
      const int64_t i = i0 + ty * kTM + r;
      apply_rules<kTN, scalar_t>(p, s[r], b, h, i, j, unit, edge);
      acc_t row_max = -INFINITY;
#pragma unroll
      for (int c = 0; c < kTN; ++c) row_max = max_nan(row_max, s[r][c]);
      const acc_t m_next = max_nan(m[r], max16(row_max));
      const acc_t m_safe = m_next == -INFINITY ? acc_t(0) : m_next;  // no key yet: keep P finite
      const acc_t rescale = exp_base(m[r] - m_safe, flash);
      acc_t keep[kTN];
      if (p.has_dropout) dropout_run<kTN>(rng, p.shard.row_position(b, h, i) + static_cast<uint64_t>(j), keep, aligned);
      acc_t sum = 0;
#pragma unroll
      for (int c = 0; c < kTN; ++c) {
        acc_t prob = exp_base(s[r][c] - m_safe, flash);
        sum += prob;
        if (flash) prob = round_to<scalar_t>(prob);
        s[r][c] = p.has_dropout ? prob * keep[c] : prob;
      }
      l[r] = l[r] * rescale + sum;
      m[r] = m_next;
#pragma unroll
      for (int c = 0; c < Cfg::kOutCols; ++c) o[r][c] *= rescale;
    }
    store_weights<kTM, kTN, Cfg::kLdWeights>(sP, s);
    __syncthreads();
    // Zero weights still multiply V: NaN/inf in V reach the row, as in PyTorch's math path.
    gemm_nn<Cfg, kTM, kBN, Cfg::kLdWeights>(o, sP, tV);
  }

  // o_i = acc_i / l_i (a row with no keys keeps acc: zeros, or NaN from V);  lse_i = m_i + log l_i
  acc_t denominator[kTM];
#pragma unroll
  for (int r = 0; r < kTM; ++r) {
    const acc_t total = sum16(l[r]);
    denominator[r] = total > 0 ? total : acc_t(1);
    const int64_t i = i0 + ty * kTM + r;
    if (tx == 0 && i < p.queries) {
      const acc_t m_safe = m[r] == -INFINITY ? acc_t(0) : m[r];
      lse[(b * p.heads + h) * p.queries + i] = m_safe / unit + log_natural(total);
    }
  }
  const int64_t rows = (b * p.heads + h) * p.queries;
  store_rows<Cfg, kTM>(
      out, Ev,
      [&](int r) {
        const int64_t i = i0 + ty * kTM + r;
        return i < p.queries ? rows + i : int64_t{-1};
      },
      [&](int r, int c) { return flash ? o[r][c] * (acc_t(1) / denominator[r]) : o[r][c] / denominator[r]; });
}

template <typename scalar_t, typename Cfg>
void launch_forward(const AttentionParams& p, const at::Tensor& out, const at::Tensor& lse,
                    const at::Tensor& kv_finite) {
  using acc_t = typename Compute<scalar_t>::type;
  const size_t smem = sizeof(acc_t) * ((Cfg::kBM + 4 * Cfg::kBN) * Cfg::kLd + Cfg::kBN * Cfg::kLdWeights);
  launch(attention_forward_kernel<scalar_t, Cfg>, tile_grid(p.queries, Cfg::kBM, p.heads, p.batch), smem, p,
         out.data_ptr<scalar_t>(), lse.data_ptr<acc_t>(),
         kv_finite.defined() ? kv_finite.const_data_ptr<bool>() : nullptr);
}

}  // namespace

void attention_forward_cuda(const AttentionProblem& pb, const at::Tensor& out, const at::Tensor& lse) {
  const AttentionParams& p = pb.params;
  if (p.batch * p.heads * p.queries == 0) return;
  check_cuda_problem(p);
  if (forward_kernels(pb).tensor_cores) {
    attention_forward_tc(pb, out, lse);
    return;
  }
  const c10::cuda::CUDAGuard guard(out.device());
  const at::Tensor kv_finite = keys_values_finite(pb);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "rudnn_attention_forward_cuda", [&] {
    using acc_t = typename Compute<scalar_t>::type;
    dispatch_width(std::max(p.head_dim, p.value_dim), [&](auto width) {
      launch_forward<scalar_t, TileConfig<acc_t, decltype(width)::value>>(p, out, lse, kv_finite);
    });
  });
}

}  // namespace rudnn::cuda
