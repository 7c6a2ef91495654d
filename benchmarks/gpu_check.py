"""The one prepared command for a lent GPU: is kvtier exact on CUDA, and how fast is it there?

::

    python3 benchmarks/gpu_check.py [--out DIR]     # on a machine with torch, transformers, CUDA

No download and no model file: the models are random-weight Llamas that transformers builds here (a
tiny one for exactness, a ~0.3B one for speed) with the tests' tiny byte-level BPE tokenizer, so the
command needs only torch, transformers, tokenizers, safetensors and numpy (a GPU image has them all).

Exactness (greedy, fp32, 8 prompts sharing a 96-token prefix, 32 new tokens each), every row against
transformers' ``generate`` on the same device:

    plain            one engine, prefix caching on (a second pass hits the cache)
    host tier swap   a device pool too small for the batch, preemption by swap through the host tier
                     (pinned host memory, the mover's own CUDA stream)
    recompute        the same pool, preemption by recompute
    cpu engine       the same engine on the CPU (does the device change the answer?)

Speed (the ~0.3B model, fp32): kvtier decode ms/token at batch 1 and tokens/s at batch 32 next to
transformers' ``generate`` on the same device. Results print as a table and go to ``DIR/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvtier import LLM, SamplingParams  # noqa: E402
from tests.conftest import _randomize, write_tiny_tokenizer  # noqa: E402

NEW_TOKENS = 32


def make_model(directory: Path, *, hidden: int, layers: int, heads: int, kv_heads: int, seed: int) -> Path:
    """A random-weight Llama saved as an HF directory with the tiny tokenizer."""
    import transformers

    vocab = write_tiny_tokenizer(directory)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    _randomize(model, seed)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def prompts(num: int, prefix_len: int, tail_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 500, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, 500, (tail_len,), generator=g).tolist() for _ in range(num)]


def hf_greedy(model_dir: Path, device: str, batch: list[list[int]]) -> list[list[int]]:
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    out = []
    with torch.inference_mode():
        for p in batch:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
            out.append(gen[0, len(p) :].tolist())
    return out


def kvtier_greedy(model_dir: Path, batch: list[list[int]], passes: int = 1, **engine: Any) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(model_dir), dtype="float32", **engine) as llm:
        for _ in range(passes):
            outs = llm.generate(batch, params)
        stats = llm.engine.stats()
        device = str(llm.engine.device)
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "cached": sum(o.num_cached_tokens or 0 for o in outs),
        "preemptions": dict(stats.num_preemptions),
        "device": device,
    }


def exactness(tmp: Path, device: str) -> list[dict[str, Any]]:
    model_dir = make_model(tmp / "tiny", hidden=256, layers=4, heads=8, kv_heads=4, seed=0)
    batch = prompts(8, 96, 24)
    ref = hf_greedy(model_dir, device, batch)
    tight = dict(kv_device_blocks=24, max_num_seqs=8)
    runs = {
        "plain (2nd pass cached)": dict(passes=2, kv_device_blocks=512),
        "host tier swap": dict(**tight, kv_host_gb=0.05, preemption_mode="swap"),
        "recompute": dict(**tight, preemption_mode="recompute"),
    }
    rows = []
    for name, engine in runs.items():
        got = kvtier_greedy(model_dir, batch, **engine)
        rows.append(_row(name, got, ref))
    if device != "cpu":  # the same engine on the CPU, in a child that sees no GPU
        rows.append(_cpu_row(model_dir, batch, ref))
    rows.append(_prompt_logprobs_row(model_dir, batch[0], device))
    return rows


def _prompt_logprobs_row(model_dir: Path, prompt: list[int], device: str) -> dict[str, Any]:
    """Every prompt token's logprob from the engine (prompt_logprobs) against transformers' own."""
    import transformers

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    with LLM(str(model_dir), dtype="float32", kv_device_blocks=512) as llm:
        ours = [e.logprob for e in llm.generate([prompt], params)[0].prompt_logprobs[1:]]
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([prompt], device=device)).logits[0].float(), -1).cpu()
    theirs = lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
    diff = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
    ok = diff < 1e-4
    return {"run": "prompt logprobs (max abs diff)", "device": device, "rows equal to HF": f"{int(ok)}/1",
            "cached tokens": 0, "preemptions": {}, "max_abs_diff": diff}  # fmt: skip


def _row(name: str, got: dict[str, Any], ref: list[list[int]]) -> dict[str, Any]:
    same = sum(a == b for a, b in zip(got["tokens"], ref, strict=True))
    return {
        "run": name,
        "device": got["device"],
        "rows equal to HF": f"{same}/{len(ref)}",
        "cached tokens": got["cached"],
        "preemptions": got["preemptions"],
    }


def _cpu_row(model_dir: Path, batch: list[list[int]], ref: list[list[int]]) -> dict[str, Any]:
    code = (
        "import json,sys; sys.path.insert(0, sys.argv[1]); from benchmarks.gpu_check import kvtier_greedy;"
        "from pathlib import Path; b=json.loads(sys.argv[3]);"
        "print(json.dumps(kvtier_greedy(Path(sys.argv[2]), b, kv_device_blocks=512)))"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-c", code, str(ROOT), str(model_dir), json.dumps(batch)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return _row("cpu engine", json.loads(out.strip().splitlines()[-1]), ref)


def speed(tmp: Path, device: str) -> list[dict[str, Any]]:
    import transformers

    model_dir = make_model(tmp / "speed", hidden=1024, layers=24, heads=16, kv_heads=4, seed=1)
    rows = []
    for batch_size in (1, 32):
        batch = prompts(batch_size, 64, 64)
        params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
        with LLM(str(model_dir), dtype="float32", kv_device_blocks=4096) as llm:
            llm.generate(batch[:1], SamplingParams(temperature=0.0, max_tokens=8))  # warm up
            _sync(device)
            t0 = time.perf_counter()
            llm.generate(batch, params)
            _sync(device)
            ours = time.perf_counter() - t0
        model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        ids = torch.tensor(batch, device=device)
        with torch.inference_mode():
            model.generate(ids[:1], max_new_tokens=8, do_sample=False)
            _sync(device)
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=128, min_new_tokens=128, do_sample=False)
            _sync(device)
            theirs = time.perf_counter() - t0
        del model
        tokens = batch_size * 128
        rows.append(
            {
                "batch": batch_size,
                "kvtier tok/s": round(tokens / ours, 1),
                "HF generate tok/s": round(tokens / theirs, 1),
                "ratio": round(theirs / ours, 2),
                "kvtier ms/step": round(1000 * ours / 128, 2),
            }
        )
    return rows


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".", help="where gpu_check.json goes")
    p.add_argument("--skip-speed", action="store_true")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"gpu_check: torch {torch.__version__} on {name}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        exact = exactness(Path(tmp), device)
        for r in exact:
            print(json.dumps(r), flush=True)
        fast = [] if args.skip_speed else speed(Path(tmp), device)
        for r in fast:
            print(json.dumps(r), flush=True)
    result = {"device": name, "torch": torch.__version__, "exactness": exact, "speed": fast}
    Path(args.out, "gpu_check.json").write_text(json.dumps(result, indent=2))
    same, total = zip(*(r["rows equal to HF"].split("/") for r in exact), strict=True)
    return 0 if same == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
