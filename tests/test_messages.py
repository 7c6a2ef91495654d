"""Anthropic's Messages API without a model: the request mapped onto the chat route's internals
(``kvtier.server.anthropic``), the answer's blocks, usage and event sequence (``kvtier.server.messages``),
errors in Anthropic's shape from the app while its model "is loading", ``x-api-key``, and the router's
side (the prompt it hashes, its own errors)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvtier.config import ConfigError
from kvtier.outputs import CompletionOutput, RequestOutput
from kvtier.sampling_params import FREE_ANSWER, StructuredOutputs
from kvtier.server.anthropic import CachePrefix, MessagesRequest
from kvtier.server.anthropic_errors import AnthropicError, as_anthropic, authorization_of, presents_key
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.async_engine import EngineDeadError
from kvtier.server.messages import ContentBlocks, MessagesFormatter
from kvtier.server.protocol import APIError, tenant_salt
from kvtier.tools import CLOSE, ToolChoice

MODEL = "test-model"
WEATHER = {
    "name": "get_weather",
    "description": "The weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CLOCK = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
BODY = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
TOOL_LOOP = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}],
    },
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
            {"type": "text", "text": "And tomorrow?"},
        ],
    },
]


def request(**changes: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({**BODY, **changes})


def refused(**changes: Any) -> AnthropicError:
    with pytest.raises(AnthropicError) as info:
        r = request(**changes)
        r.sampling_params(r.chat())
        _ = r.user_id
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


# ------------------------------------------------------------------------------------- the request
def test_a_tool_loop_maps_onto_the_chat_routes_messages() -> None:
    """system blocks joined; a user's text blocks joined; an assistant's text and tool_use as a message
    with tool_calls (input as JSON text); a tool_result as a tool message, the text after it a user turn."""
    chat = request(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=TOOL_LOOP,
        tools=[WEATHER, CLOCK],
    ).chat()
    call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assert chat.conversation == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C", "name": "get_weather"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert [t.name for t in chat.tools] == ["get_weather", "get_time"]
    assert chat.tools[0].parameters == WEATHER["input_schema"] and chat.tools[0].description
    assert chat.choice == ToolChoice("auto") and chat.tool_names == {"get_weather", "get_time"}
    assert chat.cache_prefix is None and chat.num_chars == sum(len(m["content"]) for m in chat.conversation)
    error = [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "no such city", "is_error": True}]
    failed = request(messages=[*TOOL_LOOP[:2], {"role": "user", "content": error}], tools=[WEATHER]).chat()
    assert failed.conversation[-1]["content"] == "Error: no such city"


def test_consecutive_turns_of_one_role_are_one_turn(tmp_path: Any) -> None:
    """As Anthropic's API combines them: two user messages are one user turn (a template that insists on
    alternating roles, Gemma's, renders it), two assistant messages one assistant turn with both calls."""
    from kvtier.tokenizer import GEMMA3_CHAT_TEMPLATE, Tokenizer
    from tests.conftest import write_tiny_tokenizer

    use = {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}}
    messages = [
        {"role": "user", "content": "Weather in Paris? "},
        {"role": "user", "content": [{"type": "text", "text": "And the time?"}]},
        TOOL_LOOP[1],
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": "Thanks."},
    ]
    chat = request(messages=messages, tools=[WEATHER, CLOCK]).chat()
    assert [m["role"] for m in chat.conversation] == ["user", "assistant", "user"]
    assert chat.conversation[0]["content"] == "Weather in Paris? And the time?"
    assert [c["id"] for c in chat.conversation[1]["tool_calls"]] == ["toolu_1", "toolu_2"]
    write_tiny_tokenizer(tmp_path, chat_template=GEMMA3_CHAT_TEMPLATE)
    two_users = request(messages=messages[:2]).chat()
    text, _ = Tokenizer.from_dir(tmp_path).encode_chat(two_users.conversation, **two_users.template_args())
    assert text.count("<start_of_turn>user") == 1


@pytest.mark.parametrize(
    "choice, expected",
    [
        (None, ToolChoice("auto")),
        ({"type": "auto"}, ToolChoice("auto")),
        ({"type": "auto", "disable_parallel_tool_use": True}, ToolChoice("auto", parallel=False)),
        ({"type": "any"}, ToolChoice("required")),
        ({"type": "any", "disable_parallel_tool_use": True}, ToolChoice("required", parallel=False)),
        ({"type": "tool", "name": "get_time"}, ToolChoice("function", "get_time", parallel=False)),
        ({"type": "none"}, ToolChoice("none")),
    ],
)
def test_tool_choice_maps_onto_kvtiers(choice: Any, expected: ToolChoice) -> None:
    r = request(tools=[WEATHER, CLOCK], tool_choice=choice)
    chat = r.chat()
    assert chat.choice == expected
    params = r.sampling_params(chat)
    assert (params.structured_outputs is not None) == expected.constrained  # the calls' grammar
    assert (CLOSE in params.stop) == (expected.mode == "auto" and not expected.parallel)
    assert chat.tool_names is None if expected.mode == "none" else chat.tool_names
    assert request(tool_choice={"type": "auto"}).chat().choice.mode == "none"  # no tools: nothing to call


def test_sampling_parameters() -> None:
    params = request(stop_sequences=["\n\n", "END"], temperature=0.0, top_p=0.5, top_k=3).sampling_params(
        request().chat()
    )
    assert (params.stop, params.temperature, params.top_p, params.top_k, params.max_tokens, params.n) == (
        ["\n\n", "END"],
        0.0,
        0.5,
        3,
        8,
        1,
    )
    default = request().sampling_params(request().chat())
    assert (default.temperature, default.top_p, default.top_k, default.structured_outputs) == (
        1.0,
        1.0,
        0,
        None,
    )
    assert request(metadata={"user_id": "u1"}).user_id == "u1" and request().user_id is None
    assert request(service_tier="auto", thinking=None).chat()  # accepted: one tier here; a null is absent
    prefilled = request(messages=[BODY["messages"][0], {"role": "assistant", "content": "So"}]).chat()
    assert prefilled.continue_final and prefilled.conversation[-1] == {"role": "assistant", "content": "So"}
    assert prefilled.template_args() == {"add_generation_prompt": False, "continue_final_message": True}
    assert request().chat().template_args()["add_generation_prompt"]


def user(*blocks: dict[str, Any]) -> dict[str, Any]:
    """A body change: one user message of these blocks."""
    return {"messages": [{"role": "user", "content": list(blocks)}]}


USE = {"type": "tool_use", "id": "a", "name": "f", "input": "x"}
ASKED = {"messages": [{"role": "assistant", "content": [USE]}, {"role": "user", "content": "x"}]}
EPHEMERAL_X = {"type": "ephemeral", "x": 1}
WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search"}
REFUSED = [
    ({"messages": []}, "messages", "must not be empty"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "non-empty content"),
    (
        {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "Hi"}]},
        "messages[0].content",
        "except for the optional final assistant",
    ),
    (user({"type": "image", "source": {}}), "messages[0].content[0]", "'image'"),
    (user({"type": "document"}), "messages[0].content[0]", "'document'"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", "'user' or 'assistant'"),
    (
        {"messages": [BODY["messages"][0], {"role": "assistant", "content": "So "}]},
        "messages[1]",
        "whitespace",
    ),
    (
        {"messages": [BODY["messages"][0], {"role": "assistant", "content": [{**USE, "input": {}}]}]},
        "messages[1]",
        "holds tool_use",
    ),
    (user({**USE, "input": {}}), "messages[0].content[0]", "'tool_use'"),
    (user({"type": "tool_result", "tool_use_id": "no"}), "messages[0].content[0].tool_use_id", "matches no"),
    (ASKED, "messages[0].content[0].input", "object"),
    (user({"type": "text", "text": "x", "citations": [{}]}), "messages[0].content[0].citations", "citations"),
    (user({"type": "text", "text": "x", "extra": 1}), "messages[0].content[0].extra", "not supported"),
    ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, "cache_control", '"5m" | "1h"'),
    ({"cache_control": {"type": "persistent"}}, "cache_control", "ephemeral"),
    (
        {"system": [{"type": "text", "text": "x", "cache_control": EPHEMERAL_X}]},
        "system[0].cache_control",
        "ttl",
    ),
    ({"system": 5}, "system", "string or a list"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema", "required"),
    ({"tools": [{"name": "a b", "input_schema": {}}]}, "tools[0].name", "tools[0].name must be"),
    (
        {"tools": [{"name": "f", "input_schema": {"type": "array"}}]},
        "tools[0].input_schema",
        "input_schema must",
    ),
    ({"tools": [WEB_SEARCH]}, "tools[0].type", "Anthropic's own tools"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "f"}},
        "tool_choice",
        "'f', which is not in",
    ),
    ({"tool_choice": {"type": "any"}}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", '"type"'),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens", "at least 1024"),
    ({"thinking": {"type": "sometimes"}}, "thinking", "adaptive"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort", "one of"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format", "json_schema"),
    ({"output_config": {"verbosity": 1}}, "output_config", "format"),
    ({"output_format": {"type": "json_schema", "schema": {}}}, "output_format", "output_config.format"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"stop_sequences": [""]}, "stop_sequences", "non-empty"),
    ({"stop_sequences": ["x"] * 17}, "stop_sequences", "at most 16"),
    ({"metadata": {"user_id": 5}}, "metadata.user_id", "string"),
    ({"metadata": {"tags": ["a"]}}, "metadata", "user_id"),
]


@pytest.mark.parametrize("changes, param, words", REFUSED)
def test_what_is_not_supported_or_invalid_is_a_400_naming_it(changes: dict, param: str, words: str) -> None:
    err = refused(**changes)
    assert err.param == param and words in err.message, (err.param, err.message)
    assert err.body() == {"type": "error", "error": {"type": "invalid_request_error", "message": err.message}}


def test_the_last_cache_control_breakpoint_is_found() -> None:
    """Top level or the last block: the whole prompt; a block before: the request cut after it (the
    later messages and blocks gone); a system block: the system text up to it; a tool: the system and the
    tools up to it. Every cache_control is accepted, with or without a ttl."""
    marked = {"type": "ephemeral", "ttl": "1h"}
    assert request(cache_control={"type": "ephemeral"}).chat().cache_prefix == CachePrefix(whole=True)
    last = [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": marked}]}]
    assert request(messages=last).chat().cache_prefix == CachePrefix(whole=True, ttl_s=3600.0)
    loop = json.loads(json.dumps(TOOL_LOOP))
    loop[1]["content"][1]["cache_control"] = {"type": "ephemeral", "ttl": "5m"}
    cut = request(system="S", messages=loop, tools=[WEATHER]).chat().cache_prefix
    assert cut is not None and not cut.whole and [t.name for t in cut.tools] == ["get_weather"]
    assert [m["role"] for m in cut.conversation] == ["system", "user", "assistant"]
    loop = json.loads(json.dumps(TOOL_LOOP))
    loop[2]["content"][0]["content"][0]["cache_control"] = marked  # inside a tool result
    cut = request(messages=loop, tools=[WEATHER]).chat().cache_prefix
    assert cut is not None and [m["role"] for m in cut.conversation] == ["user", "assistant", "tool"]
    system = [{"type": "text", "text": "A", "cache_control": marked}, {"type": "text", "text": "B"}]
    cut = request(system=system, tools=[WEATHER]).chat().cache_prefix
    assert cut == CachePrefix(({"role": "system", "content": "A"},), ttl_s=3600.0)
    tools = [{**WEATHER, "cache_control": marked}, CLOCK]
    cut = request(system="S", tools=tools).chat().cache_prefix
    assert cut is not None and cut.conversation == ({"role": "system", "content": "S"},)
    assert [t.name for t in cut.tools] == ["get_weather"]


def test_every_breakpoint_is_a_prefix_with_its_ttl() -> None:
    """Anthropic's up-to-four breakpoints, in prompt order (tools, system, messages), each kept for its own
    TTL: the 1h system prompt outlives the 5m conversation after it."""
    system = [{"type": "text", "text": "A", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    loop = json.loads(json.dumps(TOOL_LOOP))
    loop[1]["content"][1]["cache_control"] = {"type": "ephemeral"}
    chat = request(system=system, messages=loop, tools=[WEATHER], cache_control={"type": "ephemeral"}).chat()
    assert [(p.whole, p.ttl_s) for p in chat.cache_prefixes] == [
        (False, 3600.0),
        (False, 300.0),
        (True, 300.0),
    ]
    assert chat.cache_prefix is chat.cache_prefixes[-1]
    assert request().chat().cache_prefixes == ()


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "status, code, expected, kind",
    [
        (400, None, 400, "invalid_request_error"),
        (401, "invalid_api_key", 401, "authentication_error"),
        (404, "model_not_found", 404, "not_found_error"),
        (413, "request_too_large", 413, "request_too_large"),
        (408, "request_timeout", 408, "timeout_error"),
        (503, "queue_full", 529, "overloaded_error"),
        (503, "kv_capacity", 529, "overloaded_error"),
        (503, "queue_wait", 529, "overloaded_error"),
        (503, "model_not_ready", 503, "api_error"),
        (500, None, 500, "api_error"),
    ],
)
def test_kvtiers_errors_in_anthropics_shape(status: int, code: str | None, expected: int, kind: str) -> None:
    err = as_anthropic(APIError(status, "what happened", code=code, headers={"Retry-After": "1"}))
    assert (err.status, err.type, err.headers) == (expected, kind, {"Retry-After": "1"})
    assert set(err.body()) == {"type", "error"} and set(err.body()["error"]) == {"type", "message"}
    renamed = as_anthropic(
        APIError(400, "tools[0].function.parameters: bad", param="tools[0].function.parameters")
    )
    assert (renamed.message, renamed.param) == ("tools[0].input_schema: bad", "tools[0].input_schema")


def test_the_key_as_x_api_key_or_bearer() -> None:
    assert presents_key({"x-api-key": "k"}, "k") and presents_key({"authorization": "Bearer k"}, "k")
    assert presents_key({"authorization": "Bearer wrong", "x-api-key": "k"}, "k")
    assert not presents_key({"x-api-key": "wrong"}, "k") and not presents_key({"authorization": "k"}, "k")
    assert not presents_key({}, "k")
    assert authorization_of({"x-api-key": "k", "authorization": "Bearer j"}) == "Bearer k"
    assert authorization_of({"authorization": "Bearer j"}) == "Bearer j" and authorization_of({}) == ""


# -------------------------------------------------------------------------------------- the answer
def output(text: str, delta: str, finish: str | None, stop: str | None = None, **kw: Any) -> RequestOutput:
    completion = CompletionOutput(0, text, list(range(len(text))), finish, stop, text_delta=delta)
    return RequestOutput("r", None, list(range(40)), [completion], finish is not None, **kw)


def outputs_of(pieces: list[str], finish: str = "stop", stop: str | None = None) -> list[RequestOutput]:
    text, outs = "", []
    for i, piece in enumerate(pieces):
        text += piece
        last = i == len(pieces) - 1
        cached = {"num_cached_tokens": 32, "cached_tokens_by_tier": {"device": 16, "host": 16}}
        outs.append(output(text, piece, finish if last else None, stop if last else None, **cached))
    return outs


def run_stream(
    fmt: MessagesFormatter, outs: list[RequestOutput], fail: bool = False
) -> list[tuple[str, dict]]:
    async def feed() -> AsyncIterator[tuple[int, RequestOutput]]:
        for out in outs:
            yield 0, out
        if fail:
            raise EngineDeadError("the engine step failed")

    async def collect() -> list[str]:
        return [chunk async for chunk in fmt.stream(feed(), 1)]

    events = []
    for chunk in asyncio.run(collect()):
        head, data, blank = chunk.split("\n", 2)
        assert head.startswith("event: ") and data.startswith("data: ") and blank == "\n"
        payload = json.loads(data.removeprefix("data: "))
        assert payload["type"] == head.removeprefix("event: ")
        events.append((payload["type"], payload))
    return events


def accumulate(events: list[tuple[str, dict]]) -> dict[str, Any]:
    """What a client builds from the events (as the SDK's stream accumulator does)."""
    message: dict[str, Any] = {}
    partial: dict[int, str] = {}
    for kind, e in events:
        if kind == "message_start":
            message = e["message"]
        elif kind == "content_block_start":
            message["content"].append(dict(e["content_block"]))
        elif kind == "content_block_delta":
            block, delta = message["content"][e["index"]], e["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] += delta["signature"]
            else:
                partial[e["index"]] = partial.get(e["index"], "") + delta["partial_json"]
        elif kind == "content_block_stop" and e["index"] in partial:
            message["content"][e["index"]]["input"] = json.loads(partial[e["index"]])
        elif kind == "message_delta":
            message.update(e["delta"])
            message["usage"].update(e["usage"])
    return message


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    return {**message, "content": [{k: v for k, v in b.items() if k != "id"} for b in message["content"]]}


def test_a_text_answer_streamed_and_whole() -> None:
    fmt = MessagesFormatter(MODEL, None, ["END"], cache_write_end=36)
    outs = outputs_of(["Hel", "lo", " there"])
    events = run_stream(fmt, outs)
    assert [k for k, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert events[2][1]["content_block"] == {"type": "text", "text": ""}
    whole = fmt.response([outs[-1]])
    assert whole == accumulate(events)
    assert whole["content"] == [{"type": "text", "text": "Hello there"}]
    assert (whole["stop_reason"], whole["stop_sequence"], whole["type"], whole["role"]) == (
        "end_turn",
        None,
        "message",
        "assistant",
    )
    assert whole["usage"] == {
        "input_tokens": 4,  # 40 prompt tokens: 32 read from the cache, 4 more up to the breakpoint
        "cache_creation_input_tokens": 4,
        "cache_read_input_tokens": 32,
        "output_tokens": 11,
        "kvtier_cache_read_by_tier": {"device": 16, "host": 16, "disk": 0, "remote": 0},
        "kvtier_retained_input_tokens": 0,
    }


def test_a_repeat_whose_last_block_is_computed_again_creates_nothing() -> None:
    """A 48-token prompt sent again: the cache holds its 3 blocks, the engine reads 2 and computes the
    last again for the logits; the breakpoint at 40 lies in it, and nothing new is written."""
    completion = CompletionOutput(0, "a", [1], "stop", None, text_delta="a")
    held = {"num_cached_tokens": 32, "cached_tokens_by_tier": {"device": 32}}
    for in_cache, written in ((48, 0), (32, 8)):
        out = RequestOutput("r", None, list(range(48)), [completion], True, **held)
        out.num_prompt_tokens_in_cache = in_cache
        usage = MessagesFormatter(MODEL, None, [], cache_write_end=40).response([out])["usage"]
        assert (usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]) == (32, written)
        assert usage["input_tokens"] == 48 - 32 - written


def test_stop_reasons() -> None:
    fmt = MessagesFormatter(MODEL, None, ["END"])
    stopped = fmt.response([outputs_of(["a"], "stop", "END")[-1]])
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")
    assert fmt.response([outputs_of(["a"], "stop", CLOSE)[-1]])["stop_reason"] == "end_turn"
    assert fmt.response([outputs_of(["a"], "length")[-1]])["stop_reason"] == "max_tokens"
    empty = fmt.response([outputs_of([""], "stop")[-1]])
    assert empty["content"] == [] and empty["usage"]["cache_creation_input_tokens"] == 0


def test_a_tool_call_streams_as_a_tool_use_block() -> None:
    """Text, then a call: a text block, then a tool_use block whose input streams as partial_json; the
    stop reason tool_use; the whole answer the same blocks."""
    names = frozenset({"get_weather"})
    fmt = MessagesFormatter(MODEL, names, [])
    pieces = [
        "Sure.",
        "\n<tool_call>\n",
        '{"name": "get_weather", ',
        '"arguments": {"city": ',
        '"Paris"}}',
        "\n</tool_call>",
    ]
    outs = outputs_of(pieces)
    events = run_stream(fmt, outs)
    whole = fmt.response([outs[-1]])
    assert without_ids(whole) == without_ids(accumulate(events))  # a call's id is new each parse
    text, call = whole["content"]
    assert text == {"type": "text", "text": "Sure."}
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_") and call["name"] == "get_weather"
    assert call["input"] == {"city": "Paris"} and whole["stop_reason"] == "tool_use"
    starts = [e["content_block"] for k, e in events if k == "content_block_start"]
    assert starts[1]["id"].startswith("toolu_") and starts[1]["input"] == {}
    assert starts[1] == {**starts[1], "type": "tool_use", "name": "get_weather"}
    deltas = [e["delta"] for k, e in events if k == "content_block_delta" and e["index"] == 1]
    assert len(deltas) > 1 and {d["type"] for d in deltas} == {"input_json_delta"}
    cut = MessagesFormatter(MODEL, names, []).response([outputs_of(pieces[:4], "length")[-1]])
    assert cut["stop_reason"] == "max_tokens" and cut["content"][1]["input"] == {}  # nothing parses yet


def test_content_blocks_are_the_same_fed_whole_or_in_pieces() -> None:
    text = 'A <tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n</tool_call> B'
    whole = ContentBlocks(frozenset({"f"}))
    whole.feed(text)
    whole.finish()
    pieces = ContentBlocks(frozenset({"f"}))
    for ch in text:
        pieces.feed(ch)
    pieces.finish()
    strip = [{k: v for k, v in b.items() if k != "id"} for b in whole.content]
    assert strip == [{k: v for k, v in b.items() if k != "id"} for b in pieces.content]
    assert [b["type"] for b in whole.content] == ["text", "tool_use", "text"] and whole.called


def test_with_a_reasoning_parser_the_thinking_is_a_thinking_block() -> None:
    """--reasoning-parser: the model's <think> block comes back as Anthropic's thinking block (an empty
    signature: kvtier signs nothing), before the answer's text and calls; streamed as thinking_delta and
    signature_delta; the same blocks whole."""
    fmt = MessagesFormatter(MODEL, frozenset({"f"}), [], reasoning_parser="qwen3")
    pieces = [
        "<thi",
        "nk>\nWhy",
        "?</th",
        "ink>\n\nBe",
        "cause.",
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
    ]
    outs = outputs_of(pieces)
    events = run_stream(fmt, outs)
    whole = fmt.response([outs[-1]])
    assert without_ids(whole) == without_ids(accumulate(events))
    thinking, text, call = whole["content"]
    assert thinking == {"type": "thinking", "thinking": "\nWhy?", "signature": ""}
    assert text == {"type": "text", "text": "Because."} and call["name"] == "f"
    kinds = [e["delta"]["type"] for k, e in events if k == "content_block_delta" and e["index"] == 0]
    assert kinds[-1] == "signature_delta" and set(kinds[:-1]) == {"thinking_delta"}
    plain = MessagesFormatter(MODEL, None, []).response([outputs_of(["<think>Hm</think>Hi"])[-1]])
    assert plain["content"] == [{"type": "text", "text": "<think>Hm</think>Hi"}]  # no parser: as written


def test_output_config_holds_the_answer_to_a_schema_and_passes_the_effort() -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}
    r = request(output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"})
    chat = r.chat()
    assert r.sampling_params(chat).structured_outputs == StructuredOutputs(json=schema)
    assert chat.template_args()["template_kwargs"] == {"reasoning_effort": "low"}
    forced = {"tools": [WEATHER], "tool_choice": {"type": "any"}}
    error = refused(output_config={"format": {"type": "json_schema", "schema": schema}}, **forced)
    assert error.param == "output_config.format" and "tool calls" in error.message


def test_thinking_maps_to_the_templates_variable_and_earlier_thinking_is_reasoning() -> None:
    assert request(thinking={"type": "enabled", "budget_tokens": 2048}).chat().thinking.enabled is True
    off = request(thinking={"type": "disabled"}).chat()
    assert off.template_args()["template_kwargs"] == {"enable_thinking": False}
    assert "template_kwargs" not in request().chat().template_args()  # not said: the template's default
    thought = {"type": "thinking", "thinking": "Hm.", "signature": "abc"}
    history = [
        BODY["messages"][0],
        {"role": "assistant", "content": [thought, {"type": "text", "text": "Hi!"}]},
    ]
    chat = request(messages=[*history, {"role": "user", "content": "Again?"}]).chat()
    assert chat.conversation[1] == {"role": "assistant", "content": "Hi!", "reasoning_content": "Hm."}
    redacted = [{"type": "redacted_thinking", "data": "xyz"}, {"type": "text", "text": "Hi!"}]
    chat = request(messages=[history[0], {"role": "assistant", "content": redacted}, history[0]]).chat()
    assert chat.conversation[1] == {"role": "assistant", "content": "Hi!"}


def test_the_thinking_budget_bounds_the_thought_with_a_reasoning_parser() -> None:
    """budget_tokens is the thought's bound where the server splits thinking off (--reasoning-parser),
    and, as Anthropic's, under max_tokens; without a parser the thinking is text and max_tokens bounds all."""
    r = request(max_tokens=4096, thinking={"type": "enabled", "budget_tokens": 2048})
    params = r.sampling_params(r.chat(), "qwen3")
    assert params.thinking_token_budget == 2048
    assert params.structured_outputs == StructuredOutputs(grammar=FREE_ANSWER, reasoning="qwen3")
    assert r.sampling_params(r.chat()).thinking_token_budget is None
    forced = request(max_tokens=4096, tools=[WEATHER], tool_choice={"type": "any"})
    assert forced.sampling_params(forced.chat(), "qwen3").structured_outputs.reasoning == "qwen3"
    error = refused(max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 2048})
    assert error.param == "max_tokens" and "greater than thinking.budget_tokens" in error.message


def test_an_engine_failure_ends_the_stream_with_an_error_event() -> None:
    events = run_stream(MessagesFormatter(MODEL, None, []), outputs_of(["a", "b", "c"])[:2], fail=True)
    kind, error = events[-1]
    assert kind == "error" and error["error"]["type"] == "api_error" and "failed" in error["error"]["message"]


# ------------------------------------------------------------------------- the app, model loading
def app_client(api_key: str | None = None) -> Iterator[TestClient]:
    release = threading.Event()

    def factory():  # noqa: ANN202 - never returns an engine
        release.wait(30)
        raise ConfigError("model not found: 'test'")

    with TestClient(create_app(factory, ServerSettings(model_name=MODEL, api_key=api_key))) as client:
        try:
            yield client
        finally:
            release.set()


def assert_anthropic_error(r: Any, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body == {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}, body
    assert body["error"]["message"]
    return body["error"]["message"]


def test_errors_from_the_app_are_anthropics() -> None:
    for client in app_client():
        post = client.post
        assert "max_tokens" in assert_anthropic_error(
            post("/v1/messages", json={k: v for k, v in BODY.items() if k != "max_tokens"}),
            400,
            "invalid_request_error",
        )
        image = {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}
        assert "'image'" in assert_anthropic_error(
            post("/v1/messages", json={**BODY, "messages": [image]}), 400, "invalid_request_error"
        )
        bad_ttl = {**BODY, "cache_control": {"type": "ephemeral", "ttl": "10m"}}
        assert_anthropic_error(post("/v1/messages", json=bad_ttl), 400, "invalid_request_error")
        unknown = {**BODY, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}
        assert "nope" in assert_anthropic_error(
            post("/v1/messages", json=unknown), 400, "invalid_request_error"
        )
        bad_schema = {
            **BODY,
            "tools": [
                {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}
            ],
        }
        assert "tools[0].input_schema" in assert_anthropic_error(
            post("/v1/messages", json=bad_schema), 400, "invalid_request_error"
        )
        assert_anthropic_error(
            post("/v1/messages", json={**BODY, "model": "claude-x"}), 404, "not_found_error"
        )
        assert_anthropic_error(
            post("/v1/messages", content=b"{", headers={"content-type": "application/json"}),
            400,
            "invalid_request_error",
        )
        assert_anthropic_error(
            post("/v1/messages", content=b"{}", headers={"content-type": "text/plain"}),
            400,
            "invalid_request_error",
        )
        huge = {**BODY, "system": "x" * (5 << 20)}  # over --max-request-bytes: the middleware's 413
        assert "--max-request-bytes" in assert_anthropic_error(
            post("/v1/messages", json=huge), 413, "request_too_large"
        )
        openai_shaped = client.post("/v1/chat/completions", json=huge).json()["error"]
        assert openai_shaped["code"] == "request_too_large"  # OpenAI's shape elsewhere
        r = post("/v1/messages", json=BODY, headers={"anthropic-version": "2023-06-01"})
        assert_anthropic_error(r, 503, "api_error")  # the model is loading
        assert r.headers["retry-after"] == "1"
        assert_anthropic_error(
            post("/v1/messages/count_tokens", json={"model": MODEL, "messages": BODY["messages"]}),
            503,
            "api_error",
        )
        assert_anthropic_error(
            post("/v1/messages/count_tokens", json=BODY), 400, "invalid_request_error"
        )  # max_tokens
        rejected = [line for line in client.get("/metrics").text.splitlines() if "invalid_request" in line]
        assert rejected and float(rejected[-1].split()[-1]) >= 8


def test_the_key_comes_as_x_api_key_or_bearer() -> None:
    for client in app_client(api_key="sekrit"):
        for headers in (
            {},
            {"x-api-key": "wrong"},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "sekrit"},
        ):
            message = assert_anthropic_error(
                client.post("/v1/messages", json=BODY, headers=headers), 401, "authentication_error"
            )
            assert "x-api-key" in message
        for headers in ({"x-api-key": "sekrit"}, {"Authorization": "Bearer sekrit"}):
            assert_anthropic_error(client.post("/v1/messages", json=BODY, headers=headers), 503, "api_error")
        assert (
            client.post("/v1/chat/completions", json=BODY, headers={"x-api-key": "sekrit"}).status_code == 401
        )


# ---------------------------------------------------------------------------------------- the router
def test_the_router_hashes_the_prompt_the_replica_runs(tiny_tokenizer_dir) -> None:  # noqa: ANN001
    """A Messages body gives the token ids of the same conversation sent to chat (tools included), and
    its salt comes from metadata.user_id as chat's from user."""
    from kvtier.router.prompt import CHAT_PATH, MESSAGES_PATH, parse_prompt
    from kvtier.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_tokenizer_dir)
    body = {
        **BODY,
        "system": "Be brief.",
        "messages": TOOL_LOOP,
        "tools": [WEATHER],
        "metadata": {"user_id": "u"},
    }
    chat = MessagesRequest.model_validate(body).chat()
    openai_tools = [t.as_openai() for t in chat.tools]
    same = {"messages": chat.conversation, "tools": openai_tools, "user": "u"}
    for scope in ("shared", "user"):
        mine = parse_prompt(tok, MESSAGES_PATH, body, "Bearer k", scope)
        theirs = parse_prompt(tok, CHAT_PATH, same, "Bearer k", scope)
        assert mine is not None and theirs is not None and mine.token_ids == theirs.token_ids
        assert mine.cache_salt == theirs.cache_salt == tenant_salt("Bearer k", "u", None, scope)
    assert parse_prompt(tok, MESSAGES_PATH, {**body, "thinking": {"type": "enabled"}}) is None
    assert parse_prompt(tok, MESSAGES_PATH, {"messages": []}) is None


def test_the_routers_own_answers_are_anthropics(tiny_tokenizer_dir) -> None:  # noqa: ANN001
    from kvtier.router.app import create_app as router_app
    from kvtier.router.core import RouterSettings

    settings = RouterSettings(replicas=["http://127.0.0.1:9"], api_key="k", model=str(tiny_tokenizer_dir))
    with TestClient(router_app(settings)) as client:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            assert_anthropic_error(
                client.post(path, json=BODY, headers={"x-api-key": "no"}), 401, "authentication_error"
            )
            r = client.post(path, json=BODY, headers={"x-api-key": "k"})
            assert_anthropic_error(r, 503, "api_error")  # no healthy replica
        bad = client.post("/v1/messages", content=b"{", headers={"x-api-key": "k"})
        assert_anthropic_error(bad, 400, "invalid_request_error")
