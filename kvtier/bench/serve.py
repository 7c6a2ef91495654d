"""``kvtier bench serve``: open-loop HTTP load against an OpenAI-compatible server.

For each request rate, ``--num-requests`` streaming ``/v1/completions`` requests arrive as a Poisson
process (seeded): random token-id prompts and fixed output lengths (``ignore_eos``), drawn uniformly from
``--prompt-len`` and ``--output-len``. Reported per rate: output tokens/s, time to first token and
inter-token latency percentiles (as a client sees them), and the rate at which p90 TTFT crosses
``--ttft-slo`` (linear interpolation between the measured rates).

Server overhead: one batch of ``--overhead-requests`` requests, all sent at once, through the server vs
through offline ``LLM.generate`` with the same engine flags, in the same process (only when the bench
starts the server itself), best of ``--overhead-repeats`` alternating runs. The load generator shares the
process (and its GIL) with the server, so the ratio includes the client's own cost.

The server starts in this process on a free loopback port unless ``--url`` names a running one.

``--compare`` starts one server per scheduling policy (``legacy``: one fixed token budget in
admission order; ``stall_free``: decode-first with a step-time budget) in this process and runs every
rate against each in turn, side by side in one run (:mod:`kvtier.bench.serve_compare`), with the ratios
of stall_free to legacy. ``--mixed N`` adds a mixed workload: ``N`` prompts of ``--mixed-long-len``
tokens among ``--num-requests`` short chats at ``--mixed-rate``, against stall_free with and without
``--max-num-partial-prefills`` (and legacy), reporting the short requests' TTFT.

The requests, their timings and the per-rate summary are :mod:`kvtier.bench.http_load`'s.

``--hostile`` mixes hostile traffic into every rate (:mod:`kvtier.bench.hostile`: 20 MB bodies, ``n`` at
the limit, slow connections) and reports ``/health``'s latency meanwhile; compare the TTFT with a run
without it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import asdict
from typing import Any

import httpx

from kvtier.args import add_engine_args, engine_args_from, engine_kwargs
from kvtier.bench.hostile import KINDS as HOSTILE_KINDS
from kvtier.bench.hostile import Hostile, HostileStats
from kvtier.bench.http_load import RateRow, crossing_rate, print_table_head, run_load, summarize, workload
from kvtier.bench.serve_compare import compare_main


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 1 <= LO <= HI, got {text!r}")
    return a, b


def _rates(text: str) -> list[float]:
    rates = sorted(float(x) for x in text.split(",") if x.strip())
    if not rates or rates[0] <= 0:
        raise argparse.ArgumentTypeError(f"expected positive comma-separated rates, got {text!r}")
    return rates


def _hostile_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in HOSTILE_KINDS]
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(HOSTILE_KINDS)}, got {text!r}")
    return kinds


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--url", default=None, help="a running server (default: start one in this process)")
    g.add_argument("--api-key", default=None, help="Bearer key for --url")
    g.add_argument("--rates", type=_rates, default=_rates("1,2,4,8"), help="requests/s (default 1,2,4,8)")
    g.add_argument("--num-requests", type=int, default=24, help="requests per rate (default 24)")
    g.add_argument(
        "--prompt-len", type=_range, default=(32, 256), help="prompt tokens LO:HI (default 32:256)"
    )
    g.add_argument("--output-len", type=_range, default=(16, 96), help="output tokens LO:HI (default 16:96)")
    g.add_argument("--ttft-slo", type=float, default=2.0, help="p90 TTFT threshold in s (default 2)")
    g.add_argument(
        "--overhead-requests", type=int, default=32, help="server vs offline batch size (0 skips; default 32)"
    )
    g.add_argument(
        "--overhead-repeats", type=int, default=2, help="best of this many runs per path (default 2)"
    )
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--json", default=None, help="also write the results to this JSON file")
    g.add_argument(
        "--hostile",
        action="store_true",
        help="mix in hostile traffic (20 MB bodies, n at the limit, slow connections, huge grammars, "
        "non-finite sampling values, empty-message floods); time /health",
    )
    g.add_argument(
        "--hostile-n", type=int, default=16, help="n of the hostile requests (the server's --max-n)"
    )
    g.add_argument("--hostile-slow", type=int, default=8, help="slow connections held open (default 8)")
    g.add_argument(
        "--hostile-kinds",
        type=_hostile_kinds,
        default=HOSTILE_KINDS,
        help=f"which hostile kinds, comma-separated (default all: {','.join(HOSTILE_KINDS)})",
    )
    g.add_argument(
        "--compare",
        action="store_true",
        help="legacy vs stall_free scheduling, one in-process server each, side by side",
    )
    g.add_argument(
        "--mixed", type=int, default=0, help="with --compare: long prompts in a mixed workload (0: none)"
    )
    g.add_argument("--mixed-long-len", type=int, default=4000, help="tokens of each long prompt (4000)")
    g.add_argument("--mixed-rate", type=float, default=None, help="mixed workload rate (default: lowest)")
    add_engine_args(p)
    p.set_defaults(func=main)


def offline_llm(ns: argparse.Namespace) -> Any:
    """An ``LLM`` with the bench's engine flags (the same as the server's)."""
    from kvtier.llm import LLM

    args = engine_args_from(ns)
    return LLM(args.model, **engine_kwargs(args))


def offline_tokens_per_s(llm: Any, work: list[tuple[list[int], int]]) -> float:
    """Output tokens/s of ``work`` through ``LLM.generate`` (the whole batch at once)."""
    from kvtier.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    seconds = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


async def _bench(ns: argparse.Namespace, url: str, in_process: bool) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None, limits=limits) as client:
        models = (await client.get("/v1/models")).raise_for_status().json()
        model = models["data"][0]["id"]
        await run_load(client, model, workload(2, (16, 16), (4, 4), 99), None, 0)  # warm-up
        rows = []
        hostile = HostileStats()
        for i, rate in enumerate(ns.rates):
            work = workload(ns.num_requests, ns.prompt_len, ns.output_len, ns.workload_seed + i)
            mixed: Any = contextlib.nullcontext()
            if ns.hostile:
                mixed = Hostile(url, model, ns.hostile_n, ns.hostile_slow, headers, hostile, ns.hostile_kinds)
            async with mixed:
                results, seconds = await run_load(client, model, work, rate, ns.workload_seed + i)
            rows.append(summarize(rate, results, seconds))
            print(f"  rate {rate:g} req/s done in {seconds:.1f}s", file=sys.stderr, flush=True)
        overhead: dict[str, Any] | None = None
        if ns.overhead_requests > 0 and in_process:
            overhead = await _overhead(ns, client, model)
    return {
        "model": model,
        "rows": rows,
        "overhead": overhead,
        "hostile": hostile.summary() if ns.hostile else None,
    }


async def _overhead(ns: argparse.Namespace, client: httpx.AsyncClient, model: str) -> dict[str, Any]:
    """Best-of-``--overhead-repeats`` tokens/s of one batch through the server and through ``LLM.generate``,
    alternating (server, offline, server, ...) so that drifting machine load hits both alike."""
    print("server vs offline LLM.generate ...", file=sys.stderr, flush=True)
    work = workload(ns.overhead_requests, ns.prompt_len, ns.output_len, ns.workload_seed + 1000)
    llm = offline_llm(ns)  # loaded while the server is idle; it steps only while the server is idle
    offline_tokens_per_s(llm, work[:4])  # warm-up
    server, offline, errors = 0.0, 0.0, 0
    for _ in range(max(1, ns.overhead_repeats)):
        results, seconds = await run_load(client, model, work, None, 0)
        row = summarize(float("inf"), results, seconds)
        server, errors = max(server, row.tokens_per_s), errors + row.errors
        offline = max(offline, offline_tokens_per_s(llm, work))
    llm.engine.close()
    return {
        "server_tokens_per_s": server,
        "offline_tokens_per_s": offline,
        "ratio": server / offline,
        "errors": errors,
    }


def main(ns: argparse.Namespace) -> int:
    if ns.compare:
        return compare_main(ns)
    server = None
    url = ns.url
    if url is None:
        from kvtier.server.app import ServerSettings, create_app
        from kvtier.server.serve import default_model_name, engine_factory, serve_in_thread

        args = engine_args_from(ns)
        settings = ServerSettings(model_name=default_model_name(args.model), api_key=ns.api_key)
        print("starting the server in this process ...", file=sys.stderr, flush=True)
        server = serve_in_thread(create_app(engine_factory(args), settings))
        server.wait_ready()
        url = server.url
    try:
        out = asyncio.run(_bench(ns, url, in_process=server is not None))
    finally:
        if server is not None:
            server.stop()
    overhead = out["overhead"]
    print_report(out["model"], out["rows"], overhead, ns)
    if out["hostile"] is not None:
        print_hostile(out["hostile"])
    if ns.json:
        with open(ns.json, "w") as f:
            result = {
                "rows": [asdict(r) for r in out["rows"]],
                "overhead": overhead,
                "hostile": out["hostile"],
            }
            json.dump(result, f, indent=2)
    failed = any(r.errors for r in out["rows"]) or (overhead is not None and overhead["errors"])
    return 1 if failed else 0


def print_report(
    model: str, rows: list[RateRow], overhead: dict[str, Any] | None, ns: argparse.Namespace
) -> None:
    print(
        f"\nkvtier bench serve: {model}, {ns.num_requests} requests per rate, prompts {ns.prompt_len[0]}-"
        f"{ns.prompt_len[1]} tokens, outputs {ns.output_len[0]}-{ns.output_len[1]} tokens (streaming)\n"
    )
    head = "| rate req/s | done | errors | tok/s | TTFT p50 | TTFT p90 | TTFT p99 "
    head += "| ITL p50 | ITL p90 | ITL p99 |"
    print_table_head(head)
    for r in rows:
        print(
            f"| {r.rate:10g} | {r.requests - r.errors:4d} | {r.errors:6d} | {r.tokens_per_s:5.0f} | "
            f"{r.ttft_p50:7.2f}s | {r.ttft_p90:7.2f}s | {r.ttft_p99:7.2f}s | "
            f"{r.itl_p50 * 1000:5.0f}ms | {r.itl_p90 * 1000:5.0f}ms | {r.itl_p99 * 1000:5.0f}ms |"
        )
    print(f"\np90 TTFT crosses {ns.ttft_slo:g} s at {crossing_rate(rows, ns.ttft_slo)}")
    if overhead is not None:
        ratio = overhead["ratio"]
        met = "met" if ratio >= 0.9 else "NOT met"
        server, offline = overhead["server_tokens_per_s"], overhead["offline_tokens_per_s"]
        print(
            f"server overhead ({ns.overhead_requests} requests at once): server {server:.0f} tok/s vs "
            f"offline LLM.generate {offline:.0f} tok/s = {ratio:.2f}x (target >= 0.90: {met})"
        )


def print_hostile(h: dict[str, Any]) -> None:
    answers = ", ".join(f"{k}: {v}" for k, v in sorted(h["answers"].items()))
    print(
        f"hostile traffic mixed in: /health p50 {h['health_p50_ms']:.1f} ms, p99 {h['health_p99_ms']:.1f} "
        f"ms, max {h['health_max_ms']:.1f} ms over {h['health_polls']} polls ({h['health_errors']} not 200; "
        f"target p99 < 100 ms: {'met' if h['health_p99_ms'] < 100 else 'NOT met'}); answers: {answers}"
    )
