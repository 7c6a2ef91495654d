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
(:func:`victim_key`): the largest priority value first, then the most recently admitted. Torch-free.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Iterator

from kvtier.sequence import Sequence


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
