"""``kvtier bench agent`` end to end on a tiny model: two agents in tool loops, unrelated prompts pushing
through a 48-block device pool and a ~52-block host tier (retention may keep half of them). With
retention their steps read their prefix back from the cache; without, the pressure has pushed it out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_retention_keeps_the_agents_prefixes_under_pressure(tiny_llama_dir, tmp_path: Path) -> None:
    out = tmp_path / "agent.json"
    cmd = [
        sys.executable, "-m", "kvtier.cli", "bench", "agent", "--model", str(tiny_llama_dir()),
        "--agents", "2", "--steps", "3", "--system-tokens", "96", "--result-tokens", "16",
        "--pause-s", "0.05",
        "--pressure-tokens", "240", "--kv-device-blocks", "48", "--kv-host-gb", "0.0004", "--json", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "p90 step TTFT" in run.stdout and "unrelated tok/s" in run.stdout
    off, on = json.loads(out.read_text())
    assert (off["label"], on["label"]) == ("no retention", "cache_control (retained)")
    assert len(off["agent_ttft_s"]) == len(on["agent_ttft_s"]) == 2 * 2  # steps after each agent's first
    cached = [sum(r["agent_tokens_by_tier"].values()) / r["agent_prompt_tokens"] for r in (off, on)]
    assert cached[1] > 0.7 and cached[1] > cached[0] + 0.3, cached  # a step's new tokens: ~20-25%
    assert off["pressure_prompt_tokens"] > 0 and on["pressure_prompt_tokens"] > 0


def test_a_bad_flag_is_one_line() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "agent", "--kv-retain-max-fraction", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode != 0
