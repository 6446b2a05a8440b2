"""RoPE fused into attention (rope=): against float64 references that rotate Q and K explicitly
with the same float32 angles, then attend; gradients reach the un-rotated inputs."""
import pytest
import torch

import reference as ref
import rudnn
from rudnn.rotary import rotary_table
from test_documents import document_mask, ids_of


def rotate64(x, positions, offset, base, interleaved, device):
    """x rotated in float64 by the float32 angles that rudnn's kernels read, computed on `device`
    (whose float32 cos/sin may differ from the CPU's in the last bit; the angles' own rounding is
    apply_rotary's, tested in test_rotary.py); differentiable in x."""
    table = rotary_table(positions.to(device), x.size(-1), base, offset).double().to(x.device)
    cos, sin = table.chunk(2, dim=-1)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x.chunk(2, dim=-1)
    ya, yb = a * cos - b * sin, a * sin + b * cos
    return torch.stack([ya, yb], -1).flatten(-2) if interleaved else torch.cat([ya, yb], -1)


CASES = {
    # (Hq, Hk, L, S, E, Ev), attention arguments, Rotary arguments (positions as functions of (L, S))
    "causal gqa offset": ((4, 2, 113, 113, 64, 64), dict(is_causal=True, enable_gqa=True), dict(offset=1000)),
    "cross positions": ((2, 2, 37, 203, 40, 24), {}, dict(positions=lambda L, S: torch.randint(0, 4096, (2, 1, L)),
                                                          key_positions=lambda L, S: torch.arange(S) * 3,
                                                          key_offset=5)),
    "mask dropout": ((2, 1, 70, 90, 128, 128), dict(attn_mask="bool", dropout_p=0.2, enable_gqa=True),
                     dict(base=500.0)),
    "decode": ((4, 4, 1, 129, 96, 96), {}, dict(offset=128, key_offset=0)),
    # Several query and key tiles at E = 128: tiles turned while the previous ones' products run.
    "tiles E128 causal": ((2, 2, 150, 300, 128, 128), dict(is_causal=True), dict(offset=7)),
    # Few queries over several key tiles: on sm_90a the one-group wgmma forward, whose turner group
    # turns the K tiles into two buffers in turn.
    "decode E128 tiles": ((2, 1, 16, 400, 128, 128), dict(attn_mask="bool", dropout_p=0.2, enable_gqa=True),
                          dict(offset=5)),
    # "exact" numerics past 64 queries: on sm_90a the two-group wgmma forward with 64-key tiles.
    "exact E128": ((2, 1, 130, 140, 128, 128), dict(numerics="exact", enable_gqa=True), dict(offset=2)),
    # Head dims of the wider buckets (on sm_90a the wgmma backward: two warp groups, one streamed
    # buffer, separate dK and dV launches; pairs across 64-column panels), and E = 100, whose
    # pairs turn element by element.
    "float mask E136": ((2, 1, 70, 45, 136, 136), dict(attn_mask="float", enable_gqa=True), dict(offset=9)),
    "E160/128 causal": ((2, 2, 33, 90, 160, 128), dict(is_causal=True), {}),
    "E256": ((2, 2, 40, 72, 256, 256), {}, dict(base=100.0)),
    "E100": ((2, 2, 50, 77, 100, 100), dict(is_causal=True), dict(offset=3)),
}


# The tensor-core dtypes run twice on CUDA: with the default products (on sm_90a builds the
# backward by wgmma in every case here but E = 96, the forward too where E <= 128 or L <= 64) and
# with RUDNN_DISABLE_WGMMA=1 (mma.sync throughout).
DTYPES_PRODUCTS = [(torch.float64, "default"), (torch.float32, "default"), (torch.bfloat16, "default"),
                   (torch.float16, "default"), (torch.bfloat16, "mma.sync"), (torch.float16, "mma.sync")]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype,products", DTYPES_PRODUCTS)
@pytest.mark.parametrize("name", list(CASES))
def test_fused_rope(device, name, dtype, products, interleaved, monkeypatch):
    if products == "mma.sync":
        if device == "cpu":
            pytest.skip("RUDNN_DISABLE_WGMMA steers the CUDA kernels only")
        monkeypatch.setenv("RUDNN_DISABLE_WGMMA", "1")
    (hq, hk, L, S, E, Ev), kw, rope_kw = CASES[name]
    kw = dict(kw)
    positions = {key: f(L, S) if callable(f) else f for key, f in rope_kw.items()}
    q64, k64, v64 = torch.randn(2, hq, L, E, dtype=torch.float64), torch.randn(2, hk, S, E, dtype=torch.float64), \
        torch.randn(2, hk, S, Ev, dtype=torch.float64)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(L, S) > 0.3
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(L, S).to(dtype)
    keep = None
    if "dropout_p" in kw:
        kw.update(dropout_seed=11, dropout_offset=4)
        keep = rudnn.dropout_mask(2, hq, L, S, kw["dropout_p"], 11, 4, dtype=torch.float64)
    qpos = positions.get("positions", torch.arange(L))
    kpos = positions.get("key_positions", torch.arange(S))
    offset = positions.get("offset", 0)
    key_offset = positions.get("key_offset", offset)
    base = positions.get("base", 10000.0)
    rope = rudnn.Rotary(**{key: (x.to(device) if isinstance(x, torch.Tensor) else x) for key, x in positions.items()},
                        interleaved=interleaved)

    def on(device_, t):
        return t.to(device_) if isinstance(t, torch.Tensor) else t

    inputs = [ref.leaf(t.to(dtype).to(device)) for t in (q64, k64, v64)]
    out, lse = rudnn.scaled_dot_product_attention(*inputs, rope=rope, return_lse=True,
                                                  **{key: on(device, x) for key, x in kw.items()})
    mask, causal, gqa = kw.get("attn_mask"), kw.get("is_causal", False), kw.get("enable_gqa", False)
    r_in = [ref.leaf(t.to(dtype), torch.float64) for t in (q64, k64, v64)]
    r_q = rotate64(r_in[0], qpos, offset, base, interleaved, device)
    r_k = rotate64(r_in[1], kpos, key_offset, base, interleaved, device)
    r_out, r_lse = ref.attention(r_q, r_k, r_in[2], mask, causal, None, gqa, keep)
    grad_out = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    got = torch.autograd.grad(out, inputs, grad_out.to(device))
    expected = torch.autograd.grad(r_out, r_in, grad_out.double())
    baseline = [None] * 5
    if dtype in ref.LOW_PRECISION:  # PyTorch's own: apply_rotary in dtype, then attention in dtype
        b_in = [ref.leaf(t.to(dtype).to(device)) for t in (q64, k64, v64)]
        b_q = rudnn.apply_rotary(b_in[0], positions=qpos.to(device), offset=offset, base=base, interleaved=interleaved)
        b_k = rudnn.apply_rotary(b_in[1], positions=kpos.to(device), offset=key_offset, base=base,
                                 interleaved=interleaved)
        b_keep = None if keep is None else keep.to(dtype).to(device)
        b_out, b_lse = ref.attention(b_q, b_k, b_in[2], on(device, mask), causal, None, gqa, b_keep)
        grads = torch.autograd.grad(b_out, b_in, grad_out.to(device))
        baseline = [t.detach().cpu() for t in (b_out, *grads, b_lse)]
    ref.assert_close(out.cpu(), r_out.detach(), dtype, baseline[0], "out")
    for i, name_ in enumerate(["dq", "dk", "dv"]):
        ref.assert_close(got[i].cpu(), expected[i], dtype, baseline[i + 1], name_)
    # Q and K are rounded to the input dtype once turned, so a low-precision LSE is held to the
    # FlashAttention rule too.
    lse_rule = dtype if dtype in ref.LOW_PRECISION else torch.float64 if dtype == torch.float64 else torch.float32
    ref.assert_close(lse.cpu(), r_lse.detach(), lse_rule, baseline[4], "lse")


def test_fused_rope_matches_apply_rotary_then_attention(device):
    # Same rounding points as rotating separately (float32 turn, rounded to bf16): outputs agree
    # to the last bits of attention's own rounding.
    q, k, v = (torch.randn(2, 4, 300, 64, device=device).to(torch.bfloat16) for _ in range(3))
    fused = rudnn.scaled_dot_product_attention(q, k, v, is_causal=True, rope=rudnn.Rotary(offset=7))
    separate = rudnn.scaled_dot_product_attention(rudnn.apply_rotary(q, offset=7), rudnn.apply_rotary(k, offset=7),
                                                  v, is_causal=True)
    torch.testing.assert_close(fused.float(), separate.float(), rtol=0, atol=2e-2)
    plain = rudnn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (fused.float() - plain.float()).abs().max() > 0.1


def test_fused_rope_layouts_and_documents(device):
    # (N, L, H, E).transpose(1, 2) inputs and packed documents, RoPE positions restarting per document.
    sizes = [40, 0, 1, 77, 12]
    total = sum(sizes)
    ids = ids_of(sizes)
    within = torch.arange(total) - torch.tensor([0] + sizes).cumsum(0)[ids]
    q, k, v = (torch.randn(1, total, h, 32, dtype=torch.float64, device=device).transpose(1, 2) for h in (4, 2, 2))
    rope = rudnn.Rotary(positions=within.to(device), key_positions=within.to(device), interleaved=True)
    out = rudnn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, rope=rope,
                                             document_ids=ids.to(device))
    mask = document_mask(ids, ids, True).to(device)
    expected = ref.attention(rotate64(q, within, 0, 10000.0, True, device),
                             rotate64(k, within, 0, 10000.0, True, device), v, mask, enable_gqa=True)[0]
    ref.assert_close(out, expected, torch.float64, what="out")
    # varlen_attention's RoPE positions default to those within each document.
    cu = torch.tensor([0] + sizes).cumsum(0).to(device)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    varlen = rudnn.varlen_attention(*packed, cu, cu, 77, 77, is_causal=True, enable_gqa=True,
                                    rope=rudnn.Rotary(interleaved=True))
    ref.assert_close(varlen, expected[0].transpose(0, 1), torch.float64, what="varlen")


def test_gradcheck_fused_rope(device):
    q = torch.randn(1, 2, 9, 8, dtype=torch.float64, device=device, requires_grad=True)
    k = torch.randn(1, 1, 11, 8, dtype=torch.float64, device=device, requires_grad=True)
    v = torch.randn(1, 1, 11, 6, dtype=torch.float64, device=device, requires_grad=True)
    mask = torch.randn(9, 11, dtype=torch.float64, device=device, requires_grad=True)
    for interleaved in (False, True):
        rope = rudnn.Rotary(positions=torch.tensor([5, 1, 2, 3, 9, 4, 2, 1, 0], device=device), offset=3,
                            interleaved=interleaved)

        def f(q, k, v, mask):
            return rudnn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, rope=rope)

        assert torch.autograd.gradcheck(f, (q, k, v, mask))


def test_functional_backward_with_rope(device):
    q, k, v = (torch.randn(2, 2, 50, 16, dtype=torch.float64, device=device, requires_grad=True) for _ in range(3))
    rope = rudnn.Rotary(offset=2)
    out = rudnn.scaled_dot_product_attention(q, k, v, is_causal=True, rope=rope)
    grad = torch.randn_like(out)
    expected = torch.autograd.grad(out, (q, k, v), grad)
    out2, stats = rudnn.attention_forward(q, k, v, is_causal=True, rope=rope)
    assert torch.equal(out, out2)
    buffers = [torch.randn_like(t) for t in (q, k, v)]
    start = [b.clone() for b in buffers]
    dq, dk, dv, _ = rudnn.attention_backward(grad, q, k, v, out2, stats, is_causal=True, rope=rope, dq=buffers[0],
                                             dk=buffers[1], dv=buffers[2])
    for got, s, e in zip((dq, dk, dv), start, expected):
        torch.testing.assert_close(got, s + e, rtol=0, atol=1e-12)


def test_explain_names_fused_rope(device):
    q, k, v = (torch.randn(2, 4, 70, 64, device=device, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.randn(70, 70, device=device)
    e = rudnn.explain(q, k, v, attn_mask=mask, rope=rudnn.Rotary(offset=3))
    assert "fused RoPE" in e.forward and "fused RoPE" in e.backward
    assert "fused RoPE" not in rudnn.explain(q, k, v, attn_mask=mask).forward
    if device == "cuda":  # the mask's gradient with fused RoPE: the CUDA-core kernel (whose loads turn Q and K)
        assert e.backward.endswith("by its CUDA-core kernel")
    with pytest.raises(ValueError, match="rudnn.Rotary"):
        rudnn.explain(q, k, v, rope=10000.0)


def test_fused_rope_errors(device):
    q = torch.randn(1, 2, 5, 7, device=device)
    with pytest.raises(ValueError, match="even head dim"):
        rudnn.scaled_dot_product_attention(q, q, q, rope=True)
    q = torch.randn(1, 2, 5, 8, device=device)
    with pytest.raises(ValueError, match="rudnn.Rotary"):
        rudnn.scaled_dot_product_attention(q, q, q, rope=10000.0)
    with pytest.raises(ValueError, match="do not broadcast"):
        rudnn.scaled_dot_product_attention(q, q, q, rope=rudnn.Rotary(positions=torch.arange(4, device=device)))
    table = torch.zeros(5, 8, device=device)
    with pytest.raises(ValueError, match="for both queries and keys"):
        torch.ops.rudnn.attention_forward(q, q, q, None, 0.0, False, None, False, None, None, [-1, 0, -1, 0, -1, 0],
                                          True, None, None, table, None, False)
    with pytest.raises(ValueError, match=r"key RoPE table of shape \[5, 6\] does not broadcast"):
        torch.ops.rudnn.attention_forward(q, q, q, None, 0.0, False, None, False, None, None, [-1, 0, -1, 0, -1, 0],
                                          True, None, None, table, table[:, :6], False)
    with pytest.raises(ValueError, match="must be float32"):
        torch.ops.rudnn.attention_forward(q, q, q, None, 0.0, False, None, False, None, None, [-1, 0, -1, 0, -1, 0],
                                          True, None, None, table, table.double(), False)
