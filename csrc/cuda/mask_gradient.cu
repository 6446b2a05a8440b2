// Gradient of a float mask on CUDA cores: dMask = dS summed over the dims the mask broadcasts
// along. A block owns a kBM x kBN tile of the mask's rows and keys (all of a broadcast dim) and
// visits, in a fixed order, every (b, h, i, j) that reads it: deterministic, no atomics.
// dS stays in the compute type in both numerics (FlashAttention has no mask gradient; rounding
// dS first would turn the cancellation of row-constant masks into noise).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>

#include "backward.cuh"
#include "launch.cuh"

namespace rudnn::cuda {
namespace {

// One block a multiprocessor is enough here (not a hot kernel): its registers are not capped.
template <typename scalar_t, typename Cfg, typename acc_t = typename Compute<scalar_t>::type>
__global__ void __launch_bounds__(kThreads)
    attention_dmask_kernel(const AttentionParams p, const BackwardArgs<acc_t> a, acc_t* __restrict__ dmask) {
  constexpr int kTM = Cfg::kTM, kTN = Cfg::kTN, kBM = Cfg::kBM, kBN = Cfg::kBN, kLd = Cfg::kLd;
  const int ty = grid_row(), tx = grid_col();
  const int64_t bm = blockIdx.z / p.mask_heads, hm = blockIdx.z % p.mask_heads;
  const bool all_rows = p.mask_queries == 1, all_keys = p.mask_keys == 1;
  const int64_t own_i0 = static_cast<int64_t>(blockIdx.y) * kBM, own_j0 = static_cast<int64_t>(blockIdx.x) * kBN;
  const acc_t unit = static_cast<acc_t>(p.score_unit());
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.value_dim);

  extern __shared__ __align__(16) unsigned char smem[];
  acc_t* sQ = reinterpret_cast<acc_t*>(smem);  // kBM x kLd: Q times unit * scale
  acc_t* sDO = sQ + kBM * kLd;                   // kBM x kLd
  acc_t* sK = sDO + kBM * kLd;                   // kBN x kLd, rows permuted
  acc_t* sV = sK + kBN * kLd;                    // kBN x kLd, rows permuted
  acc_t* sRed = sV + kBN * kLd;                  // kThreadGrid x kBN: partial sums over rows

  acc_t total[kTM][kTN] = {};
  const DropoutRng rng = device_rng(p);
  const int64_t b_end = p.mask_batch == 1 ? p.batch : bm + 1, h_end = p.mask_heads == 1 ? p.heads : hm + 1;
  for (int64_t b = p.mask_batch == 1 ? 0 : bm; b < b_end; ++b) {
    for (int64_t h = p.mask_heads == 1 ? 0 : hm; h < h_end; ++h) {
      const int64_t hk = h / p.group(), rows = (b * p.heads + h) * p.queries;
      for (int64_t i0 = all_rows ? 0 : own_i0; i0 < (all_rows ? p.queries : own_i0 + 1); i0 += kBM) {
        __syncthreads();
        load_tile<scalar_t, Cfg, kBM, false>(sQ, p.q, p.q_strides, b, h, i0, p.queries, E,
                                             static_cast<acc_t>(p.scale) * unit, p.q_rotary);
        load_tile<scalar_t, Cfg, kBM, false>(sDO, a.dout, a.dout_strides, b, h, i0, p.queries, Ev, acc_t(1));
        acc_t lse[kTM], delta[kTM];
#pragma unroll
        for (int r = 0; r < kTM; ++r) {
          const int64_t i = min(i0 + ty * kTM + r, p.queries - 1);
          lse[r] = a.lse_unit[rows + i];
          delta[r] = a.delta[rows + i];
        }
        for (int64_t j0 = all_keys ? 0 : own_j0; j0 < (all_keys ? p.keys : own_j0 + 1); j0 += kBN) {
          __syncthreads();
          load_tile<scalar_t, Cfg, kBN, true>(sK, p.k, p.k_strides, b, hk, j0, p.keys, E, acc_t(1), p.k_rotary);
          load_tile<scalar_t, Cfg, kBN, true>(sV, p.v, p.v_strides, b, hk, j0, p.keys, Ev, acc_t(1));
          __syncthreads();
          acc_t prob[kTM][kTN], dpm[kTM][kTN];
          query_tile_probabilities<scalar_t, Cfg>(p, rng, b, h, i0, j0, sQ, sDO, sK, sV, lse, prob, dpm);
          // dS_ij = P_ij (M_ij dP_ij - D_i)
#pragma unroll
          for (int r = 0; r < kTM; ++r) {
            const int64_t i = i0 + ty * kTM + r;
#pragma unroll
            for (int c = 0; c < kTN; ++c) {
              if (i < p.queries && j0 + tx * kTN + c < p.keys) total[r][c] += prob[r][c] * (dpm[r][c] - delta[r]);
            }
          }
        }
      }
    }
  }

  // Sum over the broadcast dims in a fixed order: keys across a row's 16 lanes, rows across the block.
  if (all_keys) {
#pragma unroll
    for (int r = 0; r < kTM; ++r) {
      acc_t x = 0;
#pragma unroll
      for (int c = 0; c < kTN; ++c) x += total[r][c];
      total[r][0] = sum16(x);
    }
  }
  const int64_t base = blockIdx.z * p.mask_queries * p.mask_keys;
  if (all_rows) {
    __syncthreads();
#pragma unroll
    for (int c = 0; c < kTN; ++c) {
      acc_t x = 0;
#pragma unroll
      for (int r = 0; r < kTM; ++r) x += total[r][c];
      sRed[ty * kBN + tx * kTN + c] = x;
    }
    __syncthreads();
    if (ty != 0) return;
    for (int c = 0; c < (all_keys ? 1 : kTN); ++c) {
      const int64_t j = own_j0 + tx * kTN + c;
      acc_t x = 0;
      for (int y = 0; y < kThreadGrid; ++y) x += sRed[y * kBN + tx * kTN + c];
      if (all_keys && tx == 0) dmask[base] = x;
      if (!all_keys && j < p.keys) dmask[base + j] = x;
    }
    return;
  }
#pragma unroll
  for (int r = 0; r < kTM; ++r) {
    const int64_t i = own_i0 + ty * kTM + r;
    if (i >= p.queries) continue;
    if (all_keys) {
      if (tx == 0) dmask[base + i] = total[r][0];
      continue;
    }
#pragma unroll
    for (int c = 0; c < kTN; ++c) {
      const int64_t j = own_j0 + tx * kTN + c;
      if (j < p.keys) dmask[base + i * p.mask_keys + j] = total[r][c];
    }
  }
}

template <typename scalar_t, typename Cfg>
void launch_mask_gradient(const AttentionParams& p, const BackwardTensors& t, const at::Tensor& dmask) {
  using acc_t = typename Compute<scalar_t>::type;
  const size_t smem = sizeof(acc_t) * (2 * (Cfg::kBM + Cfg::kBN) * Cfg::kLd + kThreadGrid * Cfg::kBN);
  launch(attention_dmask_kernel<scalar_t, Cfg>, mask_gradient_grid(p, Cfg::kBM, Cfg::kBN), smem, p,
         backward_args<acc_t>(t), dmask.data_ptr<acc_t>());
}

}  // namespace

void mask_gradient_cuda(const AttentionProblem& pb, const BackwardTensors& t, const at::Tensor& dmask) {
  const AttentionParams& p = pb.params;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pb.q.scalar_type(), "rudnn_mask_gradient_cuda", [&] {
    using acc_t = typename Compute<scalar_t>::type;
    dispatch_width(std::max(p.head_dim, p.value_dim), [&](auto width) {
      launch_mask_gradient<scalar_t, TileConfig<acc_t, decltype(width)::value>>(p, t, dmask);
    });
  });
}

}  // namespace rudnn::cuda
