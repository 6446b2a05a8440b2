"""Rotary position embedding (SPEC 6, seed 004) with autograd: pair p of head dim E turns by the
angle (position + offset) * base^(-2p/E); the backward turns the gradient back (the inverse
rotation). Angles are float32 whatever the input dtype, as in seed 004."""
import torch


def rotary_angles(positions, head_dim, base, offset):
    """(..., E/2) float32 angles of `positions` (...)."""
    pair = torch.arange(head_dim // 2, device=positions.device, dtype=torch.float32)
    theta = torch.pow(torch.tensor(float(base), dtype=torch.float32, device=positions.device), pair * (-2.0 / head_dim))
    return (positions.to(torch.float32) + float(offset)).unsqueeze(-1) * theta


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
    if positions is None:
        positions = torch.arange(x.size(-2), device=x.device)
    elif not isinstance(positions, torch.Tensor):
        raise ValueError(f"positions must be a tensor or None, but got {type(positions).__name__}")
    elif not _broadcasts(positions.shape, x.shape[:-1]):
        raise ValueError(f"positions of shape {tuple(positions.shape)} do not broadcast to x's rows "
                         f"{tuple(x.shape[:-1])}")
    angles = rotary_angles(positions.to(x.device), x.size(-1), base, offset)
    return _Rotary.apply(x, angles.cos(), angles.sin(), bool(interleaved))
