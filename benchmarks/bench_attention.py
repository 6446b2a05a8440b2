"""Benchmark rudnn against each PyTorch SDPA backend on the same inputs, in one run.

    python benchmarks/bench_attention.py [--device cpu|cuda] [--sets issue,sweep,fallback]
        [--cases E128,E256] [--impls rudnn,flash] [--modes fwd] [--json results.json] [--png plot.png]
    python benchmarks/bench_attention.py --plot-only results.json --png plot.png

Prints a markdown table (time, TFLOP/s, peak memory, rudnn's speed-up over each backend) with the
device and versions, writes the raw numbers as JSON and a plot of TFLOP/s as PNG.
"""
import argparse
import dataclasses
import json

import torch

from rudnn import benchmark

CPU_CASES = [
    benchmark.Case(2, 8, 1024, 64),
    benchmark.Case(2, 8, 1024, 64, causal=True),
    benchmark.Case(2, 8, 1024, 64, kv_heads=2),
    benchmark.Case(2, 8, 1024, 64, mask="bool"),
    benchmark.Case(2, 8, 1024, 64, mask="float-grad"),
    benchmark.Case(2, 8, 1024, 64, dropout=0.1),
    benchmark.Case(2, 8, 1024, 64, dtype=torch.bfloat16),
    benchmark.Case(1, 4, 4096, 64, causal=True),
]

def _bf16(batch, heads, length, head_dim, **kw):
    return benchmark.Case(batch, heads, length, head_dim, dtype=torch.bfloat16, **kw)


# Issue 4's table: bf16, E = 128 unless said, L = S = 4096, B x H = 8 x 16 (16 x 16 for E = 64).
ISSUE_CASES = [
    _bf16(8, 16, 4096, 128),
    _bf16(8, 16, 4096, 128, kv_heads=2),
    _bf16(8, 16, 4096, 128, mask="bool"),
    _bf16(8, 16, 4096, 128, mask="float"),
    _bf16(8, 16, 4096, 128, mask="float-grad"),
    _bf16(8, 16, 4096, 128, dropout=0.1),
    _bf16(8, 16, 4096, 192, value_dim=128),
    _bf16(8, 16, 4096, 256),
    _bf16(2, 16, 16384, 64),
]
# E in {64, 128, 256}, L = S from 512 to 16384 with B L = 32768 tokens, causal or not.
SWEEP_CASES = [_bf16(32768 // length, 16, length, e, causal=causal)
               for e in (64, 128, 256) for length in (512, 2048, 8192, 16384) for causal in (False, True)]
# Issue 3's CUDA-core cases: float32 with a bool mask and dropout; then two that keep the
# backward's query-owned dQ kernel (causal; more key tiles than query tiles).
FALLBACK_CASES = [benchmark.Case(4, 16, 2048, 64, dtype=torch.float32, mask="bool", dropout=0.1),
                  benchmark.Case(4, 16, 2048, 64, dtype=torch.float32, causal=True, dropout=0.1),
                  benchmark.Case(4, 16, 512, 64, keys=4096, dtype=torch.float32, mask="bool", dropout=0.1)]
CUDA_SETS = {"issue": ISSUE_CASES, "sweep": SWEEP_CASES, "fallback": FALLBACK_CASES}


def plot(results, path):
    """Bars of TFLOP/s per case, one per implementation, forward and forward+backward."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in results))
    impls = list(dict.fromkeys(r["impl"] for r in results))
    fig, axes = plt.subplots(2, 1, figsize=(max(10, 0.6 * len(cases) * len(impls) / 2), 10), sharex=True)
    width = 0.8 / len(impls)
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        values = {(r["case"], r["impl"]): r["tflops"] for r in results if r["mode"] == mode}
        for n, impl in enumerate(impls):
            ax.bar([c + n * width for c in range(len(cases))], [values.get((case, impl), 0.0) or 0.0
                                                                 for case in cases], width, label=impl)
        ax.set_ylabel(f"TFLOP/s, {mode}")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(ncol=len(impls))
    axes[1].set_xticks([c + 0.4 - width / 2 for c in range(len(cases))], cases, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=benchmark.default_device())
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--sets", default="issue,sweep,fallback", help="CUDA case sets: " + ", ".join(CUDA_SETS))
    parser.add_argument("--cases", help="only the cases whose name holds one of these comma-separated strings")
    parser.add_argument("--impls", help="only these implementations, comma-separated: rudnn, flash, efficient, "
                        "cudnn, math (default: all of the device's)")
    parser.add_argument("--modes", default="fwd,fwd+bwd", help="fwd, fwd+bwd or both")
    parser.add_argument("--png", help="plot TFLOP/s here (needs matplotlib)")
    parser.add_argument("--plot-only", metavar="JSON", help="plot the results of an earlier --json run, run nothing")
    args = parser.parse_args()
    if args.plot_only:
        with open(args.plot_only) as f:
            plot(json.load(f)["results"], args.png)
        return
    torch.manual_seed(0)
    if torch.device(args.device).type == "cuda":
        cases = [c for name in args.sets.split(",") for c in CUDA_SETS[name]]
    else:
        cases = CPU_CASES
    if args.cases:
        cases = [c for c in cases if any(part in c.name for part in args.cases.split(","))]
    impls = None
    if args.impls:
        impls = [name if name == "rudnn" else f"torch {name}" for name in args.impls.split(",")]
    modes = [{"fwd": False, "fwd+bwd": True}[mode] for mode in args.modes.split(",")]
    results = benchmark.run(cases, args.device, backward_modes=modes, repeats=args.repeats, impls=impls)
    benchmark.report(args.device, f"median of {args.repeats} runs", benchmark.table(results),
                     [dataclasses.asdict(r) for r in results], args.json)
    if args.png:
        plot([dataclasses.asdict(r) for r in results], args.png)


if __name__ == "__main__":
    main()
