// Forward on CUDA cores: a block owns 32 query rows of one head (16 in float64), each warp a
// quarter of them; key/value tiles of 32 rows stream through shared memory with an online softmax.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../kernels.h"
#include "common.cuh"
#include "launch.cuh"

namespace rudnn::cuda {
namespace {

template <typename scalar_t, typename B>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(const AttentionParams p, scalar_t* __restrict__ out,
                             typename Compute<scalar_t>::type* __restrict__ lse, const bool* __restrict__ kv_finite) {
  using acc_t = typename Compute<scalar_t>::type;
  constexpr int kRows = rows_per_warp<acc_t>();
  constexpr int kTileRows = kWarps * kRows;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t b = blockIdx.z, h = blockIdx.y, i0 = static_cast<int64_t>(blockIdx.x) * kTileRows;
  const int64_t hk = h / p.group();
  const bool flash = p.numerics == Numerics::kFlash;
  const acc_t unit = static_cast<acc_t>(p.score_unit());
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);
  const int ldq = padded_cols(E), ldk = lane_row_stride<acc_t>(E), ldv = B::kWidth;

  extern __shared__ __align__(16) unsigned char smem[];
  acc_t* sQ = reinterpret_cast<acc_t*>(smem);  // kTileRows x ldq, times unit * scale
  acc_t* sK = sQ + kTileRows * ldq;              // kTile x ldk
  acc_t* sV = sK + kTile * ldk;                  // kTile x ldv
  acc_t* sP = sV + kTile * ldv;                  // per warp: kTile x kRows weights (P∘M)
  acc_t* sPw = sP + warp * kTile * kRows;

  load_tile<scalar_t>(sQ, ldq, p.q, p.q_strides, b, h, i0, p.queries, E, kTileRows,
                      static_cast<acc_t>(p.scale) * unit);
  acc_t m[kRows], l[kRows], acc[kRows][B::kChunks][B::kVec];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0;
#pragma unroll
    for (int c = 0; c < B::kChunks; ++c)
#pragma unroll
      for (int e = 0; e < B::kVec; ++e) acc[r][c][e] = 0;
  }
  const DropoutRng rng = device_rng(p);
  const int64_t last_row = min(i0 + kTileRows, p.queries) - 1;
  // Tiles past the causal frontier are skipped unless K or V holds a non-finite value, which
  // PyTorch's math path carries into every row (NaN - inf, and zero weights times inf).
  const bool can_skip = p.is_causal && kv_finite[b * p.kv_heads + hk];
  const int64_t diagonal = p.shard.query_start - p.shard.key_start;

  for (int64_t j0 = 0; j0 < p.keys; j0 += kTile) {
    if (can_skip && j0 - last_row > diagonal) break;
    __syncthreads();  // the previous tile is consumed
    load_tile<scalar_t>(sK, ldk, p.k, p.k_strides, b, hk, j0, p.keys, E, kTile);
    load_tile<scalar_t>(sV, ldv, p.v, p.v_strides, b, hk, j0, p.keys, Ev, kTile);
    __syncthreads();
    const int64_t j = j0 + lane;
    acc_t s[kRows];
    dot_rows<kRows>(sQ + warp * kRows * ldq, ldq, sK + lane * ldk, ldq, s);
    // m' = max(m, max_j s_ij);  l' = l base^(m - m') + sum_j P_ij;  acc' = acc base^(m - m') + (P∘M) V
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t i = i0 + warp * kRows + r;
      const acc_t score = adjust_score<scalar_t>(p, s[r], b, h, i, j, unit);
      const acc_t m_next = max_nan(m[r], warp_max(score));
      const acc_t m_safe = m_next == -INFINITY ? acc_t(0) : m_next;  // no key yet: keep P finite
      const acc_t rescale = exp_base(m[r] - m_safe, flash);
      acc_t prob = exp_base(score - m_safe, flash);
      l[r] = l[r] * rescale + warp_sum(prob);
      m[r] = m_next;
      if (flash) prob = round_to<scalar_t>(prob);
      if (p.has_dropout) prob *= dropout_multiplier<acc_t>(p, rng, b, h, i, j);
      sPw[lane * kRows + r] = prob;
#pragma unroll
      for (int c = 0; c < B::kChunks; ++c)
#pragma unroll
        for (int e = 0; e < B::kVec; ++e) acc[r][c][e] *= rescale;
    }
    __syncwarp();
    // Zero weights still multiply V: NaN/inf in V reach the row, as in PyTorch's math path.
    accumulate_rows<B, kRows>(acc, sPw, sV, ldv, kTile, lane);
  }

  // o_i = acc_i / l_i (a row with no keys keeps acc: zeros, or NaN from V);  lse_i = m_i + log l_i
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t i = i0 + warp * kRows + r;
    if (i >= p.queries) continue;
    const acc_t denominator = l[r] > 0 ? l[r] : acc_t(1);
    const acc_t reciprocal = acc_t(1) / denominator;
    scalar_t* o = out + ((b * p.heads + h) * p.queries + i) * Ev;
#pragma unroll
    for (int c = 0; c < B::kChunks; ++c)
#pragma unroll
      for (int e = 0; e < B::kVec; ++e) {
        const int d = c * kWarpSize * B::kVec + lane * B::kVec + e;
        if (d < Ev) o[d] = static_cast<scalar_t>(flash ? acc[r][c][e] * reciprocal : acc[r][c][e] / denominator);
      }
    if (lane == 0) {
      const acc_t m_safe = m[r] == -INFINITY ? acc_t(0) : m[r];
      lse[(b * p.heads + h) * p.queries + i] = m_safe / unit + log_natural(l[r]);
    }
  }
}

template <typename scalar_t, typename B>
void launch_forward(const AttentionParams& p, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& kv_finite) {
  using acc_t = typename Compute<scalar_t>::type;
  constexpr int kTileRows = kWarps * rows_per_warp<acc_t>();
  const int E = static_cast<int>(p.head_dim);
  const size_t smem = sizeof(acc_t) * (kTileRows * padded_cols(E) + kTile * lane_row_stride<acc_t>(E) +
                                       kTile * B::kWidth + kWarps * kTile * rows_per_warp<acc_t>());
  auto kernel = attention_forward_kernel<scalar_t, B>;
  const dim3 grid = tile_grid(p.queries, kTileRows, p.heads, p.batch);
  launch(kernel, grid, smem, p, out.data_ptr<scalar_t>(), lse.data_ptr<acc_t>(),
         kv_finite.defined() ? kv_finite.const_data_ptr<bool>() : nullptr);
}

}  // namespace

void attention_forward_cuda(const AttentionProblem& pb, const at::Tensor& out, const at::Tensor& lse) {
  const AttentionParams& p = pb.params;
  if (p.batch * p.heads * p.queries == 0) return;
  check_cuda_problem(p);
  const c10::cuda::CUDAGuard guard(out.device());
  const at::Tensor kv_finite = keys_values_finite(pb);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "rudnn_attention_forward_cuda", [&] {
    dispatch_bucket(std::max(p.head_dim, p.value_dim), [&](auto bucket) {
      launch_forward<scalar_t, decltype(bucket)>(p, out, lse, kv_finite);
    });
  });
}

}  // namespace rudnn::cuda
