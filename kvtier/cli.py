"""``kvtier`` command line: generate · chat · serve · router · bench · demo · plan · score · cache.

Engine flags have the names of ``LLM(...)`` keyword arguments (``--kv-device-blocks`` is
``kv_device_blocks``); :mod:`kvtier.args` makes them from ``EngineArgs``. ``generate`` and ``chat`` live
here; every other subcommand is added when it is parsed, from its own module's ``add_args`` (so
``kvtier --help`` imports neither torch nor FastAPI). Bad input ends with one line on stderr and exit
status 2, never a traceback (set ``KVTIER_DEBUG=1`` to get the traceback). Status messages (loading...)
go to stderr when it is a terminal; results go to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from kvtier.args import add_engine_args, engine_args_from, engine_kwargs
from kvtier.config import ConfigError, EngineArgs

if TYPE_CHECKING:
    from kvtier.llm import LLM
    from kvtier.outputs import RequestOutput
    from kvtier.sampling_params import SamplingParams


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``kvtier: error:`` line (exit status 2), like every bad input.

    A subcommand whose code lives in another module has ``populate`` set (see :func:`_lazy`): its
    arguments are added, and its module imported, only when that subcommand is parsed.
    """

    populate: Callable[[argparse.ArgumentParser], None] | None = None

    def error(self, message: str) -> NoReturn:
        _fail(f"{message} (see '{self.prog} --help')")

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


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="0 disables")
    g.add_argument("--min-p", type=float, default=0.0, help="in [0, 1]")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]: against any repeat")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]: per repeat")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; 1 disables (HF's)")
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
        presence_penalty=ns.presence_penalty,
        frequency_penalty=ns.frequency_penalty,
        repetition_penalty=ns.repetition_penalty,
    )


def _make_llm(args: EngineArgs) -> LLM:
    t0 = time.monotonic()
    from kvtier.models.loader import resolve_model_path

    resolve_model_path(args.model)  # an unknown path fails now, not after importing torch
    _status(f"loading {args.model or 'the embedded SmolLM2-135M-Instruct'} ...")
    from kvtier.llm import LLM

    llm = LLM(args.model, progress=sys.stderr.isatty(), **engine_kwargs(args))
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


_BENCHMARKS = {  # kvtier bench NAME runs kvtier.bench.NAME: a user's own deployment, measured
    "serve": "HTTP load: Poisson arrivals, TTFT/ITL percentiles, server overhead",
    "multiturn": "multi-turn chat TTFT: no caching, device, +host, +disk, restart",
    "transfer": "tier store/load bandwidth vs memcpy; decode with write-back on/off",
    "remote": "two engines sharing one Redis: returning-turn TTFT, prefill saved, Redis bandwidth",
    "cluster": "replicas behind kvtier router: round-robin vs cache-aware, Redis/replica failures",
    "disagg": "the same cores as two colocated replicas vs one prefill + one decode: ITL, TTFT, tok/s",
    "advice": "miss-ratio curves vs a replay on real tiers of 1/4..2x size; --canary-cost: canary overhead",
    "agent": "agents in tool loops under unrelated pressure: step TTFT with and without retention",
    "gpu": "on a lent GPU: exactness vs transformers, kernels, transfer GB/s, TTFT, decode, overlap",
}
# Studies, A/B harnesses and peer comparisons: not in the package; a kvtier checkout runs them from its
# benchmarks/ directory. The first three were `kvtier bench NAME` once: that now says where they are.
_CHECKOUT_BENCHMARKS = {
    "python -m benchmarks.throughput": "kvtier vs HF transformers: decode, prefill, mixed, cached, start-up",
    "python -m benchmarks.decode": "one-stream decode of any model (--model) vs HF transformers, fp32 floor",
    "python -m benchmarks.kvdtype": "KV cache dtypes side by side: perplexity, agreement, capacity, speed",
    "python -m benchmarks.kernels": "this checkout's gguf weight kernel vs a git revision's",
    "python benchmarks/overload.py": "goodput under overload, driven by guidellm (make bench-overload)",
}
_MOVED_BENCHMARKS = ("throughput", "kvdtype", "kernels")


def _add_bench_parser(sub: Any) -> None:
    """``kvtier bench``: the installed benchmarks as subcommands; the help's epilog lists the ones in a
    checkout, and a moved one's old name answers with the command that runs it there."""
    width = max(map(len, _CHECKOUT_BENCHMARKS))
    epilog = "not installed: studies, A/B harnesses, peer comparisons, run from a kvtier checkout's root:\n"
    epilog += "\n".join(f"  {cmd:<{width}}  {text}" for cmd, text in _CHECKOUT_BENCHMARKS.items())
    bench = sub.add_parser(
        "bench",
        help="benchmarks of a deployment (print a table); studies live in a checkout's benchmarks/",
        description="Benchmarks installed with kvtier: they measure your own deployment.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    names = bench.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(_BENCHMARKS) + "}")
    for name, bench_help in _BENCHMARKS.items():
        _lazy(names, name, f"kvtier.bench.{name}", bench_help, unavailable="the benchmark")
    for name in _MOVED_BENCHMARKS:
        message = (
            f"kvtier bench {name} is not in the installed package: it moved to benchmarks/{name}.py "
            f"in a kvtier checkout; run it there as 'python -m benchmarks.{name}'"
        )
        names.add_parser(name).populate = lambda _p, message=message: _fail(message)  # no help: unlisted


def _lazy(sub: Any, name: str, module: str, help_text: str, unavailable: str | None = None) -> None:
    """Subcommand ``name`` of ``sub``, run by ``module``: its ``add_args(parser)`` adds the arguments and
    sets ``func``, when the subcommand is parsed. An import failure is one error line (``unavailable``,
    else the module's name, "is unavailable: ..."), so the other commands work whatever it imports."""

    def populate(p: argparse.ArgumentParser) -> None:
        try:
            add_args = importlib.import_module(module).add_args
        except Exception as exc:
            _fail(f"{unavailable or module} is unavailable: {type(exc).__name__}: {exc}")
        add_args(p)

    parser = sub.add_parser(name, help=help_text)
    parser.populate = populate


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

    serve_help = "OpenAI-compatible HTTP server (/v1 chat and completions, /metrics)"
    _lazy(sub, "serve", "kvtier.server.serve", serve_help)
    router_help = "cache-aware router in front of several 'kvtier serve' replicas (same OpenAI API)"
    _lazy(sub, "router", "kvtier.router.cli", router_help)

    _add_bench_parser(sub)

    demo = sub.add_parser("demo", help="demonstrations (print what happens)").add_subparsers(
        dest="demo", required=True
    )
    demo_help = "the tiered KV cache at work: a miss, device and host hits; disk hits after a restart"
    _lazy(demo, "offload", "kvtier.demo", demo_help)

    plan_help = "capacity planner: KV pool, concurrency, decode and reload estimates"
    _lazy(sub, "plan", "kvtier.planner", plan_help)
    score_help = "perplexity of a text and its most surprising tokens (prompt logprobs, in windows)"
    _lazy(sub, "score", "kvtier.score", score_help)
    cache_help = "what the model cache holds on disk (conversions, packed and fused weights); --clear"
    _lazy(sub, "cache", "kvtier.models.cache_admin", cache_help)
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
