"""Summaries, the side-by-side table, the targets and the chart of ``kvtier bench cluster``."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from kvtier.bench.cluster_workload import Record
from kvtier.bench.quantiles import percentile


@dataclass
class ScenarioResult:
    key: str  # "a".."f"
    title: str
    records: list[Record] = field(default_factory=list)
    wall_s: float = 0.0
    events: dict[str, float] = field(default_factory=dict)  # name -> seconds since the run started
    notes: list[str] = field(default_factory=list)
    replica_metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # replica -> samples
    router_metrics: dict[str, float] = field(default_factory=dict)
    router_state: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the scenario could not run (a process did not start, ...)

    def ok(self, returning: bool = True) -> list[Record]:
        return [r for r in self.records if r.ok and (r.round >= 1 or not returning)]

    @property
    def failed(self) -> list[Record]:
        return [r for r in self.records if not r.ok]

    def ttfts(self, returning: bool = True) -> list[float]:
        return [r.ttft for r in self.ok(returning) if r.ttft is not None]

    def mean_ttft(self, returning: bool = True) -> float:
        xs = self.ttfts(returning)
        return statistics.fmean(xs) if xs else math.nan

    def itls(self) -> list[float]:
        return [x for r in self.ok(False) for x in r.itls]

    def computed(self, returning: bool = True) -> int:
        return sum(r.computed for r in self.ok(returning))

    def hits(self, tier: str) -> int:
        return sum(r.by_tier.get(tier, 0) for r in self.ok(False))


def _ms(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x * 1e3:.0f}"


def print_table(results: list[ScenarioResult]) -> None:
    heads = ("scenario", "reqs", "failed", "mean TTFT", "p50", "p90", "ITL p50", "ITL p90")
    heads += ("prefill computed", "device hit", "host hit", "remote hit", "all-turn mean", "wall s")
    print("\n| " + " | ".join(heads) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(heads))) + "|")
    for s in results:
        if s.error:
            print(f"| ({s.key}) {s.title} | not run: {s.error} |")
            continue
        xs, itl = s.ttfts(), s.itls()
        cells = [
            f"({s.key}) {s.title}",
            str(len(s.records)),
            str(len(s.failed)),
            _ms(s.mean_ttft()),
            _ms(percentile(xs, 0.5)),
            _ms(percentile(xs, 0.9)),
            _ms(percentile(itl, 0.5)),
            _ms(percentile(itl, 0.9)),
            f"{s.computed():,}",
            *(f"{s.hits(t):,}" for t in ("device", "host", "remote")),
            _ms(s.mean_ttft(returning=False)),
            f"{s.wall_s:.0f}",
        ]
        print("| " + " | ".join(cells) + " |")
    print(
        "TTFT (ms, client side) and prefill computed (prompt tokens minus cached, from each response's "
        "usage) over returning users' requests (round >= 2); ITL over all requests; hits: prompt tokens "
        "served by each tier, all requests; all-turn mean: TTFT over every request, first rounds included."
    )
    for s in results:
        for note in s.notes:
            print(f"  ({s.key}) {note}")


def matched_ratio(s: ScenarioResult, ref: ScenarioResult, since: float) -> tuple[float, int] | None:
    """Mean TTFT of ``s``'s requests started at or after ``since`` over ``ref``'s mean on the same
    (user, round) pairs; ``(ratio, pairs)`` or None when no pair matches."""
    base = {(r.user, r.round): r.ttft for r in ref.ok(False) if r.ttft is not None}
    pairs = [
        (r.ttft, base[(r.user, r.round)])
        for r in s.ok(False)
        if r.start >= since and r.ttft is not None and (r.user, r.round) in base
    ]
    if not pairs:
        return None
    return statistics.fmean(a for a, _ in pairs) / statistics.fmean(b for _, b in pairs), len(pairs)


def evaluate_targets(by_key: dict[str, ScenarioResult], recovery_wait_s: float) -> list[dict[str, Any]]:
    targets: list[dict[str, Any]] = []

    def add(text: str, met: bool | None, measured: str) -> None:
        targets.append({"target": text, "met": met, "measured": measured})

    def ran(key: str) -> ScenarioResult | None:
        s = by_key.get(key)
        return s if s is not None and not s.error else None

    a, b, c = ran("a"), ran("b"), ran("c")
    if a and c:
        r = a.mean_ttft() / c.mean_ttft()
        add("(c) mean TTFT >= 3x lower than (a)", r >= 3, f"{r:.2f}x")
        frac = c.computed() / a.computed() if a.computed() else math.nan
        add("(c) prefill computed <= 25% of (a)'s", frac <= 0.25, f"{frac:.1%}")
    if a and b:
        r = a.mean_ttft() / b.mean_ttft()
        add("(b) mean TTFT >= 2x lower than (a)", r >= 2, f"{r:.2f}x")
    d = ran("d")
    if d and d.extra.get("recompute_ratio") is not None:
        r = d.extra["recompute_ratio"]
        add("(d) new replica: returning-user TTFT >= 3x lower than recompute", r >= 3, f"{r:.2f}x")
    for key in ("e", "f"):
        s = ran(key)
        if s is None:
            continue
        allowed = s.extra.get("allowed_failures", 0)
        bad = len(s.failed) - allowed
        allowed_text = "in flight on the killed replica" if key == "f" else "allowed"
        but = " but those in flight on the killed replica" if key == "f" else ""
        add(
            f"({key}) no failed request{but}",
            bad <= 0,
            f"{len(s.failed)} failed, {allowed} of them {allowed_text}",
        )
        back = s.events.get("back")
        m = matched_ratio(s, c, back + recovery_wait_s) if c and back is not None else None
        text = f"({key}) TTFT within 20% of (c) {recovery_wait_s:.0f} s after recovery"
        if m is None:
            add(text, None, "no data")
        else:
            add(text, m[0] <= 1.2, f"{m[0]:.2f}x (c)'s on the same {m[1]} (user, round) pairs")
    oh = c.extra.get("overhead") if c else None
    if c and oh is not None:
        name = "kvtier_router:routing_latency_seconds"
        n = c.router_metrics.get(name + "_count", 0.0)
        decide = c.router_metrics.get(name + "_sum", 0.0) / n * 1e3 if n else math.nan
        p50 = histogram_quantile(c.router_metrics, name, 0.5) * 1e3
        add(
            "router overhead <= 5 ms p50",
            oh["overhead_ms"] <= 5 and p50 <= 5,
            f"short requests: {oh['overhead_ms']:+.1f} ms (p50 {oh['router_p50_ms']:.1f} ms through the "
            f"router vs {oh['direct_p50_ms']:.1f} ms straight to a replica); the router's own decision "
            f"on (c)'s workload requests, tokenizing and hashing included: p50 <= {p50:.1f} ms (histogram "
            f"bucket), mean {decide:.1f} ms",
        )
    return targets


def histogram_quantile(samples: dict[str, float], name: str, q: float, interpolate: bool = False) -> float:
    """Quantile ``q`` of a Prometheus histogram (nan: no samples): the upper bound of the bucket holding
    it, or with ``interpolate`` a linear guess inside that bucket, as PromQL's ``histogram_quantile``
    makes (the top bucket's lower bound when it is the open ``+Inf`` one)."""
    buckets = []
    for key, count in samples.items():
        if key.startswith(name + "_bucket{") and 'le="' in key:
            le = key.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((math.inf if le == "+Inf" else float(le), count))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    below, below_count = 0.0, 0.0
    for le, count in buckets:
        if total and count >= q * total:
            if not interpolate or count == below_count:
                return le
            if le == math.inf:
                return below
            return below + (le - below) * (q * total - below_count) / (count - below_count)
        below, below_count = le, count
    return math.nan


def print_targets(targets: list[dict[str, Any]]) -> None:
    print("\ntargets")
    for t in targets:
        met = {True: "met", False: "NOT met", None: "n/a"}[t["met"]]
        print(f"  [{met}] {t['target']}: {t['measured']}")


def write_chart(results: list[ScenarioResult], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"not written (matplotlib is not installed: {exc})"
    runs = [s for s in results if not s.error]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), dpi=100)
    labels = [f"({s.key})" for s in runs]
    xs = range(len(runs))
    ax = axes[0]
    ax.bar([x - 0.2 for x in xs], [s.mean_ttft() * 1e3 for s in runs], 0.4, label="mean")
    ax.bar([x + 0.2 for x in xs], [percentile(s.ttfts(), 0.9) * 1e3 for s in runs], 0.4, label="p90")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("returning-user TTFT (ms)")
    ax.set_title("time to first token")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.bar(list(xs), [s.computed() for s in runs], 0.6, color="tab:gray")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("prompt tokens computed (returning users)")
    ax.set_title("prefill work")
    ax = axes[2]
    for s in runs:
        if s.key in ("c", "d", "e", "f"):
            pts = sorted((r.start, r.ttft * 1e3) for r in s.ok(False) if r.ttft is not None)
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", ms=3, label=f"({s.key})")[0]
            for name, t in s.events.items():
                ax.axvline(t, ls=":", lw=0.9, color=line.get_color())
                ax.text(
                    t,
                    0.98,
                    f" {s.key}: {name}",
                    transform=ax.get_xaxis_transform(),
                    fontsize=6,
                    rotation=90,
                    va="top",
                    color=line.get_color(),
                )
    ax.set_xlabel("request start (s into the run)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT over time (dotted: kill / back / added)")
    ax.legend(fontsize=8)
    fig.suptitle(
        "kvtier bench cluster: (a) round-robin  (b) round-robin + Redis  (c) cache-aware + Redis  "
        "(d) +replica mid-run  (e) Redis killed  (f) replica killed",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"written to {path}"
