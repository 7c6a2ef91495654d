"""``kvtier bench gpu``, the prepared command for a lent GPU, as a smoke run on this CPU with tiny shapes.

The command must never rot between the sessions that have a GPU: here it runs every section end to end
through the real CLI (random checkpoints written on the spot, transformers as the CPU reference), its
JSON holds what each section measured, a reference from another checkpoint makes the exactness check
fail, and the checks table turns measured numbers into the issue's targets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kvtier.bench import gpu, gpu_exact, gpu_report, step_phases  # noqa: E402
from kvtier.bench.gpu_models import SHAPES, write_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu") / "gpu.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "kvtier.cli", "bench", "gpu", "--tiny", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {"stdout": run.stdout, "report": json.loads(out.read_text())}


def test_every_section_runs_and_kvtier_is_exact_on_this_device(smoke: dict) -> None:
    report = smoke["report"]
    assert report["device"] == "cpu" and not report["errors"]
    assert set(report["sections"]) | set(report["skipped"]) == set(gpu.SECTIONS)
    assert "kernels" in report["skipped"]  # no CUDA, no interpreter: the Triton rows do not run
    exact = report["sections"]["exact"]
    assert {(r["shape"], r["run"]) for r in exact} == {
        (s, run)
        for s in ("tiny-llama", "tiny-qwen3", "tiny-gemma3")
        for run in ("cached", "swap", "recompute")
    }
    for r in exact:
        assert r["tokens_equal"] == "4/4" and r["max_logprob_diff"] < 1e-4, r
    assert all(r["cached_tokens"] > 0 for r in exact)
    assert all(r["preemptions"] > 0 for r in exact if r["run"] != "cached")


def test_the_speed_sections_measure_what_they_name(smoke: dict) -> None:
    s = smoke["report"]["sections"]
    assert all(r["load_gbs"] > 0 and r["memcpy_h2d_gbs"] > 0 for r in s["transfer"])
    for r in s["ttft"]:  # the host row really came from the host tier, the device row from the pool
        assert r["host_tokens"] >= r["prompt_tokens"] - 16 and r["device_tokens"] >= r["prompt_tokens"] - 16
        assert r["busy_load_ms"] > 0 and r["host_load_ms"] > 0
    tiny = gpu.TINY
    cases = [(b, tiny.decode_context) for b in tiny.decode_batches]
    cases += [(max(tiny.decode_batches), c) for c in tiny.decode_long]
    assert [(r["batch"], r["context"]) for r in s["decode"]] == cases
    assert all(
        r["torch_tok_s"] > 0 and r["triton_tok_s"] is r["triton_eager_tok_s"] is None for r in s["decode"]
    )
    (overlap,) = s["overlap"]
    assert overlap["load_ms"] > 0 and overlap["forward_ms"] > 0
    assert "check" in smoke["stdout"] and "exact: tiny-gemma3 torch swap" in smoke["stdout"]
    scopes = {r["scope"] for r in s["profile"]}
    middle = sorted(gpu.TINY.ttft_lengths)[1]
    assert scopes == {"decode step", f"device hit {middle}", f"host load {middle}"}
    for scope in scopes:
        wall, *ops = [r for r in s["profile"] if r["scope"] == scope]
        assert wall["name"] == "wall" and wall["host_ms_per_step"] > 0
        assert any(r["name"].startswith("aten::") and r["calls_per_step"] > 0 for r in ops)
    copies = {r["scope"]: r["calls_per_step"] for r in s["profile"] if r["name"] == "aten::copy_"}
    assert copies[f"host load {middle}"] > copies.get(f"device hit {middle}", 0)  # a hit may list none
    assert [(r["variant"], r["batch"]) for r in s["phases"]] == [("torch", b) for b in gpu.TINY.phase_batches]
    for r in s["phases"]:  # each phase took time, and together they fit in the step
        parts = [r[k] for k in ("schedule_ms", "forward_host_ms", "sample_ms", "update_ms")]
        assert all(p > 0 for p in parts) and r["device_wait_ms"] >= 0
        assert 0 < r["plan_ms"] < r["forward_host_ms"]  # eager: the runner plans the step's metadata
        assert sum(parts) <= 1.5 * r["step_ms"]  # medians of each: about the step's
    *moved, load = s["layered"]  # the mover alone, then the 8k-like load both ways in one engine
    assert [r["exact"] for r in moved] == ["yes", "yes"] and all(r["layered_ms"] > 0 for r in moved)
    assert load["gated"] == "3/3" and load["exact"] == "6/6" and load["recompute_ms"] > 0


def test_the_phase_clock_times_an_objects_own_methods_and_puts_them_back() -> None:
    class Engine:
        def step(self) -> int:
            return self.inner() + 1

        def inner(self) -> int:
            time.sleep(0.01)
            return 1

    engine, waited = Engine(), []
    with step_phases.method_clock(
        {"step": (engine, "step"), "inner": (engine, "inner")}, {"inner": lambda: waited.append(1)}
    ) as spent:
        assert engine.step() == 2 and engine.step() == 2
    assert spent["step"] >= spent["inner"] >= 0.02 and spent["inner_wait"] >= 0 and waited == [1, 1]
    assert "step" not in vars(engine) and "inner" not in vars(engine)  # the class's methods again


def test_a_reference_from_other_weights_fails_the_exactness_check(tmp_path: Path) -> None:
    shape = SHAPES["tiny-llama"]
    ours, other = (
        write_checkpoint(shape, tmp_path / "a", seed=0),
        write_checkpoint(shape, tmp_path / "b", seed=1),
    )
    prompts = gpu_exact.exact_prompts(shape, 24)
    ref = gpu_exact.reference(other, prompts, None)
    got = gpu_exact.kvtier_run(ours, prompts, "torch", "cached")
    assert got["answers"] != ref["answers"]
    row = gpu_exact.ExactRow("tiny-llama", "torch", "cached", "cpu", "0/4", 1.0, 0, 0)
    assert not row.ok


def test_the_checks_table_holds_measurements_against_the_targets() -> None:
    report = gpu.Report("NVIDIA H200", "2.11", "3.6", {"ttft_lengths": list(gpu.FULL.ttft_lengths)})
    report.sections = {
        "ttft": [
            {"prompt_tokens": 8192, "recompute_ms": 120.0, "host_load_ms": 10.0, "device_hit_ms": 8.0,
             "busy_load_ms": 20.0},
        ],
        "transfer": [
            {"blocks": 1024, "pattern": "contiguous", "load_gbs": 40.0, "store_gbs": 30.0,
             "memcpy_h2d_gbs": 45.0, "memcpy_d2h_gbs": 45.0},
        ],
        "decode": [
            {"batch": b, "context": c, "triton_tok_s": 2 * e, "triton_eager_tok_s": e, "torch_tok_s": t}
            for b, c, e, t in [(16, 1024, 300.0, 300.0), (64, 1024, 900.0, 300.0), (64, 4096, 500.0, 250.0)]
        ],
    }  # fmt: skip
    rows = {r[0]: r for r in gpu_report._checks(report)}
    assert rows["ttft 8192: recompute / host load (idle)"][1:] == ["12.0x", ">= 10x", True]
    assert rows["ttft 8192: recompute / host load (busy)"][1:] == ["6.0x", ">= 10x", False]
    assert rows["transfer 1024 blocks: mover / memcpy"][1:] == ["67%", ">= 80%", False]  # the store's 30/45
    assert rows["decode batch 64, 1024 tokens: triton / torch (eager)"][1:] == ["3.00x", ">= 3x", True]
    assert rows["decode batch 64, 4096 tokens: triton / torch (eager)"][1:] == ["2.00x", ">= 3x", False]
    assert not any(r.startswith("decode batch 16") for r in rows)  # the target is at the largest batch
    assert gpu_report.print_report(report) == 0  # a missed speed target is a finding, not a failure
    report.errors["decode"] = "Traceback ..."
    assert gpu_report.print_report(report) == 1


def test_an_unknown_section_is_one_config_error() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "gpu", "--sections", "exact,warp"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert run.stderr.strip().count("\n") == 0 and "unknown warp" in run.stderr
