"""The operators as torch sees them: opcheck, and torch.compile(fullgraph=True) against eager."""
import pytest
import torch

import rudnn

SHARD = [-1, 0, -1, 0, -1, 0]


def _inputs(device, dtype=torch.float32, hk=4, requires_grad=True):
    def t(*shape):
        return torch.randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad)

    return t(2, 4, 9, 16), t(2, hk, 11, 16), t(2, hk, 11, 8)


def _state(device, seed=3, offset=1):
    return torch.tensor([seed, offset], dtype=torch.int64, device=device)


def _rotary_table(device, rows):
    return rudnn.rotary.rotary_table(torch.arange(rows), 16, 10000.0, 3).to(device)


FORWARD_CASES = {
    "plain": lambda d: (*_inputs(d), None, 0.0, False, None, False, None, None, SHARD),
    "causal gqa": lambda d: (*_inputs(d, hk=2), None, 0.0, True, 0.5, True, "exact", None, SHARD),
    "float mask": lambda d: (*_inputs(d), torch.randn(9, 11, device=d, requires_grad=True), 0.0, False, None,
                             False, None, None, SHARD),
    "bool mask bf16": lambda d: (*_inputs(d, torch.bfloat16), torch.rand(2, 1, 9, 11, device=d) > 0.5, 0.0, False,
                                 None, False, "flash", None, SHARD),
    "dropout": lambda d: (*_inputs(d), None, 0.25, False, None, False, None, _state(d), [8, 2, -1, 0, -1, 0]),
    "documents": lambda d: (*_inputs(d), None, 0.0, True, None, False, None, None, SHARD, True,
                            torch.tensor([[0, 0, 0, 1, 1, 3, 3, 3, 3]] * 2, device=d),
                            torch.tensor([[0, 0, 1, 1, 1, 1, 2, 3, 3, 3, 3]] * 2, device=d)),
    "rope": lambda d: (*_inputs(d, hk=2), None, 0.0, True, None, True, None, None, SHARD, True, None, None,
                       _rotary_table(d, 9), _rotary_table(d, 11), True),
}


@pytest.mark.parametrize("name", list(FORWARD_CASES))
def test_opcheck_forward(device, name):
    torch.library.opcheck(torch.ops.rudnn.attention_forward.default, FORWARD_CASES[name](device))


@pytest.mark.parametrize("name", list(FORWARD_CASES))
def test_opcheck_backward(device, name):
    args = FORWARD_CASES[name](device)
    with torch.no_grad():
        out, lse, state = torch.ops.rudnn.attention_forward(*args)
    q, k, v, mask = (a.detach() if a is not None else None for a in args[:4])
    mask_grad = mask is not None and mask.is_floating_point()
    torch.library.opcheck(torch.ops.rudnn.attention_backward.default,
                          (torch.randn_like(out), torch.randn_like(lse), q, k, v, mask, out, lse, *args[4:9], state,
                           args[10], mask_grad, *args[11:]))


def test_opcheck_dropout_mask(device):
    torch.library.opcheck(torch.ops.rudnn.dropout_mask.default,
                          (_state(device), [2, 3, 5, 7], 0.4, [6, 1, -1, 0, 20, 3], torch.float16))


class Block(torch.nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim)
        self.bias = torch.nn.Parameter(torch.randn(heads, 1, 1) * 0.1)

    def forward(self, x, mask):
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (N, L, H, E) storage, no copy
        out = rudnn.scaled_dot_product_attention(q, k, v, attn_mask=mask + self.bias, dropout_p=0.1,
                                                 enable_gqa=True, dropout_seed=123)
        return out.transpose(1, 2).reshape(b, n, -1)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(device, dynamic):
    torch._dynamo.reset()
    model = Block().to(device)
    x = torch.randn(2, 10, 32, device=device)
    mask = torch.randn(10, 10, device=device)
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic)
    eager_out = model(x, mask)
    eager_grads = torch.autograd.grad(eager_out.square().sum(), list(model.parameters()))
    out = compiled(x, mask)
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    torch.testing.assert_close(out, eager_out)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e)
