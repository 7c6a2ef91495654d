"""Goodput under overload: how many sequences may run at once, and how long a new one would wait.

A server past its capacity that lets every request into the running batch shares each step among
all of them, so none finishes (processor sharing: at twice the capacity a load generator saw 0 of 41
requests complete in 40 s). Instead the running set is bounded by what the machine can serve at a
latency target, the rest waits in order, and a request that would wait too long is refused at once::

    step times                StepTimes: the wall time from one step's start to the next while work
                              remains (what a stream waits between tokens: forward, sampling, the
                              prompt chunks that joined, whatever the process did between steps);
                              ``recent``, an EMA over the last ~1/SMOOTHING steps, and the best step
                              seen per batch size; the first WARMUP_STEPS are not counted (a fresh
                              process's first steps are slow)
    ITL target                --max-itl-ms, or (0) --itl-factor x a lone sequence's step (the best
                              at n = 1, or the line through the two smallest batches' bests)
    running cap               a controller, every SETTLE_STEPS steps: while the recent step is within
                              the target and the batch is full, the cap grows by half (at least
                              1); while it is over, it shrinks by a quarter of the batch it holds
                              (no sequence is stopped: fewer start, as the running ones finish at
                              the rate the machine finishes them); INITIAL_CAP before any
                              measurement, and never below it (MIN_CAP); never above --max-num-seqs.
                              Prompt chunks are in the step times, so a machine bound by prefill is
                              capped by it too. The floor: a step of so few sequences is over the
                              target (10 lone steps in kvtier serve) because of a prompt chunk, not
                              the batch, and a long prompt in a quiet hour (a 3,000-token one beside
                              one stream) took the cap to 1 and the server refused 10 of the 12
                              requests of the burst after it (benchmarks/burst.py); a --max-itl-ms
                              below a 4-sequence step still lets 4 run

    start rate                StartMeter: sequences that left the waiting queue per second of
                              backlog (time with someone waiting), over the last WINDOW_S
    output lengths            OutputLengths: an EMA of finished sequences' output tokens; a
                              sequence is expected to decode up to that (at least 1 more), never
                              past its max_tokens
    predicted wait            0 when the new one would start at once; else simulated_wait_s: the
                              running sequences' and the queue's expected tokens played out on the
                              cap's slots at a decode step of the batch that will run (with more
                              running than the cap, only the last finishes free a slot). The step:
                              StepTimes.decode_at, an EMA per batch size of the steps without a
                              prompt chunk, a line between sizes, the recent step before any
                              (prompts count at the prefill rate: the recent step, which counts
                              the chunks again, refused 8 of a burst of 12 after a long prompt,
                              and on a quiet server let all 12 in with first tokens at 2x the
                              limit, a step of 4 being twice a lone one: tests/test_goodput.py).
                              Once the meter has MIN_BACKLOG_S of backlog and MIN_STARTS starts, at
                              least (sequences waiting + the new one's + those running above the
                              cap) / start rate. The rate alone
                              ran short: finishes come in bunches (sequences that started together
                              end together), so a request arriving after a bunch waits for the next
    its prompt's own time     FirstTokenTimes: seconds from a sequence's start to its first token
                              per prompt token it computed (the ratio of two EMAs over the last
                              ~1/SMOOTHING first tokens), times the new prompt's uncached tokens; at
                              least the recent step (a cached prompt still waits for one)
    predicted first token     the predicted wait + its prompt's own time, counted up to half the
                              limit (a longer prompt would be refused whenever anything is ahead
                              of it: on a busy server, never served)

The server (``kvtier.server.async_engine``) refuses a request that would queue (predicted wait > 0)
and whose predicted first token is later than ``--max-queue-wait-s`` with a 503 and ``Retry-After``:
a started request still computes its prompt in steps it shares with the running batch, so the wait
to *start* alone let first tokens run seconds past the limit (benchmarks/overload.py). A request that
would start at once is never refused, however long its prompt. ``--itl-factor 0`` (with no ``--max-itl-ms``)
turns the cap off. Torch-free.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.config import SchedulerConfig

INITIAL_CAP = 4  # running sequences before any step was measured (then grown step by step)
MIN_CAP = INITIAL_CAP  # ... and the fewest it shrinks to
WARMUP_STEPS = 8  # a process's first steps, not measured
SETTLE_STEPS = 10  # steps between two changes of the cap (about the recent EMA's memory)
WINDOW_S = 30.0  # the start rate's memory
MIN_BACKLOG_S = 1.0  # backlogged seconds in the window before the rate is trusted
MIN_STARTS = 2
SMOOTHING = 0.1  # ``recent`` is about the last 10 steps: a prompt chunk's long step is averaged in


@dataclass
class StepTimes:
    """Wall seconds between consecutive steps: ``recent`` (an EMA over every batch) and the best per
    batch size. Fed by ``Goodput.on_schedule``."""

    recent: float | None = None
    best: dict[int, float] = field(default_factory=dict)
    decode: dict[int, float] = field(default_factory=dict)  # batch -> EMA of its steps without a chunk
    num_seen: int = 0

    def observe(self, batch: int, seconds: float, chunked: bool = False) -> None:
        """A step of ``batch`` sequences took ``seconds`` (``chunked``: it computed prompt tokens)."""
        if batch < 1 or seconds <= 0:
            return
        self.num_seen += 1
        if self.num_seen <= WARMUP_STEPS:
            return
        old = self.recent
        self.recent = seconds if old is None else old + SMOOTHING * (seconds - old)
        self.best[batch] = min(seconds, self.best.get(batch, seconds))
        if not chunked:
            old = self.decode.get(batch)
            self.decode[batch] = seconds if old is None else old + SMOOTHING * (seconds - old)

    def decode_at(self, batch: int) -> float | None:
        """A step of ``batch`` decoding sequences: its EMA, else the line between the nearest measured
        sizes around it (beyond the largest: through the two largest, never below the largest's; below
        the smallest: the smallest's); None before any step without a chunk was measured."""
        if batch in self.decode or not self.decode:
            return self.decode.get(batch)
        sizes = sorted(self.decode)
        below, above = [n for n in sizes if n < batch], [n for n in sizes if n > batch]
        if not below:
            return self.decode[above[0]]
        if above:
            n1, n2 = below[-1], above[0]
        elif len(below) == 1:
            return self.decode[below[0]]
        else:
            n1, n2 = below[-2], below[-1]
        s1, s2 = self.decode[n1], self.decode[n2]
        at = s1 + (s2 - s1) * (batch - n1) / (n2 - n1)
        return at if above else max(at, s2)

    def lone(self) -> float | None:
        """A lone sequence's step: the best at n = 1, else the line through the two smallest batches'
        bests at n = 1 (between the smallest's step over its size and that step), else None."""
        if not self.best:
            return None
        sizes = sorted(self.best)
        n1, s1 = sizes[0], self.best[sizes[0]]
        if n1 == 1 or len(sizes) == 1:
            return s1
        n2, s2 = sizes[1], self.best[sizes[1]]
        slope = (s2 - s1) / (n2 - n1)
        return min(s1, max(s1 - slope * (n1 - 1), s1 / n1))


@dataclass
class OutputLengths:
    """Output tokens of finished sequences (an EMA): how much longer a running one is expected to
    decode. Fed by ``Scheduler.finish``."""

    mean: float | None = None

    def observe(self, num_output_tokens: int) -> None:
        old = self.mean
        self.mean = num_output_tokens if old is None else old + SMOOTHING * (num_output_tokens - old)

    def left(self, produced: int, max_left: int) -> int:
        """Tokens a sequence that has ``produced`` tokens and may decode ``max_left`` more is expected
        to decode: ``max_left`` until a sequence has finished."""
        if self.mean is None:
            return max_left
        return min(max_left, max(1, round(self.mean) - produced))


@dataclass
class FirstTokenTimes:
    """Seconds from a sequence's start to its first token against the prompt tokens it computed in
    between: ``predict`` scales their ratio (two EMAs, so long prompts weigh by their tokens) to a new
    prompt. Fed by ``Scheduler.append_token``."""

    seconds: float | None = None
    tokens: float | None = None

    def observe(self, seconds: float, tokens: int) -> None:
        tokens = max(1, tokens)
        if self.seconds is None or self.tokens is None:
            self.seconds, self.tokens = seconds, float(tokens)
            return
        self.seconds += SMOOTHING * (seconds - self.seconds)
        self.tokens += SMOOTHING * (tokens - self.tokens)

    def predict(self, tokens: int, floor_s: float) -> float:
        """Seconds a prompt of ``tokens`` uncached tokens would take from its start to its first token:
        at least ``floor_s`` (the step it joins); 0 before any first token was measured."""
        if self.seconds is None or self.tokens is None:
            return 0.0
        return max(floor_s, self.seconds * max(1, tokens) / self.tokens)


class RunningCap:
    """The most sequences the running batch may hold (see the module docstring): ``update`` once a
    step with the running batch's size, ``cap()`` read by admission."""

    def __init__(self, config: SchedulerConfig, steps: StepTimes):
        self.config = config
        self.steps = steps
        self._cap = INITIAL_CAP
        self._settling = 0  # steps since the cap last changed

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

    def update(self, num_running: int) -> None:
        """After a step was timed: every SETTLE_STEPS steps (the recent steps then reflect the last
        change), grow by half while the full batch keeps within the target, shrink by a quarter of the
        batch it holds while it does not (no sequence is stopped: fewer start until the batch is under
        the cap)."""
        target, recent = self.target_s(), self.steps.recent
        if target is None or recent is None:
            return
        self._settling += 1
        if self._settling < SETTLE_STEPS:
            return
        if recent > target:
            held = min(self._cap, num_running)
            self._cap = max(MIN_CAP, held - max(1, held // 4))
        elif num_running >= self._cap:
            self._cap += max(1, self._cap // 2)
        else:
            return
        self._settling = 0

    def cap(self) -> int:
        limit = self.config.max_num_seqs
        return min(limit, self._cap) if self.enabled else limit


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
        """Called once per schedule, before it admits anyone: ``backlogged`` whether someone waits
        then, those the step admits included (a request's first step counts as backlog). Counting only
        who still waits after admission was tried, with other changes, on 2026-11-28: at twice the
        capacity, 6 of 7 runs of benchmarks/overload.py had a TTFT p90 of 2.1-6.4 s (one 0.9 s),
        against 1.3-1.7 s without it; not kept."""
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
    num_new: int = 1,
) -> float:
    """When ``num_new`` new sequences would start: ``running_left`` tokens each running sequence has
    yet to decode, ``waiting`` (prompt tokens, output tokens) of each waiting one in order, ``cap``
    slots, every decode step ``step_s``."""
    cap = max(cap, 1)
    # a slot frees when the running batch is under the cap: with more running than the cap (it shrank),
    # only the last ``cap`` finishes free one
    free_at = ([0.0] * cap + sorted(left * step_s for left in running_left))[-cap:]
    heapq.heapify(free_at)
    for prompt, output in waiting:
        start = heapq.heappop(free_at)
        heapq.heappush(free_at, start + prompt / prefill_tokens_per_s + output * step_s)
    return heapq.nsmallest(min(num_new, cap), free_at)[-1]


class Goodput:
    """The scheduler's meters together, and the predictions admission asks of them: the scheduler
    calls ``on_schedule`` once a step and feeds ``first_tokens``, ``output_lengths`` and ``starts``."""

    def __init__(self, config: SchedulerConfig):
        self.step_times = StepTimes()
        self.running_cap = RunningCap(config, self.step_times)
        self.starts = StartMeter()
        self.first_tokens = FirstTokenTimes()
        self.output_lengths = OutputLengths()
        # (when the last step began, its batch size, whether it computed prompt tokens)
        self._last_step: tuple[float, int, bool] | None = None

    def on_schedule(self, now: float, num_running: int, backlogged: bool) -> None:
        """A step is about to be built at ``now``: time the last one if its batch went on."""
        self.starts.tick(now, backlogged)
        if self._last_step is not None and num_running:
            began, batch, chunked = self._last_step
            self.step_times.observe(batch, now - began, chunked)
            self.running_cap.update(num_running)

    def on_scheduled(self, now: float, batch: int, chunked: bool = False) -> None:
        """The step begun at ``now`` holds ``batch`` sequences (0: an empty step, not timed), with
        prompt tokens to compute when ``chunked``."""
        self._last_step = (now, batch, chunked) if batch else None

    def starts_at_once(self, num_running: int, num_waiting: int, num_new: int) -> bool:
        """Whether ``num_new`` new sequences would join the running batch at once (nobody queued)."""
        return not num_waiting and num_running + num_new <= self.running_cap.cap()

    def predicted_wait_s(
        self,
        running_left: Sequence[int],
        waiting: Sequence[tuple[int, int]],
        num_new: int,
        fallback_step_s: float,
        prefill_tokens_per_s: float,
    ) -> float:
        """How long ``num_new`` new sequences would wait to start (``running_left``: each running
        sequence's expected tokens to decode; ``waiting``: each waiting one's (prompt tokens left,
        expected output)); 0 when they would join the running batch at once."""
        if self.starts_at_once(len(running_left), len(waiting), num_new):
            return 0.0
        cap = self.running_cap.cap()
        batch = max(1, min(cap, len(running_left) + len(waiting) + num_new))
        step_s = self.step_times.decode_at(batch) or self.step_times.recent or fallback_step_s
        wait = simulated_wait_s(list(running_left), list(waiting), cap, step_s, prefill_tokens_per_s, num_new)
        rate = self.starts.rate()
        if rate is not None:  # starts needed: the queue ahead, its own, and what runs above the cap
            wait = max(wait, (len(waiting) + num_new + max(0, len(running_left) - cap)) / rate)
        return wait

    def predicted_prompt_s(self, uncached_tokens: int) -> float:
        """How long a prompt computing ``uncached_tokens`` would take from its start to its first
        token, at the recent pace; 0 before any first token was measured."""
        return self.first_tokens.predict(uncached_tokens, self.step_times.recent or 0.0)
