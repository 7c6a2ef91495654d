"""Who goes next: priorities, then a per-tenant fair share, then arrival order.

A waiting sequence's place is decided by, in order::

    (priority,                  lower runs first (vLLM's meaning of the request field)
     running[tenant],           the tenant holding fewer running sequences goes first
     not preempted,             a preempted sequence (its KV swapped out or cached) before a fresh one
     arrival_time)              then first come, first served

``running[tenant]`` changes as sequences are admitted within one step, so the order is produced one
sequence at a time (:class:`FairOrder`): a burst of 20 requests from one tenant is interleaved with
another tenant's 2, which therefore never wait for the whole burst. Within a tenant the order is
(priority, preempted first, arrival). Preemption victims are chosen the other way round
(:func:`victim_key`): the largest priority value first, then the most recently admitted.

A request's *sibling rows* (its ``n > 1`` sequences) may share the engine with other requests: with
``row_share_span`` = S > 0 (0 offline, 8 in ``kvtier serve``), while another request waits, prefills
or decodes, a request decodes at most ``max(SIBLING_FREE_ROWS, ceil(rows / S))`` of its rows a step
(:func:`sibling_share`), the rows that sat out longest first, so each row still moves at least every S
steps; alone, it decodes every row. On a CPU each row costs about a one-row forward, so the share
spreads one request's bulk over more, shorter steps. Measured (``kvtier bench serve --hostile``, a
``guided_choice`` with ``n=16`` every 3 s among 150 normal requests; BENCHMARKS.md): with the
server's running cap at ``--itl-factor 6`` the other users' TTFT p90 was 1.7-1.8x the clean run's
with or without the share (the rows kept the steps over the cap's target, so it shrank and queued
them); with the cap's target at 10 lone steps, 1.29x at S = 4 and 1.08-1.14x at S = 8 (2 of the 16
rows a step). Torch-free.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Iterator

from kvtier.sequence import Sequence

SIBLING_FREE_ROWS = 2  # a request with at most this many rows always decodes all of them


def _own_key(seq: Sequence) -> tuple[int, bool, float]:
    return (seq.priority, seq.num_preemptions == 0, seq.arrival_time)


def victim_key(seq: Sequence) -> tuple[int, int]:
    """Larger is preempted first: the lowest priority (largest value), then the latest admitted."""
    return (seq.priority, seq.admitted_order or 0)


def run_order_key(seq: Sequence) -> tuple[int, int]:
    """Order in which running sequences get their tokens (the reverse of the victims' order)."""
    return victim_key(seq)


class FairOrder:
    """The waiting sequences in admission order; tell it which ones were admitted (``admitted``)."""

    def __init__(self, waiting: Iterable[Sequence], running: Iterable[Sequence]):
        self.running = Counter(seq.tenant for seq in running)
        queues: dict[str, list[Sequence]] = {}
        for seq in waiting:
            queues.setdefault(seq.tenant, []).append(seq)
        self._queues = {t: deque(sorted(q, key=_own_key)) for t, q in queues.items()}

    def __iter__(self) -> Iterator[Sequence]:
        while self._queues:
            tenant = min(self._queues, key=self._head_key)
            queue = self._queues[tenant]
            seq = queue.popleft()
            if not queue:
                del self._queues[tenant]
            yield seq

    def _head_key(self, tenant: str) -> tuple[int, int, bool, float]:
        head = self._queues[tenant][0]
        return (head.priority, self.running[tenant], head.num_preemptions == 0, head.arrival_time)

    def admitted(self, seq: Sequence) -> None:
        self.running[seq.tenant] += 1


def sibling_share(decoding: list[Sequence], span: int) -> list[Sequence]:
    """The sibling rows of ``decoding`` (in run order) that sit out a step shared with other requests
    (``span``: ``row_share_span``, see the module docstring), in run order; the rest decode."""
    rows: dict[str, list[Sequence]] = {}
    for seq in decoding:
        rows.setdefault(seq.request_id, []).append(seq)
    out: set[str] = set()
    for siblings in rows.values():
        share = max(SIBLING_FREE_ROWS, math.ceil(len(siblings) / span))
        longest_out = sorted(siblings, key=lambda s: -s.num_yielded_steps)  # stable: run order on ties
        out.update(s.seq_id for s in longest_out[share:])
    return [s for s in decoding if s.seq_id in out]
