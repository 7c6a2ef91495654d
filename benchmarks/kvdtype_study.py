"""``python -m benchmarks.kvdtype --fp8-study``: where fp8_e4m3 KV loses top-1 agreement, and what moves it.

A bench-only experiment, not an engine path: every variant runs the model teacher-forced (as
``python -m benchmarks.kvdtype``'s quality part does) through a float32 paged cache whose writes store
*fake-quantized* K/V: each variant's quantizer rounds the new K/V and the cache keeps the values it
would read back. With today's quantizer this is the compact cache's arithmetic (the stored values are
bit for bit ``dequantize(quantize(x R)) R``); the attention then runs in the model's basis instead of
the rotated one, so fp32 rounding differs by ~1e-7, and that alone flips some fp8 rounding decisions
in later layers: a variant's agreement moves by a few tenths of a point between two equivalent
implementations on one 2,047-position window (95.75% vs 96.14% measured). Compare variants on many
positions, in one run.

Calibration (the levers that need it): the queries' second moment per (layer, KV head) and the keys'
mean, taken from the fp32 pass over the last window of the text (tokens 18,432..20,479), which no
evaluated window contains.

    variant                                what it stores for K (V: today's fp8 unless said)
    ─────────────────────────────────────  ───────────────────────────────────────────────────────────
    today                                  rotated, best of 8 scales by squared error (kv_quant.py)
    K only / V only                        the other one kept in float32
    first block fp32                       positions 0..15 (the attention sinks) kept in float32
    weighted S                             best of S scales by e^T H e, H = queries' second moment
    weighted 8 + flips                     then up to 4 greedy flips of one value to its other fp8
                                           neighbour, each lowering e^T H e
    GPTQ rounding                          values rounded one after another along the head dim, each
                                           rounding error pushed onto the later ones through H^-1
    key mean subtracted                    k - mean(k): every score of a query shifts by q . mean, which
                                           softmax ignores; the rest is smaller, so is its fp8 error
    K as int8                              int8 codes (amax / 127) for K: a format change
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.kv_text import teacher_force
from kvtier.models.kv_quant import KVFormat, PagedKVCache, dequantize, hadamard, quantize

WINDOW, BLOCK, QMAX = 2048, 16, 448.0
Policy = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]  # (layer, kv [T,2,KVH,D], pos [T]) -> kv


class FakeQuantCache(PagedKVCache):
    """A float32 pool whose writes store ``policy(layer, kv_new, positions)``; it can also record the
    (unrotated) queries attention hands it, one call per layer in layer order."""

    def __init__(self, num_blocks: int, shape: tuple[int, int, int, int], policy: Policy | None) -> None:
        super().__init__(KVFormat("float32", torch.float32), num_blocks, shape, torch.device("cpu"))
        self.policy = policy
        self.queries: list[torch.Tensor] | None = None  # [T, H, D] per call when recording

    def write(self, layer, kv_new, slot_block_ids, slot_offsets, stored_values=True):  # type: ignore[no-untyped-def]
        if self.policy is not None:
            kv_new = self.policy(layer, kv_new, slot_block_ids * self.block_size + slot_offsets)
        return super().write(layer, kv_new, slot_block_ids, slot_offsets, stored_values)

    def rotate_queries(self, q: torch.Tensor) -> torch.Tensor:
        if self.queries is not None:
            self.queries.append(q.clone())
        return q


# ------------------------------------------------------------------------------------------ quantizers
def _fp8(y: torch.Tensor) -> torch.Tensor:
    return y.clamp(-QMAX, QMAX).to(torch.float8_e4m3fn).float()


def _candidates(x: torch.Tensor, num: int) -> torch.Tensor:
    """x [N, D] -> [N, num] scales amax / 448 * 2^(k / num): today's candidates when num = 8."""
    amax = x.abs().amax(-1).div(QMAX).clamp_min(1e-12)
    return amax[:, None] * torch.exp2(torch.arange(num, dtype=torch.float32) / num)


def _weighted(x: torch.Tensor, h: torch.Tensor, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] -> (stored values [N, D], scale [N, 1]): the candidate whose error e minimizes e^T h e."""
    cand = _candidates(x, num)[..., None]  # [N, S, 1]
    back = _fp8(x[:, None] / cand) * cand  # [N, S, D]
    e = back - x[:, None]
    best = torch.einsum("nsd,de,nse->ns", e, h, e).argmin(-1)
    n = torch.arange(x.shape[0])
    return back[n, best], cand[n, best]


def fp8_weighted(x: torch.Tensor, h: torch.Tensor, num: int) -> torch.Tensor:
    return _weighted(x, h, num)[0]


def _other_neighbour(y: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The fp8 value on the other side of y from its nearest q (same sign, magnitude code +-1)."""
    codes = q.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16)
    mag, sign = codes & 0x7F, codes & 0x80
    mag = torch.where(y.abs() > q.abs(), mag + 1, mag - 1).clamp(0, 0x7E)
    return (sign | mag).to(torch.uint8).view(torch.float8_e4m3fn).float()


def fp8_flips(x: torch.Tensor, h: torch.Tensor, num: int, flips: int) -> torch.Tensor:
    """``fp8_weighted``, then up to ``flips`` greedy single-value flips, each lowering e^T h e."""
    n = torch.arange(x.shape[0])
    back, s = _weighted(x, h, num)
    alt = _other_neighbour(x / s, back / s) * s
    he = (back - x) @ h  # [N, D]
    diag = h.diagonal()
    for _ in range(flips):
        d = alt - back
        gain = 2 * d * he + d * d * diag  # change of e^T h e when flipping each value
        i = gain.argmin(-1)
        step = torch.where(gain[n, i] < 0, d[n, i], torch.zeros_like(d[n, i]))
        old = back[n, i].clone()
        back[n, i] += step
        alt[n, i] = torch.where(step != 0, old, alt[n, i])
        he += step[:, None] * h[i]
    return back


def fp8_gptq(x: torch.Tensor, h: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """Sequential rounding along D (GPTQ's update through the Cholesky factor of H^-1), scale amax / 448."""
    d = x.shape[1]
    hd = h + damp * h.diagonal().mean() * torch.eye(d)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hd)), upper=True)
    s = _candidates(x, 1)  # [N, 1]
    w, out = x / s, torch.empty_like(x)
    for i in range(d):
        out[:, i] = _fp8(w[:, i])
        err = (w[:, i] - out[:, i]) / hinv[i, i]
        w[:, i + 1 :] -= err[:, None] * hinv[i, i + 1 :][None, :]
    return out * s


def today(x: torch.Tensor, kd: str = "fp8_e4m3") -> torch.Tensor:
    q, s = quantize(x, KVFormat(kd, torch.float32))
    return dequantize(q, s, torch.float32)


# ------------------------------------------------------------------------------------------ variants
def variant(
    rot: torch.Tensor,
    k_fn: Callable[[int, int, torch.Tensor], torch.Tensor] | None,
    v_fn: Callable[[torch.Tensor], torch.Tensor] | None = today,
    key_mean: torch.Tensor | None = None,  # [L, KVH, D] subtracted from K first
    keep_first: int = 0,
) -> Policy:
    """A write policy: K through ``k_fn(layer, kv_head, x [T, D] rotated)``, V through ``v_fn``
    (None: kept float32), both in the rotated basis, stored back in the model's basis."""

    def rotate(x: torch.Tensor) -> torch.Tensor:
        return (x.reshape(-1, rot.shape[0]) @ rot).view(x.shape)  # R symmetric: its own inverse

    def policy(layer: int, kv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = kv.clone()
        if key_mean is not None:
            out[:, 0] -= key_mean[layer]
        k = rotate(out[:, 0])  # [T, KVH, D]
        if k_fn is not None:
            k = torch.stack([k_fn(layer, h, k[:, h]) for h in range(k.shape[1])], 1)
        stored_k = rotate(k)
        stored_v = out[:, 1] if v_fn is None else rotate(v_fn(rotate(out[:, 1])))
        stored = torch.stack([stored_k if k_fn is not None else out[:, 0], stored_v], 1)
        if keep_first:
            first = pos < keep_first
            stored[first] = kv[first]
        return stored

    return policy


def build_variants(rot: torch.Tensor, hq: torch.Tensor, key_mean: torch.Tensor) -> dict[str, Policy]:
    """Name -> policy; hq [L, KVH, D, D] the queries' second moment in the rotated basis."""
    base = lambda layer, h, x: today(x)  # noqa: E731
    return {
        "fp8_e4m3 today (K and V)": variant(rot, base),
        "K only quantized": variant(rot, base, None),
        "V only quantized": variant(rot, None),
        "first block (16 tokens) kept fp32": variant(rot, base, keep_first=BLOCK),
        "K: 8 scales, query-weighted": variant(rot, lambda layer, h, x: fp8_weighted(x, hq[layer, h], 8)),
        "K: 32 scales, query-weighted": variant(rot, lambda layer, h, x: fp8_weighted(x, hq[layer, h], 32)),
        "K: 8 weighted + 4 flips": variant(rot, lambda layer, h, x: fp8_flips(x, hq[layer, h], 8, 4)),
        "K: GPTQ-style rounding": variant(rot, lambda layer, h, x: fp8_gptq(x, hq[layer, h])),
        "K: key mean subtracted": variant(rot, base, key_mean=key_mean),
        "K: mean subtracted + 32 weighted + 8 flips": variant(
            rot, lambda layer, h, x: fp8_flips(x, hq[layer, h], 32, 8), key_mean=key_mean
        ),
        "K as int8, V fp8_e4m3 (format change)": variant(rot, lambda layer, h, x: today(x, "int8")),
    }


# ------------------------------------------------------------------------------------------ the run
def _window(model: Any, ids: torch.Tensor, policy: Policy | None, record: bool = False) -> tuple[Any, ...]:
    c = model.config
    cache = FakeQuantCache(-(-len(ids) // BLOCK), (c.num_layers, BLOCK, c.num_kv_heads, c.head_dim), policy)
    if record:
        cache.queries = []
    nll, top1 = teacher_force(model, cache, ids, 256)
    return nll, top1, cache


def calibrate(model: Any, ids: torch.Tensor, rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(queries' second moment [L, KVH, D, D] rotated, keys' mean [L, KVH, D]) over ``ids``."""
    c = model.config
    keys: list[list[torch.Tensor]] = [[] for _ in range(c.num_layers)]

    def record_keys(layer: int, kv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        keys[layer].append(kv[:, 0].clone())
        return kv

    _, _, cache = _window(model, ids, record_keys, record=True)
    group = c.num_heads // c.num_kv_heads
    hq = []
    for layer in range(c.num_layers):
        q = torch.cat(cache.queries[layer :: c.num_layers])  # [T, H, D]
        qr = (q.reshape(-1, c.head_dim) @ rot).view(q.shape[0], c.num_kv_heads, group, c.head_dim)
        hq.append(torch.einsum("tkgd,tkge->kde", qr, qr) / q.shape[0])
    key_mean = torch.stack([torch.cat(k).mean(0) for k in keys])
    return torch.stack(hq), key_mean


def run_study(model: Any, ids: list[int], num_windows: int) -> list[dict[str, Any]]:
    tokens = torch.tensor(ids)
    if not 1 <= num_windows < len(ids) // WINDOW:  # the last window calibrates: never evaluated
        raise ValueError(f"--fp8-study takes 1 to {len(ids) // WINDOW - 1} windows, not {num_windows}")
    windows = [tokens[w * WINDOW : (w + 1) * WINDOW] for w in range(num_windows)]
    rot = hadamard(model.config.head_dim)
    assert rot is not None
    hq, key_mean = calibrate(model, tokens[-WINDOW:], rot)
    ref = [_window(model, w, None)[:2] for w in windows]
    rows = []
    for name, policy in build_variants(rot, hq, key_mean).items():
        t0 = time.perf_counter()
        nll = nll_ref = 0.0
        agree = n = 0
        for w, (ref_nll, ref_top1) in zip(windows, ref, strict=True):
            got_nll, top1, _ = _window(model, w, policy)
            nll, nll_ref = nll + got_nll, nll_ref + ref_nll
            agree, n = agree + int((top1 == ref_top1).sum()), n + top1.numel()
        row = {"variant": name, "positions": n, "ppl_vs_float32": math.exp((nll - nll_ref) / n) - 1}
        row["top1_agreement"] = agree / n
        rows.append(row)
        print(
            f"  study {name}: {agree / n:.2%} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True
        )
    return rows


def print_study(rows: list[dict[str, Any]]) -> None:
    n = rows[0]["positions"]
    print(
        f"\nfp8_e4m3 study: {n:,} positions (the first windows), calibration on the text's last window; "
        "fake-quantized K/V in a float32 cache (benchmarks/kvdtype_study.py)"
    )
    print(f"  {'variant':<44} {'ppl vs fp32':>11} {'top-1 agree':>11}")
    for r in rows:
        print(f"  {r['variant']:<44} {r['ppl_vs_float32']:>+11.2%} {r['top1_agreement']:>11.2%}")
