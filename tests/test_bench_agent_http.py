"""``kvtier bench agent`` over HTTP, smoke-sized on a tiny model: ``--url`` against a running ``kvtier
serve`` (uvicorn on a thread of this process), and ``--cluster`` (two replicas sharing a real Redis behind
``kvtier router``, started by the benchmark). The agents' requests are real streamed ``/v1/messages``
calls; each run reports client-side step TTFTs and the prompt tokens by tier from the answers' usage."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier import LLM
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.serve import serve_in_thread

SMALL = [
    "--agents", "2", "--steps", "3", "--system-tokens", "30", "--answer-tokens", "4",
    "--result-tokens", "8", "--pause-s", "0.05", "--pressure-tokens", "80", "--pressure-concurrency", "1",
]  # fmt: skip


def bench(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvtier.cli", "bench", "agent", *SMALL, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def check(out: Path) -> list[dict]:
    off, on = json.loads(out.read_text())
    assert (off["label"], on["label"]) == ("no cache_control", "cache_control (retained)")
    for run in (off, on):
        assert len(run["agent_ttft_s"]) == 2 * 2 and all(0 < t < 120 for t in run["agent_ttft_s"])
        assert run["agent_prompt_tokens"] > 2 * 2 * 30 and run["pressure_prompt_tokens"] > 0
    cached = sum(on["agent_tokens_by_tier"].values()) / on["agent_prompt_tokens"]
    assert cached > 0.5, on  # each step's prefix came back from the cache
    return [off, on]


def test_bench_agent_against_a_running_server(tiny_llama_dir: Callable[..., Path], tmp_path: Path) -> None:
    model = str(tiny_llama_dir(max_position_embeddings=2048))
    settings = ServerSettings(model_name="tiny", api_key="sesame")
    server = serve_in_thread(
        create_app(lambda: LLM(model, kv_device_blocks=256, num_threads=1).engine, settings)
    )
    server.wait_ready()
    try:
        out = tmp_path / "agent.json"
        run = bench("--url", server.url, "--api-key", "sesame", "--json", str(out), timeout=300)
    finally:
        server.stop()
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"at {server.url}" in run.stdout and "p90 step TTFT" in run.stdout
    check(out)


@pytest.mark.slow
def test_bench_agent_through_the_router_over_two_replicas_and_redis(
    tiny_llama_dir: Callable[..., Path], tmp_path: Path
) -> None:
    if shutil.which("redis-server") is None and not Path("/usr/bin/redis-server").exists():
        pytest.skip("redis-server is not installed")
    model = str(tiny_llama_dir(max_position_embeddings=2048))
    out = tmp_path / "agent.json"
    flags = ["--model", model, "--kv-device-blocks", "256", "--kv-host-gb", "0.01", "--num-threads", "1"]
    run = bench("--cluster", *flags, "--json", str(out), timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "through kvtier router, 2 replicas + Redis" in run.stdout
    check(out)
