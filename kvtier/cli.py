"""``kvtier`` command line: generate · chat · bench.

Engine flags have the names of ``LLM(...)`` keyword arguments (``--kv-device-blocks`` is
``kv_device_blocks``). Bad input ends with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.config import ConfigError, EngineArgs

_ENGINE_HELP = {
    "model": "model path: an HF directory or a .gguf file (default: embedded SmolLM2-135M-Instruct)",
    "dtype": "auto (the model's own precision), float32 (exact), bfloat16 (fast)",
    "block_size": "tokens per KV block",
    "kv_device_blocks": "device KV pool size in blocks",
    "kv_device_gb": "device KV pool size in GiB (default 1)",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step (chunked prefill)",
    "max_model_len": "longest prompt + output",
    "enable_prefix_caching": "reuse cached prompt prefixes",
    "seed": "engine seed (unseeded requests draw from it)",
    "num_threads": "torch CPU threads",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name not in _ENGINE_HELP:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is dataclasses.MISSING else f.default
        if f.name == "enable_prefix_caching":
            g.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=True, help=_ENGINE_HELP[f.name]
            )
            continue
        kind: Callable[[str], Any] = str
        if f.name in (
            "block_size",
            "kv_device_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "seed",
            "num_threads",
        ):
            kind = int
        elif f.name == "kv_device_gb":
            kind = float
        g.add_argument(flag, type=kind, default=default, help=_ENGINE_HELP[f.name])


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    kwargs = {name: getattr(ns, name) for name in _ENGINE_HELP if hasattr(ns, name)}
    return EngineArgs(**kwargs)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from(ns: argparse.Namespace):  # noqa: ANN201
    from kvtier.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        seed=ns.sampling_seed,
        stop=ns.stop,
        ignore_eos=ns.ignore_eos,
    )


def _make_llm(ns: argparse.Namespace):  # noqa: ANN202
    from kvtier.llm import LLM

    args = engine_args_from(ns)
    print("kvtier: loading model ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    kwargs = {k: v for k, v in dataclasses.asdict(args).items() if k not in ("model", "extra")}
    llm = LLM(args.model, progress=True, **kwargs)
    print(f"kvtier: model ready in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
    return llm


# ------------------------------------------------------------------------------- commands
def cmd_generate(ns: argparse.Namespace) -> int:
    prompt = ns.prompt if ns.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ConfigError("no prompt: pass it as an argument or on stdin")
    params = sampling_params_from(ns)
    llm = _make_llm(ns)
    request: Any = llm.render_chat([{"role": "user", "content": prompt}]) if ns.chat else prompt
    t0 = time.monotonic()
    first = None
    final = None
    for out in llm.stream(request, params):
        if first is None and out.outputs[0].num_new_tokens:
            first = time.monotonic() - t0
        sys.stdout.write(out.outputs[0].text_delta)
        sys.stdout.flush()
        final = out
    sys.stdout.write("\n")
    if final is not None:
        n = len(final.outputs[0].token_ids)
        dt = time.monotonic() - t0
        print(
            f"kvtier: {n} tokens in {dt:.2f}s, first token after {first or 0:.2f}s, "
            f"{final.num_cached_tokens}/{len(final.prompt_token_ids)} prompt tokens from cache",
            file=sys.stderr,
        )
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    params = sampling_params_from(ns)
    llm = _make_llm(ns)
    history: list[dict[str, str]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    print("kvtier chat — empty line or Ctrl-D to quit, /reset to clear the history", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            history = history[:1] if ns.system else []
            continue
        history.append({"role": "user", "content": line})
        t0 = time.monotonic()
        reply, final, first = "", None, None
        sys.stdout.write("assistant> ")
        for out in llm.stream(llm.render_chat(history), params):
            if first is None and out.outputs[0].num_new_tokens:
                first = time.monotonic() - t0
            sys.stdout.write(out.outputs[0].text_delta)
            sys.stdout.flush()
            reply = out.outputs[0].text
            final = out
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": reply})
        if final is not None:
            print(
                f"  [{final.num_cached_tokens}/{len(final.prompt_token_ids)} prompt tokens from cache, "
                f"first token {first or 0:.2f}s]",
                file=sys.stderr,
            )
    return 0


def cmd_bench(ns: argparse.Namespace) -> int:
    from kvtier.bench import throughput

    return throughput.main(ns)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="LLM inference on a tiered, paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text from a prompt (argument or stdin), streamed")
    p.add_argument("prompt", nargs="?", help="the prompt; read from stdin when omitted")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat; each turn reuses the cached conversation prefix")
    p.add_argument("--system", default=None, help="system message")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="benchmarks (print a table)")
    bsub = p.add_subparsers(dest="bench", required=True)
    from kvtier.bench.throughput import add_args as add_throughput_args

    b = bsub.add_parser(
        "throughput", help="kvtier vs HF transformers: decode, prefill, mixed, cached, start-up"
    )
    add_throughput_args(b)
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return int(ns.func(ns) or 0)
    except ConfigError as e:
        print(f"kvtier: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
