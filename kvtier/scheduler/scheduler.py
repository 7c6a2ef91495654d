"""Continuous batching at iteration level, with chunked prefill and recompute preemption.

Each ``schedule()`` builds one step under a token budget (``max_num_batched_tokens``):

1. Running sequences first, in admission order: a decoding sequence takes 1 token, a sequence in
   the middle of a chunked prefill takes its next chunk. If the block pool cannot supply the blocks,
   the most recently admitted running sequence is preempted (its blocks freed, to be recomputed
   later — usually mostly from the prefix cache) until the allocation fits.
2. Then waiting sequences are admitted in arrival order (preempted ones at the front), while the
   budget, ``max_num_seqs`` and the pool allow. Their cached prefix is looked up first and only the
   rest is computed; the last prompt token is always computed so there are logits to sample from.

Torch-free: the step is described by a ``SchedulerOutput`` the model runner turns into tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.config import SchedulerConfig
from kvtier.kv.manager import KVCacheManager
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
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, eos_token_ids: Iterable[int]):
        self.config = config
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ----------------------------------------------------------------- admission and removal
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        """End a sequence now (stop, length or abort) and give its blocks back."""
        if seq.status.finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.kv.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        seq.stop_reason = stop_reason

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child`` sharing every block of ``parent`` (n > 1 sampling after the prompt)."""
        self.kv.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

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

        while self.waiting and budget > 0 and not out.preempted_seq_ids:
            if len(self.running) >= self.config.max_num_seqs:
                break
            seq = self.waiting[0]
            computed = self.kv.get_computed_blocks(seq.token_ids, seq.extra_keys)
            num_new = min(seq.num_tokens - computed.num_computed_tokens, budget)
            if not self.kv.allocate_slots(
                seq.seq_id, seq.token_ids, computed.num_computed_tokens, num_new, computed, seq.extra_keys
            ):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = computed.num_computed_tokens
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = computed.num_computed_tokens
            self.running.append(seq)
            scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new

        for s in scheduled:
            (out.decodes if s.num_new_tokens == 1 else out.prefills).append(s)
        out.block_copies = self.kv.take_block_copies()
        return out

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        return ScheduledSeq(seq, seq.num_computed_tokens, num_new, tuple(self.kv.block_ids(seq.seq_id)))

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the blocks (they stay cached), keep the tokens, requeue first."""
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
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
