"""``histogram_quantile`` over a real ``prometheus_client`` histogram's /metrics text: the bucket's upper
bound, or (``interpolate``) PromQL's linear guess inside it (``kvtier bench disagg``'s handoff p50)."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvtier.bench.cluster_report import histogram_quantile


def samples_of(values: list[float], buckets: tuple[float, ...]) -> dict[str, float]:
    """What ``kvtier.bench.cluster.scrape`` makes of the page of a histogram that observed ``values``."""
    registry = CollectorRegistry()
    h = Histogram("handoff_seconds", "test", buckets=buckets, registry=registry)
    for v in values:
        h.observe(v)
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_the_median_is_the_buckets_bound_or_a_guess_inside_it() -> None:
    m = samples_of([0.62, 0.68, 0.74, 0.81], (0.1, 0.5, 1.0, 2.0))  # all four in (0.5, 1.0]
    assert histogram_quantile(m, "handoff_seconds", 0.5) == 1.0
    assert math.isclose(histogram_quantile(m, "handoff_seconds", 0.5, interpolate=True), 0.75)
    m = samples_of([0.05, 0.3, 0.7, 1.5], (0.1, 0.5, 1.0, 2.0))  # one a bucket: the 2nd is (0.1, 0.5]
    assert math.isclose(histogram_quantile(m, "handoff_seconds", 0.5, interpolate=True), 0.5)
    assert math.isnan(histogram_quantile(samples_of([], (0.1, 1.0)), "handoff_seconds", 0.5))


def test_past_the_last_bound_the_guess_is_that_bound() -> None:
    m = samples_of([5.0, 6.0], (0.1, 1.0))  # both in the open +Inf bucket
    assert histogram_quantile(m, "handoff_seconds", 0.5, interpolate=True) == 1.0
    assert histogram_quantile(m, "handoff_seconds", 0.5) == math.inf
