"""Tool calls end to end on the real default model: the official ``openai`` client runs the two-step tool
loop against ``kvtier serve`` (uvicorn on a thread of this process), streamed and not; a forced call's
arguments validate against the tool's schema; ``auto`` parses a call the model wrote (forced here through
``guided_regex``, since SmolLM2-135M does not call tools on its own); ``none`` parses nothing;
``LLM.chat`` gives the server's calls offline; LangChain's ``ChatOpenAI.bind_tools`` reads the calls."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from openai import OpenAI

from kvtier import LLM, SamplingParams
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.serve import BackgroundServer, serve_in_thread

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ENGINE = dict(kv_device_blocks=256, max_num_seqs=8, num_threads=1)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = (  # guided_regex: text, then a call
    r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    threads = torch.get_num_threads()
    srv = serve_in_thread(create_app(lambda: LLM(**ENGINE).engine, ServerSettings(model_name=MODEL)))
    srv.wait_ready()
    yield srv
    srv.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def assert_valid(name: str, arguments: str) -> dict[str, Any]:
    """``arguments`` parse and match the tool's schema (jsonschema when installed, and by hand)."""
    value = json.loads(arguments)
    schema = SCHEMAS[name]
    try:
        import jsonschema
    except ImportError:
        pass
    else:
        jsonschema.validate(value, schema)
    kinds = {"string": str, "integer": int}
    assert isinstance(value, dict) and set(schema["required"]) <= set(value) <= set(schema["properties"])
    for key, item in value.items():
        spec = schema["properties"][key]
        assert isinstance(item, kinds[spec["type"]]) and not isinstance(item, bool), (key, item)
        assert "enum" not in spec or item in spec["enum"], (key, item)
        assert spec.get("minimum", item) <= item <= spec.get("maximum", item), (key, item)
        assert len(item) >= spec.get("minLength", 0) if isinstance(item, str) else True
    return value


def test_a_two_step_tool_loop(client: OpenAI) -> None:
    """required (one call): the call names a tool, its arguments validate, content is null, the finish
    reason tool_calls; the SDK's own message goes back with the result, and the next turn answers in
    text, its prompt cached up to the call the model wrote (the call renders as the same text)."""
    messages: list[Any] = list(QUESTION)
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in SCHEMAS
    assert_valid(call.function.name, call.function.arguments)
    messages.append(choice.message)  # the SDK object itself, as the OpenAI cookbook does
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 18})})
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=30
    )
    assert (
        second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.tool_calls is None
    )
    assert second.choices[0].message.content
    turn = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= turn // 16 * 16  # block size 16


def test_a_streamed_named_call_equals_the_whole_one(client: OpenAI) -> None:
    """A named function, streamed: the call's id, type and name come first with empty arguments, then
    the arguments in pieces that add up to the non-streamed call's; the finish reason is tool_calls."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=60
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice=named,
            temperature=0,
            max_tokens=60,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant" and not any(d.content for d in deltas)
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    head, pieces = calls[0], calls[1:]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert len(pieces) > 1 and all(p.index == 0 and p.id is None and p.function.name is None for p in pieces)
    arguments = "".join(p.function.arguments for p in pieces)
    assert arguments == whole.choices[0].message.tool_calls[0].function.arguments
    assert_valid("get_weather", arguments)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    # the loop's second step, streamed: text comes back
    messages = [*QUESTION, whole.choices[0].message]
    messages.append(
        {"role": "tool", "tool_call_id": whole.choices[0].message.tool_calls[0].id, "content": "18 C"}
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=20, stream=True
    )
    answer = [c.choices[0] for c in stream]
    assert "".join(c.delta.content or "" for c in answer) and not any(c.delta.tool_calls for c in answer)
    assert answer[-1].finish_reason in ("stop", "length")


def test_required_with_parallel_calls_validates_every_finished_call(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=80
    )
    calls = r.choices[0].message.tool_calls
    finished = calls[:-1] if r.choices[0].finish_reason == "length" else calls
    assert finished and len({c.id for c in calls}) == len(calls)
    for call in finished:
        assert_valid(call.function.name, call.function.arguments)


def test_auto_parses_a_call_the_model_writes(client: OpenAI) -> None:
    """auto: the output is free; here guided_regex makes the model write text and a call, which come
    back as content and tool_calls (and streamed: the text, then the call)."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=[WEATHER],
        temperature=0,
        max_tokens=60,
        extra_body={"guided_regex": FORCED},
    )
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "Sure."
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert assert_valid("get_weather", message.tool_calls[0].function.arguments)["unit"] == "celsius"
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            tools=[WEATHER],
            temperature=0,
            max_tokens=60,
            stream=True,
            extra_body={"guided_regex": FORCED},
        )
    )
    kinds = [
        "text" if c.choices[0].delta.content else "call"
        for c in chunks[1:]
        if c.choices[0].delta.model_dump(exclude_none=True)
    ]
    assert kinds[0] == "text" and set(kinds[kinds.index("call") :]) == {"call"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Sure."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_none_renders_the_tools_and_parses_nothing(client: OpenAI) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12)
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=12
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 100  # the tools were rendered
    written = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_tokens=60,
        extra_body={"guided_regex": FORCED},
    )
    assert written.choices[0].message.content.startswith("Sure.\n<tool_call>\n{")  # left as text
    assert written.choices[0].message.tool_calls is None and written.choices[0].finish_reason == "stop"


def test_llm_chat_gives_the_servers_calls_offline(client: OpenAI, server: BackgroundServer) -> None:
    llm = LLM(**ENGINE)
    params = SamplingParams(temperature=0, max_tokens=60)
    out = llm.chat(QUESTION, params, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)[
        0
    ].outputs[0]
    served = (
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=60,
        )
        .choices[0]
        .message.tool_calls[0]
    )
    (call,) = out.tool_calls
    assert (call.name, call.arguments) == (served.function.name, served.function.arguments)
    assert out.content is None and out.text.startswith("<tool_call>\n") and params.structured_outputs is None
    plain = llm.chat(QUESTION, params, tools=TOOLS, tool_choice="none")[0].outputs[0]
    assert plain.tool_calls is None and plain.content is None and plain.text


def test_langchain_bind_tools_reads_the_calls(server: BackgroundServer) -> None:
    try:
        import langchain_openai  # the dev extra installs it
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("langchain-openai is not installed (pip install -e '.[dev]')")
    chat_model = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        model=MODEL,
        temperature=0,
        max_tokens=60,
        max_retries=0,
    )
    bound = chat_model.bind_tools([WEATHER], tool_choice="required", parallel_tool_calls=False)
    reply = bound.invoke("What is the weather in Paris?")
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert_valid("get_weather", json.dumps(call["args"]))


def test_tokenize_counts_the_tools_block_as_the_chat_route_does(
    client: OpenAI, server: BackgroundServer
) -> None:
    """``/tokenize`` with ``tools`` renders them as the chat route does: its count is the prompt_tokens
    of the same chat request, and more than without them; a bad tool is a 400 naming it."""
    import httpx

    answer = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=1,  # type: ignore[arg-type]
    )
    with_tools = httpx.post(server.url + "/tokenize", json={"messages": QUESTION, "tools": TOOLS}).json()
    without = httpx.post(server.url + "/tokenize", json={"messages": QUESTION}).json()
    assert answer.usage is not None and with_tools["count"] == answer.usage.prompt_tokens > without["count"]
    bad = httpx.post(server.url + "/tokenize", json={"messages": QUESTION, "tools": [{"type": "function"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].function"
