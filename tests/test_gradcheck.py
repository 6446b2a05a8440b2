"""torch.autograd.gradcheck in float64 through rudnn's backward."""
import pytest
import torch

import rudnn

VARIANTS = ["plain", "causal", "gqa", "dropout", "float mask", "gqa dropout mask"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradcheck(device, variant):
    def t(*shape):
        return torch.randn(*shape, dtype=torch.float64, device=device, requires_grad=True)

    hk = 1 if "gqa" in variant else 3
    q, k, v = t(2, 3, 5, 4), t(2, hk, 6, 4), t(2, hk, 6, 3)
    inputs = [q, k, v]
    if "mask" in variant:
        inputs.append(t(1, 3, 5, 6))
    dropout = 0.3 if "dropout" in variant else 0.0

    def f(q, k, v, mask=None):
        return rudnn.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                  is_causal=variant == "causal", enable_gqa="gqa" in variant,
                                                  dropout_seed=17, dropout_offset=2)

    assert torch.autograd.gradcheck(f, inputs)


def test_gradcheck_lse(device):
    q, k, v = (torch.randn(1, 2, 4, 3, dtype=torch.float64, device=device, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: rudnn.scaled_dot_product_attention(q, k, v, return_lse=True),
                                    (q, k, v))
