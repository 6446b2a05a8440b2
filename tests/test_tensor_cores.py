"""The tensor-core path (float16/bfloat16 on CUDA): explain says when it runs, and it holds the
float64 reference to FlashAttention's rule over the cases that exercise its tiling."""
import pytest
import torch
import torch.nn.functional as F

import case
import reference as ref
import rudnn
from conftest import _CUDA_SKIP

pytestmark = pytest.mark.skipif(_CUDA_SKIP is not None, reason=str(_CUDA_SKIP))


def _inputs(E=64, Ev=None, dtype=torch.bfloat16, L=70, S=90, device="cuda"):
    Ev = E if Ev is None else Ev
    return (torch.randn(2, 4, L, E, device=device, dtype=dtype), torch.randn(2, 4, S, E, device=device, dtype=dtype),
            torch.randn(2, 4, S, Ev, device=device, dtype=dtype))


def test_explain_picks_tensor_cores():
    e = rudnn.explain(*_inputs(128), is_causal=True)
    assert e.forward.startswith("tensor-core forward") and "causal" in e.forward
    assert e.backward.startswith("tensor-core backward")
    e = rudnn.explain(*_inputs(192, 128), attn_mask=torch.randn(70, 90, device="cuda"))
    assert e.forward.startswith("tensor-core forward") and "float mask" in e.forward
    assert e.backward.startswith("tensor-core backward")
    assert "float mask's gradient, where asked for, by its tensor-core kernel" in e.backward
    assert "at most 256" in rudnn.explain(*_inputs(264)).forward


def test_explain_says_why_not():
    assert "float16/bfloat16" in rudnn.explain(*_inputs(64, dtype=torch.float32)).forward
    q, k, v = _inputs(64)
    shifted = torch.randn(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape)
    e = rudnn.explain(shifted, k, v)
    assert e.forward.startswith("tensor-core forward") and "; query read element by element" in e.forward
    e = rudnn.explain(*_inputs(20, 36))
    assert e.forward.startswith("tensor-core") and "query, key, value read element by element" in e.forward
    assert "flash numerics only" in rudnn.explain(q, k, v, numerics="exact").backward
    assert rudnn.explain(*(t.cpu() for t in (q, k, v))).forward.startswith("CPU kernels")


def test_explain_names_the_products(monkeypatch):
    # sm_90a builds (setup.py's default on an H100/H200) take the products of forward and backward
    # by wgmma where the head-dim bucket is whole 64-column panels (the forward with fused RoPE and
    # heads wider than 128 only where the queries fit one 64-row block).
    hopper = torch.cuda.get_device_capability() == (9, 0)
    ropes = [rudnn.explain(*_inputs(128, L=L), rope=True) for L in (64, 65)]
    ropes.append(rudnn.explain(*_inputs(192, 128, L=64), rope=True))
    for e in [rudnn.explain(*_inputs(128)), rudnn.explain(*_inputs(192, 128))] + ropes:
        assert ("(wgmma)" in e.forward) == hopper
        assert ("(wgmma:" in e.backward) == hopper
    e = rudnn.explain(*_inputs(192, 128, L=65), rope=True)
    assert "(mma.sync)" in e.forward and ("(wgmma:" in e.backward) == hopper
    for e in (rudnn.explain(*_inputs(80)), rudnn.explain(*_inputs(32))):
        assert "(mma.sync)" in e.forward and "wgmma" not in e.backward
    monkeypatch.setenv("RUDNN_DISABLE_WGMMA", "1")
    e = rudnn.explain(*_inputs(128))
    assert "(mma.sync)" in e.forward and "wgmma" not in e.backward


def _backward_kernels(monkeypatch, wgmma):
    """(explain's texts, names of the CUDA kernels) of one forward+backward with fused RoPE
    (E = 128, bf16)."""
    if not wgmma:
        monkeypatch.setenv("RUDNN_DISABLE_WGMMA", "1")
    q, k, v = (t.requires_grad_() for t in _inputs(128))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        rudnn.scaled_dot_product_attention(q, k, v, rope=rudnn.Rotary()).sum().backward()
        torch.cuda.synchronize()
    return rudnn.explain(q, k, v, rope=True), " ".join(e.key for e in prof.key_averages())


def test_fused_rope_backward_products(monkeypatch):
    # The profiler's kernel names say which products ran, and explain must say the same: on sm_90a
    # builds the backward with fused RoPE runs the wgmma kernels (the forward's kernel has one name
    # for both products: explain_names_the_products covers it).
    e, names = _backward_kernels(monkeypatch, wgmma=True)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert ("attention_dq_wgmma_kernel" in names) == hopper and ("attention_dkdv_wgmma_kernel" in names) == hopper
    assert ("(wgmma:" in e.backward) == hopper
    assert "attention_forward_tc_kernel" in names and ("(wgmma)" in e.forward) == hopper
    e, names = _backward_kernels(monkeypatch, wgmma=False)
    assert "wgmma" not in names and "attention_dq_tc_kernel" in names
    assert "(mma.sync)" in e.forward and "(mma.sync:" in e.backward


@pytest.fixture(params=["default", "mma.sync"])
def products(request, monkeypatch):
    """Runs a test with the default products (wgmma on sm_90a builds) and again with
    RUDNN_DISABLE_WGMMA=1 (mma.sync), forward and backward alike."""
    if request.param == "mma.sync":
        monkeypatch.setenv("RUDNN_DISABLE_WGMMA", "1")
    return request.param


def test_explain_follows_the_switch(monkeypatch):
    monkeypatch.setenv("RUDNN_DISABLE_TENSOR_CORES", "1")
    e = rudnn.explain(*_inputs(64))
    assert e.forward.startswith("CUDA-core forward") and "RUDNN_DISABLE_TENSOR_CORES=1" in e.forward


def _keep(B, H, L, S, p, seed, offset):
    return rudnn.dropout_mask(B, H, L, S, p, seed, offset, dtype=torch.float64)


# (q shape, k shape, v shape, keyword arguments): tile edges (1, 113, 203, 1023), head-dim buckets
# and padding (32, 80 -> 96, 192/128, 192, 256, E != Ev, E and Ev not multiples of 8), GQA down to
# one KV head, masks, dropout, and layouts read element by element. At 192/192 and 256 the wgmma
# backward runs two warp groups a block: cases put the second one past L or past S.
CASES = {
    "plain 203x113 E=128": ((2, 3, 203, 128), (2, 3, 113, 128), (2, 3, 113, 128), {}),
    "causal 1023 E=64": ((1, 2, 1023, 64), (1, 2, 1023, 64), (1, 2, 1023, 64), dict(is_causal=True)),
    "causal L<S": ((1, 2, 40, 64), (1, 2, 300, 64), (1, 2, 300, 64), dict(is_causal=True)),
    "causal L>S": ((1, 2, 300, 64), (1, 2, 40, 64), (1, 2, 40, 64), dict(is_causal=True)),
    "L=1": ((2, 2, 1, 64), (2, 2, 77, 64), (2, 2, 77, 64), {}),
    "S=1": ((2, 2, 77, 64), (2, 2, 1, 64), (2, 2, 1, 64), {}),
    "E=32": ((2, 2, 100, 32), (2, 2, 130, 32), (2, 2, 130, 32), {}),
    "E=80 padded": ((2, 2, 100, 80), (2, 2, 130, 80), (2, 2, 130, 80), dict(is_causal=True)),
    "E=64 Ev=32": ((2, 2, 100, 64), (2, 2, 130, 64), (2, 2, 130, 32), {}),
    "E=20 Ev=37 unaligned": ((2, 2, 100, 20), (2, 2, 130, 20), (2, 2, 130, 37), dict(is_causal=True)),
    "E=136 Ev=200 wide": ((1, 2, 90, 136), (1, 2, 110, 136), (1, 2, 110, 200), {}),
    "strided": ((2, 2, 100, 64), (2, 2, 120, 64), (2, 2, 120, 64), dict(kind="strided")),
    "E=192 Ev=128": ((1, 2, 150, 192), (1, 2, 170, 192), (1, 2, 170, 128), {}),
    "E=192 Ev=128 GQA bool mask": ((2, 4, 130, 192), (2, 2, 150, 192), (2, 2, 150, 128),
                                   dict(enable_gqa=True, mask=("bool", (130, 150)))),
    "E=192 Ev=128 float mask grad": ((1, 2, 130, 192), (1, 2, 150, 192), (1, 2, 150, 128),
                                     dict(mask=("float", (1, 2, 130, 150)), mask_grad=True)),
    "E=256": ((1, 2, 150, 256), (1, 2, 170, 256), (1, 2, 170, 256), dict(is_causal=True)),
    "E=256 GQA bool mask": ((2, 4, 130, 256), (2, 2, 150, 256), (2, 2, 150, 256),
                            dict(enable_gqa=True, mask=("bool", (130, 150)))),
    "E=256 float32 mask grad": ((1, 2, 130, 256), (1, 2, 150, 256), (1, 2, 150, 256),
                                dict(mask=("float32", (1, 2, 130, 150)), mask_grad=True)),
    "E=256 S=50 float mask grad": ((2, 2, 130, 256), (2, 2, 50, 256), (2, 2, 50, 256),
                                   dict(mask=("float", (2, 1, 130, 50)), mask_grad=True)),
    "E=256 float mask rows by cp.async": ((1, 2, 100, 256), (1, 2, 160, 256), (1, 2, 160, 256),
                                          dict(mask=("float", (1, 2, 100, 160)))),
    "E=192 Ev=192 L=40 causal": ((1, 2, 40, 192), (1, 2, 300, 192), (1, 2, 300, 192), dict(is_causal=True)),
    "GQA 8/1": ((2, 8, 90, 64), (2, 1, 110, 64), (2, 1, 110, 64), dict(enable_gqa=True)),
    "GQA 8/2 causal": ((1, 8, 130, 128), (1, 2, 130, 128), (1, 2, 130, 128), dict(enable_gqa=True, is_causal=True)),
    "bool mask": ((2, 2, 113, 64), (2, 2, 203, 64), (2, 2, 203, 64), dict(mask=("bool", (113, 203)))),
    "bool mask aligned rows": ((2, 2, 113, 64), (2, 2, 160, 64), (2, 2, 160, 64),
                               dict(mask=("bool", (2, 1, 113, 160)))),
    "float32 mask aligned rows": ((2, 2, 70, 64), (2, 2, 200, 64), (2, 2, 200, 64),
                                  dict(mask=("float32", (2, 2, 70, 200)), mask_grad=True)),
    "float mask grad": ((2, 2, 113, 64), (2, 2, 203, 64), (2, 2, 203, 64),
                        dict(mask=("float", (2, 1, 113, 203)), mask_grad=True)),
    "float mask grad over heads and keys": ((2, 4, 150, 128), (2, 2, 170, 128), (2, 2, 170, 128),
                                            dict(mask=("float", (2, 1, 150, 1)), mask_grad=True, enable_gqa=True)),
    "float mask grad over rows": ((1, 2, 150, 96), (1, 2, 170, 96), (1, 2, 170, 96),
                                  dict(mask=("float32", (2, 1, 170)), mask_grad=True)),
    "transposed": ((2, 4, 100, 64), (2, 4, 120, 64), (2, 4, 120, 64), dict(kind="transposed", is_causal=True)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_tensor_core_cases(dtype, name, products):
    q_shape, k_shape, v_shape, kwargs = CASES[name]
    kwargs = dict(kwargs)
    if "mask" in kwargs:
        kind, shape = kwargs.pop("mask")
        dtypes = {"float": torch.float64, "float32": torch.float32}
        kwargs["attn_mask"] = torch.rand(shape) > 0.3 if kind == "bool" else torch.randn(shape, dtype=dtypes[kind])
    probe = [torch.empty(s, device="cuda", dtype=dtype) for s in (q_shape, k_shape, v_shape)]
    assert rudnn.explain(*probe, enable_gqa=kwargs.get("enable_gqa", False)).forward.startswith("tensor-core")
    case.run("cuda", dtype, q_shape, k_shape, v_shape, **kwargs)


# S = 170: a row's dropout positions start inside a Philox block; S = 160 and 256: on one, where
# lanes share blocks. Three cases add a bool mask to the dropout; in the wgmma backward, E = 192/128
# streams its tiles through one buffer and E = 256 runs two warp groups a block.
@pytest.mark.parametrize("gqa,S,extra,E,Ev", [(False, 170, False, 64, 64), (True, 170, False, 64, 64),
                                              (False, 160, False, 64, 64), (True, 256, True, 64, 64),
                                              (True, 170, True, 192, 128), (True, 170, True, 256, 256)])
def test_tensor_core_dropout(gqa, S, extra, E, Ev, products):
    B, H, L, p, seed, offset = 2, 4, 150, 0.2, 1234, 77
    hk = 2 if gqa else H
    kwargs = dict(attn_mask=torch.rand(L, S) > 0.2) if extra else {}
    case.run("cuda", torch.bfloat16, (B, H, L, E), (B, hk, S, E), (B, hk, S, Ev), enable_gqa=gqa,
             dropout=(p, seed, offset), keep=_keep(B, H, L, S, p, seed, offset), **kwargs)


def test_tensor_core_exact_numerics_halve_flash_error():
    # numerics="exact" carries P to V at float32 accuracy: its forward error is at most half of
    # torch's flash backend's, measured from the correctly rounded result (whose own rounding is
    # the error floor of any bfloat16 output).
    q, k, v = (torch.randn(4, 8, 512, 128, dtype=torch.float64).to(torch.bfloat16).cuda() for _ in range(3))
    expected = ref.attention(*(t.double().cpu() for t in (q, k, v)))[0].to(torch.bfloat16).double()
    exact = rudnn.scaled_dot_product_attention(q, k, v, numerics="exact")
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        flash = F.scaled_dot_product_attention(q, k, v)
    error = {name: (x.double().cpu() - expected).abs().mean().item() for name, x in [("exact", exact), ("flash", flash)]}
    assert error["exact"] <= 0.5 * error["flash"], error


def test_tensor_core_backward_is_deterministic(products):
    q, k, v = (torch.randn(2, 8, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    k2, v2 = k[:, :2].detach().requires_grad_(), v[:, :2].detach().requires_grad_()
    grad = torch.randn(2, 8, 300, 64, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(50):
        out = rudnn.scaled_dot_product_attention(q, k2, v2, dropout_p=0.2, enable_gqa=True, dropout_seed=7,
                                                 is_causal=True)
        runs.append(torch.autograd.grad(out, (q, k2, v2), grad))
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))
