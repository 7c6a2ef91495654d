"""The reference for kvtier's Gemma 3: transformers running the packaged Gemma 3 270M GGUF at fp32.

    python -m benchmarks.gemma3_reference [--tokens 16] [--threads 2] [--kvtier]

Before kvtier's output is compared with transformers' token for token, this checks that transformers'
own load of the same file is a sane model: the GGUF joined from its packages (sha256 checked), loaded
with ``gguf_file=`` as ``Gemma3ForCausalLM``; its perplexity on an English paragraph (a base 270M model
should be well under 50) and on the first 700 tokens of the Apache-2.0 text when ``benchmarks/data``
has it; a greedy continuation. ``--kvtier`` adds kvtier's perplexity from prompt logprobs on the same
ids (needs the Gemma 3 model class). When llama.cpp's Python binding (``llama_cpp``) is installed, the
last position's logits are compared with llama.cpp's too; otherwise that line says it was skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

# Plain English prose (written for this check): 245 Gemma tokens with BOS.
PARAGRAPH = (
    "The printing press changed how ideas travelled across Europe. Before it, a book was copied by hand, "
    "and a single copy of a long work could take a scribe many months to finish. Mistakes crept in with "
    "every copy, and only monasteries, universities and wealthy families could afford to keep a library. "
    "When movable type arrived in the middle of the fifteenth century, a workshop could produce hundreds of "
    "identical pages in a day. Prices fell, and within fifty years millions of books were in circulation. "
    "Scholars in different cities could now read the same text, point to the same page, and argue about "
    "the same words. Pamphlets spread news and opinions faster than any messenger on horseback, which "
    "worried rulers who had grown used to controlling what their subjects heard. Printers learned to "
    "standardize spelling and punctuation, because a consistent style made their work easier to set and "
    "easier to sell. Over time, more people learned to read, schools grew, and the written word became "
    "part of ordinary life rather than a privilege of the few. Historians still debate how much of the "
    "scientific revolution and the religious reforms of the following century can be traced back to this "
    "one invention, but few doubt that the world after the press was very different from the world before."
)
PROMPT = "The capital of France is"
APACHE = Path(__file__).resolve().parent / "data" / "Apache-2.0.txt"
MODEL = "gemma-3-270m"


def load_reference(path: Path) -> tuple[Any, Any]:
    """transformers' fp32 model and tokenizer, both from the GGUF itself."""
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    model = Gemma3ForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


@torch.no_grad()
def perplexity(model: Any, token_ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of tokens 1.. given the ones before (one forward)."""
    ids = torch.tensor([token_ids])
    logits = model(ids).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="mean")
    return math.exp(float(nll))


@torch.no_grad()
def greedy(model: Any, token_ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation, past any end-of-sequence token (like ``ignore_eos``)."""
    out = model.generate(
        torch.tensor([token_ids]),
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(token_ids) :].tolist()


def kvtier_perplexity(token_ids: list[int]) -> float:
    """kvtier's perplexity of the same ids from prompt logprobs (the packaged model, fp32)."""
    from kvtier import LLM, SamplingParams

    llm = LLM(MODEL, dtype="float32", kv_device_blocks=256)
    out = llm.generate({"prompt_token_ids": token_ids}, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    logprobs = [entry.logprob for entry in out.prompt_logprobs[1:]]  # the prompt's own tokens
    return math.exp(-sum(logprobs) / len(logprobs))


def llama_cpp_logits(path: Path, token_ids: list[int], threads: int) -> torch.Tensor | None:
    """llama.cpp's logits of the last position (None when its Python binding is not installed)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=2048, n_threads=threads, logits_all=False, verbose=False)
    llm.eval(token_ids)
    return torch.tensor(llm.scores[len(token_ids) - 1], dtype=torch.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens to generate (default 16)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--kvtier", action="store_true", help="also kvtier's perplexity on the same ids")
    ns = parser.parse_args(argv)
    torch.set_num_threads(ns.threads)
    from kvtier.models.loader import PACKAGED_MODELS, packaged_gguf_path

    t0 = time.monotonic()
    path = packaged_gguf_path(MODEL)
    digest = PACKAGED_MODELS[MODEL].sha256
    print(f"file: {path} ({path.stat().st_size / 1e6:.0f} MB, sha256 {digest[:12]}... checked when joined)")
    model, tokenizer = load_reference(path)
    print(f"transformers {type(model).__name__} fp32 from the GGUF: loaded in {time.monotonic() - t0:.0f} s")
    ids = tokenizer(PARAGRAPH)["input_ids"]
    print(f"perplexity, English paragraph ({len(ids)} tokens): {perplexity(model, ids):.2f}")
    if APACHE.is_file():
        apache = tokenizer(APACHE.read_text(encoding="utf-8"))["input_ids"][:700]
        print(f"perplexity, Apache-2.0 text (first {len(apache)} tokens): {perplexity(model, apache):.2f}")
    prompt = tokenizer(PROMPT)["input_ids"]
    t1 = time.monotonic()
    tokens = greedy(model, prompt, ns.tokens)
    per_token = (time.monotonic() - t1) / ns.tokens
    print(f"greedy {PROMPT!r} -> {tokenizer.decode(tokens)!r} ({per_token:.2f} s/token)")
    print(f"  ids {tokens}")
    if ns.kvtier:
        print(f"kvtier perplexity, same paragraph ids: {kvtier_perplexity(ids):.2f}")
    theirs = llama_cpp_logits(path, prompt, ns.threads)
    if theirs is None:
        print("llama.cpp: skipped (the llama_cpp binding is not installed)")
    else:
        with torch.no_grad():
            ours = model(torch.tensor([prompt])).logits[0, -1]
        same_top = int(ours.argmax()) == int(theirs.argmax())
        diff = float((ours - theirs).abs().max())
        print(f"llama.cpp last-position logits: max |diff| {diff:.3g}, same top-1 {same_top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
