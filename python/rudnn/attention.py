"""The public functions: the drop-in scaled_dot_product_attention and the dropout mask."""
import operator
from typing import NamedTuple, Optional

import torch

from .rotary import rotary_tables


class DropoutShard(NamedTuple):
    """Where a problem sits in a larger one whose dropout mask it must reproduce (SPEC section 3).

    A problem of `heads` heads, `queries` rows and `keys` columns is the block
    [head_start, head_start + heads) x [query_start, ...) x [key_start, ...) of a global problem
    of global_heads x global_queries x global_keys (None: the local size). Causality also uses
    these global positions: key j takes part iff key_start + j <= query_start + i.
    """

    global_heads: Optional[int] = None
    head_start: int = 0
    global_queries: Optional[int] = None
    query_start: int = 0
    global_keys: Optional[int] = None
    key_start: int = 0

    def as_list(self):
        def size(n):
            return -1 if n is None else operator.index(n)

        return [size(self.global_heads), operator.index(self.head_start), size(self.global_queries),
                operator.index(self.query_start), size(self.global_keys), operator.index(self.key_start)]


def _word64(value, name):
    """A 64-bit unsigned value as the int64 with the same bits."""
    value = operator.index(value)
    if not 0 <= value < 2**64:
        raise ValueError(f"{name} must be in [0, 2**64), but got {value}")
    return value - 2**64 if value >= 2**63 else value


def _dropout_state(seed, offset, device):
    if seed is None:
        if offset is not None:
            raise ValueError("dropout_offset needs dropout_seed")
        return None
    words = [_word64(seed, "dropout_seed"), _word64(0 if offset is None else offset, "dropout_offset")]
    return torch.tensor(words, dtype=torch.int64, device=device)


def document_pair(document_ids, query, key):
    """(query ids, key ids) from `document_ids`: None, one tensor for both (L == S), or a pair."""
    if document_ids is None:
        return None, None
    if isinstance(document_ids, torch.Tensor):
        queries, keys = query.size(-2), key.size(-2)
        if queries != keys:
            raise ValueError(f"one document_ids tensor needs as many queries as keys, but got L={queries} and "
                             f"S={keys}: pass (query_ids, key_ids)")
        return document_ids, document_ids
    query_ids, key_ids = document_ids
    return query_ids, key_ids


def forward_op(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, document_ids, dropout_seed,
               dropout_offset, dropout_shard, numerics, deterministic, rope):
    """rudnn::attention_forward on the public functions' arguments: (out, lse, dropout state)."""
    state = _dropout_state(dropout_seed, dropout_offset, query.device) if dropout_p > 0 else None
    shard = (dropout_shard if dropout_shard is not None else DropoutShard()).as_list()
    query_ids, key_ids = document_pair(document_ids, query, key)
    query_table, key_table, interleaved = rotary_tables(rope, query, key)
    return torch.ops.rudnn.attention_forward(query, key, value, attn_mask, float(dropout_p), bool(is_causal), scale,
                                             bool(enable_gqa), numerics, state, shard, bool(deterministic),
                                             query_ids, key_ids, query_table, key_table, interleaved)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, document_ids=None, rope=None, dropout_seed=None,
                                 dropout_offset=None, dropout_shard=None, return_lse=False, numerics=None,
                                 deterministic=True):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention.

    query (N..., Hq, L, E), key (N..., Hk, S, E), value (N..., Hk, S, Ev) -> (N..., Hq, L, Ev).
    Same arguments, broadcasting, dtype rules and errors as PyTorch's function; every backend
    feature (masks and their gradients, dropout with GQA, any head dims, float64) works.

    Extras:
      document_ids: packed documents (SPEC 6): integer ids (N..., L), non-decreasing along the
        sequence, for queries and keys alike, or a pair (query ids (N..., L), key ids (N..., S)).
        A query sees only the keys of its document; is_causal is then causal within each document
        (the k-th key of a document is seen from the document's k-th query on). Tiles that cross no
        document of theirs are skipped: work grows with the sum of squared document lengths.
        Documents are apart as in a batch, except that a NaN/inf in K or V can reach the rows of a
        neighbouring document that shares a tile with it. Validating the ids synchronises once.
      rope: RoPE fused into the kernels: True, or a rudnn.Rotary (positions, offsets, base,
        pairing); the result is that of rudnn.apply_rotary on query and key first, but the rotated
        tensors are never written to memory and the gradients are those of the un-rotated inputs.
      dropout_seed, dropout_offset: the 64-bit Philox seed and counter offset of the dropout mask;
        by default drawn from PyTorch's generator of the device.
      dropout_shard: a DropoutShard placing this call in a larger problem, so that pieces computed
        apart reproduce the dropout mask of the whole.
      return_lse: also return the log-sum-exp of each query row, float32 (float64 for float64
        inputs), -inf for a row with no keys; it is differentiable.
      numerics: "exact" (float32 between score and output) or "flash" (FlashAttention's rounding
        points); None picks "flash" for float16/bfloat16 and "exact" otherwise.
      deterministic: False lets the CUDA backward accumulate dQ with float atomics (the generic
        backward); the default gives bitwise-repeatable gradients. The CPU backward is
        always deterministic.
    """
    out, lse, _ = forward_op(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, document_ids,
                             dropout_seed, dropout_offset, dropout_shard, numerics, deterministic, rope)
    return (out, lse) if return_lse else out


def dropout_mask(batch, heads, queries, keys, p, seed, offset, *, global_heads=None, head_start=0,
                 global_queries=None, query_start=0, global_keys=None, key_start=0, dtype=torch.float32,
                 device=None):
    """The dropout multipliers (batch, heads, queries, keys) in {0, 1/(1-p)} of SPEC section 3.

    Attention with dropout equals attention without it whose probabilities are multiplied by this
    tensor, for the same p, seed, offset and shard.
    """
    state = _dropout_state(seed, offset, "cpu" if device is None else device)
    shard = DropoutShard(global_heads, head_start, global_queries, query_start, global_keys, key_start).as_list()
    return torch.ops.rudnn.dropout_mask(state, [batch, heads, queries, keys], float(p), shard, dtype)


class Explanation(NamedTuple):
    """Which kernels run a call, and why."""

    forward: str
    backward: str


def explain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
            rope=None, numerics=None):
    """Which kernels `scaled_dot_product_attention` with these arguments runs, forward and backward,
    and why: the tensor-core kernels, or the CUDA-core ones with the reason they were passed over
    (dtype, head dims, strides, RUDNN_DISABLE_TENSOR_CORES=1, ...). Nothing is computed."""
    query_table, key_table, interleaved = rotary_tables(rope, query, key)
    forward, backward = torch.ops.rudnn.explain(query, key, value, attn_mask, float(dropout_p), bool(is_causal),
                                                scale, bool(enable_gqa), numerics, query_table, key_table,
                                                interleaved)
    return Explanation(forward, backward)
