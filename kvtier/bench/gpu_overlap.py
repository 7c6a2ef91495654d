"""``kvtier bench gpu`` part 5: does a host→device load hide under the forward?

Measured inside a real engine, at a decode step of a running batch (the step's own scheduler output,
executed again: it writes the same K/V into the same slots). A load of host blocks into device blocks
that no running sequence reads is timed four ways, best of a few:

    load      ``TierMover.execute`` of the load plan, alone (its copy stream, pinned host buffer)
    forward   the decode step alone (``ModelRunner.execute``)
    engine    the load then the step, as ``Engine._step`` orders them: the step's forward waits on the
              load's event (its rows may read the loaded blocks), so only host-side work overlaps
    bound     the same bytes copied on a side stream that the step does not wait for: what a load
              issued a step ahead (or for rows this step does not run) could hide

hidden = (load + forward - both) / load: 0 when nothing overlaps, 1 when the load is free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.gpu_models import Shape, random_prompts
from kvtier.bench.gpu_speed import best_of


@dataclass
class OverlapRow:
    batch: int
    context: int
    load_blocks: int
    load_mib: float
    load_ms: float
    forward_ms: float
    engine_ms: float
    bound_ms: float

    def hidden(self, both_ms: float) -> float:
        return (self.load_ms + self.forward_ms - both_ms) / self.load_ms


def _free_blocks(out: Any, num_blocks: int, n: int) -> list[int]:
    """``n`` device block ids that no sequence of ``out`` reads (from the top of the pool)."""
    used = {b for s in out.scheduled for table in s.block_tables for b in table}
    free = [i for i in range(num_blocks - 1, -1, -1) if i not in used][:n]
    if len(free) < n:
        raise RuntimeError(f"the pool has {len(free)} unused blocks, the load needs {n}")
    return free


@torch.inference_mode()
def _measure(engine: Any, out: Any, load_blocks: int, batch: int, context: int) -> OverlapRow:
    from kvtier.kv.plan import SwapPlan

    runner, mover = engine.runner, engine.mover
    free = _free_blocks(out, runner.kv_cache.shape[0], load_blocks)
    plan = SwapPlan(loads=list(zip(range(load_blocks), free, strict=True)))
    nbytes = load_blocks * mover.block_bytes
    cuda = runner.kv_cache.device.type == "cuda"
    side = torch.cuda.Stream() if cuda else None
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=runner.kv_cache.device)

    def side_copy() -> None:
        if side is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)

    times = best_of(
        {
            "load": lambda: (mover.execute(plan), mover.synchronize()),
            "forward": lambda: runner.execute(out),
            "engine": lambda: (mover.execute(plan), runner.execute(out)),
            "bound": lambda: (side_copy(), runner.execute(out)),
        },
        repeat=5,
    )
    ms = {k: 1000 * v for k, v in times.items()}
    return OverlapRow(
        batch, context, load_blocks, nbytes / 2**20, ms["load"], ms["forward"], ms["engine"], ms["bound"]
    )


def overlap_row(
    model_dir: Path, shape: Shape, dtype: str, backend: str, batch: int, context: int, load_blocks: int
) -> OverlapRow:
    """Measured at the third step that decodes the whole batch (and no prompt chunk)."""
    from kvtier import LLM, SamplingParams

    per_seq = -(-(context + 48) // 16)
    engine_args = dict(
        dtype=dtype, attention_backend=backend, max_num_seqs=batch,
        kv_device_blocks=batch * per_seq + load_blocks + 64,
        kv_host_gb=(load_blocks + 8) * shape.kv_bytes_per_token(2 if dtype != "float32" else 4) * 16 / 2**30,
    )  # fmt: skip
    rows: list[OverlapRow] = []
    with LLM(str(model_dir), **engine_args) as llm:
        engine = llm.engine
        run = engine.runner.execute
        decode_steps = 0

        def spy(out: Any) -> Any:
            nonlocal decode_steps
            if not out.prefills and len(out.decodes) == batch:
                decode_steps += 1
                if decode_steps == 3 and not rows:
                    rows.append(_measure(engine, out, load_blocks, batch, context))
            return run(out)

        engine.runner.execute = spy  # type: ignore[method-assign]
        try:
            prompts = random_prompts(batch, context, 5, shape.vocab)
            # long enough that the whole batch decodes together after the last prompt's chunks
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
        finally:
            engine.runner.execute = run  # type: ignore[method-assign]
    if not rows:
        raise RuntimeError("no decode step ran the whole batch together")
    return rows[0]
