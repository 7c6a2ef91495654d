"""The fp8_e4m3 quality study (``python -m benchmarks.kvdtype --fp8-study``) measures what it claims: its
fake-quantizing cache stores what the compact cache reads back, and its rounding levers do what
their names say on the error they optimize."""

from __future__ import annotations

import torch

from benchmarks.kvdtype_study import (
    FakeQuantCache,
    _candidates,
    _fp8,
    _other_neighbour,
    build_variants,
    fp8_flips,
    fp8_weighted,
)
from kvtier.models.kv_quant import KVFormat, PagedKVCache, hadamard


def _low_rank_h(d: int = 64, rank: int = 4) -> torch.Tensor:
    """A query second moment like SmolLM2's (effective rank ~4) plus a small isotropic floor."""
    g = torch.Generator().manual_seed(1)
    u = torch.randn(d, rank, generator=g)
    return u @ u.T + 0.05 * torch.eye(d)


def test_todays_variant_stores_what_the_compact_cache_reads_back() -> None:
    torch.manual_seed(0)
    rot = hadamard(64)
    assert rot is not None
    shape = (2, 4, 3, 64)  # L, BS, KVH, D
    kv = torch.randn(10, 2, 3, 64) * torch.logspace(-1, 1, 64)  # outlier channels
    pos = torch.arange(10)
    policies = build_variants(rot, torch.eye(64).expand(2, 3, 64, 64), torch.zeros(2, 3, 64))
    fake = FakeQuantCache(3, shape, policies["fp8_e4m3 today (K and V)"])
    real = PagedKVCache(KVFormat("fp8_e4m3", torch.float32), 3, shape, torch.device("cpu"))
    fake.write(1, kv, pos // 4, pos % 4)
    real.write(1, kv, pos // 4, pos % 4)
    table = torch.arange(3)
    stored = real.gather(1, table)[:10]
    back = (stored.reshape(-1, 64) @ rot).view(stored.shape)  # the model's basis
    torch.testing.assert_close(fake.gather(1, table)[:10], back, rtol=0, atol=1e-5)
    assert not torch.allclose(back, kv, atol=1e-3)  # it did quantize


def test_the_other_neighbour_brackets_the_value() -> None:
    y = torch.randn(4096) * 100
    q = _fp8(y)
    alt = _other_neighbour(y, q)
    lo, hi = torch.minimum(q, alt), torch.maximum(q, alt)
    inside = (lo <= y) & (y <= hi)
    assert bool(inside.all())
    assert (alt != q).float().mean() > 0.99  # only exact hits (and zero) have no second neighbour


def test_weighted_choice_and_flips_lower_the_query_weighted_error() -> None:
    torch.manual_seed(0)
    h = _low_rank_h()
    x = torch.randn(512, 64) * 2

    def cost(back: torch.Tensor) -> torch.Tensor:
        e = back - x
        return torch.einsum("nd,de,ne->n", e, h, e)

    cand = _candidates(x, 8)[..., None]
    plain = _fp8(x[:, None] / cand) * cand  # today's 8 candidates, chosen by squared error
    l2 = plain[torch.arange(512), (plain - x[:, None]).square().sum(-1).argmin(-1)]
    weighted = fp8_weighted(x, h, 8)
    flipped = fp8_flips(x, h, 8, 4)
    assert bool((cost(weighted) <= cost(l2) * (1 + 1e-5)).all())
    assert bool((cost(flipped) <= cost(weighted) * (1 + 1e-5)).all())
    assert cost(flipped).sum() < 0.8 * cost(l2).sum()  # they matter on a low-rank H
    cand = _candidates(x, 8)[..., None]  # [N, 8, 1]: each row stays on one candidate's fp8 grid
    on_grid = (_fp8(flipped[:, None] / cand) * cand == flipped[:, None]).all(-1)  # [N, 8]
    assert bool(on_grid.any(-1).all())
