"""Tool rendering and the call constraint: a template's own tool format where it has one (found by probes),
else the generic format (the package's docstring and ``docs/tools.md``); the Lark grammar llguidance holds a
forced call to."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.tools.spec import CLOSE, OPEN, RESULT_CLOSE, RESULT_OPEN, Tool, ToolChoice


# ---------------------------------------------------------------------------------------- rendering
@dataclass(frozen=True)
class ToolSupport:
    """What a chat template renders itself: the ``tools`` it is given, an assistant's ``tool_calls``, and
    ``tool`` messages (found by rendering probes: :func:`probe_tool_support`)."""

    tools: bool = False
    calls: bool = False
    results: bool = False


def probe_tool_support(
    render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str],
) -> ToolSupport:
    """Render a few probe conversations with ``render(messages, tools)`` (llama.cpp's way of finding a
    template's capabilities): a part is supported when the probe's marker shows in the text."""
    mark = f"kvtier_probe_{secrets.token_hex(4)}"
    tool = Tool(mark + "_tool", "a probe", {"type": "object", "properties": {"x": {"type": "string"}}})
    user = {"role": "user", "content": "hello"}
    call = {
        "id": "call_probe",
        "type": "function",
        "function": {"name": mark + "_call", "arguments": {"x": "y"}},
    }
    assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
    result = {
        "role": "tool",
        "tool_call_id": "call_probe",
        "name": mark + "_call",
        "content": mark + "_result",
    }

    def shows(messages: list[dict[str, Any]], marker: str) -> bool:
        try:
            return marker in render(messages, [tool.as_openai()])
        except Exception:  # a template that refuses the probe does not support the part
            return False

    return ToolSupport(
        tools=shows([user], tool.name),
        calls=shows([user, assistant], mark + "_call"),
        results=shows([user, assistant, result], mark + "_result"),
    )


def tools_block(tools: list[Tool]) -> str:
    """The generic format's system block: the tools and how to call them."""
    listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\n"
        "You may call one or more of these functions to help with the request. "
        "Their JSON schemas are listed inside <tools></tools> tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        f"To call a function, write a JSON object with its name and arguments inside {OPEN}{CLOSE} tags, "
        "one block per call:\n"
        f'{OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{CLOSE}\n'
        f"Each result comes back inside {RESULT_OPEN}{RESULT_CLOSE} tags."
    )


def call_text(name: str, arguments: str) -> str:
    """One call in the generic format; ``arguments`` (JSON text) goes in as it is when it parses, so the
    text the model wrote renders the same again."""
    try:
        json.loads(arguments)
    except ValueError:
        arguments = json.dumps(arguments, ensure_ascii=False)  # not JSON: a JSON string of it
    return f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}\n{CLOSE}'


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """A call as transformers hands it to a template: arguments as an object where they parse."""
    try:
        arguments: Any = json.loads(call["function"]["arguments"])
    except ValueError:
        arguments = call["function"]["arguments"]
    return {**call, "function": {**call["function"], "arguments": arguments}}


def uses_tools(messages: list[dict[str, Any]], tools: list[Tool] | None) -> bool:
    """Whether a conversation has tools or tool parts (else it renders as it always did)."""
    return bool(tools) or any(
        isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in messages
    )


def prepare_chat(
    messages: list[dict[str, Any]], tools: list[Tool] | None, support: ToolSupport
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and ``tools`` to render a conversation with (``messages`` normalized): what the
    template renders itself goes to it as it is, the rest in the generic format. Without tools and tool
    messages, ``messages`` unchanged and no tools."""
    if not uses_tools(messages, tools):
        return messages, None
    out: list[dict[str, Any]] = []
    if tools and not support.tools:
        block = tools_block(tools)
        if messages and messages[0].get("role") == "system":
            first, *messages = messages
            out.append({**first, "content": f"{first.get('content') or ''}\n\n{block}".lstrip()})
        else:
            out.append({"role": "system", "content": block})
    merging = False  # the last message out is a user turn of generic tool results
    for message in messages:
        if message.get("tool_calls"):
            if support.calls:
                message = {**message, "tool_calls": [_template_call(c) for c in message["tool_calls"]]}
            else:
                texts = [
                    call_text(c["function"]["name"], c["function"]["arguments"])
                    for c in message["tool_calls"]
                ]
                content = "\n".join([message.get("content") or "", *texts]).lstrip("\n")
                message = {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}
        elif message.get("role") == "tool" and not support.results:
            result = f"{RESULT_OPEN}\n{message.get('content') or ''}\n{RESULT_CLOSE}"
            if merging:
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + result}
                continue
            out.append({"role": "user", "content": result})
            merging = True
            continue
        merging = False
        out.append(message)
    return out, [t.as_openai() for t in tools] if tools and support.tools else None


# -------------------------------------------------------------------------------------- constraint
# The arguments' JSON as json.dumps writes it (``{"city": "Paris"}``): no whitespace to wander in.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_COMPOSED = (
    "allOf",
    "anyOf",
    "oneOf",
    "$ref",
    "patternProperties",
    "additionalProperties",
    "unevaluatedProperties",
)


def _closed(schema: Any) -> Any:
    """``schema`` with every object that lists its ``properties`` (and says nothing of other keys, nor
    composes schemas) closed to them (``additionalProperties: false``, as OpenAI's strict mode asks): a
    forced call fills the declared parameters instead of inventing more."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: _closed(v) for k, v in out["properties"].items()}
        if not any(k in out for k in _COMPOSED):
            out["additionalProperties"] = False
    if isinstance(out.get("items"), dict):
        out["items"] = _closed(out["items"])
    return out


def call_grammar(tools: list[Tool], choice: ToolChoice) -> str:
    """Lark (llguidance's dialect) for the calls ``choice`` forces: one or more ``<tool_call>`` blocks
    (required, ``parallel``), or exactly one (required without parallel; the named function), each a JSON
    object ``{"name": "<tool>", "arguments": <matching the tool's schema>}``; the arguments written
    compactly (one space after ``,`` and ``:``) and held to the declared properties (:func:`_closed`)."""
    chosen = [t for t in tools if choice.mode != "function" or t.name == choice.name]
    lines = ['start: call ("\\n" call)*' if choice.mode == "required" and choice.parallel else "start: call"]
    lines.append(
        f"call: {json.dumps(OPEN + chr(10))} ({' | '.join(f'call_{i}' for i in range(len(chosen)))}) "
        f"{json.dumps(chr(10) + CLOSE)}"
    )
    for i, tool in enumerate(chosen):
        head = '{"name": ' + json.dumps(tool.name) + ', "arguments": '
        lines.append(f'call_{i}: {json.dumps(head)} args_{i} "}}"')
        schema = _closed({"type": "object", **tool.parameters})
        schema["x-guidance"] = {**_JSON_STYLE, **(schema.get("x-guidance") or {})}
        lines.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"
