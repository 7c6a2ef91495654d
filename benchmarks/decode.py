"""``python -m benchmarks.decode``: single-stream decode of any model, kvtier vs HF transformers.

Both load the same file (``--model``: a GGUF, an HF directory or a packaged name such as
``gemma-3-270m``; default the embedded SmolLM2), compute in float32 with the same threads and decode
the same greedy prompt. ``--weight-dtype gguf`` runs kvtier's linears on the file's own blocks (the
same fp32 weights, dequantized in registers; transformers holds them dequantized). Rows (each a ratio
against its target, measured in this run, the two engines taking turns ``--rounds`` times so drift on
a shared machine hits both alike):

* decode ms/token (``(t(n tokens) - t(1 token)) / (n - 1)``, the best of each round), kvtier vs HF;
* kvtier's ms/token vs this machine's bandwidth floor (the weight bytes one decode step reads / the
  measured memory read bandwidth).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from benchmarks.runner import run
from benchmarks.throughput import (
    hf_decode_ms,
    kvtier_decode_ms,
    read_bandwidth_gbs,
    weight_bytes_per_decode_step,
)
from kvtier.args import add_engine_args

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(
        p,
        ["model", "num_threads", "weight_dtype"],
        defaults={"num_threads": 2},
        notes={"num_threads": "for HF transformers too"},
    )
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="kvtier and HF take turns this many times")
    p.set_defaults(func=main)


def load_hf(path: str, threads: int):  # noqa: ANN201
    """transformers' model from the same file kvtier loads (a GGUF through ``gguf_file=``)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    p = Path(path)
    kwargs = {"gguf_file": p.name} if p.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(p.parent if kwargs else p, dtype=torch.float32, **kwargs)
    model.generation_config.eos_token_id = None
    torch.set_num_threads(threads)
    return model.eval()


def main(ns: argparse.Namespace) -> int:
    from kvtier import LLM
    from kvtier.models.loader import resolve_model_path

    torch.set_num_threads(ns.num_threads)
    llm = LLM(model=ns.model, dtype="float32", num_threads=ns.num_threads, weight_dtype=ns.weight_dtype)
    hf = load_hf(str(resolve_model_path(ns.model)), ns.num_threads)
    prompt = llm.tokenizer.encode(PROMPT)
    ours, theirs = [], []
    for _ in range(ns.rounds):
        ours.append(kvtier_decode_ms(llm, prompt, ns.decode_tokens))
        theirs.append(hf_decode_ms(hf, prompt, ns.decode_tokens))
    bw = read_bandwidth_gbs()
    floor = weight_bytes_per_decode_step(llm.engine.model) / (bw * 1e9) * 1e3
    k, h = statistics.median(ours), statistics.median(theirs)
    name = llm.engine.loaded.path.name
    print(f"\nbenchmarks.decode — {name}, weight_dtype {ns.weight_dtype}, {ns.num_threads} threads, "
          f"torch {torch.__version__}")  # fmt: skip
    print("| metric | kvtier | baseline | unit | ratio | target | met |")
    print("|---|---|---|---|---|---|---|")
    print(f"| decode, 1 stream (median of {ns.rounds}) | {k:.2f} | {h:.2f} | ms/token | {h / k:.2f} "
          f"| >= 1.3x HF | {'yes' if h / k >= 1.3 else 'NO'} |")  # fmt: skip
    print(f"| decode vs bandwidth floor | {k:.2f} | {floor:.2f} | ms/token | {floor / k:.2f} "
          f"| floor = weight bytes / {bw:.1f} GB/s read | |")  # fmt: skip
    print(f"(each round: kvtier {[round(x, 2) for x in ours]}, HF {[round(x, 2) for x in theirs]})")
    return 0


if __name__ == "__main__":
    sys.exit(run("decode", __doc__, add_args))
