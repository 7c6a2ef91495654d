"""``python -m benchmarks.stephost`` (BENCHMARKS.md) as a smoke run: a decode step's host work is timed
phase by phase, for every batch and context asked for."""

from __future__ import annotations

import pytest

from benchmarks import stephost

pytestmark = pytest.mark.slow


def test_each_batch_and_context_gets_a_row_of_phases(capsys: pytest.CaptureFixture[str]) -> None:
    stephost.main(["--steps", "4", "--contexts", "64,160", "--batches", "1,3"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line[:1] == " " or line[:1].isdigit()]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(1, 64), (3, 64), (1, 160), (3, 160)]
    for r in rows:
        step, schedule, plan, forward, sample, update, rest, per_row = map(float, r[2:])
        assert step > 0 and schedule > 0 and sample > 0 and update > 0 and per_row > 0
        assert 0 < plan < forward
