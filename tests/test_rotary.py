"""rudnn.apply_rotary against an explicit float64 rotation, its gradient, and errors."""
import math

import pytest
import torch

import rudnn


def rotated(x, positions, offset, base, interleaved):
    """The float64 reference: pair p turned by (position + offset) * base^(-2p/E)."""
    E = x.size(-1)
    theta = torch.tensor([base ** (-2 * p / E) for p in range(E // 2)], dtype=torch.float64)
    angle = (positions.double() + offset)[..., None] * theta
    x = x.double()
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : E // 2], x[..., E // 2:]
    ya, yb = a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()
    return torch.stack([ya, yb], -1).flatten(-2) if interleaved else torch.cat([ya, yb], -1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", ["default", "offset", "positions"])
def test_apply_rotary(device, interleaved, dtype, where):
    x = torch.randn(2, 3, 45, 24, dtype=torch.float64)
    positions, offset, kw = torch.arange(45), 0, {}
    if where == "offset":
        offset, kw = 1000, dict(offset=1000)
    elif where == "positions":
        positions = torch.randint(0, 5000, (2, 1, 45))
        kw = dict(positions=positions.to(device))
    got = rudnn.apply_rotary(x.to(dtype).to(device), interleaved=interleaved, base=500.0, **kw)
    expected = rotated(x.to(dtype), positions, offset, 500.0, interleaved)
    assert got.dtype == dtype
    # float32 angles: an angle a is off by about |a| 2^-24 radians (a few roundings), |x| times that
    # in the result.
    angle_error = (positions.max().item() + offset) * 2**-21 * x.abs().max().item()
    tolerance = angle_error + {torch.float64: 1e-6, torch.float32: 2e-6, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.cpu().double(), expected, rtol=0, atol=tolerance)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_gradient_is_inverse_rotation(device, interleaved):
    x = torch.randn(3, 17, 8, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: rudnn.apply_rotary(x, offset=7, interleaved=interleaved), (x,))
    y = rudnn.apply_rotary(x, offset=7, interleaved=interleaved)
    (grad,) = torch.autograd.grad(y, x, y)  # R^T R x = x: rotations are orthogonal (cos, sin in float32)
    torch.testing.assert_close(grad, x, rtol=0, atol=1e-6 * x.abs().max().item())
    assert not math.isclose(float((y - x).abs().max()), 0.0)


def test_apply_rotary_errors(device):
    with pytest.raises(ValueError, match="E even"):
        rudnn.apply_rotary(torch.randn(4, 5, device=device))
    with pytest.raises(ValueError, match="do not broadcast"):
        rudnn.apply_rotary(torch.randn(4, 6, device=device), positions=torch.arange(5, device=device))
    with pytest.raises(ValueError, match="floating-point"):
        rudnn.apply_rotary(torch.ones(4, 6, dtype=torch.int64, device=device))
