"""``kvtier bench gpu``'s tables: one per section as it finishes, then the checks against the targets."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

# Properties a section's rows show after their fields.
_DERIVED = {
    "exact": ("ok",),
    "kernels": ("ok",),
    "transfer": ("load_fraction",),
    "ttft": ("host_speedup", "busy_speedup"),
    "decode": ("ratio", "graphs_gain"),
    "phases": ("host_per_row_us",),
    "layered": ("gain", "layered_speedup"),
}


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 0.01 or abs(value) >= 1000 else f"{value:.2f}"
    return "-" if value is None else str(value)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    numeric = [all(isinstance(r[i], int | float) or r[i] is None for r in rows) for i in range(len(headers))]
    for r in cells:
        out.append(
            "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(r, widths, numeric, strict=True))
        )
    return "\n".join(out)


def print_section(name: str, rows: list[Any]) -> None:
    if not rows:
        print("   (no rows)")
        return
    names = [f.name for f in fields(rows[0])]
    derived = list(_DERIVED.get(name, ()))
    data = [[getattr(r, n) for n in names] + [getattr(r, d) for d in derived] for r in rows]
    if name == "overlap":
        derived = ["engine_hidden", "bound_hidden"]
        data = [d + [r.hidden(r.engine_ms), r.hidden(r.bound_ms)] for d, r in zip(data, rows, strict=True)]
    print(table(names + derived, data), flush=True)


def _checks(report: Any) -> list[list[Any]]:
    """(check, measured, target, verdict) for what the run measured."""
    s = report.sections
    rows: list[list[Any]] = []
    for r in s.get("exact", []):
        ok = (
            r["tokens_equal"].split("/")[0] == r["tokens_equal"].split("/")[1]
            and r["max_logprob_diff"] < 1e-3
        )
        what = f"exact: {r['shape']} {r['backend']} {r['run']} on {r['device']} vs transformers (CPU)"
        rows.append(
            [what, f"{r['tokens_equal']} answers, Δlogprob {r['max_logprob_diff']:.2g}", "all, < 1e-3", ok]
        )
    if s.get("kernels"):
        worst = max(s["kernels"], key=lambda r: r["max_rel_diff"] / r["tolerance"])
        ok = all(r["max_rel_diff"] <= r["tolerance"] for r in s["kernels"])
        rows.append(["kernels: triton vs torch path", f"worst {worst['max_rel_diff']:.2g} ({worst['case']})",
                     "within tolerance", ok])  # fmt: skip
    for r in s.get("ttft", []):
        if r.get("loads_exact"):
            k, n = r["loads_exact"].split("/")
            rows.append([f"exact: ttft {r['prompt_tokens']} host loads vs device hit", f"{k}/{n} answers",
                         "all, bit for bit", k == n])  # fmt: skip
    for r in s.get("layered", []):
        k, _, n = r["exact"].partition("/")
        ok = r["exact"] == "yes" or (n != "" and k == n)
        what = "pools equal, layered vs whole" if r["recompute_ms"] is None else "answers as the device hit's"
        rows.append([f"exact: layered {r['case']}", r["exact"], what, ok])
    if 8192 not in report.plan["ttft_lengths"]:
        return rows  # a smoke run: the speed targets are for the full shapes on a GPU
    for r in s.get("ttft", []):
        for engine, key in (("idle", "host_load_ms"), ("busy", "busy_load_ms")):
            if r["prompt_tokens"] == 8192 and r.get(key):
                x = r["recompute_ms"] / r[key]
                rows.append([f"ttft 8192: recompute / host load ({engine})", f"{x:.1f}x", ">= 10x", x >= 10])
    for r in s.get("layered", []):
        if r["case"].startswith("ttft 8192"):
            x = r["recompute_ms"] / r["layered_ms"]
            rows.append(["ttft 8192: recompute / host load (idle, layered)", f"{x:.1f}x", ">= 10x", x >= 10])
    big = [r for r in s.get("transfer", []) if r["pattern"] == "contiguous"]
    if big:
        r = big[-1]
        x = min(r["load_gbs"] / r["memcpy_h2d_gbs"], r["store_gbs"] / r["memcpy_d2h_gbs"])
        rows.append([f"transfer {r['blocks']} blocks: mover / memcpy", f"{x:.0%}", ">= 80%", x >= 0.8])
    dec = [r for r in s.get("decode", []) if r["triton_eager_tok_s"] is not None]
    widest = max((r["batch"] for r in dec), default=0)
    for r in (r for r in dec if r["batch"] == widest):
        x = r["triton_eager_tok_s"] / r["torch_tok_s"]
        what = f"decode batch {r['batch']}, {r['context']} tokens: triton / torch (eager)"
        rows.append([what, f"{x:.2f}x", ">= 3x", x >= 3])
    return rows


def print_report(report: Any) -> int:
    """The checks table; 1 when a section failed or kvtier was not exact (a missed speed target is a
    finding, not a failure of the command)."""
    rows = _checks(report)
    print(f"\nkvtier bench gpu on {report.device} (torch {report.torch}, triton {report.triton})")
    print(table(["check", "measured", "target", "met"], rows))
    for name, reason in report.skipped.items():
        print(f"{name} skipped: {reason}")
    for name, error in report.errors.items():
        print(f"\n{name} failed:\n{error}")
    exact_ok = all(r[3] for r in rows if str(r[0]).startswith(("exact", "kernels")))
    return 0 if exact_ok and not report.errors else 1
