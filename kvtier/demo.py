"""``kvtier demo offload``: the tiered KV cache at work on the real model, and a restart that hits disk.

Four phases on a tiny device pool (the host and disk tiers below it)::

    1. cold cache          three requests share a system prompt: a miss, then device hits
    2. same prefix again   two more requests with that system prompt: device hits
    3. device pressure     request A, then B, C, D evict A's prefix from the device pool (write-back
                           stores keep it in the host tier); A again is a host hit
    4. restart             close the engine (device and host blocks are flushed to disk), start a new
                           one on the same disk directory: A and request 1 are disk hits

Each request prints its source (the slowest tier that served part of its prompt, or ``miss``), its
cached tokens by tier and its time to first token; each phase ends with the tiers' statistics.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from kvtier.args import add_engine_args, engine_args_from, engine_kwargs

SYSTEM = (
    "You are a helpful assistant for a team of engineers. Answer briefly, precisely and politely. "
    "If a question is ambiguous, state your assumption first. Prefer plain words to jargon."
)
PHASE1 = ("What is the capital of France?", "Explain gravity in one sentence.", "What is 2+2?")
PHASE2 = ("Name three colors.", "What is Python?")
SYSTEM_A = "You summarize technical reports for busy managers."
DOC_A = "Summarize this report. " + "The tiered cache keeps evicted blocks in host memory and on disk. " * 18
PRESSURE = tuple(  # (system, user): each has its own system prompt, so nothing is shared with A
    (
        f"You are storyteller {name}, who writes short fables.",
        f"Continue story {name}. "
        + f"Once upon a time, robot {name} learned to paint the sea at night. " * 16,
    )
    for name in ("B", "C", "D")
)
SOURCES = ("miss", "device", "host", "disk")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (default 8)")
    add_engine_args(
        p,
        ["model", "kv_device_blocks", "kv_host_gb", "kv_disk_dir", "num_threads"],
        defaults={"kv_device_blocks": 32, "kv_host_gb": 0.25},
        notes={"kv_disk_dir": "default: a fresh temporary directory, removed afterwards"},
    )
    p.set_defaults(func=main)


@dataclass
class Served:
    label: str
    source: str
    expected: str
    cached: int
    prompt: int
    by_tier: dict[str, int]
    ttft_ms: float


def source_of(num_cached: int, by_tier: dict[str, int]) -> str:
    """``miss`` when nothing was cached, else the slowest tier that served part of the prompt."""
    if num_cached <= 0:
        return "miss"
    for tier in ("disk", "host", "device"):
        if by_tier.get(tier, 0) > 0:
            return tier
    return "device"


def _serve(llm: Any, params: Any, messages: list[dict[str, str]], label: str, expected: str) -> Served:
    out = llm.generate([llm.render_chat(messages)], params)[0]
    by_tier = {t: int(out.cached_tokens_by_tier.get(t, 0)) for t in ("device", "host", "disk")}
    m = out.metrics
    ttft = (m["first_token_time"] - m["arrival_time"]) * 1e3 if "first_token_time" in m else float("nan")
    s = Served(
        label,
        source_of(out.num_cached_tokens, by_tier),
        expected,
        out.num_cached_tokens,
        len(out.prompt_token_ids),
        by_tier,
        ttft,
    )
    mark = "" if s.source == expected else f"   (expected {expected})"
    tiers = " ".join(f"{by_tier[t]:>6}" for t in ("device", "host", "disk"))
    print(f"  {label:<28} {s.source:<7} {s.cached:>6}/{s.prompt:<6} {tiers} {ttft:>9.1f}{mark}", flush=True)
    return s


def _header(title: str, llm: Any = None) -> None:
    """A phase's title, then (given ``llm``) its tiers' statistics, then the table's column names."""
    print(f"\n--- {title} ---", flush=True)
    if llm is not None:
        print_tiers(llm)
    tiers = " ".join(f"{t:>6}" for t in ("device", "host", "disk"))
    print(f"  {'request':<28} {'source':<7} {'cached/prompt':^13} {tiers} {'TTFT ms':>9}", flush=True)


def print_tiers(llm: Any) -> None:
    tiers = llm.engine.stats().tiers
    parts = []
    for name in ("device", "host", "disk"):
        t = tiers.get(name)
        if t is None:
            continue
        if name == "device":  # idle cached blocks count as free in used_blocks: count them here
            cached = sum(1 for b in llm.engine.kv.pool.blocks if b.block_hash is not None)
            text = f"device {cached}/{t.capacity_blocks} blocks cached, {t.blocks_evicted} evicted"
        else:
            text = f"{name} {t.used_blocks}/{t.capacity_blocks} blocks held, {t.blocks_evicted} evicted"
            text += f", {t.blocks_stored} stored, {t.blocks_loaded} loaded"
        parts.append(text)
    print("  tiers: " + " | ".join(parts), flush=True)


def _warm_up(llm: Any) -> None:
    """One forward before the timed requests (the first one pays one-time costs). Its prompt is
    shorter than a block, so nothing is cached."""
    from kvtier import SamplingParams

    llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))


def _messages(user: str, system: str | None = SYSTEM) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def run_demo(ns: argparse.Namespace, disk_dir: str) -> list[Served]:
    from kvtier import LLM, SamplingParams

    args = dataclasses.replace(engine_args_from(ns), kv_disk_dir=disk_dir)
    kwargs = engine_kwargs(args)
    params = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens, ignore_eos=True)
    served: list[Served] = []
    llm = LLM(args.model, **kwargs)
    try:
        bs = llm.engine.config.cache.block_size
        host = llm.engine.stats().tiers["host"].capacity_blocks
        print(
            f"kvtier demo offload — device pool {ns.kv_device_blocks} blocks ({ns.kv_device_blocks * bs} "
            f"tokens), host tier {ns.kv_host_gb:g} GiB ({host} blocks), disk tier {disk_dir}"
        )
        print("  source: the slowest tier that served part of the prompt (miss: nothing cached)")
        _warm_up(llm)
        _header("Phase 1: cold cache, three requests sharing a system prompt")
        for i, q in enumerate(PHASE1):
            served.append(
                _serve(llm, params, _messages(q), f"{i + 1} {q}"[:28], "miss" if i == 0 else "device")
            )
        print_tiers(llm)

        _header("Phase 2: the same system prompt again (device hits)")
        for i, q in enumerate(PHASE2):
            served.append(_serve(llm, params, _messages(q), f"{i + 4} {q}"[:28], "device"))
        print_tiers(llm)

        _header("Phase 3: device pressure, then request A again (host hit)")
        served.append(_serve(llm, params, _messages(DOC_A, SYSTEM_A), "A (a 250-token report)", "miss"))
        for system, text in PRESSURE:
            served.append(_serve(llm, params, _messages(text, system), text.split(".")[0], "miss"))
        served.append(_serve(llm, params, _messages(DOC_A, SYSTEM_A), "A again", "host"))
        print_tiers(llm)
    finally:
        llm.close()  # flushes device and host blocks to disk

    llm = LLM(args.model, **kwargs)
    try:
        _header("Phase 4: restart on the same disk directory (disk hits)", llm)
        _warm_up(llm)
        served.append(_serve(llm, params, _messages(DOC_A, SYSTEM_A), "A after restart", "disk"))
        served.append(_serve(llm, params, _messages(PHASE1[0]), f"1 {PHASE1[0]} (restart)"[:28], "disk"))
        print_tiers(llm)
    finally:
        llm.close()
    return served


def main(ns: argparse.Namespace) -> int:
    if ns.kv_device_blocks < 24:
        print("kvtier demo offload: --kv-device-blocks below 24 cannot hold request A", file=sys.stderr)
    if ns.kv_disk_dir is not None:
        os.makedirs(ns.kv_disk_dir, exist_ok=True)
        if any(os.scandir(ns.kv_disk_dir)):
            print(
                f"note: {ns.kv_disk_dir} is not empty: blocks of an earlier run turn misses into disk hits",
                file=sys.stderr,
            )
        served = run_demo(ns, ns.kv_disk_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
            served = run_demo(ns, tmp)
    seen = {s.source for s in served}
    unexpected = [s for s in served if s.source != s.expected]
    missing = [x for x in SOURCES if x not in seen]
    summary = "all four" if not missing else "missing " + ", ".join(missing)
    print(f"\nsources seen: {', '.join(x for x in SOURCES if x in seen)} ({summary})")
    if unexpected:
        print(f"{len(unexpected)} request(s) were not served from the expected tier", file=sys.stderr)
        return 1
    return 0
