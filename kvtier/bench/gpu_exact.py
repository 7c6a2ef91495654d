"""``kvtier bench gpu`` part 1: is kvtier exact on this device?

Model level: greedy tokens and the logprob of every token (prompt and answer) of kvtier in float32 on the
device, each attention backend, against transformers in float32 on the CPU (the reference), on random
checkpoints of real shapes (``gpu_models.py``). Kernel level: the Triton kernels against the torch path on
the device, over a random pool of the 1B shape's heads (GQA 4, head_dim 64): decode with long ragged
contexts (split-K) and a sliding window, a prefill chunk after cached blocks, in bfloat16 and fp8/int8.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.gpu_models import Shape, random_prompts

NEW_TOKENS = 16


@dataclass
class ExactRow:
    shape: str
    backend: str
    run: str  # "cached": a second pass from the prefix cache; "swap" / "recompute": a pool too small
    device: str
    tokens_equal: str  # "4/4": answers equal to the CPU reference token for token
    max_logprob_diff: float  # over every prompt and answer token
    cached_tokens: int  # prefix-cache hits of the run (the answers must not change)
    preemptions: int  # sequences preempted (swapped to the host tier, or recomputed)
    seconds: float = 0.0  # the run's wall time (kernels compiled in it included)
    compiled: int | None = None  # Triton kernel variants compiled in the run (None: no triton here)

    @property
    def ok(self) -> bool:
        same, total = self.tokens_equal.split("/")
        return same == total and self.max_logprob_diff < 1e-3


def exact_prompts(shape: Shape, prefix_len: int) -> list[list[int]]:
    """Four prompts sharing a ``prefix_len``-token prefix (the second pass hits it in the cache)."""
    prefix = random_prompts(1, prefix_len, 7, shape.vocab)[0]
    return random_prompts(4, max(8, prefix_len // 4), 8, shape.vocab, prefix=prefix)


@torch.inference_mode()
def reference(model_dir: Path, prompts: list[list[int]], answers: list[list[int]] | None) -> dict[str, Any]:
    """transformers on the CPU in float32: greedy answers (when ``answers`` is None) and the logprob of
    every token of prompt + answer, each under the tokens before it."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if answers is None:
        answers = []
        for p in prompts:
            out = model.generate(
                torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )
            answers.append(out[0, len(p) :].tolist())
    logprobs = [_sequence_logprobs(model, p + a) for p, a in zip(prompts, answers, strict=True)]
    return {"answers": answers, "logprobs": logprobs}


def _sequence_logprobs(model: Any, ids: list[int]) -> list[float]:
    logits = model(torch.tensor([ids])).logits[0].float()  # [n, V]
    lp = torch.log_softmax(logits, dim=-1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


# A pool too small for the four prompts together: preemption by swap (through the host tier's pinned
# buffer and the mover's stream) and by recompute must give the same answers.
TIGHT = {"swap": dict(preemption_mode="swap", kv_host_gb=0.5), "recompute": dict(preemption_mode="recompute")}


def kvtier_run(
    model_dir: Path, prompts: list[list[int]], backend: str, run: str, kv_groups: int = 1
) -> dict[str, Any]:
    """kvtier in float32 on its default device. ``cached``: every token's logprob (a pass that computes
    the whole prompt), then the answers again from the prefix cache; ``swap``/``recompute``: the answers
    from a pool that holds about half the batch (each sequence takes blocks in each of ``kv_groups``)."""
    from kvtier import LLM, SamplingParams

    scored = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    need = sum(-(-(len(p) + NEW_TOKENS) // 16) for p in prompts)
    engine = (
        dict(kv_device_blocks=1024)
        if run == "cached"
        else dict(kv_device_blocks=need * kv_groups // 2, **TIGHT[run])
    )
    with LLM(str(model_dir), dtype="float32", attention_backend=backend, **engine) as llm:
        first = llm.generate(prompts, scored)
        llm.generate(prompts, plain)  # fills the prefix cache
        again = llm.generate(prompts, plain)
        device, stats = str(llm.engine.device), llm.engine.stats()
    answers = [o.outputs[0].token_ids for o in first]
    if answers != [o.outputs[0].token_ids for o in again]:
        answers = [[-1]] * len(prompts)  # the cache changed an answer: nothing can be equal
    logprobs = []
    for o in first:
        prompt = [e.logprob for e in (o.prompt_logprobs or [])[1:] if e is not None]
        logprobs.append(prompt + [e.logprob for e in o.outputs[0].logprobs or []])
    hits = sum(o.num_cached_tokens for o in again)
    preempted = sum(stats.num_preemptions.values())
    return {
        "answers": answers,
        "logprobs": logprobs,
        "device": device,
        "cached": hits,
        "preempted": preempted,
    }


def exactness(shape: Shape, model_dir: Path, backends: list[str], prefix_len: int) -> list[ExactRow]:
    """A row per backend (its answers from the prefix cache), and the last backend's under preemption
    by swap and by recompute: kvtier on the device against transformers on the CPU."""
    prompts = exact_prompts(shape, prefix_len)
    ref = reference(model_dir, prompts, None)
    runs = [(b, "cached") for b in backends] + [(backends[-1], "swap"), (backends[-1], "recompute")]
    rows = []
    for backend, run in runs:
        t0, before = time.perf_counter(), _compiled()
        got = kvtier_run(model_dir, prompts, backend, run, shape.kv_groups())
        seconds, after = time.perf_counter() - t0, _compiled()
        compiled = None if before is None or after is None or min(before, after) < 0 else after - before
        same = sum(a == b for a, b in zip(got["answers"], ref["answers"], strict=True))
        pairs = zip(got["logprobs"], ref["logprobs"], strict=True)
        diff = max((abs(x - y) for a, b in pairs for x, y in zip(a, b, strict=True)), default=float("inf"))
        equal = f"{same}/{len(prompts)}"
        row = ExactRow(
            shape.name, backend, run, got["device"], equal, diff, got["cached"], got["preempted"], seconds,
            compiled,
        )  # fmt: skip
        rows.append(row)
        # as it happens: a run that hangs or compiles for minutes on a lent GPU is named in its log
        print(f"   {shape.name} {backend} {run}: {equal}, {seconds:.1f} s, {compiled} compiled", flush=True)
    return rows


def _compiled() -> int | None:
    """Triton kernel variants compiled so far in this process (None where triton is not installed)."""
    try:
        from kvtier.models.triton_attention import compiled_kernels
    except ImportError:
        return None
    return compiled_kernels()


# ------------------------------------------------------------------------------------------ kernels
@dataclass
class KernelRow:
    case: str
    kv_dtype: str
    compute: str
    max_rel_diff: float  # |triton - torch| / max |torch|
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_rel_diff <= self.tolerance


# (name, [(cached tokens, new tokens) per sequence], window): decodes have 1 new token
KERNEL_CASES = (
    ("decode, ragged, split-K", [(4000, 1), (700, 1), (17, 1), (2500, 1)], None),
    ("decode, sliding window 512", [(4000, 1), (300, 1), (1500, 1)], 512),
    ("prefill after cached blocks", [(1000, 300)], None),
    ("prefill + decodes, window", [(600, 1), (0, 200), (900, 130)], 256),
)
KERNEL_DTYPES = (("bfloat16", torch.bfloat16), ("fp8_e4m3", torch.bfloat16), ("int8", torch.bfloat16))
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 2e-3}


def kernel_rows(
    device: torch.device, heads: int, kv_heads: int, head_dim: int, shrink: int = 1
) -> list[KernelRow]:
    """The Triton kernels against the torch path (float32 over the same stored bytes) on ``device``;
    ``shrink``: every context and chunk divided by it (the interpreter is slow)."""
    from kvtier.bench.gpu_kernel_step import compare

    rows = []
    for name, cases, w in KERNEL_CASES:
        seqs = [(c // shrink, n if n == 1 else max(2, n // shrink)) for c, n in cases]
        window = None if w is None else max(4, w // shrink)
        for kv_dtype, compute in KERNEL_DTYPES:
            diff = compare(seqs, window, kv_dtype, compute, heads, kv_heads, head_dim, device)
            rows.append(
                KernelRow(name, kv_dtype, str(compute).removeprefix("torch."), diff, TOLERANCE[compute])
            )
    return rows
