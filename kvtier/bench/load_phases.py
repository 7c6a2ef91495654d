"""Where the time to first token of a prompt loaded back from the host tier goes, engine phase by phase
(``kvtier bench gpu``'s ``loads`` section; ``python -m benchmarks.hostload`` on a CPU).

The ``ttft`` section's engine and prompt (the middle length) is hit on the device, then pushed out of
the device pool by other prompts and loaded back: into an engine that idled first as a server does
between requests (``settle``: the blocks the load evicts were written back ahead) and into a busy one (it
stores them first). Each row is the fastest of ``repeats`` with its phases' own times::

    ttft = add_request        the prompt's block hashes
         + schedule           lookup, admission; holds allocate_slots (device blocks for the hit and the
                              load: evictions, the tiers' plans, and the hit's loads enqueued as soon as
                              they are planned: ``TierCoordinator.start_loads``), which holds get_new_blocks
         + copies             the rest of the step's block copies enqueued (on CUDA: two streams,
                              asynchronous); ~0 for a lone hit, whose loads ran inside allocate_slots
         + forward            the runner's host side: metadata, launches
         + forward wait       the device work still queued when the launches end: on CUDA the copies'
                              remainder (the forward waits for them) and the forward's kernels
         + sample, update     the token read back; outputs, the finished prompt's blocks freed
         + rest               everything else (``generate``'s own loop, the step's tier polls, events)

So on a GPU a load is bound by the link when ``forward wait`` is the copies' time less what the host did
after enqueueing them, and by the host when the phases before the copies dominate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.gpu_models import Shape, random_prompts
from kvtier.bench.gpu_speed import _ttft, push_out, sync, ttft_engine
from kvtier.bench.step_phases import method_clock

# label -> (the attribute path of the engine that owns the method, "" for the engine itself; the method)
PHASES = {
    "add_request": ("", "add_request"),
    "schedule": ("scheduler", "schedule"),
    "allocate_slots": ("kv", "allocate_slots"),
    "get_new_blocks": ("kv.pool", "get_new_blocks"),
    "copies": ("", "_move_blocks"),
    "forward": ("runner", "execute"),
    "sample": ("", "_sample"),
    "update": ("", "_update"),
}
_SEQUENTIAL = ("add_request", "schedule", "copies", "forward", "forward_wait", "sample", "update")


@dataclass
class LoadPhaseRow:
    run: str  # "device hit", "host load, idle engine", "host load, busy engine"
    prompt_tokens: int
    ttft_ms: float
    recompute_ratio: float  # the prompt's recompute TTFT / this row's
    add_request_ms: float
    schedule_ms: float
    allocate_slots_ms: float  # inside schedule
    get_new_blocks_ms: float  # inside allocate_slots
    copies_ms: float  # the step's other copies: enqueued on CUDA, run on a CPU (a hit's: in allocate_slots)
    forward_ms: float  # the host side
    forward_wait_ms: float  # 0 on a CPU
    sample_ms: float
    update_ms: float
    rest_ms: float


def _owner(engine: Any, path: str) -> Any:
    for part in path.split(".") if path else ():
        engine = getattr(engine, part)
    return engine


def timed_ttft(llm: Any, prompt: list[int]) -> tuple[float, dict[str, float]]:
    """One ``generate`` of ``prompt`` (one token), timed as a whole and phase by phase (ms)."""
    methods = {label: (_owner(llm.engine, path), name) for label, (path, name) in PHASES.items()}
    with method_clock(methods, {"forward": sync}) as spent:
        ms, _ = _ttft(llm, prompt)
    phases = {label: 1000 * seconds for label, seconds in spent.items()}
    phases["rest"] = ms - sum(phases.get(label, 0.0) for label in _SEQUENTIAL)
    return ms, phases


def _row(run: str, n: int, recompute: float, best: tuple[float, dict[str, float]]) -> LoadPhaseRow:
    ms, phases = best
    labels = (*PHASES, "forward_wait", "rest")
    return LoadPhaseRow(run, n, ms, recompute / ms, **{f"{x}_ms": phases.get(x, 0.0) for x in labels})


def load_phase_rows(
    model_dir: Path, shape: Shape, lengths: tuple[int, ...], dtype: str, backend: str, repeats: int = 3
) -> list[LoadPhaseRow]:
    """The middle of ``lengths``: its recompute, then the best of ``repeats`` device hits, idle loads and
    busy loads, phase by phase (fresh fillers before each load)."""
    from kvtier import LLM

    n = sorted(lengths)[len(lengths) // 2]
    with LLM(str(model_dir), **ttft_engine(shape, lengths, dtype, backend)) as llm:
        warm = random_prompts(1, min(lengths), 99, shape.vocab)[0]
        for _ in range(2):  # kernels compiled: a fresh chunk, then one after cached blocks
            _ttft(llm, warm)
        prompt = random_prompts(1, n, 3, shape.vocab)[0]
        recompute, _ = _ttft(llm, prompt)
        hits = [timed_ttft(llm, prompt) for _ in range(repeats)]
        runs: dict[str, list[tuple[float, dict[str, float]]]] = {"idle": [], "busy": []}
        for i in range(repeats):
            for kind in runs:
                push_out(llm, shape, lengths, 5 + i + 100 * (kind == "idle"), idle=kind == "idle")
                runs[kind].append(timed_ttft(llm, prompt))
    best = {label: min(found, key=lambda r: r[0]) for label, found in
            [("device hit", hits), ("host load, idle engine", runs["idle"]),
             ("host load, busy engine", runs["busy"])]}  # fmt: skip
    return [_row(label, n, recompute, found) for label, found in best.items()]
