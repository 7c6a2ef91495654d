"""Server metrics without a model: the snapshot collector, latency histograms and the Grafana dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvtier.outputs import CompletionOutput, RequestOutput
from kvtier.server.metrics import TIERS, ServerMetrics
from kvtier.stats import EngineStats, KVGroupUsage, Medium, TierSnapshot

DASHBOARD = Path(__file__).resolve().parents[1] / "grafana" / "kvtier-dashboard.json"
REQUIRED = {
    "kvtier:num_requests_running": "gauge",
    "kvtier:num_requests_waiting": "gauge",
    "kvtier:kv_cache_usage_perc": "gauge",
    "kvtier:prefix_cache_queries": "counter",
    "kvtier:prefix_cache_hits": "counter",
    "kvtier:num_preemptions": "counter",
    "kvtier:prompt_tokens": "counter",
    "kvtier:generation_tokens": "counter",
    "kvtier:time_to_first_token_seconds": "histogram",
    "kvtier:inter_token_latency_seconds": "histogram",
    "kvtier:e2e_request_latency_seconds": "histogram",
    "kvtier:request_queue_time_seconds": "histogram",
    "kvtier:tier_usage_perc": "gauge",
    "kvtier:tier_hit_tokens": "counter",
    "kvtier:tier_hit_blocks": "counter",
    "kvtier:tier_bytes_loaded": "counter",
    "kvtier:tier_bytes_stored": "counter",
    "kvtier:tier_load_seconds": "counter",
    "kvtier:tier_store_seconds": "counter",
    "kvtier:remote_errors": "counter",
    "kvtier:remote_breaker_state": "gauge",
}


def scrape(metrics: ServerMetrics) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """``{sample name: {sorted labels: value}}`` of one exposition, parsed the way Prometheus would."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def family_types(metrics: ServerMetrics) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(metrics.render().decode())}


def test_every_series_is_exposed_before_the_engine_exists() -> None:
    m = ServerMetrics(lambda: None)
    types = family_types(m)
    for name, kind in REQUIRED.items():
        assert types.get(name) == kind, (name, types.get(name))
    samples = scrape(m)
    assert samples["kvtier:num_requests_running"] == {(): 0.0}
    for name in (
        "kvtier:tier_usage_perc",
        "kvtier:tier_bytes_loaded_total",
        "kvtier:tier_store_seconds_total",
    ):
        assert set(samples[name]) == {(("tier", t),) for t in TIERS}
    assert set(samples["kvtier:num_preemptions_total"]) == {(("mode", "swap"),), (("mode", "recompute"),)}


def test_snapshot_values_and_missing_tiers_as_zeros() -> None:
    device = TierSnapshot(
        medium=Medium.DEVICE, capacity_blocks=100, used_blocks=25, block_size=16, lookups=10, hit_blocks=4
    )
    host = TierSnapshot(
        medium=Medium.HOST, capacity_blocks=400, used_blocks=100, bytes_loaded=4096, load_seconds=0.5
    )
    stats = EngineStats(
        3, 2, 0.25, 320, 64, {"swap": 1, "recompute": 2}, 500, 70, {Medium.DEVICE: device, Medium.HOST: host}
    )
    samples = scrape(ServerMetrics(lambda: stats))
    assert samples["kvtier:num_requests_running"][()] == 3
    assert samples["kvtier:num_requests_waiting"][()] == 2
    assert samples["kvtier:kv_cache_usage_perc"][()] == 0.25
    assert samples["kvtier:prefix_cache_queries_total"][()] == 320
    assert samples["kvtier:prefix_cache_hits_total"][()] == 64
    assert samples["kvtier:prompt_tokens_total"][()] == 500
    assert samples["kvtier:generation_tokens_total"][()] == 70
    assert samples["kvtier:num_preemptions_total"][(("mode", "swap"),)] == 1
    assert samples["kvtier:num_preemptions_total"][(("mode", "recompute"),)] == 2
    usage = samples["kvtier:tier_usage_perc"]
    assert usage[(("tier", "device"),)] == 0.25 and usage[(("tier", "host"),)] == 0.25
    assert usage[(("tier", "disk"),)] == 0.0 and usage[(("tier", "remote"),)] == 0.0
    assert samples["kvtier:tier_hit_tokens_total"][(("tier", "device"),)] == 64
    assert samples["kvtier:tier_bytes_loaded_total"][(("tier", "host"),)] == 4096
    assert samples["kvtier:tier_load_seconds_total"][(("tier", "host"),)] == 0.5
    assert samples["kvtier:tier_bytes_stored_total"][(("tier", "disk"),)] == 0.0


def _output(
    rid: str, n_tokens: int, finished: bool, t: dict[str, float], reason: str = "length"
) -> RequestOutput:
    completion = CompletionOutput(
        0, "x" * n_tokens, [1] * n_tokens, reason if finished else None, num_new_tokens=1 if n_tokens else 0
    )
    return RequestOutput(rid, "p", [1, 2, 3], [completion], finished, metrics=t)


def test_latency_histograms_follow_request_outputs() -> None:
    m = ServerMetrics(lambda: None)
    empty = EngineStats(0, 0, 0.0, 0, 0, {}, 0, 0, {})
    m.on_add("a", 100.0)
    times = {"arrival_time": 100.2, "first_scheduled_time": 100.5, "first_token_time": 101.0}
    m.on_step([_output("a", 1, False, times)], empty, 101.0)
    m.on_step([_output("a", 2, False, times)], empty, 101.25)
    m.on_step([_output("a", 3, True, {**times, "finished_time": 101.5})], empty, 101.5)
    m.on_add("b", 200.0)
    m.on_abort("b")
    s = scrape(m)
    assert s["kvtier:time_to_first_token_seconds_count"][()] == 1
    assert (
        s["kvtier:time_to_first_token_seconds_sum"][()] == 1.0
    )  # from the server's arrival, not the engine's
    assert s["kvtier:request_queue_time_seconds_sum"][()] == 0.5
    assert s["kvtier:inter_token_latency_seconds_count"][()] == 2
    assert s["kvtier:inter_token_latency_seconds_sum"][()] == 0.5
    assert s["kvtier:e2e_request_latency_seconds_sum"][()] == 1.5
    assert s["kvtier:request_success_total"][(("finished_reason", "length"),)] == 1
    assert s["kvtier:request_success_total"][(("finished_reason", "abort"),)] == 1
    assert not m._arrivals and not m._last_token  # nothing left behind for finished or aborted requests


def test_grafana_dashboard_uses_only_exposed_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(dashboard["panels"]) >= 10 and all(exprs)
    exposed = set(scrape(ServerMetrics(lambda: None)))  # sample names: with _total, _bucket, _sum, _count
    used = {name for e in exprs for name in re.findall(r"kvtier:[A-Za-z0-9_:]+", e)}
    assert used, exprs
    missing = sorted(used - exposed)
    assert not missing, missing
    families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}
    for name in REQUIRED:
        assert name in families, f"the dashboard does not chart {name}"
    for panel in dashboard["panels"]:
        assert {"type", "title", "gridPos", "targets"} <= set(panel)


def test_kv_groups_are_gauges_labelled_by_group_and_kind() -> None:
    """Each KV group's blocks in use, window and layers (Gemma 3 270M's layout: a full group and five
    sliding ones sharing the pool); none before the engine has a snapshot."""
    groups = (KVGroupUsage(0, "full", None, 3, 40),) + tuple(
        KVGroupUsage(g, "sliding", 512, 3, 33) for g in range(1, 6)
    )
    stats = EngineStats(1, 0, 0.5, 0, 0, {}, 0, 0, {}, kv_groups=groups)
    samples = scrape(ServerMetrics(lambda: stats))
    in_use = samples["kvtier:kv_group_blocks_in_use"]
    assert in_use[(("group", "0"), ("kind", "full"))] == 40
    assert in_use[(("group", "5"), ("kind", "sliding"))] == 33 and len(in_use) == 6
    assert samples["kvtier:kv_group_window_tokens"][(("group", "1"), ("kind", "sliding"))] == 512
    assert samples["kvtier:kv_group_window_tokens"][(("group", "0"), ("kind", "full"))] == 0
    assert samples["kvtier:kv_group_layers"][(("group", "2"), ("kind", "sliding"))] == 3
    assert "kvtier:kv_group_blocks_in_use" not in scrape(ServerMetrics(lambda: None))
