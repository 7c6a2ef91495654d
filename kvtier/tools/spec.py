"""Tools, tool_choice and the tool parts of chat messages, checked (OpenAI's shapes): :class:`ToolError`
names the field that is wrong, as the server's 400 does (``tools[0].function.parameters``)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from kvtier.config import ConfigError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function name
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolError(ConfigError):
    """Bad tools, tool_choice or tool messages; ``param`` names the field (``tools[0].function.name``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# ------------------------------------------------------------------------------------- the request
@dataclass(frozen=True)
class Tool:
    """One function tool: its name, description and the JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's ``{"type": "function", "function": {...}}`` (what chat templates take as ``tools``)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


Mode = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True)
class ToolChoice:
    """``none``: no call is parsed; ``auto``: the model may call; ``required``: it must call (one or more
    with ``parallel``); ``function``: it must call ``name``, once."""

    mode: Mode = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        """The output is held to the call syntax (llguidance): required or a named function."""
        return self.mode in ("required", "function")


def parse_tools(raw: Any) -> list[Tool]:
    """OpenAI's ``tools`` (None or [] for none) as :class:`Tool` s; ToolError naming the bad field."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ToolError('tools must be a list of {"type": "function", "function": {...}} objects', "tools")
    if len(raw) > MAX_TOOLS:
        raise ToolError(f"tools holds at most {MAX_TOOLS} tools, got {len(raw)}", "tools")
    tools: list[Tool] = []
    for i, entry in enumerate(raw):
        tool = _parse_tool(entry, f"tools[{i}]")
        if any(t.name == tool.name for t in tools):
            raise ToolError(
                f"tools[{i}]: the function name '{tool.name}' is given twice", f"tools[{i}].function.name"
            )
        tools.append(tool)
    return tools


def _parse_tool(entry: Any, at: str) -> Tool:
    if not isinstance(entry, dict):
        raise ToolError(f'{at} must be an object {{"type": "function", "function": {{...}}}}', at)
    if entry.get("type") != "function":
        raise ToolError(f"{at}.type must be 'function'", f"{at}.type")
    function = entry.get("function")
    if not isinstance(function, dict):
        raise ToolError(
            f'{at}.function must be an object {{"name": ..., "parameters": {{...}}}}', f"{at}.function"
        )
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolError(
            f"{at}.function.name must be 1 to 64 letters, digits, underscores or dashes",
            f"{at}.function.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{at}.function.description must be a string", f"{at}.function.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = dict(EMPTY_PARAMETERS)
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ToolError(
            f"{at}.function.parameters must be a JSON schema of an object (type 'object')",
            f"{at}.function.parameters",
        )
    return Tool(name, description, parameters)


def parse_tool_choice(raw: Any, tools: list[Tool], parallel: bool = True) -> ToolChoice:
    """OpenAI's ``tool_choice``: ``"none"``, ``"auto"`` (the default with tools), ``"required"`` or
    ``{"type": "function", "function": {"name": ...}}``. Any but ``"none"`` needs tools."""
    if raw is None:
        return ToolChoice("auto" if tools else "none", parallel=parallel)
    if raw == "none":
        return ToolChoice("none", parallel=parallel)
    if raw in ("auto", "required"):
        if not tools:
            raise ToolError(f"tool_choice '{raw}' needs tools", "tool_choice")
        return ToolChoice(raw, parallel=parallel)
    function = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ToolError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if not any(t.name == name for t in tools):
        shown = name if len(name) <= 64 else name[:64] + "..."
        raise ToolError(f"tool_choice names the function '{shown}', which is not in tools", "tool_choice")
    return ToolChoice("function", name, parallel=False)


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages (``content`` already text) with their tool parts checked and in one shape: an
    assistant's ``tool_calls`` as ``{"id", "type": "function", "function": {"name", "arguments": <JSON
    text>}}``, a ``tool`` message's ``tool_call_id`` answering one of them (its ``name`` added)."""
    calls: dict[str, str] = {}  # id -> function name, of the calls so far
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if message.get("tool_calls") and role == "assistant":
            normalized = [
                _normalize_call(c, f"messages[{i}].tool_calls[{j}]")
                for j, c in enumerate(message["tool_calls"])
            ]
            calls.update((c["id"], c["function"]["name"]) for c in normalized)
            message = {**message, "content": message.get("content") or "", "tool_calls": normalized}
        elif message.get("tool_calls"):
            raise ToolError(
                f"messages[{i}]: only assistant messages carry tool_calls", f"messages[{i}].tool_calls"
            )
        elif "tool_calls" in message:
            message = {k: v for k, v in message.items() if k != "tool_calls"}
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in calls:
                shown = (
                    call_id if not isinstance(call_id, str) or len(call_id) <= 64 else call_id[:64] + "..."
                )
                raise ToolError(
                    f"messages[{i}] has role 'tool': its tool_call_id {shown!r} matches no tool call of an "
                    "earlier assistant message",
                    f"messages[{i}].tool_call_id",
                )
            message = {**message, "name": calls[call_id]}
        out.append(message)
    return out


def _normalize_call(call: Any, at: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise ToolError(f'{at} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', at)
    call_id, name, arguments = call.get("id"), function.get("name"), function.get("arguments", "{}")
    if not isinstance(call_id, str) or not call_id:
        raise ToolError(f"{at}.id must be a non-empty string", f"{at}.id")
    if not isinstance(name, str) or not name:
        raise ToolError(f"{at}.function.name must be a non-empty string", f"{at}.function.name")
    if isinstance(arguments, dict):  # some clients send the object itself
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise ToolError(f"{at}.function.arguments must be a JSON string", f"{at}.function.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
