"""Prometheus metrics of the server, in a registry of their own, named like vLLM's under ``kvtier:``.

Two sources:

* the engine's :class:`EngineStats` snapshot (taken on the engine thread after every step). A custom
  collector turns it into gauges and counters when ``/metrics`` is scraped: the snapshot's counters are
  cumulative, so they are exposed as counters directly. Every tier label (each ``Medium``: "device",
  "host", "disk", "remote") is always present, with zeros for a tier the engine does not have;
* per-request latencies, observed into histograms on the engine thread from each step's
  ``RequestOutput``s (``arrival_time`` is when the HTTP request reached the server).

``kv_cache_usage_perc`` and ``tier_usage_perc`` are fractions in [0, 1], as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.outputs import RequestOutput
from kvtier.stats import REMOTE_ERROR_KINDS as ERROR_KINDS
from kvtier.stats import EngineStats, Medium, TierSnapshot

PREFIX = "kvtier:"
TIERS = tuple(Medium)
PREEMPTION_MODES = ("swap", "recompute")

# (name, help, EngineStats field) — gauges and cumulative counters read from the snapshot.
_GAUGES = (
    ("num_requests_running", "Sequences in the running batch.", "num_requests_running"),
    ("num_requests_waiting", "Sequences waiting to be scheduled.", "num_requests_waiting"),
    ("kv_cache_usage_perc", "Fraction of device KV blocks in use (0-1).", "kv_cache_usage"),
    (
        "running_cap",
        "Most sequences the running batch may hold now: its measured step time within the target "
        "(--itl-factor / --max-itl-ms), at most --max-num-seqs.",
        "running_cap",
    ),
    ("retained_keys", "Block keys under prompt-cache retention now (every tier).", "retained_keys"),
)
_COUNTERS = (
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens served from the prefix cache (any tier).", "prefix_cache_hits"),
    ("prompt_tokens", "Prompt tokens of admitted requests.", "prompt_tokens"),
    ("generation_tokens", "Generated tokens.", "generation_tokens"),
    (
        "retained_hit_tokens",
        "Prompt tokens of requests asking for retention (cache_control, prompt_cache_retention) served "
        "from the cache within what they retain.",
        "retained_hit_tokens",
    ),
)
# Per tier, labelled tier="device|host|disk|remote": (name, help, TierSnapshot attribute).
_TIER_GAUGES = (
    ("tier_usage_perc", "Fraction of the tier's blocks in use (0-1).", "usage"),
    ("tier_capacity_blocks", "Blocks the tier holds.", "capacity_blocks"),
    ("tier_used_blocks", "Blocks of the tier in use.", "used_blocks"),
    (
        "tier_retained_blocks",
        "Blocks the tier keeps from eviction for prompt-cache retention (times kv_block_bytes: bytes).",
        "retained_blocks",
    ),
)
_TIER_COUNTERS = (
    ("tier_lookups", "Blocks looked up in the tier.", "lookups"),
    ("tier_hit_blocks", "Blocks found in the tier.", "hit_blocks"),
    ("tier_hit_tokens", "Prompt tokens served from the tier.", "hit_tokens"),
    ("tier_blocks_loaded", "Blocks loaded from the tier into the device pool.", "blocks_loaded"),
    ("tier_bytes_loaded", "Bytes loaded from the tier.", "bytes_loaded"),
    ("tier_load_seconds", "Seconds spent loading from the tier.", "load_seconds"),
    ("tier_blocks_stored", "Blocks stored into the tier.", "blocks_stored"),
    ("tier_bytes_stored", "Bytes stored into the tier.", "bytes_stored"),
    ("tier_store_seconds", "Seconds spent storing into the tier.", "store_seconds"),
    ("tier_blocks_evicted", "Blocks evicted from the tier.", "blocks_evicted"),
)
# The remote tier's own series (zeros without one): errors by kind, and its circuit breaker.
_REMOTE_ERRORS = ("remote_errors", "Remote tier failures, by kind (each one a miss or a dropped store).")
_REMOTE_BREAKER = (
    "remote_breaker_state",
    "Remote tier circuit breaker: 0 closed (in use), 1 open (skipped).",
)
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_LATENCY_BUCKETS += (20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)

_EMPTY = EngineStats(0, 0, 0.0, 0, 0, {}, 0, 0, {})


def _tier(stats: EngineStats, medium: Medium) -> TierSnapshot:
    return stats.tiers.get(medium) or TierSnapshot(medium=medium, capacity_blocks=0, used_blocks=0)


class _StatsCollector(Collector):
    """Builds the snapshot's gauges and counters at scrape time."""

    def __init__(self, source: Callable[[], EngineStats | None]):
        self._source = source

    def describe(self) -> Iterator[Metric]:
        return self._families(_EMPTY)

    def collect(self) -> Iterator[Metric]:
        return self._families(self._source() or _EMPTY)

    def _families(self, stats: EngineStats) -> Iterator[Metric]:
        for name, doc, field in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(getattr(stats, field)))
        for name, doc, field in _COUNTERS:
            yield CounterMetricFamily(PREFIX + name, doc, value=float(getattr(stats, field)))
        preemptions = CounterMetricFamily(
            PREFIX + "num_preemptions", "Preempted sequences, by mode.", labels=["mode"]
        )
        modes = list(PREEMPTION_MODES) + sorted(set(stats.num_preemptions) - set(PREEMPTION_MODES))
        for mode in modes:
            preemptions.add_metric([mode], float(stats.num_preemptions.get(mode, 0)))
        yield preemptions
        for families, kind in ((_TIER_GAUGES, GaugeMetricFamily), (_TIER_COUNTERS, CounterMetricFamily)):
            for name, doc, attr in families:
                family = kind(PREFIX + name, doc, labels=["tier"])
                for medium in Medium:
                    family.add_metric([medium.value], float(getattr(_tier(stats, medium), attr)))
                yield family
        yield from _remote_families(_tier(stats, Medium.REMOTE))
        yield from _insight_families(stats)
        yield from _group_families(stats)


def _remote_families(remote: TierSnapshot) -> Iterator[Metric]:
    errors = CounterMetricFamily(PREFIX + _REMOTE_ERRORS[0], _REMOTE_ERRORS[1], labels=["kind"])
    for kind in list(ERROR_KINDS) + sorted(set(remote.errors) - set(ERROR_KINDS)):
        errors.add_metric([kind], float(remote.errors.get(kind, 0)))
    yield errors
    yield GaugeMetricFamily(
        PREFIX + _REMOTE_BREAKER[0], _REMOTE_BREAKER[1], value=float(remote.breaker_state)
    )


def _group_families(stats: EngineStats) -> Iterator[Metric]:
    """The device pool by KV group (one group, "0", full, for a dense model; none before a snapshot)."""
    labels = ["group", "kind"]
    in_use = GaugeMetricFamily(
        PREFIX + "kv_group_blocks_in_use",
        "Device KV blocks a KV group's tables hold (the groups share the pool's blocks).",
        labels=labels,
    )
    window = GaugeMetricFamily(
        PREFIX + "kv_group_window_tokens",
        "Tokens a KV group's sliding-window query sees (0: full attention).",
        labels=labels,
    )
    layers = GaugeMetricFamily(PREFIX + "kv_group_layers", "Model layers in a KV group.", labels=labels)
    for g in stats.kv_groups:
        at = [str(g.group), g.kind]
        in_use.add_metric(at, float(g.blocks_in_use))
        window.add_metric(at, float(g.window or 0))
        layers.add_metric(at, float(g.num_layers))
    yield from (in_use, window, layers)


def _insight_families(stats: EngineStats) -> Iterator[Metric]:
    """kvtier/insight: the equivalence canary's checks, and the miss-ratio curves (zeros without data)."""
    checks = CounterMetricFamily(
        PREFIX + "canary_checks",
        "Cached blocks rechecked against a recomputation, by result (match, mismatch) and serving tier.",
        labels=["result", "tier"],
    )
    for result in ("match", "mismatch"):
        for medium in Medium:
            checks.add_metric(
                [result, medium.value], float(stats.canary_checks.get((result, medium.value), 0))
            )
    yield checks
    mrc = GaugeMetricFamily(
        PREFIX + "kv_mrc_hit_ratio",
        "Estimated prompt-block hit ratio (all tiers) if the tier were size_factor times its size (0-1).",
        labels=["tier", "size_factor"],
    )
    for (tier, factor), ratio in sorted(stats.mrc_hit_ratio.items()):
        mrc.add_metric([tier, f"{factor:g}"], float(ratio))
    yield mrc


class ServerMetrics:
    """The server's metrics. ``on_add``/``on_abort``/``on_step`` run on the engine thread (an
    :class:`~kvtier.server.async_engine.EngineObserver`); ``render`` on any thread."""

    def __init__(self, stats_source: Callable[[], EngineStats | None]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StatsCollector(stats_source))
        r = self.registry
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Seconds from arrival to the first generated token.",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Seconds between two generated tokens of a sequence.",
            registry=r,
            buckets=_ITL_BUCKETS,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Seconds from arrival to the last token.",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Seconds from arrival to the first scheduled step.",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.requests_rejected = Counter(
            PREFIX + "requests_rejected",
            "Requests refused before admission, by reason.",
            ["reason"],
            registry=r,
        )
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(reason)
        for reason in ("queue_full", "invalid_request", "kv_capacity"):
            self.requests_rejected.labels(reason)
        self.role = Gauge(
            PREFIX + "role",
            "1 for the replica's role in disaggregated serving (kvtier serve --role): both, prefill, decode.",
            ["role"],
            registry=r,
        )
        self.set_role("both")
        # Engine-thread state: arrival times, whether the first token was seen, latest token times.
        self._arrivals: dict[str, float] = {}
        self._first_seen: set[str] = set()
        self._last_token: dict[str, dict[int, float]] = {}  # request id -> choice -> time

    def set_role(self, role: str) -> None:
        """Show ``role`` (``kvtier serve --role``) as ``kvtier:role{role="..."} 1``, the only series."""
        self.role.clear()
        self.role.labels(role).set(1)

    def watch_kv_admission(self, source: Callable[[], Any]) -> None:
        """Gauges of admission by KV capacity, read from ``source()`` (the latest ``EngineStats``, None
        before the model has loaded)."""
        demand = Gauge(
            PREFIX + "kv_demand_blocks",
            "KV blocks running and waiting requests still need, at most (prompt + max_tokens, minus "
            "cached blocks): the admission estimate.",
            registry=self.registry,
        )
        limit = Gauge(
            PREFIX + "kv_admission_limit_blocks",
            "Demand in KV blocks above which new requests get 503 (0: admission by KV capacity off).",
            registry=self.registry,
        )
        demand.set_function(lambda: float(getattr(source(), "kv_demand_blocks", 0)))
        limit.set_function(lambda: float(getattr(source(), "kv_admission_limit_blocks", 0)))

    # ----------------------------------------------------------------------- engine thread
    def on_add(self, request_id: str, arrival_time: float) -> None:
        self._arrivals[request_id] = arrival_time

    def on_abort(self, request_id: str) -> None:
        self.request_success.labels("abort").inc()
        self._forget(request_id)

    def on_step(self, outputs: list[RequestOutput], stats: EngineStats, now: float) -> None:
        for out in outputs:
            rid = out.request_id
            m = out.metrics
            arrival = self._arrivals.get(rid, m.get("arrival_time", now))
            if rid not in self._first_seen and "first_token_time" in m:
                self._first_seen.add(rid)
                self.ttft.observe(max(0.0, m["first_token_time"] - arrival))
                self.queue_time.observe(max(0.0, m.get("first_scheduled_time", now) - arrival))
            for completion in out.outputs:
                if not completion.num_new_tokens:
                    continue
                times = self._last_token.setdefault(rid, {})
                last = times.get(completion.index)
                if last is not None:
                    gap = (now - last) / completion.num_new_tokens
                    for _ in range(completion.num_new_tokens):
                        self.itl.observe(gap)
                times[completion.index] = now
            if out.finished:
                self.e2e.observe(max(0.0, m.get("finished_time", now) - arrival))
                reason = out.outputs[0].finish_reason if out.outputs else None
                self.request_success.labels(reason or "stop").inc()
                self._forget(rid)

    def _forget(self, request_id: str) -> None:
        self._arrivals.pop(request_id, None)
        self._first_seen.discard(request_id)
        self._last_token.pop(request_id, None)

    # ------------------------------------------------------------------------------- any thread
    def reject(self, reason: str) -> None:
        self.requests_rejected.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def names(self) -> set[str]:
        """Every metric family name the registry exposes (without ``_total``/``_bucket`` suffixes)."""
        return {family.name for family in self.registry.collect()}
