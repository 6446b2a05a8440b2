"""A small grid of shapes for compute-sanitizer: odd sizes, masks, dropout, GQA, documents, fused RoPE, every
dtype (or the dtypes named: python benchmarks/sanitize_grid.py float16). Each dtype's line is printed
when it is done, so that a run cut by its time limit still says what it covered."""
import sys

import torch

import rudnn

torch.manual_seed(0)
for dtype in [getattr(torch, name) for name in sys.argv[1:]] or (torch.float16, torch.float32, torch.float64):
    # (150, 100): two key tiles of a head adding dQ in turns; (40, 200): four bands of one key tile
    # (float32/float64 CUDA-core backward); (130, 300) at E = 64: several tiles each way on the
    # wgmma kernels, whose fused RoPE turns the next tile while this one's products run; (16, 300):
    # the one-group forward's turner group over three key tiles
    for L, S, E, Ev, hq, hk in ((1, 1, 8, 8, 1, 1), (17, 33, 40, 24, 4, 2), (70, 45, 130, 136, 2, 1),
                                (150, 100, 24, 24, 2, 2), (40, 200, 24, 24, 2, 2), (130, 300, 64, 64, 2, 1),
                                (16, 300, 64, 64, 2, 1)):
        for variant in ("plain", "causal", "bool mask", "float mask", "dropout", "documents", "rope"):
            q = torch.randn(2, hq, L, E, device="cuda", dtype=dtype, requires_grad=True)
            k = torch.randn(2, hk, S, E, device="cuda", dtype=dtype, requires_grad=True)
            v = torch.randn(2, hk, S, Ev, device="cuda", dtype=dtype, requires_grad=True)
            mask = None
            if variant == "bool mask":
                mask = torch.rand(L, S, device="cuda") > 0.3
            elif variant == "float mask":
                mask = torch.randn(hq, 1, S, device="cuda", dtype=dtype, requires_grad=True)
            documents = None
            if variant == "documents":  # a causal split into three, one of them empty on the keys' side
                documents = (torch.arange(L, device="cuda") * 3 // L, torch.arange(S, device="cuda") * 3 // S * 2)
            out = rudnn.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                     is_causal=variant in ("causal", "documents"),
                                                     dropout_p=0.3 if variant == "dropout" else 0.0,
                                                     enable_gqa=hq != hk, document_ids=documents,
                                                     rope=rudnn.Rotary(offset=3) if variant == "rope" else None)
            out.backward(torch.randn_like(out))
    mask = rudnn.dropout_mask(2, 3, 5, 7, 0.5, 1, 2, dtype=dtype, device="cuda")
    torch.cuda.synchronize()
    print(f"{dtype} done", flush=True)
print("sanitize grid done")
