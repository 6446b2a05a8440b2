"""Packed documents: document_ids and varlen_attention against float64 references with the
block-diagonal masks of the document boundaries, against each other and against a padded batch."""
import pytest
import torch

import reference as ref
import rudnn


def lengths(total, documents, generator):
    """`documents` random lengths summing to `total`, the second one empty and the third one token."""
    cuts = torch.randint(0, total, (documents - 3,), generator=generator).sort().values.tolist()
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [total - 1])]
    return sizes[:1] + [0, 1] + sizes[1:]


def ids_of(sizes):
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))


def document_mask(query_ids, key_ids, causal):
    """(..., L, S) bool: same document and, causal, key position in it <= query position in it."""
    mask = query_ids[..., :, None] == key_ids[..., None, :]
    if causal:
        def position(ids):
            first = torch.searchsorted(ids.contiguous(), ids.contiguous(), right=False)
            return torch.arange(ids.size(-1)) - first
        mask &= position(key_ids)[..., None, :] <= position(query_ids)[..., :, None]
    return mask


def compare(device, dtype, q64, k64, v64, query_ids, key_ids, causal, enable_gqa=False, dropout=None,
            document_ids=None):
    """rudnn with documents against the explicit float64 formula with their block mask (and the
    FlashAttention rule's low-precision baseline): out, LSE, dq, dk, dv."""
    q, k, v = (t.to(dtype) for t in (q64, k64, v64))
    mask = document_mask(query_ids, key_ids, causal)
    while mask.dim() < q.dim():
        mask = mask.unsqueeze(-3)
    keep = None
    extra = {}
    if dropout is not None:
        p, seed, offset = dropout
        extra = dict(dropout_p=p, dropout_seed=seed, dropout_offset=offset)
        keep = rudnn.dropout_mask(q.size(0), q.size(1), q.size(2), k.size(2), p, seed, offset, dtype=torch.float64)
    inputs = [ref.leaf(t.to(device)) for t in (q, k, v)]
    docs = document_ids if document_ids is not None else (query_ids.to(device), key_ids.to(device))
    out, lse = rudnn.scaled_dot_product_attention(*inputs, is_causal=causal, enable_gqa=enable_gqa,
                                                  document_ids=docs, return_lse=True, **extra)
    r_in = [ref.leaf(t, torch.float64) for t in (q, k, v)]
    r_out, r_lse = ref.attention(*r_in, mask, False, None, enable_gqa, keep)
    baseline = None
    if dtype in ref.LOW_PRECISION:
        b_in = [ref.leaf(t.to(device)) for t in (q, k, v)]
        b_keep = None if keep is None else keep.to(dtype).to(device)
        baseline = [ref.attention(*b_in, mask.to(device), False, None, enable_gqa, b_keep)[0]]
    ref.assert_close(out.cpu(), r_out.detach(), dtype, baseline and baseline[0].cpu(), "out")
    ref.assert_close(lse.cpu(), r_lse.detach(), torch.float64 if dtype == torch.float64 else torch.float32,
                     what="lse")
    grad_out = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    got = torch.autograd.grad(out, inputs, grad_out.to(device))
    expected = torch.autograd.grad(r_out, r_in, grad_out.double())
    if baseline is not None:
        baseline = torch.autograd.grad(baseline[0], b_in, grad_out.to(device))
    for i, (name, g, e) in enumerate(zip(["dq", "dk", "dv"], got, expected)):
        ref.assert_close(g.cpu(), e, dtype, baseline and baseline[i].cpu(), name)
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
def test_document_ids(device, dtype, causal, heads):
    # Two sequences of 203 tokens split differently, one ids tensor for queries and keys.
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([ids_of(lengths(203, n, g)) for n in (9, 4)])
    hq, hk = heads
    q64, k64, v64 = (torch.randn(2, h, 203, e, dtype=torch.float64) for h, e in ((hq, 40), (hk, 40), (hk, 72)))
    compare(device, dtype, q64, k64, v64, ids, ids, causal, enable_gqa=hq != hk, document_ids=ids.to(device))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_document_ids_queries_and_keys_differ(device, dtype, causal):
    # L != S, documents empty on one side or the other; causal aligned at each document's start.
    query_sizes, key_sizes = [5, 0, 1, 60, 30, 17], [9, 4, 0, 1, 77, 40]
    q_ids, k_ids = ids_of(query_sizes)[None], ids_of(key_sizes)[None]
    q64 = torch.randn(1, 3, sum(query_sizes), 64, dtype=torch.float64)
    k64, v64 = (torch.randn(1, 3, sum(key_sizes), 64, dtype=torch.float64) for _ in range(2))
    compare(device, dtype, q64, k64, v64, q_ids, k_ids, causal)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_document_ids_with_dropout(device, dtype):
    ids = ids_of([70, 1, 0, 96, 33])[None]
    q64, k64, v64 = (torch.randn(1, 4, 200, 64, dtype=torch.float64) for _ in range(3))
    compare(device, dtype, q64, k64, v64, ids, ids, True, dropout=(0.2, 11, 4), document_ids=ids.to(device))


def test_document_ids_broadcast_over_batch_and_mask(device):
    # ids (L,) for every batch element and head, combined with a bool mask.
    ids = ids_of([40, 3, 50])
    q, k, v = (torch.randn(2, 3, 93, 16, dtype=torch.float64, device=device) for _ in range(3))
    mask = torch.rand(93, 93, device=device) > 0.3
    out = rudnn.scaled_dot_product_attention(q, k, v, attn_mask=mask, document_ids=ids.to(device))
    expected = ref.attention(q, k, v, mask & document_mask(ids, ids, False).to(device))[0]
    ref.assert_close(out, expected, torch.float64, what="out")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_documents_tiles_are_not_read(device, dtype):
    # NaN in V of the second document: rows of the first, which share no tile with it, stay finite.
    ids = ids_of([128, 128])[None]
    q, k, v = (torch.randn(1, 2, 256, 64, dtype=dtype, device=device) for _ in range(3))
    v[0, :, 200] = float("nan")
    out = rudnn.scaled_dot_product_attention(q, k, v, document_ids=ids.to(device))
    assert out[:, :, :128].isfinite().all()
    assert out[:, :, 128:].isnan().all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_varlen_matches_document_ids_and_padded_batch(device, causal, dtype):
    sizes = [37, 0, 1, 120, 64, 9]
    total, longest, heads = sum(sizes), max(sizes), (4, 2)
    cu = torch.tensor([0] + sizes).cumsum(0).to(torch.int32).to(device)
    q, k, v = (torch.randn(total, h, 48, dtype=dtype, device=device) for h in (4, 2, 2))
    out, lse = rudnn.varlen_attention(q, k, v, cu, cu, longest, longest, is_causal=causal, enable_gqa=True,
                                      return_lse=True)
    assert out.shape == (total, 4, 48) and lse.shape == (4, total)
    ids = ids_of(sizes).to(device)
    packed = rudnn.scaled_dot_product_attention(*(t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)),
                                                is_causal=causal, enable_gqa=True, document_ids=ids)
    assert torch.equal(out, packed[0].transpose(0, 1))
    # A padded batch of the documents, keys past a document's end masked out.
    padded = torch.zeros(len(sizes), longest, heads[0], 48, dtype=dtype, device=device)
    padded_k = torch.zeros(len(sizes), longest, heads[1], 48, dtype=dtype, device=device)
    padded_v = torch.zeros_like(padded_k)
    for d, (start, size) in enumerate(zip(cu.tolist(), sizes)):
        padded[d, :size], padded_k[d, :size], padded_v[d, :size] = (t[start:start + size] for t in (q, k, v))
    valid = torch.arange(longest, device=device)[None, :] < torch.tensor(sizes, device=device)[:, None]
    mask = valid[:, None, None, :].expand(-1, 1, longest, -1)
    if causal:
        mask = mask & torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
    batch = rudnn.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (padded, padded_k, padded_v)),
                                               attn_mask=mask, enable_gqa=True).transpose(1, 2)
    rows = torch.cat([batch[d, :size] for d, size in enumerate(sizes)])
    tolerance = 1e-12 if dtype == torch.float64 else 2e-2
    torch.testing.assert_close(out, rows, atol=tolerance, rtol=0)


def test_varlen_gradients_and_dropout(device):
    sizes = [30, 1, 0, 50]
    cu = torch.tensor([0] + sizes).cumsum(0).to(device)
    q, k, v = (torch.randn(81, 2, 16, dtype=torch.float64, device=device, requires_grad=True) for _ in range(3))
    kw = dict(dropout_p=0.3, dropout_seed=5, dropout_offset=1, is_causal=True)
    out = rudnn.varlen_attention(q, k, v, cu, cu, 50, 50, **kw)
    # The packed problem's dropout positions: (0, h, t_q, t_k) of a (1, H, 81, 81) problem.
    keep = rudnn.dropout_mask(1, 2, 81, 81, 0.3, 5, 1, dtype=torch.float64, device=device)
    ids = ids_of(sizes).to(device)
    mask = document_mask(ids.cpu(), ids.cpu(), True).to(device)
    expected = ref.attention(*(t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)), mask, keep=keep)[0]
    ref.assert_close(out, expected[0].transpose(0, 1), torch.float64, what="out")
    grad = torch.randn_like(out)
    for g, e in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected[0].transpose(0, 1),
                                                                                   (q, k, v), grad)):
        ref.assert_close(g, e, torch.float64, what="grad")


def test_gradcheck_documents(device):
    ids = torch.tensor([[0, 0, 0, 1, 2, 2, 2]], device=device)
    q, k, v = (torch.randn(1, h, 7, 4, dtype=torch.float64, device=device, requires_grad=True) for h in (2, 1, 1))

    def f(q, k, v):
        return rudnn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, document_ids=ids,
                                                  dropout_p=0.25, dropout_seed=3, dropout_offset=0)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_document_errors(device):
    q = torch.randn(2, 2, 6, 8, device=device)
    k = torch.randn(2, 2, 5, 8, device=device)
    ids = torch.tensor([0, 0, 1, 1, 2, 2], device=device)
    with pytest.raises(ValueError, match="non-decreasing"):
        rudnn.scaled_dot_product_attention(q, q, q, document_ids=torch.tensor([0, 1, 0, 1, 2, 2], device=device))
    with pytest.raises(ValueError, match="integer tensor"):
        rudnn.scaled_dot_product_attention(q, q, q, document_ids=ids.float())
    with pytest.raises(ValueError, match="does not broadcast"):
        rudnn.scaled_dot_product_attention(q, q, q, document_ids=ids[:5])
    with pytest.raises(ValueError, match="as many queries as keys"):
        rudnn.scaled_dot_product_attention(q, k, k, document_ids=ids)
    cu = torch.tensor([0, 2, 6], device=device)
    packed = torch.randn(6, 2, 8, device=device)
    with pytest.raises(ValueError, match="end at the packed length 6"):
        rudnn.varlen_attention(packed, packed, packed, cu[:2], cu[:2], 4, 4)
    with pytest.raises(ValueError, match="shorter than the longest document"):
        rudnn.varlen_attention(packed, packed, packed, cu, cu, 3, 4)
    with pytest.raises(ValueError, match="same documents"):
        rudnn.varlen_attention(packed, packed, packed, cu, cu[:2], 4, 4)


def test_document_ids_with_float_mask_gradient(device):
    ids = ids_of([20, 0, 1, 45])[None]
    q, k, v = (torch.randn(2, 2, 66, 16, dtype=torch.float64, device=device, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, 1, 66, 66, dtype=torch.float64, device=device, requires_grad=True)
    out = rudnn.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=False, document_ids=ids.to(device))
    blocks = document_mask(ids, ids, False).to(device)
    expected = ref.attention(q, k, v, bias.masked_fill(~blocks, float("-inf")))[0]
    ref.assert_close(out, expected, torch.float64, what="out")
    grad = torch.randn_like(out)
    for name, g, e in zip(["dq", "dk", "dv", "dmask"], torch.autograd.grad(out, (q, k, v, bias), grad),
                          torch.autograd.grad(expected, (q, k, v, bias), grad)):
        ref.assert_close(g, e, torch.float64, what=name)
