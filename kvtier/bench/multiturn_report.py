"""The tables, targets and chart of ``kvtier bench multiturn`` (``kvtier.bench.multiturn`` runs the
rows and imports this; the rows' types are only named here)."""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any

from kvtier.bench.quantiles import percentile

if TYPE_CHECKING:
    from kvtier.bench.multiturn import RunResult, Workload

TIER_NAMES = ("device", "host", "disk")  # the media a row's hits are counted by


def print_tables(rows: list[RunResult], work: Workload) -> None:
    names = (
        "configuration",
        "mean TTFT",
        "p50",
        "p90",
        "queued",
        "prefill computed",
        "device hit",
        "host hit",
    )
    heads = list(zip((*names, "disk hit", "wall s"), (26, 9, 7, 7, 6, 16, 10, 8, 8, 6), strict=True))
    print(
        "\n| "
        + " | ".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w) in enumerate(heads))
        + " | notes"
    )
    print("|" + "|".join("-" * (w + 2) for _, w in heads) + "|------")
    for r in rows:
        if r.skipped:
            blank = " | ".join(" " * w for _, w in heads[1:])
            print(f"| {r.name:<26} | {blank} | skipped: {r.skipped}")
            continue
        xs = r.ttfts()
        comp = "n/a" if r.computed is None else f"{r.computed:,}"
        note = r.note + (f"; {r.mismatches} answers differ from device-only's" if r.mismatches else "")
        hits = [f"{r.hits(t):,}" if any(x.by_tier for x in r.records) else "n/a" for t in TIER_NAMES]
        cells = [f"{r.mean * 1e3:>7.0f}ms", f"{percentile(xs, 0.5) * 1e3:>5.0f}ms"]
        cells += [f"{percentile(xs, 0.9) * 1e3:>5.0f}ms", f"{r.mean_wait * 1e3:>4.0f}ms", f"{comp:>16}"]
        cells += [f"{hits[0]:>10}", f"{hits[1]:>8}", f"{hits[2]:>8}", f"{r.wall_s:>6.1f}"]
        print(f"| {r.name:<26} | " + " | ".join(cells) + f" | {note}")
    print(
        "(TTFT: arrival to first token; queued: mean arrival to first scheduled, i.e. waiting for disk "
        "reads; hits: prompt tokens served by each tier, summed over requests)"
    )
    turns = range(1, work.num_turns + 1)
    print(
        f"\nmean TTFT by turn (ms)\n| {'configuration':<26} | "
        + " | ".join(f"turn {t:>2}" for t in turns)
        + " |"
    )
    for r in rows:
        if not r.skipped:
            cells = " | ".join(f"{statistics.fmean(r.ttfts(t)) * 1e3:>7.0f}" for t in turns)
            print(f"| {r.name:<26} | {cells} |")
    for r in rows:
        if len(r.tier_stats) > 1:
            parts = [
                f"{t} stored {s['blocks_stored']}, loaded {s['blocks_loaded']}, evicted {s['blocks_evicted']}"
                if t != "device"
                else f"device evicted {s['blocks_evicted']}"
                for t, s in r.tier_stats.items()
            ]
            print(f"  {r.name}: " + "; ".join(parts))


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def _fmt(x: float | None, pct: bool = False) -> str:
    if x is None:
        return "n/a"
    return f"{x:.0%}" if pct else f"{x:.2f}x"


def evaluate_targets(results: dict[str, RunResult]) -> list[dict[str, Any]]:
    dev, dh = results["device only"], results["device+host"]
    cold, warm, llama = results["device+host+disk"], results["restart on disk"], results["llama.cpp"]
    targets: list[dict[str, Any]] = []

    def add(text: str, measured: float | None, goal: float, detail: str) -> None:
        met = None if measured is None else measured >= goal
        targets.append({"target": text, "measured": measured, "met": met, "detail": detail})

    def saved(first_turn: int) -> float | None:
        a, b = dev.computed_tokens(first_turn), dh.computed_tokens(first_turn)
        return None if not a or b is None else 1 - b / a

    r2 = _ratio(dev.mean_ttft(2), dh.mean_ttft(2))
    add(
        "device+host mean TTFT >= 5x lower than device-only",
        _ratio(dev.mean, dh.mean),
        5.0,
        f"device-only / device+host over all turns; turns 2+ only: {_fmt(r2)}",
    )
    add(
        "device+host computes >= 80% fewer prefill tokens",
        saved(1),
        0.8,
        f"1 - computed(d+h) / computed(device-only), all turns; turns 2+ only: {_fmt(saved(2), True)}",
    )
    t1 = _ratio(statistics.fmean(cold.ttfts(1)), statistics.fmean(warm.ttfts(1)))
    later = _ratio(cold.mean_ttft(2), warm.mean_ttft(2))  # the turns a restarted service sees next
    nc = _ratio(results["no prefix caching"].mean, warm.mean)
    add(
        "restarted engine (disk) >= 3x lower TTFT than a cold one",
        _ratio(cold.mean, warm.mean),
        3.0,
        f"cold = device+host+disk on an empty disk dir, all turns; turn 1 alone {_fmt(t1)}; "
        f"turns 2+ only {_fmt(later)}; "
        f"vs no prefix caching {_fmt(nc)}",
    )
    text = "kvtier device+host mean TTFT < llama.cpp's (RAM cache)"
    if llama.skipped:
        targets.append({"target": text, "measured": None, "met": None, "detail": "skipped: " + llama.skipped})
    else:
        r = _ratio(llama.mean, dh.mean)
        targets.append(
            {
                "target": text,
                "measured": r,
                "met": None if r is None else r > 1.0,
                "detail": "llama.cpp / kvtier",
            }
        )
    return targets


def print_targets(targets: list[dict[str, Any]]) -> None:
    print("\ntargets")
    for t in targets:
        m = t["measured"]
        met = {True: "met", False: "UNMET", None: "n/a"}[t["met"]]
        shown = _fmt(m, "fewer" in t["target"])
        print(f"  [{met:>5}] {t['target']}: {shown} ({t['detail']})")


def write_chart(rows: list[RunResult], work: Workload, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"not written (matplotlib is not installed: {exc})"
    turns = list(range(1, work.num_turns + 1))
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for r in rows:
        if r.skipped or not r.records:
            continue
        ax.plot(turns, [statistics.fmean(r.ttfts(t)) * 1e3 for t in turns], marker="o", label=r.name)
    ax.set_xlabel("turn")
    ax.set_ylabel("mean time to first token (ms)")
    ax.set_yscale("log")
    ax.set_xticks(turns)
    ax.set_title(f"kvtier multi-turn: {work.num_convs} conversations, round-robin")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"written to {path}"
