"""``python -m benchmarks.hostload`` (BENCHMARKS.md) as a smoke run: both host loads are timed, phase by
phase, and really came from the host tier's path (allocation, copies, a forward)."""

from __future__ import annotations

import pytest

from benchmarks import hostload

pytestmark = pytest.mark.slow


def test_the_idle_and_the_busy_load_are_timed_phase_by_phase(capsys: pytest.CaptureFixture[str]) -> None:
    hostload.main(["--repeats", "1"])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("run "))
    names = header.split()[1:]  # the columns after "run"
    rows = {
        line.split("  ")[0]: dict(zip(names, map(float, line.split("  ", 1)[1].split()), strict=True))
        for line in out.splitlines()
        if line.startswith(("device hit", "host load"))
    }
    assert set(rows) == {"device hit", "host load, idle engine", "host load, busy engine"}
    for spent in rows.values():
        assert spent["ttft_ms"] > 0 and spent["recompute_ratio"] > 1  # beats recomputing 8k tokens, even here
        assert spent["forward_ms"] > 0 and spent["add_request_ms"] > 0
    hit, load = rows["device hit"], rows["host load, idle engine"]
    assert hit["get_new_blocks_ms"] < 0.25 * load["get_new_blocks_ms"]  # a hit takes no new block
    # the load's copies run inside its allocation (as soon as they are planned): a hit copies nothing
    assert hit["allocate_slots_ms"] < 0.5 * load["allocate_slots_ms"]
