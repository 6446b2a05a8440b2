"""Fake (meta) implementations and autograd of the rudnn operators.

The operators themselves are defined in C++ (csrc/attention_ops.cpp). The fakes let
torch.compile trace them; the autograd formula carries the forward's LSE and dropout
state to the backward operator through the autograd context.
"""
import torch


def attention_shapes(query, key, value, enable_gqa):
    """Output and LSE shapes of attention on these inputs: (N..., H, L, Ev) and (N..., H, L)."""
    rank = max(query.dim(), key.dim(), value.dim(), 3)

    def leading(t):  # (N..., heads) padded to the common rank
        return (1,) * (rank - t.dim()) + tuple(t.shape[:-2])

    q, k, v = leading(query), leading(key), leading(value)
    batch = tuple(torch.broadcast_shapes(q[:-1], k[:-1], v[:-1]))
    heads = q[-1] if enable_gqa else torch.broadcast_shapes((q[-1],), (k[-1],), (v[-1],))[0]
    length, value_dim = query.shape[-2], value.shape[-1]
    if max(query.dim(), key.dim(), value.dim()) == 2:
        return (length, value_dim), (length,)
    return (*batch, heads, length, value_dim), (*batch, heads, length)


def stats_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("rudnn::attention_forward")
def _attention_forward_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, numerics,
                            dropout_state, shard, deterministic=True, query_documents=None, key_documents=None,
                            query_rotary=None, key_rotary=None, rotary_interleaved=False):
    out_shape, lse_shape = attention_shapes(query, key, value, enable_gqa)
    out = query.new_empty(out_shape)
    lse = query.new_empty(lse_shape, dtype=stats_dtype(query.dtype))
    state = query.new_empty((2,) if dropout_p > 0 else (0,), dtype=torch.int64)
    return out, lse, state


@torch.library.register_fake("rudnn::attention_backward")
def _attention_backward_fake(grad_out, grad_lse, query, key, value, attn_mask, out, lse, dropout_p, is_causal,
                             scale, enable_gqa, numerics, dropout_state, shard, mask_grad, deterministic=True,
                             query_documents=None, key_documents=None, query_rotary=None, key_rotary=None,
                             rotary_interleaved=False):
    grad_mask = attn_mask.new_empty(attn_mask.shape) if mask_grad else query.new_empty((0,))
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), grad_mask


@torch.library.register_fake("rudnn::dropout_mask")
def _dropout_mask_fake(dropout_state, size, p, shard, dtype):
    return dropout_state.new_empty(size, dtype=dtype)


def _setup_context(ctx, inputs, output):
    (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, numerics, _, shard, deterministic,
     query_documents, key_documents, query_rotary, key_rotary, rotary_interleaved) = inputs
    out, lse, state = output
    ctx.save_for_backward(query, key, value, attn_mask, out, lse, state, query_documents, key_documents, query_rotary,
                          key_rotary)
    ctx.arguments = (dropout_p, is_causal, scale, enable_gqa, numerics, rotary_interleaved)
    ctx.shard = shard
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(state)


def _backward(ctx, grad_out, grad_lse, _grad_state):
    (query, key, value, attn_mask, out, lse, state, query_documents, key_documents, query_rotary,
     key_rotary) = ctx.saved_tensors
    dropout_p, is_causal, scale, enable_gqa, numerics, rotary_interleaved = ctx.arguments
    mask_grad = ctx.needs_input_grad[3]
    grad_query, grad_key, grad_value, grad_mask = torch.ops.rudnn.attention_backward(
        grad_out, grad_lse, query, key, value, attn_mask, out, lse, dropout_p, is_causal, scale, enable_gqa,
        numerics, state, ctx.shard, mask_grad, ctx.deterministic, query_documents, key_documents, query_rotary,
        key_rotary, rotary_interleaved)
    return (grad_query, grad_key, grad_value, grad_mask if mask_grad else None) + (None,) * 13


torch.library.register_autograd("rudnn::attention_forward", _backward, setup_context=_setup_context)
