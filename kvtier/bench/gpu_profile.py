"""``kvtier bench gpu`` part 6: where a decode step's time goes (``torch.profiler``).

A batch decodes ``steps`` tokens under the profiler (CPU activity, and CUDA's where there is a GPU);
the rows are the operators and runtime calls with the most self time on the host, with their device
time beside them and their calls per step. A step far slower than its kernels shows here: host work
between launches, or a copy or synchronization (``cudaMemcpyAsync``, ``cudaStreamSynchronize``) that
makes the host wait for the device every layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.bench.gpu_models import Shape, random_prompts

TOP = 15
_WATCH = (
    "cudaMemcpy",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaHostAlloc",
)


@dataclass
class ProfileRow:
    name: str
    calls_per_step: float
    host_ms_per_step: float  # self time on the host
    device_ms_per_step: float  # self time of its kernels on the device


def _self_device_us(event: object) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_rows(
    model_dir: Path, shape: Shape, dtype: str, backend: str, batch: int, steps: int
) -> list[ProfileRow]:
    """The top operators of ``steps`` decode steps of ``batch`` sequences, and a first row ``step``: the
    wall time of a step."""
    from torch.profiler import ProfilerActivity, profile

    from kvtier import LLM, SamplingParams

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    with LLM(str(model_dir), dtype=dtype, attention_backend=backend, max_num_seqs=batch) as llm:
        llm.generate(random_prompts(batch, 64, 1, shape.vocab), params)  # warm-up
        prompts = random_prompts(batch, 64, 2, shape.vocab)
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))  # the prompts' prefill, cached
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            wall = time.perf_counter() - t0
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    chosen = events[:TOP] + [e for e in events[TOP:] if e.key.startswith(_WATCH)]
    rows = [ProfileRow("step (wall)", 1.0, 1000 * wall / steps, 0.0)]
    for e in chosen:
        rows.append(
            ProfileRow(
                e.key[:60],
                e.count / steps,
                e.self_cpu_time_total / 1000 / steps,
                _self_device_us(e) / 1000 / steps,
            )
        )
    return rows
