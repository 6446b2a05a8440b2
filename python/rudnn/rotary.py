"""Rotary position embedding (SPEC 6, seed 004) with autograd: pair p of head dim E turns by the
angle (position + offset) * base^(-2p/E); the backward turns the gradient back (the inverse
rotation). Angles are float32 whatever the input dtype, as in seed 004.

Fused into attention (`rope=Rotary(...)` on the attention functions), the kernels turn Q and K as
they read them and the rotated tensors are never written to memory; the kernels read the angles'
cosines and sines from a float32 table per side."""
from typing import NamedTuple, Optional

import torch


def rotary_angles(positions, head_dim, base, offset):
    """(..., E/2) float32 angles of `positions` (...)."""
    pair = torch.arange(head_dim // 2, device=positions.device, dtype=torch.float32)
    theta = torch.pow(torch.tensor(float(base), dtype=torch.float32, device=positions.device), pair * (-2.0 / head_dim))
    return (positions.to(torch.float32) + float(offset)).unsqueeze(-1) * theta


def rotary_table(positions, head_dim, base, offset):
    """(..., E) float32 table of `positions` (...): the cosines of the E/2 angles, then their sines
    (the kernels' layout, csrc/attention_params.h)."""
    angles = rotary_angles(positions, head_dim, base, offset)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _rotate(x, cos, sin, interleaved):
    """Turns the pairs of x by the angles whose cosine and sine are given (..., E/2)."""
    if interleaved:
        first, second = x[..., 0::2], x[..., 1::2]
    else:
        first, second = x.chunk(2, dim=-1)
    turned = (first * cos - second * sin, first * sin + second * cos)
    if interleaved:
        return torch.stack(turned, dim=-1).flatten(-2)
    return torch.cat(turned, dim=-1)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        return _rotate(x.to(compute), cos.to(compute), sin.to(compute), interleaved).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        compute = torch.float64 if grad.dtype == torch.float64 else torch.float32
        return _rotate(grad.to(compute), cos.to(compute), -sin.to(compute), ctx.interleaved).to(grad.dtype), None, \
            None, None


def _broadcasts(shape, target):
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def _positions(positions, x):
    """positions for the rows of x (..., L, E), checked; None: 0 .. L - 1 along dim -2."""
    if positions is None:
        return torch.arange(x.size(-2), device=x.device)
    if not isinstance(positions, torch.Tensor):
        raise ValueError(f"positions must be a tensor or None, but got {type(positions).__name__}")
    if not _broadcasts(positions.shape, x.shape[:-1]):
        raise ValueError(f"positions of shape {tuple(positions.shape)} do not broadcast to x's rows "
                         f"{tuple(x.shape[:-1])}")
    return positions.to(x.device)


class Rotary(NamedTuple):
    """RoPE fused into attention: `rope=Rotary(...)` (or `rope=True` for the defaults) gives the
    result of apply_rotary on query and key, then attention, without writing the rotated tensors;
    the gradients reach the un-rotated query and key.

    positions / key_positions: the positions of the query / key rows, broadcastable to
    query.shape[:-1] / key.shape[:-1]; None: 0 .. L - 1 / 0 .. S - 1 (varlen_attention: positions
    within each document). offset is added to the query positions, key_offset (None: offset) to
    the key positions. base and interleaved as in apply_rotary.
    """

    positions: Optional[torch.Tensor] = None
    key_positions: Optional[torch.Tensor] = None
    offset: int = 0
    key_offset: Optional[int] = None
    base: float = 10000.0
    interleaved: bool = False


def rotary_tables(rope, query, key):
    """(query table, key table, interleaved) of `rope` (None, True or a Rotary) for attention on
    query (..., L, E) and key (..., S, E); (None, None, False) without RoPE."""
    if rope is None or rope is False:
        return None, None, False
    if rope is True:
        rope = Rotary()
    if not isinstance(rope, Rotary):
        raise ValueError(f"rope must be None, True or a rudnn.Rotary, but got {type(rope).__name__}")
    if query.size(-1) % 2 != 0:
        raise ValueError(f"RoPE needs an even head dim, but got E = {query.size(-1)}")
    key_offset = rope.offset if rope.key_offset is None else rope.key_offset
    head_dim = query.size(-1)
    return (rotary_table(_positions(rope.positions, query), head_dim, rope.base, rope.offset),
            rotary_table(_positions(rope.key_positions, key), head_dim, rope.base, key_offset), bool(rope.interleaved))


def apply_rotary(x, *, positions=None, offset=0, base=10000.0, interleaved=False):
    """x (..., L, E) rotated by RoPE.

    positions: the position of each row, broadcastable to x.shape[:-1] (for example (L,), (N, 1, L)
    for (N, H, L, E), or (T, 1) for packed (T, H, E) tokens); None: 0 .. L - 1 along dim -2.
    offset is added to every position. interleaved: pairs (2p, 2p + 1), as in seed 004; otherwise
    the half-split pairs (p, p + E/2) of most model code. Differentiable in x.
    """
    if x.dim() < 2 or x.size(-1) % 2 != 0:
        raise ValueError(f"apply_rotary needs x of shape (..., L, E) with E even, but got {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"apply_rotary needs a floating-point x, but got {x.dtype}")
    angles = rotary_angles(_positions(positions, x), x.size(-1), base, offset)
    return _Rotary.apply(x, angles.cos(), angles.sin(), bool(interleaved))
