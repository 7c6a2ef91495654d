"""Anthropic's Messages API (``POST /v1/messages``), the wire side that ``kvtier serve`` and ``kvtier router``
share: the request checked and mapped onto the chat route's internals, keys, errors in Anthropic's shape.
No torch and no FastAPI (the router imports it); the route and the answer are :mod:`.messages`.

::

    Anthropic's request                            the chat route's internals
    ─────────────────────────────────────────────  ───────────────────────────────────────────────────────
    system: text, or text blocks                   a system message (the texts joined)
    user: text blocks                              a user message (the texts joined)
    user: tool_result {tool_use_id, content,       a tool message {tool_call_id, content}; "Error: " before
                       is_error}                     the content when is_error
    assistant: text and tool_use {id, name,        an assistant message with tool_calls, the arguments
                                  input}             json.dumps(input) (a call the model wrote renders as the
                                                     same text again: its blocks stay cached)
    tools [{name, description, input_schema}]      kvtier.tools.Tool (parameters: input_schema)
    tool_choice {type: auto | any | tool | none}   auto | required | the named function | none
      disable_parallel_tool_use: true              parallel_tool_calls false
    max_tokens, stop_sequences, temperature,       SamplingParams; a forced call's grammar
      top_p, top_k                                   (kvtier.tools.call_grammar)
    metadata.user_id                               the tenant's user (the OpenAI routes' ``user``)
    cache_control (top level, system blocks,       checked ({"type": "ephemeral", "ttl"?: "5m" | "1h"});
      tools, content blocks)                         the last one's place counts cache_creation_input_tokens

A final assistant message is a prefill: the answer continues its text (the template leaves it open,
:mod:`kvtier.chat_format`) and holds only what follows; it may not hold tool_use or end in whitespace.
``output_config.format`` (a JSON schema) holds the answer to it, as chat's ``response_format``;
``output_config.effort`` is the template's ``reasoning_effort``.
``thinking`` (enabled, adaptive, disabled) is the template's ``enable_thinking`` (Qwen3's; other
templates ignore it), and with ``--reasoning-parser`` its ``budget_tokens`` bounds the thought
(``SamplingParams.thinking_token_budget``); an assistant's earlier ``thinking`` blocks are its
``reasoning_content`` (a template that writes it, Qwen3's within the current turn, renders the prompt the
model saw), ``redacted_thinking`` is dropped.
Anything else is a 400 naming it, never silently ignored: other content blocks (image, document...),
server tools, the beta's ``output_format`` and every other top-level field but ``service_tier`` (one
tier here) and nulls. Strings inside the request must be valid Unicode, as on the OpenAI routes.

Errors in Anthropic's shape and the ``x-api-key`` header: :mod:`.anthropic_errors`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from kvtier.chat_format import ChatTemplateArgs
from kvtier.config import ConfigError
from kvtier.sampling_params import SamplingParams, StructuredOutputs
from kvtier.server.anthropic_errors import invalid, renamed
from kvtier.server.anthropic_output import (
    OutputConfig,
    Thinking,
    check_prefill,
    output_config_of,
    thinking_of,
)
from kvtier.server.protocol import (
    MAX_STOP,
    JSONValue,
    Text,
    TopK,
    TopP,
    clip,
)
from kvtier.tools import CLOSE, Tool, ToolChoice, ToolError, call_grammar, normalize_messages, parse_tools

# ------------------------------------------------------------------------------------- the request
_BLOCK_KEYS = {
    "text": frozenset({"type", "text", "cache_control", "citations"}),
    "tool_use": frozenset({"type", "id", "name", "input", "cache_control"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}),
    "thinking": frozenset({"type", "thinking", "signature", "cache_control"}),
    "redacted_thinking": frozenset({"type", "data", "cache_control"}),
}
# an assistant's earlier thinking is its reasoning_content (the template writes it or drops it)
_ROLE_BLOCKS = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
}
_TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "cache_control"})
_CHOICE_KEYS = frozenset({"type", "name", "disable_parallel_tool_use"})
_IGNORED = frozenset({"service_tier"})  # accepted whatever its value: kvtier has one tier
_WHAT = {  # what a refused top-level field is, for its message
    "output_format": "the beta's structured outputs: send output_config.format",
    "container": "code execution containers",
    "mcp_servers": "MCP servers",
    "context_management": "context management",
}


def check_cache_control(value: Any, at: str) -> bool:
    """Whether ``value`` is a breakpoint (None: none); a 400 unless it is ``{"type": "ephemeral"}`` with an
    optional ``ttl`` of ``"5m"`` or ``"1h"``."""
    if value is None:
        return False
    if (
        not isinstance(value, dict)
        or value.get("type") != "ephemeral"
        or not set(value) <= {"type", "ttl"}
        or value.get("ttl") not in (None, "5m", "1h")
    ):
        shown = clip(json.dumps(value, ensure_ascii=False))
        raise invalid(f'{at} must be {{"type": "ephemeral", "ttl"?: "5m" | "1h"}}, got {shown}', at)
    return True


def _unknown(given: dict[str, Any], known: frozenset[str] | set[str]) -> list[str]:
    """The keys of ``given`` this server does not take (a null is as good as absent)."""
    return sorted(k for k, v in given.items() if k not in known and v is not None)


def _check_block(block: Any, at: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    """A content block of one of the ``allowed`` types, its keys and cache_control checked."""
    if not isinstance(block, dict):
        raise invalid(f"{at} must be a content block (an object with a type)", at)
    kind = block.get("type")
    if kind not in allowed:
        listed = ", ".join(allowed)
        raise invalid(
            f"{at}: content blocks of type '{clip(kind)}' are not supported here (this server takes "
            f"{listed})",
            at,
        )
    unknown = _unknown(block, _BLOCK_KEYS[kind])
    if unknown:
        raise invalid(f"{at}.{clip(unknown[0])} is not supported by this server", f"{at}.{unknown[0]}")
    check_cache_control(block.get("cache_control"), f"{at}.cache_control")
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise invalid(f"{at}.text must be a string", f"{at}.text")
        if block.get("citations") not in (None, []):
            raise invalid(f"{at}.citations are not supported by this server", f"{at}.citations")
    return block


def _texts(blocks: list[dict[str, Any]]) -> str:
    return "".join(b["text"] for b in blocks)


def _system_blocks(raw: Any) -> list[dict[str, Any]]:
    """``system`` as text blocks (a string is one)."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"type": "text", "text": raw}]
    if not isinstance(raw, list):
        raise invalid("system must be a string or a list of text blocks", "system")
    return [_check_block(b, f"system[{j}]", ("text",)) for j, b in enumerate(raw)]


def _content(message: Any, at: str) -> tuple[str, list[dict[str, Any]]]:
    """A message's role and content blocks (a string is one text block), checked."""
    if not isinstance(message, dict):
        raise invalid(f'{at} must be {{"role": "user" | "assistant", "content": ...}}', at)
    role = message.get("role")
    if role not in _ROLE_BLOCKS:
        raise invalid(f"{at}.role must be 'user' or 'assistant', got '{clip(role)}'", f"{at}.role")
    unknown = _unknown(message, {"role", "content"})
    if unknown:
        raise invalid(f"{at}.{clip(unknown[0])} is not supported by this server", f"{at}.{unknown[0]}")
    content = message.get("content")
    if isinstance(content, str):
        return role, [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(f"{at}.content must be a string or a list of content blocks", f"{at}.content")
    allowed = _ROLE_BLOCKS[role]
    return role, [_check_block(b, f"{at}.content[{j}]", allowed) for j, b in enumerate(content)]


def _tool_use(block: dict[str, Any], at: str) -> dict[str, Any]:
    """A tool_use block as an OpenAI tool call (arguments: the input as JSON text)."""
    call_id, name, given = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{at}.id must be a non-empty string", f"{at}.id")
    if not isinstance(name, str) or not name:
        raise invalid(f"{at}.name must be a non-empty string", f"{at}.name")
    if not isinstance(given, dict):
        raise invalid(f"{at}.input must be an object", f"{at}.input")
    arguments = json.dumps(given, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_result(block: dict[str, Any], at: str, calls: set[str]) -> dict[str, Any]:
    """A tool_result block as a tool message; its tool_use_id must answer an earlier tool_use."""
    use_id = block.get("tool_use_id")
    if not isinstance(use_id, str) or use_id not in calls:
        raise invalid(
            f"{at}.tool_use_id '{clip(use_id)}' matches no tool_use block of an earlier assistant message",
            f"{at}.tool_use_id",
        )
    content = block.get("content")
    if isinstance(content, list):
        text = _texts([_check_block(b, f"{at}.content[{k}]", ("text",)) for k, b in enumerate(content)])
    elif isinstance(content, str) or content is None:
        text = content or ""
    else:
        raise invalid(f"{at}.content must be a string or a list of text blocks", f"{at}.content")
    is_error = block.get("is_error")
    if is_error not in (None, True, False):
        raise invalid(f"{at}.is_error must be a boolean", f"{at}.is_error")
    return {"role": "tool", "tool_call_id": use_id, "content": f"Error: {text}" if is_error else text}


def _message(message: Any, at: str, calls: set[str]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: an assistant's one (its text, its calls), or a user's text
    and tool results, in their order (consecutive texts joined)."""
    role, blocks = _content(message, at)
    if role == "assistant":
        used = [_tool_use(b, f"{at}.content[{j}]") for j, b in enumerate(blocks) if b["type"] == "tool_use"]
        calls.update(c["id"] for c in used)
        out: dict[str, Any] = {
            "role": "assistant",
            "content": _texts([b for b in blocks if b["type"] == "text"]),
        }
        thinking = "".join(str(b.get("thinking") or "") for b in blocks if b["type"] == "thinking")
        if thinking:  # the template decides whether to write it (Qwen3's: within the current turn)
            out["reasoning_content"] = thinking
        return [out | {"tool_calls": used}] if used else [out]
    chat: list[dict[str, Any]] = []
    texts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        if block["type"] == "text":
            texts.append(block)
            continue
        if texts:
            chat.append({"role": "user", "content": _texts(texts)})
            texts = []
        chat.append(_tool_result(block, f"{at}.content[{j}]", calls))
    if texts or not chat:
        chat.append({"role": "user", "content": _texts(texts)})
    return chat


def _is_empty(message: Any) -> bool:
    """A message whose content is "" or [] (as Anthropic's API, a 400 unless it is a final prefill)."""
    return isinstance(message, dict) and message.get("content") in ("", [])


def _conversation(system: list[dict[str, Any]], messages: list[Any]) -> list[dict[str, Any]]:
    """The chat messages; consecutive turns of one role are one turn, as Anthropic's API combines them
    (their texts joined as a message's blocks are, their calls in order): templates that insist on
    alternating roles (Gemma's) take them."""
    chat = [{"role": "system", "content": _texts(system)}] if system else []
    calls: set[str] = set()
    for i, message in enumerate(messages):
        if _is_empty(message) and not (i == len(messages) - 1 and message.get("role") == "assistant"):
            raise invalid(
                f"messages[{i}]: all messages must have non-empty content except for the optional final "
                "assistant message",
                f"messages[{i}].content",
            )
        for turn in _message(message, f"messages[{i}]", calls):
            last = chat[-1] if chat else None
            if last is None or turn["role"] not in ("user", "assistant") or last["role"] != turn["role"]:
                chat.append(turn)
                continue
            joined = {**last, "content": last["content"] + turn["content"]}
            if turn.get("tool_calls"):
                joined["tool_calls"] = [*last.get("tool_calls", []), *turn["tool_calls"]]
            chat[-1] = joined
    return chat


def _tools(raw: Any) -> list[Tool]:
    """Anthropic's custom tools as :class:`Tool` s (input_schema: the parameters)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid('tools must be a list of {"name", "description", "input_schema"} objects', "tools")
    given = []
    for i, entry in enumerate(raw):
        at = f"tools[{i}]"
        if not isinstance(entry, dict):
            raise invalid(f'{at} must be an object {{"name", "description", "input_schema"}}', at)
        if entry.get("type") not in (None, "custom"):
            raise invalid(
                f"{at}: tools of type '{clip(entry.get('type'))}' (Anthropic's own tools) are not supported "
                "by this server; give custom tools (name, description, input_schema)",
                f"{at}.type",
            )
        unknown = _unknown(entry, _TOOL_KEYS)
        if unknown:
            raise invalid(f"{at}.{clip(unknown[0])} is not supported by this server", f"{at}.{unknown[0]}")
        if "input_schema" not in entry:
            raise invalid(f"{at}.input_schema is required", f"{at}.input_schema")
        check_cache_control(entry.get("cache_control"), f"{at}.cache_control")
        function = {"name": entry.get("name"), "parameters": entry["input_schema"]}
        if "description" in entry:
            function["description"] = entry["description"]
        given.append({"type": "function", "function": function})
    try:
        return parse_tools(given)
    except ToolError as exc:
        raise invalid(renamed(str(exc)), renamed(exc.param)) from None


def _tool_choice(raw: Any, tools: list[Tool]) -> ToolChoice:
    """``{"type": "auto" | "any" | "tool" | "none", "name"?, "disable_parallel_tool_use"?}``."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if not isinstance(raw, dict) or raw.get("type") not in ("auto", "any", "tool", "none"):
        raise invalid(
            'tool_choice must be {"type": "auto" | "any" | "tool" | "none"} ("tool" with a "name")',
            "tool_choice",
        )
    unknown = _unknown(raw, _CHOICE_KEYS)
    if unknown:
        raise invalid(f"tool_choice.{clip(unknown[0])} is not supported by this server", "tool_choice")
    single = raw.get("disable_parallel_tool_use")
    if single not in (None, True, False):
        raise invalid("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
    kind, parallel = raw["type"], not single
    if kind == "none" or (kind == "auto" and not tools):
        return ToolChoice("none", parallel=parallel)
    if kind == "auto":
        return ToolChoice("auto", parallel=parallel)
    if not tools:
        raise invalid(f"tool_choice type '{kind}' needs tools", "tool_choice")
    if kind == "any":
        return ToolChoice("required", parallel=parallel)
    name = raw.get("name")
    if not isinstance(name, str) or not any(t.name == name for t in tools):
        raise invalid(f"tool_choice names the tool '{clip(name)}', which is not in tools", "tool_choice")
    return ToolChoice("function", name, parallel=False)


@dataclass(frozen=True)
class CachePrefix:
    """Where the request's last ``cache_control`` breakpoint sits: ``whole``, at the end of the prompt (a
    top-level cache_control, or one on the last block); else the request cut right after its block, as a
    ``conversation`` and ``tools`` to render without the generation prompt. The prompt's tokens it shares
    are the breakpoint's prefix (the tools' block follows the system text, as rendered)."""

    conversation: tuple[dict[str, Any], ...] = ()
    tools: tuple[Tool, ...] = ()
    whole: bool = False
    ttl_s: float = 300.0  # the breakpoint's "ttl": "5m" (the default) or "1h"


def _marked(block: Any) -> bool:
    """A (checked) content block that carries a breakpoint, in itself or in a tool result's text."""
    inner = block.get("content") if block.get("type") == "tool_result" else None
    nested = isinstance(inner, list) and any(b.get("cache_control") is not None for b in inner)
    return block.get("cache_control") is not None or nested


def _ttl(block: dict[str, Any]) -> float:
    """A (checked) breakpoint's TTL in seconds; a tool result's nested one counts too."""
    marks = [block.get("cache_control")]
    inner = block.get("content") if block.get("type") == "tool_result" else None
    if isinstance(inner, list):
        marks += [b.get("cache_control") for b in inner]
    return max(_TTL_S[m.get("ttl") or "5m"] for m in marks if m is not None)


_TTL_S = {"5m": 300.0, "1h": 3600.0}


def _breakpoints(
    system: list[dict[str, Any]], raw_tools: Any, tools: list[Tool], messages: list[Any]
) -> list[CachePrefix]:
    """Every breakpoint in Anthropic's order (tools, system, messages), each as a :class:`CachePrefix`
    with its TTL; the last one is the prompt's cache write end."""
    found: list[CachePrefix] = []
    for k, raw in enumerate(raw_tools if tools else []):
        if raw.get("cache_control") is not None:
            found.append(
                CachePrefix(tuple(_conversation(system, [])), tuple(tools[: k + 1]), ttl_s=_ttl(raw))
            )
    for j, block in enumerate(system):
        if block.get("cache_control") is not None:
            found.append(CachePrefix(tuple(_conversation(system[: j + 1], [])), ttl_s=_ttl(block)))
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, block in enumerate(content if isinstance(content, list) else []):
            if not _marked(block):
                continue
            if i == len(messages) - 1 and j == len(content) - 1:
                found.append(CachePrefix(whole=True, ttl_s=_ttl(block)))
                continue
            cut = [*messages[:i], {**message, "content": content[: j + 1]}]
            found.append(CachePrefix(tuple(_conversation(system, cut)), tuple(tools), ttl_s=_ttl(block)))
    return found


@dataclass(frozen=True)
class Chat:
    """A request as the chat route runs it: the conversation (OpenAI's shape, normalized), the tools and
    tool_choice, and its cache_control breakpoints (each a prefix the prompt keeps cached for its TTL)."""

    conversation: list[dict[str, Any]]
    tools: list[Tool]
    choice: ToolChoice
    cache_prefixes: tuple[CachePrefix, ...] = ()  # every breakpoint, the last one last
    continue_final: bool = False  # the last message is the assistant's: the answer continues it (prefill)
    thinking: Thinking = field(default_factory=Thinking)  # ``thinking``: enabled, its budget
    output: OutputConfig = field(default_factory=OutputConfig)  # output_config

    def template_args(self) -> ChatTemplateArgs:
        """How the template renders it: a new assistant turn, or the prefilled one left open; ``thinking``
        as the ``enable_thinking`` variable (Qwen3's; a template without it ignores it)."""
        args = ChatTemplateArgs(
            add_generation_prompt=not self.continue_final, continue_final_message=self.continue_final
        )
        variables: dict[str, Any] = {}
        if self.thinking.enabled is not None:
            variables["enable_thinking"] = self.thinking.enabled
        if self.output.effort is not None:
            variables["reasoning_effort"] = self.output.effort
        if variables:
            args["template_kwargs"] = variables
        return args

    @property
    def cache_prefix(self) -> CachePrefix | None:
        """The last breakpoint (where the prompt's cache write ends), None without one."""
        return self.cache_prefixes[-1] if self.cache_prefixes else None

    @property
    def tool_names(self) -> frozenset[str] | None:
        """The tools whose calls are parsed out of the answer (None: tool_choice none, or no tools)."""
        return None if self.choice.mode == "none" else frozenset(t.name for t in self.tools)

    @property
    def num_chars(self) -> int:
        return sum(len(m.get("content") or "") for m in self.conversation)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class CountTokensRequest(_Request):
    """``POST /v1/messages/count_tokens``: the conversation part of a Messages request."""

    model: Text
    messages: list[JSONValue]
    system: JSONValue = None
    tools: JSONValue = None
    tool_choice: JSONValue = None
    cache_control: JSONValue = None
    thinking: JSONValue = None
    output_config: JSONValue = None

    def chat(self) -> Chat:
        """The request mapped onto the chat route's internals (the module's table); 400 naming what is
        wrong or not supported."""
        for name, value in (self.model_extra or {}).items():
            if value is not None and name not in _IGNORED:
                what = f" ({_WHAT[name]})" if name in _WHAT else ""
                raise invalid(f"{clip(name)}{what} is not supported by this server", name)
        if not self.messages:
            raise invalid("messages must not be empty", "messages")
        system = _system_blocks(self.system)
        tools = _tools(self.tools)
        choice = _tool_choice(self.tool_choice, tools)
        conversation = _conversation(system, self.messages)
        continue_final = self.messages[-1].get("role") == "assistant"
        if continue_final:
            check_prefill(conversation[-1], f"messages[{len(self.messages) - 1}]")
        prefixes = _breakpoints(system, self.tools, tools, self.messages)
        if check_cache_control(self.cache_control, "cache_control"):  # a marker on the last block
            prefixes.append(CachePrefix(whole=True, ttl_s=_TTL_S[self.cache_control.get("ttl") or "5m"]))
        try:
            conversation = normalize_messages(conversation)
        except ToolError as exc:
            raise invalid(str(exc), "messages") from None
        output = output_config_of(self.output_config)
        if output.schema is not None and choice.constrained:
            raise invalid(
                "output_config.format cannot be combined with tool_choice any or tool: the answer is the "
                "tool calls",
                "output_config.format",
            )
        thinking = thinking_of(self.thinking)
        return Chat(conversation, tools, choice, tuple(prefixes), continue_final, thinking, output)


# Anthropic's range (OpenAI's goes to 2): a temperature past 1 is a 400 naming it, as there.
UnitTemperature = Annotated[float, Field(ge=0.0, le=1.0)]


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int
    stop_sequences: list[Text] | None = None
    stream: bool = False
    metadata: JSONValue = None
    diagnostics: JSONValue = None
    temperature: UnitTemperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None

    @property
    def previous_message_id(self) -> str | None:
        """``diagnostics.previous_message_id``: explain this request's cache use against that message's
        (kvtier/server/diagnostics.py); 400 when malformed."""
        if self.diagnostics is None:
            return None
        d = self.diagnostics
        if (
            not isinstance(d, dict)
            or set(d) != {"previous_message_id"}
            or not isinstance(d["previous_message_id"], str)
        ):
            raise invalid('diagnostics must be {"previous_message_id": "msg_..."}', "diagnostics")
        return d["previous_message_id"]

    @property
    def user_id(self) -> str | None:
        """``metadata.user_id``: the tenant's user, as the OpenAI routes' ``user`` (400 when malformed)."""
        if self.metadata is None:
            return None
        if not isinstance(self.metadata, dict) or not set(self.metadata) <= {"user_id"}:
            raise invalid('metadata must be {"user_id": "..."}', "metadata")
        user = self.metadata.get("user_id")
        if user is not None and not isinstance(user, str):
            raise invalid("metadata.user_id must be a string", "metadata.user_id")
        return user

    def sampling_params(self, chat: Chat, reasoning_parser: str | None = None) -> SamplingParams:
        """The request's sampling parameters: a forced call (tool_choice any or tool) held to the calls'
        grammar; ``auto`` with disable_parallel_tool_use ends after the first call. With a
        ``reasoning_parser`` the constraint holds the answer alone, and ``thinking.budget_tokens`` bounds
        the thought (without one, the thinking is text of the answer, and ``max_tokens`` bounds both)."""
        if self.max_tokens < 1:
            raise invalid(f"max_tokens must be at least 1, got {clip(self.max_tokens)}", "max_tokens")
        budget = chat.thinking.budget_tokens
        if budget is not None and budget >= self.max_tokens:
            raise invalid(
                f"max_tokens must be greater than thinking.budget_tokens ({budget}), got {self.max_tokens}",
                "max_tokens",
            )
        stop = list(self.stop_sequences or [])
        if len(stop) > MAX_STOP:
            raise invalid(
                f"stop_sequences holds at most {MAX_STOP} entries, got {len(stop)}", "stop_sequences"
            )
        if not all(stop):
            raise invalid("stop_sequences must be non-empty strings", "stop_sequences")
        if chat.choice.mode == "auto" and not chat.choice.parallel:
            stop.append(CLOSE)
        grammar = call_grammar(chat.tools, chat.choice) if chat.choice.constrained else None
        if grammar is not None:
            structured: StructuredOutputs | None = StructuredOutputs(grammar=grammar)
        elif chat.output.schema is not None:
            structured = StructuredOutputs(json=chat.output.schema)
        else:
            structured = None
        try:
            params = SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                max_tokens=self.max_tokens,
                stop=stop,
                structured_outputs=structured,
                thinking_token_budget=budget if reasoning_parser is not None else None,
            )
            params.reason_first(reasoning_parser)
            return params
        except ConfigError as exc:
            message = " ".join(str(exc).split())
            raise invalid(message, message.split(" ", 1)[0]) from None
