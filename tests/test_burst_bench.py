"""``python -m benchmarks.burst`` (BENCHMARKS.md) as a smoke run against a real ``kvtier serve``: a quiet
server, one long prompt beside a stream, then a burst; the row says what the burst got."""

from __future__ import annotations

import pytest

from benchmarks import burst

pytestmark = pytest.mark.slow


def test_a_burst_after_a_long_prompt_gets_a_row(capsys: pytest.CaptureFixture[str]) -> None:
    burst.main(["--quiet", "3", "--long-tokens", "300", "--burst", "4"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["checkout", "round"]
    row = lines[1].split()
    cap_before, cap_after, refused, served = float(row[2]), float(row[3]), int(row[4]), int(row[5])
    assert cap_before >= 1 and cap_after >= 1 and refused + served == 4 and served >= 1


def test_bad_arguments_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        burst.main(["--checkouts", "/nonexistent"])
    assert exit_info.value.code == 2 and "no kvtier package" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        burst.main(["--burst", "0"])
