"""rudnn: scaled dot-product attention for PyTorch.

`rudnn.scaled_dot_product_attention` is a drop-in for
`torch.nn.functional.scaled_dot_product_attention`.
"""
import torch

from . import _C  # noqa: F401  (loads the operators)
from . import ops  # noqa: F401  (their fake implementations and autograd)
from .attention import DropoutShard, Explanation, dropout_mask, explain, scaled_dot_product_attention

__all__ = ["DropoutShard", "Explanation", "dropout_mask", "explain", "scaled_dot_product_attention"]
__version__ = "0.1.0"
