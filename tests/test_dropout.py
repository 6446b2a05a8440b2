"""Dropout: the Philox contract of SPEC section 3, bit for bit, and attention with it."""
import math

import pytest
import torch

import case
import philox_ref
import rudnn


def test_philox_known_answer():
    # Random123's known answer for Philox4x32-10: counter 0, key 0.
    assert philox_ref.philox4x32_10(0, 0) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    # rudnn's mask for positions 0..3 of seed 0, offset 0 reads those words: u = (word >> 8) / 2^24.
    u = [(w >> 8) / 2**24 for w in (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)]
    for p in (0.1, 0.5, 0.7, 0.9):
        mask = rudnn.dropout_mask(1, 1, 1, 4, p, 0, 0, dtype=torch.float64)
        expected = [1 / (1 - p) if x >= p else 0.0 for x in u]
        assert mask.flatten().tolist() == pytest.approx(expected, rel=0, abs=0)


@pytest.mark.parametrize("seed,offset", [(0, 0), (1234, 5), (2**64 - 1, 2**64 - 3), (0xDEADBEEF12345678, 2**40)])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.93])
def test_mask_matches_python_philox(device, seed, offset, p):
    shape = (2, 3, 5, 7)
    got = rudnn.dropout_mask(*shape, p, seed, offset, dtype=torch.float64, device=device)
    expected = torch.tensor(philox_ref.dropout_mask(shape, p, seed, offset), dtype=torch.float64)
    assert torch.equal(got.cpu(), expected)


def test_shard_is_slice_of_whole(device):
    whole = rudnn.dropout_mask(2, 8, 40, 33, 0.3, 99, 7, device=device)
    part = rudnn.dropout_mask(2, 3, 11, 9, 0.3, 99, 7, global_heads=8, head_start=4, global_queries=40,
                              query_start=20, global_keys=33, key_start=24, device=device)
    assert torch.equal(part, whole[:, 4:7, 20:31, 24:33])


def test_offset_counts_blocks_of_four(device):
    # Counter = offset + pos // 4: offset + 1 is the same stream four positions on.
    a = rudnn.dropout_mask(1, 1, 1, 64, 0.5, 3, 10, device=device)
    b = rudnn.dropout_mask(1, 1, 1, 64, 0.5, 3, 11, device=device)
    assert torch.equal(a[..., 4:], b[..., :-4])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_mask_dtypes(device, dtype):
    mask = rudnn.dropout_mask(2, 2, 9, 9, 0.25, 5, 0, dtype=dtype, device=device)
    reference = rudnn.dropout_mask(2, 2, 9, 9, 0.25, 5, 0, dtype=torch.float64, device=device)
    assert mask.dtype == dtype and torch.equal(mask, reference.to(dtype))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropped_fraction(device, p):
    n = 4 * 8 * 128 * 128
    dropped = (rudnn.dropout_mask(4, 8, 128, 128, p, 2024, 0, device=device) == 0).sum().item()
    # Binomial(n, p): five standard deviations.
    assert abs(dropped - n * p) <= 5 * math.sqrt(n * p * (1 - p))


def _keep(shape, p, seed, offset):
    return rudnn.dropout_mask(*shape, p, seed, offset, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["plain", "causal", "gqa", "float mask"])
def test_attention_equals_masked_math(device, dtype, variant):
    # Attention with dropout = attention whose probabilities are multiplied by rudnn.dropout_mask.
    p, seed, offset = 0.3, 1234, 56
    B, H, Hk, L, S = 2, 4, (2 if variant == "gqa" else 4), 37, 45
    mask = torch.randn(B, 1, L, S, dtype=torch.float64) if variant == "float mask" else None
    case.run(device, dtype, (B, H, L, 24), (B, Hk, S, 24), (B, Hk, S, 16), attn_mask=mask,
             is_causal=variant == "causal", enable_gqa=variant == "gqa", mask_grad=mask is not None,
             dropout=(p, seed, offset), keep=_keep((B, H, L, S), p, seed, offset))


def test_dropout_one_gives_zeros_and_keeps_nan(device):
    q, k, v = (torch.randn(1, 2, 6, 8, device=device) for _ in range(3))
    assert torch.equal(rudnn.scaled_dot_product_attention(q, k, v, dropout_p=1.0), torch.zeros(1, 2, 6, 8,
                                                                                               device=device))
    v[0, 0, 3, 2] = float("nan")
    out = rudnn.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    assert out[0, 0, :, 2].isnan().all() and (out[0, 0, :, [0, 1, 3]] == 0).all() and (out[0, 1] == 0).all()


def test_head_shards_reproduce_whole(device):
    # Tensor parallel: heads computed apart, each told where it sits, give the whole problem's result.
    q, k, v = (torch.randn(2, 8, 30, 16, device=device) for _ in range(3))
    whole = rudnn.scaled_dot_product_attention(q, k, v, dropout_p=0.4, dropout_seed=11, dropout_offset=3)
    for start in (0, 3, 6):
        shard = rudnn.DropoutShard(global_heads=8, head_start=start)
        part = rudnn.scaled_dot_product_attention(q[:, start:start + 2], k[:, start:start + 2],
                                                  v[:, start:start + 2], dropout_p=0.4, dropout_seed=11,
                                                  dropout_offset=3, dropout_shard=shard)
        torch.testing.assert_close(part, whole[:, start:start + 2], rtol=0, atol=0)


def test_query_shards_reproduce_whole(device):
    # Context parallel over queries, with causality on global positions.
    q, k, v = (torch.randn(1, 2, 64, 16, dtype=torch.float64, device=device) for _ in range(3))
    whole = rudnn.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True, dropout_seed=5)
    for start in (0, 16, 40):
        shard = rudnn.DropoutShard(global_queries=64, query_start=start)
        part = rudnn.scaled_dot_product_attention(q[:, :, start:start + 24], k, v, dropout_p=0.2, is_causal=True,
                                                  dropout_seed=5, dropout_shard=shard)
        torch.testing.assert_close(part, whole[:, :, start:start + 24], rtol=1e-12, atol=1e-12)


def test_manual_seed_repeats_and_calls_differ(device):
    q, k, v = (torch.randn(2, 2, 16, 8, device=device) for _ in range(3))
    torch.manual_seed(42)
    first = rudnn.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    second = rudnn.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(42)
    again = rudnn.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(first, again) and not torch.equal(first, second)


def test_backward_regenerates_the_forward_mask(device):
    # With a generator-drawn seed, backward must regenerate the forward's bits from the saved state.
    import reference as ref
    q, k, v = (torch.randn(1, 2, 12, 8, dtype=torch.float64, device=device, requires_grad=True) for _ in range(3))
    out, _, state = torch.ops.rudnn.attention_forward(q, k, v, None, 0.5, False, None, False, None, None,
                                                      [-1, 0, -1, 0, -1, 0])
    seed, offset = (w % 2**64 for w in state.tolist())
    keep = rudnn.dropout_mask(1, 2, 12, 12, 0.5, seed, offset, dtype=torch.float64, device=device)
    r = [t.detach().requires_grad_() for t in (q, k, v)]
    r_out = ref.attention(*r, keep=keep)[0]
    torch.testing.assert_close(out, r_out, rtol=1e-12, atol=1e-12)
    for g, e in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(r_out.sum(), r)):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)
