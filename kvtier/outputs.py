"""What ``LLM.generate`` and ``LLMEngine.step`` return (vLLM-compatible field names)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

from kvtier.sequence import TokenLogprobs
from kvtier.stats import Medium
from kvtier.tools import ToolCall

T = TypeVar("T")


class Grown(Sequence[T]):
    """Items ``[start, stop)`` of a list that only ever grows by appending (a sequence's tokens, its
    logprobs), read-only: what a running request's output carries instead of a copy, so that a stream's
    step costs the same at its 8,000th token as at its first. Equal to a list or tuple of the same items;
    a finished request's output holds plain lists."""

    __slots__ = ("_items", "_start", "_stop")

    def __init__(self, items: list[T], start: int = 0, stop: int | None = None) -> None:
        self._items, self._start = items, start
        self._stop = len(items) if stop is None else stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...
    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            return [self._items[self._start + i] for i in range(*index.indices(len(self)))]
        i = index + len(self) if index < 0 else index
        if not 0 <= i < len(self):
            raise IndexError("Grown index out of range")
        return self._items[self._start + i]

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(self._items, self._start, self._stop)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, tuple, Grown)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self) -> tuple[Any, ...]:  # pickled or deep-copied: as the list it shows
        return list, (list(self),)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: Sequence[int]  # a list once finished; while running, a Grown window (no copy a step)
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string / stop token id that ended it
    logprobs: Sequence[TokenLogprobs] | None = None  # as token_ids
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
    prompt_logprobs: Sequence[TokenLogprobs | None] | None = None  # a Grown window while running
    # Set when the request ended with an error of its own (finish_reason "error"; no other request
    # is affected): its sampling failed, or the model's logits for it were non-finite (corrupt K/V).
    error: str | None = None
