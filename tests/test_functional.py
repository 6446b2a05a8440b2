"""rudnn.attention_forward / attention_backward: the same numbers as autograd, and gradients added
into given buffers."""
import pytest
import torch

import rudnn


@pytest.mark.parametrize("variant", ["plain", "causal gqa dropout", "float mask", "documents"])
def test_functional_matches_autograd(device, variant):
    def t(*shape):
        return torch.randn(*shape, dtype=torch.float64, device=device, requires_grad=True)

    hk = 1 if "gqa" in variant else 4
    q, k, v = t(2, 4, 37, 16), t(2, hk, 37, 16), t(2, hk, 37, 24)
    mask = t(2, 1, 37, 37) if "mask" in variant else None
    kw = dict(is_causal="causal" in variant, enable_gqa="gqa" in variant)
    if "dropout" in variant:
        kw.update(dropout_p=0.2, dropout_seed=9, dropout_offset=3)
    if variant == "documents":
        kw["document_ids"] = torch.tensor([0] * 10 + [1] * 27, device=device)
    expected, lse = rudnn.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True, **kw)
    grad, grad_lse = torch.randn_like(expected), torch.randn_like(lse)
    leaves = [q, k, v] + ([mask] if mask is not None else [])
    want = torch.autograd.grad((expected, lse), leaves, (grad, grad_lse))

    out, stats = rudnn.attention_forward(q, k, v, attn_mask=mask, **kw)
    assert torch.equal(out, expected) and torch.equal(stats.lse, lse) and not out.requires_grad
    backward_kw = {key: value for key, value in kw.items() if key not in ("dropout_seed", "dropout_offset")}
    buffers = [torch.randn_like(x) for x in (q, k, v)]
    before = [b.clone() for b in buffers]
    dq, dk, dv, dmask = rudnn.attention_backward(grad, q, k, v, out, stats, attn_mask=mask, grad_lse=grad_lse,
                                                 mask_grad=mask is not None, dq=buffers[0], dk=buffers[1],
                                                 dv=buffers[2], **backward_kw)
    for got, buffer, start, w in zip((dq, dk, dv), buffers, before, want):
        assert got is buffer
        torch.testing.assert_close(got, start + w, rtol=0, atol=1e-12)
    if mask is not None:
        torch.testing.assert_close(dmask, want[3], rtol=0, atol=1e-12)
    else:
        assert dmask is None
    fresh = rudnn.attention_backward(grad, q, k, v, out, stats, attn_mask=mask, grad_lse=grad_lse, **backward_kw)
    for got, w in zip(fresh[:3], want):
        assert torch.equal(got, w)


def test_functional_buffer_shape_error(device):
    q = torch.randn(1, 2, 5, 8, device=device)
    out, stats = rudnn.attention_forward(q, q, q)
    with pytest.raises(ValueError, match=r"dq must have shape \(1, 2, 5, 8\)"):
        rudnn.attention_backward(torch.randn_like(out), q, q, q, out, stats, dq=torch.zeros(2, 5, 8, device=device))
