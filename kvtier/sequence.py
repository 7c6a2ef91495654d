"""Sequences and requests: plain data, no torch.

A *request* (one prompt, one ``SamplingParams``) owns ``n`` *sequences*; with ``n > 1`` sequence 0
prefills the prompt and, when the prompt is done, the others fork from it and share its blocks.

A sequence's state is its token ids and how many of them have K/V in the cache::

    token_ids:  [ p0 p1 ... p(P-1) | o0 o1 ... o(k-1) ]
                 └── prompt ───────┘└── output ──────┘
    num_computed_tokens: tokens whose K/V are in the device pool; a decoding sequence has
                         len(token_ids) - 1 (the newest sampled token is computed next step).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvtier.kv.retention import RetentionSpan
from kvtier.sampling_params import SamplingParams
from kvtier.stats import Medium


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its row could not be sampled (kvtier.worker.sampler.RowError)

    @property
    def finished(self) -> bool:
        return self._value_ in _FINISHED_VALUES  # asked per row per step: no enum lookups


_FINISHED_VALUES = frozenset(
    s.value for s in SequenceStatus if s.name.startswith("FINISHED_")
)  # stop, length, abort, error


def seq_id_for(request_id: str, index: int) -> str:
    """The id of sequence ``index`` of a request (also its sampler generator's key)."""
    return f"{request_id}-{index}"


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of the chosen token and the top-k alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass(eq=False)
class Sequence:
    seq_id: str
    request_id: str
    index: int  # 0..n-1 within its request
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    extra_keys: tuple[str, ...]  # block-hash chain keys: model fingerprint, cache salt
    max_total_tokens: int  # prompt + output may not exceed this (max_model_len)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens served from cache at first admission
    # The same tokens by the tier that served them; set with num_cached_tokens.
    cached_tokens_by_tier: dict[Medium, int] = field(default_factory=dict)
    # Prompt tokens the cache held at first admission: num_cached_tokens, or one block more when the
    # prompt's last full block was held but computed again for the logits (usage's cache creation).
    num_prompt_tokens_in_cache: int = 0
    num_preemptions: int = 0
    disk_wait_deadline: float | None = None  # set while its prefix is being read from disk
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    # params.prompt_logprobs: entry j is prompt token j's (None for token 0), filled as prefill runs
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # the scheduler's clock when it first left the waiting queue
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Scheduling: lower priority runs first (vLLM's meaning); tenant: the fair-share key.
    priority: int = 0
    tenant: str = ""
    admitted_order: int | None = None  # when it last joined the running batch (recency for preemption)
    num_starved_steps: int = 0  # steps in a row a prompt (mid-prefill or waiting) got no tokens
    num_yielded_steps: int = 0  # steps in a row a sibling row sat out beside other requests (fairness.py)
    kv_cached_blocks: int = 0  # device blocks its prompt found cached when it arrived (admission estimate)
    # ...in the device pool or the host tier (the scheduler's cheap tests; raised while a read is pending)
    cached_prefix_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still to compute: more than 1 while the prompt is being prefilled, 1 when decoding."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt tokens still lack their logprobs (its prefill must then compute them all)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def forks_on_prompt_done(self) -> bool:
        return self.params.n > 1 and self.index == 0 and self.num_output_tokens == 0


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    prompt: str | None = None  # the text, when the prompt was given as text
    arrival_time: float = field(default_factory=time.monotonic)  # the HTTP layer's, when served
    priority: int = 0
    tenant: str = ""
    error: str | None = None  # why it ended with an error (its sequences are then FINISHED_ERROR)
    # Prompt-cache retention asked for (kvtier/kv/retention.py), and the prompt tokens it retained
    retention: tuple[RetentionSpan, ...] = ()
    num_retained_tokens: int = 0
    final_only: bool = False  # its caller wants the finished output only (LLM.generate): none before

    @property
    def finished(self) -> bool:
        """Every sequence finished (an erring request may end before its n > 1 forks exist)."""
        seqs = self.seqs
        if len(seqs) == 1 and self.params.n == 1:  # the usual request
            return seqs[0].status.finished
        complete = len(seqs) == self.params.n or self.error is not None
        return complete and all(s.status.finished for s in seqs)
