"""``kvtier`` command line: generate · chat · bench.

Engine flags have the names of ``LLM(...)`` keyword arguments (``--kv-device-blocks`` is
``kv_device_blocks``). Bad input ends with one line on stderr and exit status 2, never a traceback
(set ``KVTIER_DEBUG=1`` to get the traceback). Status messages (loading...) go to stderr when it is a
terminal; results go to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
import typing
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from kvtier.config import ConfigError, DType, EngineArgs, PreemptionMode, StorePolicy

if TYPE_CHECKING:
    from kvtier.llm import LLM
    from kvtier.outputs import RequestOutput
    from kvtier.sampling_params import SamplingParams

_ENGINE_HELP = {
    "model": "model path: an HF directory or a .gguf file (default: embedded SmolLM2-135M-Instruct)",
    "dtype": "auto (the model's own precision), float32 (exact), bfloat16 (fast)",
    "block_size": "tokens per KV block (a power of two)",
    "kv_device_blocks": "device KV pool size in blocks",
    "kv_device_gb": "device KV pool size in GiB (default 1)",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step (chunked prefill)",
    "max_model_len": "longest prompt + output",
    "enable_prefix_caching": "reuse cached prompt prefixes",
    "kv_host_gb": "host-memory KV tier in GiB (0: off); evicted blocks are kept there",
    "kv_disk_dir": "disk KV tier directory (needs --kv-host-gb); persists across restarts",
    "kv_disk_gb": "disk KV tier size cap in GiB (default 10)",
    "kv_store_policy": "write_back (store blocks when evicted) or write_through (as soon as full)",
    "kv_remote_secret": "sign blocks below the host tier; refuse forged ones (default $KVTIER_REMOTE_SECRET)",
    "kv_remote_url": "remote KV tier shared by replicas: redis://[:password@]host:6379/0, rediss:// (TLS)",
    "kv_remote_policy": "remote tier: write_through (publish blocks as soon as full, default) or write_back",
    "kv_remote_ttl_s": "expiry of remote blocks in seconds, refreshed by a hit (default 86400; 0: none)",
    "preemption_mode": "auto (cheaper of swap and recompute), swap or recompute",
    "seed": "engine seed (unseeded requests draw from it)",
    "num_threads": "torch CPU threads",
}
_INT_FLAGS = {"block_size", "kv_device_blocks", "max_num_seqs", "max_num_batched_tokens"}
_INT_FLAGS |= {"max_model_len", "seed", "num_threads"}
_FLOAT_FLAGS = {"kv_device_gb", "kv_host_gb", "kv_disk_gb", "kv_remote_ttl_s"}
_CHOICES = {
    "kv_store_policy": typing.get_args(StorePolicy),
    "kv_remote_policy": typing.get_args(StorePolicy),
    "preemption_mode": typing.get_args(PreemptionMode),
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``kvtier: error:`` line (exit status 2), like every bad input."""

    def error(self, message: str) -> NoReturn:
        _fail(f"{message} (see '{self.prog} --help')")


class _LazyParser(_Parser):
    """A subcommand whose arguments are added when it is used (the bench module imports torch)."""

    populate: Callable[[argparse.ArgumentParser], None] | None = None

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self.populate is not None:
            populate, self.populate = self.populate, None
            populate(self)
        return super().parse_known_args(args, namespace)


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def _fail(message: object) -> NoReturn:
    print(f"kvtier: error: {_one_line(message)}", file=sys.stderr, flush=True)
    sys.exit(2)


def _status(message: str) -> None:
    """A progress/status line on stderr, only for a person watching a terminal."""
    if sys.stderr.isatty():
        print(f"kvtier: {message}", file=sys.stderr, flush=True)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine (the keyword arguments of LLM(...))")
    for f in dataclasses.fields(EngineArgs):
        if f.name not in _ENGINE_HELP:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is dataclasses.MISSING else f.default
        help_text = _ENGINE_HELP[f.name]
        if f.name == "enable_prefix_caching":
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif f.name == "dtype":
            g.add_argument(flag, choices=typing.get_args(DType), default=default, help=help_text)
        elif f.name in _CHOICES:
            g.add_argument(flag, choices=_CHOICES[f.name], default=default, help=help_text)
        else:
            kind: Callable[[str], Any] = int if f.name in _INT_FLAGS else str
            kind = float if f.name in _FLOAT_FLAGS else kind
            g.add_argument(flag, type=kind, default=default, help=help_text)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    kwargs = {name: getattr(ns, name) for name in _ENGINE_HELP if hasattr(ns, name)}
    args = EngineArgs(**kwargs)
    args.validate()  # before anything slow: a bad flag value fails at once
    return args


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="0 disables")
    g.add_argument("--min-p", type=float, default=0.0, help="in [0, 1]")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")


def sampling_params_from(ns: argparse.Namespace) -> SamplingParams:
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


def _make_llm(args: EngineArgs) -> LLM:
    t0 = time.monotonic()
    from kvtier.models.loader import resolve_model_path

    resolve_model_path(args.model)  # an unknown path fails now, not after importing torch
    _status(f"loading {args.model or 'the embedded SmolLM2-135M-Instruct'} ...")
    from kvtier.llm import LLM

    kwargs = {k: v for k, v in dataclasses.asdict(args).items() if k not in ("model", "extra")}
    llm = LLM(args.model, progress=sys.stderr.isatty(), **kwargs)
    engine = llm.engine
    _status(
        f"model ready in {time.monotonic() - t0:.1f}s ({engine.device.type}, {engine.dtype}, "
        f"max_model_len {engine.max_model_len})"
    )
    return llm


def _stream(llm: LLM, request: Any, params: SamplingParams) -> tuple[RequestOutput | None, float, float]:
    """Stream one request's text to stdout; ``(final output, seconds to first token, total seconds)``."""
    t0 = time.monotonic()
    first, final, written = None, None, ""
    for out in llm.stream(request, params):
        completion = out.outputs[0]
        if first is None and completion.num_new_tokens:
            first = time.monotonic() - t0
        sys.stdout.write(completion.text_delta)
        sys.stdout.flush()
        written += completion.text_delta
        final = out
    if final is not None and final.outputs[0].text.startswith(written):
        sys.stdout.write(final.outputs[0].text[len(written) :])  # anything the deltas held back
    sys.stdout.write("\n")
    sys.stdout.flush()
    return final, first or 0.0, time.monotonic() - t0


def _stats(final: RequestOutput, first: float, total: float) -> str:
    n = len(final.outputs[0].token_ids)
    return (
        f"{final.num_cached_tokens}/{len(final.prompt_token_ids)} prompt tokens from cache, "
        f"{n} tokens in {total:.2f}s, first token after {first:.2f}s"
    )


# ------------------------------------------------------------------------------- commands
def cmd_generate(ns: argparse.Namespace) -> int:
    params = sampling_params_from(ns)
    args = engine_args_from(ns)
    if ns.prompt is None or ns.prompt == "-":
        if sys.stdin.isatty():
            _status("reading the prompt from stdin (end it with Ctrl-D)")
        prompt = sys.stdin.read()
        prompt = prompt[:-1] if prompt.endswith("\n") else prompt  # `echo prompt |` adds one newline
    else:
        prompt = ns.prompt
    if not prompt.strip():
        raise ConfigError("no prompt: pass it as an argument or on stdin")
    llm = _make_llm(args)
    request: Any = llm.render_chat([{"role": "user", "content": prompt}]) if ns.chat else prompt
    final, first, total = _stream(llm, request, params)
    if final is not None:
        print(f"kvtier: {_stats(final, first, total)}", file=sys.stderr)
    return 0


_CHAT_KEYS = "Ctrl-D or /quit to leave, /reset to clear the history"


def cmd_chat(ns: argparse.Namespace) -> int:
    params = sampling_params_from(ns)
    llm = _make_llm(engine_args_from(ns))
    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - line editing for input()
        print(f"kvtier chat: {_CHAT_KEYS}", file=sys.stderr)
    system = [{"role": "system", "content": ns.system}] if ns.system else []
    history: list[dict[str, str]] = list(system)
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return 0
        if text == "/reset":
            history = list(system)
            print("kvtier: history cleared", file=sys.stderr)
            continue
        if text.startswith("/") and " " not in text:
            print(f"kvtier: unknown command {text} ({_CHAT_KEYS})", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        if interactive:
            sys.stdout.write("assistant> ")
        try:
            final, first, total = _stream(llm, llm.render_chat(history), params)
        except ConfigError as exc:
            history.pop()
            if not interactive:
                raise
            print(f"kvtier: error: {_one_line(exc)} (/reset clears the history)", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # stop this answer, keep the session
            history.pop()
            print("\nkvtier: interrupted", file=sys.stderr)
            continue
        if final is None:
            history.pop()
            continue
        history.append({"role": "assistant", "content": final.outputs[0].text})
        print(f"  [{_stats(final, first, total)}]", file=sys.stderr, flush=True)


def cmd_plan(ns: argparse.Namespace) -> int:
    from kvtier import planner  # pure arithmetic, no torch

    return planner.run(ns)


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    from kvtier.planner import add_args  # stdlib-only module: cheap even when another command runs

    add_args(p)


def cmd_bench(ns: argparse.Namespace) -> int:
    from kvtier.bench import throughput

    return throughput.main(ns)


def _add_throughput_args(b: argparse.ArgumentParser) -> None:
    try:  # generate and chat must keep working whatever the benchmark module does
        from kvtier.bench.throughput import add_args
    except Exception as exc:
        _fail(f"the benchmark is unavailable: {type(exc).__name__}: {exc}")
    else:
        add_args(b)
        b.set_defaults(func=cmd_bench)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from kvtier.server.serve import add_args  # cheap: FastAPI, uvicorn and torch load when it starts

    add_args(p)


def _lazy_args(module: str) -> Callable[[argparse.ArgumentParser], None]:
    """Populate a lazy subcommand from ``module.add_args`` (which sets ``func``), failing in one line."""

    def populate(b: argparse.ArgumentParser) -> None:
        import importlib

        try:
            add_args = importlib.import_module(module).add_args
        except Exception as exc:
            _fail(f"{module} is unavailable: {type(exc).__name__}: {exc}")
        add_args(b)

    return populate


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvtier", description="LLM inference on a tiered, paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text from a prompt (argument or stdin), streamed")
    p.add_argument("prompt", nargs="?", help="the prompt; read from stdin when omitted or '-'")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat; each turn reuses the cached conversation prefix")
    p.add_argument("--system", default=None, help="system message")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1 chat and completions, /metrics)")
    _add_serve_args(p)

    p = sub.add_parser("bench", help="benchmarks (print a table)")
    bsub = p.add_subparsers(dest="bench", required=True, parser_class=_LazyParser)
    b = bsub.add_parser(
        "throughput", help="kvtier vs HF transformers: decode, prefill, mixed, cached, start-up"
    )
    assert isinstance(b, _LazyParser)
    b.populate = _add_throughput_args
    b = bsub.add_parser("serve", help="HTTP load: Poisson arrivals, TTFT/ITL percentiles, server overhead")
    assert isinstance(b, _LazyParser)
    b.populate = _lazy_args("kvtier.bench.serve")
    b = bsub.add_parser("multiturn", help="multi-turn chat TTFT: no caching, device, +host, +disk, restart")
    assert isinstance(b, _LazyParser)
    b.populate = _lazy_args("kvtier.bench.multiturn")
    b = bsub.add_parser(
        "remote", help="two engines sharing one Redis: TTFT, prefill, hits, bandwidth, dead store"
    )
    assert isinstance(b, _LazyParser)
    b.populate = _lazy_args("kvtier.bench.remote")
    b = bsub.add_parser("transfer", help="tier store/load bandwidth vs memcpy; decode with write-back on/off")
    assert isinstance(b, _LazyParser)
    b.populate = _lazy_args("kvtier.bench.transfer")

    p = sub.add_parser("demo", help="demonstrations (print what happens)")
    dsub = p.add_subparsers(dest="demo", required=True, parser_class=_LazyParser)
    b = dsub.add_parser("offload", help="seed 000's offload demo: miss, device, host; disk after a restart")
    assert isinstance(b, _LazyParser)
    b.populate = _lazy_args("kvtier.demo")

    p = sub.add_parser("plan", help="capacity planner: KV pool, concurrency, decode and reload estimates")
    _add_plan_args(p)
    p.set_defaults(func=cmd_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return int(ns.func(ns) or 0)
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kvtier generate ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError) as exc:  # ConfigError is a ValueError; OSError: unreadable files
        if os.environ.get("KVTIER_DEBUG"):
            raise
        print(f"kvtier: error: {_one_line(exc) or type(exc).__name__}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
