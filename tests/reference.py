"""float64 references and the comparison rules of the test suite."""
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

LOW_PRECISION = (torch.float16, torch.bfloat16)


def scores(q, k, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """s_ij = scale * q_i.k_j (+ float mask), with -inf added where key j takes no part (so a NaN
    score stays NaN); as PyTorch's math path."""
    if enable_gqa:
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
    scale = 1 / math.sqrt(q.size(-1)) if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale
    length, keys = q.size(-2), k.size(-2)
    def excluded(allowed):
        return torch.zeros((), dtype=s.dtype, device=s.device).masked_fill(~allowed, -math.inf)

    if is_causal:
        s = s + excluded(torch.ones(length, keys, dtype=torch.bool, device=q.device).tril())
    if attn_mask is not None:
        s = s + (excluded(attn_mask) if attn_mask.dtype == torch.bool else attn_mask)
    return s


def attention(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, keep=None):
    """(out, lse) by the explicit formula, in the inputs' dtype: o = (P ∘ keep) V, safe softmax."""
    s = scores(q, k, attn_mask, is_causal, scale, enable_gqa)
    if enable_gqa:
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    lse = torch.logsumexp(s, -1)
    m = s.amax(-1, keepdim=True)
    m = m.masked_fill(m == -math.inf, 0)
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    p = e / total.masked_fill(total == 0, 1)
    if keep is not None:
        p = p * keep
    return p.to(v.dtype) @ v, lse  # a float32 mask promotes the scores; P @ V stays in V's dtype


def math_sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)


def leaf(t, dtype=None, requires_grad=True):
    """A fresh leaf copy of t, optionally cast, that may require grad."""
    out = t.detach().to(dtype or t.dtype).clone()
    return out.requires_grad_(requires_grad and out.is_floating_point())


def max_error(actual, expected):
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(actual.isnan(), expected.isnan()), "NaN positions differ"
    finite = ~expected.isnan()
    if not finite.any():
        return 0.0
    a, e = actual[finite], expected[finite]
    same_inf = (a == e) & e.isinf()
    return (a - e).masked_fill(same_inf, 0).abs().max().item() if a.numel() else 0.0


# Absolute bounds against the float64 reference for inputs of unit scale.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 5e-5}


def assert_close(actual, expected, dtype, baseline=None, what=""):
    """float32/float64: an absolute bound. float16/bfloat16: at most twice the error of PyTorch's own
    low-precision result `baseline` against the same float64 reference, plus a tiny atol."""
    err = max_error(actual, expected)
    if dtype in LOW_PRECISION:
        bound = 2 * max_error(baseline, expected) + 1e-4
    else:
        bound = TOLERANCE[dtype] * max(1.0, expected[~expected.isnan()].abs().max().item() if expected.numel() else 1)
    assert err <= bound, f"{what}: error {err:.3g} > bound {bound:.3g} ({dtype})"
