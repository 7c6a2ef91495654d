"""Cross-check the Gemma 3 reference against llama.cpp: transformers (the tests' reference, fp32 from the
GGUF) and llama.cpp (its own Q4_K/Q6_K kernels) on the same token ids of an English text.

    .venv/bin/python -m benchmarks.llamacpp_check --llama-python /path/to/venv/bin/python

``--llama-python`` is an interpreter with ``llama-cpp-python`` installed (a source build: not a
dependency of kvtier); it runs in a subprocess that writes llama.cpp's logits for every position. Printed
per text: top-1 agreement over positions, the median and worst correlation of the two logit vectors,
the largest difference of the top token's log-probability, and each one's perplexity; then llama.cpp's
single-stream decode ms/token on this machine (``(t(64 tokens) - t(1)) / 63``, as ``benchmarks.decode``).
llama.cpp multiplies quantized weights by 8-bit activations, so its logits are not the fp32
reference's to 1e-4: agreement on the top token and correlations near 1 are what "the reference is the
model" means.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TEXTS = (
    "The river runs through the old city, past the market and the library, and on towards the "
    "harbor, where the boats wait for the morning tide. Every spring the water rises and the bridges "
    "close for a week, and the people who live by the river move their gardens to higher ground.",
    "A cache keeps recent results close at hand, so that a question asked twice is answered from "
    "memory instead of being worked out again. The hard part is deciding what to forget when the "
    "memory is full: the oldest entry, the least used one, or the one that is cheapest to recompute.",
)

LLAMA_SCRIPT = """
import json, sys, time
import numpy as np
from llama_cpp import Llama
model, ids_path, out_path, threads = sys.argv[1:5]
ids = json.load(open(ids_path))
llm = Llama(model_path=model, n_ctx=1024, logits_all=True, verbose=False, n_threads=int(threads))
llm.eval(ids)
np.save(out_path, np.array(llm.scores[: len(ids)], dtype=np.float32))
fast = Llama(model_path=model, n_ctx=1024, verbose=False, n_threads=int(threads))
def run(n):
    fast.reset()
    start = time.perf_counter()
    out = fast.create_completion(ids[:16], max_tokens=n, temperature=0.0)
    return time.perf_counter() - start, out["usage"]["completion_tokens"]
best = min(((run(64)[0] - run(1)[0]) / 63 for _ in range(3)))
json.dump({"decode_ms_per_token": best * 1e3}, open(out_path + ".json", "w"))
"""


def llama_logits(
    python: str, model: str, ids: list[int], work: Path, threads: int
) -> tuple[np.ndarray, float]:
    """llama.cpp's logits at every position of ``ids``, and its decode ms/token (best of 3)."""
    ids_path, out_path = work / "ids.json", work / "logits.npy"
    ids_path.write_text(json.dumps(ids))
    subprocess.run(
        [python, "-c", LLAMA_SCRIPT, model, str(ids_path), str(out_path), str(threads)], check=True
    )
    timing = json.loads(Path(str(out_path) + ".json").read_text())
    return np.load(out_path), float(timing["decode_ms_per_token"])


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def perplexity(logp: np.ndarray, ids: list[int]) -> float:
    nll = -np.mean([logp[i, ids[i + 1]] for i in range(len(ids) - 1)])
    return math.exp(nll)


def compare(ref: np.ndarray, other: np.ndarray, ids: list[int]) -> dict[str, float]:
    top_ref, top_other = ref.argmax(-1), other.argmax(-1)
    corr = [float(np.corrcoef(ref[i], other[i])[0, 1]) for i in range(len(ids))]
    lr, lo = log_softmax(ref), log_softmax(other)
    dtop = [abs(float(lr[i, top_ref[i]] - lo[i, top_ref[i]])) for i in range(len(ids))]
    return {
        "positions": len(ids),
        "top1_agree": float(np.mean(top_ref == top_other)),
        "corr_median": float(np.median(corr)),
        "corr_min": float(min(corr)),
        "max_dlogp_top": max(dtop),
        "ppl_reference": perplexity(lr, ids),
        "ppl_llamacpp": perplexity(lo, ids),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-python", required=True, help="a python with llama-cpp-python installed")
    p.add_argument("--model", default="gemma-3-270m", help="kvtier's model name or a GGUF path")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (default 2)")
    ns = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from kvtier.models.loader import resolve_model_path

    gguf = Path(resolve_model_path(ns.model))
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    rows, decode_ms = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for text in TEXTS:
            ids = tok(text)["input_ids"]
            with torch.no_grad():
                ref = hf(torch.tensor([ids])).logits[0].float().numpy()
            theirs, ms = llama_logits(ns.llama_python, str(gguf), ids, Path(tmp), ns.threads)
            rows.append(compare(ref, theirs, ids))
            decode_ms.append(ms)
    head = "| text | positions | top-1 agree | corr median | corr min | max Δlogp(top) | ppl ref |"
    print(head + " ppl llama.cpp |")
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(
            f"| {i + 1} | {r['positions']} | {r['top1_agree']:.1%} | {r['corr_median']:.5f} | "
            f"{r['corr_min']:.5f} | {r['max_dlogp_top']:.3f} | "
            f"{r['ppl_reference']:.2f} | {r['ppl_llamacpp']:.2f} |"
        )
    print(f"llama.cpp decode, 1 stream, {ns.threads} threads: {min(decode_ms):.2f} ms/token (best of 3 x 2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
