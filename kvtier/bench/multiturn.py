"""``kvtier bench multiturn``: multi-turn chat served round-robin, time to first token per KV setup.

Every conversation starts with one system prompt shared by all and its own document (RAG context or
agent history); each turn adds a user message, and the model's greedy answer of ``--answer-tokens``
tokens joins the history, so turn t+1's prompt is turn t's prompt + answer + the new user turn (built
in token ids: the prefix is exact). Turns are served round-robin (turn 1 of every conversation, then
turn 2, ...), one request at a time, like a busy chat or agent service whose device pool holds only
about a quarter of the live conversations.

Rows, side by side in one process on the same prompts:

* no prefix caching (every prompt computed in full);
* device-only prefix caching;
* device + host tier (big enough for every conversation);
* device + host + disk, with a host tier as small as the device pool, so the disk tier serves;
* a second engine started on that disk directory (a restart) replaying the conversations;
* llama.cpp with its ``LlamaRAMCache`` (when llama-cpp-python is installed; skipped otherwise).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.args import add_engine_args
from kvtier.bench.multiturn_report import TIER_NAMES as TIER_NAMES
from kvtier.bench.multiturn_report import evaluate_targets, print_tables, print_targets, write_chart

WORDS = (  # noqa: SIM905 - a word list reads better as text
    "cache block memory tier host disk device token prompt answer model layer attention query key value "
    "system user agent document report table figure section result method data server request batch "
    "latency throughput budget policy review design plan team project customer order invoice payment "
    "river mountain city market garden library museum station harbor bridge forest island valley "
    "quickly carefully often rarely always never today tomorrow yesterday because although while after "
    "before during between under over across through against among around beyond inside outside "
    "build measure compare explain describe summarize improve reduce increase store load evict compute "
    "first second third final early late large small fast slow simple complex stable robust shared"
).split()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=16, help="conversations (default 16)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    p.add_argument("--system-tokens", type=int, default=200, help="shared system prompt (~tokens)")
    p.add_argument("--doc-tokens", type=int, default=600, help="per-conversation document (~tokens)")
    p.add_argument("--user-tokens", type=int, default=100, help="user message per turn (~tokens)")
    p.add_argument("--answer-tokens", type=int, default=48, help="generated tokens per turn")
    p.add_argument("--device-fraction", type=float, default=0.25, help="device pool / live conversations")
    p.add_argument("--quick", action="store_true", help="4 conversations x 3 turns, small texts (smoke run)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated texts")
    p.add_argument("--chart", default="bench-multiturn.png", help="PNG chart path ('' for none)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    notes = {"kv_disk_dir": "default: a temporary one", "num_threads": "and llama.cpp's"}
    add_engine_args(p, ["model", "chat_template", "kv_disk_dir", "num_threads"], notes=notes)
    p.set_defaults(func=main)


# ------------------------------------------------------------------------------ workload
@dataclass
class Workload:
    first_prompts: list[list[int]]  # turn 1 of each conversation
    suffixes: list[list[list[int]]]  # [conv][turn - 2]: end of the answer + the next user turn
    answer_tokens: int
    system_tokens: int
    answers: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (conv, turn) -> ids

    @property
    def num_convs(self) -> int:
        return len(self.first_prompts)

    @property
    def num_turns(self) -> int:
        return 1 + len(self.suffixes[0])

    def prompt(self, conv: int, turn: int) -> list[int]:
        """Turn ``turn`` (0-based) of ``conv``: needs the canonical answers of its earlier turns."""
        ids = list(self.first_prompts[conv])
        for t in range(turn):
            ids += self.answers[(conv, t)] + self.suffixes[conv][t]
        return ids

    def prompt_len(self, conv: int, turn: int) -> int:
        n = len(self.first_prompts[conv])
        return n + sum(self.answer_tokens + len(self.suffixes[conv][t]) for t in range(turn))


def _text(rng: random.Random, tokenizer: Any, n_tokens: int) -> str:
    words: list[str] = []
    while True:
        words += [rng.choice(WORDS) for _ in range(max(8, (n_tokens - len(words)) // 2))]
        text = " ".join(words).capitalize() + "."
        if len(tokenizer.encode(text, add_special_tokens=False)) >= n_tokens:
            return text


def build_workload(tokenizer: Any, ns: argparse.Namespace) -> Workload:
    rng = random.Random(ns.seed)
    system = "You are a careful assistant. Use the document. " + _text(rng, tokenizer, ns.system_tokens)
    sentinel = "\x00ANSWER\x00"
    firsts, suffixes = [], []
    for c in range(ns.conversations):
        doc = _text(rng, tokenizer, ns.doc_tokens)
        users = [f"Question {t + 1}: " + _text(rng, tokenizer, ns.user_tokens) for t in range(ns.turns)]
        msgs = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Document {c}:\n{doc}\n\n{users[0]}"},
        ]
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        firsts.append(tokenizer.encode(text, add_special_tokens=False))
        conv_suffixes = []
        for u in users[1:]:  # the template's text between an answer and the next generation prompt
            full = tokenizer.apply_chat_template(
                [*msgs, {"role": "assistant", "content": sentinel}, {"role": "user", "content": u}],
                add_generation_prompt=True,
            )
            conv_suffixes.append(tokenizer.encode(full.split(sentinel, 1)[1], add_special_tokens=False))
        suffixes.append(conv_suffixes)
    return Workload(firsts, suffixes, ns.answer_tokens, _shared_prefix_len(tokenizer, system, firsts))


def _shared_prefix_len(tokenizer: Any, system: str, firsts: list[list[int]]) -> int:
    """Tokens every conversation's first prompt shares: the rendered system prompt (a template without
    a system role, Gemma 3's, puts it at the start of the first user turn, so with two conversations or
    more it is their common prefix)."""
    if len(firsts) < 2:
        rendered = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}], add_generation_prompt=False
        )
        return len(tokenizer.encode(rendered, add_special_tokens=False))
    n = min(len(f) for f in firsts)
    return next((i for i in range(n) if len({f[i] for f in firsts}) > 1), n)


# ------------------------------------------------------------------------------ results
@dataclass
class Record:
    conv: int
    turn: int  # 1-based
    prompt_tokens: int
    cached_tokens: int | None  # None: unknown (llama.cpp)
    by_tier: dict[str, int]
    ttft_s: float
    answer_ok: bool | None = None  # equals the canonical answer (None: not checked)
    wait_s: float = 0.0  # arrival to first scheduled: waiting for disk reads (one request at a time)


@dataclass
class RunResult:
    name: str
    note: str
    records: list[Record] = field(default_factory=list)
    wall_s: float = 0.0
    tier_stats: dict[str, dict[str, int]] = field(default_factory=dict)
    skipped: str | None = None

    def ttfts(self, turn: int | None = None, first_turn: int = 1) -> list[float]:
        return [r.ttft_s for r in self.records if (turn is None or r.turn == turn) and r.turn >= first_turn]

    def mean_ttft(self, first_turn: int = 1) -> float:
        xs = self.ttfts(first_turn=first_turn)
        return statistics.fmean(xs) if xs else math.nan

    @property
    def mean(self) -> float:
        return self.mean_ttft()

    @property
    def mean_wait(self) -> float:
        return statistics.fmean(r.wait_s for r in self.records) if self.records else math.nan

    def computed_tokens(self, first_turn: int = 1) -> int | None:
        recs = [r for r in self.records if r.turn >= first_turn]
        if not recs or any(r.cached_tokens is None for r in recs):
            return None
        return sum(r.prompt_tokens - (r.cached_tokens or 0) for r in recs)

    @property
    def computed(self) -> int | None:
        return self.computed_tokens()

    def hits(self, tier: str) -> int:
        return sum(r.by_tier.get(tier, 0) for r in self.records)

    @property
    def mismatches(self) -> int:
        return sum(1 for r in self.records if r.answer_ok is False)


# ------------------------------------------------------------------------------ kvtier
def _run_one(engine: Any, prompt: list[int], params: Any) -> Any:
    rid = engine.add_request({"prompt_token_ids": prompt}, params)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def run_kvtier(
    name: str, note: str, loaded: Any, work: Workload, engine_kwargs: dict[str, Any], max_tokens: int
) -> RunResult:
    """Serve every turn round-robin on a new engine; the first run fills ``work.answers``."""
    from kvtier.config import EngineArgs
    from kvtier.engine import LLMEngine
    from kvtier.sampling_params import SamplingParams

    print(f"  running: {name} ...", file=sys.stderr, flush=True)
    res = RunResult(name, note)
    engine = LLMEngine(EngineArgs(dtype="float32", **engine_kwargs), loaded=loaded)
    t_start = time.perf_counter()
    try:
        _run_one(engine, [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up, < 1 block
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for turn in range(work.num_turns):
            for conv in range(work.num_convs):
                out = _run_one(engine, work.prompt(conv, turn), params)
                answer = list(out.outputs[0].token_ids)
                ok: bool | None = None
                if (conv, turn) not in work.answers:
                    work.answers[(conv, turn)] = answer
                elif max_tokens == work.answer_tokens:
                    ok = answer == work.answers[(conv, turn)]
                m, by_tier = out.metrics, {t: int(out.cached_tokens_by_tier.get(t, 0)) for t in TIER_NAMES}
                t0, t_first = m["arrival_time"], m["first_token_time"]
                wait = m.get("first_scheduled_time", t0) - t0
                rec = Record(
                    conv, turn + 1, len(out.prompt_token_ids), out.num_cached_tokens, by_tier, t_first - t0
                )
                rec.answer_ok, rec.wait_s = ok, wait
                res.records.append(rec)
        keys = ("blocks_stored", "blocks_loaded", "blocks_evicted")
        res.tier_stats = {t: {k: getattr(s, k) for k in keys} for t, s in engine.stats().tiers.items()}
    finally:
        engine.close()  # flushes device and host blocks to disk (the restart row reads them)
        res.wall_s = time.perf_counter() - t_start
        del engine
        gc.collect()
    print(f"    {name}: {res.wall_s:.1f} s, mean TTFT {res.mean * 1e3:.0f} ms", file=sys.stderr, flush=True)
    return res


# ------------------------------------------------------------------------------ llama.cpp
def run_llamacpp(work: Workload, capacity_bytes: int, threads: int | None) -> RunResult:
    """llama.cpp (llama-cpp-python) with ``LlamaRAMCache`` on the same prompts, greedy, EOS banned.
    TTFT is measured to the first logits (just before the first token is sampled)."""
    name = "llama.cpp + LlamaRAMCache"
    res = RunResult(name, f"RAM cache {capacity_bytes / 2**30:.1f} GiB, Q4_1 GGUF, same token ids")
    try:
        import numpy as np
        from llama_cpp import Llama, LlamaRAMCache, LogitsProcessorList
    except ImportError as exc:
        res.skipped = f"llama-cpp-python is not installed ({exc}); to build it: BENCHMARKS.md, llama.cpp rows"
        return res
    from kvtier.models.loader import default_model_path

    print(f"  running: {name} ...", file=sys.stderr, flush=True)
    longest = max(work.prompt_len(c, work.num_turns - 1) for c in range(work.num_convs))
    n_ctx = 256 * math.ceil((longest + work.answer_tokens + 16) / 256)
    kwargs: dict[str, Any] = {"model_path": str(default_model_path()), "n_ctx": n_ctx, "verbose": False}
    if threads:
        kwargs["n_threads"] = threads
    llama = Llama(**kwargs)
    cache = LlamaRAMCache(capacity_bytes=capacity_bytes)
    llama.set_cache(cache)
    eos = llama.token_eos()
    first: list[float] = []

    def ban_eos_and_time(input_ids: Any, scores: Any) -> Any:
        if not first:
            first.append(time.perf_counter())
        scores[eos] = -np.inf
        return scores

    processors = LogitsProcessorList([ban_eos_and_time])
    t_start = time.perf_counter()
    for turn in range(work.num_turns):
        for conv in range(work.num_convs):
            prompt = work.prompt(conv, turn)
            reused = _llamacpp_reusable(llama, cache, prompt)
            first.clear()
            t0 = time.perf_counter()
            llama.create_completion(
                prompt, max_tokens=work.answer_tokens, temperature=0.0, logits_processor=processors
            )
            ttft = (first[0] if first else time.perf_counter()) - t0
            res.records.append(Record(conv, turn + 1, len(prompt), reused, {}, ttft))
    res.wall_s = time.perf_counter() - t_start
    del llama
    gc.collect()
    return res


def _llamacpp_reusable(llama: Any, cache: Any, prompt: list[int]) -> int | None:
    """Prompt tokens llama.cpp can skip: the longest prefix shared with its live context or with a
    state in its RAM cache (what ``Llama._create_completion`` restores). None if unknown."""

    def lcp(a: Any) -> int:
        return sum(
            1 for _ in itertools.takewhile(lambda xy: int(xy[0]) == xy[1], zip(a, prompt, strict=False))
        )

    try:
        best = lcp(list(llama._input_ids))
        for key in getattr(cache, "cache_state", {}):
            best = max(best, lcp(key))
        return min(best, len(prompt) - 1)  # the last prompt token is always evaluated again
    except Exception:
        return None


# ------------------------------------------------------------------------------ main
@dataclass(frozen=True)
class Pools:
    """The tier sizes of the runs, from the workload's final size (float32 KV, 16-token blocks)."""

    block_bytes: int
    live_blocks: int  # blocks every conversation holds at the end (the system prompt's shared once)
    device_blocks: int  # ``--device-fraction`` of them, at least one conversation + 8
    host_all_gb: float  # a host tier that holds every conversation (1.5x, at least 0.02 GiB)
    host_small_gb: float  # a host tier as small as the device pool (the disk tier serves the rest)
    max_model_len: int


def size_pools(work: Workload, mc: Any, device_fraction: float) -> Pools:
    bs = 16
    layout = mc.kv_layout()  # a hybrid model's blocks: every group's, each of layers_per_group slots
    block_bytes = layout.layers_per_group * bs * 2 * mc.num_kv_heads * mc.head_dim * 4  # float32 KV
    last = work.num_turns - 1
    final_blocks = [
        layout.num_blocks_held(work.prompt_len(c, last) + work.answer_tokens, bs)
        for c in range(work.num_convs)
    ]
    shared = (work.system_tokens // bs) * layout.num_groups  # the system prompt's blocks, held once
    live_blocks = sum(final_blocks) - shared * (work.num_convs - 1)
    longest = max(work.prompt_len(c, last) for c in range(work.num_convs)) + work.answer_tokens + 1
    need = layout.num_blocks_held(longest, bs) + 8 * layout.num_groups  # the longest fits, with room
    device_blocks = max(math.ceil(live_blocks * device_fraction), need)
    return Pools(
        block_bytes=block_bytes,
        live_blocks=live_blocks,
        device_blocks=device_blocks,
        host_all_gb=max(0.02, live_blocks * 1.5 * block_bytes / 2**30),
        host_small_gb=device_blocks * block_bytes / 2**30,
        max_model_len=longest,
    )


def print_setup(work: Workload, ns: argparse.Namespace, pools: Pools) -> None:
    prompts = [work.prompt_len(c, t) for c in range(work.num_convs) for t in range(work.num_turns)]
    device, live = pools.device_blocks, pools.live_blocks
    print(
        f"kvtier bench multiturn — {work.num_convs} conversations x {work.num_turns} turns, round-robin, "
        f"one request at a time; system prompt {work.system_tokens} tokens (shared), documents "
        f"~{ns.doc_tokens}, user turns ~{ns.user_tokens}, answers {work.answer_tokens} tokens (greedy); "
        f"prompts {min(prompts)}-{max(prompts)} tokens, {sum(prompts)} in all\n"
        f"device pool {device} blocks ({device * 16} tokens) = "
        f"{device / live:.0%} of the {live} blocks the conversations hold at the end; "
        f"host tier {pools.host_all_gb:.2f} GiB (all of them) or {pools.host_small_gb:.2f} GiB with disk "
        f"({device} blocks: too small, the disk tier serves the rest)",
        flush=True,
    )


def run_all(loaded: Any, work: Workload, ns: argparse.Namespace, pools: Pools) -> dict[str, RunResult]:
    """Every row: the kvtier configurations in order (device-only first: its greedy answers become
    every conversation's history), then llama.cpp; the disk rows share one directory."""
    base: dict[str, Any] = {
        "kv_device_blocks": pools.device_blocks,
        "num_threads": ns.num_threads,
        "max_model_len": pools.max_model_len,
    }
    disk_tmp = None
    disk_dir = ns.kv_disk_dir
    if disk_dir is None:
        disk_tmp = tempfile.TemporaryDirectory(prefix="kvtier-multiturn-")
        disk_dir = disk_tmp.name
    elif os.path.isdir(disk_dir) and any(os.scandir(disk_dir)):
        print(f"note: {disk_dir} is not empty: the 'cold' disk row is not cold", file=sys.stderr)
    results: dict[str, RunResult] = {}
    host_all, host_small = pools.host_all_gb, pools.host_small_gb
    try:
        tiers_disk = {**base, "kv_host_gb": host_small, "kv_disk_dir": disk_dir}
        n = work.answer_tokens
        runs: list[tuple[str, str, dict[str, Any], int]] = [
            ("device only", "prefix caching, no tiers", base, n),
            ("no prefix caching", "max_tokens=1 (TTFT only)", {**base, "enable_prefix_caching": False}, 1),
            ("device+host", f"host {host_all:.2f} GiB", {**base, "kv_host_gb": host_all}, n),
            ("device+host+disk", f"host {host_small:.2f} GiB (small), cold disk", tiers_disk, n),
            ("restart on disk", "new engine, same disk dir, same prompts", tiers_disk, n),
        ]
        for name, note, kwargs, max_tokens in runs:
            results[name] = run_kvtier(name, note, loaded, work, kwargs, max_tokens)
        if ns.model is None:  # the llama.cpp row runs the default model's GGUF
            results["llama.cpp"] = run_llamacpp(work, int(max(host_all, 0.1) * 2**30), ns.num_threads)
        else:
            skipped = "run on the default model only"
            results["llama.cpp"] = RunResult("llama.cpp + LlamaRAMCache", "", skipped=skipped)
    finally:
        if disk_tmp is not None:
            disk_tmp.cleanup()
    return results


ROW_ORDER = (
    "no prefix caching",
    "device only",
    "device+host",
    "device+host+disk",
    "restart on disk",
    "llama.cpp",
)


def main(ns: argparse.Namespace) -> int:
    from kvtier.models.loader import load_model

    if ns.quick:
        ns.conversations, ns.turns = min(ns.conversations, 4), min(ns.turns, 3)
        ns.system_tokens, ns.doc_tokens = min(ns.system_tokens, 48), min(ns.doc_tokens, 120)
        ns.user_tokens, ns.answer_tokens = min(ns.user_tokens, 24), min(ns.answer_tokens, 8)
    if ns.conversations < 1 or ns.turns < 1 or ns.answer_tokens < 1:
        raise ValueError("--conversations, --turns and --answer-tokens must be at least 1")
    t_all = time.perf_counter()
    loaded = load_model(ns.model, chat_template=ns.chat_template)
    work = build_workload(loaded.tokenizer, ns)
    pools = size_pools(work, loaded.config, ns.device_fraction)
    print_setup(work, ns, pools)
    results = run_all(loaded, work, ns, pools)
    rows = [results[k] for k in ROW_ORDER]
    print_tables(rows, work)
    targets = evaluate_targets(results)
    print_targets(targets)
    if ns.chart:
        print(f"\nchart: {write_chart(rows, work, ns.chart)}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"results": [asdict(r) for r in rows], "targets": targets}, f, indent=2)
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s (numbers are noisy on a shared machine)")
    return 0
