"""``kvtier bench gpu`` parts 2-5: the tiers' data path and the attention kernels, timed on the device.

2. transfer  host↔device block copies through ``TierMover`` (pinned host buffer, its own CUDA stream)
             next to a plain pinned ``copy_`` (cudaMemcpy) of the same bytes.
3. ttft      time to first token of a long prompt: computed from scratch, its blocks loaded back from
             the host tier (the device copy evicted by other prompts), and a device prefix-cache hit.
4. decode    tokens/s of a batch decoding together, with the Triton kernels and with the torch path
             (gather the context, pad, SDPA).
5. overlap   how much of a host→device load the forward hides: the engine's order (the step's forward
             waits for its loads) and the bound (a copy of the same bytes on a side stream, not waited on).

Times are wall-clock around synchronized calls (``torch.cuda.synchronize``), best of a few repetitions.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.gpu_models import Shape, random_prompts
from kvtier.stats import Medium

BLOCK_SIZE = 16


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def best_of(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Best synchronized wall time of each function, run in turn (all see the same machine)."""
    for fn in fns.values():
        fn()  # warm-up
    sync()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


# ------------------------------------------------------------------------------------------ transfer
@dataclass
class TransferRow:
    blocks: int
    pattern: str  # contiguous device ids (one slice copy) or scattered (a gather or scatter on the device)
    mib: float
    load_gbs: float  # host → device through the mover
    store_gbs: float  # device → host through the mover
    memcpy_h2d_gbs: float  # a plain pinned copy of the same bytes
    memcpy_d2h_gbs: float

    @property
    def load_fraction(self) -> float:
        return self.load_gbs / self.memcpy_h2d_gbs


@torch.inference_mode()
def transfer_rows(
    shape: Shape, sizes: tuple[int, ...], dtype: torch.dtype, repeat: int = 5
) -> list[TransferRow]:
    """The shape's blocks (every layer of 16 tokens) moved in batches of ``sizes`` blocks."""
    from kvtier.kv.plan import SwapPlan
    from kvtier.transfer.mover import TierMover

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    block_shape = (shape.layers, BLOCK_SIZE, 2, shape.kv_heads, shape.head_dim)
    top = max(sizes)
    pool = torch.ones((top * 2, *block_shape), dtype=dtype, device=dev)
    mover = TierMover(pool, top)
    pinned = dev.type == "cuda"
    host = torch.ones(top * mover.block_bytes, dtype=torch.uint8, pin_memory=pinned)
    device_bytes = torch.ones(top * mover.block_bytes, dtype=torch.uint8, device=dev)
    rng = random.Random(0)
    rows = []
    for n in sizes:
        nbytes = n * mover.block_bytes
        ids = {"contiguous": list(range(n)), "scattered": rng.sample(range(top * 2), n)}
        fns: dict[str, Callable[[], object]] = {
            "h2d": lambda b=nbytes: device_bytes[:b].copy_(host[:b], non_blocking=True),
            "d2h": lambda b=nbytes: host[:b].copy_(device_bytes[:b], non_blocking=True),
        }
        for pattern, block_ids in ids.items():
            loads = SwapPlan(loads=list(zip(range(n), block_ids, strict=True)))
            stores = SwapPlan(stores=list(zip(block_ids, range(n), strict=True)))
            fns[f"load {pattern}"] = lambda p=loads: (mover.execute(p), mover.synchronize())
            fns[f"store {pattern}"] = lambda p=stores: (mover.execute(p), mover.synchronize())
        best = best_of(fns, repeat)
        gbs = {k: nbytes / v / 1e9 for k, v in best.items()}
        for pattern in ids:
            rows.append(
                TransferRow(
                    n,
                    pattern,
                    nbytes / 2**20,
                    gbs[f"load {pattern}"],
                    gbs[f"store {pattern}"],
                    gbs["h2d"],
                    gbs["d2h"],
                )
            )
    return rows


# ------------------------------------------------------------------------------------------ TTFT
@dataclass
class TTFTRow:
    prompt_tokens: int
    recompute_ms: float
    host_load_ms: float  # loaded back into an idle engine: the blocks it evicts were written back ahead
    device_hit_ms: float
    host_tokens: int  # prompt tokens the host-load run took from the host tier
    device_tokens: int  # ... the device-hit run from the device pool
    busy_load_ms: float = 0.0  # loaded back right after other prompts: it stores what it evicts first
    loads_exact: str = ""  # "k/n": host loads (idle, busy) whose answer is the device hit's, bit for bit

    @property
    def host_speedup(self) -> float:
        return self.recompute_ms / self.host_load_ms

    @property
    def busy_speedup(self) -> float:
        return self.recompute_ms / self.busy_load_ms if self.busy_load_ms else 0.0


def _ttft(llm: Any, prompt: list[int]) -> tuple[float, Any]:
    from kvtier import SamplingParams

    sync()
    t0 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=0)
    out = llm.generate([prompt], params)[0]
    sync()
    return 1000 * (time.perf_counter() - t0), out


def answer(out: Any) -> tuple[int, float]:
    """A one-token answer as (token, its logprob): a device hit and a host load read the same KV bytes
    and compute the same last chunk, so theirs are equal bit for bit."""
    chosen = out.outputs[0].logprobs[0]
    return chosen.token_id, chosen.logprob


TTFT_REPEATS = 3  # device hits and host loads: the best of this many


def pool_tokens(lengths: tuple[int, ...]) -> int:
    """The ``ttft`` engine's device pool: the longest prompt and a quarter more."""
    return int(max(lengths) * 1.25) + 4 * BLOCK_SIZE


def ttft_engine(shape: Shape, lengths: tuple[int, ...], dtype: str, backend: str) -> dict[str, Any]:
    """An engine whose device pool holds ``pool_tokens(lengths)``, over a host tier three times that
    size (the ``ttft`` section's, and the profile's of a host load)."""
    tokens = pool_tokens(lengths)
    block_bytes = shape.kv_bytes_per_token(2 if dtype != "float32" else 4) * BLOCK_SIZE
    return dict(
        dtype=dtype, attention_backend=backend, kv_device_blocks=-(-tokens // BLOCK_SIZE),
        kv_host_gb=3 * tokens * block_bytes / BLOCK_SIZE / 2**30, max_model_len=max(lengths) + BLOCK_SIZE,
        max_num_batched_tokens=8192,
    )  # fmt: skip


def push_out(llm: Any, shape: Shape, lengths: tuple[int, ...], seed: int, idle: bool = True) -> None:
    """Fill the device pool with other prompts (half the longest each), one at a time: each evicts the
    oldest blocks, a waiting prompt's first, and write-back stores them to the host tier. Then, with
    ``idle``, what a server does before its next request (``settle``)."""
    from kvtier import SamplingParams

    filler_len = max(lengths) // 2
    for f in random_prompts(
        -(-11 * pool_tokens(lengths) // (10 * filler_len)), filler_len, seed, shape.vocab
    ):
        llm.generate([f], SamplingParams(temperature=0.0, max_tokens=1))
    if idle:
        settle(llm.engine)


def settle(engine: Any, max_steps: int = 10_000) -> bool:
    """An idle server's loop (kvtier/server/async_engine.py) until it has nothing left to do: the sizing
    trackers' backlog, the tiers' copies, and the pool's next evictions written back ahead. False if
    work remained after ``max_steps``."""
    for _ in range(max_steps):
        if engine.has_idle_work:
            engine.run_idle_work()
        elif engine.has_tier_work:
            engine.settle_tiers()
        else:
            return True
    return False


def ttft_rows(
    model_dir: Path, shape: Shape, lengths: tuple[int, ...], dtype: str, backend: str
) -> list[TTFTRow]:
    """Each prompt computed, hit on the device, then pushed out of the device pool by other prompts
    (stored to the host tier on eviction) and loaded back: into an engine that idled first, as a
    server between requests does, and into one that did not (busy); device hits and host loads the
    best of ``TTFT_REPEATS`` (fresh fillers before each load)."""
    from kvtier import LLM

    rows = []
    with LLM(str(model_dir), **ttft_engine(shape, lengths, dtype, backend)) as llm:
        warm = random_prompts(1, min(lengths), 99, shape.vocab)[0]
        for _ in range(2):  # kernels compiled: a fresh chunk, then one after cached blocks
            _ttft(llm, warm)
        for n in lengths:
            prompt = random_prompts(1, n, n, shape.vocab)[0]
            recompute, _ = _ttft(llm, prompt)
            device_hit, dev_out = min((_ttft(llm, prompt) for _ in range(TTFT_REPEATS)), key=lambda r: r[0])
            loads, busy = [], []
            for i in range(TTFT_REPEATS):
                push_out(llm, shape, lengths, n + 1 + 97 * i, idle=False)
                busy.append(_ttft(llm, prompt))
                push_out(llm, shape, lengths, n + 2 + 97 * i)
                loads.append(_ttft(llm, prompt))
            host_load, host_out = min(loads, key=lambda r: r[0])
            same = sum(answer(out) == answer(dev_out) for _, out in loads + busy)
            rows.append(
                TTFTRow(
                    n, recompute, host_load, device_hit,
                    host_out.cached_tokens_by_tier.get(Medium.HOST, 0),
                    dev_out.cached_tokens_by_tier.get(Medium.DEVICE, 0),
                    min(ms for ms, _ in busy), f"{same}/{len(loads + busy)}",
                )
            )  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------ decode
@dataclass
class DecodeRow:
    batch: int
    context: int  # prompt tokens per sequence
    triton_tok_s: float | None  # the Triton kernels, decode steps replaying CUDA graphs where they apply
    triton_eager_tok_s: float | None  # the Triton kernels, every step eager (--enforce-eager)
    torch_tok_s: float  # the torch path (gather + SDPA), eager
    # the median step of each eager variant (ms); "cold": the first pass over these context lengths. Every
    # column but the cold ones is the second pass, over lengths the process has seen: on an H200 on
    # 2026-11-28 the torch path's first-pass steps were 55-59 ms at every batch and the phases section
    # (which runs later, over lengths seen) put them at 7-10 ms; a new shape costs the torch path its
    # SDPA's per-shape setup, the Triton kernels compile once for every length
    triton_eager_p50_ms: float | None = None
    torch_p50_ms: float = 0.0
    triton_eager_cold_p50_ms: float | None = None
    torch_cold_p50_ms: float = 0.0

    @property
    def ratio(self) -> float | None:
        """The kernels against the gather path, both eager (the issue's comparison)."""
        return None if self.triton_eager_tok_s is None else self.triton_eager_tok_s / self.torch_tok_s

    @property
    def graphs_gain(self) -> float | None:
        if self.triton_tok_s is None or self.triton_eager_tok_s is None:
            return None
        return self.triton_tok_s / self.triton_eager_tok_s


@contextmanager
def decode_batch(
    llm: Any, shape: Shape, batch: int, context: int, steps: int, seed: int, shared: int = 0, **add: Any
) -> Iterator[Any]:
    """The engine with ``batch`` sequences past their ``context``-token prompts (steps run until every
    sequence has its first token), room for ``steps`` more tokens each; afterwards the requests are
    aborted and the engine drained. The prompts' first ``shared`` tokens are the same (one prefill, then
    prefix hits: each row still reads its whole context). ``add``: ``add_request``'s keywords
    (``final_only=True``: as ``LLM.generate`` adds them)."""
    from kvtier import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + context, ignore_eos=True)
    prefix = random_prompts(1, shared, seed + 1, shape.vocab)[0] if shared else None
    ids = [
        engine.add_request({"prompt_token_ids": p}, params, **add)
        for p in random_prompts(batch, context - shared, seed, shape.vocab, prefix)
    ]
    while not all(engine.requests[rid].seqs[0].num_output_tokens for rid in ids):
        engine.step()
    sync()
    try:
        yield engine
    finally:
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()


def decode_tok_s(
    llm: Any, shape: Shape, batch: int, context: int, new_tokens: int, seed: int
) -> tuple[float, float]:
    """Tokens/s of ``batch`` sequences in decode-only steps, and the median step (ms): their
    ``context``-token prompts prefilled first, then ``new_tokens`` steps timed. (Timing whole ``generate``
    calls would count prefill steps and the mixed steps of stall-free scheduling, whose number changes
    with the measured step times.) A mean step (``batch`` / tokens/s) far above the median is a few slow
    steps, not a slow path."""
    steps = []
    with decode_batch(llm, shape, batch, context, new_tokens, seed) as engine:
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            engine.step()
            steps.append(time.perf_counter())
        sync()
        seconds = time.perf_counter() - t0
    spans = [b - a for a, b in zip([t0, *steps], steps, strict=False)]
    return batch * new_tokens / max(seconds, 1e-9), 1000 * statistics.median(spans)


def decode_rows(
    model_dir: Path,
    shape: Shape,
    cases: Sequence[tuple[int, int]],  # (batch, prompt tokens per sequence)
    new_tokens: int,
    dtype: str,
    backends: list[str],
) -> list[DecodeRow]:
    from kvtier import LLM

    tok_s: dict[str, list[tuple[float, float]]] = {}  # variant -> (tokens/s, median step ms) per case
    cold: dict[str, list[float]] = {}  # variant -> the first pass's median step (ms) per case
    blocks = max(b * 2 * (-(-(c + new_tokens) // BLOCK_SIZE)) for b, c in cases) + 64
    variants = {"torch": ("torch", False), "triton": ("triton", False), "triton_eager": ("triton", True)}
    for name, (backend, eager) in variants.items():
        if backend not in backends:
            continue
        engine = dict(
            dtype=dtype, attention_backend=backend, kv_device_blocks=blocks,
            max_num_seqs=max(b for b, _ in cases), enforce_eager=eager,
        )  # fmt: skip
        with LLM(str(model_dir), **engine) as llm:
            for warm in (32, 600):  # warm-up: kernels compiled (one part, several), allocator sized
                decode_tok_s(llm, shape, 2, warm, 4, seed=warm)
            # the same prompts twice: the second pass steps through context lengths seen once
            passes = [
                [decode_tok_s(llm, shape, b, c, new_tokens, 10 * b + c) for _ in (1, 2)] for b, c in cases
            ]
            tok_s[name] = [second for _, second in passes]
            cold[name] = [first[1] for first, _ in passes]
    return [
        DecodeRow(
            b,
            c,
            *(tok_s[k][i][0] if k in tok_s else None for k in ("triton", "triton_eager")),
            tok_s["torch"][i][0],
            tok_s["triton_eager"][i][1] if "triton_eager" in tok_s else None,
            tok_s["torch"][i][1],
            cold["triton_eager"][i] if "triton_eager" in cold else None,
            cold["torch"][i],
        )  # fmt: skip
        for i, (b, c) in enumerate(cases)
    ]
