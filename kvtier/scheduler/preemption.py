"""Choosing how to preempt: swap a sequence's KV to the host tier, or drop it and recompute later.

``preemption_mode = "auto"`` compares, for the sequence at hand::

    swap      = 2 * num_blocks * block_bytes / transfer_bytes_per_s      (out now, back in later)
    recompute = num_tokens / prefill_tokens_per_s

with both rates measured by the engine as it runs (exponential moving averages, seeded with
conservative guesses until the first measurements arrive). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvtier.config import PreemptionMode


@dataclass
class CostModel:
    block_bytes: int
    transfer_bytes_per_s: float = 2e9  # replaced by measurements of the swap plan's copies
    prefill_tokens_per_s: float = 500.0  # replaced by measurements of prefill steps
    smoothing: float = 0.2

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        if num_bytes >= self.block_bytes and seconds > 0:
            self.transfer_bytes_per_s += self.smoothing * (num_bytes / seconds - self.transfer_bytes_per_s)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= 16 and seconds > 0:
            self.prefill_tokens_per_s += self.smoothing * (num_tokens / seconds - self.prefill_tokens_per_s)

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.block_bytes / self.transfer_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def choose(self, mode: PreemptionMode, num_tokens: int, num_blocks: int) -> Literal["swap", "recompute"]:
        if mode != "auto":
            return mode
        return "swap" if self.swap_seconds(num_blocks) < self.recompute_seconds(num_tokens) else "recompute"
