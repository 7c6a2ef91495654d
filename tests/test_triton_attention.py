"""The Triton attention kernels (``kvtier/models/triton_attention.py``) against the torch path, on a CPU
through Triton's interpreter (``TRITON_INTERPRET=1``, set here before triton is imported; with
``TRITON_INTERPRET=0`` on a CUDA machine the same tests run the compiled kernels on the GPU).

Random pools in shuffled blocks, ragged contexts, GQA ratios 1 to 8, head dims 16 to 256 (and 80, not a
power of two), windows shorter and longer than the contexts, every KV dtype the pool stores: the decode
kernel (one part and split-K) and the prefill kernel (a fresh chunk, a chunk after cached blocks, a
step mixing both with decodes) must give the torch path's output to fp32 rounding (the compute dtype's
rounding for bfloat16/float16). A deliberately broken kernel (the window's first key off by one) fails
the same comparison. End to end, tiny Llama and Gemma 3 engines answer token for token as with
``attention_backend="torch"``. Skipped where triton is not installed: nothing else in kvtier imports it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: its kernels run on numpy

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvtier import LLM, SamplingParams  # noqa: E402
from kvtier.bench.gpu_kernel_step import step_metadata  # noqa: E402
from kvtier.config import ConfigError, EngineArgs  # noqa: E402
from kvtier.models import attention_backend, triton_attention  # noqa: E402
from kvtier.models.attention import (  # noqa: E402
    AttentionMetadata,
    paged_attention,
    write_kv,
)
from kvtier.models.kv_quant import KVFormat, PagedKVCache  # noqa: E402

INTERPRETED = attention_backend.interpreting()
DEVICE = torch.device("cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda")
if not INTERPRETED and DEVICE.type != "cuda":
    pytest.skip("TRITON_INTERPRET is off and there is no CUDA device", allow_module_level=True)

PACKAGE = Path(__file__).resolve().parent.parent / "kvtier"
LAYER = 1  # every step reads and writes layer slot 1 of 2: the slot's offset inside a block counts
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (KV dtype, compute dtype): every format the pool stores, plain pools under each compute dtype
KV_CASES = [
    ("float32", F32),
    ("bfloat16", F32),
    ("float16", F32),
    ("int8", F32),
    ("fp8_e4m3", F32),
    ("fp8_e5m2", F32),
    ("bfloat16", BF16),
    ("float16", F16),
    ("int8", BF16),
]
KV_IDS = [f"{kd}-{str(dt).removeprefix('torch.')}" for kd, dt in KV_CASES]


@dataclass
class Step:
    """One layer of a step over random K/V: the pool, the metadata, queries, new K/V as stored."""

    cache: PagedKVCache
    meta: AttentionMetadata
    q: torch.Tensor  # [T, H, D]
    kv_new: torch.Tensor  # [T, 2, KVH, D]
    scale: float  # 1 / sqrt(head_dim), as the models use


def make_step(
    kd: str,
    compute: torch.dtype,
    seqs: list[tuple[int, int]],  # (cached, new) per sequence; rows with new == 1 and cached > 0 decode
    heads: tuple[int, int, int],  # (KV heads, query heads per KV head, head_dim)
    block_size: int,
    seed: int = 0,
) -> Step:
    """The cached tokens of every sequence written in shuffled blocks, then the step's new tokens
    written through the slot mapping (``write_kv``, as the model does) and their metadata built as the
    runner builds it: decode rows first, padded tables, the mask of ragged contexts."""
    kvh, group, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    sizes = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(sizes) + 3
    cache = PagedKVCache(KVFormat(kd, compute), num_blocks, (2, block_size, kvh, head_dim), DEVICE)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(len(seqs))]
    for (c, _), table in zip(seqs, tables, strict=True):
        kv = (torch.randn(c, 2, kvh, head_dim, generator=gen) * 2).to(compute)
        kv[:2] *= 8  # a few large first tokens, as attention sinks have
        pos = torch.arange(c, device=DEVICE)
        block_ids = torch.tensor(table, device=DEVICE)[pos // block_size]
        cache.write(LAYER, kv.to(DEVICE), block_ids, pos % block_size)
    decodes = [i for i, (c, n) in enumerate(seqs) if n == 1 and c > 0]
    chunks = [i for i in range(len(seqs)) if i not in decodes]
    meta = step_metadata(seqs, tables, block_size, DEVICE)
    t = sum(seqs[i][1] for i in decodes + chunks)
    kv = (torch.randn(t, 2, kvh, head_dim, generator=gen) * 2).to(compute).to(DEVICE)
    q = (torch.randn(t, kvh * group, head_dim, generator=gen) * 2).to(compute).to(DEVICE)
    return Step(cache, meta, q, write_kv(cache, LAYER, kv, meta), head_dim**-0.5)


def tolerance(compute: torch.dtype) -> float:
    """Relative to the output's largest magnitude: fp32 rounding of the sums; for bfloat16/float16
    compute, the rounding of the queries, their rotation and the output in that dtype (measured worst:
    fp16 3.4e-4; bf16 6.5e-3, and 2.1e-2 with int8 KV, whose rotations run in bfloat16)."""
    return {F32: 1e-5, F16: 2e-3, BF16: 3e-2}[compute]


def reference(step: Step, window: int | None) -> torch.Tensor:  # [T, H * D] float32
    """The torch path (``kernel=False``) in float32 over the same stored K/V: a float32 step's own; for
    bfloat16/float16 compute a float32 twin of the pool holding the same bytes (what a block stores does
    not depend on the compute dtype), since the torch path in bfloat16 is itself further off (an int8
    prefill dequantizes into bfloat16: 6% of the largest output against float64, the kernels' 2%)."""
    cache = step.cache
    if step.q.dtype == F32:
        return paged_attention(step.q, step.kv_new, cache, LAYER, step.meta, step.scale, False, window)
    shape = (cache.raw.shape[1], cache.block_size, *cache.token_shape[1:])
    twin = PagedKVCache(KVFormat(cache.fmt.name, F32), cache.raw.shape[0], shape, DEVICE)
    twin.raw.copy_(cache.raw)
    q, kv_new = step.q.float(), step.kv_new.float()
    return paged_attention(q, kv_new, twin, LAYER, step.meta, step.scale, False, window)


def compare(step: Step, window: int | None) -> None:
    """``paged_attention`` through the Triton kernels equals the torch path's (``reference``)."""
    want = reference(step, window)
    got = paged_attention(step.q, step.kv_new, step.cache, LAYER, step.meta, step.scale, "triton", window)
    assert got.shape == want.shape and got.dtype == step.q.dtype
    atol = tolerance(step.q.dtype) * float(want.abs().max())
    torch.testing.assert_close(got.float(), want, rtol=0, atol=atol)


# ----------------------------------------------------------------------------------- decode kernel
# (contexts, (KV heads, query heads per KV head, head_dim), block size, window)
DECODE_CASES = [
    ([37], (3, 3, 64), 16, None),  # SmolLM2's heads: 3 query heads per KV head, a partial last block
    ([100, 5, 64], (2, 4, 128), 16, 20),  # ragged; the window cuts two contexts, not the 5-token one
    ([33, 70], (1, 8, 256), 8, 80),  # eight heads per KV head, head_dim 256, a window longer than both
    ([1, 50, 9], (4, 1, 16), 4, 7),  # no GQA, head_dim 16, 4-token blocks, a one-token context
]


@pytest.mark.parametrize("kd,compute", KV_CASES, ids=KV_IDS)
@pytest.mark.parametrize(
    "lens,heads,block_size,window", DECODE_CASES, ids=lambda c: str(c).replace(" ", "") if c else "full"
)
def test_decode_kernel_equals_the_torch_path(
    kd: str, compute: torch.dtype, lens: list[int], heads: tuple, block_size: int, window: int | None
) -> None:
    step = make_step(kd, compute, [(n - 1, 1) for n in lens], heads, block_size)
    compare(step, window)


@pytest.mark.parametrize("kd", ["float32", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("window", [None, 150])
def test_split_k_parts_merge_to_the_same_output(kd: str, window: int | None) -> None:
    """1, 2, 3 and 5 parts per context (flash-decoding's reduce): each equals the torch path; parts of a
    short context that hold no token merge as zero weight."""
    step = make_step(kd, F32, [(299, 1), (40, 1), (3, 1)], (2, 2, 64), 16)
    d = step.meta.decode
    assert d is not None and d.context_lens() is not None
    want = paged_attention(step.q, step.kv_new, step.cache, LAYER, step.meta, step.scale, False, window)
    tables = d.block_tables.view(d.num_seqs, d.max_blocks)
    rotated = step.cache.rotate_queries(step.q)
    for splits in (1, 2, 3, 5):
        got = triton_attention.decode(
            rotated, step.cache, LAYER, tables, d.context_lens(), d.max_context, step.scale, window, splits
        )
        got = step.cache.unrotate_output(got, step.q.shape[2])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize(
    "kd,compute", [("float32", F32), ("int8", F32), ("fp8_e4m3", F32), ("bfloat16", BF16)]
)
@pytest.mark.parametrize("window", [None, 150])
def test_a_short_chunk_after_a_long_context_splits_its_keys(
    kd: str, compute: torch.dtype, window: int | None
) -> None:
    """A prefix hit's last block (5 tokens after 299 cached) in 1, 2, 3, 5 and 16 parts of the keys: each
    equals the torch path; the own tokens (causal) lie in the last part, the window cuts the first."""
    step = make_step(kd, compute, [(299, 5)], (2, 2, 64), 16)
    want = reference(step, window)
    (p,) = step.meta.prefills
    rotated = step.cache.rotate_queries(step.q)
    atol = tolerance(compute) * float(want.abs().max())
    for splits in (1, 2, 3, 5, 16):
        got = triton_attention.prefill(
            rotated, step.kv_new, step.cache, LAYER, p.block_table, p.num_cached, step.scale, window, splits
        )
        got = step.cache.unrotate_output(got, step.q.shape[2])
        torch.testing.assert_close(got.float(), want, rtol=0, atol=atol)


def test_num_splits_keeps_a_gpu_busy_and_parts_long() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert triton_attention.num_splits(4 * 8, 100_000, cpu) == 1  # the interpreter: one part
    assert triton_attention.num_splits(1, 300, cpu) == 2  # two programs' worth, parts >= 256 tokens
    if torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(cuda).multi_processor_count
        assert triton_attention.num_splits(8, 100_000, cuda) == min(16, -(-2 * sms // 8))
        assert triton_attention.num_splits(8, 600, cuda) == 3
        assert triton_attention.num_splits(512 * 8, 8192, cuda) == 1  # an 8k prompt's tiles fill the GPU


# ---------------------------------------------------------------------------------- prefill kernel
# ((cached, new) of the chunk, heads, block size, window)
PREFILL_CASES = [
    ((0, 37), (2, 2, 64), 16, None),  # a fresh prompt: its own K/V as stored
    ((20, 37), (3, 3, 128), 16, 7),  # after 20 cached tokens, a 7-token window
    ((33, 10), (1, 8, 256), 8, 100),  # a window longer than the context
    ((0, 30), (2, 1, 16), 4, 6),  # a fresh prompt under a window
    ((9, 5), (2, 2, 80), 4, None),  # head_dim 80: not a power of two (no rotation for compact KV)
]


@pytest.mark.parametrize("kd,compute", KV_CASES, ids=KV_IDS)
@pytest.mark.parametrize(
    "chunk,heads,block_size,window", PREFILL_CASES, ids=lambda c: str(c).replace(" ", "") if c else "full"
)
def test_prefill_kernel_equals_the_torch_path(
    kd: str, compute: torch.dtype, chunk: tuple[int, int], heads: tuple, block_size: int, window: int | None
) -> None:
    compare(make_step(kd, compute, [chunk], heads, block_size), window)


@pytest.mark.parametrize("kd,compute", [("float32", F32), ("int8", F32), ("bfloat16", BF16)])
@pytest.mark.parametrize("window", [None, 6])
def test_a_step_of_decodes_and_chunks_equals_the_torch_path(
    kd: str, compute: torch.dtype, window: int | None
) -> None:
    """Two decode rows, a chunk after cached blocks, a fresh prompt after it: one call, rows in order."""
    step = make_step(kd, compute, [(29, 1), (11, 1), (20, 8), (0, 11)], (2, 2, 64), 8)
    assert step.meta.decode is not None and len(step.meta.prefills) == 2
    compare(step, window)


# ------------------------------------------------------------------------------ a broken kernel
def test_a_window_off_by_one_fails_the_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison can fail: with the window's first key moved by one token (a private hook of the
    module), decode and prefill both disagree with the torch path, where the window cuts the context."""
    decode = make_step("float32", F32, [(40, 1), (25, 1)], (2, 2, 64), 16)
    prefill = make_step("int8", F32, [(20, 12)], (2, 2, 64), 16)
    for step in (decode, prefill):
        compare(step, 8)  # the kernels as shipped
    monkeypatch.setattr(triton_attention, "_TEST_WINDOW_SKEW", 1)
    for step in (decode, prefill):
        with pytest.raises(AssertionError, match="Tensor-likes are not close"):
            compare(step, 8)
    compare(decode, None)  # a full layer has no window to break


# -------------------------------------------------------------------------------------- selection
def test_the_backend_each_name_resolves_to(monkeypatch: pytest.MonkeyPatch) -> None:
    resolve = attention_backend.resolve
    assert (resolve("auto", "cpu"), resolve("auto", "cuda"), resolve("auto", "mps")) == (
        "c",
        "triton",
        "torch",
    )
    assert [resolve(name, "cpu") for name in ("torch", "c")] == ["torch", "c"]
    assert resolve("triton", "cuda") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve("triton", "cpu") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1") as err:
        resolve("triton", "cpu")
    assert "\n" not in str(err.value)
    monkeypatch.setitem(sys.modules, "triton", None)  # as if triton were not installed
    assert resolve("auto", "cuda") == "torch"
    with pytest.raises(ConfigError, match="needs the triton package"):
        resolve("triton", "cuda")
    with pytest.raises(ConfigError, match="attention_backend must be auto, torch, c or triton"):
        EngineArgs(attention_backend="cuda").validate()  # type: ignore[arg-type]


def test_only_triton_attention_imports_triton_and_kvtier_runs_without_it() -> None:
    """No other module imports triton (at any level); with triton unimportable, the engine's modules
    import and a step's attention runs through the torch and C paths."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] == "triton" for n in names) and path.name != "triton_attention.py":
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, found
    code = """
import sys
sys.modules["triton"] = None  # import triton fails from here on
import torch
import kvtier.assembly, kvtier.llm
from kvtier.models import attention_backend
from kvtier.models.attention import AttentionMetadata, DecodeGroup, paged_attention
from kvtier.models.attention import teacher_forced_chunk, write_kv
from kvtier.models.kv_quant import KVFormat, PagedKVCache

assert attention_backend.resolve("auto", "cpu") == "c" and not attention_backend.triton_installed()
cache = PagedKVCache(KVFormat("int8", torch.float32), 4, (1, 16, 2, 64), torch.device("cpu"))
_, prompt = teacher_forced_chunk(0, 20, 16)  # a 20-token prompt, then the decode of token 20
row = DecodeGroup(1, torch.tensor([0, 1]), 2, 21, None)
decode = AttentionMetadata(torch.tensor([1]), torch.tensor([4]), row, [])
for meta, n in ((prompt, 20), (decode, 1)):
    kv_new = write_kv(cache, 0, torch.randn(n, 2, 2, 64), meta)
    for kernel in (True, "c", False, "torch"):
        assert paged_attention(torch.randn(n, 4, 64), kv_new, cache, 0, meta, 0.3, kernel, 6).isfinite().all()
assert "kvtier.models.triton_attention" not in sys.modules
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = PACKAGE.parent
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


# ------------------------------------------------------------------------------------ end to end
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma_dir(tiny_gemma3_sliding_dir: Path) -> Path:
    return tiny_gemma3_sliding_dir


def engine_prompts() -> list[list[int]]:
    """Three prompts past the window, two sharing a 13-token prefix (a prefix-cache hit: a chunk after
    cached blocks)."""
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 500, (13,), generator=gen).tolist()
    return [shared + [7, 8, 9], torch.randint(3, 500, (9,), generator=gen).tolist(), shared + [11, 12]]


def greedy(directory: Path, backend: str, **kwargs: Any) -> list[list[int]]:
    """The engine's greedy answers: the first prompt alone (its blocks then cached), then all three in
    6-token chunks with ragged decode rows."""
    args: dict[str, Any] = dict(block_size=4, kv_device_blocks=64, max_num_batched_tokens=6)
    llm = LLM(str(directory), attention_backend=backend, **{**args, **kwargs})
    if backend != "c":  # c: the model as built (kvattn.c where it covers the cache)
        # every ops object of the model hands the backend to attention (Gemma 3 keeps local-RoPE ones too)
        ops = [o for o in vars(llm.engine.model).values() if hasattr(o, "attention_kernel")]
        kinds = {o.attention_kernel for o in ops}
        assert kinds == {backend}
    prompts = engine_prompts()
    first = llm.generate(prompts[:1], GREEDY)[0].outputs[0].token_ids
    outs = llm.generate(prompts, GREEDY)
    assert outs[2].num_cached_tokens > 0  # read through the block table by the prefill kernel
    return [first, *(o.outputs[0].token_ids for o in outs)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_gemma3_engine_answers_as_with_the_torch_backend(
    gemma_dir: Path, kv_cache_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = greedy(gemma_dir, "torch", kv_cache_dtype=kv_cache_dtype)
    assert greedy(gemma_dir, "triton", kv_cache_dtype=kv_cache_dtype) == reference
    if kv_cache_dtype == "auto":  # the engine really ran the kernels: a broken one changes the answer
        monkeypatch.setattr(triton_attention, "_TEST_WINDOW_SKEW", 1)
        assert greedy(gemma_dir, "triton") != reference


def test_llama_engine_answers_as_with_the_torch_and_c_backends(tiny_llama_dir: Any) -> None:
    """Llama with head_dim 64 (the C decode kernel and decode program cover it): triton, torch and c
    answer alike; triton and torch turn the C decode program off."""
    directory = tiny_llama_dir(head_dim=64)
    reference = greedy(directory, "torch")
    assert greedy(directory, "triton") == reference
    assert greedy(directory, "c") == reference


def test_triton_on_a_cpu_without_the_interpreter_is_one_config_error(
    gemma_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if DEVICE.type == "cuda":
        pytest.skip("on CUDA the triton backend compiles")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="attention_backend=triton runs on CUDA") as err:
        LLM(str(gemma_dir), attention_backend="triton", kv_device_blocks=16)
    assert "\n" not in str(err.value)
