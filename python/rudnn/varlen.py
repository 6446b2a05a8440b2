"""Attention over packed documents in the ecosystem's varlen convention (cumulative lengths)."""
import torch

from .attention import scaled_dot_product_attention
from .rotary import Rotary


def document_ids_from_lengths(cu_seqlens, total, longest, name, longest_name):
    """(1, total) int64 ids: token t belongs to document d where cu_seqlens[d] <= t < cu_seqlens[d + 1].
    Checks the lengths (one host synchronisation): they start at 0, never decrease, end at `total`,
    and none exceeds `longest`."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(f"{name} must be a 1-D integer tensor of cumulative lengths (documents + 1 entries), "
                         f"but got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    cu = cu_seqlens.to(torch.int64)
    sizes = torch.cat([cu.diff(), cu.new_zeros(1)])
    first, last, smallest, largest = torch.stack([cu[0], cu[-1], sizes.min(), sizes.max()]).tolist()
    if first != 0 or last != total or smallest < 0:
        raise ValueError(f"{name} must start at 0, never decrease and end at the packed length {total}, but got "
                         f"{cu_seqlens.tolist()}")
    if int(longest) < largest:
        raise ValueError(f"{longest_name} ({longest}) is shorter than the longest document ({largest})")
    tokens = torch.arange(total, device=cu.device)
    return torch.searchsorted(cu[1:], tokens, right=True).unsqueeze(0)


def varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, dropout_p=0.0,
                     is_causal=False, scale=None, enable_gqa=False, return_lse=False, rope=None, numerics=None,
                     dropout_seed=None, dropout_offset=None, deterministic=True):
    """Attention within each of D packed documents.

    query (Tq, Hq, E), key (Tk, Hk, E), value (Tk, Hk, Ev) -> (Tq, Hq, Ev): document d holds the
    query tokens [cu_seqlens_q[d], cu_seqlens_q[d + 1]) and the key tokens
    [cu_seqlens_k[d], cu_seqlens_k[d + 1]), D + 1 int32/int64 entries each; a document may be
    empty on either side (its queries then get zeros and an LSE of -inf). is_causal is aligned
    within each document at its first token (PyTorch's top-left rule, as in a padded batch).
    max_seqlen_q/max_seqlen_k: the ecosystem's signature, checked against the lengths.

    It is scaled_dot_product_attention on the (1, H, T, E) view of the packed tensors with
    document ids from the lengths: the same numbers, and dropout positions (0, h, t_q, t_k) of that
    packed problem (SPEC 3). return_lse: also the (Hq, Tq) log-sum-exp. rope: RoPE fused as in
    scaled_dot_product_attention; positions default to each token's position within its document,
    explicit ones are per token (Tq,) / (Tk,).
    """
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(f"varlen_attention takes packed (tokens, heads, head dim) tensors, but got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same documents, but have "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()} entries")
    query_ids = document_ids_from_lengths(cu_seqlens_q, query.size(0), max_seqlen_q, "cu_seqlens_q", "max_seqlen_q")
    key_ids = document_ids_from_lengths(cu_seqlens_k, key.size(0), max_seqlen_k, "cu_seqlens_k", "max_seqlen_k")
    if rope is True:
        rope = Rotary()
    if isinstance(rope, Rotary):
        def within_documents(positions, cu_seqlens, ids):
            if positions is not None:
                return positions
            return torch.arange(ids.size(1), device=ids.device) - cu_seqlens.to(torch.int64)[ids[0]]

        rope = rope._replace(positions=within_documents(rope.positions, cu_seqlens_q, query_ids),
                             key_positions=within_documents(rope.key_positions, cu_seqlens_k, key_ids))
    result = scaled_dot_product_attention(
        query.unsqueeze(0).transpose(1, 2), key.unsqueeze(0).transpose(1, 2), value.unsqueeze(0).transpose(1, 2),
        dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        document_ids=(query_ids, key_ids), rope=rope, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
        return_lse=return_lse, numerics=numerics, deterministic=deterministic)
    if return_lse:
        out, lse = result
        return out[0].transpose(0, 1), lse[0]
    return result[0].transpose(0, 1)
