"""Where the GPU time goes: per-kernel CUDA time of rudnn's forward and backward on the issue's
benchmark cases, from torch.profiler.

    python benchmarks/profile_kernels.py [--cases SUBSTRING[,SUBSTRING...]] [--once] [--rope]

--once runs each selected case's forward and backward once, without torch.profiler, for an outside
profiler (ncu --kernel-name ... python benchmarks/profile_kernels.py --cases float32 --once).
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import rudnn
from rudnn import benchmark

CASES = [benchmark.Case(8, 16, 4096, 128, dtype=torch.bfloat16),
         benchmark.Case(8, 16, 4096, 128, dtype=torch.bfloat16, causal=True),
         benchmark.Case(8, 16, 4096, 128, kv_heads=2, dtype=torch.bfloat16),
         benchmark.Case(2, 16, 16384, 64, dtype=torch.bfloat16),
         benchmark.Case(8, 16, 4096, 128, dtype=torch.bfloat16, mask="bool"),
         benchmark.Case(8, 16, 4096, 128, dtype=torch.bfloat16, mask="float-grad"),
         benchmark.Case(8, 16, 4096, 128, dtype=torch.bfloat16, dropout=0.1),
         benchmark.Case(4, 16, 2048, 64, dtype=torch.float32, mask="bool", dropout=0.1)]

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--cases", default="", help="only the cases whose name holds one of these (comma-separated)")
parser.add_argument("--once", action="store_true", help="run each case once, no torch.profiler")
parser.add_argument("--rope", action="store_true", help="with RoPE fused (rope=True)")
args = parser.parse_args()

for case in CASES:
    if not any(part in case.name for part in args.cases.split(",")):
        continue
    q, k, v, mask = case.inputs("cuda", True)
    grad = torch.randn_like(q)

    def step():
        out = rudnn.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=case.dropout,
                                                 is_causal=case.causal, enable_gqa=q.size(1) != k.size(1),
                                                 rope=args.rope)
        torch.autograd.grad(out, [t for t in (q, k, v, mask) if t is not None and t.requires_grad], grad)

    step()
    torch.cuda.synchronize()
    if args.once:
        continue
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(case.name + (" RoPE" if args.rope else ""))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
