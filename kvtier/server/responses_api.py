"""OpenAI's Responses API (``POST /v1/responses``), the request side that ``kvtier serve`` and ``kvtier
router`` share: the body checked and mapped onto a chat-completions request, so the chat route's
machinery (template, tools, grammar, sampling, prompt caching) runs it unchanged. No torch, no FastAPI;
the route and its events are :mod:`.responses_route`.

::

    the Responses request                           the chat request it runs as
    ──────────────────────────────────────────────  ────────────────────────────────────────────────────
    instructions                                    a system message, first
    input: a string                                 one user message
    input: messages {role, content}, type           messages (developer is system); content a string or
      "message" or none                               input_text / output_text parts, joined
    input: function_call {call_id, name,            an assistant message's tool_calls (consecutive calls
      arguments}                                      one message)
    input: function_call_output {call_id, output}   a tool message
    input: reasoning {content | summary}            the next assistant turn's reasoning_content (the
                                                      template writes it or drops it)
    tools [{type: function, name, description,      tools [{type: function, function: {...}}]
      parameters, strict}]
    tool_choice auto | none | required |            the same; {type: function, function: {name}}
      {type: function, name}
    max_output_tokens, temperature, top_p, user,    max_tokens, temperature, top_p, user,
      prompt_cache_key, prompt_cache_retention        prompt_cache_key, prompt_cache_retention
    text.format text | json_object | json_schema    response_format
    reasoning.effort                                chat_template_kwargs.reasoning_effort (templates
                                                      that read it, as vLLM passes it)

``previous_response_id`` continues a stored response (:mod:`.response_store`): its input and output
items come first (``chat(history)``), its ``instructions`` do not carry over, as OpenAI's. An
``item_reference`` is replaced by the stored item before (``responses_stored.resolve_references``). A
400: ``background`` without ``store``, other tools (web search, files...), images and files in the
input, ``top_logprobs`` and ``max_tool_calls``. Errors name the Responses field (``input[2].call_id``,
``max_output_tokens``, ``tools[0].parameters``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from kvtier.server.api_errors import APIError, bad_request, clip, validation_error
from kvtier.server.protocol import ChatCompletionRequest, JSONValue, Temperature, Text, TopP

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# chat field paths -> the Responses request's own, for error messages and params
_RENAMES = (
    ("messages", "input"),
    ("max_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
    (".function.parameters", ".parameters"),
    (".function.name", ".name"),
    (".function.description", ".description"),
    (".function", ""),
)


def renamed(text: str) -> str:
    for old, new in _RENAMES:
        text = text.replace(old, new)
    return text


def as_responses_error(exc: APIError) -> APIError:
    """A chat-route error in the Responses request's field names."""
    exc.message = renamed(exc.message)
    exc.param = renamed(exc.param) if exc.param else exc.param
    return exc


@contextmanager
def in_responses_names() -> Iterator[None]:
    """Errors raised inside (the chat route's checks, pydantic's) named in the Responses request's fields."""
    try:
        yield
    except ValidationError as exc:
        raise as_responses_error(validation_error(list(exc.errors()))) from None
    except APIError as exc:
        raise as_responses_error(exc) from None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` (the fields kvtier reads; others are accepted and have no effect)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: Text | None = None
    input: Text | list[JSONValue]
    instructions: Text | None = None
    tools: list[JSONValue] | None = None
    tool_choice: JSONValue = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: Text | None = None
    background: bool = False
    text: JSONValue = None
    reasoning: JSONValue = None
    user: Text | None = None
    metadata: JSONValue = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    diagnostics: JSONValue = None  # kvtier's {"previous_response_id"}: why this one missed the cache

    def input_items(self) -> list[Any]:
        """``input`` as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}
            ]
        return list(self.input)

    def chat(self, history: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
        """The chat-completions request this one runs as (the module's table), after the ``history``
        items of the response it continues; a 400 for what is wrong (call it, and the chat request's
        checks, ``in_responses_names``)."""
        self._check_unsupported()
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": self._messages(history or []),
            "parallel_tool_calls": self.parallel_tool_calls,
            "stream": self.stream,
        }
        for name, value in (
            ("max_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("user", self.user),
            ("prompt_cache_key", self.prompt_cache_key),
            ("prompt_cache_retention", self.prompt_cache_retention),
            ("tools", _tools(self.tools)),
            ("tool_choice", _tool_choice(self.tool_choice)),
            ("response_format", _format(self.text)),
            ("chat_template_kwargs", _effort(self.reasoning)),
            ("diagnostics", self.diagnostics),
        ):
            if value is not None:
                chat[name] = value
        return ChatCompletionRequest.model_validate(chat)

    def _check_unsupported(self) -> None:
        if self.background and not self.store:
            raise bad_request("background requires store: true (its answer is read back by id)", "background")
        refused = (
            ("top_logprobs", bool(self.top_logprobs)),
            ("max_tool_calls", self.max_tool_calls is not None),
        )
        for name, given in refused:
            if given:
                raise bad_request(f"{name} is not supported by this server (leave it out)", name)

    def _messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat messages of ``history`` (a stored response's items: checked when it was made) and
        ``input`` (its items named ``input[i]`` in errors)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        reasoning = ""  # a reasoning item's text, for the assistant turn after it
        calls: set[str] = set()  # the call_ids of the function calls so far
        items = [(f"history[{i}]", item) for i, item in enumerate(history)]
        items += [(f"input[{i}]", item) for i, item in enumerate(self.input_items())]
        for at, item in items:
            if isinstance(item, dict) and item.get("type") == "reasoning":
                reasoning += _reasoning_text(item)
                continue
            _add_item(messages, item, at, calls)
            if reasoning and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("reasoning_content", reasoning)
            reasoning = ""  # it belongs to the item right after it
        if not messages:
            raise bad_request("input must not be empty", "input")
        return messages


def _call_id(item: dict[str, Any], at: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{at}.call_id must be a non-empty string", f"{at}.call_id")
    return call_id


def _add_item(messages: list[dict[str, Any]], item: Any, at: str, calls: set[str]) -> None:
    """One input item onto the chat messages (a function call joins the assistant message before it; an
    output must answer an earlier call: ``calls``)."""
    if not isinstance(item, dict):
        raise bad_request(f"{at} must be an object (a message or a function call or its output)", at)
    kind = item.get("type", "message")
    if kind == "message":
        role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise bad_request(f"{at}.role must be user, assistant, system or developer", f"{at}.role")
        messages.append({"role": role, "content": _text(item.get("content"), f"{at}.content")})
    elif kind == "function_call":
        calls.add(_call_id(item, at))
        if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
            raise bad_request(f"{at}: a function_call has a string name and arguments (JSON text)", at)
        call = {"id": item.get("call_id"), "type": "function"}
        call["function"] = {"name": item.get("name"), "arguments": item.get("arguments")}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        if _call_id(item, at) not in calls:
            message = f"{at}.call_id {clip(item['call_id'])!r} matches no function_call before it"
            raise bad_request(message, f"{at}.call_id")
        output = item.get("output")
        content = output if isinstance(output, str) else _text(output, f"{at}.output")
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
    else:
        raise bad_request(f"{at}: input items of type '{clip(kind)}' are not supported by this server", at)


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its ``reasoning_text`` parts, else its summary's (none: "")."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list):
            text = "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
            if text:
                return text
    return ""


def _text(content: Any, at: str) -> str:
    """A message's content as text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{at} must be a string or a list of input_text parts", at)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text", part.get("refusal")), str):
            raise bad_request(
                f"{at}[{j}]: only text parts are supported, got type '{clip(kind)}'", f"{at}[{j}]"
            )
        texts.append(part.get("text", part.get("refusal")))
    return "".join(texts)


def _tools(raw: list[Any] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat's shape; other tool types are a 400 naming them."""
    if raw is None:
        return None
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise bad_request(
                f"tools[{i}]: tools of type '{clip(kind)}' are not supported by this server "
                "(function tools are)",
                f"tools[{i}].type",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(raw: Any) -> Any:
    if isinstance(raw, dict) and raw.get("type") == "function":
        return {"type": "function", "function": {"name": raw.get("name")}}
    return raw


def _format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request(
            'text.format must be {"type": "text" | "json_object" | "json_schema", ...}', "text.format"
        )
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _effort(reasoning: Any) -> dict[str, Any] | None:
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    return {"reasoning_effort": effort} if isinstance(effort, str) else None
