"""OpenAI's Responses API (``POST /v1/responses``): the request mapped onto a chat completion, the answer
built as output items, and end to end on the real default model with the official ``openai`` SDK,
directly and through ``kvtier router``: the same greedy text as chat completions, streamed and not; a
two-step tool loop; cached input tokens on a repeated prompt; refusals naming the Responses field."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from kvtier.router.app import create_app as router_app
from kvtier.router.core import RouterSettings
from kvtier.router.prompt import CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH, parse_prompt
from kvtier.server import responses_background as background
from kvtier.server.api_errors import APIError
from kvtier.server.app import ServerSettings
from kvtier.server.async_engine import EngineDeadError
from kvtier.server.response_items import OutputItems
from kvtier.server.responses_api import ResponsesRequest, in_responses_names
from kvtier.server.responses_route import reasoning_tokens
from kvtier.server.serve import BackgroundServer, serve_in_thread
from tests.served import served_llm

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def chat_of(**body: Any) -> Any:
    with in_responses_names():
        return ResponsesRequest.model_validate({"model": MODEL, **body}).chat()


# ------------------------------------------------------------------------------------ the request
def test_a_tool_loop_maps_onto_chat_messages() -> None:
    """instructions first as system; developer is system; text parts joined; consecutive function calls
    one assistant message (a reasoning item before them its reasoning_content); outputs tool messages."""
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    chat = chat_of(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Use tools."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Paris "},
                    {"type": "input_text", "text": "and Rome?"},
                ],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Both."}],
            },
            call,
            {**call, "call_id": "call_2", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
            {"type": "function_call_output", "call_id": "call_2", "output": "21 C"},
        ],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=7,
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        reasoning={"effort": "low"},
        prompt_cache_retention="24h",
    )
    conversation = chat.conversation()
    assert [m["role"] for m in conversation] == ["system", "system", "user", "assistant", "tool", "tool"]
    assert conversation[2]["content"] == "Paris and Rome?"
    assert [c["id"] for c in conversation[3]["tool_calls"]] == ["call_1", "call_2"]
    assert conversation[3]["reasoning_content"] == "Both."  # the reasoning item before the calls
    assert [m.get("tool_call_id") for m in conversation[4:]] == ["call_1", "call_2"]
    tools, choice = chat.tool_request()
    assert [t.name for t in tools] == ["get_weather"] and choice.mode == "function"
    assert chat.max_tokens == 7 and chat.response_format["json_schema"]["name"] == "w"
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"} and chat.retention
    assert chat_of(input="Hi").conversation() == [{"role": "user", "content": "Hi"}]


REFUSED = [
    ({"background": True, "store": False}, "background", "store: true"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "'item_reference'"),  # unresolved
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0]",
        "text parts",
    ),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "user, assistant"),
    ({"input": []}, "input", "must not be empty"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "'web_search'"),
    ({"tools": [{**WEATHER, "name": "a b"}]}, "tools[0].name", "tools[0].name"),
    ({"text": {"format": {"type": "xml"}}}, "text.format", "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be at least 1"),
    (
        {"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
        "input[0].call_id",
        "nope",
    ),
    (
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "name": "f", "arguments": "{}"},
            ]
        },
        "input[1].call_id",
        "non-empty",
    ),
    ({"top_logprobs": 3}, "top_logprobs", "not supported"),
]


@pytest.mark.parametrize(("change", "param", "words"), REFUSED)
def test_what_is_wrong_or_unsupported_names_the_responses_field(change: dict, param: str, words: str) -> None:
    with pytest.raises(APIError) as info, in_responses_names():  # as the route runs them
        chat = chat_of(**{"input": "hi", **change})
        chat.sampling_params()
        chat.conversation()
        chat.tool_request()
    assert info.value.status == 400 and info.value.param == param and words in info.value.message


def test_the_router_hashes_the_prompt_the_replica_runs(tiny_tokenizer_dir) -> None:  # noqa: ANN001
    from kvtier.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_tokenizer_dir)
    body = {"input": [{"role": "user", "content": "Hello"}], "instructions": "Be brief."}
    prompt = parse_prompt(tok, RESPONSES_PATH, body)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert prompt is not None and prompt.token_ids == tok.encode_chat(messages)[1]
    assert parse_prompt(tok, RESPONSES_PATH, {"input": 5}) is None  # the replica answers its own 400
    continued = {**body, "previous_response_id": "resp_x"}  # its stored turns are the replica's to add
    assert parse_prompt(tok, RESPONSES_PATH, continued) is None
    chat = {"messages": messages, "truncate_prompt_tokens": 5}  # chat and completions cut as the replica
    assert parse_prompt(tok, CHAT_PATH, chat).token_ids == tok.encode_chat(messages)[1][-5:]
    cut = parse_prompt(
        tok, COMPLETIONS_PATH, {"prompt": [[5, 6, 7, 8], [1, 2, 3]], "truncate_prompt_tokens": 2}
    )
    assert cut is not None and cut.token_ids == [7, 8] and cut.more == ([2, 3],)
    assert parse_prompt(tok, CHAT_PATH, {**chat, "truncate_prompt_tokens": -1}) is None  # its context decides


# ------------------------------------------------------------------------------------ the answer
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("parser", [None, "qwen3"])
def test_output_items_are_the_same_fed_whole_or_in_pieces(parser: str | None) -> None:
    text = "<think>Rain?</think>\n\nLet me check." + CALL
    whole = OutputItems(frozenset({"get_weather"}), parser)
    whole.feed(text)
    whole.finish()
    pieces = OutputItems(frozenset({"get_weather"}), parser)
    events = [e for i in range(0, len(text), 3) for e in pieces.feed(text[i : i + 3])] + pieces.finish()
    strip = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in whole.items]
    assert strip == [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in pieces.items]
    kinds = [item["type"] for item in whole.items]
    assert kinds == (["reasoning"] if parser else []) + ["message", "function_call"]
    assert whole.items[-1]["arguments"] == '{"city": "Paris"}' and whole.called
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == ("" if parser else "<think>Rain?</think>\n\n") + "Let me check."
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == list(range(len(kinds)))


def test_reasoning_tokens_are_the_output_tokens_up_to_the_closing_tag() -> None:
    """One token a character here: the count is where ``</think>`` ends; all of them when it never came."""
    decode = lambda ids: "".join(map(chr, ids))  # noqa: E731
    text = "<think>Hm.</think>\n\nHi"
    assert reasoning_tokens(decode, [ord(c) for c in text], text) == len("<think>Hm.</think>")
    assert reasoning_tokens(decode, [ord(c) for c in "Hm, wh"], "Hm, wh") == 6


# ------------------------------------------------------------------------------------- served
@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    with served_llm(ServerSettings(model_name=MODEL)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


QUESTION = [{"role": "user", "content": "Say hello in one short sentence."}]


@pytest.mark.slow
def test_the_same_answer_as_chat_streamed_and_not(client: OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0)
    want = chat.choices[0].message.content
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=40, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == want
    assert r.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    assert (
        r.usage.input_tokens == chat.usage.prompt_tokens
        and r.usage.output_tokens == chat.usage.completion_tokens
    )
    assert r.usage.input_tokens_details.cached_tokens > 0  # the same prompt again: from the cache
    assert sum(r.usage.kvtier["cached_tokens_by_tier"].values()) == r.usage.input_tokens_details.cached_tokens
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=40, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events))) and events[0].type == "response.created"
    assert (
        "".join(e.delta for e in events if e.type == "response.output_text.delta")
        == want
        == final.output_text
    )
    cut = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in cut.output] == ["incomplete"] and r.output[-1].status == (
        "completed" if r.status == "completed" else "incomplete"
    )


@pytest.mark.slow
def test_a_two_step_tool_loop(client: OpenAI) -> None:
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(
        model=MODEL, input=question, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60, temperature=0,
    )  # fmt: skip
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and "city" in call.arguments
    back = [
        *question,
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"},
    ]
    second = client.responses.create(
        model=MODEL, input=back, tools=[WEATHER], tool_choice="none", max_output_tokens=30, temperature=0,
        extra_body={"diagnostics": {"previous_response_id": first.id}},
    )  # fmt: skip
    assert second.output_text and second.usage.input_tokens_details.cached_tokens > 0
    why = second.usage.kvtier["cache_miss_reason"]  # against the first step: its prompt, then more
    assert why["type"] == "none" and why["cached_tokens"] == second.usage.input_tokens_details.cached_tokens


@pytest.mark.slow
def test_refusals_and_stored_responses_through_the_sdk_and_the_router(
    server: BackgroundServer, client: OpenAI
) -> None:
    with pytest.raises(NotFoundError, match="Previous response with id"):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    with pytest.raises(NotFoundError):
        client.responses.retrieve("resp_1")
    counted = httpx.post(server.url + "/v1/responses/input_tokens", json={"model": MODEL, "input": QUESTION})
    direct = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=1)
    assert counted.json() == {"object": "response.input_tokens", "input_tokens": direct.usage.input_tokens}
    router = serve_in_thread(router_app(RouterSettings(replicas=[server.url], poll_interval=0.2)))  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 60
        while httpx.get(router.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the router found no healthy replica"
            time.sleep(0.1)
        routed = OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        direct = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0)
        via = routed.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0)
        assert via.output_text == direct.output_text
        through = httpx.post(router.url + "/v1/responses/input_tokens", json={"input": QUESTION}).json()
        assert through["input_tokens"] == direct.usage.input_tokens
        with pytest.raises(BadRequestError, match="web_search"):
            routed.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
        # a conversation through the router: continued on the replica that keeps it, read back there
        then = routed.responses.create(
            model=MODEL,
            input="And in French?",
            previous_response_id=via.id,
            max_output_tokens=12,
            temperature=0,
        )
        assert then.previous_response_id == via.id and then.usage.input_tokens_details.cached_tokens > 0
        assert routed.responses.retrieve(then.id).output_text == then.output_text
        assert [i.id for i in routed.responses.input_items.list(then.id, order="asc")] == [
            i.id for i in client.responses.input_items.list(then.id, order="asc")
        ]
        routed.responses.delete(then.id)
        with pytest.raises(NotFoundError):
            client.responses.retrieve(then.id)
    finally:
        router.stop()


@pytest.mark.slow
def test_story_a_conversation_continued_by_previous_response_id(
    server: BackgroundServer, client: OpenAI
) -> None:
    """A user asks, then asks again naming the first response: the server puts the stored turn before
    the new input (its instructions given again, as OpenAI's do not carry over), the answer equals the
    whole conversation sent inline, and the first turn's blocks are reused."""
    first = client.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input="Name a colour.",
        max_output_tokens=12,
        temperature=0,
    )
    assert first.store is True and client.responses.retrieve(first.id).output_text == first.output_text
    then = client.responses.create(
        model=MODEL, instructions="Answer briefly.", input="And another one?", previous_response_id=first.id,
        max_output_tokens=12, temperature=0,
    )  # fmt: skip
    inline = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another one?"},
    ]
    whole = client.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input=inline,
        max_output_tokens=12,
        temperature=0,
        store=False,
    )
    assert then.output_text == whole.output_text and then.usage.input_tokens == whole.usage.input_tokens
    assert then.usage.input_tokens_details.cached_tokens > 0
    assert whole.store is False
    with pytest.raises(NotFoundError):
        client.responses.retrieve(whole.id)  # store: false keeps nothing
    items = client.responses.input_items.list(then.id, order="asc")  # the stored turn, then the new input
    assert [(i.type, i.role) for i in items.data] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    newest = client.responses.input_items.list(then.id, limit=1)
    assert newest.data[0].id == items.data[-1].id and newest.has_more
    rest = client.responses.input_items.list(then.id, limit=5, after=newest.data[0].id)
    assert [i.id for i in rest.data] == [i.id for i in items.data[:2]][::-1] and not rest.has_more
    other = httpx.get(
        server.url + f"/v1/responses/{then.id}", headers={"Authorization": "Bearer someone-else"}
    )
    assert other.status_code == 404  # another key's request: not found
    client.responses.delete(first.id)
    with pytest.raises(NotFoundError, match="Previous response with id"):
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id, max_output_tokens=2)
    assert client.responses.retrieve(then.id).output_text == then.output_text  # stored whole, no chain


@pytest.mark.slow
def test_story_a_conversation_rebuilt_from_item_references(server: BackgroundServer, client: OpenAI) -> None:
    """A client that keeps its own conversation sends earlier turns as ``item_reference``s to the stored
    items (their ids name the response that holds them): the answer equals the conversation sent inline,
    the new response stores the items themselves, and an id that names nothing, or another key's item,
    is a 400 naming the reference."""
    first = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=12, temperature=0)
    (asked,) = client.responses.input_items.list(first.id).data
    (answer,) = first.output
    refs = [{"type": "item_reference", "id": asked.id}, {"type": "item_reference", "id": answer.id}]
    follow_up = {"role": "user", "content": "And another one?"}
    then = client.responses.create(
        model=MODEL,
        input=[*refs, follow_up],
        max_output_tokens=12,
        temperature=0,  # type: ignore[list-item]
    )
    inline = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": first.output_text},
        follow_up,
    ]
    whole = client.responses.create(
        model=MODEL, input=inline, max_output_tokens=12, temperature=0, store=False
    )
    assert then.output_text == whole.output_text and then.usage.input_tokens == whole.usage.input_tokens
    assert then.usage.input_tokens_details.cached_tokens > 0
    stored = client.responses.input_items.list(then.id, order="asc").data
    assert [i.id for i in stored[:2]] == [asked.id, answer.id] and stored[1].type == "message"
    for bad in ("msg_nothing", answer.id[:-1] + ("0" if answer.id[-1] != "0" else "1")):
        with pytest.raises(BadRequestError, match="no stored item") as refused:
            client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": bad}])  # type: ignore[list-item]
        assert refused.value.body["param"] == "input[0].id"
    other = httpx.post(
        server.url + "/v1/responses",
        json={"model": MODEL, "input": refs},
        headers={"Authorization": "Bearer someone-else"},
    )
    assert other.status_code == 400 and other.json()["error"]["param"] == "input[0].id"


def until_status(client: OpenAI, response_id: str, statuses: tuple[str, ...], timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while (polled := client.responses.retrieve(response_id)).status not in statuses:
        assert time.monotonic() < deadline, f"{response_id} stayed {polled.status}"
        time.sleep(0.05)
    return polled


LONG = {"format": {"type": "json_schema", "name": "numbers", "strict": True,  # at least ~600 tokens
                   "schema": {"type": "array", "items": {"type": "integer"}, "minItems": 300}}}  # fmt: skip


@pytest.mark.slow
def test_story_a_background_response_is_polled_and_another_cancelled(
    server: BackgroundServer, client: OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``background: true``: the POST answers at once, queued; polling reads it in progress, then the
    answer a foreground request gives. A long one is cancelled midway: it stays cancelled with its output
    so far, a second cancel answers the same, and a foreground response cannot be cancelled. One the
    engine ends with an error (as a shutdown past its grace does) reads failed, with the error."""
    queued = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=40, temperature=0, background=True
    )
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = until_status(client, queued.id, ("completed", "incomplete"))
    foreground = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=40, temperature=0)
    assert (
        done.output_text == foreground.output_text
        and done.usage.output_tokens == foreground.usage.output_tokens
    )
    assert done.background is True and foreground.background is False
    monkeypatch.setattr(background, "LEASE_S", 0.6)  # renewed every 0.2 s while it runs
    long = client.responses.create(
        model=MODEL, input="Count.", text=LONG, max_output_tokens=2000, background=True
    )  # type: ignore[arg-type]
    running = until_status(client, long.id, ("in_progress",))
    assert running.usage is None
    leases = [running.kvtier["lease_until"]]  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while len(leases) < 3:  # renewed as it runs, with its output so far
        assert time.monotonic() < deadline, f"the lease was not renewed: {leases}"
        time.sleep(0.1)
        if (polled := client.responses.retrieve(long.id)).kvtier["lease_until"] > leases[-1]:  # type: ignore[attr-defined]
            leases.append(polled.kvtier["lease_until"])  # type: ignore[attr-defined]
    assert polled.status == "in_progress" and polled.output
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.output and cancelled.output_text.startswith("[")
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).model_dump() == client.responses.retrieve(long.id).model_dump()
    with pytest.raises(BadRequestError, match="background: true"):
        client.responses.cancel(foreground.id)
    with pytest.raises(BadRequestError, match="store: true"):
        client.responses.create(model=MODEL, input="x", background=True, store=False)
    doomed = client.responses.create(
        model=MODEL, input="Count.", text=LONG, max_output_tokens=2000, background=True
    )  # type: ignore[arg-type]
    until_status(client, doomed.id, ("in_progress",))
    engine, loop = server.app.state.engine, server.server._loop
    loop.call_soon_threadsafe(engine.abort_all, EngineDeadError("the engine stopped (a test)"))  # type: ignore[union-attr]
    failed = until_status(client, doomed.id, ("failed",))
    assert failed.error.code == "server_error" and "(a test)" in failed.error.message


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: "):
            yield json.loads(line[6:])


@pytest.mark.slow
def test_story_a_streamed_background_response_is_followed_again_after_its_client_left(
    server: BackgroundServer, client: OpenAI
) -> None:
    """``background`` with ``stream``: the client reads a few events and leaves; the run goes on. It comes
    back with ``starting_after`` and gets every later event, in order, to the end: the deltas of both
    parts are the stored answer. A response made without them has no events to stream (400)."""
    short = {
        "format": {
            **LONG["format"],
            "schema": {"type": "array", "items": {"type": "integer"}, "minItems": 40, "maxItems": 40},
        }
    }
    body = {
        "model": MODEL,
        "input": "Count.",
        "text": short,
        "max_output_tokens": 1000,
        "background": True,
        "stream": True,
    }
    key = {"Authorization": "Bearer unused"}  # the client's: the same owner
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers=key, timeout=120) as first:
        events = sse_events(first.iter_lines())
        seen = [next(events) for _ in range(4)]
    assert [e["type"] for e in seen] == [
        "response.created", "response.queued", "response.in_progress", "response.output_item.added"
    ] and seen[0]["response"]["status"] == "queued"  # fmt: skip
    rid, last = seen[0]["response"]["id"], seen[-1]["sequence_number"]
    assert client.responses.retrieve(rid).status in ("queued", "in_progress")  # running without its client
    url, query = server.url + f"/v1/responses/{rid}", {"stream": "true", "starting_after": str(last)}
    with httpx.stream("GET", url, params=query, headers=key, timeout=120) as again:
        rest = list(sse_events(again.iter_lines()))
    assert [e["sequence_number"] for e in seen + rest] == list(range(len(seen) + len(rest)))
    assert rest[-1]["type"] == "response.completed" and rest[-1]["response"]["status"] == "completed"
    deltas = "".join(e["delta"] for e in seen + rest if e["type"] == "response.output_text.delta")
    kept = client.responses.retrieve(rid)
    assert deltas == kept.output_text and len(json.loads(deltas)) == 40 and kept.background is True
    with httpx.stream("GET", url, params={"stream": "true"}, headers=key, timeout=120) as whole:  # ended
        assert list(sse_events(whole.iter_lines())) == seen + rest
    foreground = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    refused = httpx.get(server.url + f"/v1/responses/{foreground.id}", params={"stream": "true"}, headers=key)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"


@pytest.mark.slow
def test_a_streamed_answer_is_stored_before_its_last_event(client: OpenAI) -> None:
    events = list(
        client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0, stream=True)
    )
    final = events[-1].response
    assert final.store is True and client.responses.retrieve(final.id).output_text == final.output_text
