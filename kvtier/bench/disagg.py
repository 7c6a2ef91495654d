"""``kvtier bench disagg``: the same cores split two ways behind ``kvtier router``, side by side.

* **colocated**: two ``kvtier serve`` replicas (``--role both``), one torch thread each, cache-aware;
* **disaggregated**: one ``--role prefill`` and one ``--role decode`` replica, one thread each.

Both with a shared Redis tier (``kvtier.bench.cluster_procs``) and the same workload, run through the
router: ``--users`` streaming chat users (``kvtier.bench.cluster_workload``: a shared system prompt, a
document each, ``--rounds`` rounds) and, among them, ``--long-prompts`` new ``--long-tokens``-token prompts
(streamed too), one every ``--long-every-s`` seconds. Reported per split:

* the chat streams' inter-token latency p50 and p99 (what a long prompt's chunks stretch) and p99/p50;
* the long prompts' TTFT p90; output tokens/s (every answer's tokens over the run's wall time);
* from the router (disaggregated only): handoffs; the handoff overhead's p50, the time from a prefill
  replica's answer to the decode replica's first token (``handoff_overhead_seconds``: publishing the
  blocks, the decode replica reading them from Redis and computing the partial last block; the median
  interpolated in the histogram's bucket, 0.1 s wide up to 1 s); KV bytes moved per handoff, and those
  bytes over the mean overhead (a lower bound of what the shared tier sustained: the tail's compute and
  the first token are inside); below the table, the mean overhead split into the wait for the blocks to
  reach Redis (``handoff_publish_seconds``) and the rest.

Targets (issue 29): ITL p99 <= 2x p50 disaggregated; long TTFT p90 <= 1.3x colocated's; tok/s >= 0.85x.
A full run takes minutes on two cores; ``tests/test_disagg_bench.py`` runs a tiny one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvtier.bench.cluster import scrape, warm
from kvtier.bench.cluster_procs import Cluster, ReplicaSettings
from kvtier.bench.cluster_report import histogram_quantile
from kvtier.bench.cluster_workload import (
    Record,
    WorkloadSpec,
    build_conversations,
    chat_request,
    run_workload,
)
from kvtier.bench.multiturn import WORDS
from kvtier.bench.quantiles import percentile

SPLITS = {"colocated": ("both", "both"), "disaggregated": ("prefill", "decode")}


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("disagg")
    g.add_argument("--splits", default="colocated,disaggregated", help="which splits to run, in order")
    g.add_argument("--model", default=None, help="the replicas' --model (default: the embedded SmolLM2)")
    g.add_argument("--users", type=int, default=6, help="streaming chat users (default 6)")
    g.add_argument("--rounds", type=int, default=4, help="rounds per chat user (default 4)")
    g.add_argument("--system-tokens", type=int, default=60, help="the chats' shared system prompt (~tokens)")
    g.add_argument("--doc-tokens", type=int, default=200, help="each chat user's document (~tokens)")
    g.add_argument("--question-tokens", type=int, default=20, help="each chat question (~tokens)")
    g.add_argument("--answer-tokens", type=int, default=48, help="tokens per chat answer (default 48)")
    g.add_argument("--long-prompts", type=int, default=4, help="long prompts among them (default 4)")
    g.add_argument("--long-tokens", type=int, default=3000, help="each long prompt (~tokens, default 3000)")
    g.add_argument("--long-answer-tokens", type=int, default=16, help="tokens per long answer")
    g.add_argument("--long-every-s", type=float, default=6.0, help="seconds between long prompts")
    g.add_argument(
        "--min-prompt-tokens", type=int, default=512, help="the router's --disagg-min-prompt-tokens"
    )
    g.add_argument("--device-blocks", type=int, default=512, help="each replica's device pool (blocks)")
    g.add_argument("--host-gb", type=float, default=1.0, help="each replica's host tier (GiB)")
    g.add_argument("--max-model-len", type=int, default=4608, help="each replica's --max-model-len")
    g.add_argument("--json", default=None, help="write the results here too")
    p.set_defaults(func=main)


@dataclass
class SplitResult:
    split: str
    seconds: float = 0.0
    errors: int = 0
    itl_p50: float = float("nan")
    itl_p99: float = float("nan")
    long_ttft_p90: float = float("nan")
    long_ttfts: list[float] = field(default_factory=list)  # each long prompt's, in arrival order (the JSON)
    output_tok_s: float = 0.0
    handoffs: int = 0
    handoff_overhead_s: float = float("nan")  # mean: prefill answered -> decode's first token
    handoff_overhead_p50_s: float = float("nan")  # its median, from the router's histogram (interpolated)
    handoff_publish_s: float = float("nan")  # mean: the part of it waiting for the blocks in Redis
    bytes_per_handoff: float = float("nan")
    shared_tier_gb_s: float = float("nan")
    notes: list[str] = field(default_factory=list)

    @property
    def itl_ratio(self) -> float:
        return self.itl_p99 / self.itl_p50 if self.itl_p50 > 0 else float("nan")


async def _long_prompts(url: str, ns: argparse.Namespace, t0: float) -> list[Record]:
    """``--long-prompts`` new long chats, one every ``--long-every-s``, each streamed."""
    rng = random.Random(7)
    records: list[Record] = []
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:

        async def one(i: int) -> None:
            await asyncio.sleep((i + 0.5) * ns.long_every_s)
            rec = Record(-1 - i, 0, time.perf_counter() - t0)
            records.append(rec)
            words = " ".join(rng.choice(WORDS) for _ in range(int(ns.long_tokens / 1.1)))  # ~1.1 tok/word
            text = f"Long document {i}:\n{words}\n\nSummarize it."
            await chat_request(client, [{"role": "user", "content": text}], ns.long_answer_tokens, rec, t0)

        await asyncio.gather(*(one(i) for i in range(ns.long_prompts)))
    return records


async def _workload(url: str, ns: argparse.Namespace) -> tuple[list[Record], list[Record], float]:
    spec = WorkloadSpec(
        users=ns.users,
        rounds=ns.rounds,
        system_tokens=ns.system_tokens,
        doc_tokens=ns.doc_tokens,
        question_tokens=ns.question_tokens,
        answer_tokens=ns.answer_tokens,
        concurrency=ns.users,
        stagger_s=0.5,
    )
    t0 = time.perf_counter()
    (chats, seconds), longs = await asyncio.gather(
        run_workload(url, spec, build_conversations(spec)), _long_prompts(url, ns, t0)
    )
    return chats, longs, max(seconds, time.perf_counter() - t0)


def _summarize(res: SplitResult, chats: list[Record], longs: list[Record], ns: argparse.Namespace) -> None:
    ok_chats, ok_longs = [r for r in chats if r.ok], [r for r in longs if r.ok]
    res.errors = len(chats) + len(longs) - len(ok_chats) - len(ok_longs)
    for error in sorted({r.error for r in (*chats, *longs) if not r.ok and r.error})[:3]:
        res.notes.append(f"error: {error}")
    itls = [x for r in ok_chats for x in r.itls]
    if itls:
        res.itl_p50, res.itl_p99 = percentile(itls, 0.5), percentile(itls, 0.99)
    ttfts = [r.ttft for r in ok_longs if r.ttft is not None]
    res.long_ttfts = [round(t, 3) for t in ttfts]
    if ttfts:
        res.long_ttft_p90 = percentile(ttfts, 0.9)
    tokens = len(ok_chats) * ns.answer_tokens + len(ok_longs) * ns.long_answer_tokens
    res.output_tok_s = tokens / res.seconds if res.seconds else 0.0


def _router_numbers(res: SplitResult, router_url: str) -> None:
    """Handoffs, their time and the bytes they moved, from the router's /metrics."""
    m = scrape(router_url)
    res.handoffs = int(m.get('kvtier_router:handoffs_total{outcome="handoff"}', 0))
    if res.handoffs:
        spent = m.get("kvtier_router:handoff_overhead_seconds_sum", 0.0)
        timed = m.get("kvtier_router:handoff_overhead_seconds_count", 0.0)
        res.handoff_overhead_s = spent / timed if timed else float("nan")
        res.handoff_overhead_p50_s = histogram_quantile(
            m, "kvtier_router:handoff_overhead_seconds", 0.5, interpolate=True
        )
        published = m.get("kvtier_router:handoff_publish_seconds_count", 0.0)
        if published:
            res.handoff_publish_s = m.get("kvtier_router:handoff_publish_seconds_sum", 0.0) / published
        moved = m.get("kvtier_router:handoff_bytes_total", 0.0)
        res.bytes_per_handoff = moved / res.handoffs
        res.shared_tier_gb_s = moved / spent / 1e9 if spent else float("nan")
    failed = int(m.get('kvtier_router:handoffs_total{outcome="prefill_failed"}', 0))
    if failed:
        res.notes.append(f"{failed} prefill(s) failed: the decode replica computed those prompts")


def run_split(split: str, ns: argparse.Namespace, log_root: Path) -> SplitResult:
    """One split: Redis, two replicas with its roles, the router; the workload through it."""
    log_dir = log_root / split
    log_dir.mkdir(parents=True)
    res = SplitResult(split)
    with Cluster(log_dir) as c:
        c.start_redis()
        settings = ReplicaSettings(ns.device_blocks, ns.host_gb, ns.max_model_len, 1, c.redis_url)
        model = ["--model", ns.model] if ns.model else []
        for role in SPLITS[split]:
            child = c.add_replica(settings)
            child.argv += ["--role", role, *model]
        extra = ["--disagg-min-prompt-tokens", str(ns.min_prompt_tokens), *model]
        router = c.add_router("cache_aware", c.redis_url, extra)
        c.start_all([*c.replicas, router])
        for replica in c.replicas:
            warm(replica.url)
        chats, longs, res.seconds = asyncio.run(_workload(router.url, ns))
        _summarize(res, chats, longs, ns)
        _router_numbers(res, router.url)
    return res


def _f(x: float, scale: float = 1.0, unit: str = "") -> str:
    return "-" if x != x else f"{x * scale:.1f}{unit}"  # nan: not measured


def _f3(x: float) -> str:
    return "-" if x != x else f"{x:.3f}"


def print_report(results: list[SplitResult]) -> None:
    print(
        f"{'split':<14} {'ITL p50':>8} {'ITL p99':>8} {'p99/p50':>7} {'long TTFT p90':>13} {'tok/s':>7} "
        f"{'handoffs':>8} {'overhead p50':>12} {'MB/handoff':>10} {'GB/s':>6} {'errors':>6}"
    )
    for r in results:
        print(
            f"{r.split:<14} {_f(r.itl_p50, 1e3, 'ms'):>8} {_f(r.itl_p99, 1e3, 'ms'):>8} {_f(r.itl_ratio):>7} "
            f"{_f(r.long_ttft_p90, 1, 's'):>13} {r.output_tok_s:>7.1f} {r.handoffs:>8} "
            f"{_f(r.handoff_overhead_p50_s, 1e3, 'ms'):>12} {_f(r.bytes_per_handoff, 1e-6):>10} "
            f"{_f3(r.shared_tier_gb_s):>6} {r.errors:>6}"
        )
        if r.handoff_publish_s == r.handoff_publish_s:
            rest = r.handoff_overhead_s - r.handoff_publish_s
            print(
                f"  {r.split}: the overhead's mean {_f(r.handoff_overhead_s, 1e3, ' ms')}: "
                f"{_f(r.handoff_publish_s, 1e3, ' ms')} waiting for the blocks in Redis, "
                f"{_f(rest, 1e3, ' ms')} at the decode replica (queue, loading, the tail, its step)"
            )
        for note in r.notes:
            print(f"  {r.split}: {note}")
    by = {r.split: r for r in results}
    if {"colocated", "disaggregated"} <= by.keys():
        co, dis = by["colocated"], by["disaggregated"]
        print("targets (issue 29):")
        print(f"  ITL p99/p50 disaggregated {_f(dis.itl_ratio)} (<= 2; colocated {_f(co.itl_ratio)})")
        ttft = dis.long_ttft_p90 / co.long_ttft_p90 if co.long_ttft_p90 > 0 else float("nan")
        print(f"  long TTFT p90 {_f(ttft)}x colocated's (<= 1.3)")
        rate = dis.output_tok_s / co.output_tok_s if co.output_tok_s else float("nan")
        print(f"  output tok/s {_f(rate)}x colocated's (>= 0.85)")


def main(ns: argparse.Namespace) -> int:
    splits = [s.strip() for s in ns.splits.split(",") if s.strip()]
    unknown = [s for s in splits if s not in SPLITS]
    if unknown or not splits:
        print(f"kvtier: error: --splits takes {', '.join(SPLITS)}, got {ns.splits!r}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-disagg-") as tmp:
        results = []
        for split in splits:
            print(f"== {split}: {' + '.join(SPLITS[split])} replicas, one thread each", file=sys.stderr)
            results.append(run_split(split, ns, Path(tmp)))
    print_report(results)
    if ns.json:
        Path(ns.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0
