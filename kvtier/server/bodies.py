"""Request bodies: parsed, their size counted by what costs, and validated, off the event loop when big.

::

    the route (after the key)          on the loop (body <= INLINE_BYTES) or the tokenizer pool
    ─────────────────────────          ───────────────────────────────────────────────────────
    raw = await request.body()   ──►   parse_json(raw)     JSON, nested at most MAX_DEPTH deep   400
      (<= --max-request-bytes)         check_counts(data)  messages, content parts, tool calls,
                                                           prompts, stop, stop_token_ids,
                                                           logit_bias, tools: counted             400
                                       model.model_validate(data)   the pydantic request model   400

FastAPI would parse and validate a body parameter on the event loop, before the key check, and the
validation of a list holds the GIL to its end: 127k empty chat messages (4 MB) took ~0.3 s of pydantic
time each, and four at once stalled ``/health`` for seconds. Here the lists are counted right after
``json`` parsing (a ``len()``, microseconds) and a list over its bound is a 400 naming the field before
anything validates one element of it; what remains is bounded by the counts. A big body naming four
times more messages than the bound is refused before it is parsed (``precount``: a byte count). Parsing uses
``pydantic_core.from_json`` (a Rust parser, ~35 ms for 4 MB, depth-limited); a body it refuses for any
other reason than its depth (a lone surrogate such as ``"\\ud800"``, which it does not accept) is parsed
again by ``json`` for OpenAI-compatible errors. Errors take the shape FastAPI's would (so the app's
``RequestValidationError`` handler answers them: a JSON error, a wrong ``Content-Type``).

The bounds (``MAX_COUNTS``): 2048 messages (OpenAI's limit) or Responses input items, 2048 content parts
and 2048 tool calls in all;
2048 prompts; 16 stop strings; 256 stop token ids; 300 logit_bias entries and 128 tools (OpenAI's); JSON
nested at most 200 deep.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from kvtier.server import prompts
from kvtier.server.protocol import (
    MAX_LOGIT_BIAS,
    MAX_PROMPTS,
    MAX_STOP,
    MAX_STOP_TOKEN_IDS,
    APIError,
    bad_request,
    clip,
)
from kvtier.tools import MAX_TOOLS

M = TypeVar("M", bound=BaseModel)
INLINE_BYTES = 64 * 1024  # a body up to this is parsed on the event loop (well under a millisecond)
MAX_DEPTH = 200  # JSON nesting (pydantic_core's parser stops there)
MAX_MESSAGES = 2048  # chat messages in one request (OpenAI's limit)
MAX_CONTENT_PARTS = 2048  # content parts over all of a request's messages
MAX_TOOL_CALLS = 2048  # tool calls over all of a request's assistant messages
PRECOUNT_MESSAGES = 4 * MAX_MESSAGES  # ``"role"`` strings in a big body before it is parsed
MAX_COUNTS = {
    "messages": MAX_MESSAGES,
    "prompt": MAX_PROMPTS,
    "stop": MAX_STOP,
    "stop_token_ids": MAX_STOP_TOKEN_IDS,
    "logit_bias": MAX_LOGIT_BIAS,
    "tools": MAX_TOOLS,
    "input": MAX_MESSAGES,  # the Responses API's items (messages, calls, their outputs)
}
_COUNTED = {"messages": "messages", "prompt": "prompts", "stop": "entries", "stop_token_ids": "entries"}
_COUNTED |= {"tools": "tools", "input": "items"}
_PER_MESSAGE = (("content", MAX_CONTENT_PARTS, "content parts"), ("tool_calls", MAX_TOOL_CALLS, "tool calls"))


def parse_json(raw: bytes) -> Any:
    """The body's JSON value; RequestValidationError (``json_invalid``) when it is not JSON or nested
    deeper than ``MAX_DEPTH``."""
    try:
        return from_json(raw)
    except ValueError as exc:
        if "recursion limit" in str(exc):
            raise _json_invalid(f"nested deeper than {MAX_DEPTH} levels") from None
    try:
        return json.loads(raw)  # what from_json refuses and Python's json takes (lone surrogates)
    except (ValueError, RecursionError) as exc:
        raise _json_invalid(clip(exc, 200)) from None


def _json_invalid(message: str) -> RequestValidationError:
    return RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": message, "input": {}}])


def check_counts(data: Any) -> None:
    """400 naming the field when a list (or ``logit_bias``) of the body holds more than its bound."""
    if not isinstance(data, dict):
        return  # not an object: the model's validation says so
    for name, limit in MAX_COUNTS.items():
        value = data.get(name)
        if name == "prompt" and isinstance(value, list) and value and isinstance(value[0], int):
            continue  # one prompt of token ids (its length is checked against the context)
        if isinstance(value, list | dict) and len(value) > limit:
            what = _COUNTED.get(name, "tokens")
            raise bad_request(f"{name} holds at most {limit} {what}, got {len(value)}", name)
    for field in ("messages", "input"):
        messages = data.get(field)
        if not isinstance(messages, list):
            continue
        for key, limit, what in _PER_MESSAGE:
            lists = (m.get(key) for m in messages if isinstance(m, dict))
            num = sum(len(c) for c in lists if isinstance(c, list))
            if num > limit:
                raise bad_request(f"{field} hold at most {limit} {what} in all, got {num}", field)


def precount(raw: bytes) -> None:
    """400 before parsing when ``raw`` names far more chat messages than ``MAX_MESSAGES``: a flood of
    small messages costs the parser ~0.45 µs a byte under the GIL (57 ms for 127k empty messages), a
    byte count 0.05 µs. Counts ``"role"`` byte strings, which every message holds; a few others (a tool
    parameter named ``role``, text quoting it) are why the bound is ``PRECOUNT_MESSAGES``, not
    ``MAX_MESSAGES``: a body under it is counted exactly after parsing."""
    num = raw.count(b'"role"')
    if num > PRECOUNT_MESSAGES:
        raise bad_request(f"messages holds at most {MAX_MESSAGES} messages, got about {num}", "messages")


def validate(model: type[M], raw: bytes) -> M:
    """``raw`` as ``model``: parsed, counted, validated (any thread)."""
    if len(raw) > INLINE_BYTES and "messages" in model.model_fields:
        precount(raw)
    data = parse_json(raw)
    check_counts(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


def is_json(content_type: str) -> bool:
    """``application/json`` or ``application/*+json`` (FastAPI's test: no header is not JSON)."""
    mime = content_type.split(";", 1)[0].strip().lower()
    kind, _, subtype = mime.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def content_type_error(content_type: str) -> APIError:
    return APIError(
        400,
        f"the request body must be JSON: send 'Content-Type: application/json' "
        f"(got '{clip(content_type) or 'none'}')",
        code="invalid_content_type",
    )


async def parse(request: Request, model: type[M]) -> M:
    """The request's body as ``model``; a big body is handled on the tokenizer pool."""
    content_type = request.headers.get("content-type", "")
    if not is_json(content_type):
        raise content_type_error(content_type)
    raw = await request.body()
    if len(raw) <= INLINE_BYTES:
        return validate(model, raw)
    pool: ThreadPoolExecutor = request.app.state.pool
    return await prompts.off_loop(pool, validate, model, raw)
