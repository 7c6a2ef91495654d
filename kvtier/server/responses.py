"""OpenAI response bodies and SSE chunks built from ``RequestOutput``s (chat and text completions).

A streamed response is, per choice: (chat only) a ``role`` chunk, (text with ``echo``) the prompt and its
logprobs, content chunks as text arrives, a chunk
with the ``finish_reason`` and an empty delta; then, with ``stream_options.include_usage``, one chunk
with ``choices: []`` and the ``usage``; then ``data: [DONE]``. ``usage`` carries OpenAI's
``prompt_tokens_details.cached_tokens`` and kvtier's ``kvtier.cached_tokens_by_tier``, and, when the
request asked ``diagnostics`` (``diagnose``), ``kvtier.cache_miss_reason`` (:mod:`.diagnostics`; a stream
sends its usage chunk then, ``include_usage`` or not).

A chat with tools (``tool_names``: tool_choice other than none) has each choice's text parsed for calls
(:class:`kvtier.tools.ToolCallParser`, one per choice): content chunks carry the text outside the calls,
``tool_calls`` chunks the calls (:mod:`.tools`), and the finish reason is ``tool_calls`` after calls.
With ``--reasoning-parser`` a chat's thinking goes apart first (:mod:`kvtier.reasoning`):
``message.reasoning_content`` / ``delta.reasoning_content``, the calls parsed from the answer alone.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from kvtier.outputs import CompletionOutput, RequestOutput
from kvtier.reasoning import AnswerStream, split_reasoning
from kvtier.sequence import TokenLogprobs
from kvtier.server import tools
from kvtier.server.metrics import TIERS
from kvtier.tokenizer import Tokenizer

Kind = Literal["chat", "text"]
DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def usage(finals: list[RequestOutput], completions: bool = True) -> dict[str, Any]:
    """Token counts over the requests of one API call (one per prompt); ``completions`` False: the
    completions are not returned (``echo`` with ``max_tokens`` 0) and count 0."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
    completion_tokens = sum(len(c.token_ids) for o in finals for c in o.outputs) if completions else 0
    cached = sum(o.num_cached_tokens for o in finals)
    by_tier = dict.fromkeys(TIERS, 0)
    for o in finals:
        for tier, n in o.cached_tokens_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
        "kvtier": {
            "cached_tokens_by_tier": by_tier,
            "retained_tokens": sum(o.num_retained_tokens for o in finals),  # prompt_cache_retention
        },
    }


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -Infinity


class Formatter:
    """Builds one API call's chunks and final body; ``n`` choices per prompt, choice index
    ``prompt_index * n + completion.index``."""

    def __init__(
        self,
        kind: Kind,
        tokenizer: Tokenizer,
        request_id: str,
        model: str,
        n: int,
        *,
        logprobs: bool,
        include_usage: bool = False,
        echo: bool = False,
        prompt_only: bool = False,
        tool_names: frozenset[str] | None = None,
        reasoning_parser: str | None = None,
        diagnose: Callable[[RequestOutput], dict[str, Any]] | None = None,
        tokens_as_ids: bool = False,
    ):
        self.kind = kind
        self.tokenizer = tokenizer
        self.request_id = request_id
        self.model = model
        self.n = n
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.echo = echo  # text completions: each choice starts with its prompt (and its logprobs)
        self._echoed: set[int] = set()  # streamed choices whose prompt went out already
        self.prompt_only = prompt_only  # echo with max_tokens 0: the sampled token is not returned
        self.created = int(time.time())
        self._sent_logprobs: dict[int, int] = {}  # choice -> logprob entries already sent
        self._text_offset: dict[int, int] = {}  # choice -> characters already sent (text logprobs)
        self._token_text: dict[int, str] = {}
        self.tool_names = tool_names  # chat with tools: calls are parsed out of the text
        self.reasoning_parser = reasoning_parser if kind == "chat" else None  # --reasoning-parser
        self._answers: dict[int, AnswerStream] = {}  # choice -> its text's stream (calls, reasoning)
        self.diagnose = diagnose  # diagnostics asked: the cache_miss_reason of the (one) final output
        self.tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids: logprobs name "token_id:N"

    def _usage(self, finals: list[RequestOutput]) -> dict[str, Any]:
        body = usage(finals, not self.prompt_only)
        if self.diagnose is not None and finals:
            body["kvtier"]["cache_miss_reason"] = self.diagnose(finals[0])
        return body

    # ------------------------------------------------------------------------------ logprobs
    def _text(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or ``token_id:N`` (``return_tokens_as_token_ids``, for
        tokens whose text alone is ambiguous: partial UTF-8, merges)."""
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _logprobs(self, index: int, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.kind == "chat":
            content = []
            for e in entries:
                token = self._text(e.token_id)
                top = sorted(e.top.items(), key=lambda kv: -kv[1])
                content.append(
                    {
                        "token": token,
                        "logprob": _finite(e.logprob),
                        "bytes": list(token.encode()),
                        "top_logprobs": [
                            {
                                "token": self._text(t),
                                "logprob": _finite(v),
                                "bytes": list(self._text(t).encode()),
                            }
                            for t, v in top
                        ],
                    }
                )
            return {"content": content}
        return self._text_logprobs(index, [(e.token_id, e) for e in entries])

    def _text_logprobs(self, index: int, items: list[tuple[int, TokenLogprobs | None]]) -> dict[str, Any]:
        """Legacy completions' logprobs of ``(token id, entry)`` items; an echoed prompt's first token
        has no entry (null logprob, null alternatives)."""
        tokens, offsets = [], []
        offset = self._text_offset.get(index, 0)
        for token_id, _ in items:
            tokens.append(self._text(token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        self._text_offset[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else _finite(e.logprob) for _, e in items],
            "top_logprobs": [
                None if e is None else {self._text(t): _finite(v) for t, v in e.top.items()} for _, e in items
            ],
            "text_offset": offsets,
        }

    def _prompt_echo(self, index: int, out: RequestOutput) -> tuple[str, dict[str, Any] | None]:
        """``echo``: a choice's prompt text, and its tokens' logprobs (with ``logprobs``)."""
        text = out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)
        if not self.logprobs:
            return text, None
        entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        return text, self._text_logprobs(index, list(zip(out.prompt_token_ids, entries, strict=True)))

    def _new_logprobs(self, index: int, completion: CompletionOutput) -> list[TokenLogprobs]:
        entries = completion.logprobs or []
        sent = self._sent_logprobs.get(index, 0)
        self._sent_logprobs[index] = len(entries)
        return entries[sent:]

    # ------------------------------------------------------------------------------- streaming
    def _chunk(self, choices: list[dict[str, Any]]) -> str:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def _delta_choice(self, index: int, text: str | None, lp: Any, finish: str | None) -> dict[str, Any]:
        if self.kind == "chat":
            delta = {} if text is None else {"content": text}
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}

    def _answer(self, index: int) -> AnswerStream | None:
        """A choice's stream (tools' calls, reasoning); None when its text is sent as it is."""
        if self.tool_names is None and self.reasoning_parser is None:
            return None
        answer = self._answers.get(index)
        if answer is None:
            answer = self._answers[index] = AnswerStream(self.tool_names, self.reasoning_parser)
        return answer

    def _content_chunks(self, index: int, text: str, lp: Any) -> list[str]:
        """A choice's new text (and its tokens' logprobs ``lp``) as chunks: one, or with tools or a
        reasoning parser one per delta (the logprobs on the first; an empty delta carries them when the
        text is held)."""
        answer = self._answer(index)
        if answer is None:
            return [self._chunk([self._delta_choice(index, text, lp, None)])]
        found = tools.deltas(answer.feed(text))
        if not found and lp is not None:
            found = [{}]
        chunks = []
        for delta in found:
            chunks.append(
                self._chunk([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}])
            )
            lp = None
        return chunks

    def _finish_chunks(self, index: int, reason: str) -> list[str]:
        """A choice's last chunks: what its stream held back, then the finish reason."""
        answer = self._answer(index)
        deltas = tools.deltas(answer.finish()) if answer is not None else []
        if answer is not None and answer.parser is not None:
            reason = tools.finish_reason(answer.parser.calls, reason) or reason
        chunks = [
            self._chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])
            for delta in deltas
        ]
        chunks.append(self._chunk([self._delta_choice(index, None, None, reason)]))
        return chunks

    async def stream(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int
    ) -> AsyncIterator[str]:
        """SSE chunks for ``(prompt_index, output)`` pairs, ending with usage (if asked) and [DONE]."""
        if self.kind == "chat":
            for i in range(num_prompts * self.n):
                delta = {"role": "assistant", "content": ""}
                yield self._chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
        finals: dict[int, RequestOutput] = {}
        done: set[int] = set()
        async for prompt_index, out in outputs:
            for c in out.outputs:
                index = prompt_index * self.n + c.index
                if index in done:
                    continue
                if self.echo and index not in self._echoed:
                    self._echoed.add(index)
                    text, lp = self._prompt_echo(index, out)
                    yield self._chunk([self._delta_choice(index, text, lp, None)])
                new = self._new_logprobs(index, c) if self.logprobs and not self.prompt_only else []
                if (c.text_delta or new) and not self.prompt_only:
                    for chunk in self._content_chunks(index, c.text_delta, self._logprobs(index, new)):
                        yield chunk
                if c.finish_reason is not None:
                    done.add(index)
                    for chunk in self._finish_chunks(
                        index, "length" if self.prompt_only else c.finish_reason
                    ):
                        yield chunk
            if out.finished:
                finals[prompt_index] = out
        if self.include_usage or self.diagnose is not None:
            body = {
                "id": self.request_id,
                "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": self._usage([finals[i] for i in sorted(finals)]),
            }
            yield sse(body)
        yield DONE

    # --------------------------------------------------------------------------- non-streaming
    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for prompt_index, out in enumerate(finals):
            for c in sorted(out.outputs, key=lambda c: c.index):
                index = prompt_index * self.n + c.index
                if self.kind == "chat":
                    lp = self._logprobs(index, c.logprobs or []) if self.logprobs else None
                    reasoning, text = None, c.text
                    if self.reasoning_parser is not None:
                        reasoning, text = split_reasoning(self.reasoning_parser, c.text)
                    message, finish = {"role": "assistant", "content": text}, c.finish_reason
                    if self.tool_names is not None:
                        message, calls = tools.message(text, self.tool_names)
                        finish = tools.finish_reason(calls, finish)
                    if self.reasoning_parser is not None:
                        message["reasoning_content"] = reasoning
                    choices.append(
                        {"index": index, "message": message, "logprobs": lp, "finish_reason": finish}
                    )
                    continue
                prompt, prompt_lp = self._prompt_echo(index, out) if self.echo else ("", None)
                if self.prompt_only:
                    choices.append(
                        {"index": index, "text": prompt, "logprobs": prompt_lp, "finish_reason": "length"}
                    )
                    continue
                lp = self._logprobs(index, c.logprobs or []) if self.logprobs else None  # offsets go on
                if prompt_lp is not None and lp is not None:
                    lp = {key: prompt_lp[key] + lp[key] for key in lp}
                text, finish = prompt + c.text, c.finish_reason
                choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": finish})
        return {
            "id": self.request_id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(finals),
            "system_fingerprint": None,
        }
