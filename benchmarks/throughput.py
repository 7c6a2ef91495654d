"""``python -m benchmarks.throughput``: kvtier and HF transformers side by side in one process.

Rows (each a ratio against its target, measured in this run):

* single-stream decode (ms/token after the first token), and this machine's fp32 decode floor
  (weight bytes read per step / measured memory read bandwidth);
* prefill of a 1,000-token prompt: kvtier fp32 and bf16 vs HF fp32;
* a mixed workload of 64 requests (prompts 20-400, outputs 16-256, seeded, ``ignore_eos``): useful
  tokens/s, HF batched 16 at a time with left padding;
* time to first token of a 1,000-token prompt whose first 900 tokens are cached vs uncached;
* start-up: the second launch of ``kvtier generate`` until its first token appears.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from benchmarks.decode_ab import alternating_rows, per_token_ms, read_gbs
from benchmarks.runner import run
from kvtier.args import add_engine_args


@dataclass
class Row:
    metric: str
    kvtier: float
    baseline: float | None
    unit: str
    ratio: float | None  # >1 means kvtier is better
    target: str
    met: bool | None


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(
        p, ["num_threads"], defaults={"num_threads": 2}, notes={"num_threads": "for HF transformers too"}
    )
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=1000)
    p.add_argument("--mixed-requests", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run, not for reporting)")
    p.add_argument("--skip-hf", action="store_true", help="kvtier rows only")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument(
        "--weight-dtypes",
        default="",
        help="also compare these weight dtypes side by side (e.g. auto,gguf,int8): decode 1 and 16 streams, "
        "bytes read per step; plus llama.cpp on the same GGUF when llama_cpp is importable",
    )
    p.add_argument("--weights-only", action="store_true", help="only the --weight-dtypes rows")
    p.set_defaults(func=main)


def _best(fn: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def read_bandwidth_gbs() -> float:
    """Memory read bandwidth with the current torch threads: sum over a 1 GiB fp32 tensor."""
    x = torch.ones(2**28, dtype=torch.float32)
    x.sum()
    return read_gbs(x, 5)


def weight_bytes_per_decode_step(model) -> int:  # noqa: ANN001 - kvtier.models.llama.LlamaModel
    total = model.lm_head.nbytes
    for layer in model.layers:
        total += sum(lin.nbytes for lin in layer.linears)
        for w in vars(layer).values():  # the norms' weights (every family's: llama 2, Gemma 3 six)
            if isinstance(w, torch.Tensor):
                total += w.numel() * w.element_size()
    return total


def _random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def mixed_workload(n: int, vocab: int, quick: bool) -> list[tuple[list[int], int]]:
    rng = random.Random(1234)
    hi_prompt, hi_out = (120, 48) if quick else (400, 256)
    return [
        (_random_prompt(rng, rng.randint(20, hi_prompt), vocab), rng.randint(16, hi_out)) for _ in range(n)
    ]


# ----------------------------------------------------------------------------------- kvtier
def kvtier_decode_ms(llm, prompt: list[int], n: int) -> float:  # noqa: ANN001
    from kvtier import SamplingParams

    def run(k: int) -> float:
        return _best(
            lambda: llm.generate([prompt], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)), 2
        )

    return (run(n) - run(1)) / (n - 1) * 1e3


def kvtier_prefill_s(llm, vocab: int, n: int) -> float:  # noqa: ANN001
    from kvtier import SamplingParams

    rng = random.Random(7)
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([_random_prompt(rng, 64, vocab)], one)  # warm-up
    # fresh prompts each time so the prefix cache cannot help
    return _best(lambda: llm.generate([_random_prompt(rng, n, vocab)], one), 3)


def kvtier_mixed(llm, work) -> tuple[float, int]:  # noqa: ANN001
    from kvtier import SamplingParams

    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=m, ignore_eos=True)
        for i, (_, m) in enumerate(work)
    ]
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    dt = time.perf_counter() - t
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def kvtier_cached_ttft(llm, vocab: int, n: int) -> tuple[float, float]:  # noqa: ANN001
    """TTFT of an n-token prompt: uncached, and with its first 90% cached by an earlier request."""
    from kvtier import SamplingParams

    rng = random.Random(11)
    one = SamplingParams(temperature=0, max_tokens=1)
    uncached = _best(lambda: llm.generate([_random_prompt(rng, n, vocab)], one), 2)
    shared = _random_prompt(rng, int(n * 0.9), vocab)
    llm.generate([shared + _random_prompt(rng, n - len(shared), vocab)], one)
    cached = _best(lambda: llm.generate([shared + _random_prompt(rng, n - len(shared), vocab)], one), 3)
    return uncached, cached


def startup_first_token_s(threads: int, *extra: str) -> float:
    """Seconds from launching ``kvtier generate`` (+ ``extra`` flags) until its first output byte (second
    launch)."""
    cmd = [
        sys.executable,
        "-m",
        "kvtier.cli",
        "generate",
        "Hello",
        "--max-tokens",
        "4",
        "--num-threads",
        str(threads),
        *extra,
    ]
    subprocess.run(cmd, capture_output=True, check=True)  # first launch: converts the model if needed
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    proc.stdout.read(1)
    first = time.perf_counter() - t
    proc.wait()
    return first


def batched_decode_tok_s(llm, vocab: int, streams: int, n: int) -> float:  # noqa: ANN001
    """Decode tokens/s of ``streams`` sequences generating together (prefill time subtracted)."""
    from kvtier import SamplingParams

    rng = random.Random(5)
    prompts = [_random_prompt(rng, 32, vocab) for _ in range(streams)]

    def run(k: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
        return _best(lambda: llm.generate(prompts, params), 2)

    return streams * (n - 1) / (run(n) - run(1))


def linears_pass_ms(model, repeat: int = 7) -> float:  # noqa: ANN001 - kvtier.models.llama.LlamaModel
    """Best-of-``repeat`` ms for one token through every linear layer (the weight reads of a decode step,
    without attention and the small ops): robust to a busy machine, where whole steps are not."""
    c = model.config
    x = torch.randn(1, c.hidden_size)
    inter = torch.randn(1, c.intermediate_size)
    attn = torch.randn(1, c.num_heads * c.head_dim)

    def one_pass() -> None:
        for layer in model.layers:
            layer.qkv(x)
            layer.o.residual(x.clone(), attn)
            layer.gate_up(x)
            layer.down.residual(x.clone(), inter)
        model.lm_head(x)

    one_pass()
    return _best(one_pass, repeat) * 1e3


def fused_vs_torch_step_ms(llm, prompt: list[int], n: int, repeat: int = 6) -> tuple[float, float]:  # noqa: ANN001
    """Decode forward+logits ms (min over ``repeat`` x ``n`` steps) through the C path (fused ops, RoPE +
    cache write, the decode attention kernel, the chosen GEMVs) and through torch's ops, SDPA and MKL
    only, alternating in the same engine (robust to a busy machine: both see the same load)."""
    from kvtier import SamplingParams
    from kvtier.models.qlinear import DenseLinear

    model, runner = llm.engine.model, llm.engine.runner
    dense = [lin for layer in model.layers for lin in layer.linears] + [model.lm_head]
    dense = [lin for lin in dense if isinstance(lin, DenseLinear)]
    chosen, fused, execute = [lin.gemv for lin in dense], model.ops, runner.execute
    steps: dict[bool, list[float]] = {True: [], False: []}
    new = [True]

    def timed(out):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        logits = execute(out)
        if len(out.decodes) == 1 and not out.prefills:
            steps[new[0]].append(time.perf_counter() - t)
        return logits

    runner.execute = timed
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    try:
        for _ in range(repeat):
            for variant in (True, False):
                new[0] = variant
                model.ops = fused if variant else model.torch_ops
                for lin, gemv in zip(dense, chosen, strict=True):
                    lin.gemv = gemv if variant else None
                llm.generate([prompt], params)
    finally:
        runner.execute, model.ops = execute, fused
        for lin, gemv in zip(dense, chosen, strict=True):
            lin.gemv = gemv
    return min(steps[True]) * 1e3, min(steps[False]) * 1e3


def llama_cpp_decode_ms(prompt: list[int], n: int, threads: int) -> float | None:
    """llama.cpp's single-stream decode ms/token on the default GGUF (None when llama_cpp is missing)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from kvtier.models.loader import default_model_path

    model = Llama(str(default_model_path()), n_threads=threads, n_ctx=512, verbose=False)

    def run(k: int) -> float:
        def once() -> None:
            model.reset()
            for i, _ in enumerate(model.generate(prompt, temp=0.0)):
                if i + 1 >= k:
                    break

        return _best(once, 2)

    return (run(n) - run(1)) / (n - 1) * 1e3


def weight_dtype_rows(ns: argparse.Namespace, row: Callable[..., None], rows: list[Row]) -> None:
    """Decode side by side for each ``--weight-dtypes`` mode, ratios against ``auto`` from this run."""
    from kvtier import LLM

    modes = [m.strip() for m in ns.weight_dtypes.split(",") if m.strip()]
    bw = read_bandwidth_gbs()
    base: dict[str, float] = {}  # the first mode's figures: "ms", "lin_ms", "tok_s"
    per_mode: dict[str, float] = {}  # mode -> decode ms/token
    prompt: list[int] = []
    for mode in modes:
        prompt, per_mode[mode] = _one_mode_rows(ns, mode, modes[0] == "auto", bw, base, row)
        start = startup_first_token_s(ns.num_threads, "--weight-dtype", mode)
        row(f"  {mode}: start-up to first token (2nd launch)", start, None, "s", False, None, "<= 3 s")
        rows[-1].met = start <= 3.0
    llms = {m: LLM(dtype="float32", num_threads=ns.num_threads, weight_dtype=m) for m in modes}
    alternating_rows(llms, prompt, ns.decode_tokens, weight_bytes_per_decode_step, row)
    del llms
    _llama_cpp_rows(ns, prompt, base["ms"], per_mode, row)


def _one_mode_rows(
    ns: argparse.Namespace,
    mode: str,
    auto_first: bool,
    bw: float,
    base: dict[str, float],
    row: Callable[..., None],
) -> tuple[list[int], float]:
    """One weight dtype's rows (decode, its floor at ``bw`` GB/s, the linears alone, C vs torch path,
    16 streams), against ``base`` (set by the first mode); (the prompt, its decode ms/token)."""
    from kvtier import LLM

    llm = LLM(dtype="float32", num_threads=ns.num_threads, weight_dtype=mode)
    vocab = llm.engine.model_config.vocab_size
    prompt = llm.tokenizer.encode("Once upon a time, in a small village by the sea, there lived")
    ms = kvtier_decode_ms(llm, prompt, ns.decode_tokens)
    nbytes = weight_bytes_per_decode_step(llm.engine.model)
    base.setdefault("ms", ms)
    target = 2.5 if mode == "gguf" and auto_first else None
    text = ">= 2.5x auto" if target else "vs auto"
    row(f"decode 1 stream, weights {mode}", ms, base["ms"], "ms/token", False, target, text)
    floor = nbytes / (bw * 1e9) * 1e3
    name = f"  {mode}: {nbytes / 1e6:.0f} MB/step, {nbytes / ms / 1e6:.1f} GB/s"
    row(name, ms, floor, "ms/token", False, 0.85 if mode == "auto" else None, f"floor at {bw:.1f} GB/s read")
    lin_ms = linears_pass_ms(llm.engine.model)
    base.setdefault("lin_ms", lin_ms)
    name = f"  {mode}: all linears, 1 token, best of 7 ({nbytes / lin_ms / 1e6:.1f} GB/s)"
    row(name, lin_ms, base["lin_ms"], "ms", False, None, "vs auto")
    fused_ms, torch_ms = fused_vs_torch_step_ms(llm, prompt, ns.decode_tokens)
    name = f"  {mode}: decode step, C path vs torch path (same engine, min)"
    row(name, fused_ms, torch_ms, "ms", False, None, "vs torch ops, SDPA, MKL")
    tok_s = batched_decode_tok_s(llm, vocab, 16, ns.decode_tokens)
    base.setdefault("tok_s", tok_s)
    row(f"decode 16 streams, weights {mode}", tok_s, base["tok_s"], "tok/s", True, None, "vs auto")
    return prompt, ms


def _llama_cpp_rows(
    ns: argparse.Namespace,
    prompt: list[int],
    auto_ms: float,
    per_mode: dict[str, float],
    row: Callable[..., None],
) -> None:
    """llama.cpp on the same GGUF against the first mode (``auto_ms``) and, token by token, ``gguf``."""
    ms = llama_cpp_decode_ms(prompt, ns.decode_tokens, ns.num_threads)
    if ms is None:
        print("  llama.cpp row skipped: llama_cpp is not importable", file=sys.stderr, flush=True)
        return
    row("decode 1 stream, llama.cpp (same GGUF, threads)", ms, auto_ms, "ms/token", False, None, "vs auto")
    if "gguf" not in per_mode:
        return
    gguf = per_mode["gguf"]
    row("decode 1 stream, gguf vs llama.cpp", gguf, ms, "ms/token", False, 1.0, ">= 1.0x llama.cpp")
    (ours, theirs), (ours_p50, theirs_p50) = per_token_ms("gguf", prompt, ns.decode_tokens, ns.num_threads)
    text = ">= 1.0x llama.cpp (min per token, alternating)"
    row("decode 1 token, gguf vs llama.cpp (min)", ours, theirs, "ms/token", False, 1.0, text)
    text = ">= 1.0x llama.cpp (median token, alternating)"
    row("decode 1 token, gguf vs llama.cpp (median)", ours_p50, theirs_p50, "ms/token", False, 1.0, text)


# --------------------------------------------------------------------------------------- HF
def load_hf(threads: int):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    from kvtier.models.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    torch.set_num_threads(threads)
    return model


def hf_generate(model, prompts: list[list[int]], max_new: int, **kw) -> torch.Tensor:  # noqa: ANN001
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=2, **kw)


def hf_decode_ms(model, prompt: list[int], n: int) -> float:  # noqa: ANN001
    def run(k: int) -> float:
        return _best(lambda: hf_generate(model, [prompt], k, do_sample=False), 2)

    return (run(n) - run(1)) / (n - 1) * 1e3


def hf_prefill_s(model, vocab: int, n: int) -> float:  # noqa: ANN001
    rng = random.Random(7)
    ids = torch.tensor([_random_prompt(rng, n, vocab)])
    with torch.no_grad():
        model(ids[:, :64])
        return _best(lambda: model(ids, logits_to_keep=1), 3)


def hf_mixed(model, work) -> tuple[float, int]:  # noqa: ANN001
    t = time.perf_counter()
    useful = 0
    for i in range(0, len(work), 16):
        batch = work[i : i + 16]
        hf_generate(
            model,
            [p for p, _ in batch],
            max(m for _, m in batch),
            do_sample=True,
            temperature=0.8,
            top_p=0.95,
        )
        useful += sum(m for _, m in batch)  # tokens past a request's own max_tokens are waste
    return time.perf_counter() - t, useful


# ------------------------------------------------------------------------------------ main
def add_row(
    rows: list[Row],
    metric: str,
    ours: float,
    base: float | None,
    unit: str,
    higher_better: bool,
    target: float | None,
    target_text: str,
) -> None:
    """Append a ``Row`` (its ratio: >1 when kvtier is better; met when the ratio reaches ``target``)
    and print it on stderr as it comes."""
    ratio = None
    if base is not None:
        ratio = ours / base if higher_better else base / ours
    met = None if ratio is None or target is None else ratio >= target
    rows.append(
        Row(
            metric,
            round(ours, 4),
            None if base is None else round(base, 4),
            unit,
            None if ratio is None else round(ratio, 3),
            target_text,
            met,
        )
    )
    print(
        f"  {metric}: kvtier {ours:.4g} {unit}"
        + ("" if base is None else f", baseline {base:.4g}, ratio {ratio:.2f}"),
        file=sys.stderr,
        flush=True,
    )


def main(ns: argparse.Namespace) -> int:
    from kvtier import LLM

    if ns.quick:
        ns.decode_tokens, ns.prefill_tokens, ns.mixed_requests = 16, 300, 8
    torch.set_num_threads(ns.num_threads)
    rows: list[Row] = []
    row = functools.partial(add_row, rows)
    if ns.weight_dtypes:
        weight_dtype_rows(ns, row, rows)
    if ns.weights_only:
        print_table(rows, ns)
        return 0
    vocab, hf_prefill = fp32_rows(ns, row)
    llm_bf16 = LLM(dtype="bfloat16", num_threads=ns.num_threads)
    ours = kvtier_prefill_s(llm_bf16, vocab, ns.prefill_tokens)
    row(f"prefill {ns.prefill_tokens} tokens, bf16", ours, hf_prefill, "s", False, 2.5, ">= 2.5x HF fp32")
    del llm_bf16
    start = startup_first_token_s(ns.num_threads)
    row("start-up to first token (2nd launch)", start, None, "s", False, None, "<= 3 s")
    rows[-1].met = rows[-1].kvtier <= 3.0
    print_table(rows, ns)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 0


def fp32_rows(ns: argparse.Namespace, row: Callable[..., None]) -> tuple[int, float | None]:
    """The float32 engine's rows against HF (unless ``--skip-hf``): decode and its floor, prefill,
    cached TTFT, the mixed workload; (the vocabulary size, HF's prefill seconds or None)."""
    from kvtier import LLM

    print("loading kvtier (float32) ...", file=sys.stderr, flush=True)
    llm = LLM(dtype="float32", num_threads=ns.num_threads)
    vocab = llm.engine.model_config.vocab_size
    hf = None if ns.skip_hf else load_hf(ns.num_threads)
    prompt = llm.tokenizer.encode("Once upon a time, in a small village by the sea, there lived")

    ours = kvtier_decode_ms(llm, prompt, ns.decode_tokens)
    base = None if hf is None else hf_decode_ms(hf, prompt, ns.decode_tokens)
    row("decode, 1 stream", ours, base, "ms/token", False, 1.5, ">= 1.5x HF")
    bw = read_bandwidth_gbs()
    floor_ms = weight_bytes_per_decode_step(llm.engine.model) / (bw * 1e9) * 1e3
    text = f">= 85% of floor ({bw:.1f} GB/s read)"
    row("decode vs fp32 floor", ours, floor_ms, "ms/token", False, 0.85, text)

    ours = kvtier_prefill_s(llm, vocab, ns.prefill_tokens)
    hf_prefill = None if hf is None else hf_prefill_s(hf, vocab, ns.prefill_tokens)
    row(f"prefill {ns.prefill_tokens} tokens, fp32", ours, hf_prefill, "s", False, 1.2, ">= 1.2x HF fp32")

    uncached, cached = kvtier_cached_ttft(llm, vocab, ns.prefill_tokens)
    name = f"TTFT {ns.prefill_tokens} tokens, 90% cached vs uncached"
    row(name, cached, uncached, "s", False, 5.0, ">= 5x faster than uncached")

    work = mixed_workload(ns.mixed_requests, vocab, ns.quick)
    dt, useful = kvtier_mixed(llm, work)
    base = None
    if hf is not None:
        hf_dt, hf_useful = hf_mixed(hf, work)
        base = hf_useful / hf_dt
    row(
        f"mixed {ns.mixed_requests} requests",
        useful / dt,
        base,
        "useful tok/s",
        True,
        2.0,
        ">= 2x HF (batch 16)",
    )
    return vocab, hf_prefill


def print_table(rows: list[Row], ns: argparse.Namespace) -> None:
    print(
        f"\nbenchmarks.throughput — SmolLM2-135M-Instruct, {ns.num_threads} threads, "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs"
    )
    print(
        f"| {'metric':<42} | {'kvtier':>10} | {'baseline':>10} | {'unit':<13} | {'ratio':>6} | "
        f"{'target':<34} | met |"
    )
    print(f"|{'-' * 44}|{'-' * 12}|{'-' * 12}|{'-' * 15}|{'-' * 8}|{'-' * 36}|-----|")
    for r in rows:
        base = "" if r.baseline is None else f"{r.baseline:.4g}"
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
        met = {True: "yes", False: "NO", None: ""}[r.met]
        print(
            f"| {r.metric:<42} | {r.kvtier:>10.4g} | {base:>10} | {r.unit:<13} | {ratio:>6} "
            f"| {r.target:<34} | {met:<3} |"
        )


if __name__ == "__main__":
    sys.exit(run("throughput", __doc__, add_args))
