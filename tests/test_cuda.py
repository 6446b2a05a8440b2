"""What only a GPU shows: CPU and CUDA agree, and dropout under CUDA graph capture."""
import pytest
import torch

import reference as ref
import rudnn
from conftest import _CUDA_SKIP

pytestmark = pytest.mark.skipif(_CUDA_SKIP is not None, reason=str(_CUDA_SKIP))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dropout_mask_cpu_equals_cuda(dtype):
    args = (3, 5, 37, 41, 0.3, 0xFEEDFACECAFEBEEF, 2**63 + 5)
    shard = dict(global_heads=9, head_start=2, global_queries=50, query_start=7, global_keys=64, key_start=3)
    cpu = rudnn.dropout_mask(*args, dtype=dtype, **shard)
    cuda = rudnn.dropout_mask(*args, dtype=dtype, device="cuda", **shard)
    assert torch.equal(cpu, cuda.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("variant", ["plain", "causal gqa dropout", "float mask dropout"])
def test_cpu_equals_cuda(dtype, variant):
    # The same inputs, numerics and dropout bits give the same numbers, up to summation order.
    q, k, v = (torch.randn(2, 4, 77, 48, dtype=torch.float64).to(dtype) for _ in range(3))
    if "gqa" in variant:
        k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    mask = torch.randn(77, 77, dtype=torch.float64).to(dtype) if "mask" in variant else None
    grad = torch.randn(2, 4, 77, 48, dtype=torch.float64).to(dtype)
    results = []
    for device in ("cpu", "cuda"):
        x = [t.to(device).requires_grad_() for t in (q, k, v)] + ([mask.to(device).requires_grad_()] if mask is not None
                                                                   else [])
        out = rudnn.scaled_dot_product_attention(*x[:3], attn_mask=x[3] if mask is not None else None,
                                                 dropout_p=0.2 if "dropout" in variant else 0.0,
                                                 is_causal="causal" in variant, enable_gqa="gqa" in variant,
                                                 dropout_seed=99, dropout_offset=1)
        results.append([out] + list(torch.autograd.grad(out, x, grad.to(device))))
    tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    for a, b in zip(*results):
        torch.testing.assert_close(b.cpu(), a, atol=tol, rtol=tol)


def test_graph_capture_with_dropout():
    # Forward and backward with generator-drawn dropout, captured once and replayed: each replay
    # equals eager with the same generator state, and replays draw fresh bits.
    q, k, v = (torch.randn(2, 4, 64, 32, device="cuda", requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 4, 64, 32, device="cuda")

    def step():
        out = rudnn.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
        return [out] + list(torch.autograd.grad(out, (q, k, v), grad))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up off the default stream, as graph capture requires
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (5, 6):
        torch.manual_seed(seed)
        graph.replay()
        replayed = [t.clone() for t in captured]
        torch.manual_seed(seed)
        eager = step()
        for a, b in zip(replayed, eager):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.manual_seed(5)
    graph.replay()
    first = captured[0].clone()
    graph.replay()
    assert not torch.equal(first, captured[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("variant", ["plain", "plain exact", "causal gqa", "float mask dropout"])
def test_atomic_backward_matches_deterministic(dtype, variant):
    q, k, v = (torch.randn(2, 4, 70, 40, dtype=torch.float64, device="cuda").to(dtype) for _ in range(3))
    if "gqa" in variant:
        k, v = k[:, :1].contiguous(), v[:, :1].contiguous()
    mask = torch.randn(4, 70, 70, device="cuda").to(dtype) if "mask" in variant else None
    grad = torch.randn(2, 4, 70, 40, device="cuda").to(dtype)
    grads = []
    for deterministic in (True, False):
        x = [t.clone().requires_grad_() for t in (q, k, v)] + ([mask.clone().requires_grad_()] if mask is not None
                                                                else [])
        out = rudnn.scaled_dot_product_attention(*x[:3], attn_mask=x[3] if mask is not None else None,
                                                 dropout_p=0.2 if "dropout" in variant else 0.0,
                                                 is_causal="causal" in variant, enable_gqa="gqa" in variant,
                                                 dropout_seed=4, deterministic=deterministic,
                                                 numerics="exact" if "exact" in variant else None)
        grads.append(torch.autograd.grad(out, x, grad))
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("q_shape, kv_shape", [
    ((1, 4, 300, 40), (1, 4, 130, 40)),    # fewer key tiles than query tiles: turns skip steps
    ((1, 6, 100, 24), (1, 2, 200, 24)),    # GQA: the query tiles of three heads per key/value head
    ((1, 4, 100, 40), (1, 4, 700, 40)),    # more key tiles than query tiles: bands, the last one short
    ((2, 6, 70, 24), (2, 2, 1000, 24)),    # GQA and bands (6 query tiles per key/value head, 16 key tiles)
    ((1, 16, 512, 64), (1, 16, 4096, 64)),  # 8 bands of 8 key tiles
    ((2, 8, 2048, 64), (2, 8, 2048, 64)),  # heads over two launches (float32: 8 heads fit)
    ((1, 16, 2560, 32), (1, 16, 2560, 32)),  # one batch entry's heads over three launches (float32)
])
def test_key_tiles_take_turns_adding_dq(dtype, q_shape, kv_shape):
    # Without causality the key/value-owned kernel adds dQ itself, the key tiles of a band in turns:
    # gradients as the float64 reference, the same bits every run.
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(q_shape, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(kv_shape, generator=gen, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(q_shape, generator=gen, dtype=torch.float64)
    gqa = q_shape[1] != kv_shape[1]
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(ref.math_sdpa(*inputs, enable_gqa=gqa), inputs, grad)
    runs = []
    for _ in range(3):
        x = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
        out = rudnn.scaled_dot_product_attention(*x, enable_gqa=gqa)
        runs.append(torch.autograd.grad(out, x, grad.to("cuda", dtype)))
    tol = {torch.float64: 1e-11, torch.float32: 2e-5}[dtype]
    for got, want in zip(runs[0], expected):
        torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


def test_head_dim_limit():
    # The CUDA kernels hold head dims up to 256; past that the error names the rule.
    q = torch.randn(1, 1, 4, 320, device="cuda")
    with pytest.raises(RuntimeError, match="head dims up to 256"):
        rudnn.scaled_dot_product_attention(q, q, q)
