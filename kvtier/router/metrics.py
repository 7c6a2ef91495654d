"""The router's Prometheus metrics, under ``kvtier_router:``, in a registry of their own.

::

    kvtier_router:requests_routed_total{replica, reason}     reason: cache_hit, load, fallback,
                                                             round_robin, retry, affinity
                                                             (kvtier.router.policy)
    kvtier_router:request_failures_total{reason}             no_replica, upstream (no byte sent back)
    kvtier_router:handoffs_total{outcome}                    disaggregation (kvtier.router.disagg):
                                                             handoff, prefill_failed, short, unscored,
                                                             no_decode; reasons prefill and handoff above
    kvtier_router:handoff_seconds                            histogram: prefill sent -> its blocks in the
                                                             remote tier (what a handoff adds)
    kvtier_router:handoff_overhead_seconds                   histogram: prefill answered -> the decode
                                                             replica's first token to the client
    kvtier_router:handoff_publish_seconds                    histogram: the part of it spent waiting for
                                                             the blocks to reach the remote tier
    kvtier_router:handoff_blocks_total, _bytes_total         blocks (bytes) prefill replicas published
    kvtier_router:estimated_cached_tokens                    histogram: the winner's cached tokens per
                                                             cache-aware decision
    kvtier_router:routing_latency_seconds                    histogram: body parsed -> replica chosen
                                                             (tokenizing and hashing included)
    kvtier_router:index_mode{mode}                           1 for the configured mode (events|polling)
    kvtier_router:replica_healthy{replica}                   1 up, 0 down
    kvtier_router:replica_load{replica}                      running + waiting (or in flight)
    kvtier_router:replica_index_source{replica, source}      1 for how its index is kept now
                                                             (events|polling|none)
    kvtier_router:replica_indexed_blocks{replica, medium}    blocks in the router's index of it
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.router.replicas import Replica

PREFIX = "kvtier_router:"
_TOKEN_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# a tenth of a second apart from 0.1 s to 1 s, where a handoff's overhead lies (kvtier bench disagg's p50)
_HANDOFF_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
SOURCES = ("events", "polling", "none")
# What became of a completion while prefill replicas were up (kvtier.router.disagg.why_not)
HANDOFF_OUTCOMES = ("handoff", "prefill_failed", "short", "unscored", "no_decode")


class _ReplicaCollector(Collector):
    """Gauges read from the replicas at scrape time."""

    def __init__(self, replicas: Callable[[], list[Replica]], mode: Callable[[], str]) -> None:
        self.replicas = replicas
        self.mode = mode

    def collect(self) -> Iterator[Metric]:
        mode = GaugeMetricFamily(PREFIX + "index_mode", "1 for the index mode in use.", labels=["mode"])
        for name in ("events", "polling"):
            mode.add_metric([name], 1.0 if self.mode() == name else 0.0)
        yield mode
        healthy = GaugeMetricFamily(PREFIX + "replica_healthy", "1 up, 0 down.", labels=["replica"])
        load = GaugeMetricFamily(PREFIX + "replica_load", "Requests queued on it.", labels=["replica"])
        source = GaugeMetricFamily(
            PREFIX + "replica_index_source", "How its block index is kept.", labels=["replica", "source"]
        )
        blocks = GaugeMetricFamily(
            PREFIX + "replica_indexed_blocks", "Blocks indexed, per medium.", labels=["replica", "medium"]
        )
        for r in self.replicas():
            healthy.add_metric([r.url], 1.0 if r.healthy else 0.0)
            load.add_metric([r.url], float(r.load))
            now = r.index_source() or "none"
            for s in SOURCES:
                source.add_metric([r.url, s], 1.0 if s == now else 0.0)
            for medium, n in r.index.counts().items():
                blocks.add_metric([r.url, medium], float(n))
        yield from (healthy, load, source, blocks)


class RouterMetrics:
    def __init__(self, replicas: Callable[[], list[Replica]], mode: Callable[[], str]) -> None:
        self.registry = CollectorRegistry()
        self.routed = Counter(
            PREFIX + "requests_routed",
            "Requests sent to a replica, by reason.",
            ["replica", "reason"],
            registry=self.registry,
        )
        self.failures = Counter(
            PREFIX + "request_failures",
            "Requests answered with an error by the router itself.",
            ["reason"],
            registry=self.registry,
        )
        self.cached_tokens = Histogram(
            PREFIX + "estimated_cached_tokens",
            "Prompt tokens the chosen replica is estimated to hold, per cache-aware decision.",
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            PREFIX + "routing_latency_seconds",
            "Time to choose a replica (tokenizing and hashing included).",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._handoff_metrics()
        self.registry.register(_ReplicaCollector(replicas, mode))

    def _handoff_metrics(self) -> None:
        """Disaggregated prefill and decode (``kvtier.router.disagg``)."""
        self.handoffs = Counter(
            PREFIX + "handoffs",
            "Completions while prefill replicas are up, by outcome: handed off, prefill failed (the "
            "decode replica computed the prompt), or sent straight to a decode replica and why.",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in HANDOFF_OUTCOMES:
            self.handoffs.labels(outcome)
        self.handoff_seconds = Histogram(
            PREFIX + "handoff_seconds",
            "Seconds from sending a prompt to a prefill replica to its blocks being in the remote tier.",
            buckets=_HANDOFF_BUCKETS,
            registry=self.registry,
        )
        self.handoff_overhead_seconds = Histogram(
            PREFIX + "handoff_overhead_seconds",
            "Seconds from a prefill replica's answer to the decode replica's first token to the client "
            "(publishing the blocks, the decode replica loading them and computing the rest): what a "
            "handoff adds to the prefill.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=self.registry,
        )
        self.handoff_publish_seconds = Histogram(
            PREFIX + "handoff_publish_seconds",
            "Seconds from a prefill replica's answer to its blocks being in the remote tier (the part of "
            "the handoff overhead before the decode replica is asked).",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=self.registry,
        )
        self.handoff_blocks = Counter(
            PREFIX + "handoff_blocks", "KV blocks prefill replicas published.", registry=self.registry
        )
        self.handoff_bytes = Counter(
            PREFIX + "handoff_bytes", "KV bytes prefill replicas published.", registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
