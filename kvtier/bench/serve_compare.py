"""``kvtier bench serve --compare``: the legacy and the stall-free scheduler side by side.

One in-process server per variant (the same engine flags, only the scheduling ones differ), all
started before the load begins; each rate's workload then runs against every variant in turn (the
order alternates from rate to rate, so that drifting machine load hits them alike). Reported:

* per rate and policy: output tokens/s, TTFT and ITL percentiles, ITL p99/p50; then, per rate, the
  stall-free policy's TTFT p90 and tokens/s as ratios of the legacy one's, against the targets
  (ITL p99 <= 3x p50, TTFT p90 <= 1.2x legacy, tokens/s >= 0.95x legacy);
* with ``--mixed N``: ``N`` long prompts (``--mixed-long-len`` tokens) spread among the short chats,
  against legacy, stall_free, and stall_free without the partial-prefill limit: the short requests'
  TTFT, the long ones', ITL.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from dataclasses import asdict
from typing import Any

import httpx

from kvtier.args import engine_args_from
from kvtier.bench.http_load import (
    RateRow,
    Result,
    crossing_rate,
    print_table_head,
    run_load,
    summarize,
    workload,
)
from kvtier.bench.quantiles import percentile

POLICIES = ("legacy", "stall_free")
NO_LIMIT = "stall_free, no partial limit"


def _variants(ns: argparse.Namespace) -> dict[str, dict[str, Any]]:
    variants: dict[str, dict[str, Any]] = {p: {"scheduling_policy": p} for p in POLICIES}
    if ns.mixed:
        variants[NO_LIMIT] = {"scheduling_policy": "stall_free", "max_num_partial_prefills": 0}
    return variants


def _start(ns: argparse.Namespace, overrides: dict[str, Any]) -> Any:
    from kvtier.server.app import ServerSettings, create_app
    from kvtier.server.serve import default_model_name, engine_factory, serve_in_thread

    args = dataclasses.replace(engine_args_from(ns), **overrides)
    args.validate()
    settings = ServerSettings(model_name=default_model_name(args.model), api_key=ns.api_key)
    server = serve_in_thread(create_app(engine_factory(args), settings))
    server.wait_ready()
    return server


def mixed_workload(ns: argparse.Namespace) -> tuple[list[tuple[list[int], int]], set[int]]:
    """Short chats with ``ns.mixed`` long prompts spread evenly among them; (work, long indices)."""
    work = workload(ns.num_requests, ns.prompt_len, ns.output_len, ns.workload_seed + 500)
    longs = workload(ns.mixed, (ns.mixed_long_len, ns.mixed_long_len), ns.output_len, ns.workload_seed + 501)
    step = len(work) / ns.mixed
    for k, item in enumerate(longs):
        work.insert(int(k * step + step / 2) + k, item)
    return work, {i for i, (p, _) in enumerate(work) if len(p) == ns.mixed_long_len}


def _mixed_row(results: list[Result], seconds: float, longs: set[int]) -> dict[str, float]:
    short = [r.ttft for i, r in enumerate(results) if i not in longs and r.ok and r.ttft is not None]
    long = [r.ttft for i, r in enumerate(results) if i in longs and r.ok and r.ttft is not None]
    row = summarize(0.0, results, seconds)
    return {
        "errors": row.errors,
        "tokens_per_s": row.tokens_per_s,
        "short_ttft_p50": percentile(short, 0.50),
        "short_ttft_p90": percentile(short, 0.90),
        "long_ttft_p50": percentile(long, 0.50),
        "itl_p50": row.itl_p50,
        "itl_p99": row.itl_p99,
    }


async def _compare(ns: argparse.Namespace, urls: dict[str, str]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    clients = {
        label: httpx.AsyncClient(base_url=url, headers=headers, timeout=None, limits=limits)
        for label, url in urls.items()
    }
    try:
        model = (await clients[POLICIES[0]].get("/v1/models")).raise_for_status().json()["data"][0]["id"]
        for client in clients.values():
            await run_load(client, model, workload(2, (16, 16), (4, 4), 99), None, 0)  # warm-up
        rows: list[tuple[str, RateRow]] = []
        for i, rate in enumerate(ns.rates):
            work = workload(ns.num_requests, ns.prompt_len, ns.output_len, ns.workload_seed + i)
            for label in POLICIES if i % 2 == 0 else POLICIES[::-1]:
                results, seconds = await run_load(clients[label], model, work, rate, ns.workload_seed + i)
                row = summarize(rate, results, seconds)
                rows.append((label, row))
                print(
                    f"  {label}: rate {rate:g} req/s done in {seconds:.1f}s: {row.tokens_per_s:.1f} tok/s, "
                    f"TTFT p90 {row.ttft_p90:.2f}s, ITL p50 {row.itl_p50 * 1000:.0f}ms p99 "
                    f"{row.itl_p99 * 1000:.0f}ms",
                    file=sys.stderr,
                    flush=True,
                )
        mixed: dict[str, dict[str, float]] = {}
        if ns.mixed:
            work, longs = mixed_workload(ns)
            rate = ns.mixed_rate or ns.rates[0]
            for label, client in clients.items():
                results, seconds = await run_load(client, model, work, rate, ns.workload_seed + 500)
                mixed[label] = _mixed_row(results, seconds, longs)
                done = f"  mixed, {label}: done in {seconds:.1f}s: {mixed[label]}"
                print(done, file=sys.stderr, flush=True)
    finally:
        for client in clients.values():
            await client.aclose()
    return {"model": model, "rows": rows, "mixed": mixed}


def compare_main(ns: argparse.Namespace) -> int:
    if ns.url is not None:
        raise SystemExit("kvtier: error: --compare starts its own servers; drop --url")
    servers: dict[str, Any] = {}
    try:
        for label, overrides in _variants(ns).items():
            print(f"starting the {label} server in this process ...", file=sys.stderr, flush=True)
            servers[label] = _start(ns, overrides)
        out = asyncio.run(_compare(ns, {label: s.url for label, s in servers.items()}))
    finally:
        for server in servers.values():
            server.stop()
    print_compare(out, ns)
    if ns.json:
        with open(ns.json, "w") as f:
            rows = [{"policy": label, **asdict(r)} for label, r in out["rows"]]
            json.dump({"rows": rows, "mixed": out["mixed"]}, f, indent=2)
    failed = any(r.errors for _, r in out["rows"]) or any(m["errors"] for m in out["mixed"].values())
    return 1 if failed else 0


def print_compare(out: dict[str, Any], ns: argparse.Namespace) -> None:
    print(
        f"\nkvtier bench serve --compare: {out['model']}, {ns.num_requests} requests per rate, prompts "
        f"{ns.prompt_len[0]}-{ns.prompt_len[1]} tokens, outputs {ns.output_len[0]}-{ns.output_len[1]} "
        f"tokens (streaming), max_step_ms {ns.max_step_ms:g}, step_time_factor {ns.step_time_factor:g}\n"
    )
    head = "| policy | rate req/s | errors | tok/s | TTFT p50 | TTFT p90 "
    head += "| ITL p50 | ITL p90 | ITL p99 | p99/p50 |"
    print_table_head(head)
    for label, r in out["rows"]:
        print(
            f"| {label} | {r.rate:g} | {r.errors} | {r.tokens_per_s:.0f} | {r.ttft_p50:.2f}s | "
            f"{r.ttft_p90:.2f}s | {r.itl_p50 * 1000:.0f}ms | {r.itl_p90 * 1000:.0f}ms | "
            f"{r.itl_p99 * 1000:.0f}ms | {r.itl_p99 / r.itl_p50:.1f}x |"
        )
    by = {(label, r.rate): r for label, r in out["rows"]}
    legacy = [r for label, r in out["rows"] if label == "legacy"]
    print(f"\nlegacy p90 TTFT crosses {ns.ttft_slo:g} s at {crossing_rate(legacy, ns.ttft_slo)}")
    for rate in ns.rates:
        old, new = by[("legacy", rate)], by[("stall_free", rate)]
        itl = new.itl_p99 / new.itl_p50
        ttft = new.ttft_p90 / old.ttft_p90
        tps = new.tokens_per_s / old.tokens_per_s
        print(
            f"rate {rate:g}: stall_free ITL p99/p50 {itl:.1f}x (legacy {old.itl_p99 / old.itl_p50:.1f}x; "
            f"target <= 3: {_met(itl <= 3)}), TTFT p90 {ttft:.2f}x legacy (target <= 1.2: "
            f"{_met(ttft <= 1.2)}), tok/s {tps:.2f}x legacy (target >= 0.95: {_met(tps >= 0.95)})"
        )
    if out["mixed"]:
        print_mixed(out["mixed"], ns)


def print_mixed(mixed: dict[str, dict[str, float]], ns: argparse.Namespace) -> None:
    rate = ns.mixed_rate or ns.rates[0]
    print(
        f"\nmixed workload: {ns.mixed} prompts of {ns.mixed_long_len} tokens among {ns.num_requests} "
        f"short chats at {rate:g} req/s\n"
    )
    head = "| variant | errors | tok/s | short TTFT p50 | short TTFT p90 "
    head += "| long TTFT p50 | ITL p50 | ITL p99 |"
    print_table_head(head)
    for label, m in mixed.items():
        print(
            f"| {label} | {m['errors']} | {m['tokens_per_s']:.0f} | {m['short_ttft_p50']:.2f}s | "
            f"{m['short_ttft_p90']:.2f}s | {m['long_ttft_p50']:.2f}s | {m['itl_p50'] * 1000:.0f}ms | "
            f"{m['itl_p99'] * 1000:.0f}ms |"
        )


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"
