"""rudnn: scaled dot-product attention for PyTorch.

`rudnn.scaled_dot_product_attention` is a drop-in for
`torch.nn.functional.scaled_dot_product_attention`.
"""
import torch

from . import _C  # noqa: F401  (loads the operators)
from . import ops  # noqa: F401  (their fake implementations and autograd)
from .attention import DropoutShard, Explanation, dropout_mask, explain, scaled_dot_product_attention
from .functional import AttentionStats, attention_backward, attention_forward
from .rotary import Rotary, apply_rotary
from .varlen import varlen_attention

__all__ = ["AttentionStats", "DropoutShard", "Explanation", "Rotary", "apply_rotary", "attention_backward",
           "attention_forward", "dropout_mask", "explain", "scaled_dot_product_attention", "varlen_attention"]
__version__ = "0.1.0"
