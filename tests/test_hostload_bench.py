"""``python -m benchmarks.hostload`` (BENCHMARKS.md) as a smoke run: both host loads are timed, phase by
phase, and really came from the host tier's path (allocation, copies, a forward)."""

from __future__ import annotations

import pytest

from benchmarks import hostload

pytestmark = pytest.mark.slow


def test_the_idle_and_the_busy_load_are_timed_phase_by_phase(capsys: pytest.CaptureFixture[str]) -> None:
    hostload.main(["--repeats", "1"])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("host load")]
    rows = {line.split("  ")[0]: line.split()[4:] for line in lines}  # "host load, idle engine", numbers
    assert set(rows) == {"host load, idle engine", "host load, busy engine"}
    for values in rows.values():
        ttft, ratio, *phases = map(float, values)
        spent = dict(zip(hostload.PHASES, phases, strict=True))
        assert ttft > 0 and ratio > 1  # loading back beats recomputing 8k tokens, even here
        assert spent["get_new_blocks"] > 0 and spent["_move_blocks"] > 0 and spent["_execute"] > 0
