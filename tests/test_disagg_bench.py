"""``kvtier bench disagg`` runs end to end on a tiny model with tiny parameters (a smoke run: the numbers
mean nothing here; the full benchmark is run by hand on a quiet machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main

pytestmark = pytest.mark.slow


def test_a_tiny_run_reports_both_splits_and_the_handoffs(
    tiny_llama_dir,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,  # noqa: ANN001
) -> None:
    model = str(tiny_llama_dir(max_position_embeddings=512))
    out = tmp_path / "disagg.json"
    flags = ["--model", model, "--users", "2", "--rounds", "2", "--doc-tokens", "5", "--answer-tokens", "4"]
    flags += [
        "--long-prompts",
        "2",
        "--long-tokens",
        "40",
        "--long-answer-tokens",
        "2",
        "--long-every-s",
        "0.5",
    ]
    flags += ["--system-tokens", "5", "--question-tokens", "5"]
    flags += ["--min-prompt-tokens", "64", "--device-blocks", "96", "--host-gb", "0.002"]
    flags += ["--max-model-len", "512", "--json", str(out)]
    assert main(["bench", "disagg", *flags]) == 0
    printed = capsys.readouterr().out
    assert "colocated" in printed and "disaggregated" in printed and "targets (issue 29)" in printed
    colocated, disaggregated = json.loads(out.read_text())
    assert colocated["errors"] == 0 and disaggregated["errors"] == 0
    assert colocated["handoffs"] == 0 and disaggregated["handoffs"] >= 2  # the long prompts at least
    assert disaggregated["bytes_per_handoff"] > 0 and disaggregated["output_tok_s"] > 0
    assert 0 < disaggregated["handoff_overhead_p50_s"] < 60  # the median, from the router's histogram
    assert colocated["itl_p50"] > 0 and disaggregated["long_ttft_p90"] > 0
