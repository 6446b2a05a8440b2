"""Bad inputs get a Python exception naming the argument and the rule it breaks."""
import pytest
import torch

import rudnn

sdpa = rudnn.scaled_dot_product_attention


def qkv(q=(2, 4, 5, 8), k=(2, 4, 6, 8), v=(2, 4, 6, 8), dtype=torch.float32):
    return torch.randn(q, dtype=dtype), torch.randn(k, dtype=dtype), torch.randn(v, dtype=dtype)


CASES = [
    ("rank", lambda: sdpa(*qkv((8,), (8,), (8,))), RuntimeError, "at least 2 dimensional"),
    ("dtype mismatch", lambda: sdpa(torch.randn(1, 2, 3), torch.randn(1, 2, 3, dtype=torch.float64),
                                    torch.randn(1, 2, 3)), RuntimeError, "same dtype"),
    ("integer dtype", lambda: sdpa(*(torch.ones(1, 2, 3, dtype=torch.int32),) * 3), RuntimeError,
     "float16, bfloat16, float32 or float64"),
    ("head dim", lambda: sdpa(*qkv(k=(2, 4, 6, 7))), RuntimeError, "key's last dimension .7. must equal query's"),
    ("key/value length", lambda: sdpa(*qkv(v=(2, 4, 3, 8))), RuntimeError,
     "value's sequence length .size.-2. = 3. must equal key's .6."),
    ("batch", lambda: sdpa(*qkv(k=(3, 4, 6, 8), v=(3, 4, 6, 8))), RuntimeError, "must match"),
    ("heads without gqa", lambda: sdpa(*qkv(k=(2, 2, 6, 8), v=(2, 2, 6, 8))), RuntimeError,
     "head counts .4, 2, 2. must be equal or 1; pass enable_gqa=True"),
    ("gqa divisibility", lambda: sdpa(*qkv(k=(2, 3, 6, 8), v=(2, 3, 6, 8)), enable_gqa=True), RuntimeError,
     "Number of heads in key and value must divide the number of heads in query"),
    ("key/value heads", lambda: sdpa(*qkv(q=(2, 8, 5, 8), k=(2, 2, 6, 8), v=(2, 4, 6, 8)), enable_gqa=True),
     RuntimeError, "key and value head counts .2 and 4. must be equal, or one of them 1"),
    ("mask dtype", lambda: sdpa(*qkv(), attn_mask=torch.ones(5, 6, dtype=torch.int32)), RuntimeError,
     "attn_mask dtype to be bool or float or to match query dtype"),
    ("mask float dtype", lambda: sdpa(*qkv(), attn_mask=torch.ones(5, 6, dtype=torch.float64)), RuntimeError,
     "attn_mask dtype to be bool or float or to match query dtype"),
    ("mask shape", lambda: sdpa(*qkv(), attn_mask=torch.ones(5, 7)), RuntimeError,
     r"attn_mask of shape \[5, 7\] does not broadcast to the attention shape \[2, 4, 5, 6\]"),
    ("mask rank", lambda: sdpa(*qkv(), attn_mask=torch.ones(1, 2, 4, 5, 6)), RuntimeError,
     "does not broadcast to the attention shape"),
    ("mask with causal", lambda: sdpa(*qkv(), attn_mask=torch.ones(5, 6, dtype=torch.bool), is_causal=True),
     RuntimeError, "Explicit attn_mask should not be set when is_causal=True"),
    ("dropout above 1", lambda: sdpa(*qkv(), dropout_p=1.5), RuntimeError,
     "dropout probability has to be between 0 and 1, but got 1.5"),
    ("dropout below 0", lambda: sdpa(*qkv(), dropout_p=-0.1), RuntimeError,
     "dropout probability has to be between 0 and 1, but got -0.1"),
    ("dropout nan", lambda: sdpa(*qkv(), dropout_p=float("nan")), RuntimeError,
     "dropout probability has to be between 0 and 1"),
    ("numerics", lambda: sdpa(*qkv(), numerics="fast"), ValueError,
     "numerics must be None, 'exact' or 'flash', but got 'fast'"),
    ("seed range", lambda: sdpa(*qkv(), dropout_p=0.1, dropout_seed=2**64), ValueError,
     r"dropout_seed must be in \[0, 2\*\*64\)"),
    ("offset without seed", lambda: sdpa(*qkv(), dropout_p=0.1, dropout_offset=3), ValueError,
     "dropout_offset needs dropout_seed"),
    ("shard start", lambda: sdpa(*qkv(), dropout_shard=rudnn.DropoutShard(global_heads=4, head_start=2)),
     ValueError, r"heads start \(2\) \+ local heads \(4\) exceeds global heads \(4\)"),
    ("negative shard", lambda: sdpa(*qkv(), dropout_shard=rudnn.DropoutShard(query_start=-1)), ValueError,
     "queries start must be >= 0"),
    ("mask size", lambda: rudnn.dropout_mask(2, 3, -1, 4, 0.5, 0, 0), ValueError,
     "dropout_mask size must be 4 non-negative sizes"),
    ("mask p", lambda: rudnn.dropout_mask(2, 3, 4, 4, 2.0, 0, 0), ValueError,
     "dropout probability has to be between 0 and 1, but got 2"),
    ("mask dtype int", lambda: rudnn.dropout_mask(2, 3, 4, 4, 0.5, 0, 0, dtype=torch.int64), ValueError,
     "dropout_mask dtype must be a floating-point type"),
    ("mask shard", lambda: rudnn.dropout_mask(2, 3, 4, 4, 0.5, 0, 0, global_keys=3), ValueError,
     r"keys start \(0\) \+ local keys \(4\) exceeds global keys \(3\)"),
]


@pytest.mark.parametrize("name,call,error,message", CASES, ids=[c[0] for c in CASES])
def test_error(name, call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_backward_checks_its_inputs():
    q, k, v = qkv()
    out, lse, state = torch.ops.rudnn.attention_forward(q, k, v, None, 0.0, False, None, False, None, None,
                                                        [-1, 0, -1, 0, -1, 0])
    with pytest.raises(RuntimeError, match=r"grad_out must have shape \[2, 4, 5, 8\], but got \[2, 4, 5, 7\]"):
        torch.ops.rudnn.attention_backward(out[..., :7], None, q, k, v, None, out, lse, 0.0, False, None, False,
                                           None, state, [-1, 0, -1, 0, -1, 0], False)
    with pytest.raises(RuntimeError, match="grad_out must be Float on cpu, but is BFloat16 on cpu"):
        torch.ops.rudnn.attention_backward(out.bfloat16(), None, q, k, v, None, out, lse, 0.0, False, None, False,
                                           None, state, [-1, 0, -1, 0, -1, 0], False)
    with pytest.raises(RuntimeError, match="lse must be Float on cpu, but is Double on cpu"):
        torch.ops.rudnn.attention_backward(out, None, q, k, v, None, out, lse.double(), 0.0, False, None, False,
                                           None, state, [-1, 0, -1, 0, -1, 0], False)
    with pytest.raises(RuntimeError, match="mask_grad needs a floating-point attn_mask"):
        torch.ops.rudnn.attention_backward(out, None, q, k, v, None, out, lse, 0.0, False, None, False, None, state,
                                           [-1, 0, -1, 0, -1, 0], True)
    with pytest.raises(ValueError, match=r"dropout state must be an int64 tensor holding \(seed, offset\) on cpu"):
        torch.ops.rudnn.attention_backward(out, None, q, k, v, None, out, lse, 0.5, False, None, False, None, state,
                                           [-1, 0, -1, 0, -1, 0], False)
