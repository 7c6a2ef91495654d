"""The measured cost model: how long prefill, decode steps and swaps take, and how to preempt.

``preemption_mode = "auto"`` compares, for the sequence at hand::

    swap      = 2 * num_blocks * block_bytes / transfer_bytes_per_s      (out now, back in later)
    recompute = num_tokens / prefill_tokens_per_s

The step-time budget (``budget.py``) predicts a step from the same model::

    step_seconds(num_decodes, num_prefill_tokens) = decode_step_s (when num_decodes > 0)
                                                  + num_prefill_tokens / prefill_tokens_per_s

All rates are measured by the engine as it runs (exponential moving averages, seeded with
conservative guesses until the first measurements arrive): a decode-only step updates
``decode_step_s``, a prefill-only step the prefill rate, and a mixed step the prefill rate from what
is left after the decodes' share. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvtier.config import PreemptionMode

MIN_PREFILL_TOKENS = 16  # smaller chunks are too noisy to measure a rate from


@dataclass
class CostModel:
    block_bytes: int
    transfer_bytes_per_s: float = 2e9  # replaced by measurements of the swap plan's copies
    prefill_tokens_per_s: float = 500.0  # replaced by measurements of prefill steps
    decode_step_s: float = 0.02  # one step of decodes alone; replaced by measurements
    smoothing: float = 0.2

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        if num_bytes >= self.block_bytes and seconds > 0:
            self.transfer_bytes_per_s += self.smoothing * (num_bytes / seconds - self.transfer_bytes_per_s)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            self.prefill_tokens_per_s += self.smoothing * (num_tokens / seconds - self.prefill_tokens_per_s)

    def observe_step(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        """One forward pass of ``num_decodes`` one-token rows and ``num_prefill_tokens`` prompt tokens."""
        if seconds <= 0:
            return
        if num_prefill_tokens == 0:
            if num_decodes:
                self.decode_step_s += self.smoothing * (seconds - self.decode_step_s)
            return
        prefill_s = seconds - (self.decode_step_s if num_decodes else 0.0)
        if prefill_s > 0.25 * seconds:  # else the decodes' estimate dominates: too noisy
            self.observe_prefill(num_prefill_tokens, prefill_s)

    def step_seconds(self, num_decodes: int, num_prefill_tokens: int) -> float:
        """The predicted duration of a step."""
        decode_s = self.decode_step_s if num_decodes else 0.0
        return decode_s + num_prefill_tokens / self.prefill_tokens_per_s

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.block_bytes / self.transfer_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def choose(self, mode: PreemptionMode, num_tokens: int, num_blocks: int) -> Literal["swap", "recompute"]:
        if mode != "auto":
            return mode
        return "swap" if self.swap_seconds(num_blocks) < self.recompute_seconds(num_tokens) else "recompute"
