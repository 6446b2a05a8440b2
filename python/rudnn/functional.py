"""Forward and backward as two calls, for engines that manage their own gradients (seed 004):
the forward returns what the backward needs, and the backward can add into existing gradient
buffers (micro-step accumulation). Autograd runs the same two operators."""
from typing import NamedTuple

import torch

from .attention import DropoutShard, document_pair, forward_op
from .rotary import rotary_tables


class AttentionStats(NamedTuple):
    """What attention_backward needs from attention_forward besides the inputs and the output."""

    lse: torch.Tensor  # (N..., H, L): log-sum-exp of each query row, float32 (float64 for float64 inputs)
    dropout_state: torch.Tensor  # (seed, offset) of the dropout mask, int64; empty without dropout


def attention_forward(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False, *, document_ids=None, rope=None, dropout_seed=None, dropout_offset=None,
                      dropout_shard=None, numerics=None):
    """(out, AttentionStats): scaled_dot_product_attention's output, with no autograd graph, and
    the statistics attention_backward takes. Arguments as in scaled_dot_product_attention."""
    with torch.no_grad():
        out, lse, state = forward_op(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                     document_ids, dropout_seed, dropout_offset, dropout_shard, numerics, True, rope)
    return out, AttentionStats(lse, state)


def attention_backward(grad_out, query, key, value, out, stats, attn_mask=None, dropout_p=0.0, is_causal=False,
                       scale=None, enable_gqa=False, *, document_ids=None, rope=None, dropout_shard=None,
                       numerics=None, grad_lse=None, mask_grad=False, deterministic=True, dq=None, dk=None, dv=None):
    """(dq, dk, dv, dmask) of attention_forward's call with the same arguments, given the gradient
    of its output (and of its LSE, grad_lse).

    dq, dk, dv: optional buffers of the inputs' shapes; the gradients are added into them (+=) and
    the buffers returned. mask_grad: also the float attn_mask's gradient (else dmask is None).
    With rope, the gradients are those of the un-rotated query and key.
    """
    shard = (dropout_shard if dropout_shard is not None else DropoutShard()).as_list()
    query_ids, key_ids = document_pair(document_ids, query, key)
    query_table, key_table, interleaved = rotary_tables(rope, query, key)
    with torch.no_grad():
        grads = torch.ops.rudnn.attention_backward(grad_out, grad_lse, query, key, value, attn_mask, out, stats.lse,
                                                   float(dropout_p), bool(is_causal), scale, bool(enable_gqa),
                                                   numerics, stats.dropout_state, shard, bool(mask_grad),
                                                   bool(deterministic), query_ids, key_ids, query_table, key_table,
                                                   interleaved)
        result = []
        for grad, buffer, name in zip(grads[:3], (dq, dk, dv), ("dq", "dk", "dv")):
            if buffer is None:
                result.append(grad)
                continue
            if buffer.shape != grad.shape:
                raise ValueError(f"{name} must have shape {tuple(grad.shape)}, but got {tuple(buffer.shape)}")
            result.append(buffer.add_(grad))
    return (*result, grads[3] if mask_grad else None)
