"""What ``LLM.generate`` and ``LLMEngine.step`` return (vLLM-compatible field names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.sequence import TokenLogprobs
from kvtier.stats import Medium
from kvtier.tools import ToolCall


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string / stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None
    text_delta: str = ""  # text added by the latest step (for streaming)
    num_new_tokens: int = 0  # tokens added by the latest step
    # LLM.chat with tools (tool_choice other than "none"): the calls parsed out of ``text`` (which stays the
    # whole output) and the text outside them (None when there were calls and no text); kvtier.tools.
    tool_calls: list[ToolCall] | None = None
    content: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (any tier)
    # The same tokens by the tier they came from: {Medium.DEVICE: ..., Medium.HOST: ..., ...}.
    cached_tokens_by_tier: dict[Medium, int] = field(default_factory=dict)
    # Prompt tokens the cache held (num_cached_tokens, or the whole prompt when only its last block,
    # held too, was computed again for the logits): what the request did not add to the cache
    num_prompt_tokens_in_cache: int = 0
    # Prompt tokens whose blocks the request's retention spans keep cached (kvtier/kv/retention.py)
    num_retained_tokens: int = 0
    # Monotonic seconds (kvtier.output_processor.request_metrics): arrival_time, first_scheduled_time,
    # first_token_time, last_token_time, finished_time; spans queue_time, prefill_time, ttft, e2e.
    metrics: dict[str, float] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first; the list grows
    # while the prompt is prefilled in chunks, and is complete from the first output with a token on)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Set when the request ended with an error of its own (finish_reason "error"; no other request
    # is affected): its sampling failed, or the model's logits for it were non-finite (corrupt K/V).
    error: str | None = None
