"""``kvtier score``: how likely the model finds a text — its perplexity and its most surprising tokens.

::

    kvtier score "The cache remembers what was computed."
    kvtier score --file notes.txt --top 10 --kv-cache-dtype fp8_e4m3 --weight-dtype gguf

The text is tokenized as a plain prompt (no chat template) and cut into windows of ``--window`` tokens
(default: the model's context, at most 2,048). Each window is one request with ``prompt_logprobs``, so
every token is scored given the window's tokens before it; a window's first token has no context and
is not scored. The windows run as one batch. Engine flags are ``kvtier generate``'s: comparing
``--kv-cache-dtype`` or ``--weight-dtype`` settings on the same text shows what they cost in quality.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from kvtier.args import add_engine_args, engine_args_from, engine_kwargs
from kvtier.config import ConfigError

DEFAULT_WINDOW = 2048


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("text", nargs="?", help="the text; read from --file or stdin when omitted or '-'")
    p.add_argument("--file", default=None, help="read the text from this file")
    p.add_argument("--window", type=int, default=None, help="tokens per window (default: context, <= 2048)")
    p.add_argument("--top", type=int, default=5, help="how many of the most surprising tokens to list")
    add_engine_args(p)
    p.set_defaults(func=main)


def _text(ns: argparse.Namespace) -> str:
    if ns.file is not None and ns.text not in (None, "-"):
        raise ConfigError("pass the text either as an argument or with --file, not both")
    if ns.file is not None:
        try:
            return Path(ns.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read {ns.file}: {exc}") from None
    if ns.text is None or ns.text == "-":
        return sys.stdin.read()
    return str(ns.text)


def windows(token_ids: list[int], size: int) -> list[list[int]]:
    """Consecutive windows of ``size`` tokens; a last window of one token (nothing to score) is dropped."""
    cut = [token_ids[i : i + size] for i in range(0, len(token_ids), size)]
    return [w for w in cut if len(w) >= 2]


def main(ns: argparse.Namespace) -> int:
    from kvtier.llm import LLM
    from kvtier.models.loader import resolve_model_path
    from kvtier.sampling_params import SamplingParams

    text = _text(ns)
    if not text.strip():
        raise ConfigError("no text to score: pass it as an argument, with --file or on stdin")
    if ns.top < 0:
        raise ConfigError(f"--top must be >= 0, got {ns.top}")
    args = engine_args_from(ns)
    resolve_model_path(args.model)  # an unknown path fails now, not after loading torch
    llm = LLM(args.model, **engine_kwargs(args))
    size = ns.window if ns.window is not None else min(llm.engine.max_model_len - 1, DEFAULT_WINDOW)
    if not 2 <= size < llm.engine.max_model_len:
        raise ConfigError(f"--window must be in [2, {llm.engine.max_model_len - 1}], got {size}")
    token_ids = llm.tokenizer.encode(text)
    parts = windows(token_ids, size)
    if not parts:
        raise ConfigError("the text is a single token: nothing to score")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in parts], params)
    scored = []  # (position in the text, token id, logprob)
    for k, out in enumerate(outs):
        assert out.prompt_logprobs is not None
        for j, entry in enumerate(out.prompt_logprobs[1:], start=1):
            assert entry is not None
            scored.append((k * size + j, entry.token_id, entry.logprob))
    mean = sum(lp for _, _, lp in scored) / len(scored)
    print(
        f"kvtier score: {len(token_ids):,} tokens in {len(parts)} window(s) of up to {size:,}, "
        f"{len(scored):,} scored: perplexity {math.exp(-mean):.4f} (mean logprob {mean:.4f})"
    )
    if ns.top:
        print(f"  the {min(ns.top, len(scored))} most surprising tokens:")
        print(f"  {'position':>9}  {'logprob':>9}  token")
        for pos, token, lp in sorted(scored, key=lambda s: s[2])[: ns.top]:
            print(f"  {pos:>9,}  {lp:>9.3f}  {llm.tokenizer.decode([token], skip_special_tokens=False)!r}")
    return 0
