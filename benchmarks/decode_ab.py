"""Single-stream decode measured token by token, alternating in one process (:mod:`benchmarks.throughput`).

Whole-run timings taken one after another swing by up to 1.5x on a shared machine (the other tenants,
clocks): a mode measured a minute after another can look 30% faster or slower for no reason of its
own. Here every contender decodes a round of tokens in turn, round after round, and each engine step
(forward, sampling, outputs: what a stream waits between tokens) is timed, so all of them see the same
machine. Rows built from these: ``gguf`` vs ``auto``, ``auto`` vs its bandwidth floor (a 1 GiB read
timed between rounds), and ``gguf`` vs llama.cpp.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenTimes:
    """One contender's per-token milliseconds over every round."""

    ms: list[float]

    @property
    def min(self) -> float:
        return min(self.ms)

    @property
    def median(self) -> float:
        return statistics.median(self.ms)


def _timed_steps(llm) -> list[float]:  # noqa: ANN001 - kvtier.LLM
    """Time every ``llm.engine.step`` from now on into the returned list (seconds)."""
    engine, step, times = llm.engine, llm.engine.step, []

    def timed(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        t = time.perf_counter()
        out = step(*args, **kw)
        times.append(time.perf_counter() - t)
        return out

    engine.step = timed
    return times


def _decode_round(llm, times: list[float], prompt: list[int], n: int) -> list[float]:  # noqa: ANN001
    """``n`` decode steps of one stream (its prefill step dropped), in ms."""
    from kvtier import SamplingParams

    first = len(times)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True))
    return [t * 1e3 for t in times[first + 1 :]]


def read_gbs(x: torch.Tensor, repeat: int = 2) -> float:
    """Read bandwidth of ``x.sum()`` over a large tensor (best of ``repeat``), GB/s."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * x.element_size() / best / 1e9


def modes_per_token(
    llms: dict, prompt: list[int], n: int, rounds: int = 5, read_bytes: int = 2**30
) -> tuple[dict[str, TokenTimes], list[float]]:
    """Per-token ms of each ``weight_dtype`` mode's ``LLM`` (``rounds`` x ``n`` tokens, the order
    reversed every other round), and a ``read_bytes`` read's GB/s before each round."""
    modes = list(llms)
    steps = {m: _timed_steps(llm) for m, llm in llms.items()}
    block = torch.ones(read_bytes // 4, dtype=torch.float32)  # 1 GiB by default: far past every cache
    for m, llm in llms.items():  # warm-up: first calls, page faults, thread choice
        _decode_round(llm, steps[m], prompt, 4)
    ms: dict[str, list[float]] = {m: [] for m in modes}
    bandwidth = []
    for r in range(rounds):
        bandwidth.append(read_gbs(block))
        for m in modes if r % 2 == 0 else modes[::-1]:
            ms[m] += _decode_round(llms[m], steps[m], prompt, n)
    return {m: TokenTimes(v) for m, v in ms.items()}, bandwidth


def alternating_rows(
    llms: dict,
    prompt: list[int],
    n: int,
    weight_bytes: Callable[..., int],
    row: Callable[..., None],
    read_bytes: int = 2**30,
) -> None:
    """The rows above from one alternating run of ``llms`` (weight_dtype -> ``LLM``): each mode's median
    token, ``auto`` against its floor at the median read bandwidth, ``gguf`` against ``auto``.
    ``weight_bytes(model)``: the bytes a decode step reads."""
    times, bandwidth = modes_per_token(llms, prompt, n, read_bytes=read_bytes)
    gbs = statistics.median(bandwidth)
    for m, t in times.items():
        text = f"fastest token {t.min:.2f} ms"
        row(f"decode 1 token, {m} (median, alternating)", t.median, None, "ms/token", False, None, text)
    if "auto" in times:
        floor = weight_bytes(llms["auto"].engine.model) / (gbs * 1e9) * 1e3
        text = f"floor at {gbs:.1f} GB/s: median of {len(bandwidth)} reads between rounds"
        name = "  auto vs its floor (median token, alternating)"
        row(name, times["auto"].median, floor, "ms/token", False, 0.85, text)
    if "auto" in times and "gguf" in times:
        name, text = "  gguf vs auto (median token, alternating)", ">= 2.5x auto"
        row(name, times["gguf"].median, times["auto"].median, "ms/token", False, 2.5, text)


def per_token_ms(
    mode: str, prompt: list[int], n: int, threads: int, rounds: int = 4
) -> tuple[tuple[float, float], tuple[float, float]]:
    """Single-stream decode, one token at a time: ((kvtier ``mode`` engine step, llama.cpp token) ms
    minimum, the same medians), over ``rounds`` x ``n`` tokens each, alternating in one process (robust
    to a busy machine, where whole-run differences are noise). Needs ``llama_cpp``."""
    from llama_cpp import Llama

    from kvtier import LLM
    from kvtier.models.loader import default_model_path

    llm = LLM(dtype="float32", num_threads=threads, weight_dtype=mode)
    steps, ours, theirs = _timed_steps(llm), [], []
    model = Llama(str(default_model_path()), n_threads=threads, n_ctx=512, verbose=False)
    for _ in range(rounds):
        ours += [ms / 1e3 for ms in _decode_round(llm, steps, prompt, n)]
        model.reset()
        t = time.perf_counter()
        for i, _ in enumerate(model.generate(prompt, temp=0.0)):
            now = time.perf_counter()
            if i > 0:
                theirs.append(now - t)
            t = now
            if i >= n:
                break
    return (min(ours) * 1e3, min(theirs) * 1e3), (
        statistics.median(ours) * 1e3,
        statistics.median(theirs) * 1e3,
    )
