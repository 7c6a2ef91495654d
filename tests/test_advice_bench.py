"""``kvtier bench advice``'s two halves on a tiny model: a recorded run whose engine trackers equal a
replay's of its trace (the advice is deterministic for a recorded trace) and whose host curve matches
the replayed tiers; and the canary cost run's counters (checks, recomputed vs computed tokens)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvtier.bench.advice import (
    CanaryProxy,
    Trace,
    canary_cost,
    print_canary_cost,
    print_curve_tables,
    record,
    replay,
)
from kvtier.bench.multiturn import Workload
from kvtier.models.loader import load_model

BLOCK_BYTES = 8192  # the tiny model's float32 block


def workload(convs: int = 4, turns: int = 3) -> Workload:
    rng = random.Random(0)
    system = [rng.randrange(3, 500) for _ in range(40)]
    firsts = [system + [rng.randrange(3, 500) for _ in range(60)] for _ in range(convs)]
    suffixes = [[[rng.randrange(3, 500) for _ in range(12)] for _ in range(turns - 1)] for _ in range(convs)]
    return Workload(firsts, suffixes, 4, 40)


@pytest.mark.slow
def test_story_bench_advice_on_a_tiny_model(tiny_llama_dir: Any, capsys: pytest.CaptureFixture[str]) -> None:
    loaded = load_model(tiny_llama_dir())
    work = workload()
    base = {"kv_device_blocks": 12, "max_model_len": 160, "num_threads": 1}
    host = 10
    trace, advice, snap = record(loaded, work, {**base, "kv_host_gb": host * BLOCK_BYTES / 2**30})
    assert len(trace.requests) == 12 and advice["tiers"]["host"]["capacity_blocks"] == host

    # The recording's trackers are a replay's: the same trace gives the same curves.
    ratio, replayed = replay(trace, 12, host)
    assert replayed == snap and ratio == pytest.approx(advice["measured"])
    print_curve_tables(trace, advice, snap, 12, host)
    out = capsys.readouterr().out
    assert "replay's tracker == engine's tracker on the recorded trace: yes" in out
    assert "(target <= 5): met" in out

    # The canary at 1.0 (to see checks in a few requests) against 0: interleaved, counted.
    runs = canary_cost(loaded, work, {**base, "kv_host_gb": host * BLOCK_BYTES / 2**30}, 24, (0.0, 1.0))
    off, on = runs
    assert off.checks == off.recomputed == 0 and len(off.seconds) == len(on.seconds) == 2
    assert on.checks >= 10 and on.blocks >= on.checks and on.recomputed > 0
    assert (
        off.requests == on.requests == 24 and off.computed == on.computed > 0
    )  # the same answers, the same cache hits
    assert 0 < on.canary_seconds < sum(on.seconds)
    print_canary_cost(runs)
    assert "recomputed / computed tokens" in capsys.readouterr().out

    # The work proxy (no model: the replay's own canary sampling and picks) is the engine's work.
    proxy = CanaryProxy(1.0)
    replay(Trace(trace.requests * 2, trace.extra_keys, trace.block_size), 12, host, canary=proxy)
    assert (proxy.requests, proxy.checks) == (24, on.checks)
    assert (proxy.recomputed, proxy.computed) == (on.recomputed, on.computed)
