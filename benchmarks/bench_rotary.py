"""RoPE fused into attention against RoPE applied first: rudnn's rope= against rudnn.apply_rotary
(and a torch.compile'd RoPE) followed by rudnn or PyTorch's attention, on the same inputs.

    python benchmarks/bench_rotary.py [--json results.json]

Forward and forward+backward (the gradients of the un-rotated Q, K, V); bf16 on the GPU. Square
training shapes, where attention's products dominate, and few queries over a long key sequence
(decoding, a prefill chunk), where reading K does.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import rudnn
from rudnn import benchmark

CASES = {  # name: (B, Hq, Hk, L, S, E, causal)
    "E=128, L=4096": (4, 16, 16, 4096, 4096, 128, False),
    "E=128, L=4096, causal": (4, 16, 16, 4096, 4096, 128, True),
    "E=128, L=4096, GQA 16/2, causal": (4, 16, 2, 4096, 4096, 128, True),
    "E=64, L=8192, causal": (2, 16, 16, 8192, 8192, 64, True),
    "E=128, L=16, S=32768, GQA 32/8": (4, 32, 8, 16, 32768, 128, False),
    "E=128, L=256, S=16384, GQA 32/8": (4, 32, 8, 256, 16384, 128, False),
}


def compiled_rope():
    """The half-split RoPE of model code, compiled into one elementwise kernel per tensor."""
    def rope(x, cos, sin):
        first, second = x.float().chunk(2, dim=-1)
        return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1).to(x.dtype)
    return torch.compile(rope)


def implementations(q, k, v, causal, gqa):
    tables = {x.size(-2): rudnn.rotary.rotary_table(torch.arange(x.size(-2), device=x.device), x.size(-1), 10000.0,
                                                    0).chunk(2, dim=-1) for x in (q, k)}
    rope = compiled_rope()

    def torch_attention(backend):
        def attend(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return attend

    def rudnn_attention(q, k, v):
        return rudnn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    def separate(rotate, attend):
        return lambda: attend(rotate(q), rotate(k), v)

    apply_rotary = rudnn.apply_rotary
    compiled = lambda x: rope(x, *tables[x.size(-2)])  # noqa: E731
    impls = {
        "rudnn, rope= fused": lambda: rudnn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa,
                                                                         rope=True),
        "rudnn.apply_rotary, then rudnn": separate(apply_rotary, rudnn_attention),
        "compiled RoPE, then rudnn": separate(compiled, rudnn_attention),
    }
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        impls[f"compiled RoPE, then torch {name}"] = separate(compiled, torch_attention(backend))
    return impls


def main():
    args = benchmark.script_arguments(__doc__)
    rows = []
    lines = ["| case | implementation | mode | time (ms) | peak memory | fused speed-up |", "|---|---|---|---|---|---|"]
    for case, (B, hq, hk, L, S, E, causal) in CASES.items():
        q = torch.randn(B, hq, L, E, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(B, hk, S, E, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        grad = torch.randn_like(q)
        times = {}
        for name, fn in implementations(q, k, v, causal, hq != hk).items():
            for backward in (False, True):
                mode = "fwd+bwd" if backward else "fwd"

                def step(fn=fn, backward=backward, leaves=(q, k, v), grad=grad):
                    with torch.enable_grad() if backward else torch.no_grad():
                        out = fn()
                        if backward:
                            torch.autograd.grad(out, leaves, grad)

                try:
                    seconds = benchmark.median_time(step, "cuda", warmup=3, repeats=args.repeats)
                    peak = benchmark.peak_memory(step, "cuda")
                except RuntimeError as error:  # a backend that does not take these inputs
                    note = str(error).splitlines()[0][:80]
                    rows.append(dict(case=case, impl=name, mode=mode, note=note))
                    lines.append(f"| {case} | {name} | {mode} | n/a | | {note} |")
                    continue
                times[(name, mode)] = seconds
                ratio = seconds / times[("rudnn, rope= fused", mode)]
                rows.append(dict(case=case, impl=name, mode=mode, seconds=seconds, peak_bytes=peak))
                lines.append(f"| {case} | {name} | {mode} | {seconds * 1e3:.3f} | {peak / 2**20:.0f} MiB | "
                             f"{ratio:.2f}x |")
        del q, k, v, grad
        torch.cuda.empty_cache()
    benchmark.report("cuda", f"bf16, half-split RoPE, median of {args.repeats} runs", "\n".join(lines), rows,
                     args.json)


if __name__ == "__main__":
    main()
