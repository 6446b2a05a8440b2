"""python -m rudnn: a self-check against PyTorch's math SDPA in float64, then a benchmark table of
rudnn against every PyTorch SDPA backend on this machine's device."""
import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import benchmark
from .attention import scaled_dot_product_attention

CHECKS = [
    dict(shape=(2, 8, 203, 64), kv_heads=8, causal=False, mask=None),
    dict(shape=(2, 8, 113, 80), kv_heads=2, causal=True, mask=None),
    dict(shape=(1, 4, 256, 128), kv_heads=4, causal=False, mask="float"),
    dict(shape=(3, 2, 17, 40), kv_heads=1, causal=False, mask="bool"),
]


def self_check(device):
    """Errors of rudnn's output and gradients against PyTorch's math SDPA run in float64 on the same
    (rounded) inputs, next to PyTorch's own error in the same dtype."""
    print(f"self-check on {device}: max |error| against PyTorch's math SDPA in float64")
    print(f"{'case':<36} {'dtype':<9} {'rudnn out':>10} {'rudnn grad':>10} {'torch out':>10} {'torch grad':>10}")
    worst = 0.0
    for check in CHECKS:
        B, H, L, E = check["shape"]
        for dtype in (torch.float32, torch.bfloat16):
            x64 = [torch.randn(B, h, L, E, dtype=torch.float64) for h in (H, check["kv_heads"], check["kv_heads"])]
            mask = None
            if check["mask"] == "float":
                mask = torch.randn(L, L, dtype=torch.float64).to(dtype).to(device)
            elif check["mask"] == "bool":
                mask = (torch.rand(L, L) > 0.2).to(device)
            grad = torch.randn(B, H, L, E, dtype=torch.float64).to(dtype)
            gqa = H != check["kv_heads"]

            def errors(fn, dtype_in):
                x = [t.to(dtype).to(dtype_in).to(device).requires_grad_() for t in x64]
                m = mask if mask is None or mask.dtype == torch.bool else mask.to(dtype_in)
                out = fn(*x, attn_mask=m, is_causal=check["causal"], enable_gqa=gqa)
                return out, torch.autograd.grad(out, x, grad.to(dtype_in).to(device))

            with sdpa_kernel(SDPBackend.MATH):
                ref_out, ref_grads = errors(F.scaled_dot_product_attention, torch.float64)
            rows = []
            for fn in (scaled_dot_product_attention, F.scaled_dot_product_attention):
                out, grads = errors(fn, dtype)
                rows.append((out.double() - ref_out).abs().max().item())
                rows.append(max((g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads)))
            name = f"{tuple(check['shape'])} Hk={check['kv_heads']}" + (" causal" if check["causal"] else "") + \
                (f" {check['mask']} mask" if check["mask"] else "")
            print(f"{name:<36} {str(dtype).replace('torch.', ''):<9} " + " ".join(f"{e:>10.2e}" for e in rows))
            worst = max(worst, rows[0] / max(rows[2], 1e-6), rows[1] / max(rows[3], 1e-6))
    print(f"largest ratio of rudnn's error to PyTorch's own: {worst:.2f} "
          f"({'passed' if worst <= 2 else 'FAILED'}: the rule is at most 2)")
    return worst <= 2


def cases(device):
    if torch.device(device).type == "cuda":
        return [benchmark.Case(4, 16, 4096, 128, dtype=torch.bfloat16),
                benchmark.Case(4, 16, 4096, 128, dtype=torch.bfloat16, causal=True),
                benchmark.Case(4, 16, 2048, 64, dtype=torch.float32, mask="bool", dropout=0.1)]
    return [benchmark.Case(2, 8, 1024, 64), benchmark.Case(2, 8, 1024, 64, causal=True),
            benchmark.Case(2, 8, 1024, 64, mask="float-grad")]


def main():
    parser = argparse.ArgumentParser(prog="python -m rudnn", description=__doc__)
    parser.add_argument("--device", default=benchmark.default_device())
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-benchmark", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    passed = self_check(args.device)
    if not args.no_benchmark:
        print()
        print(f"benchmark on {benchmark.environment(args.device)}")
        results = benchmark.run(cases(args.device), args.device, repeats=args.repeats)
        print(benchmark.table(results))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
