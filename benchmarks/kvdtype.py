"""``python -m benchmarks.kvdtype``: every KV cache dtype side by side in one run — quality, capacity, speed.

* **quality**: perplexity of a fixed text of ``--quality-tokens`` tokens (default 20,480), teacher-forced
  through the paged cache in chunks of ``--chunk`` tokens inside windows of ``--window`` tokens (every
  chunk after the first attends to the earlier chunks' stored, i.e. quantized, K/V, and to its own), and
  top-1 next-token agreement with float32 KV at every position. The text is :mod:`benchmarks.kv_text`'s:
  five verbatim licence texts in ``benchmarks/data/`` (23,427 tokens), cut to the token count.
* **storage error**: relative RMS error of the stored K and V of one window (float32 K/V captured from
  the float32 run) under each granularity the module docstring of ``kvtier/models/kv_quant.py``
  discusses: per (token, KV head) vs per (block, KV head) scales, with and without the rotation.
* **capacity**: the most concurrent 2,048-token sequences a fixed ``--pool-gb`` device pool holds, found
  live: an engine per dtype allocates its pool and the real block manager admits sequences until it
  refuses one.
* **speed**: a single-stream decode step at 1k and 4k context (the model's forward through the paged
  cache, ``--decode-steps`` steps, median), and the ``kvtier bench multiturn`` device+host row per KV dtype:
  host-tier load time per returning turn (the device pool holds a quarter of the conversations).

Run ``python -m benchmarks.kvdtype --quick`` for a smoke run (small text, one context, short
multiturn), and ``python -m benchmarks.kvdtype --fp8-study N`` for the fp8_e4m3 quality study instead
(:mod:`benchmarks.kvdtype_study`: K vs V, attention sinks, rounding levers, on N windows).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.kv_text import fixed_text, teacher_force
from benchmarks.runner import run
from kvtier.args import add_engine_args

KV_DTYPES = ("float32", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtypes", default=",".join(KV_DTYPES), help="KV dtypes, comma-separated (float32 first)")
    p.add_argument(
        "--quality-tokens", type=int, default=20480, help="tokens of the fixed text (default 20480)"
    )
    p.add_argument("--window", type=int, default=2048, help="tokens per teacher-forced window (default 2048)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk inside a window (default 256)")
    p.add_argument("--pool-gb", type=float, default=1.0, help="device pool of the capacity test, GiB")
    p.add_argument("--seq-tokens", type=int, default=2048, help="tokens per sequence in the capacity test")
    p.add_argument("--contexts", default="1024,4096", help="decode contexts (default 1024,4096)")
    p.add_argument("--decode-steps", type=int, default=24, help="timed decode steps per context")
    p.add_argument("--conversations", type=int, default=8, help="multiturn conversations (default 8)")
    p.add_argument("--turns", type=int, default=3, help="multiturn turns (default 3)")
    p.add_argument("--skip", default="", help="parts to skip: quality,capacity,decode,multiturn")
    p.add_argument("--quick", action="store_true", help="smoke run: 1,024 tokens, context 512, 3x2 turns")
    p.add_argument(
        "--fp8-study",
        type=int,
        default=0,
        metavar="WINDOWS",
        help="instead: the fp8_e4m3 quality study on this many 2,048-token windows (kvdtype_study.py)",
    )
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    add_engine_args(p, ["num_threads"])
    p.set_defaults(func=main)


# ------------------------------------------------------------------------------------------ quality
@dataclass
class Quality:
    kv_dtype: str
    num_tokens: int = 0
    nll_sum: float = 0.0
    agree: int = 0  # positions whose top-1 equals float32 KV's
    seconds: float = 0.0
    top1: list[Any] = field(default_factory=list, repr=False)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / max(1, self.num_tokens))


def run_quality(model: Any, ids: list[int], kv_dtypes: list[str], window: int, chunk: int) -> dict[str, Any]:
    import torch

    from kvtier.models.kv_quant import KVFormat, PagedKVCache

    c = model.config
    tokens = torch.tensor(ids)
    results: dict[str, Quality] = {}
    captured = None
    for kd in kv_dtypes:
        q = Quality(kd)
        t0 = time.perf_counter()
        for w in range(0, len(ids) - 1, window):
            win = tokens[w : w + window]
            shape = (c.num_layers, 16, c.num_kv_heads, c.head_dim)
            cache = PagedKVCache(KVFormat(kd, model.dtype), -(-len(win) // 16), shape, torch.device("cpu"))
            nll, top1 = teacher_force(model, cache, win, chunk)
            q.nll_sum += nll
            q.num_tokens += len(win) - 1
            q.top1.append(top1)
            if kd == "float32" and captured is None:
                captured = cache.raw.clone()  # [NB, L, BS, 2, KVH, D]: one window's real K/V
        q.seconds = time.perf_counter() - t0
        ref = results.get("float32")
        if ref is not None:
            q.agree = sum(int((a == b).sum()) for a, b in zip(q.top1, ref.top1, strict=True))
        results[kd] = q
        print(f"  quality {kd}: ppl {q.ppl:.4f} ({q.seconds:.0f} s)", file=sys.stderr, flush=True)
    return {"results": results, "captured": captured}


def storage_errors(kv: Any) -> list[dict[str, Any]]:
    """Relative RMS error of K and V of ``kv`` ([NB, L, BS, 2, KVH, D] float32) stored per granularity."""
    import torch

    from kvtier.models.kv_quant import KVFormat, dequantize, hadamard, quantize

    rows = []
    rot = hadamard(kv.shape[-1])
    for kd in ("fp8_e4m3", "int8"):
        fmt = KVFormat(kd, torch.float32)
        for rotated in (False, True):
            x = kv @ rot if rotated else kv
            for granularity in ("token", "block"):
                if granularity == "token":  # one scale per (block, layer, token, K/V, head)
                    q, s = quantize(x, fmt)
                    back = dequantize(q, s, torch.float32)
                else:  # one scale per (block, layer, K/V, head): move the tokens next to the channels
                    xb = x.permute(0, 1, 3, 4, 2, 5).flatten(-2)  # [NB, L, 2, KVH, BS*D]
                    q, s = quantize(xb, fmt)
                    back = dequantize(q, s, torch.float32).unflatten(-1, (kv.shape[2], -1))
                    back = back.permute(0, 1, 4, 2, 3, 5)
                err = {}
                for i, name in ((0, "K"), (1, "V")):
                    ref, got = x[:, :, :, i], back[:, :, :, i]
                    err[name] = ((got - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
                scale_bytes = 4 if granularity == "token" else 4 / kv.shape[2]
                rows.append(
                    {
                        "kv_dtype": kd,
                        "rotated": rotated,
                        "scales_per": granularity,
                        **err,
                        "bytes_per_value": 1 + scale_bytes / kv.shape[-1],
                    }
                )
    return rows


# ------------------------------------------------------------------------------------------ capacity
def run_capacity(loaded: Any, kv_dtypes: list[str], pool_gb: float, seq_tokens: int) -> list[dict[str, Any]]:
    """Per dtype: an engine with a ``pool_gb`` pool; sequences of ``seq_tokens`` distinct tokens are
    allocated by its block manager until it refuses one."""
    from kvtier.config import EngineArgs
    from kvtier.engine import LLMEngine

    rows = []
    for kd in kv_dtypes:
        args = EngineArgs(dtype="float32", kv_cache_dtype=_flag(kd), kv_device_gb=pool_gb, max_num_seqs=4096)
        engine = LLMEngine(args, loaded=loaded)
        n = 0
        while True:
            ids = [(n * seq_tokens + i) % 40000 + 100 for i in range(seq_tokens)]
            if not engine.kv.allocate_slots(f"seq{n}", ids, 0, seq_tokens):
                break
            n += 1
        cache = engine.config.cache
        rows.append(
            {
                "kv_dtype": kd,
                "block_bytes": cache.block_bytes,
                "blocks": cache.num_device_blocks,
                "pool_bytes": engine.runner.kv_cache.nbytes,
                "max_seqs": n,
            }
        )
        engine.close()
        del engine
    return rows


def _flag(kd: str) -> str:
    return "auto" if kd == "float32" else kd


# ------------------------------------------------------------------------------------------ decode
def run_decode(model: Any, kv_dtypes: list[str], contexts: list[int], steps: int) -> list[dict[str, Any]]:
    """Median seconds of a single-stream decode step at each context, per dtype, interleaved: every
    round times one step of each dtype, so load on the machine hits them alike."""
    import torch

    from kvtier.models.attention import AttentionMetadata, DecodeGroup
    from kvtier.models.kv_quant import KVFormat, PagedKVCache

    c, bs = model.config, 16
    rows = []
    gen = torch.Generator().manual_seed(0)
    for ctx in contexts:
        nb = -(-(ctx + 1) // bs)
        table = torch.randperm(nb, generator=gen)
        caches = {}
        for kd in kv_dtypes:
            cache = PagedKVCache(
                KVFormat(kd, model.dtype),
                nb,
                (c.num_layers, bs, c.num_kv_heads, c.head_dim),
                torch.device("cpu"),
            )
            pos = torch.arange(ctx)
            kv = torch.randn(ctx, 2, c.num_kv_heads, c.head_dim, generator=gen)
            for layer in range(c.num_layers):  # context K/V written through the slot mapping
                cache.write(layer, kv, table[pos // bs], pos % bs)
            caches[kd] = cache
        times: dict[str, list[float]] = {kd: [] for kd in kv_dtypes}
        pos = torch.tensor([ctx])
        meta = AttentionMetadata(table[pos // bs], pos % bs, DecodeGroup(1, table, nb, ctx + 1, None), [])
        ids = torch.tensor([42])
        for _ in range(steps + 2):
            for kd in kv_dtypes:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    model.compute_logits(model.forward(ids, pos, caches[kd], meta))
                times[kd].append(time.perf_counter() - t0)
        for kd in kv_dtypes:
            rows.append({"kv_dtype": kd, "context": ctx, "step_s": statistics.median(times[kd][2:])})
    return rows


# ------------------------------------------------------------------------------------------ multiturn
def run_multiturn(loaded: Any, kv_dtypes: list[str], ns: argparse.Namespace) -> list[dict[str, Any]]:
    """The ``bench multiturn`` device+host row per KV dtype on the same prompts (float32's answers
    make every history): host-tier load seconds and bytes per returning turn."""
    from kvtier.bench import multiturn as mt

    wl_ns = argparse.Namespace(
        conversations=ns.conversations,
        turns=ns.turns,
        system_tokens=120,
        doc_tokens=ns.doc_tokens,
        user_tokens=40,
        answer_tokens=ns.answer_tokens,
        seed=0,
    )
    work = mt.build_workload(loaded.tokenizer, wl_ns)
    c, bs = loaded.config, 16
    last = work.num_turns - 1
    final_blocks = [
        math.ceil((work.prompt_len(i, last) + work.answer_tokens) / bs) for i in range(work.num_convs)
    ]
    live = sum(final_blocks) - (work.system_tokens // bs) * (work.num_convs - 1)
    device_blocks = max(math.ceil(live * 0.25), max(final_blocks) + 8)
    fp32_block = c.num_layers * bs * 2 * c.num_kv_heads * c.head_dim * 4
    host_gb = max(0.02, live * 1.5 * fp32_block / 2**30)  # every conversation fits, in any dtype
    max_len = max(work.prompt_len(i, last) for i in range(work.num_convs)) + work.answer_tokens + 1
    rows = []
    for kd in kv_dtypes:
        kwargs = {
            "kv_device_blocks": device_blocks,
            "kv_host_gb": host_gb,
            "max_model_len": max_len,
            "num_threads": ns.num_threads,
            "kv_cache_dtype": _flag(kd),
        }
        res, host = _multiturn_row(mt, kd, loaded, work, kwargs)
        returning = [r for r in res.records if r.turn > 1]
        rows.append(
            {
                "kv_dtype": kd,
                "returning_turns": len(returning),
                "host_hit_tokens": res.hits("host"),
                "host_blocks_loaded": host.blocks_loaded,
                "host_bytes_loaded": host.bytes_loaded,
                "host_load_s_per_turn": host.load_seconds / max(1, len(returning)),
                "mean_ttft_returning_s": statistics.fmean(r.ttft_s for r in returning)
                if returning
                else math.nan,
                "answers_equal_float32": sum(1 for r in res.records if r.answer_ok)
                if kd != "float32"
                else None,
            }
        )
    return rows


def _multiturn_row(mt: Any, kd: str, loaded: Any, work: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``multiturn.run_kvtier`` with the host tier's counters kept (it keeps only block counts)."""
    from kvtier.config import EngineArgs
    from kvtier.engine import LLMEngine
    from kvtier.sampling_params import SamplingParams

    print(f"  multiturn {kd} ...", file=sys.stderr, flush=True)
    res = mt.RunResult(kd, "device+host")
    engine = LLMEngine(EngineArgs(dtype="float32", **kwargs), loaded=loaded)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=work.answer_tokens, ignore_eos=True)
        for turn in range(work.num_turns):
            for conv in range(work.num_convs):
                out = mt._run_one(engine, work.prompt(conv, turn), params)
                answer = list(out.outputs[0].token_ids)
                ok = work.answers.setdefault((conv, turn), answer) == answer
                m = out.metrics
                by_tier = {t: int(out.cached_tokens_by_tier.get(t, 0)) for t in mt.TIER_NAMES}
                rec = mt.Record(
                    conv,
                    turn + 1,
                    len(out.prompt_token_ids),
                    out.num_cached_tokens,
                    by_tier,
                    m["first_token_time"] - m["arrival_time"],
                )
                rec.answer_ok = ok
                res.records.append(rec)
        host = engine.stats().tiers["host"]
    finally:
        engine.close()
    return res, host


# ------------------------------------------------------------------------------------------ main
def main(ns: argparse.Namespace) -> int:
    import torch

    from kvtier.models.llama import LlamaModel
    from kvtier.models.loader import load_model

    if ns.num_threads:
        torch.set_num_threads(ns.num_threads)
    ns.doc_tokens, ns.answer_tokens = 400, 16
    if ns.quick:
        ns.quality_tokens, ns.window, ns.contexts, ns.decode_steps = 1024, 512, "512", 4
        ns.conversations, ns.turns, ns.doc_tokens, ns.answer_tokens, ns.pool_gb = 3, 2, 100, 4, 0.1
    kv_dtypes = [d.strip() for d in ns.dtypes.split(",") if d.strip()]
    if not kv_dtypes or kv_dtypes[0] != "float32" or not set(kv_dtypes) <= set(KV_DTYPES):
        raise ValueError(f"--dtypes must start with float32 and name only {', '.join(KV_DTYPES)}")
    skip = {s.strip() for s in ns.skip.split(",") if s.strip()}
    t_all = time.perf_counter()
    loaded = load_model(None)
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, max(8192, ns.window))
    out: dict[str, Any] = {"kv_dtypes": kv_dtypes}
    print(
        f"benchmarks.kvdtype — SmolLM2-135M (float32 compute), KV dtypes {', '.join(kv_dtypes)}; "
        f"{torch.get_num_threads()} threads; side by side in one process",
        flush=True,
    )
    if ns.fp8_study:
        from benchmarks.kvdtype_study import print_study, run_study

        out["fp8_study"] = run_study(model, fixed_text(loaded.tokenizer, 20480), ns.fp8_study)
        print_study(out["fp8_study"])
        skip = {"quality", "capacity", "decode", "multiturn"}
    if "quality" not in skip:
        ids = fixed_text(loaded.tokenizer, ns.quality_tokens)
        q = run_quality(model, ids, kv_dtypes, ns.window, ns.chunk)
        out["quality"] = [_quality_row(r, q["results"]["float32"]) for r in q["results"].values()]
        out["storage_error"] = storage_errors(q["captured"])
        print_quality(out["quality"], out["storage_error"], ns)
    if "capacity" not in skip:
        out["capacity"] = run_capacity(loaded, kv_dtypes, ns.pool_gb, ns.seq_tokens)
        print_capacity(out["capacity"], ns)
    if "decode" not in skip:
        contexts = [int(x) for x in ns.contexts.split(",")]
        out["decode"] = run_decode(model, kv_dtypes, contexts, ns.decode_steps)
        print_decode(out["decode"])
    if "multiturn" not in skip:
        out["multiturn"] = run_multiturn(loaded, kv_dtypes, ns)
        print_multiturn(out["multiturn"])
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s (a shared machine: compare the ratios, one run)")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def _quality_row(r: Quality, ref: Quality) -> dict[str, Any]:
    row = {k: v for k, v in asdict(r).items() if k != "top1"}
    row["ppl"] = r.ppl
    row["ppl_vs_float32"] = r.ppl / ref.ppl - 1
    row["top1_agreement"] = r.agree / r.num_tokens if r.kv_dtype != "float32" else 1.0
    return row


def print_quality(rows: list[dict[str, Any]], errors: list[dict[str, Any]], ns: argparse.Namespace) -> None:
    n = rows[0]["num_tokens"]
    print(
        f"\nquality: {n:,} positions teacher-forced (windows of {ns.window}, chunks of {ns.chunk}); "
        "targets fp8_e4m3/int8: ppl within 1% of float32 KV, top-1 agreement >= 98%"
    )
    print(f"  {'kv dtype':<10} {'perplexity':>10} {'vs fp32':>8} {'top-1 agree':>11}  target")
    for r in rows:
        target = ""
        if r["kv_dtype"] in ("fp8_e4m3", "int8"):
            met = abs(r["ppl_vs_float32"]) <= 0.01 and r["top1_agreement"] >= 0.98
            target = "met" if met else "NOT met"
        print(
            f"  {r['kv_dtype']:<10} {r['ppl']:>10.4f} {r['ppl_vs_float32']:>+8.2%} "
            f"{r['top1_agreement']:>11.2%}  {target}"
        )
    print("\nstorage error of one window's real K/V (relative RMS), by scale granularity and rotation:")
    print(
        f"  {'kv dtype':<9} {'rotated':>7} {'scales per':>14} {'K err':>7} {'V err':>7} {'bytes/value':>11}"
    )
    for e in errors:
        per = "token x head" if e["scales_per"] == "token" else "block x head"
        print(
            f"  {e['kv_dtype']:<9} {e['rotated']!s:>7} {per:>14} {e['K']:>7.2%} {e['V']:>7.2%} "
            f"{e['bytes_per_value']:>11.4f}"
        )


def print_capacity(rows: list[dict[str, Any]], ns: argparse.Namespace) -> None:
    ref = {r["kv_dtype"]: r["max_seqs"] for r in rows}
    print(
        f"\ncapacity: concurrent {ns.seq_tokens:,}-token sequences in a {ns.pool_gb:g} GiB device pool "
        "(allocated live by the block manager)"
    )
    print(
        f"  {'kv dtype':<10} {'block bytes':>11} {'blocks':>7} {'sequences':>9} {'vs fp32':>8} {'vs bf16':>8}"
    )
    for r in rows:
        vs32 = r["max_seqs"] / ref["float32"] if ref.get("float32") else math.nan
        vs16 = r["max_seqs"] / ref["bfloat16"] if ref.get("bfloat16") else math.nan
        print(
            f"  {r['kv_dtype']:<10} {r['block_bytes']:>11,} {r['blocks']:>7,} {r['max_seqs']:>9,} "
            f"{vs32:>7.2f}x {vs16:>7.2f}x"
        )


def print_decode(rows: list[dict[str, Any]]) -> None:
    from kvtier.models import kvkernels

    print("\nsingle-stream decode step (model forward through the paged cache, median; target >= 0.9x fp32):")
    path = "the fused C kernel (kvattn.c)" if kvkernels.kernels() else "the torch path (kernel unavailable)"
    print(f"  fp8/int8 decode attention: {path}")
    print(f"  {'kv dtype':<10} {'context':>7} {'step':>9} {'tokens/s':>8} {'vs fp32':>8}")
    ref = {r["context"]: r["step_s"] for r in rows if r["kv_dtype"] == "float32"}
    for r in rows:
        speed = ref[r["context"]] / r["step_s"]
        print(
            f"  {r['kv_dtype']:<10} {r['context']:>7,} {r['step_s'] * 1e3:>7.1f}ms {1 / r['step_s']:>8.1f} "
            f"{speed:>7.2f}x"
        )


def print_multiturn(rows: list[dict[str, Any]]) -> None:
    print(
        "\nbench multiturn device+host row (device pool = 1/4 of the conversations; target: host load "
        "time per returning turn >= 3x lower than fp32):"
    )
    print(
        f"  {'kv dtype':<10} {'host hits':>9} {'MB loaded':>9} {'load/turn':>10} {'vs fp32':>8} "
        f"{'TTFT ret.':>9} {'same answers':>12}"
    )
    ref = rows[0]["host_load_s_per_turn"]
    for r in rows:
        same = "-" if r["answers_equal_float32"] is None else f"{r['answers_equal_float32']}"
        print(
            f"  {r['kv_dtype']:<10} {r['host_hit_tokens']:>9,} {r['host_bytes_loaded'] / 1e6:>9.1f} "
            f"{r['host_load_s_per_turn'] * 1e3:>8.2f}ms {ref / max(r['host_load_s_per_turn'], 1e-12):>7.2f}x "
            f"{r['mean_ttft_returning_s'] * 1e3:>7.0f}ms {same:>12}"
        )


if __name__ == "__main__":
    sys.exit(run("kvdtype", __doc__, add_args))
