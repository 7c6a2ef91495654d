"""Turns sampled tokens into text: incremental detokenization, stop strings, streaming deltas.

The text ends before the stop string that ended it (after it with ``include_stop_str_in_output``); a
token that ended it (EOS, a ``stop_token_ids`` entry) is written as the detokenizer writes it: nothing for
a special token unless ``skip_special_tokens`` is False.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TypeVar

from kvtier.outputs import CompletionOutput, Grown, RequestOutput
from kvtier.sequence import Request, Sequence
from kvtier.tokenizer import IncrementalDetokenizer, Tokenizer

T = TypeVar("T")


@dataclass
class _TextState:
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, _TextState] = {}

    def on_token(self, seq: Sequence, token_id: int) -> str | None:
        """Feed one new token of ``seq``; returns the stop string it completed, if any."""
        state = self._states.get(seq.seq_id)
        if state is None:
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            detokenizer = self.tokenizer.detokenizer(prompt, seq.params.skip_special_tokens)
            state = self._states[seq.seq_id] = _TextState(detokenizer)
        delta = state.detokenizer.step([token_id])
        if not delta:
            return None
        state.text += delta
        stops = seq.params.stop
        if not stops:
            return None
        longest = max(len(s) for s in stops)
        search_from = max(0, len(state.text) - len(delta) - longest + 1)
        hits = [(idx, s) for s in stops if (idx := state.text.find(s, search_from)) != -1]
        if not hits:
            return None
        idx, stop = min(hits)
        state.text = state.text[: idx + len(stop) if seq.params.include_stop_str_in_output else idx]
        return stop

    def on_finish(self, seq: Sequence) -> None:
        """Emit whatever the detokenizer still holds (e.g. the start of a multi-byte character)."""
        state = self._states.get(seq.seq_id)
        if state is not None and not isinstance(seq.stop_reason, str):  # a stop string cut the text already
            state.text += state.detokenizer.flush()

    def make_output(self, request: Request) -> RequestOutput:
        outputs = []
        for seq in request.seqs:
            state = self._states.get(seq.seq_id)
            text = state.text if state else ""
            finished = seq.status.finished
            if not finished and seq.params.stop:  # hold back what could be the start of a stop string
                text = text[: max(0, len(text) - (max(len(s) for s in seq.params.stop) - 1))]
            emitted_chars = state.num_emitted_chars if state else 0
            emitted_tokens = state.num_emitted_tokens if state else 0
            if state:
                state.num_emitted_chars = max(emitted_chars, len(text))
                state.num_emitted_tokens = seq.num_output_tokens
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=_items(seq.token_ids, finished, seq.num_prompt_tokens),
                    finish_reason=seq.status.value if finished else None,
                    stop_reason=seq.stop_reason,
                    logprobs=None if seq.logprobs is None else _items(seq.logprobs, finished),
                    text_delta=text[emitted_chars:],
                    num_new_tokens=seq.num_output_tokens - emitted_tokens,
                )
            )
        seq0 = request.seqs[0]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            num_cached_tokens=seq0.num_cached_tokens or 0,
            cached_tokens_by_tier=dict(seq0.cached_tokens_by_tier),
            num_prompt_tokens_in_cache=seq0.num_prompt_tokens_in_cache,
            num_retained_tokens=request.num_retained_tokens,
            metrics=request_metrics(request),
            prompt_logprobs=None
            if seq0.prompt_logprobs is None
            else _items(seq0.prompt_logprobs, request.finished),
            error=request.error,
        )

    def forget(self, request: Request) -> None:
        for seq in request.seqs:
            self._states.pop(seq.seq_id, None)


def _items(items: list[T], finished: bool, start: int = 0) -> Seq[T]:
    """``items[start:]`` for an output: the caller's own list once finished, else a window on the growing
    list (a stream's step copies nothing)."""
    return items[start:] if finished else Grown(items, start)


def request_metrics(request: Request) -> dict[str, float]:
    """A request's timings (monotonic seconds; vLLM's names): ``arrival_time`` (the HTTP layer's when
    served), ``first_scheduled_time``, ``first_token_time``, ``last_token_time``, ``finished_time``,
    and the spans ``queue_time`` (arrival to first step), ``prefill_time`` (first step to first token),
    ``ttft`` and ``e2e`` (arrival to the finish). A key is absent until its moment has come."""
    arrival = request.arrival_time
    metrics = {"arrival_time": arrival}
    seqs = request.seqs
    if len(seqs) == 1:  # the usual request: its one sequence's moments, no lists to build
        s = seqs[0]
        first, token, last = s.first_scheduled_time, s.first_token_time, s.last_token_time
    else:
        first = min((t for s in seqs if (t := s.first_scheduled_time) is not None), default=None)
        token = min((t for s in seqs if (t := s.first_token_time) is not None), default=None)
        last = max((t for s in seqs if (t := s.last_token_time) is not None), default=None)
    if first is not None:
        metrics["first_scheduled_time"] = first
        metrics["queue_time"] = max(0.0, first - arrival)
    if token is not None:
        metrics["first_token_time"] = token
        metrics["ttft"] = max(0.0, token - arrival)
        if first is not None:
            metrics["prefill_time"] = max(0.0, token - first)
    if last is not None:
        metrics["last_token_time"] = last
    if request.finished:
        metrics["finished_time"] = time.monotonic()
        metrics["e2e"] = max(0.0, metrics["finished_time"] - arrival)
    return metrics
