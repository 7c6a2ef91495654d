"""The measured cost model: how long prefill, decode steps and swaps take, and how to preempt.

``preemption_mode = "auto"`` compares, for the sequence at hand::

    swap      = 2 * num_blocks * block_bytes / transfer_bytes_per_s      (out now, back in later)
    recompute = num_tokens / prefill_tokens_per_s

The step-time budget (``budget.py``) predicts a step from the same model::

    step_seconds(num_decodes, num_prefill_tokens) = decode_step_s (when num_decodes > 0)
                                                  + num_prefill_tokens / prefill_tokens_per_s

and a prefix loaded from the host tier costs its copy (``load_tokens``: the prompt tokens computed in
the same time), charged to the budget of the step that loads it.

All rates are measured by the engine as it runs (exponential moving averages, seeded with
conservative guesses until the first measurements arrive): a decode-only step updates
``decode_step_s``; the prefill rate is the *marginal* one, what prompt tokens add to a step::

    prefill_tokens_per_s = EMA(prefill tokens) / EMA(seconds they added)
        mixed step (decodes + at least MIN_PREFILL_TOKENS):  added = step - decode_step_s
        prefill-only step (at least MIN_ALONE_TOKENS):       added = step  (includes the fixed
                                                             per-step cost: a conservative rate)

A ratio of averages weights each step by its tokens, so small chunks' noisy excess times do not
swing the rate; charging a small prefill-only step's fixed cost (reading every weight once) to its
tokens would make prefill look several times slower than it is beside decodes. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from kvtier.config import PreemptionMode

MIN_PREFILL_TOKENS = 16  # smaller chunks are too noisy to measure a rate from
MIN_ALONE_TOKENS = 256  # a prefill-only step shorter than this is mostly its fixed cost


@dataclass
class CostModel:
    block_bytes: int
    transfer_bytes_per_s: float = 2e9  # replaced by measurements of the swap plan's copies
    prefill_tokens_per_s: float = 500.0  # replaced by measurements of prefill steps
    decode_step_s: float = 0.02  # one step of decodes alone; replaced by measurements
    smoothing: float = 0.2
    _prefill_tokens: float = field(default=0.0, repr=False)  # EMAs behind prefill_tokens_per_s
    _prefill_s: float = field(default=0.0, repr=False)

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        if num_bytes >= self.block_bytes and seconds > 0:
            self.transfer_bytes_per_s += self.smoothing * (num_bytes / seconds - self.transfer_bytes_per_s)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """``num_tokens`` prompt tokens added ``seconds`` to a step."""
        if num_tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return
        if self._prefill_s == 0.0:  # the first measurement replaces the seed
            self._prefill_tokens, self._prefill_s = float(num_tokens), seconds
        else:
            self._prefill_tokens += self.smoothing * (num_tokens - self._prefill_tokens)
            self._prefill_s += self.smoothing * (seconds - self._prefill_s)
        self.prefill_tokens_per_s = self._prefill_tokens / self._prefill_s

    def observe_step(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        """One forward pass of ``num_decodes`` one-token rows and ``num_prefill_tokens`` prompt tokens."""
        if seconds <= 0:
            return
        if num_prefill_tokens == 0:
            if num_decodes:
                self.decode_step_s += self.smoothing * (seconds - self.decode_step_s)
            return
        if num_decodes:
            # Noise can make a small chunk's excess negative: counted as ~0, not dropped (unbiased).
            self.observe_prefill(num_prefill_tokens, max(seconds - self.decode_step_s, 1e-4))
        elif num_prefill_tokens >= MIN_ALONE_TOKENS:
            self.observe_prefill(num_prefill_tokens, seconds)

    def step_seconds(self, num_decodes: int, num_prefill_tokens: int) -> float:
        """The predicted duration of a step."""
        decode_s = self.decode_step_s if num_decodes else 0.0
        return decode_s + num_prefill_tokens / self.prefill_tokens_per_s

    def load_tokens(self, num_blocks: int) -> int:
        """The prompt tokens whose compute takes as long as loading ``num_blocks`` blocks host → device
        (what a step's time budget charges for a loaded prefix: a handoff's, a retained turn's)."""
        seconds = num_blocks * self.block_bytes / self.transfer_bytes_per_s
        return math.ceil(seconds * self.prefill_tokens_per_s)

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.block_bytes / self.transfer_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def choose(self, mode: PreemptionMode, num_tokens: int, num_blocks: int) -> Literal["swap", "recompute"]:
        if mode != "auto":
            return mode
        return "swap" if self.swap_seconds(num_blocks) < self.recompute_seconds(num_tokens) else "recompute"
