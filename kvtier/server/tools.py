"""Tool calls on ``/v1/chat/completions``, the HTTP side (the rules are :mod:`kvtier.tools`'):

::

    before the model is needed (tokenizer pool)   check_schemas(): each tool's parameters compile with
                                                  llguidance, else a 400 naming tools[i].function.parameters
    the answer, one JSON body                     message(): {"role", "content", "tool_calls"}; finish
                                                  reason "tool_calls" when the model stopped after calls
    the answer, streamed                          deltas(): OpenAI's chunks, per parser event:
        text                                        {"content": "..."}
        reasoning (kvtier.reasoning.AnswerStream)   {"reasoning_content": "..."}
        a call starts                               {"tool_calls": [{"index", "id", "type": "function",
                                                                     "function": {"name", "arguments": ""}}]}
        more of its arguments                       {"tool_calls": [{"index", "function": {"arguments"}}]}

A call's ``index`` counts the calls of its choice (0, 1, ...), as OpenAI's do.
"""

from __future__ import annotations

from typing import Any

from kvtier.server.protocol import bad_request
from kvtier.tools import Tool, ToolCall, ToolCallParser, ToolError, ToolEvent
from kvtier.worker.structured import check_tool_schemas


def check_schemas(tools: list[Tool]) -> None:
    """400 naming ``tools[i].function.parameters`` when a tool's schema cannot be compiled (a few ms a
    tool: run it on the tokenizer pool)."""
    try:
        check_tool_schemas(tools)
    except ToolError as exc:
        raise bad_request(exc, exc.param) from None


def finish_reason(calls: list[ToolCall], reason: str | None) -> str | None:
    """OpenAI's ``tool_calls`` when the model stopped after calling (a cut call keeps ``length``)."""
    return "tool_calls" if calls and reason == "stop" else reason


def message(text: str, names: frozenset[str]) -> tuple[dict[str, Any], list[ToolCall]]:
    """A whole output as the assistant's message: its text outside the calls, and the calls."""
    parser = ToolCallParser(names)
    parser.feed(text)
    parser.finish()
    body: dict[str, Any] = {"role": "assistant", "content": parser.content}
    if parser.calls:
        body["tool_calls"] = [call.as_openai() for call in parser.calls]
    return body, parser.calls


def deltas(events: list[ToolEvent]) -> list[dict[str, Any]]:
    """The chat chunks' ``delta`` objects of a parser's events, one per event."""
    out: list[dict[str, Any]] = []
    for event in events:
        if event.kind == "text":
            out.append({"content": event.text})
        elif event.kind == "reasoning":
            out.append({"reasoning_content": event.text})
        elif event.kind == "call":
            function = {"name": event.name, "arguments": ""}
            call = {"index": event.index, "id": event.call_id, "type": "function", "function": function}
            out.append({"tool_calls": [call]})
        else:
            out.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
    return out
