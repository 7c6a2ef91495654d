"""Continuous batching at iteration level, with chunked prefill and preemption by swap or recompute.

Each ``schedule()`` builds one step under a token budget (``max_num_batched_tokens``):

1. Running sequences first, in admission order: a decoding sequence takes 1 token, a sequence in
   the middle of a chunked prefill takes its next chunk. If the block pool cannot supply the blocks,
   the most recently admitted running sequence is preempted until the allocation fits: either its
   KV is *swapped* to the host tier (and loaded back when it resumes) or its blocks are dropped to
   be *recomputed* later (usually mostly from the prefix cache); ``preemption_mode`` and the
   measured costs decide (``preemption.py``).
2. Then waiting sequences are admitted in arrival order (preempted ones at the front), while the
   budget, ``max_num_seqs`` and the pool allow. Their cached prefix is looked up in every tier and
   only the rest is computed; the last prompt token is always computed so there are logits to
   sample from. A sequence whose prefix continues on disk is held back while those blocks are read
   into host memory (others go first), until the reads finish or ``disk_load_timeout_s`` passes.

The KV manager accumulates the step's device↔host copies as it allocates; they leave in
``SchedulerOutput.swap``. Torch-free: the runner turns a ``SchedulerOutput`` into tensors.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvtier.config import SchedulerConfig
from kvtier.kv.manager import KVCacheManager
from kvtier.kv.plan import SwapPlan
from kvtier.scheduler.preemption import CostModel
from kvtier.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: tokens [num_computed_tokens, num_computed_tokens + num_new_tokens)."""

    seq: Sequence
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: tuple[int, ...]  # the block table after this step's allocation

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the newest token: the step yields logits for it."""
        return self.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """The step contract between scheduler and model runner. Rows: decodes first, then prefills."""

    decodes: list[ScheduledSeq] = field(default_factory=list)  # one new token each
    prefills: list[ScheduledSeq] = field(default_factory=list)  # chunks of more than one token
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    swap: SwapPlan = field(default_factory=SwapPlan)  # device↔host copies, run before the forward
    preempted_seq_ids: list[str] = field(default_factory=list)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.decodes + self.prefills

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.decodes) + sum(s.num_new_tokens for s in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        eos_token_ids: Iterable[int],
        cost_model: CostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.cost_model = cost_model if cost_model is not None else CostModel(block_bytes=1)
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions_by_mode = {"swap": 0, "recompute": 0}

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions_by_mode.values())

    # ----------------------------------------------------------------- admission and removal
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        """End a sequence now (stop, length or abort) and give its blocks back."""
        if seq.status.finished:
            return
        # Membership, not status, decides: an abort after a failed step must still free everything.
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)  # device blocks, or the host blocks of a swapped-out sequence
        seq.status = status
        seq.stop_reason = stop_reason

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child`` sharing every block of ``parent`` (n > 1 sampling after the prompt)."""
        self.kv.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    # ----------------------------------------------------------------------------- the step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(
                seq.seq_id, seq.token_ids, seq.num_computed_tokens, num_new, extra_keys=seq.extra_keys
            ):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted_seq_ids.append(victim.seq_id)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: nothing after it can fit either
            scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
            i += 1

        for seq in list(self.waiting):
            if budget <= 0 or out.preempted_seq_ids or len(self.running) >= self.config.max_num_seqs:
                break
            if self.kv.is_swapped(seq.seq_id):
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if not self.kv.swap_in(seq.seq_id, seq.token_ids, seq.num_computed_tokens, num_new):
                    break
            else:
                computed = self.kv.get_computed_blocks(seq.token_ids, seq.extra_keys)
                if computed.lower.num_pending_blocks and self._waits_for_disk(seq):
                    continue  # its prefix is being read from disk; the next ones may go first
                num_new = min(seq.num_tokens - computed.num_computed_tokens, budget)
                if not self.kv.allocate_slots(
                    seq.seq_id, seq.token_ids, computed.num_computed_tokens, num_new, computed, seq.extra_keys
                ):
                    break
                seq.num_computed_tokens = computed.num_computed_tokens
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens = computed.num_computed_tokens
                    seq.cached_tokens_by_tier = computed.tokens_by_tier(self.kv.block_size)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new

        for s in scheduled:
            (out.decodes if s.num_new_tokens == 1 else out.prefills).append(s)
        out.block_copies = self.kv.take_block_copies()
        out.swap = self.kv.end_schedule_step()
        return out

    def _waits_for_disk(self, seq: Sequence) -> bool:
        """Hold ``seq`` back while its disk blocks are read, up to ``disk_load_timeout_s``."""
        now = self.clock()
        if seq.disk_wait_deadline is None:
            seq.disk_wait_deadline = now + self.config.disk_load_timeout_s
        return now < seq.disk_wait_deadline

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        return ScheduledSeq(seq, seq.num_computed_tokens, num_new, tuple(self.kv.block_ids(seq.seq_id)))

    def _preempt(self, seq: Sequence) -> None:
        """Swap the sequence's KV out to the host tier, or drop its blocks (they stay cached) to be
        recomputed; either way it keeps its tokens and goes back to the front of the queue."""
        self.running.remove(seq)
        bs = self.kv.block_size
        mode = self.cost_model.choose(
            self.config.preemption_mode, seq.num_computed_tokens, -(-seq.num_computed_tokens // bs)
        )
        if (
            mode == "swap"
            and seq.num_computed_tokens
            and self.kv.swap_out(seq.seq_id, seq.num_computed_tokens)
        ):
            self.preemptions_by_mode["swap"] += 1
        else:
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
            self.preemptions_by_mode["recompute"] += 1
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    # --------------------------------------------------------------------- after the forward
    def advance(self, out: SchedulerOutput) -> None:
        """Record that the step's K/V now exist: advance counters and publish newly full blocks."""
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens
            self.kv.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.extra_keys)

    def append_token(self, seq: Sequence, token_id: int) -> None:
        """Add a sampled token and finish the sequence if a token-level stop condition is met."""
        seq.token_ids.append(token_id)
        p = seq.params
        num_out = seq.num_output_tokens
        if num_out > p.min_tokens:  # the sampler masks EOS/stop ids until min_tokens are out
            if not p.ignore_eos and token_id in self.eos_token_ids:
                self.finish(seq, SequenceStatus.FINISHED_STOPPED)
                return
            if token_id in p.stop_token_ids:
                self.finish(seq, SequenceStatus.FINISHED_STOPPED, token_id)
                return
        if (p.max_tokens is not None and num_out >= p.max_tokens) or seq.num_tokens >= seq.max_total_tokens:
            self.finish(seq, SequenceStatus.FINISHED_LENGTH)
