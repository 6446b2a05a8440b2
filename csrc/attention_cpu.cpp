// CPU attention: tiles of queries x keys, online softmax forward, recomputing backward.
// Tile arithmetic runs on ATen ops (matrix products through the CPU BLAS, vectorised exp);
// at::parallel_for spreads independent tiles over threads. No buffer grows with L x S.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "dropout_cpu.h"
#include "kernels.h"
#include "rotary.h"

namespace rudnn {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Tile sizes (queries x keys): large enough that the fixed cost of each ATen call is small next
// to its arithmetic. RUDNN_CPU_BLOCK="q,k" overrides them; the tests use small tiles so that
// small problems cross tile boundaries.
struct Blocks {
  int64_t q = 256, k = 256;
};

Blocks cpu_blocks() {
  Blocks b;
  if (const char* env = std::getenv("RUDNN_CPU_BLOCK")) {
    long q = 0, k = 0;
    if (std::sscanf(env, "%ld,%ld", &q, &k) == 2 && q > 0 && k > 0) b = Blocks{q, k};
  }
  return b;
}

struct Span {
  int64_t start, size;
};

// Rows s of head (b, h) of a (B, H, L, ...) tensor.
at::Tensor head_rows(const at::Tensor& t, int64_t b, int64_t h, Span s) {
  return t.select(0, b).select(0, h).narrow(0, s.start, s.size);
}

// Probabilities of a tile and dP_ij = m_ij * dO_i.v_j (m: dropout multipliers, undefined without).
struct TileProbs {
  at::Tensor p, dp, keep;
};

// Arithmetic on the tiles of one problem, shared by every pass.
class Tiles {
 public:
  explicit Tiles(const AttentionProblem& pb)
      : pb_(pb), p_(pb.params), blocks_(cpu_blocks()), dtype_(pb.q.scalar_type()) {
    acc_ = dtype_ == at::kDouble ? at::kDouble : at::kFloat;
    flash_ = p_.numerics == Numerics::kFlash;
    unit_ = p_.score_unit();
    // A sum over each head is finite iff every value is, unless it overflows: then tiles are
    // merely not skipped. One pass, instead of the four of at::isfinite(...).all().
    if (p_.is_causal) {
      kv_finite_ = at::isfinite(pb.k.sum({2, 3}, /*keepdim=*/false, acc_) + pb.v.sum({2, 3}, false, acc_)).contiguous();
    }
  }

  const Blocks& blocks() const { return blocks_; }
  at::ScalarType acc() const { return acc_; }
  bool flash() const { return flash_; }
  // Scores are kept in the base of the exponential: e (exact) or 2 (flash, log2(e) folded in).
  double unit() const { return unit_; }
  int64_t query_tiles() const { return ceil_div(p_.queries, blocks_.q); }
  Span query_tile(int64_t t) const { return tile(t, blocks_.q, p_.queries); }
  int64_t key_tiles() const { return ceil_div(p_.keys, blocks_.k); }
  Span key_tile(int64_t t) const { return tile(t, blocks_.k, p_.keys); }

  // Rows of head h of a canonical (B, H, rows, D) tensor, in the compute dtype.
  at::Tensor rows(const at::Tensor& t, int64_t b, int64_t h, Span s) const {
    return head_rows(t, b, h, s).to(acc_);
  }

  // Query rows of head (b, h) and key rows of key head (b, hk) in the compute dtype, turned by RoPE
  // where it is fused (rounded to the input dtype, as a separately rotated input would be).
  at::Tensor query_rows(int64_t b, int64_t h, Span s) const {
    return turned_rows(pb_.q, pb_.q_rotary, p_.q_rotary.interleaved, b, h, s);
  }
  at::Tensor key_rows(int64_t b, int64_t hk, Span s) const {
    return turned_rows(pb_.k, pb_.k_rotary, p_.k_rotary.interleaved, b, hk, s);
  }

  // A whole tile that causality excludes. It is skipped unless K or V holds a non-finite value,
  // which PyTorch's math path carries into every row: excluded scores are s - inf (NaN for a NaN
  // score) and zero weights still multiply V (0 * inf = NaN).
  bool skip(int64_t b, int64_t hk, Span qs, Span ks) const {
    return p_.is_causal && ks.start - (qs.start + qs.size - 1) > causal_diagonal() &&
           kv_finite_.const_data_ptr<bool>()[b * p_.kv_heads + hk];
  }

  // Packed documents: no row of the tile sees any of its keys. Such tiles are skipped whatever
  // K and V hold: documents are apart, as in a batch of them.
  bool outside(int64_t b, Span qs, Span ks) const {
    if (p_.key_windows == nullptr) return false;
    const int32_t* w = p_.key_windows + 2 * b * p_.queries;
    return ks.start + ks.size <= w[2 * qs.start] || ks.start >= w[2 * (qs.start + qs.size - 1) + 1];
  }

  // s_ij = unit * (scale * q_i.k_j + mask_ij), minus inf where key j takes no part: excluded
  // scores get -inf added, as in PyTorch's math path, so a NaN score stays NaN; keys of other
  // documents get -inf.
  // q_scaled: the query rows times unit * scale.
  at::Tensor scores(const at::Tensor& q_scaled, const at::Tensor& k, int64_t b, int64_t h, Span qs, Span ks) const {
    at::Tensor s = at::mm(q_scaled, k.t());
    if (p_.mask_kind != MaskKind::kNone) {
      at::Tensor m = pb_.mask.select(0, p_.mask_batch == 1 ? 0 : b).select(0, p_.mask_heads == 1 ? 0 : h);
      if (p_.mask_queries != 1) m = m.narrow(0, qs.start, qs.size);
      if (p_.mask_keys != 1) m = m.narrow(1, ks.start, ks.size);
      if (p_.mask_kind == MaskKind::kBool) {
        s.add_(at::where(m, 0.0, -kInf));
      } else {
        s.add_(m, unit_);
      }
    }
    // Key j takes part iff j - i <= query_start - key_start (global positions of the shard).
    if (p_.is_causal && (ks.start + ks.size - 1) - qs.start > causal_diagonal()) {
      // -inf where (local) j - i > qs.start + diagonal - ks.start: the upper triangle from there.
      const int64_t first = qs.start + causal_diagonal() - ks.start + 1;
      s.add_(at::full({qs.size, ks.size}, -kInf, s.options()).triu_(first));
    }
    if (p_.key_windows != nullptr) {
      const int32_t* w = p_.key_windows + 2 * b * p_.queries;
      const bool inside = ks.start >= w[2 * (qs.start + qs.size - 1)] && ks.start + ks.size <= w[2 * qs.start + 1];
      if (!inside) {
        const at::Tensor window = pb_.key_windows.select(0, b).narrow(0, qs.start, qs.size);
        const at::Tensor j = at::arange(ks.start, ks.start + ks.size, window.options()).unsqueeze(0);
        s.masked_fill_((j < window.select(1, 0).unsqueeze(1)).logical_or_(j >= window.select(1, 1).unsqueeze(1)),
                       -kInf);
      }
    }
    return s;
  }

  // In place: e^x (exact) or 2^x (flash).
  at::Tensor& exp_(at::Tensor& x) const { return flash_ ? x.exp2_() : x.exp_(); }

  // FlashAttention rounds P and dS to the input dtype before its matrix products.
  at::Tensor round(const at::Tensor& x) const { return flash_ ? x.to(dtype_).to(acc_) : x; }

  // Dropout multipliers m_ij in {0, 1/(1-p)} of a tile (SPEC 3).
  at::Tensor keep(int64_t b, int64_t h, Span qs, Span ks) const {
    at::Tensor out = at::empty({qs.size, ks.size}, at::TensorOptions().dtype(acc_));
    AT_DISPATCH_FLOATING_TYPES(acc_, "rudnn_keep_tile", [&] {
      scalar_t* data = out.data_ptr<scalar_t>();
      for (int64_t i = 0; i < qs.size; ++i) {
        const uint64_t row = p_.shard.row_position(b, h, qs.start + i) + static_cast<uint64_t>(ks.start);
        fill_dropout_row(p_.rng, row, ks.size, data + i * ks.size);
      }
    });
    return out;
  }

  // P_ij = base^(s_ij - lse_i) and dP_ij = m_ij dO_i.v_j, recomputed from the saved statistics.
  // lse_unit: lse * unit, with +inf for rows where no key takes part (their P is 0).
  TileProbs probs(const at::Tensor& q_scaled, const at::Tensor& dout, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& lse_unit, int64_t b, int64_t h, Span qs, Span ks) const {
    at::Tensor s = scores(q_scaled, k, b, h, qs, ks);
    s.sub_(lse_unit.unsqueeze(1));
    exp_(s);
    at::Tensor dp = at::mm(dout, v.t());
    at::Tensor m;
    if (p_.has_dropout) {
      m = keep(b, h, qs, ks);
      dp.mul_(m);
    }
    return {s, dp, m};
  }

 private:
  static Span tile(int64_t t, int64_t block, int64_t total) {
    return {t * block, std::min(block, total - t * block)};
  }
  at::Tensor turned_rows(const at::Tensor& x, const at::Tensor& table, bool interleaved, int64_t b, int64_t h,
                         Span s) const {
    at::Tensor r = head_rows(x, b, h, s);
    if (table.defined()) r = rotate(r, head_rows(table, b, h, s), interleaved, /*inverse=*/false);
    return r.to(acc_);
  }
  int64_t causal_diagonal() const { return p_.shard.query_start - p_.shard.key_start; }

  const AttentionProblem& pb_;
  const AttentionParams& p_;
  Blocks blocks_;
  at::ScalarType dtype_, acc_;
  bool flash_;
  double unit_;
  at::Tensor kv_finite_;  // (B, Hkv): every value of K and V is finite
};

// Runs fn(b, h, query tile) for every query tile of every head, spread over threads.
template <typename F>
void for_each_query_tile(const AttentionParams& p, const Tiles& t, const F& fn) {
  at::parallel_for(0, p.batch * p.heads * t.query_tiles(), 1, [&](int64_t begin, int64_t end) {
    at::NoGradGuard no_grad;  // grad mode is thread-local: set it in every worker
    for (int64_t task = begin; task < end; ++task) {
      fn(task / (p.heads * t.query_tiles()), task / t.query_tiles() % p.heads, t.query_tile(task % t.query_tiles()));
    }
  });
}

// lse * unit, +inf where lse is -inf (rows with no keys), so that base^(s - lse) is 0 there.
at::Tensor lse_in_unit(const at::Tensor& lse, const Tiles& t) {
  at::Tensor scaled = lse.to(t.acc()) * t.unit();
  return scaled.masked_fill_(scaled == -kInf, kInf);
}

}  // namespace

void attention_forward_cpu(const AttentionProblem& pb, const at::Tensor& out, const at::Tensor& lse) {
  const AttentionParams& p = pb.params;
  if (p.batch * p.heads * p.queries == 0) return;
  const Tiles t(pb);
  for_each_query_tile(p, t, [&](int64_t b, int64_t h, Span qs) {
    const int64_t hk = h / p.group();
    const at::Tensor q = t.query_rows(b, h, qs) * (p.scale * t.unit());
    const auto rows = at::TensorOptions().dtype(t.acc());
    at::Tensor m = at::full({qs.size}, -kInf, rows);  // running maximum
    at::Tensor l = at::zeros({qs.size}, rows);        // running denominator
    at::Tensor acc = at::zeros({qs.size, p.value_dim}, rows);
    for (int64_t kt = 0; kt < t.key_tiles(); ++kt) {
      const Span ks = t.key_tile(kt);
      if (t.skip(b, hk, qs, ks)) break;  // so is every later tile
      if (t.outside(b, qs, ks)) continue;
      // m' = max(m, max_j s_ij);  l' = l * base^(m - m') + sum_j P_ij;  acc' = acc * base^(m - m') + (P∘M) V
      at::Tensor s = t.scores(q, t.key_rows(b, hk, ks), b, h, qs, ks);
      at::Tensor m_next = at::maximum(m, s.amax(1));
      at::Tensor m_safe = m_next.masked_fill(m_next == -kInf, 0.0);  // no key yet: keep P finite
      at::Tensor rescale = m - m_safe;
      t.exp_(rescale);
      s.sub_(m_safe.unsqueeze(1));
      at::Tensor prob = t.exp_(s);
      l.mul_(rescale).add_(prob.sum(1));
      prob = t.round(prob);
      if (p.has_dropout) prob.mul_(t.keep(b, h, qs, ks));
      // Zero weights still multiply V, so NaN/inf in V reach the row as in PyTorch's math path.
      acc.mul_(rescale.unsqueeze(1)).addmm_(prob, t.rows(pb.v, b, hk, ks));
      m = m_next;
    }
    // o_i = acc_i / l_i (a row with no keys keeps acc: zeros, or NaN from V);  lse_i = m_i + log l_i
    const at::Tensor denominator = l.where(l > 0, 1.0).unsqueeze(1);
    if (t.flash()) {
      acc.mul_(denominator.reciprocal());
    } else {
      acc.div_(denominator);
    }
    head_rows(out, b, h, qs).copy_(acc);
    const at::Tensor m_safe = m.masked_fill(m == -kInf, 0.0);
    head_rows(lse, b, h, qs).copy_(m_safe / t.unit() + l.log());
  });
}

void attention_backward_cpu(const AttentionProblem& pb, const at::Tensor& grad_out, const at::Tensor& out,
                            const at::Tensor& lse, const std::optional<at::Tensor>& grad_lse,
                            const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                            const at::Tensor& dmask) {
  const AttentionParams& p = pb.params;
  at::NoGradGuard no_grad;
  if (p.batch * p.heads * p.queries == 0) {  // no query row reads a key: zero key/value gradients
    dk.zero_();
    dv.zero_();
    if (dmask.defined()) dmask.zero_();
    return;
  }
  const Tiles t(pb);
  const at::Tensor lse_unit = lse_in_unit(lse, t);

  // D_i = sum_j P_ij dP_ij. Flash numerics take rowsum(dO ∘ O) from the rounded output, as
  // FlashAttention does; exact numerics use it only where O is not rounded below float32, and
  // otherwise sweep the keys once more in float32.
  at::Tensor delta;
  const bool from_output = t.flash() || pb.q.scalar_type() == t.acc();
  if (from_output) {
    delta = (grad_out.to(t.acc()) * out.to(t.acc())).sum(-1);
  } else {
    delta = at::empty({p.batch, p.heads, p.queries}, at::TensorOptions().dtype(t.acc()));
    for_each_query_tile(p, t, [&](int64_t b, int64_t h, Span qs) {
      const int64_t hk = h / p.group();
      const at::Tensor q = t.query_rows(b, h, qs) * (p.scale * t.unit());
      const at::Tensor dout = t.rows(grad_out, b, h, qs);
      const at::Tensor lse_rows = head_rows(lse_unit, b, h, qs);
      at::Tensor d = at::zeros({qs.size}, at::TensorOptions().dtype(t.acc()));
      for (int64_t kt = 0; kt < t.key_tiles(); ++kt) {
        const Span ks = t.key_tile(kt);
        if (t.skip(b, hk, qs, ks)) break;
        if (t.outside(b, qs, ks)) continue;
        const TileProbs g = t.probs(q, dout, t.key_rows(b, hk, ks), t.rows(pb.v, b, hk, ks), lse_rows, b, h, qs, ks);
        d.add_((g.p * g.dp).sum(1));
      }
      head_rows(delta, b, h, qs).copy_(d);
    });
  }
  // A gradient of the LSE adds P_ij * dLSE_i to dS_ij: fold it into D.
  if (grad_lse.has_value()) delta.sub_(grad_lse->to(t.acc()));

  // Each task owns key/value head (b, hk): its dK and dV, and dQ of every query head of its group.
  const bool round_per_head = t.flash() && p.group() > 1;
  at::parallel_for(0, p.batch * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
    at::NoGradGuard no_grad_worker;
    const auto opts = at::TensorOptions().dtype(t.acc());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / p.kv_heads, hk = task % p.kv_heads;
      at::Tensor dk_sum = at::zeros({p.keys, p.head_dim}, opts);
      at::Tensor dv_sum = at::zeros({p.keys, p.value_dim}, opts);
      for (int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
        at::Tensor dk_head = round_per_head ? at::zeros_like(dk_sum) : dk_sum;
        at::Tensor dv_head = round_per_head ? at::zeros_like(dv_sum) : dv_sum;
        for (int64_t qt = 0; qt < t.query_tiles(); ++qt) {
          const Span qs = t.query_tile(qt);
          const at::Tensor q = t.query_rows(b, h, qs);
          const at::Tensor q_scaled = q * (p.scale * t.unit());
          const at::Tensor dout = t.rows(grad_out, b, h, qs);
          const at::Tensor lse_rows = head_rows(lse_unit, b, h, qs);
          const at::Tensor d_rows = head_rows(delta, b, h, qs).unsqueeze(1);
          at::Tensor dq_rows = at::zeros({qs.size, p.head_dim}, opts);
          for (int64_t kt = 0; kt < t.key_tiles(); ++kt) {
            const Span ks = t.key_tile(kt);
            if (t.skip(b, hk, qs, ks)) break;
            if (t.outside(b, qs, ks)) continue;
            const at::Tensor k = t.key_rows(b, hk, ks);
            TileProbs g = t.probs(q_scaled, dout, k, t.rows(pb.v, b, hk, ks), lse_rows, b, h, qs, ks);
            // dS_ij = P_ij (dP_ij - D_i);  dQ_i += dS_ij K_j;  dK_j += dS_ij Q_i;  dV_j += (P∘M)_ij dO_i
            const at::Tensor ds = t.round(g.dp.sub_(d_rows).mul_(g.p));
            dq_rows.addmm_(ds, k);
            dk_head.narrow(0, ks.start, ks.size).addmm_(ds.t(), q);
            at::Tensor pm = t.round(g.p);
            if (g.keep.defined()) pm.mul_(g.keep);
            dv_head.narrow(0, ks.start, ks.size).addmm_(pm.t(), dout);
          }
          head_rows(dq, b, h, qs).copy_(dq_rows.mul_(p.scale));
        }
        if (round_per_head) {  // FlashAttention rounds each query head's dK/dV before the group sum
          dk_sum.add_(t.round(dk_head.mul_(p.scale)));
          dv_sum.add_(t.round(dv_head));
        }
      }
      if (!round_per_head) dk_sum.mul_(p.scale);
      dk.select(0, b).select(0, hk).copy_(dk_sum);
      dv.select(0, b).select(0, hk).copy_(dv_sum);
    }
  });

  if (!dmask.defined()) return;
  // dMask_ij = dS_ij summed over the dims the mask broadcasts along, with dS in float32 in both
  // numerics (FlashAttention has no mask gradient; rounding dS first would turn the cancellation in
  // sums such as sum_j dS_ij = 0 into noise). Each task owns a block of mask rows and visits, in a
  // fixed order, every (b, h, i) that reads them: deterministic, no atomics.
  const int64_t mask_row_tiles = p.mask_queries == 1 ? 1 : t.query_tiles();
  at::parallel_for(0, p.mask_batch * p.mask_heads * mask_row_tiles, 1, [&](int64_t begin, int64_t end) {
    at::NoGradGuard no_grad_worker;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bm = task / (p.mask_heads * mask_row_tiles), hm = task / mask_row_tiles % p.mask_heads;
      const int64_t row_tile = task % mask_row_tiles;
      const Span mrows = p.mask_queries == 1 ? Span{0, 1} : t.query_tile(row_tile);
      at::Tensor dm = at::zeros({mrows.size, p.mask_keys}, at::TensorOptions().dtype(t.acc()));
      for (int64_t b = 0; b < p.batch; ++b) {
        if (p.mask_batch != 1 && b != bm) continue;
        for (int64_t h = 0; h < p.heads; ++h) {
          if (p.mask_heads != 1 && h != hm) continue;
          const int64_t hk = h / p.group();
          const int64_t first = p.mask_queries == 1 ? 0 : row_tile;
          const int64_t last = p.mask_queries == 1 ? t.query_tiles() : row_tile + 1;
          for (int64_t qt = first; qt < last; ++qt) {
            const Span qs = t.query_tile(qt);
            const at::Tensor q = t.query_rows(b, h, qs) * (p.scale * t.unit());
            const at::Tensor dout = t.rows(grad_out, b, h, qs);
            const at::Tensor lse_rows = head_rows(lse_unit, b, h, qs);
            const at::Tensor d_rows = head_rows(delta, b, h, qs).unsqueeze(1);
            for (int64_t kt = 0; kt < t.key_tiles(); ++kt) {
              const Span ks = t.key_tile(kt);
              if (t.outside(b, qs, ks)) continue;
              TileProbs g = t.probs(q, dout, t.key_rows(b, hk, ks), t.rows(pb.v, b, hk, ks), lse_rows, b, h, qs, ks);
              at::Tensor ds = g.dp.sub_(d_rows).mul_(g.p);
              if (p.mask_queries == 1) ds = ds.sum(0, /*keepdim=*/true);
              if (p.mask_keys == 1) {
                dm.add_(ds.sum(1, /*keepdim=*/true));
              } else {
                dm.narrow(1, ks.start, ks.size).add_(ds);
              }
            }
          }
        }
      }
      dmask.select(0, bm).select(0, hm).narrow(0, mrows.start, mrows.size).copy_(dm);
    }
  });
}

}  // namespace rudnn
