"""Where the GPU time goes: per-kernel CUDA time of rudnn's forward and backward on the issue's
benchmark cases, from torch.profiler."""
import torch
from torch.profiler import ProfilerActivity, profile

import rudnn
from rudnn import benchmark

CASES = [benchmark.Case(8, 16, 4096, 128, dtype=torch.bfloat16),
         benchmark.Case(8, 16, 4096, 128, dtype=torch.bfloat16, causal=True),
         benchmark.Case(8, 16, 4096, 128, dtype=torch.bfloat16, mask="bool"),
         benchmark.Case(8, 16, 4096, 128, dtype=torch.bfloat16, dropout=0.1),
         benchmark.Case(4, 16, 2048, 64, dtype=torch.float32, mask="bool", dropout=0.1)]

for case in CASES:
    q, k, v, mask = case.inputs("cuda", True)
    grad = torch.randn_like(q)

    def step():
        out = rudnn.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=case.dropout,
                                                 is_causal=case.causal)
        torch.autograd.grad(out, (q, k, v), grad)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(case.name)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
