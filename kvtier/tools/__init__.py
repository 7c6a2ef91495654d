"""Tool calls (OpenAI's function tools), the part shared by the server, ``LLM.chat`` and any later API that
maps its own tool blocks to the same calls: torch-free, no HTTP.

::

    tools (OpenAI's JSON)   ─ parse_tools ─────────► [Tool]          ToolError naming the field, e.g.
    tool_choice             ─ parse_tool_choice ───► ToolChoice        param "tools[0].function.name"
    messages (plain dicts)  ─ normalize_messages ──► the same dicts, every call checked; a tool result
                                                     must answer a call of an earlier assistant message
    rendering               ─ prepare_chat ────────► (template messages, template tools): the template's
                                                     own tool format where it has one, else the generic one
    constraint              ─ call_grammar ────────► Lark text for llguidance (tool_choice required / named)
    parsing                 ─ ToolCallParser ──────► text and call events, streamed; parse_tool_calls(text)

**The generic format** (``docs/tools.md``), for chat templates that do not render tools themselves (as
llama.cpp's server does; the tags are Hermes' and Qwen's): a system block lists the tools as JSON inside
``<tools></tools>`` and says how to call one; a call is a JSON object inside tags, one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

An assistant message's calls are rendered the same way after its text (the arguments as the client sent
them back, so a call the model wrote is the same text again and its blocks stay cached); tool results
become user turns, ``<tool_response>\\n...\\n</tool_response>``, consecutive results in one turn. The
block depends on the tools alone, never on ``tool_choice``: a conversation's prefix stays cached whatever
each turn asks. A template that renders tools (it writes the tools it is given: Qwen's, Llama 3.1's...)
gets them as ``tools=`` and the messages as transformers passes them (``tool_calls`` with arguments as
objects, ``tool`` messages), each part it does not render falling back to the generic text.

**Parsing** (``tool_choice`` auto, required or a named function): a ``<tool_call>`` block whose JSON names
a known tool with an object of arguments is a call; anything else stays text. An output that is a bare
JSON call and nothing else (``{"name": ..., "arguments" | "parameters": {...}}``, or a list of them: Llama
3.1's format) is a call too. Streaming, text is held back while it could be the start of ``<tool_call>``
(and whole while it could be a bare JSON call: it starts with ``{`` or ``[{``); a call's arguments stream
as the model writes them once ``{"name": "<tool>", "arguments": {`` is seen. Whitespace next to a call is
dropped.
"""

from kvtier.tools.parser import ToolCall, ToolCallParser, ToolEvent, new_call_id, parse_tool_calls
from kvtier.tools.render import (
    ToolSupport,
    call_grammar,
    call_text,
    prepare_chat,
    probe_tool_support,
    tools_block,
    uses_tools,
)
from kvtier.tools.spec import (
    CLOSE,
    MAX_TOOLS,
    OPEN,
    RESULT_CLOSE,
    RESULT_OPEN,
    Tool,
    ToolChoice,
    ToolError,
    normalize_messages,
    parse_tool_choice,
    parse_tools,
)

__all__ = [
    "CLOSE",
    "MAX_TOOLS",
    "OPEN",
    "RESULT_CLOSE",
    "RESULT_OPEN",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolChoice",
    "ToolError",
    "ToolEvent",
    "ToolSupport",
    "call_grammar",
    "call_text",
    "new_call_id",
    "normalize_messages",
    "parse_tool_calls",
    "parse_tool_choice",
    "parse_tools",
    "prepare_chat",
    "probe_tool_support",
    "tools_block",
    "uses_tools",
]
