"""Packed documents on the GPU: rudnn.varlen_attention on 64k-256k tokens against PyTorch's backends
on the same documents as a padded batch (and FlexAttention with a document mask where it compiles).

    python benchmarks/bench_documents.py [--json results.json]

Time grows with the sum of squared document lengths: the uniform cases double it at each step.
TFLOP/s count the useful products only (FlashAttention's 2 + 5 per score of a document).
"""
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import rudnn
from rudnn import benchmark

TOKENS, HEADS, HEAD_DIM = 131072, 16, 128


def document_sizes():
    """Uniform documents of 1k-8k in TOKENS tokens, then random ones of 1k-8k in TOKENS / 2, TOKENS
    and 2 TOKENS tokens (memory against the token count)."""
    cases = {f"uniform {n}": [n] * (TOKENS // n) for n in (1024, 2048, 4096, 8192)}
    g = torch.Generator().manual_seed(0)
    for tokens in (TOKENS // 2, TOKENS, 2 * TOKENS):
        mixed = []
        while sum(mixed) < tokens:
            mixed.append(min(int(torch.randint(1024, 8193, (1,), generator=g)), tokens - sum(mixed)))
        cases[f"mixed 1k-8k, {tokens // 1024}k tokens"] = mixed
    return cases


def flops(sizes, backward):
    forward = sum(4 * HEADS * n * n * HEAD_DIM for n in sizes)
    return forward * (3.5 if backward else 1.0)


def implementations(sizes):
    """name -> (run(backward) -> None) on one set of inputs."""
    cu = torch.tensor([0] + sizes, device="cuda").cumsum(0).to(torch.int32)
    longest, tokens = max(sizes), sum(sizes)

    def t(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = t(tokens, HEADS, HEAD_DIM), t(tokens, HEADS, HEAD_DIM), t(tokens, HEADS, HEAD_DIM)
    grad = torch.randn_like(q)

    def step(fn, leaves, grad_out, backward):
        out = fn()
        if backward:
            torch.autograd.grad(out, leaves, grad_out)

    impls = {"rudnn varlen": lambda backward: step(
        lambda: rudnn.varlen_attention(q, k, v, cu, cu, longest, longest), (q, k, v), grad, backward)}

    # The padded batch (D, H, longest, E), keys past each document's end masked where they exist.
    def padded():
        x = torch.zeros(len(sizes), longest, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        for d, n in enumerate(sizes):
            x[d, :n] = torch.randn(n, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        return x.transpose(1, 2).contiguous().requires_grad_(True)

    pq, pk, pv = padded(), padded(), padded()
    pgrad = torch.randn_like(pq)
    uniform = len(set(sizes)) == 1
    key_mask = None
    if not uniform:
        valid = torch.arange(longest, device="cuda")[None, :] < torch.tensor(sizes, device="cuda")[:, None]
        key_mask = valid[:, None, None, :]
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        mask = None if name == "flash" else key_mask  # flash takes no mask: timing of the padded work only

        def run(backward, backend=backend, mask=mask):
            with sdpa_kernel(backend):
                step(lambda: F.scaled_dot_product_attention(pq, pk, pv, attn_mask=mask), (pq, pk, pv), pgrad,
                     backward)

        label = f"torch {name} (padded batch)" + (", no padding mask" if name == "flash" and not uniform else "")
        impls[label] = run
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        ids = rudnn.varlen.document_ids_from_lengths(cu, tokens, longest, "cu", "longest")[0]

        def same_document(b, h, i, j):
            return ids[i] == ids[j]

        block_mask = create_block_mask(same_document, None, None, tokens, tokens, device="cuda", _compile=True)
        flex = torch.compile(flex_attention)
        fq, fk, fv = (x.detach().transpose(0, 1).unsqueeze(0).requires_grad_(True) for x in (q, k, v))
        fgrad = grad.transpose(0, 1).unsqueeze(0)
        impls["torch flex_attention (document mask)"] = lambda backward: step(
            lambda: flex(fq, fk, fv, block_mask=block_mask), (fq, fk, fv), fgrad, backward)
    except Exception as error:  # FlexAttention needs Triton and a compiler on the device
        print(f"flex_attention unavailable: {type(error).__name__}: {str(error).splitlines()[0][:100]}")
    return impls


def main():
    args = benchmark.script_arguments(__doc__)
    rows = []
    lines = ["| documents | sum of squares / 2^30 | implementation | mode | time (ms) | TFLOP/s | peak memory | "
             "rudnn speed-up |", "|---|---|---|---|---|---|---|---|"]
    for case, sizes in document_sizes().items():
        impls = implementations(sizes)
        for backward in (False, True):
            mode = "fwd+bwd" if backward else "fwd"
            times = {}
            for name, run in impls.items():
                try:
                    with warnings.catch_warnings(), torch.no_grad() if not backward else torch.enable_grad():
                        warnings.simplefilter("ignore")
                        seconds = benchmark.median_time(lambda: run(backward), "cuda", repeats=args.repeats)
                        peak = benchmark.peak_memory(lambda: run(backward), "cuda")
                except (RuntimeError, torch._dynamo.exc.BackendCompilerFailed) as error:
                    rows.append(dict(case=case, impl=name, mode=mode, note=str(error).splitlines()[0][:80]))
                    lines.append(f"| {case} | | {name} | {mode} | n/a | | | {rows[-1]['note']} |")
                    continue
                times[name] = seconds
                tflops = flops(sizes, backward) / seconds / 1e12
                squares = sum(n * n for n in sizes) / 2**30
                rows.append(dict(case=case, impl=name, mode=mode, seconds=seconds, tflops=tflops, peak_bytes=peak,
                                 documents=len(sizes), sum_of_squares=squares * 2**30))
                ratio = seconds / times["rudnn varlen"]
                lines.append(f"| {case} ({len(sizes)} docs) | {squares:.2f} | {name} | {mode} | {seconds * 1e3:.2f} | "
                             f"{tflops:.1f} | {peak / 2**20:.0f} MiB | {ratio:.2f}x |")
        del impls
        torch.cuda.empty_cache()
    benchmark.report("cuda", f"H={HEADS}, E={HEAD_DIM}, bf16, median of {args.repeats} runs", "\n".join(lines),
                     rows, args.json)


if __name__ == "__main__":
    main()
