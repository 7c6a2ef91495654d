"""Continuous batching at iteration level, with chunked prefill and preemption by swap or recompute.

Two policies (``scheduling_policy``); each ``schedule()`` builds one step.

**stall_free** (Sarathi-Serve's stall-free batching, vLLM's chunked prefill)::

    1. decodes      every running sequence that decodes gets its 1 token, first (best priority,
                    then oldest admission first); if the pool cannot grow one, the worst running
                    sequence (largest priority value, then the latest admitted) is preempted. With
                    ``row_share_span`` (0 offline, 8 in ``kvtier serve``), while other requests share
                    the engine a request with many rows (n > 1) decodes a share of them a step,
                    rotating (``fairness.py``)
    2. budget       prefill tokens = what the measured cost model says fits beside those decodes in
                    a target step time: ``step_time_factor`` decode-only steps (at least
                    ``max_step_ms``), widened while the oldest prompt waits (``budget.py``), capped by
                    ``max_num_batched_tokens``
    3. prefills     with ``max_num_partial_prefills`` = P > 0, a *short step* first when a waiting
                    prompt needs at most SHORT_STEP_FRACTION of ``max_num_batched_tokens`` (its
                    prefix cached in the device pool or host tier not counted: an agent's next
                    turn, a chat's short message): short prompts only, so their first token waits
                    for one short step instead of a step full of others' chunks; never two short
                    steps in a row. Otherwise:
                      a. a prompt mid-prefill that got nothing for STARVE_STEPS steps takes its chunk,
                         then one waiting prompt that finishers behind it overtook for STARVE_STEPS
                         steps in a row (one too long to finish in a step, behind a stream of prompts
                         that do, would otherwise never start)
                      b. *finishers*: prompts whose whole rest fits in what is left of the budget,
                         running ones first, then waiting ones in fair order (``fairness.py``):
                         short prompts overtake a long one's remaining chunks
                      c. *chunks*: what is left goes to prompts that stay mid-prefill, at most P of
                         them at once (those already mid-prefill first)
                    with P = 0: running prompts first, then waiting ones, each takes what is left

**legacy** (the first scheduler, before step budgets and fair order): one fixed token budget; running
sequences in admission order take 1 token or their next chunk (a long prompt's 2,048-token chunk
shares the step with every decode), then waiting ones in arrival order. A request's many rows take
their share (``row_share_span``) as in stall_free.

In both, preemption either *swaps* the sequence's KV to the host tier (loaded back when it resumes)
or drops its blocks to be *recomputed* later (usually mostly from the prefix cache);
``preemption_mode`` and the measured costs decide (``preemption.py``). A waiting sequence's cached
prefix is looked up in every tier and only the rest is computed; the last prompt token is always
computed so there are logits to sample from. A sequence whose prefix continues on disk is held back
while those blocks are read into host memory (others go first), until the reads finish or
``disk_load_timeout_s`` passes.

The KV manager accumulates the step's device↔host copies as it allocates; they leave in
``SchedulerOutput.swap``. Torch-free: the runner turns a ``SchedulerOutput`` into tensors.
"""

from __future__ import annotations

import itertools
import math
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from kvtier.config import SchedulerConfig
from kvtier.kv.computed import ComputedBlocks
from kvtier.kv.manager import NO_COMPUTED_BLOCKS, KVCacheManager
from kvtier.kv.plan import SwapPlan
from kvtier.scheduler.budget import StepBudget
from kvtier.scheduler.fairness import FairOrder, run_order_key, sibling_share, victim_key
from kvtier.scheduler.goodput import Goodput
from kvtier.scheduler.preemption import CostModel
from kvtier.scheduler.prefill_plan import PoolFull, PrefillPlan, passed_over
from kvtier.sequence import Sequence, SequenceStatus

STARVE_STEPS = 4  # a prompt mid-prefill passed over this many steps in a row goes first
# A request without max_tokens may run to max_model_len; the KV admission estimate counts it as this
# many output tokens (at most what its context leaves), not the worst case.
UNSPECIFIED_OUTPUT_TOKENS = 1024
SHORT_STEP_FRACTION = 0.25  # a short step holds at most this share of a full step's tokens


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: tokens [num_computed_tokens, num_computed_tokens + num_new_tokens)."""

    seq: Sequence
    num_computed_tokens: int
    num_new_tokens: int
    # Every KV group's block table after this step's allocation (one for a dense model; int64 arrays
    # from the KV manager); a sliding group's leading entries may be null (NULL_BLOCK_ID: released, out
    # of its window, never read).
    block_tables: tuple[array[int] | tuple[int, ...], ...]

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
        self.budget = StepBudget(config, self.cost_model)
        self.goodput = Goodput(config)
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions_by_mode = {"swap": 0, "recompute": 0}
        self._admissions = itertools.count(1)
        self._last_short_lane = False  # the last step was a short prompts' step (_short_lane)

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions_by_mode.values())

    # ----------------------------------------------------------------- admission and removal
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        cached = self.kv.num_prefix_blocks(seq.token_ids, seq.extra_keys)  # device, device + host
        seq.kv_cached_blocks, seq.cached_prefix_blocks = cached
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
        if status in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH):
            self.goodput.output_lengths.observe(seq.num_output_tokens)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child`` sharing every block of ``parent`` (n > 1 sampling after the prompt)."""
        self.kv.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_prompt_tokens_in_cache = parent.num_prompt_tokens_in_cache
        child.priority, child.tenant = parent.priority, parent.tenant
        child.arrival_time = parent.arrival_time
        self._start(child)

    def _start(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        seq.admitted_order = next(self._admissions)
        self.running.append(seq)

    # ---------------------------------------------------------------- KV demand (admission control)
    def num_cached_device_blocks(self, token_ids: list[int], extra_keys: tuple[str, ...]) -> int:
        """Leading full blocks of ``token_ids`` the device pool holds now, in every KV group (a pure
        lookup; a block position counts once however many groups hold it)."""
        return self.kv.num_device_prefix_blocks(token_ids, extra_keys)

    def kv_need_blocks(self, seq: Sequence) -> int:
        """Device blocks ``seq`` still needs to reach ``max_total_tokens`` (prompt + max_tokens)."""
        max_total = seq.max_total_tokens
        if seq.params.max_tokens is None:
            expected = seq.num_prompt_tokens + UNSPECIFIED_OUTPUT_TOKENS
            max_total = min(max_total, max(expected, seq.num_tokens + 1))
        total = self.kv.num_blocks_for(max_total)  # over every KV group (one group: ceil(tokens / B))
        if seq.status is SequenceStatus.RUNNING:
            return max(0, total - self.kv.num_held_blocks(seq.seq_id))
        return max(0, total - self.kv.num_blocks_for(seq.kv_cached_blocks * self.kv.block_size))

    def kv_need_for(
        self,
        token_ids: list[int],
        extra_keys: tuple[str, ...],
        max_tokens: int | None,
        max_model_len: int,
        n: int = 1,
    ) -> int:
        """The device blocks a new request would need: prompt + ``max_tokens`` (None:
        ``UNSPECIFIED_OUTPUT_TOKENS``) within ``max_model_len``, minus the cached prompt blocks; each of
        ``n`` completions its own output."""
        kv, num_prompt = self.kv, len(token_ids)
        output = max_tokens if max_tokens is not None else UNSPECIFIED_OUTPUT_TOKENS
        total = min(max_model_len, num_prompt + output)
        cached = self.num_cached_device_blocks(token_ids, extra_keys) * kv.block_size
        need = kv.num_blocks_for(total) - kv.num_blocks_for(cached)  # blocks over every KV group
        return max(0, need) + (n - 1) * kv.num_blocks_for(total - num_prompt)

    def kv_demand_blocks(self) -> int:
        """Blocks every running and waiting sequence still needs, at most (an estimate: a prompt
        with ``n`` completions counts once until it forks)."""
        return sum(self.kv_need_blocks(s) for s in itertools.chain(self.running, self.waiting))

    # ----------------------------------------------------------------------------- the step
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        self.goodput.on_schedule(now, len(self.running), backlogged=bool(self.waiting))
        out = self._schedule()
        self.goodput.on_scheduled(now, len(out.scheduled), chunked=bool(out.prefills))
        return out

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.config.scheduling_policy == "legacy":
            scheduled = self._schedule_legacy(out)
        else:
            scheduled = self._schedule_decodes(out)
            budget = self.budget.prefill_tokens(len(scheduled), self.oldest_wait_s())
            scheduled += self._schedule_prefills(out, budget, {s.seq.seq_id for s in scheduled})
            if not scheduled and not out.preempted_seq_ids and len(self.running) > 1:
                self._unblock(out)
        for s in scheduled:
            (out.decodes if s.num_new_tokens == 1 else out.prefills).append(s)
        out.block_copies = self.kv.take_block_copies()
        out.swap = self.kv.end_schedule_step()
        return out

    def predicted_wait_s(self, num_new: int) -> float:
        """How long ``num_new`` new sequences would wait to start (goodput.py): 0 when they would
        join the running batch at once."""
        if self.goodput.starts_at_once(len(self.running), len(self.waiting), num_new):
            return 0.0
        return self.goodput.predicted_wait_s(
            [self._output_left(s) for s in self.running],
            [(s.num_remaining_tokens, self._output_left(s)) for s in self.waiting],
            num_new,
            self.cost_model.decode_step_s,
            self.cost_model.prefill_tokens_per_s,
        )

    def _output_left(self, seq: Sequence) -> int:
        """Tokens ``seq`` is expected to decode still: at most what it may (``UNSPECIFIED_OUTPUT_TOKENS``
        stands in for no max_tokens), at most what finished sequences decoded (goodput.py)."""
        left = seq.max_total_tokens - seq.num_tokens
        if seq.params.max_tokens is None:
            left = min(left, UNSPECIFIED_OUTPUT_TOKENS - seq.num_output_tokens)
        return self.goodput.output_lengths.left(seq.num_output_tokens, max(0, left))

    def oldest_wait_s(self) -> float:
        """How long the oldest waiting (not yet admitted) request has queued; 0 when none."""
        arrivals = [s.arrival_time for s in self.waiting]
        return max(0.0, self.clock() - min(arrivals)) if arrivals else 0.0

    def _schedule_decodes(self, out: SchedulerOutput) -> list[ScheduledSeq]:
        """Every decoding sequence's token, best first; growing one may preempt the worst others. Beside
        other requests, a request's many rows (n > 1) decode a share of them (``fairness.sibling_share``)."""
        decoding = sorted((s for s in self.running if s.num_remaining_tokens == 1), key=run_order_key)
        sitting_out = self._sitting_out(decoding)
        if sitting_out:
            decoding = [s for s in decoding if s.seq_id not in sitting_out]
        scheduled: list[ScheduledSeq] = []
        taken: set[str] = set()
        for seq in decoding[: self.config.max_num_batched_tokens]:
            if seq.status is SequenceStatus.RUNNING and self._allocate(seq, 1, out, taken):
                scheduled.append(self.entry(seq, 1))
                taken.add(seq.seq_id)
        return scheduled

    def _shared(self) -> bool:
        """Whether more than one request has work now (waiting, prefilling or decoding)."""
        return bool(self.waiting) or len({s.request_id for s in self.running}) > 1

    def _sitting_out(self, decoding: list[Sequence] | None = None) -> set[str]:
        """The sibling rows that sit this step out while other requests share the engine (fairness.py);
        each is counted (the longest out go first next time). ``decoding``: the decoding rows in run
        order, when the caller has them. Call once per step."""
        span = self.config.row_share_span
        if span <= 0 or not self._shared():
            return set()
        if decoding is None:
            decoding = sorted((s for s in self.running if s.num_remaining_tokens == 1), key=run_order_key)
        sitting_out = sibling_share(decoding, span)
        for seq in sitting_out:
            seq.num_yielded_steps += 1
        return {s.seq_id for s in sitting_out}

    def _allocate(self, seq: Sequence, num_new: int, out: SchedulerOutput, taken: set[str]) -> bool:
        """Grow ``seq``'s table by ``num_new`` slots, preempting the worst running sequences not yet
        in this step until it fits; False when ``seq`` itself had to go (or nothing is left to take)."""
        while not self.kv.allocate_slots(
            seq.seq_id, seq.token_ids, seq.num_computed_tokens, num_new, extra_keys=seq.extra_keys
        ):
            candidates = [s for s in self.running if s.seq_id not in taken]
            if not candidates:
                return False
            victim = max(candidates, key=victim_key)
            self._preempt(victim)
            out.preempted_seq_ids.append(victim.seq_id)
            if victim is seq:
                return False
        return True

    def _schedule_prefills(self, out: SchedulerOutput, budget: int, taken: set[str]) -> list[ScheduledSeq]:
        """Prompt chunks within ``budget`` tokens (see the module docstring, step 3)."""
        prompts = sorted((s for s in self.running if s.num_remaining_tokens > 1), key=run_order_key)
        plan = self._short_lane(out, budget, taken, prompts)
        if plan is None:
            fair = FairOrder(self.waiting, self.running)
            plan = PrefillPlan(self, out, budget, taken, fair)
            self._plan_prefills(plan, prompts, iter(fair))
        for seq in prompts:
            seq.num_starved_steps = 0 if seq.seq_id in plan.taken else seq.num_starved_steps + 1
        for seq in self.waiting:  # overtaken by a finisher behind it: one more step starved
            overtaken = seq.seq_id in plan.overtaken and seq.seq_id not in plan.taken
            seq.num_starved_steps = seq.num_starved_steps + 1 if overtaken else 0
        return plan.scheduled

    def _plan_prefills(self, plan: PrefillPlan, prompts: list[Sequence], order: Iterator[Sequence]) -> None:
        limit = self.config.max_num_partial_prefills
        if limit == 0:
            for seq in prompts:
                plan.continue_prompt(seq)
            plan.admit_all(order, must_finish=False)
            return
        starved = [s for s in prompts if s.num_starved_steps >= STARVE_STEPS]
        for seq in starved:
            plan.continue_prompt(seq)
        waited = [s for s in self.waiting if s.num_starved_steps >= STARVE_STEPS]
        plan.admit_all(waited, must_finish=False, limit=1)  # one long prompt the finishers kept out
        for seq in prompts:
            plan.continue_prompt(seq, must_finish=True)
        passed = plan.admit_all(order, must_finish=True)
        partial = [s for s in prompts if s.seq_id not in plan.taken]
        for seq in partial[:limit]:
            plan.continue_prompt(seq)
        plan.admit_all(itertools.chain(passed, order), must_finish=False, limit=limit - len(partial))

    def _short_lane(
        self, out: SchedulerOutput, budget: int, taken: set[str], prompts: list[Sequence]
    ) -> PrefillPlan | None:
        """A step of short prompts only: prompts that need at most ``short_prompt_tokens`` more (the cached
        prefix in the device pool or host tier not counted) finish in a step without anyone's long
        chunk, so their first token waits for one short step, not for a full one (nor for a long
        prompt's last chunk, when the time budget beside running decodes is smaller than theirs). Never
        two such steps in a row: long prompts get at least every other step. None when it admitted no one."""
        if self._last_short_lane or self.config.max_num_partial_prefills == 0:  # 0: chunks in order
            self._last_short_lane = False
            return None
        most = self.short_prompt_tokens
        short = [s for s in self.waiting if self.uncached_tokens(s) <= most]
        if not short:
            return None
        # the time budget beside the decodes may be smaller than a short prompt: a short step may be as
        # long as the policy's widest (--step-time-max-factor; never wider than its own budget when
        # that equals --step-time-factor: streams first)
        widest = self.budget.prefill_tokens(len(taken), oldest_wait_s=math.inf)
        fair = FairOrder(short, self.running)
        plan = PrefillPlan(self, out, max(budget, min(most, widest)), taken, fair)
        for seq in prompts:
            if seq.num_remaining_tokens <= most:
                plan.continue_prompt(seq, must_finish=True)
        plan.admit_all(fair, must_finish=True)
        self._last_short_lane = bool(plan.scheduled)
        return plan if plan.scheduled else None

    @property
    def short_prompt_tokens(self) -> int:
        """The most a prompt may compute to get a short step: a quarter of a full step (128 of 512)."""
        return int(self.config.max_num_batched_tokens * SHORT_STEP_FRACTION)

    def uncached_tokens(self, seq: Sequence) -> int:
        """About how many tokens a waiting ``seq`` would compute: its prefix the device pool or the host
        tier held when it arrived not counted (a cheap estimate; ``admit`` looks up the real hit)."""
        return seq.num_remaining_tokens - seq.cached_prefix_blocks * self.kv.block_size

    def admit(self, seq: Sequence, budget: int, must_finish: bool) -> int | None:
        """Move a waiting ``seq`` into the running batch with its first chunk (at most ``budget``
        tokens; with ``must_finish`` only if that is its whole rest). The chunk's size, or None when
        it is passed over; ``PoolFull`` when the pool cannot take it."""
        if self.kv.is_swapped(seq.seq_id):
            num_new = min(seq.num_remaining_tokens, budget)
            if must_finish and num_new < seq.num_remaining_tokens:
                return None
            num_new = self._fit_chunk(
                num_new,
                must_finish,
                lambda n: self.kv.swap_in(seq.seq_id, seq.token_ids, seq.num_computed_tokens, n),
                seq.num_computed_tokens,
            )
            if not num_new:
                return passed_over(must_finish)
        else:
            # prompt logprobs need every prompt token's logits: no cache hit for such a prefill
            computed = (
                NO_COMPUTED_BLOCKS
                if seq.needs_prompt_logprobs
                else self.kv.get_computed_blocks(seq.token_ids, seq.extra_keys)
            )
            if computed.lower.num_pending_blocks and self._waits_for_disk(seq):
                # its prefix is being read (disk, Redis: a handoff's); the next ones may go first. Once
                # read, the cheap tests count it cached: its rest may then get a short step.
                hit = computed.num_computed_tokens // self.kv.block_size + computed.lower.num_pending_blocks
                seq.cached_prefix_blocks = max(seq.cached_prefix_blocks, hit)
                return None
            rest = seq.num_tokens - computed.num_computed_tokens
            num_new = min(rest, budget)
            if must_finish and num_new < rest:
                return None
            num_new = self._fit_chunk(
                num_new,
                must_finish,
                lambda n: self.kv.allocate_slots(
                    seq.seq_id, seq.token_ids, computed.num_computed_tokens, n, computed, seq.extra_keys
                ),
                computed.num_computed_tokens,
            )
            if not num_new:
                return passed_over(must_finish)
            seq.num_computed_tokens = computed.num_computed_tokens
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = computed.num_computed_tokens
                seq.cached_tokens_by_tier = computed.tokens_by_tier(self.kv.block_size)
                seq.num_prompt_tokens_in_cache = self._tokens_in_cache(seq, computed)
        self.waiting.remove(seq)
        self._start(seq)
        self.goodput.starts.on_start()
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = self.clock()
        return num_new

    def _tokens_in_cache(self, seq: Sequence, hit: ComputedBlocks) -> int:
        """The hit's tokens, or the whole prompt when a hit of every block but the last (a multiple of
        the block size long) left that block out only to compute the logits."""
        n, bs, found = seq.num_tokens, self.kv.block_size, hit.num_computed_tokens
        if n % bs or found != n - bs:
            return found
        return n if self.kv.holds_last_block(seq.token_ids, seq.extra_keys, hit.block_hashes) else found

    # ------------------------------------------------------------------- the legacy policy
    def _schedule_legacy(self, out: SchedulerOutput) -> list[ScheduledSeq]:
        """The first scheduler: one fixed token budget, admission order."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        sitting_out = self._sitting_out()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.seq_id in sitting_out:
                i += 1
                continue
            num_new = self._legacy_chunk(seq, min(seq.num_remaining_tokens, budget))
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
            scheduled.append(self.entry(seq, num_new))
            budget -= num_new
            i += 1
        for seq in list(self.waiting):
            if budget <= 0 or out.preempted_seq_ids or len(self.running) >= self.goodput.running_cap.cap():
                break
            try:
                num_new = self.admit(seq, budget, must_finish=False)
            except PoolFull:
                break
            if num_new is not None:
                scheduled.append(self.entry(seq, num_new))
                budget -= num_new
        return scheduled

    def _legacy_chunk(self, seq: Sequence, num_new: int) -> int:
        """A running sequence's next chunk: with several KV groups, a prompt chunk the pool cannot take
        is halved (down to a block) before anyone is preempted for it; without prefix caching, a
        sequence that preempted itself for its next chunk would start over and never finish."""
        if num_new <= 1 or self.kv.layout.is_dense:
            return num_new
        return self.grow(seq, num_new, must_finish=False) or min(num_new, self.kv.block_size)

    # ------------------------------------------------------------------------------ helpers
    def _waits_for_disk(self, seq: Sequence) -> bool:
        """Hold ``seq`` back while its disk blocks are read, up to ``disk_load_timeout_s``."""
        now = self.clock()
        if seq.disk_wait_deadline is None:
            seq.disk_wait_deadline = now + self.config.disk_load_timeout_s
        return now < seq.disk_wait_deadline

    def _fit_chunk(
        self, num_new: int, must_finish: bool, allocate: Callable[[int], bool], num_computed: int
    ) -> int:
        """``allocate(n)`` for a prompt chunk of ``n = num_new`` tokens after ``num_computed``; the tokens
        allocated, 0 when it does not fit. With several KV groups a chunk takes one block per group for
        each of its blocks (a sliding group releases them once computed), so one too large for the pool
        is halved rather than waiting for room that may never come (not when it ``must_finish``): down
        to the rest of the block the sequence is in, which takes no new block (a sequence swapped out
        mid-block, resumed with a whole block's chunk, needed one table position more than the pool
        had, on every step: a Gemma 3 shape's swap run never finished)."""
        bs = self.kv.block_size
        floor = bs - num_computed % bs
        while not allocate(num_new):
            if self.kv.layout.is_dense or must_finish or num_new <= floor:
                return 0
            num_new = max(floor, num_new // 2)
        return num_new

    def grow(self, seq: Sequence, num_new: int, must_finish: bool) -> int:
        """``_fit_chunk`` for the next chunk of a sequence that has blocks."""
        kv = self.kv

        def allocate(n: int) -> bool:
            return kv.allocate_slots(
                seq.seq_id, seq.token_ids, seq.num_computed_tokens, n, None, seq.extra_keys
            )

        return self._fit_chunk(num_new, must_finish, allocate, seq.num_computed_tokens)

    def entry(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        seq.num_yielded_steps = 0
        return ScheduledSeq(seq, seq.num_computed_tokens, num_new, self.kv.step_tables(seq.seq_id))

    def _unblock(self, out: SchedulerOutput) -> None:
        """Nothing could run: each running sequence waits for blocks the others hold (a hybrid model's
        prompts, each part-way through its chunks in a tight pool, none of which preempts for a prompt
        chunk here). The worst one goes (swapped out or recomputed), so the others go on next step; the
        oldest never goes, so it gets further every time until it finishes."""
        victim = max(self.running, key=victim_key)
        self._preempt(victim)
        out.preempted_seq_ids.append(victim.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        """Swap the sequence's KV out to the host tier, or drop its blocks (they stay cached) to be
        recomputed; either way it keeps its tokens and goes back to the front of the queue."""
        self.running.remove(seq)
        mode = self.cost_model.choose(
            self.config.preemption_mode,
            seq.num_computed_tokens,
            self.kv.num_blocks_for(seq.num_computed_tokens),
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
        seq.last_token_time = self.clock()
        p = seq.params
        num_out = seq.num_output_tokens
        # its first token: how long its prompt took (once a prompt: the sequence that computed it)
        if num_out == 1 and seq.index == 0 and seq.first_scheduled_time is not None:
            computed = seq.num_prompt_tokens - (seq.num_cached_tokens or 0)
            self.goodput.first_tokens.observe(seq.last_token_time - seq.first_scheduled_time, computed)
        if num_out > p.min_tokens:  # the sampler masks EOS/stop ids until min_tokens are out
            if not p.ignore_eos and token_id in self.eos_token_ids:
                self.finish(seq, SequenceStatus.FINISHED_STOPPED)
                return
            if token_id in p.stop_token_ids:
                self.finish(seq, SequenceStatus.FINISHED_STOPPED, token_id)
                return
        if (p.max_tokens is not None and num_out >= p.max_tokens) or seq.num_tokens >= seq.max_total_tokens:
            self.finish(seq, SequenceStatus.FINISHED_LENGTH)

    # ------------------------------------------------------------------------- inspection
    def waiting_weight(self) -> int:
        """Sequences waiting to start, a prompt that will fork into ``n`` counting ``n``."""
        return sum(seq.params.n if seq.forks_on_prompt_done else 1 for seq in self.waiting)
