"""The fused compact-KV decode kernel (``kvtier/models/kvattn.c`` via ``kvkernels.py``): it reads the
fp8/int8 pool in place through the block table and must agree with the torch path (gather, convert,
scale-folded attention, rotations) to fp32 rounding, on tiny random caches and on the real model; the
torch path stays the fallback (no compiler, ``KVTIER_NO_KERNELS``, shapes the kernel does not cover)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvtier.llm import LLM
from kvtier.models import kvkernels, qkernels
from kvtier.models.attention import AttentionMetadata, DecodeGroup, PrefillGroup, paged_attention
from kvtier.models.kv_quant import KVFormat, PagedKVCache
from kvtier.sampling_params import SamplingParams

COMPACT = ("fp8_e4m3", "fp8_e5m2", "int8")
PLAIN = ("float32", "bfloat16")  # no scales, no rotation: the same kernel walk over 4- or 2-byte elements
needs_kernel = pytest.mark.skipif(kvkernels.kernels() is None, reason="no C compiler / AVX2: kernel off")


def filled_cache(
    kd: str,
    lens: list[int],
    kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    layers: int = 2,
    seed: int = 0,
) -> tuple[PagedKVCache, torch.Tensor, int]:
    """A compact cache holding ``len(lens)`` sequences of random K/V in shuffled blocks, written through
    the slot mapping like a prefill would; returns (cache, block tables [B * max_blocks], max_blocks)."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 2
    shape = (layers, block_size, kv_heads, head_dim)
    cache = PagedKVCache(KVFormat(kd, torch.float32), num_blocks, shape, torch.device("cpu"))
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        for layer in range(layers):
            kv = torch.randn(n, 2, kv_heads, head_dim, generator=gen) * 2  # [n, 2, KVH, D]
            kv[:2] *= 20  # a few large first tokens, as real attention sinks have
            cache.write(layer, kv, tables[b, pos // block_size], pos % block_size)
    return cache, tables.reshape(-1), max_blocks


def decode_meta(tables: torch.Tensor, max_blocks: int, lens: list[int], block_size: int) -> AttentionMetadata:
    """One decode step of every sequence (its new token's slot is the last of its context)."""
    ctx = torch.tensor(lens)
    mask = None
    if len(lens) > 1 and min(lens) != max(lens):
        mask = (torch.arange(max(lens))[None, :] < ctx[:, None])[:, None, None, :]  # [B, 1, 1, max]
    last = ctx - 1
    block_ids = tables.view(len(lens), max_blocks)[torch.arange(len(lens)), last // block_size]
    group = DecodeGroup(len(lens), tables, max_blocks, max(lens), mask)
    return AttentionMetadata(block_ids, last % block_size, group, [])


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to fp32 rounding of sums of a few thousand terms: 1e-5 of the largest magnitude."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention through torch from here on, as where the kernel cannot be built."""
    monkeypatch.setattr(kvkernels, "_state", {"lib": None})


# ------------------------------------------------------------------------------ tiny random caches
CASES = [  # (lens per sequence, KV heads, query heads per KV head, head_dim, block size)
    ([37], 3, 3, 64, 16),  # SmolLM2's heads, one partial block at the end
    ([1], 1, 1, 64, 16),  # a context of one token
    ([100, 5, 64], 2, 4, 128, 16),  # a batch of three lengths: the mask's prefixes
    ([300, 299], 1, 8, 64, 32),  # eight query heads per KV head, 32-token blocks
    ([2000], 2, 2, 64, 16),  # long enough to be split in parts over threads
]


@needs_kernel
@pytest.mark.parametrize("kd", COMPACT + PLAIN)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"lens{c[0]}-kvh{c[1]}-g{c[2]}-d{c[3]}-bs{c[4]}")
def test_kernel_agrees_with_the_torch_path_to_fp32_rounding(
    kd: str, case: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    lens, kv_heads, group, head_dim, block_size = case
    cache, tables, max_blocks = filled_cache(kd, lens, kv_heads, head_dim, block_size)
    meta = decode_meta(tables, max_blocks, lens, block_size)
    q = torch.randn(len(lens), kv_heads * group, head_dim)  # [B, H, D]
    kv_new = torch.zeros(len(lens), 2, kv_heads, head_dim)  # only its shape is read by decode
    assert kvkernels.supports(cache, kv_heads * group)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # what _plan asks: 2 threads, whatever set
    for parallel_min in (1 << 40, 0):  # one thread, one part; then 2 threads, contexts in parts
        monkeypatch.setattr(kvkernels, "PARALLEL_MIN", parallel_min)
        assert kvkernels._plan(len(lens), kv_heads, max(lens))[0] == (1 if parallel_min else 2)
        fused = [paged_attention(q, kv_new, cache, layer, meta, 0.125) for layer in range(2)]
        with monkeypatch.context() as m:
            torch_path(m)
            reference = [paged_attention(q, kv_new, cache, layer, meta, 0.125) for layer in range(2)]
        for got, want in zip(fused, reference, strict=True):  # [B, H * D] each
            assert_fp32_close(got, want)
    assert not torch.equal(fused[0], fused[1])  # the layer offset is honoured


@needs_kernel
@pytest.mark.parametrize("kd", COMPACT)
def test_kernel_equals_plain_attention_over_the_dequantized_context(kd: str) -> None:
    """An independent reference: SDPA over what ``gather`` dequantizes, rotated queries and output."""
    lens = [50, 23]
    cache, tables, max_blocks = filled_cache(kd, lens, 3, 64)
    meta = decode_meta(tables, max_blocks, lens, 16)
    q = torch.randn(2, 9, 64)
    got = paged_attention(q, torch.zeros(2, 2, 3, 64), cache, 1, meta, 0.125).view(2, 9, 64)
    rot = cache.rotation
    assert rot is not None
    for b, n in enumerate(lens):
        kv = cache.gather(1, tables.view(2, -1)[b])[:n]  # [n, 2, KVH, D] stored (rotated) basis
        k, v = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)  # [KVH, n, D]
        qb = (q[b] @ rot).view(3, 3, 64)  # [KVH, G, D]
        want = F.scaled_dot_product_attention(qb, k, v, scale=0.125).reshape(9, 64) @ rot
        assert_fp32_close(got[b], want)


@needs_kernel
def test_a_step_with_decodes_and_a_prefill_chunk_runs_both_paths_in_one_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode rows go through the kernel, the prefill chunk after them through torch; the rows come
    back in step order, each in the model's basis."""
    cache, tables, max_blocks = filled_cache("int8", [40, 40], 3, 64)
    chunk_table = tables.view(2, -1)[1]
    step = decode_meta(tables[:max_blocks], max_blocks, [40], 16)  # sequence 0 decodes
    pos = torch.arange(32, 40)  # sequence 1 re-reads its last 8 tokens as a chunk after 32 cached
    mask = torch.arange(40)[None, :] <= pos[:, None]  # [8, 40]
    prefill = PrefillGroup(1, 8, 32, chunk_table, mask)
    meta = AttentionMetadata(step.slot_block_ids, step.slot_offsets, step.decode, [prefill])
    q, kv_new = torch.randn(9, 9, 64), torch.zeros(9, 2, 3, 64)
    both = paged_attention(q, kv_new, cache, 0, meta, 0.125)  # [9, H * D]
    decode_only = paged_attention(q[:1], kv_new[:1], cache, 0, step, 0.125)
    torch_path(monkeypatch)
    reference = paged_attention(q, kv_new, cache, 0, meta, 0.125)
    assert torch.equal(both[:1], decode_only)
    assert_fp32_close(both, reference)


# ------------------------------------------------------------------------------ fallback
@needs_kernel
@pytest.mark.parametrize("kd", ["float32", "int8"])
def test_kernel_false_is_the_torch_path(kd: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the torch ops ask for (``TorchOps.attention_kernel``): the torch path, bit for bit."""
    cache, tables, max_blocks = filled_cache(kd, [30, 7], 3, 64)
    meta = decode_meta(tables, max_blocks, [30, 7], 16)
    q, kv_new = torch.randn(2, 9, 64), torch.zeros(2, 2, 3, 64)
    off = paged_attention(q, kv_new, cache, 1, meta, 0.125, kernel=False)
    assert not torch.equal(off, paged_attention(q, kv_new, cache, 1, meta, 0.125))  # the kernel's rounding
    torch_path(monkeypatch)
    assert torch.equal(off, paged_attention(q, kv_new, cache, 1, meta, 0.125))


def test_unsupported_caches_take_the_torch_path() -> None:
    fmt = KVFormat("int8", torch.float32)
    assert not kvkernels.supports(PagedKVCache(fmt, 2, (1, 16, 2, 32), torch.device("cpu")), 4)  # D 32
    assert not kvkernels.supports(PagedKVCache(fmt, 2, (1, 16, 1, 64), torch.device("cpu")), 16)  # G 16
    assert not kvkernels.supports(PagedKVCache(fmt, 2, (1, 128, 1, 64), torch.device("cpu")), 1)  # BS 128
    bf16 = KVFormat("int8", torch.bfloat16)
    assert not kvkernels.supports(PagedKVCache(bf16, 2, (1, 16, 2, 64), torch.device("cpu")), 4)
    half = KVFormat("float16", torch.float32)  # float16 KV: no kernel format
    assert not kvkernels.supports(PagedKVCache(half, 2, (1, 16, 2, 64), torch.device("cpu")), 4)
    plain = KVFormat("float32", torch.float32)
    assert kvkernels.supports(PagedKVCache(plain, 2, (1, 16, 2, 64), torch.device("cpu")), 4)


def test_kernels_off_or_no_compiler_is_one_log_line_and_decode_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache, tables, max_blocks = filled_cache("fp8_e4m3", [20], 3, 64)
    meta = decode_meta(tables, max_blocks, [20], 16)
    q = torch.randn(1, 9, 64)
    for env, compiler in (("1", None), ("", str(tmp_path / "no-such-gcc"))):
        monkeypatch.setattr(kvkernels, "_state", {})
        monkeypatch.setattr(qkernels, "kernel_dir", lambda: tmp_path / "kernels")  # nothing built there
        monkeypatch.setenv("KVTIER_NO_KERNELS", env)
        if compiler:
            monkeypatch.setenv("CC", compiler)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            out = paged_attention(q, torch.zeros(1, 2, 3, 64), cache, 0, meta, 0.125)
            paged_attention(q, torch.zeros(1, 2, 3, 64), cache, 1, meta, 0.125)
        lines = [r.getMessage() for r in caplog.records if "decode kernel unavailable" in r.getMessage()]
        assert len(lines) == 1 and "\n" not in lines[0], lines
        assert kvkernels.kernels() is None and out.shape == (1, 9 * 64) and bool(out.isfinite().all())


# ------------------------------------------------------------------------------ engine and real model
@needs_kernel
@pytest.mark.parametrize("kd", ["fp8_e4m3", "int8"])
def test_with_the_kernel_the_answer_still_does_not_depend_on_chunking_or_prefix_hits(
    tiny_llama_dir: Any, kd: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny model the kernel covers (head_dim 64): greedy answers cold, warm (prefix hit) and prefilled
    in chunks of 24 are one answer; the decode steps ran through the kernel."""
    model = str(tiny_llama_dir(num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=128))
    prompt = list(range(3, 90))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    calls = []
    kernel = kvkernels.decode_attention
    monkeypatch.setattr(kvkernels, "decode_attention", lambda *a: calls.append(1) or kernel(*a))
    with LLM(model, kv_cache_dtype=kd, kv_device_blocks=64) as llm:
        assert kvkernels.supports(llm.engine.runner.cache, 4)
        cold = llm.generate([prompt], greedy)[0]
        warm = llm.generate([prompt], greedy)[0]
    with LLM(model, kv_cache_dtype=kd, kv_device_blocks=64, max_num_batched_tokens=24) as llm:
        chunked = llm.generate([prompt], greedy)[0]
    assert warm.num_cached_tokens > 0 and cold.num_cached_tokens == 0
    assert cold.outputs[0].token_ids == warm.outputs[0].token_ids == chunked.outputs[0].token_ids
    assert len(calls) == 3 * 11 * 2  # 11 decode steps per answer, 2 layers


@pytest.fixture(scope="module")
def smollm(converted_default_model: Any) -> tuple[Any, list[int]]:
    from kvtier.models.llama import LlamaModel

    loaded = converted_default_model
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, 512)
    ids = loaded.tokenizer.encode("The history of the printing press " * 20, add_special_tokens=False)
    return model, ids[:48]


def greedy_decode(model: Any, ids: list[int], kd: str, steps: int) -> list[int]:
    """Prefill ``ids`` into a fresh compact cache, then ``steps`` greedy decode steps; the new tokens."""
    c, n = model.config, len(ids)
    shape = (c.num_layers, 16, c.num_kv_heads, c.head_dim)
    num_blocks = -(-(n + steps) // 16)
    cache = PagedKVCache(KVFormat(kd, torch.float32), num_blocks, shape, torch.device("cpu"))
    pos, table = torch.arange(n), torch.arange(num_blocks)
    meta = AttentionMetadata(pos // 16, pos % 16, None, [PrefillGroup(0, n, 0, None, None)])
    with torch.inference_mode():
        tokens = [int(model.compute_logits(model.forward(torch.tensor(ids), pos, cache, meta))[-1].argmax())]
        for p in range(n, n + steps):
            at = torch.tensor([p])
            step = AttentionMetadata(at // 16, at % 16, DecodeGroup(1, table, num_blocks, p + 1, None), [])
            logits = model.compute_logits(model.forward(torch.tensor(tokens[-1:]), at, cache, step))  # [1, V]
            tokens.append(int(logits[0].argmax()))
    return tokens


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("kd", ["fp8_e4m3", "int8"])
def test_real_model_attention_agrees_layer_by_layer_and_the_answer_is_the_same(
    smollm: tuple[Any, list[int]], kd: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2-135M, a 48-token prompt in a compact cache, 4 greedy decode steps: in every layer of every
    step the kernel and the torch path attend with the same real queries over the same real cache and
    agree to fp32 rounding; and decoding through the kernel from the start gives the same tokens.

    (Whole-model logits are not compared: a decode step quantizes its own K/V when it writes them, and
    a rounding-sized difference in a deep layer's new K/V can move a stored value by a whole step.)"""
    from kvtier.models import llama

    model, ids = smollm
    checked: list[int] = []

    def both_paths(
        q: torch.Tensor,
        kv_new: torch.Tensor,
        cache: PagedKVCache,
        layer: int,
        meta: Any,
        scale: float,
        kernel: bool,
    ):
        assert kernel  # the model's fp32 fused ops ask for the kernel
        fused = paged_attention(q, kv_new, cache, layer, meta, scale)
        with monkeypatch.context() as m:
            torch_path(m)
            want = paged_attention(q, kv_new, cache, layer, meta, scale)
        if meta.decode is not None:
            assert_fp32_close(fused, want)
            checked.append(layer)
        return want

    with monkeypatch.context() as m:
        m.setattr(llama, "paged_attention", both_paths)  # the torch path's answer, checking every layer
        m.setattr(model, "program", None)  # layer by layer (where the dense GEMV wins, a program runs)
        torch_tokens = greedy_decode(model, ids, kd, steps=4)
    assert len(checked) == 4 * model.config.num_layers
    assert greedy_decode(model, ids, kd, steps=4) == torch_tokens  # the kernel's answer


# ------------------------------------------------------------------------------ the compact write
@needs_kernel
@pytest.mark.parametrize("kd", [*COMPACT, "bfloat16"])
@pytest.mark.parametrize("factor", [1.0, 2.0])  # 2.0: the quality test's deliberately broken quantizer
def test_c_write_stores_the_torch_writes_bytes(kd: str, factor: float) -> None:
    """Codes, scales and returned values of the C write equal ``PagedKVCache.write``'s bit for bit, on
    magnitudes over six decades, an all-zero token and an all-zero head (bfloat16: the rounded rows)."""
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(40, 2, 3, 64, generator=gen) * torch.logspace(-3, 3, 40)[:, None, None, None]
    kv[3], kv[5, 0, 1] = 0, 0
    slots = torch.randperm(96, generator=gen)[:40]
    caches = [PagedKVCache(KVFormat(kd, torch.float32), 6, (2, 16, 3, 64), torch.device("cpu")) for _ in "ab"]
    for cache in caches:
        cache.scale_factor = factor
    for stored in (True, False):
        want = caches[0].write(1, kv, slots // 16, slots % 16, stored)
        got = kvkernels.store_quantized(
            kvkernels.kernels(), caches[1], 1, kv, slots // 16, slots % 16, stored
        )
        assert torch.equal(caches[0].raw, caches[1].raw)
        assert torch.equal(got, want) if stored else got.shape == want.shape  # unstored: only the shape
    assert caches[1].raw[:, 0].count_nonzero() == 0  # layer 1 only


@needs_kernel
def test_c_bfloat16_rounding_is_torchs_at_ties_and_edges() -> None:
    """Every tie (low half exactly 0x8000, after an even and an odd bfloat16), its neighbours, the
    largest finite floats (which round to inf), infinities, NaN, subnormals and signed zeros."""
    high = torch.randint(0, 1 << 16, (4096,), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
    bits = torch.cat([(high << 16) | low for low in (0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF)])
    v = bits.to(torch.int32).view(torch.float32)
    edges = [float("inf"), -float("inf"), float("nan"), 3.4028235e38, -3.4028235e38, 1e-40, -1e-45, 0.0, -0.0]
    v = torch.cat([v[~v.isnan()], torch.tensor(edges)])
    v = v[: v.numel() // 64 * 64].view(-1, 2, 1, 32)  # rows of [2, KVH, D] tokens
    caches = [
        PagedKVCache(KVFormat("bfloat16", torch.float32), 2, (1, v.shape[0], 1, 32), torch.device("cpu"))
    ]
    caches.append(
        PagedKVCache(KVFormat("bfloat16", torch.float32), 2, (1, v.shape[0], 1, 32), torch.device("cpu"))
    )
    slots = torch.arange(v.shape[0])
    want = caches[0].write(0, v, slots * 0, slots, True)
    got = kvkernels.store_quantized(kvkernels.kernels(), caches[1], 0, v, slots * 0, slots, True)
    assert torch.equal(caches[0].raw.view(torch.int16), caches[1].raw.view(torch.int16))  # NaN bits too
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@needs_kernel
@pytest.mark.parametrize("kd,dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_c_fp8_rounding_is_torchs_at_every_grid_point_and_tie(kd: str, dtype: torch.dtype) -> None:
    qmax = 448.0 if kd == "fp8_e4m3" else 57344.0
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    grid = grid[grid.isfinite() & (grid.abs() <= qmax)].unique()  # sorted, both signs
    ties = (grid[1:] + grid[:-1]) / 2
    up, down = torch.nextafter(ties, torch.tensor(qmax)), torch.nextafter(ties, torch.tensor(-qmax))
    v = torch.cat([grid, ties, up, down])
    v = torch.cat([v, v[: -v.numel() % 8]]).contiguous()  # whole vectors of 8
    codes = torch.empty(v.numel(), dtype=torch.uint8)
    kvkernels.kernels().kv_fp8_codes(kvkernels.FORMAT_IDS[kd], v.data_ptr(), v.numel(), codes.data_ptr())
    assert torch.equal(codes, v.to(dtype).view(torch.uint8))
