"""Anthropic's Messages API on ``kvtier serve``: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

The request is mapped onto the chat route's internals (:mod:`.anthropic`: the conversation, tools and
tool_choice in OpenAI's shape), then runs as a chat completion does: the same checks, chat template, tool
format, call grammar, admission and parser. Only the answer differs::

    one JSON body    {"id": "msg_...", "type": "message", "role": "assistant", "model",
                      "content": [{"type": "thinking", "thinking", "signature": ""} (with
                                   --reasoning-parser), {"type": "text", "text"},
                                   {"type": "tool_use", "id": "toolu_...", "name", "input": {...}}, ...],
                      "stop_reason": "end_turn" | "max_tokens" | "stop_sequence" | "tool_use",
                      "stop_sequence", "usage"}
    server-sent      message_start (the message, content [], usage), ping,
    events           per block: content_block_start, content_block_delta (text_delta, or input_json_delta
                     with partial_json for a tool_use, or thinking_delta then an empty signature_delta
                     for a thinking block), content_block_stop;
                     message_delta (stop_reason, stop_sequence, usage), message_stop.
                     An engine failure ends the stream with an ``error`` event.

``message_start`` goes out with the first token (its usage counts the prompt's cached tokens, known then).
``usage``: ``input_tokens`` + ``cache_creation_input_tokens`` + ``cache_read_input_tokens`` is the prompt;
``cache_read_input_tokens`` are the tokens served from kvtier's cache (any tier; split by tier in
``kvtier_cache_read_by_tier``), ``cache_creation_input_tokens`` the uncached ones up to the last
``cache_control`` breakpoint (0 without one), ``input_tokens`` the rest; ``output_tokens`` the completion.
Each breakpoint keeps its prefix cached for its TTL (5m, 1h; refreshed by every request that sends it:
kvtier/kv/retention.py); ``kvtier_retained_input_tokens`` is how much of the prompt that retains (less
than the last breakpoint when a tier's retention cap is reached: the request is served all the same).

Every error of these routes is Anthropic's shape (:class:`AnthropicRoute`; the key check's 401 too). The
key is the client role's (:func:`kvtier.server.auth.check_messages_key`: ``x-api-key`` or ``Authorization:
Bearer``); ``anthropic-version`` is accepted and not read. What the route needs of the app (admission,
the drain check, the answer's delivery) comes in a :class:`Serving`, so this module never imports the app.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic_core import from_json
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.config import ConfigError
from kvtier.kv.retention import RetentionSpan
from kvtier.outputs import CompletionOutput, RequestOutput
from kvtier.reasoning import AnswerStream
from kvtier.server import bodies, prompts, tools
from kvtier.server.anthropic import CachePrefix, Chat, CountTokensRequest, MessagesRequest
from kvtier.server.anthropic_errors import AnthropicError, anthropic_error, as_anthropic, authorization_of
from kvtier.server.async_engine import EngineDeadError, EngineNotReady, RequestStream
from kvtier.server.auth import check_messages_key
from kvtier.server.diagnostics import PromptLog, miss_reason, shared_prefix
from kvtier.server.metrics import TIERS
from kvtier.server.protocol import APIError, check_model, http_error, tenant_of, tenant_salt, validation_error
from kvtier.tokenizer import Tokenizer
from kvtier.tools import ToolEvent

logger = logging.getLogger("kvtier.server")
RETRY_AFTER = {"Retry-After": "1"}


@dataclass(frozen=True)
class Serving:
    """What the routes take from the app (:mod:`kvtier.server.app` builds it): ``admit`` (prompts to
    streams: 503 when full, 400 when refused), ``check_open`` (503 while draining) and ``respond`` (the
    streams as SSE or one JSON body from a formatter's ``stream`` / ``response``; 499 when the client
    leaves)."""

    admit: Callable[..., Awaitable[list[RequestStream]]]
    check_open: Callable[[Request], None]
    respond: Callable[..., Awaitable[Response]]


# ------------------------------------------------------------------------------------------- errors
def translated(exc: Exception) -> AnthropicError:
    """Any error of these routes as Anthropic's (an unexpected one logged with its traceback, answered
    as a 500 ``api_error`` without it)."""
    if isinstance(exc, APIError):
        return as_anthropic(exc)
    if isinstance(exc, EngineNotReady):
        return anthropic_error(503, str(exc), RETRY_AFTER)
    if isinstance(exc, RequestValidationError):
        return as_anthropic(validation_error(list(exc.errors())))
    if isinstance(exc, StarletteHTTPException):
        return as_anthropic(http_error(exc))
    if isinstance(exc, EngineDeadError):
        return anthropic_error(500, str(exc))
    logger.error("internal error on an Anthropic route", exc_info=exc)
    return anthropic_error(500, f"internal error: {type(exc).__name__}")


class AnthropicRoute(APIRoute):
    """A route whose every error (its dependencies' included) is answered in Anthropic's shape: the
    app's ``APIError`` handler answers an :class:`AnthropicError` with its own body."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                raise translated(exc) from None

        return answer


# -------------------------------------------------------------------------------------- the answer
def event(payload: dict[str, Any]) -> str:
    """One server-sent event as Anthropic writes it: ``event: <type>`` and its JSON ``data``."""
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {payload['type']}\ndata: {data}\n\n"


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> Any:
    """A tool_use's ``input`` from its arguments' JSON text: as far as it goes when ``max_tokens`` cut it
    (the SDK's partial parse of the streamed ``partial_json``), ``{}`` if nothing of it parses."""
    try:
        value = from_json(arguments or "{}", allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class ContentBlocks:
    """A completion's text as Anthropic content blocks, built as it arrives: ``feed`` and ``finish``
    return the stream's block events, ``content`` holds the blocks. With ``tool_names`` the text is parsed
    (:class:`kvtier.tools.ToolCallParser`): the text outside the calls makes text blocks, each call a
    tool_use block; without, the text is one text block. Fed at once or piece by piece, the same content."""

    def __init__(self, tool_names: frozenset[str] | None, reasoning_parser: str | None = None):
        self._answer = AnswerStream(tool_names, reasoning_parser)
        self.content: list[dict[str, Any]] = []
        self._open: str | None = None  # the type of the block still open
        self._arguments = ""  # the open tool_use's arguments so far

    @property
    def called(self) -> bool:
        return any(block["type"] == "tool_use" for block in self.content)

    def feed(self, delta: str) -> list[dict[str, Any]]:
        return self._apply(self._answer.feed(delta))

    def finish(self) -> list[dict[str, Any]]:
        """The end of the text: what the stream held back, then the open block closed."""
        return [*self._apply(self._answer.finish()), *self._close()]

    def _apply(self, events: list[ToolEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if e.kind == "reasoning":
                if self._open != "thinking":
                    out += [
                        *self._close(),
                        self._start({"type": "thinking", "thinking": "", "signature": ""}),
                    ]
                self.content[-1]["thinking"] += e.text
                out.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
            elif e.kind == "text":
                if self._open != "text":
                    out += [*self._close(), self._start({"type": "text", "text": ""})]
                self.content[-1]["text"] += e.text
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif e.kind == "call":
                block = {"type": "tool_use", "id": _tool_use_id(e.call_id), "name": e.name, "input": {}}
                out += [*self._close(), self._start(block)]
                self._arguments = ""
            else:
                self._arguments += e.text
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.text}))
        return out

    def _start(self, block: dict[str, Any]) -> dict[str, Any]:
        self.content.append(block)
        self._open = block["type"]
        return {"type": "content_block_start", "index": len(self.content) - 1, "content_block": dict(block)}

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        out = []
        if self._open == "tool_use":
            self.content[-1]["input"] = _input(self._arguments)
        elif self._open == "thinking":  # kvtier signs nothing: an empty signature, as its delta
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        self._open = None
        return [*out, {"type": "content_block_stop", "index": len(self.content) - 1}]


def usage(out: RequestOutput, cache_write_end: int | None) -> dict[str, Any]:
    """Anthropic's usage of one request (the module's docstring), with kvtier's split of the cached
    tokens by tier; ``cache_write_end``: the prompt tokens up to the last breakpoint (None: none)."""
    prompt = len(out.prompt_token_ids)
    read = min(out.num_cached_tokens, prompt)
    held = max(read, out.num_prompt_tokens_in_cache)  # a last block held but computed again: not written
    written = 0 if cache_write_end is None else max(0, min(cache_write_end, prompt) - held)
    by_tier = dict.fromkeys(TIERS, 0)
    for tier, n in out.cached_tokens_by_tier.items():
        by_tier[tier] = by_tier.get(tier, 0) + n
    return {
        "input_tokens": prompt - read - written,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": read,
        "output_tokens": len(out.outputs[0].token_ids),
        "kvtier_cache_read_by_tier": {str(tier): n for tier, n in by_tier.items()},
        "kvtier_retained_input_tokens": out.num_retained_tokens,
    }


class MessagesFormatter:
    """One Messages call's answer (one prompt, one completion): the JSON body (``response``) or the
    events (``stream``), as :func:`kvtier.server.app.respond` asks of a formatter."""

    def __init__(
        self,
        model: str,
        tool_names: frozenset[str] | None,
        stop_sequences: list[str],
        cache_write_end: int | None = None,
        diagnose: Callable[[RequestOutput], dict[str, Any]] | None = None,
        reasoning_parser: str | None = None,
    ):
        self.message_id = f"msg_{secrets.token_hex(12)}"
        self.reasoning_parser = reasoning_parser  # --reasoning-parser: the thinking as a thinking block
        self.model = model
        self.tool_names = tool_names
        self.stop_sequences = stop_sequences
        self.cache_write_end = cache_write_end
        self.diagnose = diagnose  # diagnostics.previous_message_id asked: the cache_miss_reason of an output

    def _message(self, content: list[dict[str, Any]], out: RequestOutput, stop: tuple[Any, Any]) -> dict:
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage(out, self.cache_write_end),
        }
        if self.diagnose is not None:
            message["diagnostics"] = {"cache_miss_reason": self.diagnose(out)}
        return message

    def _stop(self, c: CompletionOutput, called: bool) -> tuple[str, str | None]:
        """``(stop_reason, stop_sequence)``: max_tokens when cut, tool_use after calls, stop_sequence when
        one of the request's ended it, else end_turn."""
        if c.finish_reason == "length":
            return "max_tokens", None
        if called:
            return "tool_use", None
        if isinstance(c.stop_reason, str) and c.stop_reason in self.stop_sequences:
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        (out,) = finals
        c = out.outputs[0]
        blocks = ContentBlocks(self.tool_names, self.reasoning_parser)
        blocks.feed(c.text)
        blocks.finish()
        return self._message(blocks.content, out, self._stop(c, blocks.called))

    async def stream(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int
    ) -> AsyncIterator[str]:
        """The events as the outputs come; an engine failure is an ``error`` event."""
        blocks = ContentBlocks(self.tool_names, self.reasoning_parser)
        started = False
        try:
            async for _, out in outputs:
                c = out.outputs[0]
                if not started:
                    started = True
                    yield event({"type": "message_start", "message": self._message([], out, (None, None))})
                    yield event({"type": "ping"})
                for payload in blocks.feed(c.text_delta):
                    yield event(payload)
                if c.finish_reason is None:
                    continue
                for payload in blocks.finish():
                    yield event(payload)
                reason, sequence = self._stop(c, blocks.called)
                delta = {"stop_reason": reason, "stop_sequence": sequence}
                yield event(
                    {"type": "message_delta", "delta": delta, "usage": usage(out, self.cache_write_end)}
                )
                yield event({"type": "message_stop"})
                return
        except (EngineNotReady, EngineDeadError) as exc:
            yield event(translated(exc).body())


# ------------------------------------------------------------------------------------------ routes
def _cache_write_end(tokenizer: Tokenizer, prefix: CachePrefix | None, token_ids: list[int]) -> int | None:
    """The prompt tokens up to the last breakpoint: those the prompt shares with the request cut there
    (rendered without the generation prompt); None without a breakpoint, 0 when the cut does not render."""
    if prefix is None:
        return None
    if prefix.whole:
        return len(token_ids)
    try:
        _, cut = tokenizer.encode_chat(list(prefix.conversation), False, tools=list(prefix.tools))
    except ConfigError:
        return 0
    return shared_prefix(cut, token_ids)


def _render(
    tokenizer: Tokenizer, chat: Chat, max_tokens: int | None, max_model_len: int
) -> tuple[dict[str, Any], int | None, tuple[RetentionSpan, ...]]:
    """The prompt (as the chat route renders it), its tokens up to the last breakpoint, and each
    breakpoint's retention span (its tokens, its TTL) (on the pool)."""
    prompt = prompts.render_chat(
        tokenizer, chat.conversation, max_tokens, max_model_len, chat.tools, chat.template_args()
    )
    ids = prompt["prompt_token_ids"]
    ends = [_cache_write_end(tokenizer, p, ids) or 0 for p in chat.cache_prefixes]
    spans = tuple(RetentionSpan(n, p.ttl_s) for n, p in zip(ends, chat.cache_prefixes, strict=True) if n)
    write_end = None if chat.cache_prefix is None else ends[-1]
    return prompt, write_end, spans


def _count(tokenizer: Tokenizer, chat: Chat) -> int:
    try:
        return len(tokenizer.encode_chat(chat.conversation, tools=chat.tools, **chat.template_args())[1])
    except ConfigError as exc:
        raise as_anthropic(APIError(400, " ".join(str(exc).split()), param="messages")) from None


async def create_message(request: Request, serving: Serving) -> Response:
    """``POST /v1/messages``, checked in the chat route's order: body (400), draining (503), model (404),
    parameters and tools (400), tool schemas (400), loaded (503), length (400), admission (503/529)."""
    arrival = time.monotonic()
    body = await bodies.parse(request, MessagesRequest)
    serving.check_open(request)
    state = request.app.state
    check_model(state.settings.model_name, body.model)
    chat = body.chat()
    params = body.sampling_params(chat, state.settings.reasoning_parser)
    user = body.user_id
    if chat.tools:
        await prompts.off_loop(state.pool, tools.check_schemas, chat.tools)
    tokenizer, max_model_len = prompts.loaded_tokenizer(state.engine)
    prompts.check_chat_length(tokenizer, len(chat.conversation), chat.num_chars, max_model_len)
    prompt, cache_write_end, retention = await prompts.off_loop(
        state.pool, _render, tokenizer, chat, params.max_tokens, max_model_len
    )
    authorization = authorization_of(request.headers)
    salt = tenant_salt(authorization, user, None, state.settings.prefix_cache_scope)
    previous = body.previous_message_id
    streams = await serving.admit(
        state.engine,
        state.metrics,
        [prompt],
        params,
        cache_salt=salt,
        arrival=arrival,
        param="messages",
        tenant=tenant_of(authorization, user),
        grammar_param="output_config.format" if chat.output.schema is not None else "tools",
        retention=retention,
    )
    log = _prompt_log(state)
    ids = prompt["prompt_token_ids"]
    diagnose = None
    if previous is not None:
        before, block_size = log.get(previous), state.engine.block_size or 16
        diagnose = lambda out: miss_reason(before, ids, salt, out.num_cached_tokens, block_size)  # noqa: E731
    fmt = MessagesFormatter(
        state.settings.model_name,
        chat.tool_names,
        body.stop_sequences or [],
        cache_write_end,
        diagnose,
        state.settings.reasoning_parser,
    )
    log.record(fmt.message_id, ids, salt, max((r.ttl_s for r in retention), default=None))
    return await serving.respond(request, fmt, streams, body.stream)


def _prompt_log(state: Any) -> PromptLog:
    """The app's record of recent messages' prompts (made at the first message)."""
    if getattr(state, "prompt_log", None) is None:
        state.prompt_log = PromptLog()
    return state.prompt_log


async def count_tokens(request: Request) -> JSONResponse:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens"}``, the prompt the same request would run."""
    body = await bodies.parse(request, CountTokensRequest)
    state = request.app.state
    check_model(state.settings.model_name, body.model)
    chat = body.chat()
    tokenizer, _ = prompts.loaded_tokenizer(state.engine)
    return JSONResponse({"input_tokens": await prompts.off_loop(state.pool, _count, tokenizer, chat)})


def messages_router(serving: Serving) -> APIRouter:
    """``/v1/messages`` and ``/v1/messages/count_tokens``, behind the client key (``x-api-key`` or
    ``Authorization: Bearer``)."""
    router = APIRouter(prefix="/v1", route_class=AnthropicRoute, dependencies=[Depends(check_messages_key)])

    @router.post("/messages")
    async def messages(request: Request) -> Response:
        return await create_message(request, serving)

    @router.post("/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> JSONResponse:
        return await count_tokens(request)

    return router
