"""Benchmark rudnn against each PyTorch SDPA backend on the same inputs, in one run.

    python benchmarks/bench_attention.py [--device cpu|cuda] [--json results.json]

Prints a markdown table (time, TFLOP/s, peak memory, rudnn's speed-up over each backend) with the
device and versions, and writes the raw numbers as JSON.
"""
import argparse
import dataclasses
import datetime
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

CUDA_CASES = [
    benchmark.Case(4, 16, 2048, 64, dtype=torch.float32, mask="bool", dropout=0.1),
    benchmark.Case(4, 16, 4096, 128, dtype=torch.bfloat16),
    benchmark.Case(4, 16, 4096, 128, dtype=torch.bfloat16, causal=True),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=benchmark.default_device())
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.manual_seed(0)
    cases = CUDA_CASES if torch.device(args.device).type == "cuda" else CPU_CASES
    results = benchmark.run(cases, args.device, repeats=args.repeats)
    print(f"{datetime.date.today()}, {benchmark.environment(args.device)}, median of {args.repeats} runs")
    print(benchmark.table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": str(datetime.date.today()), "environment": benchmark.environment(args.device),
                       "results": [dataclasses.asdict(r) for r in results]}, f, indent=1)


if __name__ == "__main__":
    main()
