"""Sizing advice: the miss-ratio curve turned into per-tier curves and sentences an operator can act on.

Each tier has its own access stream (``CacheInsight``): the device pool, an LRU over every prompt
lookup, block computed and sequence freed (reuse distances, ``mrc``); the host tier over the blocks
asked of it (the device missed them) and the blocks offered to it (device evictions), simulated with
its admission rules (``minisim``); the disk tier likewise one level down.
Growing or shrinking one tier leaves the stream of the tiers above it unchanged, so its own curve says
how many of the blocks asked of it it would serve; the faster tiers serve what they serve now, and the
slower ones the same share of its misses as now. The curve of tier ``t`` at size factor ``f`` is then
the share of all looked-up prompt blocks served from some tier; ``current_hit_ratio`` is the curve at
1× (``measured_hit_ratio``, from the counters, is next to it). A shared remote tier has no capacity of
its own to scale and is left out.

Sentences (``advice``), from the curves and the engine's measured costs::

    undersized   the smallest factor (2×, 4×, 8×) that gets 90% of the gain at 8×, when that gain is
                 at least 2 points: "a host tier of 6.0 GiB (2× today's) would have served 31% more
                 prompt tokens from cache (est. −420 ms mean TTFT)"
    oversized    a tier whose hit ratio at a fraction of its size is within 1 point of today's:
                 "the disk tier is oversized 3.1× (3.2 GiB would have served as many prompt tokens,
                 within 1 point)"
    no host tier the device curve beyond 1× read as "a host tier of X GiB would have ..."

TTFT estimates: each extra block served saves its prefill (``block_size / prefill_tokens_per_s``) and
costs its load (the tier's measured seconds per block loaded, else ``block_bytes / transfer rate``),
times the looked-up blocks per request. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.insight.minisim import SimSnapshot
from kvtier.insight.mrc import TrackerSnapshot

SIZE_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
GAIN_MIN = 0.02  # points of hit ratio worth a sentence
OVERSIZE_SLACK = 0.01  # "as many", within 1 point


@dataclass(frozen=True)
class TierSize:
    """One tier as the advisor sees it: its size, its own access stream's curve, what it served."""

    medium: str  # "device", "host", "disk"
    capacity_blocks: int
    load_seconds_per_block: float  # measured (0: unknown, use the transfer rate)
    snap: TrackerSnapshot | SimSnapshot | None = None  # the tier's own stream: blocks asked of it, offered
    num_asked: int = 0  # blocks looked up in this tier (the faster ones missed)
    num_served: int = 0  # of those, blocks it served (measured)


@dataclass(frozen=True)
class Costs:
    block_size: int
    block_bytes: int
    prefill_tokens_per_s: float
    transfer_bytes_per_s: float


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes < 2**30 * 10 else f"{num_bytes / 2**30:.0f} GiB"


class Advisor:
    """Curves and sentences for the tiers ``sizes`` (fastest first), each with its own tracker."""

    def __init__(self, sizes: list[TierSize], costs: Costs, num_lookups: int, num_requests: int):
        self.sizes = [t for t in sizes if t.capacity_blocks > 0]
        self.costs = costs
        self.num_lookups = num_lookups
        self.blocks_per_request = num_lookups / num_requests if num_requests else 0.0

    def _own_hits(self, tier: TierSize, factor: float) -> float:
        """Blocks ``tier`` would serve at ``factor`` times its size: its own stream's curve."""
        if tier.snap is None:
            return float(tier.num_served)
        return tier.snap.hit_ratio(factor * tier.capacity_blocks) * tier.num_asked

    def hit_at(self, tier: TierSize, factor: float) -> float:
        """Share of looked-up blocks served by some tier if ``tier`` were ``factor`` times its size: the
        faster tiers as measured, ``tier`` from its curve, the slower ones serving the same share of
        what it misses as they do now."""
        if self.num_lookups <= 0:
            return 0.0
        i = self.sizes.index(tier)
        faster = sum(t.num_served for t in self.sizes[:i])
        own, own_now = self._own_hits(tier, factor), self._own_hits(tier, 1.0)
        slower = sum(t.num_served for t in self.sizes[i + 1 :])
        misses_now = max(tier.num_asked - own_now, 1e-9)
        slower *= max(tier.num_asked - own, 0.0) / misses_now
        return min(1.0, (faster + own + slower) / self.num_lookups)

    def curve(self, tier: TierSize) -> list[dict[str, Any]]:
        return [
            {
                "size_factor": f,
                "size_blocks": round(f * tier.capacity_blocks),
                "hit_ratio": round(self.hit_at(tier, f), 6),
            }
            for f in SIZE_FACTORS
        ]

    def tiers_json(self) -> dict[str, Any]:
        bb = self.costs.block_bytes
        return {
            t.medium: {
                "capacity_blocks": t.capacity_blocks,
                "capacity_bytes": t.capacity_blocks * bb,
                "curve": self.curve(t),
                "current_hit_ratio": round(self.hit_at(t, 1.0), 6),
            }
            for t in self.sizes
        }

    # ------------------------------------------------------------------------------ sentences
    def ttft_delta_s(self, tier: TierSize, gain: float) -> float:
        """Estimated change of mean TTFT when ``gain`` more of the looked-up blocks are served."""
        c = self.costs
        load = tier.load_seconds_per_block or c.block_bytes / max(c.transfer_bytes_per_s, 1.0)
        saved = c.block_size / max(c.prefill_tokens_per_s, 1e-9) - load
        return -gain * self.blocks_per_request * saved

    def _undersized(self, tier: TierSize, name: str, extra: bool) -> str | None:
        now = self.hit_at(tier, 1.0)
        best = self.hit_at(tier, 8.0) - now
        if best < GAIN_MIN:
            return None
        f = next(f for f in (2.0, 4.0, 8.0) if self.hit_at(tier, f) - now >= 0.9 * best)
        gain = self.hit_at(tier, f) - now
        size = (f - 1.0 if extra else f) * tier.capacity_blocks * self.costs.block_bytes
        more = f"{gain / now:.0%} more" if now > 0 else f"{gain:.0%} of the"
        today = "" if extra else f" ({f:g}× today's)"
        delta_ms = self.ttft_delta_s(tier, gain) * 1e3
        sign = "−" if delta_ms < 0 else "+"
        return (
            f"a {name} of {_gib(size)}{today} would have served {more} prompt tokens from cache "
            f"(est. {sign}{abs(delta_ms):.0f} ms mean TTFT)"
        )

    def _oversized(self, tier: TierSize) -> str | None:
        now = self.hit_at(tier, 1.0)
        if tier.snap is None or tier.snap.num_sampled == 0:
            return None
        f = 1.0
        for i in range(65):  # the smallest size (from ¼×) within OVERSIZE_SLACK of today's hit ratio
            f = 0.25 + 0.75 * i / 64
            if self.hit_at(tier, f) >= now - OVERSIZE_SLACK:
                break
        if f > 0.5:
            return None
        size = f * tier.capacity_blocks * self.costs.block_bytes
        return (
            f"the {tier.medium} tier is oversized {1 / f:.1f}× ({_gib(size)} would have served as many "
            f"prompt tokens, within {OVERSIZE_SLACK:.0%} point)"
        )

    def sentences(self) -> list[str]:
        out: list[str] = []
        lower = [t for t in self.sizes if t.medium != "device"]
        if not lower and self.sizes:  # device only: what a host tier would add
            s = self._undersized(self.sizes[0], "host tier", extra=True)
            out += [s] if s else []
        for t in lower:  # a tier that would gain from growing is not also called oversized
            s = self._undersized(t, f"{t.medium} tier", extra=False) or self._oversized(t)
            out += [s] if s else []
        return out

    def to_json(self, sentences: bool = True) -> dict[str, Any]:
        snaps = [t.snap for t in self.sizes if t.snap is not None]
        return {
            "object": "kv.advice",
            "tiers": self.tiers_json(),
            "sampled_accesses": sum(s.num_sampled for s in snaps),
            "lookups": self.num_lookups,
            "sampling_rate": min((s.sampling_rate for s in snaps), default=1.0),
            "tracked_blocks": sum(s.num_tracked for s in snaps),
            "advice": self.sentences() if sentences else [],
        }
