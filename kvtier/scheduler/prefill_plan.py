"""One step's prefill phase under stall_free (kvtier/scheduler/scheduler.py, step 3): the token budget
left, the chunks scheduled, who joined the running batch, and who was passed over. Torch-free."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvtier.scheduler.fairness import FairOrder
from kvtier.sequence import Sequence

if TYPE_CHECKING:
    from kvtier.scheduler.scheduler import ScheduledSeq, Scheduler, SchedulerOutput


class PoolFull(Exception):
    """Admission ends for this step (the pool is full)."""


def passed_over(must_finish: bool) -> None:
    """A waiting sequence whose chunk the pool cannot take: with ``must_finish`` (its whole rest, now)
    it is passed over, so the step's later pass may still admit a smaller chunk (a hybrid model's
    prompt that fits only chunk by chunk); otherwise the pool is full and admissions stop (``PoolFull``)."""
    if must_finish:
        return None
    raise PoolFull


class PrefillPlan:
    """One step's prefill phase: the budget left, what is scheduled, who joined the batch."""

    def __init__(
        self, scheduler: Scheduler, out: SchedulerOutput, budget: int, taken: set[str], fair: FairOrder
    ):
        self.s = scheduler
        self.out = out
        self.budget = budget
        self.taken = set(taken)
        self.fair = fair
        self.scheduled: list[ScheduledSeq] = []
        self.stopped = False  # the pool or max_num_seqs is full: no more admissions this step
        self._too_long: list[str] = []  # waiting prompts the finishers' pass skipped: they cannot finish
        self.overtaken: set[str] = set()  # ...and a finisher after them in order was admitted
        # Beside decodes (a timed step) a loaded prefix's copy takes step time: charged to the budget.
        self.charges_loads = bool(taken) and scheduler.config.max_step_ms > 0

    def _take(self, seq: Sequence, num_new: int) -> None:
        self.scheduled.append(self.s.entry(seq, num_new))
        self.taken.add(seq.seq_id)
        self.budget -= num_new

    def continue_prompt(self, seq: Sequence, must_finish: bool = False) -> bool:
        """The next chunk of a running prompt (never preempts: a prompt can wait)."""
        num_new = min(seq.num_remaining_tokens, self.budget)
        if num_new <= 0 or seq.seq_id in self.taken or (must_finish and num_new < seq.num_remaining_tokens):
            return False
        num_new = self.s.grow(seq, num_new, must_finish)
        if not num_new:
            return False
        self._take(seq, num_new)
        return True

    def admit_all(
        self, order: Iterable[Sequence], must_finish: bool, limit: int | None = None
    ) -> list[Sequence]:
        """Waiting sequences join the batch in ``order`` (with ``must_finish``: only those whose whole
        rest fits in the budget left; ``limit``: at most that many). Returns those passed over, in
        order, up to where it stopped (the caller may continue with the rest of ``order``)."""
        s, passed = self.s, []
        for seq in order:
            if seq.seq_id in self.taken:
                continue  # admitted earlier in this step (a starved one)
            if self.stopped or self.budget <= 0 or (limit is not None and limit <= 0):
                passed.append(seq)
                break
            if self.out.preempted_seq_ids or len(s.running) >= s.goodput.running_cap.cap():
                self.stopped = True
                passed.append(seq)
                break
            if must_finish and s.uncached_tokens(seq) > self.budget:
                passed.append(seq)  # cheap test first: its prompt cannot finish in this step
                self._too_long.append(seq.seq_id)
                continue
            loads = s.kv.num_planned_loads
            try:
                num_new = s.admit(seq, self.budget, must_finish)
            except PoolFull:
                self.stopped = True
                passed.append(seq)
                break
            if num_new is None:
                passed.append(seq)
                continue
            self._take(seq, num_new)
            if self.charges_loads:  # its prefix's loads (never held against itself: it is admitted)
                self.budget -= s.cost_model.load_tokens(s.kv.num_planned_loads - loads)
            self.fair.admitted(seq)
            if must_finish:
                self.overtaken.update(self._too_long)
            if limit is not None:
                limit -= 1
        return passed
