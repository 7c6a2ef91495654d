"""The scheduler's requests as a dashboard lists them: one row per running and waiting sequence (what it
holds, what each tier served it) and the whole counts. Torch-free; read on the engine thread."""

from __future__ import annotations

import itertools
from typing import Any

from kvtier.scheduler.scheduler import Scheduler
from kvtier.sequence import Sequence


def describe_requests(scheduler: Scheduler, limit: int) -> dict[str, Any]:
    """Up to ``limit`` running and waiting sequences, one row each, and the whole counts (call it on
    the engine thread, between steps)."""
    now = scheduler.clock()
    return {
        "running": [_row(scheduler, s, now) for s in scheduler.running[:limit]],
        "waiting": [_row(scheduler, s, now) for s in itertools.islice(scheduler.waiting, limit)],
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
    }


def _row(scheduler: Scheduler, seq: Sequence, now: float) -> dict[str, Any]:
    return {
        "seq_id": seq.seq_id,
        "status": seq.status.value,
        "prompt_tokens": seq.num_prompt_tokens,
        "output_tokens": seq.num_output_tokens,
        "computed_tokens": seq.num_computed_tokens,
        "cached_tokens": seq.num_cached_tokens,
        "cached_tokens_by_tier": {str(m): n for m, n in seq.cached_tokens_by_tier.items() if n},
        "preemptions": seq.num_preemptions,
        "swapped": scheduler.kv.is_swapped(seq.seq_id),
        "age_s": max(0.0, now - seq.arrival_time),
    }
