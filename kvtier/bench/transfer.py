"""``kvtier bench transfer``: the tiers' data path, measured in isolation and inside decode.

1. Block store (device pool → host buffer) and load (host → device) bandwidth through ``TierMover``
   executing a ``SwapPlan``, for batches of 1 to 1,024 blocks with contiguous device block ids (one
   slice copy per run of host blocks) and scattered ones (per run, one copy and an index_select /
   index_copy_ on the device side), against a plain memcpy
   (``torch.Tensor.copy_`` of one contiguous tensor) of the same bytes.
   Target: >= 70% of memcpy at >= 64 blocks.
2. Decode throughput of the same greedy workload with the tiers off and with a host tier whose
   write-back stores run during decode (a small device pool full of cached blocks: every new block
   evicts one, which is stored). A/B repetitions interleaved in one process. Target: <= 5% slower.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvtier.args import add_engine_args

BATCHES = (1, 4, 16, 64, 256, 1024)
BLOCK_SHAPE = (30, 16, 2, 3, 64)  # the default model: layers, block_size, K/V, kv heads, head_dim


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-blocks", type=int, default=1024, help="largest batch (1,024 blocks = 755 MB a side)"
    )
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions per copy (best is kept)")
    p.add_argument("--decode-seqs", type=int, default=8, help="sequences decoded together")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens generated per sequence")
    p.add_argument("--decode-reps", type=int, default=3, help="A/B repetitions (interleaved)")
    p.add_argument("--skip-decode", action="store_true", help="bandwidth only (no model)")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run, not for reporting)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    add_engine_args(p, ["num_threads"], notes={"num_threads": "default: torch's"})
    p.set_defaults(func=main)


@dataclass
class BandwidthRow:
    blocks: int
    pattern: str  # "contiguous" | "scattered"
    mib: float
    store_gbs: float
    load_gbs: float
    memcpy_gbs: float

    @property
    def worst_fraction(self) -> float:
        return min(self.store_gbs, self.load_gbs) / self.memcpy_gbs


def _interleaved_best(
    fns: dict[str, Callable[[], object]], repeat: int, min_seconds: float
) -> dict[str, float]:
    """Best time of each function, run in turn (so all see the same machine load), ``repeat`` rounds
    or more until ``min_seconds`` have passed (short copies get more rounds, at most 500)."""
    for fn in fns.values():
        fn()  # warm-up: first-touch page faults, allocator
    best = dict.fromkeys(fns, float("inf"))
    rounds, t_start = 0, time.perf_counter()
    while rounds < repeat or (time.perf_counter() - t_start < min_seconds and rounds < 500):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
        rounds += 1
    return best


@torch.inference_mode()
def measure_bandwidth(max_blocks: int, repeat: int, batches: tuple[int, ...]) -> list[BandwidthRow]:
    from kvtier.kv.plan import SwapPlan
    from kvtier.transfer.mover import TierMover

    sizes = [n for n in batches if n <= max_blocks]
    top = max(sizes)
    pool_blocks = top + max(16, top // 4)  # room for scattered ids
    device = torch.full((pool_blocks, *BLOCK_SHAPE), 1.0, dtype=torch.float32)
    mover = TierMover(device, top)
    block_bytes = mover.block_bytes
    src = torch.full((top, *BLOCK_SHAPE), 2.0, dtype=torch.float32)
    dst = torch.zeros_like(src)
    for chunk in mover.host.chunks:
        chunk.fill_(3.0)  # touch the host buffer's pages before timing
    rng = random.Random(0)
    rows = []
    for n in sizes:
        host_block_ids = list(range(n))
        ids = {
            "contiguous": list(range(8, 8 + n)),  # one slice copy per run of host blocks
            "scattered": rng.sample(range(pool_blocks), n),  # random order: a gather or scatter per run
        }
        fns: dict[str, Callable[[], object]] = {"memcpy": lambda n=n: dst[:n].copy_(src[:n])}
        for pattern, block_ids in ids.items():
            store_plan = SwapPlan(stores=list(zip(block_ids, host_block_ids, strict=True)))
            load_plan = SwapPlan(loads=list(zip(host_block_ids, block_ids, strict=True)))
            fns[f"store {pattern}"] = lambda p=store_plan: mover.execute(p)
            fns[f"load {pattern}"] = lambda p=load_plan: mover.execute(p)
        best = _interleaved_best(fns, repeat, min_seconds=0.3)
        nbytes = n * block_bytes
        for pattern in ids:
            r = BandwidthRow(
                n,
                pattern,
                nbytes / 2**20,
                nbytes / best[f"store {pattern}"] / 1e9,
                nbytes / best[f"load {pattern}"] / 1e9,
                nbytes / best["memcpy"] / 1e9,
            )
            rows.append(r)
            print(
                f"  {n:>5} blocks {pattern:<10}: store {r.store_gbs:.1f} GB/s, load {r.load_gbs:.1f} GB/s, "
                f"memcpy {r.memcpy_gbs:.1f} GB/s",
                file=sys.stderr,
                flush=True,
            )
    return rows


# ------------------------------------------------------------------------------ decode
@dataclass
class DecodeResult:
    tiers_off_tok_s: list[float]
    tiers_on_tok_s: list[float]
    ratios: list[float]  # on / off, per interleaved pair
    blocks_stored: int
    blocks_stored_during_decode: int
    device_blocks: int
    host_gb: float


def _decode_once(llm: Any, prompts: list[list[int]], tokens: int) -> tuple[float, int]:
    from kvtier import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def measure_decode(seqs: int, tokens: int, reps: int, threads: int | None) -> DecodeResult:
    """The same greedy batch, tiers off vs a host tier with write-back stores during decode. Both
    engines have the same small device pool; fresh random prompts each repetition, so the pool is
    full of the previous repetition's cached blocks and every new block evicts (and stores) one."""
    from kvtier import LLM

    prompt_len = 32
    per_seq = -(-(prompt_len + tokens) // 16)
    device_blocks = seqs * per_seq + 4
    host_gb = (reps + 2) * seqs * per_seq * 737_280 * 1.5 / 2**30
    common: dict[str, Any] = {"kv_device_blocks": device_blocks, "num_threads": threads, "dtype": "float32"}
    off = LLM(**common)
    on = LLM(**common, kv_host_gb=host_gb)
    vocab = off.engine.model_config.vocab_size
    rng = random.Random(5)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(100, vocab - 100) for _ in range(prompt_len)] for _ in range(seqs)]

    for llm in (off, on):  # warm-up, and fill both pools with cached blocks
        _decode_once(llm, prompts(), tokens)
    res = DecodeResult([], [], [], 0, 0, device_blocks, host_gb)
    for rep in range(reps):
        pair: dict[str, float] = {}
        order = ("off", "on") if rep % 2 == 0 else ("on", "off")  # alternate who goes first
        for which in order:
            llm = off if which == "off" else on
            before = llm.engine.stats().tiers.get("host")
            dt, n = _decode_once(llm, prompts(), tokens)
            pair[which] = n / dt
            after = llm.engine.stats().tiers.get("host")
            if which == "on" and before is not None and after is not None:
                res.blocks_stored_during_decode += after.blocks_stored - before.blocks_stored
            print(f"  decode rep {rep + 1} tiers {which:<3}: {n / dt:.1f} tok/s", file=sys.stderr, flush=True)
        res.tiers_off_tok_s.append(pair["off"])
        res.tiers_on_tok_s.append(pair["on"])
        res.ratios.append(pair["on"] / pair["off"])
    host = on.engine.stats().tiers["host"]
    res.blocks_stored = host.blocks_stored
    on.close()
    off.close()
    return res


# ------------------------------------------------------------------------------ main
def main(ns: argparse.Namespace) -> int:
    if ns.quick:
        ns.max_blocks, ns.repeat = min(ns.max_blocks, 64), min(ns.repeat, 2)
        ns.decode_seqs, ns.decode_tokens, ns.decode_reps = 4, 32, 1
    if ns.max_blocks < 1:
        raise ValueError("--max-blocks must be at least 1")
    if ns.num_threads:
        torch.set_num_threads(ns.num_threads)
    block_mib = torch.Size(BLOCK_SHAPE).numel() * 4 / 2**20
    print(
        f"kvtier bench transfer — block {list(BLOCK_SHAPE)} fp32 = {block_mib:.3f} MiB, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, device "
        f"{'cuda' if torch.cuda.is_available() else 'cpu'} (the device pool is host memory on a CPU)",
        flush=True,
    )
    rows = measure_bandwidth(ns.max_blocks, ns.repeat, BATCHES)
    print_bandwidth(rows)
    decode = None
    if not ns.skip_decode:
        decode = measure_decode(ns.decode_seqs, ns.decode_tokens, ns.decode_reps, ns.num_threads)
        print_decode(decode, ns)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(
                {
                    "bandwidth": [asdict(r) for r in rows],
                    "decode": None if decode is None else asdict(decode),
                },
                f,
                indent=2,
            )
    print("\n(numbers are noisy on a shared machine: compare rows of one run)")
    return 0


def print_bandwidth(rows: list[BandwidthRow]) -> None:
    print(
        f"\n| {'blocks':>6} | {'MiB':>7} | {'block ids':<10} | {'store GB/s':>10} | {'load GB/s':>9} | "
        f"{'memcpy GB/s':>11} | {'store %':>7} | {'load %':>6} | target >= 70% (>= 64 blocks) |"
    )
    print(f"|{'-' * 8}|{'-' * 9}|{'-' * 12}|{'-' * 12}|{'-' * 11}|{'-' * 13}|{'-' * 9}|{'-' * 8}|{'-' * 31}|")
    for r in rows:
        met = "" if r.blocks < 64 else ("met" if r.worst_fraction >= 0.7 else "UNMET")
        store, load = r.store_gbs / r.memcpy_gbs, r.load_gbs / r.memcpy_gbs
        print(
            f"| {r.blocks:>6} | {r.mib:>7.1f} | {r.pattern:<10} | {r.store_gbs:>10.1f} | {r.load_gbs:>9.1f} "
            f"| {r.memcpy_gbs:>11.1f} | {store:>7.0%} | {load:>6.0%} | {met:<29} |"
        )
    big = [r for r in rows if r.blocks >= 64]
    if big:
        worst = min(big, key=lambda r: r.worst_fraction)
        verdict = "met" if worst.worst_fraction >= 0.7 else "UNMET"
        print(
            f"target store/load >= 70% of memcpy at >= 64 blocks: {verdict} "
            f"(worst {worst.worst_fraction:.0%}, {worst.blocks} blocks {worst.pattern})"
        )
    else:
        print("target store/load >= 70% of memcpy at >= 64 blocks: n/a (--max-blocks < 64)")


def print_decode(d: DecodeResult, ns: argparse.Namespace) -> None:
    ratio = statistics.median(d.ratios)
    slower = 1 - ratio
    print(
        f"\ndecode: {ns.decode_seqs} sequences x {ns.decode_tokens} tokens, greedy, device pool "
        f"{d.device_blocks} blocks in both; tiers on = host tier {d.host_gb:.2f} GiB, write-back"
    )
    print(f"| {'rep':>3} | {'tiers off tok/s':>15} | {'tiers on tok/s':>14} | {'on / off':>8} |")
    print(f"|{'-' * 5}|{'-' * 17}|{'-' * 16}|{'-' * 10}|")
    for i, (a, b, r) in enumerate(zip(d.tiers_off_tok_s, d.tiers_on_tok_s, d.ratios, strict=True)):
        print(f"| {i + 1:>3} | {a:>15.1f} | {b:>14.1f} | {r:>8.3f} |")
    print(
        f"host blocks stored by the tiers-on engine: {d.blocks_stored} in all, "
        f"{d.blocks_stored_during_decode} during the timed repetitions"
        + ("" if d.blocks_stored_during_decode > 0 else "  (none: the comparison measured nothing!)")
    )
    how = f"{slower:.1%} slower" if slower >= 0 else f"{-slower:.1%} faster"
    if d.blocks_stored_during_decode == 0:  # no store overlapped the timed decode: nothing to judge
        verdict, how = "n/a", f"no block stored during decode; {how}"
    else:
        verdict = "met" if slower <= 0.05 else "UNMET"
    print(f"target decode with write-back stores <= 5% slower: {verdict} (median on/off {ratio:.3f}: {how})")
