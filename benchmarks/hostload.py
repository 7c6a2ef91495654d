"""Where a host-tier load's time to first token goes on this CPU: an 8k-token prompt pushed out of the
device pool and loaded back, the engine's phases timed one by one.

    python -m benchmarks.hostload [--repeats 5]

The ``kvtier bench gpu`` TTFT engine (device pool of 1.25x the longest of 2k/8k/32k prompts, host tier
three times that) on a 2-layer random model, so that the model's compute is small and the engine's own
bookkeeping shows: the prompt is computed, hit on the device, then loaded back from the host tier into an
engine that idled first (``settle``: the blocks it evicts were written back ahead) and into a busy one
(no idle moment: it stores what it evicts first). Each row is the fastest of ``--repeats`` loads; the
phases are the engine methods' own times within it (nested: ``schedule`` holds ``allocate_slots``, which
holds ``get_new_blocks``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from kvtier import LLM
from kvtier.bench.gpu_models import Shape, random_prompts, write_checkpoint
from kvtier.bench.gpu_report import table
from kvtier.bench.gpu_speed import _ttft, push_out, ttft_engine
from kvtier.bench.step_phases import method_clock

SHAPE = Shape("probe-2-layers", "llama", 2, 64, 128, 4, 2, 16, 512, 10_000.0, 40_960)
LENGTHS = (2048, 8192, 32768)
PHASES = (
    "add_request", "catch_up", "schedule", "allocate_slots", "get_new_blocks", "_move_blocks", "_execute",
)  # fmt: skip


def _methods(engine: Any) -> dict[str, tuple[object, str]]:
    """The phases' methods on their objects, for ``method_clock``."""
    owners = {"catch_up": engine.insight, "schedule": engine.scheduler, "allocate_slots": engine.kv,
              "get_new_blocks": engine.kv.pool}  # fmt: skip
    return {name: (owners.get(name, engine), name) for name in PHASES}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    ns = p.parse_args(argv)
    directory = write_checkpoint(SHAPE, Path(tempfile.mkdtemp()) / "model")
    with LLM(str(directory), **ttft_engine(SHAPE, LENGTHS, "float32", "auto")) as llm:
        prompt = random_prompts(1, 8192, 3, SHAPE.vocab)[0]
        recompute, _ = _ttft(llm, prompt)
        hit = min(_ttft(llm, prompt)[0] for _ in range(3))
        rows = []
        for idle in (True, False):
            best: tuple[float, dict[str, float]] | None = None
            for i in range(ns.repeats):
                push_out(llm, SHAPE, LENGTHS, 5 + i + 100 * idle, idle=idle)
                with method_clock(_methods(llm.engine)) as spent:
                    ms, _ = _ttft(llm, prompt)
                if best is None or ms < best[0]:
                    best = (ms, {k: 1000 * v for k, v in spent.items()})
            assert best is not None
            ms, phases = best
            label = "host load, idle engine" if idle else "host load, busy engine"
            rows.append([label, ms, recompute / ms] + [phases.get(name, 0.0) for name in PHASES])
    print(f"8,192-token prompt, {SHAPE.name}: recompute {recompute:.1f} ms, device hit {hit:.1f} ms")
    print(table(["run", "TTFT ms", "recompute / load", *(f"{n} ms" for n in PHASES)], rows))


if __name__ == "__main__":
    main()
