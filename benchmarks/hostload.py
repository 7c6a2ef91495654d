"""Where a host-tier load's time to first token goes on this CPU: an 8k-token prompt pushed out of the
device pool and loaded back, the engine's phases timed one by one.

    python -m benchmarks.hostload [--repeats 5]

The ``kvtier bench gpu`` ``loads`` section (``kvtier/bench/load_phases.py``: the TTFT engine, a device
pool of 1.25x the longest of 2k/8k/32k prompts, a host tier three times that) on a 2-layer random model,
so that the model's compute is small and the engine's own bookkeeping shows: the 8k prompt is computed,
hit on the device, then loaded back from the host tier into an engine that idled first (``settle``: the
blocks it evicts were written back ahead) and into a busy one (it stores what it evicts first). Each row
is the fastest of ``--repeats`` with the engine methods' own times within it (nested: ``schedule`` holds
``allocate_slots``, which holds ``get_new_blocks``).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import astuple, fields
from pathlib import Path

from kvtier.bench.gpu_models import Shape, write_checkpoint
from kvtier.bench.gpu_report import table
from kvtier.bench.load_phases import LoadPhaseRow, load_phase_rows

SHAPE = Shape("probe-2-layers", "llama", 2, 64, 128, 4, 2, 16, 512, 10_000.0, 40_960)
LENGTHS = (2048, 8192, 32768)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    ns = p.parse_args(argv)
    directory = write_checkpoint(SHAPE, Path(tempfile.mkdtemp()) / "model")
    rows = load_phase_rows(directory, SHAPE, LENGTHS, "float32", "auto", ns.repeats)
    print(f"8,192-token prompt, {SHAPE.name}: recompute {rows[0].ttft_ms * rows[0].recompute_ratio:.1f} ms")
    print(table([f.name for f in fields(LoadPhaseRow)], [list(astuple(r)) for r in rows]))


if __name__ == "__main__":
    main()
