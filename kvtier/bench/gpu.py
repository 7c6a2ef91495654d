"""``kvtier bench gpu``: the one prepared command for a lent GPU. Is kvtier exact there, and how fast?

::

    kvtier bench gpu                      # on CUDA: the 1B / Qwen3 shapes, ~3-5 minutes on one H100/H200
    kvtier bench gpu --tiny               # anywhere: tiny shapes, a smoke run (CI runs it on the CPU)
    python3 -m kvtier.cli bench gpu --json $OUT/gpu.json      # from a checkout on a lent machine

No download, no model file: random-weight checkpoints of real shapes are written on the spot
(``gpu_models.py``). It needs torch, transformers (the reference) and, for the Triton rows, triton.
Sections (``--sections``, in this order; each one's failure is reported and the others still run):

    kernels   the Triton kernels against the torch path on the device (decode split-K, windows,
              prefill after cached blocks; bfloat16, fp8_e4m3, int8 pools)
    transfer  host↔device block copies through the mover vs a plain pinned cudaMemcpy
    decode    tokens/s at batch 1 / 16 / 64 after 1k-token prompts, and 64 after 4k: Triton kernels vs
              gather + SDPA (1B shape, bf16)
    overlap   how much of a host→device load the forward hides (the engine's order, and the bound)
    ttft      2k / 8k / 32k-token prompts: recompute vs host-tier load vs device hit (1B shape, bf16)
    loads     the 8k prompt's device hit and host loads (idle and busy engine) split by engine phase:
              lookup and allocation, the copies enqueued, the forward's launches, the wait for the
              device (the copies' remainder and the forward), sampling and outputs
    profile   where a decode step's time goes (batch 1) and a host-tier load's (8k tokens):
              torch.profiler's top operators, runtime calls and copies
    phases    a decode step's wall time split by engine phase (schedule, forward launches, the wait for
              the device, sampling, outputs) at batch 1 and 64, each backend eager and Triton's graphs
    exact     greedy tokens and every token's logprob of kvtier (float32, on the device, each attention
              backend) against transformers on the CPU, Llama 3.2 1B, Qwen3 0.6B and Gemma 3 270M
              shapes (the last with sliding-window layers: two KV groups); each run's time and
              Triton compiles printed as it ends
    layered   host loads copied whole against layer slot by layer slot (--layered-loads): the mover
              alone (1,024 blocks), and the 8k prompt's idle load in one engine, both ways in turn

The last table checks the issue's targets: host load of an 8k prefix ≥ 10x faster than recomputing it,
mover ≥ 80% of cudaMemcpy, Triton decode at batch 64 ≥ 3x the torch path. Results also go to ``--json``
(written after every section, so a run cut short keeps what it measured). Exit status 1 when a section
failed or kvtier was not exact.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class Skipped(Exception):
    """A section that cannot run on this machine (not a failure)."""


# The run order: exactness last, so that a run that hangs there (as one on an H200 did on 2026-11-28, in a
# Qwen3 or Gemma 3 run) leaves every speed section measured (--json is written after each section).
# ``layered`` after it: the first CUDA run of its 2-D copies and of event waits inside captured graphs.
SECTIONS = (
    "kernels", "transfer", "decode", "overlap", "ttft", "loads", "profile", "phases", "exact", "layered",
)  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """What the run measures: the full shapes on CUDA, tiny ones for a smoke run."""

    exact_shapes: tuple[str, ...]
    speed_shape: str
    exact_prefix: int
    kernel_shrink: int  # the kernel cases' contexts divided by this
    transfer_blocks: tuple[int, ...]
    ttft_lengths: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_context: int
    decode_tokens: int
    phase_batches: tuple[int, ...]  # the phases section's batches (after decode_context-token prompts)
    overlap: tuple[int, int, int]  # batch, context, blocks loaded
    profile: tuple[int, int]  # batch, decode steps
    dtype: str  # the speed sections' compute dtype
    # more decode rows at the largest batch after prompts this long: at 1,024 tokens both eager paths
    # were bound by their launches on an H200 (2026-11-28: 1.3x at 4,096), so the kernels' own speed
    # shows only here (each prompt its own: a shared prefix would sit in L2 for every row)
    decode_long: tuple[int, ...] = ()


FULL = Plan(("llama-3.2-1b", "qwen3-0.6b", "gemma3-270m"), "llama-3.2-1b", 64, 1, (64, 256, 1024),
            (2048, 8192, 32768), (1, 16, 64), 1024, 32, (1, 64), (32, 1024, 512), (1, 16),
            "bfloat16", decode_long=(4096, 8192))  # fmt: skip
TINY = Plan(("tiny-llama", "tiny-qwen3", "tiny-gemma3"), "tiny-llama", 40, 50, (4, 16), (64, 128, 256),
            (1, 4), 32, 8, (1, 4), (4, 32, 8), (1, 4), "float32", decode_long=(64,))  # fmt: skip


@dataclass
class Report:
    device: str
    torch: str
    triton: str | None
    plan: dict[str, Any]
    sections: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run (the default without CUDA)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {','.join(SECTIONS)}")
    p.add_argument("--json", default=None, help="write the results here (after every section)")
    p.add_argument("--workdir", default=None, help="where the random checkpoints go (default: a temp dir)")
    p.set_defaults(func=main)


def backends(device_type: str) -> list[str]:
    """The torch path always; the Triton kernels where they run (CUDA, or the interpreter)."""
    from kvtier.config import ConfigError
    from kvtier.models.attention_backend import resolve

    try:
        return ["torch", resolve("triton", device_type)]
    except ConfigError:
        return ["torch"]


def main(ns: argparse.Namespace) -> int:
    import torch

    from kvtier.config import ConfigError

    cuda = torch.cuda.is_available()
    plan = TINY if ns.tiny or not cuda else FULL
    wanted = [s.strip() for s in ns.sections.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"--sections: unknown {', '.join(unknown)} (choose from {', '.join(SECTIONS)})")
    report = Report(
        torch.cuda.get_device_name() if cuda else "cpu", torch.__version__, _triton_version(), asdict(plan)
    )
    print(f"kvtier bench gpu: {report.device}, torch {report.torch}, triton {report.triton}", flush=True)
    with tempfile.TemporaryDirectory(dir=ns.workdir) as tmp:
        for name in (s for s in SECTIONS if s in wanted):
            _run_section(name, plan, Path(tmp), report, ns.json)
    from kvtier.bench.gpu_report import print_report

    return print_report(report)


def _triton_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")  # not imported: only triton_attention.py imports triton
    except PackageNotFoundError:
        return None


def _run_section(name: str, plan: Plan, workdir: Path, report: Report, json_path: str | None) -> None:
    from kvtier.bench import gpu_report

    print(f"-- {name}", flush=True)
    t0 = time.perf_counter()
    try:
        rows = SECTION_RUNNERS[name](plan, workdir)
        report.sections[name] = [asdict(r) for r in rows]
        gpu_report.print_section(name, rows)
    except Skipped as why:
        report.skipped[name] = str(why)
        print(f"   skipped: {why}", flush=True)
    except Exception as exc:  # one section's failure is reported; the others still run
        report.errors[name] = "".join(traceback.format_exception(exc)[-6:])
        print(f"   {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    report.seconds[name] = round(time.perf_counter() - t0, 1)
    if json_path:
        Path(json_path).write_text(json.dumps(asdict(report), indent=2, default=str))


def _checkpoint(name: str, workdir: Path) -> Path:
    from kvtier.bench.gpu_models import SHAPES, write_checkpoint

    directory = workdir / name
    if not (directory / "config.json").exists():
        write_checkpoint(SHAPES[name], directory)
    return directory


def _device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _exact(plan: Plan, workdir: Path) -> list[Any]:
    from kvtier.bench.gpu_exact import exactness
    from kvtier.bench.gpu_models import SHAPES

    rows = []
    for name in plan.exact_shapes:
        rows += exactness(
            SHAPES[name], _checkpoint(name, workdir), backends(_device_type()), plan.exact_prefix
        )
    return rows


def _kernels(plan: Plan, workdir: Path) -> list[Any]:
    import torch

    from kvtier.bench.gpu_exact import kernel_rows
    from kvtier.bench.gpu_models import SHAPES

    if "triton" not in backends(_device_type()):
        raise Skipped("the Triton kernels do not run here (no CUDA; TRITON_INTERPRET=1 runs them on a CPU)")
    s = SHAPES[plan.speed_shape]
    return kernel_rows(torch.device(_device_type()), s.heads, s.kv_heads, s.head_dim, plan.kernel_shrink)


def _transfer(plan: Plan, workdir: Path) -> list[Any]:
    import torch

    from kvtier.bench.gpu_models import SHAPES
    from kvtier.bench.gpu_speed import transfer_rows

    dtype = getattr(torch, plan.dtype)
    return transfer_rows(SHAPES[plan.speed_shape], plan.transfer_blocks, dtype)


def _ttft(plan: Plan, workdir: Path) -> list[Any]:
    from kvtier.bench.gpu_models import SHAPES
    from kvtier.bench.gpu_speed import ttft_rows

    name = plan.speed_shape
    backend = backends(_device_type())[-1]
    return ttft_rows(_checkpoint(name, workdir), SHAPES[name], plan.ttft_lengths, plan.dtype, backend)


def _loads(plan: Plan, workdir: Path) -> list[Any]:
    from kvtier.bench.gpu_models import SHAPES
    from kvtier.bench.load_phases import load_phase_rows

    name = plan.speed_shape
    backend = backends(_device_type())[-1]
    return load_phase_rows(_checkpoint(name, workdir), SHAPES[name], plan.ttft_lengths, plan.dtype, backend)


def _decode(plan: Plan, workdir: Path) -> list[Any]:
    from kvtier.bench.gpu_models import SHAPES
    from kvtier.bench.gpu_speed import decode_rows

    name, p = plan.speed_shape, plan
    cases = [(b, p.decode_context) for b in p.decode_batches]
    cases += [(max(p.decode_batches), c) for c in p.decode_long]
    args = (cases, p.decode_tokens, p.dtype, backends(_device_type()))
    return decode_rows(_checkpoint(name, workdir), SHAPES[name], *args)


def _phases(plan: Plan, workdir: Path) -> list[Any]:
    from kvtier.bench.gpu_models import SHAPES
    from kvtier.bench.step_phases import phase_rows

    name, device = plan.speed_shape, _device_type()
    found = backends(device)
    graphs = [("triton", False)] if device == "cuda" and "triton" in found else []  # captured on CUDA only
    variants = [(b, True) for b in found] + graphs
    args = (plan.phase_batches, plan.decode_context, 16, plan.dtype, variants)
    return phase_rows(_checkpoint(name, workdir), SHAPES[name], *args)


def _overlap(plan: Plan, workdir: Path) -> list[Any]:
    from kvtier.bench.gpu_models import SHAPES
    from kvtier.bench.gpu_overlap import overlap_row

    name = plan.speed_shape
    backend = backends(_device_type())[-1]
    return [overlap_row(_checkpoint(name, workdir), SHAPES[name], plan.dtype, backend, *plan.overlap)]


def _profile(plan: Plan, workdir: Path) -> list[Any]:
    from kvtier.bench.gpu_models import SHAPES
    from kvtier.bench.gpu_profile import host_load_rows, profile_rows

    name = plan.speed_shape
    backend = backends(_device_type())[-1]
    model = _checkpoint(name, workdir)
    decode = profile_rows(model, SHAPES[name], plan.dtype, backend, *plan.profile)
    return decode + host_load_rows(model, SHAPES[name], plan.ttft_lengths, plan.dtype, backend)


def _layered(plan: Plan, workdir: Path) -> list[Any]:
    import torch

    from kvtier.bench.gpu_layered import copy_rows, ttft_row
    from kvtier.bench.gpu_models import SHAPES

    name = plan.speed_shape
    backend = backends(_device_type())[-1]
    rows = copy_rows(SHAPES[name], plan.transfer_blocks[-1:], getattr(torch, plan.dtype))
    return [*rows, ttft_row(_checkpoint(name, workdir), SHAPES[name], plan.ttft_lengths, plan.dtype, backend)]


SECTION_RUNNERS = {
    "layered": _layered,
    "exact": _exact,
    "kernels": _kernels,
    "transfer": _transfer,
    "ttft": _ttft,
    "loads": _loads,
    "profile": _profile,
    "decode": _decode,
    "phases": _phases,
    "overlap": _overlap,
}
