"""Goodput under overload: how many sequences may run at once, and how long a new one would wait.

A server past its capacity that lets every request into the running batch shares each step among
all of them, so none finishes (processor sharing: at twice the capacity a load generator saw 0 of 41
requests complete in 40 s). Instead the running set is bounded by what the machine can decode at a
latency target, the rest waits in order, and a request that would wait too long is refused at once::

    decode step at batch n    DecodeSteps: the measured decode-only step, an EMA per batch size n
                              (fed by CostModel.observe_step)
    ITL target                --max-itl-ms, or (0) --itl-factor x a lone sequence's step (measured,
                              or the line through the two smallest batches measured, at n = 1)
    running cap               the largest n whose measured step is within the target, grown by a
                              quarter (at least 1) beyond it to find out, but short of any larger
                              batch measured too slow; INITIAL_CAP before any measurement; never
                              above --max-num-seqs

    start rate                StartMeter: sequences that left the waiting queue per second of
                              backlog (time with someone waiting), over the last WINDOW_S
    predicted wait            (sequences waiting + the new one's) / start rate once the meter has
                              MIN_BACKLOG_S of backlog and MIN_STARTS starts; before that
                              (a cold start's burst) simulated_wait_s: the running sequences' and
                              the queue's remaining tokens played out on the cap's slots at the
                              measured step (an upper bound: it assumes no early stop)
                              0 when the new one would start at once

The server (``kvtier.server.async_engine``) refuses a request whose predicted wait is above
``--max-queue-wait-s`` with a 503 and ``Retry-After``. ``--itl-factor 0`` (with no ``--max-itl-ms``)
turns the cap off. Torch-free.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from kvtier.config import SchedulerConfig

INITIAL_CAP = 2  # running sequences before any decode step was measured (then grown step by step)
WINDOW_S = 30.0  # the start rate's memory
MIN_BACKLOG_S = 1.0  # backlogged seconds in the window before the rate is trusted
MIN_STARTS = 2
SMOOTHING = 0.2


@dataclass
class DecodeSteps:
    """Measured decode-only step seconds by batch size (EMAs; written by the engine's cost model)."""

    by_batch: dict[int, float] = field(default_factory=dict)

    def observe(self, num_decodes: int, seconds: float) -> None:
        if num_decodes < 1 or seconds <= 0:
            return
        old = self.by_batch.get(num_decodes)
        self.by_batch[num_decodes] = seconds if old is None else old + SMOOTHING * (seconds - old)

    def lone(self) -> float | None:
        """A lone sequence's step: measured, else the line through the two smallest batches measured,
        at n = 1 (at least the smallest batch's step over its size), else None."""
        if not self.by_batch:
            return None
        sizes = sorted(self.by_batch)
        n1, s1 = sizes[0], self.by_batch[sizes[0]]
        if n1 == 1 or len(sizes) == 1:
            return s1
        n2, s2 = sizes[1], self.by_batch[sizes[1]]
        slope = (s2 - s1) / (n2 - n1)
        return max(s1 - slope * (n1 - 1), s1 / n1)


class RunningCap:
    """The most sequences the running batch may hold (see the module docstring)."""

    def __init__(self, config: SchedulerConfig, steps: DecodeSteps):
        self.config = config
        self.steps = steps

    @property
    def enabled(self) -> bool:
        return self.config.max_itl_ms > 0 or self.config.itl_factor > 0

    def target_s(self) -> float | None:
        """The ITL target in seconds; None when the cap is off or nothing has been measured yet."""
        if self.config.max_itl_ms > 0:
            return self.config.max_itl_ms / 1000
        lone = self.steps.lone()
        if self.config.itl_factor <= 0 or lone is None:
            return None
        return self.config.itl_factor * lone

    def cap(self) -> int:
        limit = self.config.max_num_seqs
        if not self.enabled:
            return limit
        target = self.target_s()
        if target is None:
            return min(limit, INITIAL_CAP)
        within = [n for n, s in self.steps.by_batch.items() if s <= target]
        if not within:
            return 1
        ok = max(within)
        grown = ok + max(1, ok // 4)
        too_slow = [n for n, s in self.steps.by_batch.items() if n > ok and s > target]
        if too_slow:
            grown = min(grown, min(too_slow) - 1)  # never as far as a batch measured too slow
        return min(limit, max(INITIAL_CAP, grown))


class StartMeter:
    """Sequences started per second of backlog, over the last ``WINDOW_S`` seconds."""

    def __init__(self) -> None:
        self._ticks: deque[tuple[float, float, int]] = deque()  # (time, backlogged seconds, starts)
        self._last: float | None = None
        self._backlogged = False
        self._starts = 0

    def on_start(self) -> None:
        """A waiting sequence joined the running batch (counted at the next tick)."""
        self._starts += 1

    def tick(self, now: float, backlogged: bool) -> None:
        """Called once per schedule: ``backlogged`` whether someone waits after it."""
        if self._last is not None and self._backlogged:
            self._ticks.append((now, now - self._last, self._starts))
        self._last, self._backlogged, self._starts = now, backlogged, 0
        while self._ticks and self._ticks[0][0] < now - WINDOW_S:
            self._ticks.popleft()

    def rate(self) -> float | None:
        """Starts per backlogged second; None until the window holds enough of both."""
        seconds = sum(t[1] for t in self._ticks)
        starts = sum(t[2] for t in self._ticks)
        if seconds < MIN_BACKLOG_S or starts < MIN_STARTS:
            return None
        return starts / seconds


def simulated_wait_s(
    running_left: list[int],
    waiting: list[tuple[int, int]],
    cap: int,
    step_s: float,
    prefill_tokens_per_s: float,
) -> float:
    """When a new sequence would start: ``running_left`` tokens each running sequence has yet to
    decode, ``waiting`` (prompt tokens, output tokens) of each waiting one in order, ``cap`` slots,
    every decode step ``step_s``."""
    free_at = sorted(left * step_s for left in running_left)[: max(cap, 1)]
    free_at += [0.0] * max(0, cap - len(free_at))
    heapq.heapify(free_at)
    for prompt, output in waiting:
        start = heapq.heappop(free_at)
        heapq.heappush(free_at, start + prompt / prefill_tokens_per_s + output * step_s)
    return free_at[0]
