"""Long rows on the GPU: bf16, E = 64, causal, forward and backward at L = S up to 65536.
Prints time and peak memory per length: memory must grow linearly in L, never as L x S."""
import torch

import rudnn
from rudnn import benchmark

torch.manual_seed(0)
heads = 4
print(f"{benchmark.environment('cuda')}; B=1, H={heads}, E=64, bf16, causal")
print("| L = S | forward (ms) | fwd+bwd (ms) | peak fwd+bwd (MiB) | inputs+outputs+grads (MiB) |")
print("|---|---|---|---|---|")
for length in (16384, 32768, 65536):
    q, k, v = (torch.randn(1, heads, length, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)

    def forward():
        with torch.no_grad():
            return rudnn.scaled_dot_product_attention(q, k, v, is_causal=True)

    def step():
        out = rudnn.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    fwd = benchmark.median_time(forward, "cuda", warmup=1, repeats=3)
    both = benchmark.median_time(step, "cuda", warmup=1, repeats=3)
    peak = benchmark.peak_memory(step, "cuda")
    tensors = 4 * q.numel() * q.element_size()  # out, dq, dk, dv
    print(f"| {length} | {fwd * 1e3:.1f} | {both * 1e3:.1f} | {peak / 2**20:.1f} | {tensors / 2**20:.1f} |")
