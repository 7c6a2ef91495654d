"""The per-step token budget: decodes first, prefill chunks fill what a target step time leaves.

::

    step time ≈ decode_step_s + prefill_tokens / prefill_tokens_per_s      (CostModel, measured:
                the engine's whole step, forward + sampling + outputs)

    target    = max(max_step_ms, factor * decode_step_s)
    factor    = step_time_factor, grown by AGE_GROWTH per decode step the oldest waiting request
                has queued beyond AGE_GRACE_STEPS target steps, at most step_time_max_factor (0:
                MAX_FACTOR_GROWTH times step_time_factor; so a queue that keeps backing up turns the
                steps into the fixed token budget's)
    prefill budget = (target - decode_step_s) * prefill_tokens_per_s
                     capped by max_num_batched_tokens - num_decodes

The target follows the measured decode step, so on a slow CPU (where a decode step alone takes
about any fixed ``max_step_ms``) prefill still gets ``factor - 1`` decode steps' worth of every
step: with ``factor`` 2.5 a step with a prompt chunk lasts at most 2.5 decode-only steps (ITL
p99/p50 stays under 3) while prompts get 60% of the time. When the queue backs up, the oldest
waiting request's age widens the factor so first tokens do not fall behind the arrivals: a server
that keeps up streams smoothly, one that falls behind moves toward throughput (big prompt chunks),
with every step about as long as its neighbours while the backlog lasts, instead of letting the
queue grow without bound at 60% of the prefill rate. With no decodes
running nobody's stream can stall, so a prefill-only step takes the whole ``max_num_batched_tokens``.
``max_step_ms = 0`` turns the time budget off (the fixed token budget). Torch-free.
"""

from __future__ import annotations

from kvtier.config import SchedulerConfig
from kvtier.scheduler.preemption import CostModel

MIN_PREFILL_TOKENS = 16
AGE_GRACE_STEPS = 2.0  # waiting this many target steps is normal under load: no growth yet
AGE_GROWTH = 1.0  # factor added per decode step of waiting beyond the grace
MAX_FACTOR_GROWTH = 8.0  # the factor grows to at most this many times step_time_factor


class StepBudget:
    def __init__(self, config: SchedulerConfig, cost_model: CostModel):
        self.config = config
        self.cost_model = cost_model

    def factor(self, oldest_wait_s: float = 0.0) -> float:
        """The step-time factor over a decode-only step, grown by the oldest waiting request's queue
        time (counted in decode steps, so a loaded machine's slower steps do not look like a backlog)."""
        base = self.config.step_time_factor
        step_s = max(self.cost_model.decode_step_s, 1e-6)
        beyond = oldest_wait_s / step_s - AGE_GRACE_STEPS * base
        most = self.config.step_time_max_factor or MAX_FACTOR_GROWTH * base
        return min(base + AGE_GROWTH * max(0.0, beyond), most)

    def target_s(self, oldest_wait_s: float = 0.0) -> float:
        """The step time prefill may fill up to, beside the decodes."""
        floor = self.config.max_step_ms / 1000
        return max(floor, self.factor(oldest_wait_s) * self.cost_model.decode_step_s)

    def prefill_tokens(self, num_decodes: int, oldest_wait_s: float = 0.0) -> int:
        """Prompt tokens a step with ``num_decodes`` decoding sequences may add."""
        cap = max(0, self.config.max_num_batched_tokens - num_decodes)
        if self.config.max_step_ms <= 0 or num_decodes == 0:
            return cap
        cost = self.cost_model
        spare_s = max(0.0, self.target_s(oldest_wait_s) - cost.decode_step_s)
        tokens = int(spare_s * cost.prefill_tokens_per_s)
        return min(cap, max(tokens, MIN_PREFILL_TOKENS))
