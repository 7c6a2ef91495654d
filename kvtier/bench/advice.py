"""``kvtier bench advice``: are the miss-ratio curves right, and what does the canary cost?

1. **Curves vs replay.** The ``bench multiturn`` workload (conversations served round-robin, one request
   at a time) runs once on a real engine with a device pool and a host tier; its trackers (the host
   tier's: miniature simulations of its admission rules) give
   the predicted hit ratios (``LLMEngine.kv_advice``, what ``GET /v1/kv/advice`` serves). The recorded
   trace (every prompt and answer, in order) is then replayed against the real tier bookkeeping
   (``KVCacheManager`` over a ``TierCoordinator`` with a ``HostTier``) of ¼, ½, 1 and 2× the host size,
   and of 1, 2 and 4× the device pool with no host tier; the table compares predicted and replayed
   prompt-block hit ratios (target: within 5 points). The replay's own tracker, fed the same trace,
   must give the same curve as the engine's (deterministic for a recorded trace).
2. **Canary cost** (``--canary-cost``): (a) the work proxy, deterministic: the recorded trace replayed
   20 times on the real bookkeeping with the canary's own sampling and picks at rate 0.01 (and 1.0),
   tokens it would recompute over tokens the engine computes; (b) time: the workload's requests cycled
   on two engines with ``canary_rate`` 0 and 0.01, interleaved request by request (which goes first
   alternating), each running its pending checks after each request (in a server they run when it is
   idle), plus the time the 0.01 engine spent inside the canary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from kvtier.args import add_engine_args

FACTORS = (0.25, 0.5, 1.0, 2.0)  # host tier sizes replayed
DEVICE_FACTORS = (1.0, 2.0, 4.0)  # device pool sizes replayed without a host tier


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=12, help="conversations (default 12)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    p.add_argument("--system-tokens", type=int, default=120, help="shared system prompt (~tokens)")
    p.add_argument("--doc-tokens", type=int, default=300, help="per-conversation document (~tokens)")
    p.add_argument("--user-tokens", type=int, default=40, help="user message per turn (~tokens)")
    p.add_argument("--answer-tokens", type=int, default=16, help="generated tokens per turn")
    p.add_argument("--device-fraction", type=float, default=0.25, help="device pool / live conversations")
    p.add_argument("--host-fraction", type=float, default=0.5, help="host tier / live conversations")
    p.add_argument("--canary-cost", action="store_true", help="also measure the canary's cost")
    p.add_argument(
        "--canary-requests", type=int, default=400, help="requests per engine in the canary cost run"
    )
    p.add_argument(
        "--canary-budget", type=float, default=0.0, help="seconds: start no new round after (0: none)"
    )
    p.add_argument("--quick", action="store_true", help="4 conversations x 3 turns, small texts (smoke run)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated texts")
    p.add_argument("--trace-out", default=None, help="also write the recorded trace to this JSON file")
    add_engine_args(p, ["num_threads"])
    p.set_defaults(func=main)


@dataclass
class Trace:
    """What the recording run served, in order: (prompt, answer) token ids per request."""

    requests: list[tuple[list[int], list[int]]]
    extra_keys: tuple[str, str]
    block_size: int


# ------------------------------------------------------------------------------ recording
def record(loaded: Any, work: Any, engine_kwargs: dict[str, Any]) -> tuple[Trace, dict[str, Any], Any]:
    """Serve the workload on a real engine; returns the trace, its advice and its tracker snapshot."""
    from kvtier.config import EngineArgs
    from kvtier.engine import LLMEngine
    from kvtier.sampling_params import SamplingParams

    engine = LLMEngine(EngineArgs(dtype="float32", canary_rate=0.0, **engine_kwargs), loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=work.answer_tokens, ignore_eos=True)
    requests = []
    try:
        for turn in range(work.num_turns):
            for conv in range(work.num_convs):
                prompt = work.prompt(conv, turn)
                out = _run_one(engine, prompt, params)
                work.answers[(conv, turn)] = list(out.outputs[0].token_ids)
                requests.append((prompt, list(out.outputs[0].token_ids)))
        advice = engine.kv_advice()
        advice["measured"] = _measured(engine)
        snap = engine.insight.snapshots()
        return Trace(requests, (engine.cache_identity, ""), engine.kv.block_size), advice, snap
    finally:
        engine.close()


def _run_one(engine: Any, prompt: list[int], params: Any) -> Any:
    rid = engine.add_request({"prompt_token_ids": prompt}, params)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def _measured(engine: Any) -> float:
    """The engine's own prompt-block hit ratio (all tiers)."""
    stats = engine.stats()
    device = stats.tiers["device"]
    hits = sum(t.hit_blocks for t in stats.tiers.values())
    return hits / device.lookups if device.lookups else 0.0


# ------------------------------------------------------------------------------ replay
def replay(
    trace: Trace, device_blocks: int, host_blocks: int, keep: bool = False, canary: Any = None
) -> tuple[float, Any]:
    """The trace against the real bookkeeping of a device pool (and a host tier): its block hit ratio,
    and the snapshots of the trackers fed the replay's accesses (``keep``: their ``CacheInsight``).
    ``canary``: a ``CanaryProxy`` told each request's computed tokens and the canary's picks."""
    from kvtier.insight.hub import CacheInsight
    from kvtier.kv.manager import KVCacheManager
    from kvtier.stats import Medium
    from kvtier.tiers.coordinator import TierCoordinator
    from kvtier.tiers.host import HostTier

    bs = trace.block_size
    tiers = TierCoordinator(HostTier(host_blocks)) if host_blocks > 0 else None
    kv = KVCacheManager(device_blocks, bs, True, tiers=tiers)
    rate = canary.rate if canary is not None else 0.0
    insight = CacheInsight(rate, bs, "float32", seed=1, lower=[Medium.HOST] if tiers else [])
    kv.observer = insight
    if tiers is not None:
        insight.attach(tiers)
    for i, (prompt, answer) in enumerate(trace.requests):
        seq = f"r{i}"
        computed = kv.get_computed_blocks(prompt, trace.extra_keys)
        n = computed.num_computed_tokens
        if not kv.allocate_slots(seq, prompt, n, len(prompt) - n, computed, trace.extra_keys):
            raise RuntimeError(f"replay: request {i} does not fit in {device_blocks} blocks")
        _complete(kv, tiers)
        kv.cache_blocks(seq, prompt, len(prompt))
        tokens = prompt + answer
        for t in range(len(prompt), len(tokens) - 1):  # decode: one slot per step, the last never computed
            kv.allocate_slots(seq, tokens, t, 1)
            _complete(kv, tiers)
            kv.cache_blocks(seq, tokens, t + 1)
        kv.free(seq)
        if canary is not None:
            canary.add(len(prompt) - n + len(answer), insight.canary)
    device = kv.device_counters
    hits = device.hit_blocks + (sum(t.counters.hit_blocks for t in tiers.tiers) if tiers else 0)
    ratio = hits / device.lookups if device.lookups else 0.0
    return ratio, insight if keep else insight.snapshots()


@dataclass
class CanaryProxy:
    """The canary's work at ``rate`` over a replay, in tokens: what it would recompute (its own
    sampling and picks, no model) against what the engine computes (prompt not from cache, decode)."""

    rate: float
    requests: int = 0
    checks: int = 0
    recomputed: int = 0
    computed: int = 0

    def add(self, computed: int, canary: Any) -> None:
        self.requests += 1
        self.computed += computed
        picked = canary.take_picked()
        self.checks += len(picked)
        self.recomputed += sum(len(c.token_ids) for c in picked)


def _complete(kv: Any, tiers: Any) -> None:
    plan = kv.end_schedule_step()
    if tiers is not None:
        tiers.complete_plan(plan)  # the copies themselves: bookkeeping only, nothing reads the bytes


# ------------------------------------------------------------------------------ canary cost
CANARY_RATES = (0.0, 0.01)  # off, and the default


@dataclass
class CanaryRun:
    rate: float
    seconds: list[float]  # per round (one pass over the workload)
    checks: int = 0  # requests checked
    blocks: int = 0  # blocks compared
    recomputed: int = 0  # tokens the checks ran through the model
    computed: int = 0  # tokens the engine computed for the requests (prompt not from cache + decode)
    canary_seconds: float = 0.0  # measured inside the engine: captures and checks
    requests: int = 0


def canary_cost(
    loaded: Any,
    work: Any,
    engine_kwargs: dict[str, Any],
    num_requests: int,
    rates: tuple[float, float] = CANARY_RATES,
    budget_s: float = 0.0,
) -> list[CanaryRun]:
    """The workload's requests, cycled to ``num_requests``, on two engines (``rates``: 0 and 0.01)
    interleaved request by request, which engine goes first alternating (the machine's load hits them
    alike). Each engine runs its pending checks after each request, and that time counts. No new round
    starts after ``budget_s`` seconds (0: no limit)."""
    from kvtier.config import EngineArgs
    from kvtier.engine import LLMEngine
    from kvtier.sampling_params import SamplingParams

    engines = [
        LLMEngine(EngineArgs(dtype="float32", canary_rate=r, seed=1, **engine_kwargs), loaded=loaded)
        for r in rates
    ]
    runs = [CanaryRun(r, []) for r in rates]
    params = SamplingParams(temperature=0.0, max_tokens=work.answer_tokens, ignore_eos=True)
    order = [(c, t) for t in range(work.num_turns) for c in range(work.num_convs)]
    t_start = time.perf_counter()
    try:
        for i in range(num_requests):
            if i % len(order) == 0:
                if budget_s and time.perf_counter() - t_start > budget_s:
                    break  # whole rounds only, both engines alike
                if i:
                    print(
                        f"  round {i // len(order)}: "
                        + ", ".join(f"{r.rate:g}: {r.seconds[-1]:.1f} s" for r in runs),
                        file=sys.stderr,
                        flush=True,
                    )
                for run in runs:
                    run.seconds.append(0.0)
            prompt = work.prompt(*order[i % len(order)])
            for j in (0, 1) if i % 2 == 0 else (1, 0):
                t0 = time.perf_counter()
                out = _run_one(engines[j], prompt, params)
                while engines[j].run_idle_work():
                    pass
                runs[j].seconds[-1] += time.perf_counter() - t0
                runs[j].computed += len(prompt) - out.num_cached_tokens + work.answer_tokens
                runs[j].requests += 1
        for run, engine in zip(runs, engines, strict=True):
            stats = engine.insight.canary.stats
            run.blocks, run.recomputed = stats.match + stats.mismatch, stats.recomputed_tokens
            run.checks, run.canary_seconds = stats.checks_run, stats.seconds
        return runs
    finally:
        for engine in engines:
            engine.close()


# ------------------------------------------------------------------------------ main
def _workload(ns: argparse.Namespace, tokenizer: Any) -> Any:
    from kvtier.bench.multiturn import build_workload

    if ns.quick:
        ns.conversations, ns.turns = min(ns.conversations, 4), min(ns.turns, 3)
        ns.system_tokens, ns.doc_tokens = min(ns.system_tokens, 48), min(ns.doc_tokens, 120)
        ns.user_tokens, ns.answer_tokens = min(ns.user_tokens, 24), min(ns.answer_tokens, 8)
    return build_workload(tokenizer, ns)


def _sizes(work: Any, ns: argparse.Namespace, block_bytes: int) -> tuple[int, int, int]:
    """(device blocks, host blocks, max_model_len) sized like bench multiturn's small-pool rows."""
    bs, last = 16, work.num_turns - 1
    final = [-(-(work.prompt_len(c, last) + work.answer_tokens) // bs) for c in range(work.num_convs)]
    live = sum(final) - (work.system_tokens // bs) * (work.num_convs - 1)
    device = max(round(live * ns.device_fraction), max(final) + 8)
    host = max(1, round(live * ns.host_fraction))
    max_len = max(work.prompt_len(c, last) for c in range(work.num_convs)) + work.answer_tokens + 1
    return device, host, max_len


def main(ns: argparse.Namespace) -> int:
    from kvtier.models.loader import load_model

    t_all = time.perf_counter()
    loaded = load_model(None)
    mc = loaded.config
    block_bytes = mc.num_layers * 16 * 2 * mc.num_kv_heads * mc.head_dim * 4
    work = _workload(ns, loaded.tokenizer)
    device, host, max_len = _sizes(work, ns, block_bytes)
    base = {"kv_device_blocks": device, "max_model_len": max_len, "num_threads": ns.num_threads}
    print(
        f"kvtier bench advice — bench multiturn's workload: {work.num_convs} conversations x "
        f"{work.num_turns} "
        f"turns, round-robin; device pool {device} blocks, host tier {host} blocks "
        f"({host * block_bytes / 2**30:.3f} GiB)",
        flush=True,
    )
    print("  recording on a real engine ...", file=sys.stderr, flush=True)
    trace, advice, snap = record(loaded, work, {**base, "kv_host_gb": host * block_bytes / 2**30})
    if ns.trace_out:
        with open(ns.trace_out, "w") as f:
            json.dump(
                {"requests": trace.requests, "block_size": trace.block_size, "device": device, "host": host},
                f,
            )
    print_curve_tables(trace, advice, snap, device, host)
    if ns.canary_cost:
        print_canary_proxy(trace, device, host)
        print("  canary cost: two engines, interleaved ...", file=sys.stderr, flush=True)
        host_gb = {"kv_host_gb": host * block_bytes / 2**30}
        print_canary_cost(
            canary_cost(loaded, work, {**base, **host_gb}, ns.canary_requests, budget_s=ns.canary_budget)
        )
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s (a shared, loaded machine: times are noisy)")
    return 0


def print_curve_tables(trace: Trace, advice: dict[str, Any], snap: Any, device: int, host: int) -> None:
    curve = {p["size_factor"]: p["hit_ratio"] for p in advice["tiers"]["host"]["curve"]}
    # device-only pools: the device tracker's own curve (no lower tier to serve its misses)
    device_curve = {f: snap["device"].hit_ratio(f * device) for f in DEVICE_FACTORS}
    n = sum(len(p) for p, _ in trace.requests)
    print(
        f"\n{len(trace.requests)} requests, {n} prompt tokens; "
        f"sampled accesses {advice['sampled_accesses']}, "
        f"sampling rate {advice['sampling_rate']:.3f}; the engine measured {advice['measured']:.1%} at 1x"
    )
    worst = 0.0
    rows = []
    for f in FACTORS:
        replayed, rsnap = replay(trace, device, round(f * host))
        rows.append(("host", f, round(f * host), curve[f], replayed))
        if f == 1.0:
            same = rsnap == snap
    for f in DEVICE_FACTORS:  # smaller pools than today's cannot hold the longest request
        replayed, _ = replay(trace, round(f * device), 0)
        rows.append(("device (no host)", f, round(f * device), device_curve[f], replayed))
    print(
        f"\n{'tier scaled':<17} {'factor':>6} {'blocks':>7} {'predicted':>10} {'replayed':>9} {'|diff|':>7}"
    )
    for tier, f, blocks, predicted, replayed in rows:
        worst = max(worst, abs(predicted - replayed))
        print(
            f"{tier:<17} {f:>6g} {blocks:>7} {predicted:>10.1%} {replayed:>9.1%} "
            f"{abs(predicted - replayed) * 100:>5.1f}pp"
        )
    print(
        f"\nworst |predicted - replayed|: {worst * 100:.1f} points (target <= 5): "
        f"{'met' if worst <= 0.05 else 'NOT met'}"
    )
    print(f"replay's tracker == engine's tracker on the recorded trace: {'yes' if same else 'NO'}")
    print("advice:", *([f"  - {s}" for s in advice["advice"]] or ["  (none)"]), sep="\n")


def print_canary_cost(runs: list[CanaryRun]) -> None:
    off, on = runs
    per_round = sorted(b / a - 1 for a, b in zip(off.seconds, on.seconds, strict=True) if a > 0)
    print(
        f"\ncanary cost: {on.requests} requests per engine, interleaved (who goes first alternating), "
        f"{len(per_round)} rounds"
    )
    print(
        f"{'canary_rate':>11} {'seconds':>8} {'checks':>7} {'blocks':>7} {'recomputed':>11} "
        f"{'computed':>9} {'recomputed/computed':>20}"
    )
    for run in runs:
        share = run.recomputed / run.computed if run.computed else 0.0
        print(
            f"{run.rate:>11g} {sum(run.seconds):>8.1f} {run.checks:>7} {run.blocks:>7} "
            f"{run.recomputed:>11} {run.computed:>9} {share:>19.2%}"
        )
    total = sum(on.seconds) / sum(off.seconds) - 1 if sum(off.seconds) > 0 else 0.0
    median = per_round[len(per_round) // 2] if per_round else 0.0
    spread = f"{per_round[0]:+.1%} .. {per_round[-1]:+.1%}" if per_round else "-"
    inside = on.canary_seconds / sum(on.seconds) if sum(on.seconds) > 0 else 0.0
    print(f"time inside the canary at 0.01: {on.canary_seconds:.2f} s = {inside:.2%} of that engine's time")
    print(
        f"time at 0.01 vs off: {total:+.2%} in all (per round: median {median:+.1%}, {spread}); "
        f"work proxy (recomputed / computed tokens): {on.recomputed / max(on.computed, 1):.2%}; "
        f"target <= 2%"
    )


def print_canary_proxy(trace: Trace, device: int, host: int, rounds: int = 20) -> None:
    """The canary's work at the default rate (and at 1.0) over the recorded trace replayed ``rounds``
    times on the real bookkeeping: deterministic, no model, no clock."""
    long = Trace(trace.requests * rounds, trace.extra_keys, trace.block_size)
    print(f"\ncanary work proxy: the recorded trace replayed {rounds}x ({len(long.requests)} requests)")
    print(
        f"{'canary_rate':>11} {'checks':>7} {'recomputed':>11} {'computed':>10} {'recomputed/computed':>20}"
    )
    for rate in (0.01, 1.0):
        proxy = CanaryProxy(rate)
        replay(long, device, host, canary=proxy)
        share = proxy.recomputed / proxy.computed if proxy.computed else 0.0
        print(f"{rate:>11g} {proxy.checks:>7} {proxy.recomputed:>11} {proxy.computed:>10} {share:>19.2%}")
