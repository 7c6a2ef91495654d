"""What a new shape costs ``F.scaled_dot_product_attention`` on CUDA, backend by backend, at the torch
attention path's decode shapes (bf16, 8 KV heads x 4 query rows as ``_decode_torch`` lays them out, dim
64, a bool mask, K/V strided views of a gathered context).

    python -m benchmarks.cudnn_sdpa          # CUDA only, ~20 s on an H200

For each batch (1, 16, 64) and backend, SDPA is called once at each of several new context lengths,
then at the same lengths again ("visits"); each visit's median call is printed. The default backend's
first visit is cuDNN building a graph per shape, which is why ``kvtier/models/attention.py``'s ``sdpa``
leaves cuDNN out (BENCHMARKS.md, ``kvtier bench gpu``, run C: the same sweeps, from an untracked copy).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvtier.models.attention import sdpa

BACKENDS = {
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
}


def call_ms(batch: int, length: int, backend: str, masked: bool = True) -> float:
    """One SDPA call (ms, synchronized) at a decode shape: q [B, 8, 4, 64], K/V [B, 8, L, 64] views."""
    q = torch.randn(batch, 8, 4, 64, device="cuda", dtype=torch.bfloat16)
    ctx = torch.randn(batch, length, 2, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = ctx[:, :, 0].transpose(1, 2), ctx[:, :, 1].transpose(1, 2)
    mask = torch.ones(batch, 1, 1, length, dtype=torch.bool, device="cuda") if masked else None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if backend == "default":
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)
    elif backend == "kvtier":
        sdpa(q, k, v, attn_mask=mask, scale=0.125)
    else:
        with sdpa_kernel(BACKENDS[backend]):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0)


def sweep(label: str, batch: int, lengths: range, backend: str, masked: bool = True, visits: int = 2) -> None:
    medians = []
    for _ in range(visits):
        calls = sorted(call_ms(batch, n, backend, masked) for n in lengths)
        medians.append(round(calls[len(calls) // 2], 3))
    print(f"{label:34s} b={batch:2d} n_lengths={len(lengths):2d} median ms per visit {medians}", flush=True)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.cudnn_sdpa: needs a CUDA device (cuDNN's SDPA is CUDA's)")
    call_ms(1, 100, "math")  # CUDA context, allocator
    for b in (1, 16, 64):
        base = 1000 + 200 * b  # lengths no earlier call used: first visits
        sweep("default, masked, 33 lengths", b, range(base, base + 33), "default", visits=3)
        sweep("default, masked, 8 lengths", b, range(base + 100, base + 108), "default", visits=3)
        sweep("default, no mask", b, range(base + 120, base + 128), "default", masked=False)
        for name in (*BACKENDS, "kvtier"):
            start = base + 140 + 10 * len(name)
            sweep(f"{name} only, masked" if name in BACKENDS else "kvtier sdpa, masked", b,
                  range(start, start + 8), name)  # fmt: skip


if __name__ == "__main__":
    main()
