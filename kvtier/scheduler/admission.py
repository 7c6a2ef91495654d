"""Admission: whether a new request may join the engine now. Torch-free; runs on the engine thread.

::

    LLMEngine.add_request(..., admit=True)
        └─► Admission.check(token_ids, extra_keys, params)
              KV capacity: demand (running + waiting, blocks) + this request's need
                           > kv_admission_factor x the device pool        -> KVCapacityExceeded
              queue wait:  it would queue, and its predicted first token (the wait to join the
                           running batch + its prompt's own time)
                           > max_queue_wait_s (kvtier/scheduler/goodput.py) -> QueueWaitExceeded
    a request finishes  ─► Admission.on_finished(blocks it held): the drain rate behind Retry-After

Every request's KV need is estimated as ``prompt + max_tokens`` in blocks, minus the prompt's blocks
the device pool already caches (a running one: minus the blocks it holds)::

    demand = need(running) + need(waiting)                    (Scheduler.kv_demand_blocks)
    refuse the new request (503)  when demand > 0 and demand + need(new) > kv_admission_factor * pool

Below that bound the scheduler can run everything without preempting much (at factor 1, not at all);
above it accepting would only turn into a preemption storm. ``Retry-After`` is how long the excess
takes to drain at the rate finished requests have been releasing blocks (the last ``DRAIN_WINDOW_S``
seconds), clamped to [1, 60] s.

Both refusals carry ``retry_after_s`` (the server answers 503 with ``Retry-After``). Offline callers
(``kvtier.LLM``) queue without the check: every request they add runs.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvtier.config import SchedulerConfig
from kvtier.sampling_params import SamplingParams
from kvtier.scheduler.scheduler import Scheduler

DRAIN_WINDOW_S = 30.0
UNKNOWN_DRAIN_RETRY_S = 5  # Retry-After before any request has finished
MAX_RETRY_S = 60


@dataclass(frozen=True)
class KVVerdict:
    admit: bool
    need_blocks: int  # the new request's estimate
    demand_blocks: int  # running + waiting requests' estimate before it
    limit_blocks: int  # kv_admission_factor x the device pool
    retry_after_s: int  # when refused: the excess over the drain rate

    def message(self) -> str:
        return (
            f"the server's KV cache is oversubscribed: running and waiting requests need about "
            f"{self.demand_blocks} blocks and this one {self.need_blocks}, above the admission limit of "
            f"{self.limit_blocks} (--kv-admission-factor x the device pool); retry in {self.retry_after_s} s"
        )


class KVCapacityExceeded(RuntimeError):
    """Admitting the request would oversubscribe the KV cache (a 503 with ``Retry-After``)."""

    def __init__(self, verdict: KVVerdict):
        super().__init__(verdict.message())
        self.verdict = verdict
        self.retry_after_s = verdict.retry_after_s


class QueueWaitExceeded(RuntimeError):
    """The request would queue and wait longer than ``--max-queue-wait-s`` for its first token (a 503
    with ``Retry-After``)."""

    def __init__(self, wait_s: float, limit_s: float, start_s: float | None = None):
        self.wait_s, self.limit_s = wait_s, limit_s
        self.start_s = wait_s if start_s is None else start_s
        self.retry_after_s = max(1, min(MAX_RETRY_S, math.ceil(wait_s - limit_s)))
        super().__init__(
            f"the server is past its capacity: this request would wait about {wait_s:.1f} s for its first "
            f"token ({self.start_s:.1f} s to start; --max-queue-wait-s {limit_s:g}); retry in "
            f"{self.retry_after_s} s"
        )


class KVAdmission:
    """Admission by KV capacity and the drain rate behind ``Retry-After``."""

    def __init__(self, factor: float, num_device_blocks: int, clock: Any = time.monotonic):
        self.factor = factor
        self.limit_blocks = int(factor * num_device_blocks)
        self.clock = clock
        self._freed: deque[tuple[float, int]] = deque()  # (time, blocks) of finished requests
        self.demand_blocks = 0  # the latest estimate (exported on /metrics)

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def check(self, demand_blocks: int, need_blocks: int) -> KVVerdict:
        """Whether a request needing ``need_blocks`` may join ``demand_blocks`` of running + waiting work."""
        self.demand_blocks = demand_blocks
        excess = demand_blocks + need_blocks - self.limit_blocks
        admit = not self.enabled or demand_blocks == 0 or excess <= 0
        retry = 0 if admit else self.retry_after_s(excess)
        return KVVerdict(admit, need_blocks, demand_blocks, self.limit_blocks, retry)

    def on_finished(self, num_blocks: int) -> None:
        """A request finished and gave ``num_blocks`` device blocks back."""
        self._freed.append((self.clock(), num_blocks))

    def drain_blocks_per_s(self) -> float | None:
        now = self.clock()
        while self._freed and self._freed[0][0] < now - DRAIN_WINDOW_S:
            self._freed.popleft()
        if not self._freed:
            return None
        span = max(now - self._freed[0][0], 1.0)
        return sum(b for _, b in self._freed) / span

    def retry_after_s(self, excess_blocks: int) -> int:
        rate = self.drain_blocks_per_s()
        if not rate:
            return UNKNOWN_DRAIN_RETRY_S
        return max(1, min(MAX_RETRY_S, math.ceil(excess_blocks / rate)))


class Admission:
    """The engine's one admission decision: KV capacity first, then the predicted queue wait."""

    def __init__(
        self, config: SchedulerConfig, scheduler: Scheduler, num_device_blocks: int, max_model_len: int
    ):
        self.kv = KVAdmission(config.kv_admission_factor, num_device_blocks)
        self.max_queue_wait_s = config.max_queue_wait_s
        self.scheduler = scheduler
        self.max_model_len = max_model_len

    def check(self, token_ids: list[int], extra_keys: tuple[str, ...], params: SamplingParams) -> None:
        """Raise ``KVCapacityExceeded`` or ``QueueWaitExceeded`` when the request may not join now."""
        scheduler = self.scheduler
        if self.kv.enabled:
            need = scheduler.kv_need_for(
                token_ids, extra_keys, params.max_tokens, self.max_model_len, params.n
            )
            verdict = self.kv.check(scheduler.kv_demand_blocks(), need)
            if not verdict.admit:
                raise KVCapacityExceeded(verdict)
        if self.max_queue_wait_s > 0:
            self._check_wait(token_ids, extra_keys, params.n)

    def _check_wait(self, token_ids: list[int], extra_keys: tuple[str, ...], n: int) -> None:
        """Refuse a request that would queue when its predicted first token is past the limit."""
        scheduler = self.scheduler
        start = scheduler.predicted_wait_s(n)
        if start <= 0:
            return  # it starts at once: never refused, however long its prompt
        if start > self.max_queue_wait_s:
            raise QueueWaitExceeded(start, self.max_queue_wait_s)
        cached = scheduler.num_cached_device_blocks(token_ids, extra_keys) * scheduler.kv.block_size
        # its own prompt counts up to half the limit: a prompt longer than that would be refused
        # whenever anything is ahead of it, and never served on a busy server
        own = min(scheduler.goodput.predicted_prompt_s(len(token_ids) - cached), self.max_queue_wait_s / 2)
        first_token = start + own
        if first_token > self.max_queue_wait_s:
            raise QueueWaitExceeded(first_token, self.max_queue_wait_s, start)

    def on_finished(self, num_blocks: int) -> None:
        """A request finished and its sequences gave ``num_blocks`` device blocks back."""
        self.kv.on_finished(num_blocks)
