"""What ``kvtier bench agent`` measures in one run, and its side-by-side table (both drivers: the
in-process engine of :mod:`.agent` and the HTTP one of :mod:`.agent_http`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field

TIERS = ("device", "host", "disk", "remote")


@dataclass
class RunResult:
    label: str
    agent_ttft_s: list[float] = field(default_factory=list)  # steps after each agent's first
    agent_prompt_tokens: int = 0  # of those steps
    agent_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # of those, read from each tier
    pressure_prompt_tokens: int = 0
    seconds: float = 0.0

    def p(self, q: float) -> float:
        xs = sorted(self.agent_ttft_s)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    @property
    def pressure_tok_s(self) -> float:
        return self.pressure_prompt_tokens / self.seconds if self.seconds else 0.0


def write_json(results: list[RunResult], path: str) -> None:
    with open(path, "w") as f:
        json.dump([asdict(r) | {"p50": r.p(0.5), "p90": r.p(0.9)} for r in results], f, indent=2)


def print_table(
    results: list[RunResult], ns: argparse.Namespace, where: str = "", unit: str = "token"
) -> None:
    """The runs side by side: step TTFT p50/p90, the agents' prompt tokens by tier (the remote tier's
    column when a run read from it), the unrelated traffic's prompt tokens/s. ``where``: how it ran;
    ``unit``: what the prompt sizes count (the HTTP driver's prompts are words)."""
    print(
        f"kvtier bench agent{where}: {ns.agents} agents x {ns.steps} steps, {ns.system_tokens}-{unit} "
        f"system prompts, {ns.pause_s} s tool pauses; unrelated {ns.pressure_tokens}-{unit} prompts, "
        f"{ns.pressure_concurrency} in flight"
    )
    tiers = [t for t in TIERS if t != "remote" or any(r.agent_tokens_by_tier.get(t) for r in results)]
    cached = f"agent tokens cached ({'/'.join(tiers)})"
    cols = f"{'step TTFT p50':>14} {'p90':>8} {cached:>40}"
    head = f"{'run':<26} {cols} {'unrelated tok/s':>16}"
    print(head)
    print("-" * len(head))
    for r in results:
        share = [r.agent_tokens_by_tier.get(t, 0) / max(r.agent_prompt_tokens, 1) for t in tiers]
        by_tier = "/".join(f"{x:.0%}" for x in share)
        print(f"{r.label:<26} {r.p(0.5):>13.3f}s {r.p(0.9):>7.3f}s {by_tier:>40} {r.pressure_tok_s:>16.0f}")
    if len(results) == 2 and results[1].p(0.9) > 0:
        base, kept = results
        print(
            f"p90 step TTFT {base.p(0.9) / kept.p(0.9):.2f}x lower with retention; unrelated throughput "
            f"{kept.pressure_tok_s / max(base.pressure_tok_s, 1e-9):.2f}x"
        )
