"""One attention case run through rudnn, a float64 reference and PyTorch's own low-precision result."""
import torch
import torch.nn.functional as F

import rudnn
import reference as ref


def layout(x, kind):
    """x with the same values in another memory layout."""
    if kind == "contiguous":
        return x.contiguous()
    if kind == "transposed":  # (N..., L, H, E) storage viewed as (N..., H, L, E)
        return x.transpose(-3, -2).contiguous().transpose(-3, -2)
    if kind == "strided":  # every other element of a buffer twice as long
        return torch.stack([x, x], -1).flatten(-2)[..., ::2]
    raise ValueError(kind)


def run(device, dtype, q_shape, k_shape, v_shape, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
        numerics=None, mask_grad=False, kind="contiguous", keep=None, dropout=None, grads=True, v_nan=None):
    """Compares forward, LSE and gradients (mask gradient included) with the float64 reference.

    attn_mask: a bool, float32 (kept, as PyTorch takes it with any inputs) or float64 tensor (cast to
      dtype), moved to device here.
    dropout: (p, seed, offset) passed to rudnn; keep: the matching multipliers for the reference.
    v_nan: index into V set to NaN.
    """
    q64, k64, v64 = (torch.randn(s, dtype=torch.float64) for s in (q_shape, k_shape, v_shape))
    if v_nan is not None:
        v64[v_nan] = float("nan")
    # The reference sees exactly the values rudnn sees: the inputs rounded to dtype.
    q, k, v = (layout(t.to(dtype), kind).to(device) for t in (q64, k64, v64))
    mask = None
    if attn_mask is not None:
        keep_dtype = attn_mask.dtype in (torch.bool, torch.float32)
        mask = (attn_mask if keep_dtype else attn_mask.to(dtype)).to(device)
    inputs = [ref.leaf(t, requires_grad=grads) for t in (q, k, v)]
    if mask is not None:
        mask = ref.leaf(mask, requires_grad=mask_grad)
    extra = {}
    if dropout is not None:
        extra = dict(dropout_p=dropout[0], dropout_seed=dropout[1], dropout_offset=dropout[2])
    out, lse = rudnn.scaled_dot_product_attention(*inputs, attn_mask=mask, is_causal=is_causal, scale=scale,
                                                  enable_gqa=enable_gqa, numerics=numerics, return_lse=True, **extra)

    r_in = [ref.leaf(t.cpu(), torch.float64, grads) for t in (q, k, v)]
    r_mask = None if mask is None else ref.leaf(mask.cpu(), torch.float64 if mask.is_floating_point() else None,
                                                mask_grad)
    r_keep = None if keep is None else keep.double()
    r_out, r_lse = ref.attention(*r_in, r_mask, is_causal, scale, enable_gqa, r_keep)
    if keep is None:  # the explicit formula is PyTorch's math path
        ref.assert_close(ref.math_sdpa(*r_in, r_mask, is_causal, scale, enable_gqa).detach(), r_out.detach(),
                         torch.float64, what="reference")

    # PyTorch's own low-precision result, the yardstick for float16/bfloat16. "exact" numerics are held
    # to PyTorch's SDPA; "flash" numerics round P and dS to the input dtype as FlashAttention does,
    # and are held to FlashAttention's rule: PyTorch computing the formula in the input dtype.
    baseline = None
    if dtype in ref.LOW_PRECISION:
        b_in = [ref.leaf(t, requires_grad=grads) for t in (q, k, v)]
        b_mask = None if mask is None else ref.leaf(mask, requires_grad=mask_grad)
        if numerics == "exact" and keep is None:
            b_mask_2d = b_mask if b_mask is None or b_mask.dim() >= 2 else b_mask.unsqueeze(0)
            b_out = F.scaled_dot_product_attention(*b_in, b_mask_2d, 0.0, is_causal, scale=scale,
                                                   enable_gqa=enable_gqa)
        else:
            b_keep = None if keep is None else keep.to(dtype).to(device)
            b_out = ref.attention(*b_in, b_mask, is_causal, scale, enable_gqa, b_keep)[0]
        baseline = [b_out]

    ref.assert_close(out.cpu(), r_out.detach(), dtype, baseline and baseline[0].cpu(), "out")
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert lse.dtype == lse_dtype
    ref.assert_close(lse.cpu(), r_lse.detach(), lse_dtype, what="lse")
    if not grads:
        return out
    grad_out = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    wrt = inputs + ([mask] if mask_grad else [])
    got = torch.autograd.grad(out, wrt, grad_out.to(device))
    expected = torch.autograd.grad(r_out, r_in + ([r_mask] if mask_grad else []), grad_out.double())
    if baseline is not None:
        baseline = torch.autograd.grad(baseline[0], b_in + ([b_mask] if mask_grad else []), grad_out.to(device))
    for i, (name, g, e) in enumerate(zip(["dq", "dk", "dv", "dmask"], got, expected)):
        assert g.shape == wrt[i].shape and g.dtype == wrt[i].dtype
        # A float32 mask's gradient is float32 even for float64 inputs: held to float32's bound.
        rule = dtype if dtype in ref.LOW_PRECISION or g.dtype != torch.float32 else torch.float32
        ref.assert_close(g.cpu(), e, rule, baseline and baseline[i].cpu(), name)
    return out
