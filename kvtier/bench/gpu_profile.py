"""``kvtier bench gpu`` part 6: where a decode step's time goes, and a host-tier load's (``torch.profiler``).

A batch decodes ``steps`` tokens under the profiler (CPU activity, and CUDA's where there is a GPU);
the rows are the operators and runtime calls with the most self time on the host, with their device
time beside them and their calls per step. A step far slower than its kernels shows here: host work
between launches, or a copy or synchronization (``cudaMemcpyAsync``, ``cudaStreamSynchronize``) that
makes the host wait for the device every layer. Then one time to first token of a prompt loaded back
from the host tier (the ``ttft`` section's engine and its middle length), the same way, with the copies'
device time (``Memcpy HtoD`` / ``DtoH``) among the rows, after the same prompt's device hit (what the
forward costs the device once every block is in place). Each scope also lists its ``TOP_DEVICE``
operators and kernels by device time: a kernel that only runs on the device (a Triton kernel, a GEMM)
shows there with no host time of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.gpu_models import Shape, random_prompts

TOP = 15  # operators by self host time
TOP_DEVICE = 10  # ... and by self device time (kernels, Triton's among them, and copies)
_WATCH = (
    "cudaMemcpy",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaHostAlloc",
    "cudaGraphLaunch",
)
_COPIES = ("Memcpy",)  # the device's copies (HtoD, DtoH, DtoD): host time 0, device time theirs


@dataclass
class ProfileRow:
    scope: str  # "decode step" or "host load N": what the row's times are per
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
    return _rows(prof, "decode step", wall, steps)


def host_load_rows(
    model_dir: Path, shape: Shape, lengths: tuple[int, ...], dtype: str, backend: str
) -> list[ProfileRow]:
    """The top operators of one time to first token of a prompt (``lengths``' middle one) whose blocks
    come back from the host tier (pushed out of the device pool by other prompts first)."""
    from torch.profiler import ProfilerActivity, profile

    from kvtier import LLM
    from kvtier.bench.gpu_speed import _ttft, push_out, ttft_engine

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    n = sorted(lengths)[len(lengths) // 2]
    with LLM(str(model_dir), **ttft_engine(shape, lengths, dtype, backend)) as llm:
        prompt = random_prompts(1, n, 3, shape.vocab)[0]
        for _ in range(2):  # computed, then a device hit: kernels compiled
            _ttft(llm, prompt)
        with profile(activities=activities) as hit:
            hit_ms, _ = _ttft(llm, prompt)
        push_out(llm, shape, lengths, 5)
        _ttft(llm, prompt)  # a host load, unprofiled (first-time allocations)
        push_out(llm, shape, lengths, 7)
        with profile(activities=activities) as prof:
            wall, _ = _ttft(llm, prompt)
    return _rows(hit, f"device hit {n}", hit_ms / 1000, 1) + _rows(prof, f"host load {n}", wall / 1000, 1)


def _rows(prof: Any, scope: str, wall: float, per: int) -> list[ProfileRow]:
    """A first row (the wall time of ``scope``), then the top operators by self host time, those that
    wait (``_WATCH``) and the copies, per ``per`` repetitions."""
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    by_device = sorted(events[TOP:], key=_self_device_us, reverse=True)[:TOP_DEVICE]
    busy = [e for e in by_device if _self_device_us(e) > 0]
    chosen = (
        events[:TOP]
        + busy
        + [e for e in events[TOP:] if e not in busy and e.key.startswith(_WATCH + _COPIES)]
    )
    rows = [ProfileRow(scope, "wall", 1.0, 1000 * wall / per, 0.0)]
    for e in chosen:
        rows.append(
            ProfileRow(
                scope,
                e.key[:60],
                e.count / per,
                e.self_cpu_time_total / 1000 / per,
                _self_device_us(e) / 1000 / per,
            )
        )
    return rows
