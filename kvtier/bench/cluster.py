"""``kvtier bench cluster``: replicas behind ``kvtier router``, with and without the shared Redis tier.

Each scenario starts its own processes on loopback (:mod:`kvtier.bench.cluster_procs`): a
``redis-server`` (persistence off, ``maxmemory`` with ``allkeys-lru``), ``--replicas`` ``kvtier serve``
replicas (one torch thread each; a device pool and a host tier that together hold only part of the
users' conversations) and a ``kvtier router`` in front of them. The multi-round chat workload
(:mod:`kvtier.bench.cluster_workload`: U users x R rounds, a shared system prompt plus each user's own
document and history) runs through the router, streaming, with ``--concurrency`` requests in flight.
Scenarios, side by side in one run (``--scenarios`` picks):

* (a) round-robin, no remote tier;
* (b) round-robin + the shared Redis tier;
* (c) cache-aware + the shared Redis tier; then the router's overhead: the same short requests
  through the router and straight to a replica, alternating, p50 of each;
* (d) as (c), and a replica added mid-run (cold: started when every user has had a first round, then
  ``POST /admin/replicas``); its returning users' TTFT is compared with recomputing the same prompts on
  it (a ``cache_salt`` no block has, so nothing is cached);
* (e) as (c), and Redis killed (SIGKILL) mid-run, started again (empty) ``--outage-s`` later;
* (f) as (c), and a replica killed (SIGKILL) mid-run, started again ``--outage-s`` later.

For (e) and (f), requests started ``--recovery-wait-s`` after the process is back are compared with (c)'s
on the same (user, round) pairs, and failures are counted against the requests in flight at the kill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench.cluster_procs import ADMIN_KEY, Cluster, ReplicaSettings, StartError
from kvtier.bench.cluster_report import (
    ScenarioResult,
    evaluate_targets,
    print_table,
    print_targets,
    write_chart,
)
from kvtier.bench.cluster_workload import (
    Record,
    WorkloadSpec,
    build_conversations,
    probe_latency,
    run_workload,
)
from kvtier.bench.quantiles import percentile

SCENARIOS = {
    "a": ("round-robin, no remote tier", "round_robin", False),
    "b": ("round-robin + Redis", "round_robin", True),
    "c": ("cache-aware + Redis", "cache_aware", True),
    "d": ("(c) + replica added mid-run", "cache_aware", True),
    "e": ("(c) + Redis killed mid-run", "cache_aware", True),
    "f": ("(c) + replica killed mid-run", "cache_aware", True),
}


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--scenarios", default="abcdef", help="which of a-f to run (default abcdef)")
    g.add_argument("--replicas", type=int, default=2, help="replicas at the start (default 2)")
    g.add_argument("--users", type=int, default=8, help="users, one conversation each (default 8)")
    g.add_argument("--rounds", type=int, default=6, help="rounds per user (default 6)")
    g.add_argument("--concurrency", type=int, default=4, help="requests in flight at most (default 4)")
    g.add_argument("--system-tokens", type=int, default=300, help="shared system prompt (~tokens)")
    g.add_argument("--doc-tokens", type=int, default=700, help="each user's document (~tokens)")
    g.add_argument("--question-tokens", type=int, default=30, help="each question (~tokens)")
    g.add_argument("--answer-tokens", type=int, default=16, help="generated tokens per answer")
    g.add_argument("--stagger-s", type=float, default=1.0, help="users start this far apart (s)")
    g.add_argument(
        "--local-fraction",
        type=float,
        default=0.25,
        help="each replica's device pool (and, as much again, its host tier) / all users' final KV",
    )
    g.add_argument("--threads", type=int, default=1, help="torch threads per replica (default 1)")
    g.add_argument("--outage-s", type=float, default=4.0, help="(e), (f): seconds a killed process is down")
    g.add_argument("--kill-at", type=float, default=0.2, help="(e), (f): kill after this share of requests")
    g.add_argument(
        "--recovery-wait-s", type=float, default=10.0, help="(e), (f): compare TTFT from this long after"
    )
    g.add_argument("--overhead-requests", type=int, default=30, help="(c): router-overhead probes per path")
    g.add_argument("--seed", type=int, default=0, help="seed of the generated texts")
    g.add_argument("--quick", action="store_true", help="2 users x 2 rounds, small texts (smoke run)")
    g.add_argument("--keep-logs", default=None, help="write the processes' logs under this directory")
    g.add_argument("--chart", default="bench-cluster.png", help="PNG chart path ('' for none)")
    g.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=main)


# ------------------------------------------------------------------------------ sizes
@dataclass(frozen=True)
class Plan:
    spec: WorkloadSpec
    settings: ReplicaSettings
    final_tokens: int  # a user's last prompt + answer (estimated)
    live_blocks: int  # all users' final KV, the system prompt counted once


def make_plan(ns: argparse.Namespace) -> Plan:
    spec = WorkloadSpec(
        ns.users,
        ns.rounds,
        ns.system_tokens,
        ns.doc_tokens,
        ns.question_tokens,
        ns.answer_tokens,
        ns.concurrency,
        ns.stagger_s,
        seed=ns.seed,
    )
    bs = 16
    per_round = ns.question_tokens + ns.answer_tokens + 16  # + the template's tokens
    final = ns.system_tokens + ns.doc_tokens + 40 + ns.rounds * per_round
    final_blocks = math.ceil(final / bs)
    live = ns.users * final_blocks - (ns.system_tokens // bs) * (ns.users - 1)
    per_replica_in_flight = math.ceil(ns.concurrency / max(1, ns.replicas))
    device = max(math.ceil(live * ns.local_fraction), per_replica_in_flight * final_blocks + 8)
    block_bytes = 30 * bs * 2 * 3 * 64 * 4  # SmolLM2-135M, fp32 (the embedded model)
    settings = ReplicaSettings(
        device_blocks=device,
        host_gb=device * block_bytes / 2**30,
        max_model_len=int(final * 1.5) + ns.answer_tokens,
        threads=ns.threads,
    )
    return Plan(spec, settings, final, live)


# ------------------------------------------------------------------------------ helpers
def scrape(url: str) -> dict[str, float]:
    """A ``/metrics`` page as ``{"name{labels}": value}`` (comment lines skipped)."""
    out: dict[str, float] = {}
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def warm(url: str) -> None:
    """One tiny request, so the first measured one does not pay for first-call costs."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0.0}
    httpx.post(url + "/v1/chat/completions", json=body, timeout=120).raise_for_status()


def _short_chat(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Say one word about the number {i % 3}."}]


async def router_overhead(router: str, replica: str, n: int) -> dict[str, float]:
    """p50 seconds of the same short requests through the router and straight to a replica,
    alternating (after one warm-up request each), and the difference in ms."""
    via, direct = [], []
    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(n + 1):
            for base, out in ((router, via), (replica, direct)):
                client.base_url = httpx.URL(base)
                t = await probe_latency(client, _short_chat(i))
                if i:
                    out.append(t)
    p_via, p_direct = percentile(via, 0.5), percentile(direct, 0.5)
    overhead = (p_via - p_direct) * 1e3
    return {"router_p50_ms": p_via * 1e3, "direct_p50_ms": p_direct * 1e3, "overhead_ms": overhead}


# ------------------------------------------------------------------------------ mid-run events
class Events:
    """What happens mid-run in (d), (e), (f): triggered from the workload's progress hook; the slow
    part (starting a process) runs in a thread so the users keep going."""

    def __init__(self, key: str, cluster: Cluster, plan: Plan, ns: argparse.Namespace, res: ScenarioResult):
        self.key, self.cluster, self.plan, self.ns, self.res = key, cluster, plan, ns, res
        self.task: asyncio.Task[None] | None = None
        self.settings = cluster.replica_settings  # a new replica is started as the others were
        self.t0 = time.perf_counter()  # reset when the workload starts
        self.total = plan.spec.users * plan.spec.rounds

    async def hook(self, records: list[Record], now: float) -> None:
        if self.task is not None or self.key not in "def":
            return
        done = [r for r in records if r.end]
        if self.key == "d":
            firsts = sum(1 for r in done if r.round == 0)
            if firsts < self.plan.spec.users:
                return
            self.task = asyncio.create_task(self._add_replica(now))
        elif len(done) >= self.ns.kill_at * self.total:
            in_flight = [r for r in records if not r.end]
            self.task = asyncio.create_task(self._outage(now, in_flight))

    async def wait(self) -> None:
        if self.task is not None:
            await self.task

    async def _add_replica(self, t: float) -> None:
        c, res = self.cluster, self.res
        assert self.settings is not None
        new = c.add_replica(self.settings)
        res.events["start"] = t
        await asyncio.to_thread(c.restart, new)
        await asyncio.to_thread(warm, new.url)
        assert c.router is not None
        async with httpx.AsyncClient(timeout=30) as client:
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            r = await client.post(c.router.url + "/admin/replicas", json={"url": new.url}, headers=admin)
        res.events["added"] = time.perf_counter() - self.t0
        res.extra["admin_status"] = r.status_code
        res.extra["new_replica"] = new.url
        if r.status_code >= 300:
            res.notes.append(f"POST /admin/replicas answered {r.status_code}: {r.text[:200]}")

    async def _outage(self, t: float, in_flight: list[Record]) -> None:
        c, res = self.cluster, self.res
        victim = c.redis if self.key == "e" else c.replicas[-1]
        assert victim is not None
        victim.kill()
        res.events["kill"] = t
        res.extra["in_flight_at_kill"] = [(r.user, r.round) for r in in_flight]
        res.extra["killed"] = victim.name
        res.extra["killed_url"] = victim.url
        await asyncio.sleep(self.ns.outage_s)
        await asyncio.to_thread(c.restart, victim)
        if victim is not c.redis:
            await asyncio.to_thread(warm, victim.url)
        res.events["back"] = time.perf_counter() - self.t0


# ------------------------------------------------------------------------------ one scenario
async def _run(key: str, c: Cluster, plan: Plan, ns: argparse.Namespace, res: ScenarioResult) -> None:
    _, policy, remote = SCENARIOS[key]
    if remote:
        c.start_redis()
    c.replica_settings = ReplicaSettings(**{**asdict(plan.settings), "remote_url": c.redis_url})
    reps = [c.add_replica(c.replica_settings) for _ in range(ns.replicas)]
    await asyncio.to_thread(c.start_all, reps)
    for r in reps:
        await asyncio.to_thread(warm, r.url)
    router = c.add_router(policy, c.redis_url)
    await asyncio.to_thread(c.restart, router, 60.0)
    events = Events(key, c, plan, ns, res)
    convs = build_conversations(plan.spec)
    events.t0 = time.perf_counter()
    res.records, res.wall_s = await run_workload(router.url, plan.spec, convs, events.hook)
    await events.wait()
    for rep in c.replicas:
        if rep.running:
            res.replica_metrics[rep.name] = scrape(rep.url)
    router_samples = scrape(router.url)
    res.router_metrics = {k: v for k, v in router_samples.items() if k.startswith("kvtier_router")}
    try:
        res.router_state = httpx.get(router.url + "/router/state", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        res.router_state = None
    if key == "c" and ns.overhead_requests:
        res.extra["overhead"] = await router_overhead(router.url, reps[0].url, ns.overhead_requests)
        res.extra["router_overhead_ms"] = res.extra["overhead"]["overhead_ms"]
    if key == "d" and "new_replica" in res.extra:
        await _recompute_probe(res, convs, ns)
    if key in "ef":
        _allowed_failures(res)


def _allowed_failures(res: ScenarioResult) -> None:
    """The failures the targets allow: in (f), requests in flight on the killed replica at the kill (by
    the router's header; any in flight when it sent none, an upper bound); in (e) none (Redis is not a
    replica: a replica must serve through its outage)."""
    in_flight = {tuple(x) for x in res.extra.get("in_flight_at_kill", [])}
    killed = res.extra.get("killed_url", "")
    allowed = 0
    for r in res.failed:
        on_victim = res.key == "f" and (r.replica is None or killed in r.replica)
        if (r.user, r.round) in in_flight and on_victim:
            allowed += 1
    res.extra["allowed_failures"] = allowed


async def _recompute_probe(res: ScenarioResult, convs: list[Any], ns: argparse.Namespace) -> None:
    """(d): the new replica's in-run returning-user TTFT (its requests found by the router's
    ``x-kvtier-replica`` header) vs recomputing the same users' prompts on it."""
    new = res.extra["new_replica"]
    mine = [r.ttft for r in res.ok() if r.ttft is not None and r.replica and new in r.replica]
    if not mine:
        res.extra["recompute_ratio"] = None
        res.notes.append("the new replica served no workload request (the run ended first, or no header)")
        return
    in_run = statistics.fmean(mine)
    recompute = []
    async with httpx.AsyncClient(base_url=new, timeout=300) as client:
        for i, conv in enumerate(convs[: min(4, len(convs))]):
            msgs = conv.messages(len(conv.answers) - 1)
            body = {"messages": msgs, "max_tokens": 1, "temperature": 0.0, "cache_salt": f"recompute-{i}"}
            t = time.perf_counter()
            (await client.post("/v1/chat/completions", json=body)).raise_for_status()
            recompute.append(time.perf_counter() - t)
    rec_mean = statistics.fmean(recompute)
    res.extra.update(
        new_replica_requests=len(mine),
        new_replica_ttft_ms=in_run * 1e3,
        recompute_ttft_ms=rec_mean * 1e3,
        recompute_ratio=rec_mean / in_run,
    )
    res.notes.append(
        f"new replica served {len(mine)} requests; their mean TTFT {in_run * 1e3:.0f} ms (client side) vs "
        f"{rec_mean * 1e3:.0f} ms recomputing the same users' prompts on it (cache_salt, one at a time, idle)"
    )


def run_scenario(key: str, plan: Plan, ns: argparse.Namespace, log_root: Path) -> ScenarioResult:
    title = SCENARIOS[key][0]
    res = ScenarioResult(key, title)
    print(f"  running ({key}) {title} ...", file=sys.stderr, flush=True)
    log_dir = log_root / key
    log_dir.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    with Cluster(log_dir) as c:
        try:
            asyncio.run(_run(key, c, plan, ns, res))
        except (StartError, httpx.HTTPError, OSError) as exc:
            res.error = " ".join(str(exc).split())[:300]
    _describe_events(res)
    print(
        f"    ({key}) {time.perf_counter() - t:.0f} s, mean returning TTFT {res.mean_ttft() * 1e3:.0f} ms, "
        f"{len(res.failed)} failed" + (f"; ERROR {res.error}" if res.error else ""),
        file=sys.stderr,
        flush=True,
    )
    return res


def _describe_routing(res: ScenarioResult) -> None:
    """Where the requests went (the router's ``x-kvtier-replica`` header) and why (its metrics)."""
    served: dict[str, int] = {}
    for r in res.records:
        name = (r.replica or "?").rsplit(":", 1)[-1]
        served[name] = served.get(name, 0) + 1
    reasons: dict[str, float] = {}
    for key, value in res.router_metrics.items():
        if key.startswith("kvtier_router:requests_routed_total{") and 'reason="' in key:
            reason = key.split('reason="', 1)[1].split('"', 1)[0]
            reasons[reason] = reasons.get(reason, 0) + value
    n = res.router_metrics.get("kvtier_router:routing_latency_seconds_count", 0.0)
    mean_ms = res.router_metrics.get("kvtier_router:routing_latency_seconds_sum", 0.0) / n * 1e3 if n else 0
    ports = ", ".join(f":{k} {v}" for k, v in sorted(served.items()))
    why = ", ".join(f"{k} {v:.0f}" for k, v in sorted(reasons.items()))
    res.notes.append(
        f"requests per replica port: {ports}; router reasons: {why or '-'}; "
        f"routing decision {mean_ms:.2f} ms mean"
    )


def _describe_events(res: ScenarioResult) -> None:
    _describe_routing(res)
    ev = res.events
    if "kill" in ev:
        back = f"back at {ev['back']:.1f} s" if "back" in ev else "never back"
        n = len(res.extra.get("in_flight_at_kill", []))
        res.notes.append(
            f"{res.extra.get('killed')} killed at {ev['kill']:.1f} s ({n} requests in flight), {back}; "
            f"{len(res.failed)} requests failed"
        )
    if "added" in ev:
        res.notes.append(f"replica start at {ev['start']:.1f} s, added to the router at {ev['added']:.1f} s")


# ------------------------------------------------------------------------------ main
def main(ns: argparse.Namespace) -> int:
    if ns.quick:
        ns.users, ns.rounds = min(ns.users, 2), min(ns.rounds, 2)
        ns.system_tokens, ns.doc_tokens = min(ns.system_tokens, 48), min(ns.doc_tokens, 96)
        ns.question_tokens, ns.answer_tokens = min(ns.question_tokens, 16), min(ns.answer_tokens, 4)
        ns.overhead_requests, ns.stagger_s = min(ns.overhead_requests, 5), min(ns.stagger_s, 0.2)
    keys = [k for k in ns.scenarios if k in SCENARIOS]
    if not keys or len(keys) != len(ns.scenarios):
        raise ValueError(f"--scenarios takes letters among {''.join(SCENARIOS)}, got {ns.scenarios!r}")
    if ns.users < 1 or ns.rounds < 2 or ns.replicas < 1 or ns.concurrency < 1 or ns.answer_tokens < 1:
        raise ValueError("--users, --replicas, --concurrency, --answer-tokens >= 1 and --rounds >= 2")
    if "f" in keys and ns.replicas < 2:
        raise ValueError("scenario f kills a replica: it needs --replicas >= 2")
    plan = make_plan(ns)
    st = plan.settings
    print(
        f"kvtier bench cluster — {ns.users} users x {ns.rounds} rounds, {ns.concurrency} requests in flight, "
        f"{ns.replicas} replicas ({ns.threads} torch thread each, fp32) behind kvtier router, on loopback\n"
        f"prompts: shared system ~{ns.system_tokens} tokens + a document ~{ns.doc_tokens} per user + "
        f"{ns.rounds} rounds of ~{ns.question_tokens}-token questions and {ns.answer_tokens}-token answers "
        f"(a user's last prompt ~{plan.final_tokens} tokens)\n"
        f"each replica: device pool {st.device_blocks} blocks + host tier {st.host_gb:.3f} GiB (as many "
        f"blocks): {st.device_blocks / plan.live_blocks:.0%} each of the {plan.live_blocks} blocks all "
        f"users hold at the end (--local-fraction {ns.local_fraction:g}, at least the prompts in flight)",
        flush=True,
    )
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-cluster-") as tmp:
        log_root = Path(ns.keep_logs or tmp)
        results = [run_scenario(k, plan, ns, log_root) for k in keys]
    by_key = {s.key: s for s in results}
    print_table(results)
    targets = evaluate_targets(by_key, ns.recovery_wait_s)
    print_targets(targets)
    if ns.chart:
        print(f"\nchart: {write_chart(results, ns.chart)}")
    if ns.json:
        with open(ns.json, "w") as f:
            out = {"args": vars(ns) | {"func": None}, "results": [asdict(s) for s in results]}
            json.dump(out | {"targets": targets}, f, indent=1, default=str)
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s (a shared, loaded 2-core machine: numbers are noisy)")
    return 0 if all(not s.error for s in results) else 1
