"""Open-loop HTTP load against an OpenAI-compatible server: the requests, their timings, the summary.

Shared by ``kvtier bench serve`` (one server, a ladder of rates) and ``kvtier bench serve --compare``
(one server per scheduling policy). A request is a streaming ``/v1/completions`` call with a token-id
prompt and a fixed output length (``ignore_eos``); the client records, per request::

    ttft        seconds from sending until the first chunk with text
    itls        seconds between consecutive chunks with text (inter-token latency)
    e2e         seconds until the stream ended
    completion_tokens   the usage chunk's count

``run_load`` sends a workload with Poisson arrivals (or all at once) and ``summarize`` turns one rate's
results into a ``RateRow`` of percentiles (:func:`kvtier.bench.quantiles.percentile`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from kvtier.bench.quantiles import percentile

TOKEN_RANGE = (1000, 20000)  # prompt token ids: inside any modern vocabulary, away from special tokens


@dataclass
class Result:
    ok: bool
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class RateRow:
    rate: float
    requests: int
    errors: int
    seconds: float
    tokens_per_s: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    itl_p50: float
    itl_p90: float
    itl_p99: float
    e2e_p50: float


def workload(
    n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(*TOKEN_RANGE) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len))
        for _ in range(n)
    ]


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    res = Result(ok=False)
    last: float | None = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}"
                await r.aread()
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message")
                    return res
                if chunk.get("usage"):
                    res.completion_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.e2e = time.perf_counter() - t0
    res.ok = res.error is None
    return res


async def run_load(
    client: httpx.AsyncClient, model: str, work: list[tuple[list[int], int]], rate: float | None, seed: int
) -> tuple[list[Result], float]:
    """Send ``work`` with Poisson arrivals at ``rate`` (None: all at once); ``(results, seconds)``."""
    rng = random.Random(seed)
    t0 = time.perf_counter()
    tasks = []
    at = 0.0
    for prompt, out_len in work:
        if rate is not None:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            at += rng.expovariate(rate)
        tasks.append(asyncio.create_task(one_request(client, model, prompt, out_len)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - t0


def summarize(rate: float, results: list[Result], seconds: float) -> RateRow:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    tokens = sum(r.completion_tokens for r in ok)
    return RateRow(
        rate=rate,
        requests=len(results),
        errors=len(results) - len(ok),
        seconds=seconds,
        tokens_per_s=tokens / seconds if seconds else 0.0,
        ttft_p50=percentile(ttfts, 0.50),
        ttft_p90=percentile(ttfts, 0.90),
        ttft_p99=percentile(ttfts, 0.99),
        itl_p50=percentile(itls, 0.50),
        itl_p90=percentile(itls, 0.90),
        itl_p99=percentile(itls, 0.99),
        e2e_p50=percentile([r.e2e for r in ok], 0.50),
    )


def crossing_rate(rows: list[RateRow], slo: float) -> str:
    """The request rate where p90 TTFT reaches ``slo``, interpolated between measured rates."""
    prev: RateRow | None = None
    for row in rows:
        if row.ttft_p90 >= slo:
            if prev is None:
                return f"< {row.rate:g} req/s (p90 TTFT {row.ttft_p90:.2f} s at the lowest rate)"
            frac = (slo - prev.ttft_p90) / (row.ttft_p90 - prev.ttft_p90)
            return f"~{prev.rate + frac * (row.rate - prev.rate):.2f} req/s"
        prev = row
    return f"> {rows[-1].rate:g} req/s (not reached)" if rows else "n/a"


def print_table_head(head: str) -> None:
    """A markdown table's header row ``head`` and its separator row."""
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
