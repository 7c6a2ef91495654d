"""OpenAI's Responses API on ``kvtier serve``: ``POST /v1/responses`` and ``/v1/responses/input_tokens``.

The request is mapped onto a chat completion (:mod:`.responses_api`) and runs as one: the same checks,
template, tools, grammar, admission and prompt caching. Only the answer differs::

    one JSON body    {"id": "resp_...", "object": "response", "created_at", "status": "completed" |
                      "incomplete", "incomplete_details": {"reason": "max_output_tokens"} | null,
                      "model", "output": [items], "usage": {"input_tokens", "input_tokens_details":
                      {"cached_tokens"}, "output_tokens", "output_tokens_details": {"reasoning_tokens"},
                      "total_tokens", "kvtier": {"cached_tokens_by_tier", "retained_tokens"}},
                      the request's settings, "previous_response_id", "store": true when it was kept}
    server-sent      response.created, response.in_progress; each item's events (:mod:`.response_items`);
    events           response.completed or response.incomplete (the whole response); an engine failure
                     is an ``error`` event. Every event has its ``sequence_number``.

``reasoning_tokens`` counts the output tokens up to the end of the reasoning (all of them when the
answer was cut while thinking). ``store`` (true unless the request says false) keeps the answer, and
``previous_response_id`` continues a kept one (:mod:`.responses_stored`: the stored routes too). What the
route needs of the app comes in a :class:`~kvtier.server.messages.Serving`, so this module never imports
the app.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from kvtier.outputs import RequestOutput
from kvtier.reasoning import CLOSE
from kvtier.sampling_params import SamplingParams
from kvtier.server import bodies, diagnostics, prompts, responses_stored, tools
from kvtier.server import responses_background as background
from kvtier.server.api_errors import bad_request, not_found
from kvtier.server.async_engine import EngineDeadError, EngineNotReady
from kvtier.server.auth import check_key
from kvtier.server.messages import Serving
from kvtier.server.protocol import ChatCompletionRequest, check_model, tenant_of, tenant_salt
from kvtier.server.response_items import OutputItems
from kvtier.server.response_store import new_response_id
from kvtier.server.responses import usage
from kvtier.server.responses_api import ResponsesRequest, in_responses_names
from kvtier.tokenizer import Tokenizer
from kvtier.tools import Tool


def event(payload: dict[str, Any]) -> str:
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {payload['type']}\ndata: {data}\n\n"


def reasoning_tokens(decode: Callable[[list[int]], str], token_ids: list[int], text: str) -> int:
    """How many of the output's tokens wrote its reasoning: the fewest whose text reaches past the
    closing tag (all of them when the answer was cut while thinking)."""
    at = text.find(CLOSE)
    if at < 0:
        return len(token_ids)
    end, lo, hi = at + len(CLOSE), 0, len(token_ids)
    while lo < hi:  # the smallest k with len(decode(token_ids[:k])) >= end
        mid = (lo + hi) // 2
        if len(decode(token_ids[:mid])) >= end:
            hi = mid
        else:
            lo = mid + 1
    return lo


class ResponsesFormatter:
    """One Responses call's answer: the JSON body (``response``) or the events (``stream``), as
    :func:`kvtier.server.app.respond` asks of a formatter."""

    def __init__(
        self,
        body: ResponsesRequest,
        model: str,
        tool_names: frozenset[str] | None,
        reasoning_parser: str | None,
        decode: Callable[[list[int]], str],
        diagnose: Callable[[RequestOutput], dict[str, Any]] | None = None,
        response_id: str | None = None,
        keeper: responses_stored.Keeper | None = None,
    ):
        self.response_id = response_id or new_response_id(None)
        self.keeper = keeper  # stores the answer before the client has it whole (None: store false)
        self.stored = keeper is not None
        self.created_at = int(time.time())
        self.body = body
        self.model = model
        self.tool_names = tool_names
        self.reasoning_parser = reasoning_parser
        self.decode = decode
        self.diagnose = diagnose  # diagnostics.previous_response_id asked: the cache_miss_reason
        self._sequence = 0

    def _response(self, status: str, items: OutputItems | None, out: RequestOutput | None) -> dict[str, Any]:
        body = self.body
        incomplete = status == "incomplete"
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": body.background,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": items.items if items is not None else [],
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning,
            "store": self.stored,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": body.text if isinstance(body.text, dict) else {"format": {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": self._usage(out, items) if out is not None and items is not None else None,
            "user": body.user,
            "metadata": body.metadata if isinstance(body.metadata, dict) else {},
        }

    def _usage(self, out: RequestOutput, items: OutputItems) -> dict[str, Any]:
        prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        reasoning = (
            reasoning_tokens(self.decode, out.outputs[0].token_ids, out.outputs[0].text)
            if items.reasoning_text
            else 0
        )
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": min(out.num_cached_tokens, prompt)},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion,
            "kvtier": self._kvtier(out),
        }

    def _kvtier(self, out: RequestOutput) -> dict[str, Any]:
        """The cached tokens by tier, the retained ones and (diagnostics asked) why it missed: chat's."""
        body = usage([out])["kvtier"]
        if self.diagnose is not None:
            body["cache_miss_reason"] = self.diagnose(out)
        return body

    def _status(self, out: RequestOutput) -> str:
        return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"

    async def keep(self, response: dict[str, Any]) -> dict[str, Any]:
        """``response``, stored first when it is to be (``store`` false if that failed)."""
        if self.keeper is not None:
            self.stored = await self.keeper.keep(self.response_id, response)
        return {**response, "store": self.stored}

    def _items(self, out: RequestOutput, cut: bool) -> OutputItems:
        items = OutputItems(self.tool_names, self.reasoning_parser, self.response_id)
        items.feed(out.outputs[0].text)
        items.finish(cut)
        return items

    def snapshot(self, status: str, out: RequestOutput | None = None) -> dict[str, Any]:
        """The response at ``status`` (a background run's): no output yet, or ``out``'s so far (its last
        item incomplete; no usage)."""
        return self._response(status, None if out is None else self._items(out, cut=True), None)

    async def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        (out,) = finals
        status = self._status(out)
        return await self.keep(self._response(status, self._items(out, status == "incomplete"), out))

    def _event(self, payload: dict[str, Any]) -> str:
        self._sequence += 1
        return event({**payload, "sequence_number": self._sequence - 1})

    async def stream(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int
    ) -> AsyncIterator[str]:
        """The events as the outputs come; an engine failure is an ``error`` event."""
        items = OutputItems(self.tool_names, self.reasoning_parser, self.response_id)
        started = self._response("in_progress", None, None)
        if self.body.background:  # created queued, as its stored copy was
            queued = {**started, "status": "queued"}
            yield self._event({"type": "response.created", "response": queued})
            yield self._event({"type": "response.queued", "response": queued})
        else:
            yield self._event({"type": "response.created", "response": started})
        yield self._event({"type": "response.in_progress", "response": started})
        try:
            async for _, out in outputs:
                c = out.outputs[0]
                for payload in items.feed(c.text_delta):
                    yield self._event(payload)
                if c.finish_reason is None:
                    continue
                status = self._status(out)
                for payload in items.finish(cut=status == "incomplete"):
                    yield self._event(payload)
                final = await self.keep(self._response(status, items, out))
                yield self._event({"type": f"response.{status}", "response": final})
                return
        except (EngineNotReady, EngineDeadError) as exc:
            yield self._event({"type": "error", "code": "server_error", "message": str(exc), "param": None})


@dataclass(frozen=True)
class _Prepared:
    """A Responses request past its checks, as the chat route runs it: rendered and tokenized."""

    chat: ChatCompletionRequest
    params: SamplingParams
    tools: list[Tool]
    tool_names: frozenset[str] | None  # the calls parsed out of the answer (None: tool_choice none)
    tokenizer: Tokenizer
    prompt: dict[str, Any]
    items: list[dict[str, Any]]  # the input items it runs on: a continued response's, then its own


async def _prepare(request: Request, body: ResponsesRequest, response_id: str | None = None) -> _Prepared:
    """Model (404), the response it continues (400, 404), the items it references (400), parameters and
    tools (400), tool schemas (400), loaded (503), length (400). ``response_id``: the answer's (its new
    input items' ids name it)."""
    state = request.app.state
    check_model(state.settings.model_name, body.model)
    with in_responses_names():
        continued = await responses_stored.previous(request, body)
        body = await responses_stored.resolve_references(request, body, continued)
        history = continued.conversation() if continued is not None else []
        chat: ChatCompletionRequest = body.chat(history)
        params = chat.sampling_params()
        params.reason_first(state.settings.reasoning_parser)  # text.format or a forced call: the answer's
        conversation = chat.conversation()
        given_tools, choice = chat.tool_request()
        if given_tools:
            await prompts.off_loop(state.pool, tools.check_schemas, given_tools)
        tokenizer, max_model_len = prompts.loaded_tokenizer(state.engine)
        num_chars = sum(len(m["content"]) for m in conversation)
        prompts.check_chat_length(tokenizer, len(conversation), num_chars, max_model_len)
        prompt = await prompts.off_loop(
            state.pool,
            prompts.render_chat,
            tokenizer,
            conversation,
            params.max_tokens,
            max_model_len,
            given_tools,
            chat.template_args(),
        )
    names = frozenset(t.name for t in given_tools) if choice.mode != "none" else None
    items = [*history, *responses_stored.with_ids(body.input_items(), response_id)]
    return _Prepared(chat, params, given_tools, names, tokenizer, prompt, items)


async def create_response(request: Request, serving: Serving) -> Response:
    """``POST /v1/responses``, checked in the chat route's order: body (400), draining (503), then
    :func:`_prepare`'s, then admission (503)."""
    arrival = time.monotonic()
    body = await bodies.parse(request, ResponsesRequest)
    serving.check_open(request)
    state = request.app.state
    if body.background and not responses_stored.keeps(request):
        message = "background is not supported by this server (it keeps no responses: --response-store off)"
        raise bad_request(message, "background")
    response_id = new_response_id(state.engine.replica_id)
    run = await _prepare(request, body, response_id)
    chat = run.chat
    authorization = request.headers.get("authorization", "")
    salt = tenant_salt(authorization, chat.user, None, state.settings.prefix_cache_scope)
    log = diagnostics.prompt_log(state)  # the chat routes' record: either's id may be asked
    with in_responses_names():
        previous = diagnostics.previous_response_id(chat.diagnostics)
        diagnose = diagnostics.explain(log, previous, [run.prompt], salt, state.engine.block_size or 16)
        streams = await serving.admit(
            state.engine,
            state.metrics,
            [run.prompt],
            run.params,
            cache_salt=salt,
            arrival=arrival,
            param="input",
            tenant=tenant_of(authorization, chat.user),
            grammar_param="tools" if run.tools else "text.format",
            retention=chat.retention,
        )
    decode = run.tokenizer.decode
    keeper = responses_stored.Keeper(request, run.items)
    fmt = ResponsesFormatter(
        body,
        state.settings.model_name,
        run.tool_names,
        state.settings.reasoning_parser,
        decode,
        diagnose,
        response_id,
        keeper if body.store and keeper.enabled else None,
    )
    ttl_s = max((r.ttl_s for r in chat.retention), default=None)
    diagnostics.record_answer(log, fmt.response_id, [run.prompt], salt, ttl_s)
    if body.background:  # answered at once (queued), or its events followed: it runs on without the client
        started = await state.background.start(fmt, streams[0], body.stream)
        return JSONResponse(started) if isinstance(started, dict) else background.followed(started)
    return await serving.respond(request, fmt, streams, body.stream)


async def count_input_tokens(request: Request) -> JSONResponse:
    """``POST /v1/responses/input_tokens``: the prompt tokens the same request would run."""
    body = await bodies.parse(request, ResponsesRequest)
    run = await _prepare(request, body)
    count = len(run.prompt["prompt_token_ids"])
    return JSONResponse({"object": "response.input_tokens", "input_tokens": count})


def responses_router(serving: Serving) -> APIRouter:
    """``POST /v1/responses`` and ``/v1/responses/input_tokens``, and the stored responses' routes, behind
    the client key."""
    router = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @router.post("/responses")
    async def responses(request: Request) -> Response:
        return await create_response(request, serving)

    @router.post("/responses/input_tokens")
    async def input_tokens(request: Request) -> JSONResponse:
        return await count_input_tokens(request)

    @router.get("/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> Response:
        return await responses_stored.retrieve(request, response_id)

    @router.delete("/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> JSONResponse:
        return await responses_stored.delete(request, response_id)

    @router.get("/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str) -> JSONResponse:
        return await responses_stored.input_items(request, response_id)

    @router.post("/responses/{response_id}/cancel")
    async def cancel(request: Request, response_id: str) -> JSONResponse:
        return await responses_stored.cancel(request, response_id)

    @router.api_route("/responses/{rest:path}", methods=["GET", "POST", "DELETE"], include_in_schema=False)
    async def other(request: Request, rest: str) -> Response:
        raise not_found()

    return router
