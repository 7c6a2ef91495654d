"""Where a decode step's wall time goes, phase by phase of the engine (``kvtier bench gpu``'s ``phases``
section; ``python -m benchmarks.stephost`` on a CPU).

A step of ``LLMEngine.step`` is timed as::

    step = schedule          the scheduler: slots allocated, each row's block tables
         + forward (host)    the runner: the step's metadata planned (``plan``: Python ints, every
                             row's block table padded) and uploaded, its kernels launched
         + device wait       the forward's device work still queued when the launches end (0 on a CPU,
                             where the host runs every kernel itself)
         + sample            the sampler (a decode step's greedy rows: one argmax, one readback)
         + update            tokens appended, detokenized, stop checks, the step's outputs made
         + rest              everything else in ``step`` (the sizing trackers' slice, tier polls, ...)

The device wait is measured by synchronizing right after the runner returns, where the sampler's
readback would wait anyway: a step far above its kernels' time with a small wait is host-bound (Python,
launches); one with a large wait is bound by the device. A batch of ``batch`` sequences starts with
``context``-token prompts (prefilled first, not timed), then ``steps`` decode-only steps are timed.

The clock wraps the named methods of one engine instance for the span of a measurement and restores
them afterwards: the engine runs its own code, nothing is replaced.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.gpu_models import Shape
from kvtier.bench.gpu_speed import decode_batch, sync

# label -> (the attribute of the engine that owns the method, "" for the engine itself; the method)
PHASES = {
    "step": ("", "step"),
    "schedule": ("scheduler", "schedule"),
    "forward": ("runner", "execute"),
    "plan": ("runner", "_plan"),  # inside the forward: the eager path's metadata as Python ints
    "sample": ("", "_sample"),
    "update": ("", "_update"),
}


# Untimed decode steps first: a batch's first steps also do its admission's bookkeeping (the sizing
# trackers' slices of its prompts' lookups), which is not a decode step's own work.
WARM_STEPS = 8


@dataclass
class PhaseRow:
    variant: str  # "<backend>" eager, or "<backend> + graphs"
    batch: int
    context: int  # prompt tokens per sequence
    step_ms: float  # wall time of a step (the median of the timed steps', as every column)
    schedule_ms: float
    plan_ms: float  # part of forward_host_ms (0 for a step through CUDA graphs: its rows are planned apart)
    forward_host_ms: float
    device_wait_ms: float
    sample_ms: float
    update_ms: float

    rest_ms: float  # the step minus its phases (the median of that difference, step by step)

    @property
    def host_per_row_us(self) -> float:
        """The engine's Python per row: scheduling, planning the metadata, sampling, outputs."""
        return 1000 * (self.schedule_ms + self.plan_ms + self.sample_ms + self.update_ms) / self.batch


@contextmanager
def method_clock(
    methods: dict[str, tuple[object, str]], waits: dict[str, Callable[[], None]] | None = None
) -> Iterator[Counter[str]]:
    """Seconds spent in each ``label: (object, method name)`` while the block runs (nested calls count
    in each of their labels). ``waits[label]`` runs right after that method returns, timed as
    ``<label>_wait``. The wrappers are instance attributes, removed on exit: the class's methods return."""
    spent: Counter[str] = Counter()
    for label, (owner, name) in methods.items():
        setattr(owner, name, _timed(getattr(owner, name), label, spent, (waits or {}).get(label)))
    try:
        yield spent
    finally:
        for owner, name in methods.values():
            delattr(owner, name)


def _timed(fn: Callable[..., Any], label: str, spent: Counter[str], wait: Callable[[], None] | None) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            spent[label] += t1 - t0
            if wait is not None:
                wait()
                spent[f"{label}_wait"] += time.perf_counter() - t1

    return timed


def phase_clock(engine: Any):  # noqa: ANN201 - method_clock's context manager
    """``method_clock`` over ``PHASES``, the forward's queued device work waited for (``forward_wait``)."""
    methods = {
        label: (getattr(engine, path) if path else engine, name) for label, (path, name) in PHASES.items()
    }
    return method_clock(methods, {"forward": sync})


def measure(
    llm: Any, variant: str, shape: Shape, batch: int, context: int, steps: int, seed: int, shared: int = 0,
    final_only: bool = False,
) -> PhaseRow:  # fmt: skip
    """One row: ``batch`` sequences after ``context``-token prompts (the first ``shared`` tokens the
    same), ``WARM_STEPS`` decode steps untimed, then ``steps`` timed; each phase's median over the steps
    (a shared machine's hiccups stay out of it). ``final_only``: requests as ``LLM.generate`` adds them."""
    per_step: dict[str, list[float]] = {label: [] for label in (*PHASES, "forward_wait")}
    with decode_batch(
        llm, shape, batch, context, WARM_STEPS + steps, seed, shared, final_only=final_only
    ) as engine:
        for _ in range(WARM_STEPS):
            engine.step()
        with phase_clock(engine) as acc:
            for _ in range(steps):
                before = dict(acc)
                engine.step()
                for label, values in per_step.items():
                    values.append(1000 * (acc[label] - before.get(label, 0.0)))
    parts = ("schedule", "forward", "forward_wait", "sample", "update")
    rest = [step - sum(per_step[p][i] for p in parts) for i, step in enumerate(per_step["step"])]
    ms = {label: statistics.median(values) for label, values in [*per_step.items(), ("rest", rest)]}
    return PhaseRow(
        variant, batch, context, ms["step"], ms["schedule"], ms["plan"], ms["forward"], ms["forward_wait"],
        ms["sample"], ms["update"], ms["rest"],
    )  # fmt: skip


def phase_rows(
    model_dir: Path,
    shape: Shape,
    batches: tuple[int, ...],
    context: int,
    steps: int,
    dtype: str,
    variants: list[tuple[str, bool]],  # (attention backend, eager)
) -> list[PhaseRow]:
    """Each variant's engine, warmed up, then a row per batch size."""
    from kvtier import LLM

    rows = []
    blocks = max(batches) * (-(-(context + steps + 1) // 16) + 1) + 64
    for backend, eager in variants:
        engine = dict(
            dtype=dtype, attention_backend=backend, kv_device_blocks=blocks, max_num_seqs=max(batches),
            enforce_eager=eager,
        )  # fmt: skip
        variant = backend if eager else f"{backend} + graphs"
        with LLM(str(model_dir), **engine) as llm:
            measure(llm, variant, shape, 2, min(context, 64), 4, seed=1)  # warm-up: kernels compiled
            rows += [measure(llm, variant, shape, b, context, steps, seed=b) for b in batches]
    return rows
