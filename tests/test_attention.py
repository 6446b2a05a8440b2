"""rudnn against PyTorch's math SDPA in float64: forward, LSE and gradients over the shapes,
layouts, masks and dtypes users hit."""
import itertools
import math

import pytest
import torch

import case
import rudnn

LENGTHS = [1, 2, 17, 64, 113, 203, 256]
HEAD_DIMS = [8, 16, 40, 64, 80, 128, 256]
HEADS = [(1, 1), (4, 4), (8, 2), (8, 1)]
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("L,S", list(itertools.product(LENGTHS, LENGTHS)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_lengths(device, L, S, dtype):
    # Head dims, heads, batch dims, causality and numerics vary with the case so that the grid
    # covers them all.
    index = LENGTHS.index(L) * len(LENGTHS) + LENGTHS.index(S)
    E = HEAD_DIMS[index % len(HEAD_DIMS)]
    Ev = HEAD_DIMS[(index + 3) % len(HEAD_DIMS)]
    hq, hk = HEADS[index % len(HEADS)]
    batch = [(), (2,), (2, 3)][index % 3]
    # float16/bfloat16 alternate numerics; float32/float64 keep their default, exact. (Flash numerics
    # take D from the output, so a one-key row's dS, exactly 0, is float32 noise instead; summed over
    # hundreds of rows into dK it can exceed the tight float32 bound. test_head_dims covers them.)
    numerics = ["exact", "flash"][index // 2 % 2] if dtype in (torch.float16, torch.bfloat16) else None
    case.run(device, dtype, (*batch, hq, L, E), (*batch, hk, S, E), (*batch, hk, S, Ev),
             is_causal=index % 2 == 1, enable_gqa=hq != hk, numerics=numerics)


@pytest.mark.parametrize("E", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numerics", ["exact", "flash"])
def test_head_dims(device, E, dtype, numerics):
    Ev = E if E % 16 == 0 else E + 24
    case.run(device, dtype, (2, 4, 37, E), (2, 2, 45, E), (2, 2, 45, Ev), enable_gqa=True, numerics=numerics)


@pytest.mark.parametrize("hq,hk", HEADS)
@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_heads_and_batch_dims(device, hq, hk, batch, is_causal):
    case.run(device, torch.float64, (*batch, hq, 19, 24), (*batch, hk, 33, 24), (*batch, hk, 33, 16),
             is_causal=is_causal, enable_gqa=hq != hk)


@pytest.mark.parametrize("L,S", [(40, 17), (17, 40), (1, 33), (33, 1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_causal_lengths_differ(device, L, S, dtype):
    # Causal stays top-left aligned when L != S; with L > S the last rows see every key.
    case.run(device, dtype, (2, 3, L, 32), (2, 3, S, 32), (2, 3, S, 32), is_causal=True)


@pytest.mark.parametrize("kind", ["transposed", "strided"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_layouts(device, kind, dtype):
    case.run(device, dtype, (2, 4, 50, 64), (2, 4, 70, 64), (2, 4, 70, 64), kind=kind, is_causal=True)


def test_broadcast_batch_and_heads(device):
    # PyTorch's math path broadcasts batch dims, and heads of size 1 without enable_gqa.
    case.run(device, torch.float64, (3, 2, 4, 9, 16), (2, 1, 11, 16), (1, 4, 11, 8))
    case.run(device, torch.float64, (2, 1, 9, 16), (2, 4, 11, 16), (2, 4, 11, 8))


@pytest.mark.parametrize("shape", [(21, 24), (4, 21, 24)])
def test_two_and_three_dims(device, shape):
    out = case.run(device, torch.float64, shape, (*shape[:-2], 30, 24), (*shape[:-2], 30, 12))
    assert out.shape == (*shape[:-1], 12)


def test_scale(device):
    case.run(device, torch.float64, (2, 2, 20, 16), (2, 2, 25, 16), (2, 2, 25, 16), scale=0.37)
    case.run(device, torch.float32, (2, 2, 20, 16), (2, 2, 25, 16), (2, 2, 25, 16), scale=1.0, is_causal=True)


B, H, L, S = 2, 4, 23, 37
MASK_SHAPES = {
    "L,S": (L, S), "S": (S,), "1,S": (1, S), "L,1": (L, 1), "H,L,S": (H, L, S), "1,H,L,S": (1, H, L, S),
    "B,1,L,S": (B, 1, L, S), "B,H,L,S": (B, H, L, S), "B,H,1,S": (B, H, 1, S), "B,1,1,1": (B, 1, 1, 1),
}


def _mask(shape, kind):
    if kind == "bool":
        return torch.rand(shape) > 0.3
    return torch.randn(shape, dtype=torch.float64).masked_fill(torch.rand(shape) < 0.2, -math.inf)


@pytest.mark.parametrize("shape", list(MASK_SHAPES))
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_mask_broadcast(device, shape, kind, dtype):
    mask = _mask(MASK_SHAPES[shape], kind)
    case.run(device, dtype, (B, H, L, 32), (B, H, S, 32), (B, H, S, 24), attn_mask=mask,
             mask_grad=kind == "float")


@pytest.mark.parametrize("shape", ["L,1", "B,1,1,1"])
def test_mask_constant_along_keys_takes_the_lse_gradient(device, shape):
    # Such a mask shifts each row's scores: the output ignores it and the LSE follows it, so its
    # gradient is the LSE's, summed over the broadcast dims (0 in rows it masks out).
    import reference as ref
    q, k, v = (torch.randn(B, H, n, 16, dtype=torch.float64) for n in (L, S, S))
    mask = torch.randn(MASK_SHAPES[shape], dtype=torch.float64)
    mask.view(-1)[0] = -math.inf
    leaves = [t.to(device).requires_grad_() for t in (q, k, v, mask)]
    assert "is the LSE's" in rudnn.explain(*leaves[:3], attn_mask=leaves[3]).backward
    out, lse = rudnn.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3], return_lse=True)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    dmask = torch.autograd.grad((out, lse), leaves[3], (grad_out, grad_lse))[0].cpu()
    r_mask = mask.clone().requires_grad_()
    r_out, r_lse = ref.attention(q, k, v, r_mask)
    live = r_lse.isfinite()
    expected = torch.autograd.grad((r_out, r_lse[live]), r_mask, (grad_out.cpu(), grad_lse.cpu()[live]))[0]
    # The masked-out row: the reference's logsumexp backward gives NaN there (-inf - -inf).
    assert dmask.view(-1)[0] == 0 and dmask.view(-1)[1:].abs().min() > 0
    ref.assert_close(dmask.view(-1)[1:], expected.view(-1)[1:], torch.float64, what="dmask")


@pytest.mark.parametrize("view", ["expanded", "strided", "transposed"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_views(device, view, kind):
    if view == "expanded":  # a stride-0 view of one (L, S) mask; its gradient keeps the view's shape
        mask = _mask((1, 1, L, S), kind).expand(B, H, L, S)
    elif view == "strided":
        mask = _mask((B, H, L, 2 * S), kind)[..., ::2]
    else:
        mask = _mask((S, L), kind).t()
    case.run(device, torch.float64, (B, H, L, 16), (B, H, S, 16), (B, H, S, 16), attn_mask=mask,
             mask_grad=kind == "float")


def test_mask_with_extra_batch_dims(device):
    # Batch dims partly broadcast: (2, 1, H, L, S) against (2, 3, H, L, S).
    mask = _mask((2, 1, H, L, S), "float")
    case.run(device, torch.float64, (2, 3, H, L, 16), (2, 3, H, S, 16), (2, 3, H, S, 16), attn_mask=mask,
             mask_grad=True)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fully_masked_rows(device, kind, dtype):
    mask = _mask((B, H, L, S), kind)
    rows = [0, 5, 22]
    if kind == "bool":
        mask[:, :, rows] = False
    else:
        mask[:, :, rows] = -math.inf
    out = case.run(device, dtype, (B, H, L, 16), (B, H, S, 16), (B, H, S, 16), attn_mask=mask,
                   mask_grad=kind == "float")
    assert (out[:, :, rows] == 0).all()


@pytest.mark.parametrize("is_causal", [False, True])
def test_nan_in_value(device, is_causal):
    # Zero weights still multiply V: NaN reaches every row through its column, as in PyTorch's math path.
    mask = None if is_causal else _mask((L, S), "bool")
    out = case.run(device, torch.float64, (B, H, L, 16), (B, H, S, 16), (B, H, S, 16), attn_mask=mask,
                   is_causal=is_causal, grads=False, v_nan=(0, 1, S - 1, 3))
    assert out[0, 1, :, 3].isnan().all() and not out[0, 1, :, 2].isnan().any()


@pytest.mark.parametrize("is_causal", [False, True])
def test_nan_in_key(device, is_causal):
    # Excluded scores get -inf added, as in PyTorch's math path: a NaN key poisons every row.
    import reference as ref
    q, k, v = (torch.randn(1, 2, 40, 8, dtype=torch.float64) for _ in range(3))
    k[0, 0, 35, 1] = float("nan")
    mask = None if is_causal else torch.rand(40, 40) > 0.5
    if mask is not None:
        mask[:, 35] = False
    out = rudnn.scaled_dot_product_attention(q.to(device), k.to(device), v.to(device),
                                             attn_mask=None if mask is None else mask.to(device), is_causal=is_causal)
    expected = ref.math_sdpa(q, k, v, mask, is_causal)
    assert expected[0, 0].isnan().all() and not expected[0, 1].isnan().any()
    assert torch.equal(out.cpu().isnan(), expected.isnan())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_float32_mask_with_other_dtypes(device, dtype):
    # PyTorch takes a float32 mask whatever the inputs' dtype.
    case.run(device, dtype, (B, H, L, 16), (B, H, S, 16), (B, H, S, 16), attn_mask=torch.randn(L, S),
             mask_grad=True)


def test_heads_broadcast_against_zero(device):
    # One query head against zero key/value heads broadcasts to zero heads. (PyTorch returns
    # q-shaped zeros here, from an early exit for empty keys.)
    q, k, v = (t.to(device).requires_grad_() for t in (torch.randn(1, 1, 4, 8), torch.randn(1, 0, 4, 8),
                                                       torch.randn(1, 0, 4, 8)))
    out = rudnn.scaled_dot_product_attention(q, k, v)
    assert out.shape == (1, 0, 4, 8)
    out.sum().backward()
    assert q.grad.shape == q.shape and torch.equal(q.grad, torch.zeros_like(q))


def test_nan_in_query(device):
    q = torch.randn(1, 2, 5, 8, device=device)
    q[0, 0, 2, 1] = float("nan")
    out = rudnn.scaled_dot_product_attention(q, torch.randn(1, 2, 6, 8, device=device),
                                             torch.randn(1, 2, 6, 8, device=device))
    assert out[0, 0, 2].isnan().all() and not out[0, 0, [0, 1, 3, 4]].isnan().any() and not out[0, 1].isnan().any()


@pytest.mark.parametrize("shape", [(0, 2, 5, 8), (2, 0, 5, 8), (2, 2, 0, 8), (2, 2, 5, 8, 0)])
def test_empty(device, shape):
    # (batch 0), (L 0), (S 0): outputs of the right shape; with no keys, zero output and -inf LSE.
    if len(shape) == 5:
        q, k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 0, 8), torch.randn(2, 2, 0, 8)
    else:
        q = torch.randn(shape)
        k = v = torch.randn(shape[0], shape[1], 6, 8)
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    out, lse = rudnn.scaled_dot_product_attention(q, k, v, return_lse=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert out.shape == expected.shape and lse.shape == expected.shape[:-1]
    assert torch.equal(out, torch.zeros_like(out)) and (lse == -math.inf).all()
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert torch.equal(q.grad, torch.zeros_like(q))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_lse_gradient(device, dtype):
    # A loss on the LSE (as ring attention merges partial results) gets its gradient.
    q, k, v = (torch.randn(2, 3, 13, 16, dtype=torch.float64).to(dtype).to(device).requires_grad_()
               for _ in range(3))
    out, lse = rudnn.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    (out.double().sum() + lse.double().square().sum()).backward()
    r = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    import reference as ref
    r_out, r_lse = ref.attention(*r, is_causal=True)
    (r_out.sum() + r_lse.square().sum()).backward()
    tol = 1e-9 if dtype == torch.float64 else 0.05
    for g, e in zip((q.grad, k.grad, v.grad), r):
        torch.testing.assert_close(g.double().cpu(), e.grad, atol=tol, rtol=tol)


def test_exact_numerics_beat_flash(device):
    # SPEC 4: exact numerics give gradients closer to float64 than FlashAttention's rounding points.
    import reference as ref
    q, k, v = (torch.randn(2, 4, 200, 64, dtype=torch.float64) for _ in range(3))
    grad = torch.randn(2, 4, 200, 64, dtype=torch.float64)
    r = [t.to(torch.bfloat16).double().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(ref.attention(*r)[0], r, grad.to(torch.bfloat16).double())
    errors = {}
    for numerics in ["exact", "flash"]:
        x = [t.to(torch.bfloat16).to(device).requires_grad_() for t in (q, k, v)]
        out = rudnn.scaled_dot_product_attention(*x, numerics=numerics)
        got = torch.autograd.grad(out, x, grad.to(torch.bfloat16).to(device))
        errors[numerics] = [(g.double().cpu() - e).abs().max().item() for g, e in zip(got, expected)]
    assert all(e < f for e, f in zip(errors["exact"], errors["flash"])), errors


@pytest.mark.parametrize("S", [150, 700])
def test_exact_numerics_form_delta(device, S):
    # Exact numerics of bfloat16 form D from P and dP rather than from the rounded output. On CUDA
    # the dQ kernel keeps each row's P and dP on chip when its keys fit (S = 150) and sweeps the
    # keys twice when they do not (S = 700).
    case.run(device, torch.bfloat16, (2, 2, 67, 64), (2, 2, S, 64), (2, 2, S, 64), numerics="exact")


def test_deterministic_backward(device):
    q, k, v = (torch.randn(2, 8, 70, 40, device=device, requires_grad=True) for _ in range(3))
    k2, v2 = k[:, :2].detach().requires_grad_(), v[:, :2].detach().requires_grad_()
    mask = torch.randn(70, 70, device=device, requires_grad=True)
    grad = torch.randn(2, 8, 70, 40, device=device)
    runs = []
    for _ in range(50):
        out = rudnn.scaled_dot_product_attention(q, k2, v2, attn_mask=mask, dropout_p=0.2, enable_gqa=True,
                                                 dropout_seed=7)
        runs.append(torch.autograd.grad(out, (q, k2, v2, mask), grad))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


def test_cpu_ignores_nondeterministic_request():
    q, k, v = (torch.randn(1, 2, 9, 8, requires_grad=True) for _ in range(3))
    grads = [torch.autograd.grad(rudnn.scaled_dot_product_attention(q, k, v, deterministic=d).sum(), (q, k, v))
             for d in (True, False)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))
