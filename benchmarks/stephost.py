"""The host work of a decode step on this CPU, phase by phase, as the batch and the contexts grow.

    python -m benchmarks.stephost [--steps 32] [--contexts 1024,8192] [--batches 1,16,64] [--final-only]

A 2-layer random model (``kvtier/bench/gpu_models.py``), so that the forward is small and the engine's
own Python per row shows: what a GPU step pays on its host beside kernels that take a few milliseconds
(``kvtier bench gpu``'s ``phases`` section is the same table on a lent GPU). The prompts of a batch share
all but their last 32 tokens (one prefill, then prefix hits: each row still has its whole context in
its block tables and reads it). Columns as in ``kvtier/bench/step_phases.py``, each the median over the
timed steps; ``plan`` is part of ``forward_host``; ``host_per_row_us`` is the engine's Python per row:
schedule, plan, sample and update over the batch.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from kvtier import LLM
from kvtier.bench.gpu_models import Shape, write_checkpoint
from kvtier.bench.gpu_report import table
from kvtier.bench.step_phases import PhaseRow, measure

SHAPE = Shape("probe-2-layers", "llama", 2, 64, 128, 4, 2, 16, 512, 10_000.0, 40_960)
TAIL = 32  # each prompt's own tokens after the shared prefix


def _ints(p: argparse.ArgumentParser, flag: str, text: str, least: int) -> list[int]:
    """A comma-separated list of integers of at least ``least``, or a one-line usage error."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        p.error(f"{flag}: comma-separated integers, got {text!r}")
    if not values or min(values) < least:
        p.error(f"{flag}: each at least {least}, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument(
        "--final-only", action="store_true", help="requests as LLM.generate adds them: no output per step"
    )
    ns = p.parse_args(argv)
    contexts, batches = _ints(p, "--contexts", ns.contexts, TAIL + 1), _ints(p, "--batches", ns.batches, 1)
    if ns.steps < 1:
        p.error("--steps: at least 1")
    directory = write_checkpoint(SHAPE, Path(tempfile.mkdtemp()) / "model")
    blocks = max(batches) * (-(-(max(contexts) + ns.steps + 1) // 16) + 1) + 64
    engine = dict(dtype="float32", kv_device_blocks=blocks, max_num_seqs=max(batches), enforce_eager=True)
    rows: list[PhaseRow] = []
    with LLM(str(directory), **engine) as llm:
        measure(llm, "warm-up", SHAPE, 2, 64, 4, seed=1)
        for context in contexts:
            for batch in batches:
                args = (
                    llm,
                    "auto",
                    SHAPE,
                    batch,
                    context,
                    ns.steps,
                    10 * batch,
                    context - TAIL,
                    ns.final_only,
                )
                rows.append(measure(*args))
    names = ["batch", "context", "step_ms", "schedule_ms", "plan_ms", "forward_host_ms"]
    names += ["sample_ms", "update_ms", "rest_ms"]
    data = [[getattr(r, n) for n in names] + [r.host_per_row_us] for r in rows]
    kind = ", final-only requests (LLM.generate's)" if ns.final_only else ""
    print(f"decode steps of {SHAPE.name} (float32), {ns.steps} timed per row{kind}")
    print(table(names + ["host_per_row_us"], data))


if __name__ == "__main__":
    main()
