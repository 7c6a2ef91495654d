"""``kvtier bench gpu``'s ``layered`` section: host loads copied whole against layer slot by layer slot
(``--layered-loads``, ``kvtier/models/slot_gate.py``), side by side in one process.

    copy   the 1B shape's blocks loaded by the mover alone: whole blocks (one copy per run) against one
           2-D copy per run and layer slot (``cudaMemcpy2DAsync``), each until the device is done; the
           pools compared byte for byte afterwards
    ttft   the ``ttft`` section's middle prompt loaded back from the host tier into an idle engine built
           with layered loads, its loads made whole (the forward waits for every copy) and layered (each
           layer waits for its slot) in turn, best of ``TTFT_REPEATS`` each; ``exact``: the loads whose
           one-token answer and logprob equal the device hit's, bit for bit

It runs last: it is the first CUDA run of the 2-D copies and of event waits inside captured graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.gpu_models import Shape, random_prompts
from kvtier.bench.gpu_speed import BLOCK_SIZE, TTFT_REPEATS, _ttft, answer, best_of, push_out, ttft_engine


@dataclass
class LayeredRow:
    case: str
    whole_ms: float  # the loads copied whole; the forward (ttft) waits for all of them
    layered_ms: float  # slot by slot; each layer waits for its own slot
    recompute_ms: float | None  # ttft rows: the prompt computed from scratch
    exact: str  # copy: "yes" when the two pools are byte-identical; ttft: "k/n" answers as the device hit's
    gated: str = ""  # ttft: "k/n" layered loads whose layers waited for their slots (the others went whole)

    @property
    def gain(self) -> float:
        return self.whole_ms / self.layered_ms

    @property
    def layered_speedup(self) -> float | None:
        """Recompute over the layered load (the issue's 10x target)."""
        return None if self.recompute_ms is None else self.recompute_ms / self.layered_ms


@torch.inference_mode()
def copy_rows(shape: Shape, sizes: tuple[int, ...], dtype: torch.dtype, repeat: int = 5) -> list[LayeredRow]:
    """``sizes`` blocks loaded through a mover without and with a gate, into consecutive and
    scattered device blocks."""
    from kvtier.kv.plan import SwapPlan
    from kvtier.models.slot_gate import SlotGate
    from kvtier.transfer.mover import TierMover

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    block_shape = (shape.layers, BLOCK_SIZE, 2, shape.kv_heads, shape.head_dim)
    top = max(sizes)
    whole = TierMover(torch.zeros((top * 2, *block_shape), dtype=dtype, device=dev), top)
    gate = SlotGate(shape.layers, dev)
    layered = TierMover(torch.zeros_like(whole.device_kv), top, gate=gate)
    for h in range(top):
        noise = torch.randn(block_shape).to(dtype)
        whole.host.block(h).copy_(noise)
        layered.host.block(h).copy_(noise)
    rows = []
    for n in sizes:
        for pattern, ids in (("contiguous", list(range(n))), ("scattered", list(range(2 * n - 1, -1, -2)))):
            plan = SwapPlan(loads=list(zip(range(n), ids, strict=True)))

            def gated(p: SwapPlan = plan) -> None:
                layered.execute(p)
                gate.settle()
                layered.synchronize()

            def plain(p: SwapPlan = plan) -> None:
                whole.execute(p)
                whole.synchronize()

            best = best_of({"whole": plain, "layered": gated}, repeat)
            same = torch.equal(whole.device_kv[ids], layered.device_kv[ids])
            rows.append(LayeredRow(f"copy {n} blocks {pattern}", 1000 * best["whole"],
                                   1000 * best["layered"], None, "yes" if same else "NO"))  # fmt: skip
    return rows


def ttft_row(model_dir: Path, shape: Shape, lengths: tuple[int, ...], dtype: str, backend: str) -> LayeredRow:
    """The middle of ``lengths`` loaded back into an idle engine, whole and layered in turn."""
    from kvtier import LLM

    n = sorted(lengths)[len(lengths) // 2]
    with LLM(str(model_dir), layered_loads=True, **ttft_engine(shape, lengths, dtype, backend)) as llm:
        mover = llm.engine.mover
        gate = None if mover is None else mover.gate
        if gate is None:
            raise RuntimeError("--layered-loads did not take: see the engine's log")
        warm = random_prompts(1, min(lengths), 99, shape.vocab)[0]
        for _ in range(2):
            _ttft(llm, warm)
        prompt = random_prompts(1, n, n, shape.vocab)[0]
        recompute, _ = _ttft(llm, prompt)
        _, hit = _ttft(llm, prompt)
        runs: dict[str, list[tuple[float, Any]]] = {"whole": [], "layered": []}
        gated = 0
        for i in range(TTFT_REPEATS):
            for kind in runs:
                push_out(llm, shape, lengths, n + 7 + 97 * i + (kind == "layered"))
                mover.gate, gate.waited = (gate if kind == "layered" else None), []
                runs[kind].append(_ttft(llm, prompt))
                gated += bool(gate.waited)
        mover.gate = gate
    outs = [out for found in runs.values() for _, out in found]
    same = sum(answer(out) == answer(hit) for out in outs)
    best = {kind: min(ms for ms, _ in found) for kind, found in runs.items()}
    exact, waited = f"{same}/{len(outs)}", f"{gated}/{TTFT_REPEATS}"
    return LayeredRow(f"ttft {n} tokens, idle", best["whole"], best["layered"], recompute, exact, waited)
