"""The per-step token budget: decodes first, prefill chunks fill what a target step latency leaves.

::

    step time ≈ decode_step_s + prefill_tokens / prefill_tokens_per_s      (CostModel, measured)

    prefill budget = (max_step_ms - decode_step_s) * prefill_tokens_per_s
                     at least MIN_PREFILL_SHARE of a decode step's worth, so prompts always move;
                     capped by max_num_batched_tokens - num_decodes

With no decodes running nobody's stream can stall, so a prefill-only step takes the whole
``max_num_batched_tokens``. ``max_step_ms = 0`` turns the time budget off (the fixed token budget).
Torch-free.
"""

from __future__ import annotations

from kvtier.config import SchedulerConfig
from kvtier.scheduler.preemption import CostModel

# When the decodes alone take longer than the target, prefill still gets this share of a decode
# step's time: a step is then at most (1 + share) decode steps long.
MIN_PREFILL_SHARE = 1.0
MIN_PREFILL_TOKENS = 16


class StepBudget:
    def __init__(self, config: SchedulerConfig, cost_model: CostModel):
        self.config = config
        self.cost_model = cost_model

    def prefill_tokens(self, num_decodes: int) -> int:
        """Prompt tokens a step with ``num_decodes`` decoding sequences may add."""
        cap = max(0, self.config.max_num_batched_tokens - num_decodes)
        if self.config.max_step_ms <= 0 or num_decodes == 0:
            return cap
        cost = self.cost_model
        target_s = self.config.max_step_ms / 1000
        spare_s = max(target_s - cost.decode_step_s, MIN_PREFILL_SHARE * cost.decode_step_s)
        tokens = int(spare_s * cost.prefill_tokens_per_s)
        return min(cap, max(tokens, MIN_PREFILL_TOKENS))

    def step_limit_s(self, num_decodes: int) -> float:
        """The longest step this budget plans (what a decode may wait), by the cost model."""
        return self.cost_model.step_seconds(num_decodes, self.prefill_tokens(num_decodes))
