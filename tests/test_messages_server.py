"""Anthropic's Messages API end to end on the real default model: the official ``anthropic`` SDK, unmodified,
against ``kvtier serve`` (uvicorn on a thread of this process, with an API key) and through ``kvtier
router``: a plain message streamed and not, a forced tool call whose input validates and the tool loop's
second step, cached prompt tokens in ``usage``, stop sequences, token counting, errors in Anthropic's
shape, and the key as ``x-api-key``."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
import torch

from kvtier import LLM
from kvtier.router.app import create_app as router_app
from kvtier.router.core import RouterSettings
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.serve import BackgroundServer, serve_in_thread

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY = "messages-key"
ENGINE = dict(kv_device_blocks=256, max_num_seqs=8, num_threads=1)
GREEDY = {"temperature": 0.0}  # the SDK 2.x sends sampling parameters in the body through extra_body
WEATHER = {
    "name": "get_weather",
    "description": "The current weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    threads = torch.get_num_threads()
    settings = ServerSettings(model_name=MODEL, api_key=KEY)
    srv = serve_in_thread(create_app(lambda: LLM(**ENGINE).engine, settings))
    srv.wait_ready()
    yield srv
    srv.stop()
    torch.set_num_threads(threads)


def sdk(url: str, **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, max_retries=0, timeout=120, **kw)


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> anthropic.Anthropic:
    return sdk(server.url, api_key=KEY)


def assert_valid(value: Any) -> None:
    """``value`` matches WEATHER's input_schema (jsonschema when installed, and by hand)."""
    schema = WEATHER["input_schema"]
    try:
        import jsonschema
    except ImportError:
        pass
    else:
        jsonschema.validate(value, schema)
    assert isinstance(value, dict) and set(value) == {"city", "unit"}
    assert isinstance(value["city"], str) and value["city"] and value["unit"] in ("celsius", "fahrenheit")


def test_a_message_streamed_and_not(client: anthropic.Anthropic) -> None:
    """Greedy, the same text either way; the stream's events in Anthropic's order."""
    whole = client.messages.create(model=MODEL, max_tokens=24, messages=HELLO, extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.model == MODEL and whole.stop_reason in ("end_turn", "max_tokens")
    (block,) = whole.content
    assert block.type == "text" and block.text
    with client.messages.stream(model=MODEL, max_tokens=24, messages=HELLO, extra_body=GREEDY) as stream:
        pieces = [text for text in stream.text_stream]
        streamed = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == block.text == streamed.content[0].text
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == streamed.usage.input_tokens + (
        streamed.usage.cache_read_input_tokens or 0
    )
    raw = client.messages.create(model=MODEL, max_tokens=8, messages=HELLO, stream=True, extra_body=GREEDY)
    kinds = [e.type for e in raw]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(kinds[2:-3]) == {"content_block_delta"}


def test_a_two_step_tool_loop(client: anthropic.Anthropic) -> None:
    """tool_choice tool forces a call whose input validates; the SDK's own content goes back with a
    tool_result, and the next turn answers in text, its prompt read from the cache up to the call."""
    messages: list[Any] = list(QUESTION)
    first = client.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    assert_valid(call.input)
    messages.append({"role": "assistant", "content": first.content})  # the SDK's blocks, as its docs do
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees and sunny"}
    messages.append({"role": "user", "content": [result]})
    second = client.messages.create(
        model=MODEL, max_tokens=30, messages=messages, tools=[WEATHER], extra_body=GREEDY
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert second.content and all(b.type == "text" for b in second.content) and second.content[0].text
    turn = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens
    assert second.usage.cache_read_input_tokens >= turn // 16 * 16 - 16  # block size 16
    with client.messages.stream(
        model=MODEL,
        max_tokens=60,
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and [b.type for b in streamed.content] == ["tool_use"]
    assert_valid(streamed.content[0].input)


def test_usage_reads_a_repeated_long_prompt_from_the_cache(client: anthropic.Anthropic) -> None:
    """The second time, most of the prompt is cache_read_input_tokens (split by tier, all on the device
    here); cache_creation_input_tokens counts the uncached tokens up to the cache_control breakpoint."""
    words = " ".join(secrets.token_hex(3) for _ in range(150))  # ~600 tokens no earlier test sent
    system = [{"type": "text", "text": f"Reference notes: {words}", "cache_control": {"type": "ephemeral"}}]
    ask = [{"role": "user", "content": "Summarize the notes."}]
    first = client.messages.create(model=MODEL, max_tokens=4, system=system, messages=ask, extra_body=GREEDY)
    again = client.messages.create(model=MODEL, max_tokens=4, system=system, messages=ask, extra_body=GREEDY)
    u1, u2 = first.usage, again.usage
    total = u1.input_tokens + u1.cache_creation_input_tokens + u1.cache_read_input_tokens
    assert total == u2.input_tokens + u2.cache_creation_input_tokens + u2.cache_read_input_tokens > 400
    assert u1.cache_creation_input_tokens > 300 and u1.cache_read_input_tokens < 100  # the notes were new
    assert u2.cache_read_input_tokens >= total - 16 and u2.cache_creation_input_tokens == 0
    assert u2.kvtier_cache_read_by_tier["device"] == u2.cache_read_input_tokens  # type: ignore[attr-defined]
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=ask)
    assert counted.input_tokens == total
    # the breakpoint's prefix is retained (5 minutes, refreshed by the second request): its full blocks
    retained = u2.kvtier_retained_input_tokens  # type: ignore[attr-defined]
    assert total - u1.input_tokens - 16 <= retained <= total - u1.input_tokens and retained % 16 == 0


def test_diagnostics_explain_a_miss_against_an_earlier_message(server: BackgroundServer) -> None:
    """The next turn of a conversation names the earlier message: nothing missed. A prompt edited in the
    middle: where it diverged. A message id this server never gave: unknown. Malformed: a 400."""
    raw = httpx.Client(base_url=server.url, headers={"x-api-key": KEY}, timeout=60)
    words = " ".join(secrets.token_hex(3) for _ in range(80))
    first_turn = [{"role": "user", "content": f"Notes: {words}. Summarize."}]
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0.0, "messages": first_turn}
    first = raw.post("/v1/messages", json=body).json()
    answer = first["content"][0]["text"] or "ok"
    later = [*first_turn, {"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
    diag = {"previous_message_id": first["id"]}
    second = raw.post("/v1/messages", json={**body, "messages": later, "diagnostics": diag}).json()
    reason = second["diagnostics"]["cache_miss_reason"]
    assert (
        reason["type"] in ("none", "prompt_changed")
        and reason["cached_tokens"] >= reason["reusable_tokens"] > 0
    )
    edited = [{"role": "user", "content": f"Notes: {words[:40]}X{words[41:]}. Summarize."}]
    third = raw.post("/v1/messages", json={**body, "messages": edited, "diagnostics": diag}).json()
    reason = third["diagnostics"]["cache_miss_reason"]
    assert reason["type"] == "prompt_changed" and 0 < reason["diverged_at_token"] < 120  # ~char 47 of ~250
    assert reason["reusable_tokens"] <= reason["diverged_at_token"]
    unknown = raw.post(
        "/v1/messages", json={**body, "diagnostics": {"previous_message_id": "msg_nope"}}
    ).json()
    assert unknown["diagnostics"]["cache_miss_reason"]["type"] == "previous_message_unknown"
    bad = raw.post("/v1/messages", json={**body, "diagnostics": {"previous_message_id": 3}})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert "diagnostics" not in first


def test_breakpoint_ttls_and_prompt_cache_retention_retain_the_prompt(server: BackgroundServer) -> None:
    """A 1h system prompt and a 5m turn after it: both prefixes retained. OpenAI's chat route with
    ``prompt_cache_retention: 24h`` retains the whole prompt, reported in usage's kvtier extension."""
    words = " ".join(secrets.token_hex(3) for _ in range(60))
    system = [
        {"type": "text", "text": f"Notes: {words}", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    ]
    turn = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Go on.", "cache_control": {"type": "ephemeral"}}],
        }
    ]
    msg = sdk(server.url, api_key=KEY).messages.create(
        model=MODEL, max_tokens=2, system=system, messages=turn, extra_body=GREEDY
    )
    whole = msg.usage.input_tokens + msg.usage.cache_creation_input_tokens + msg.usage.cache_read_input_tokens
    assert whole - 16 < msg.usage.kvtier_retained_input_tokens <= whole  # type: ignore[attr-defined]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Repeat: {words}"}],
        "max_tokens": 2,
        "prompt_cache_retention": "24h",
        "prompt_cache_key": "agent-7",
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    usage = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60).json()[
        "usage"
    ]
    assert usage["prompt_tokens"] - 16 < usage["kvtier"]["retained_tokens"] <= usage["prompt_tokens"]
    body["prompt_cache_retention"] = "forever"
    bad = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert bad.status_code == 400 and "prompt_cache_retention" in bad.text


def test_a_prefill_is_continued(
    client: anthropic.Anthropic, server: BackgroundServer, hf_default_tokenizer: Any
) -> None:
    """A final assistant message is a prefill: the answer holds only what follows it, the same greedy
    tokens as the completions route gives the prompt transformers renders with continue_final_message;
    the usage and count_tokens count that prompt; trailing whitespace is refused, as Anthropic does."""
    prefill = [
        {"role": "user", "content": "Name a colour as JSON."},
        {"role": "assistant", "content": '{"colour": "'},
    ]
    text = hf_default_tokenizer.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    ids = hf_default_tokenizer.encode(text, add_special_tokens=False)
    want = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": ids, "max_tokens": 12, "temperature": 0},
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()["choices"][0]["text"]
    answer = client.messages.create(model=MODEL, max_tokens=12, messages=prefill, extra_body=GREEDY)
    assert answer.content[0].text == want  # type: ignore[union-attr]
    usage = answer.usage
    num_input = (
        usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    )
    assert num_input == len(ids)
    assert client.messages.count_tokens(model=MODEL, messages=prefill).input_tokens == len(ids)  # type: ignore[arg-type]
    spaced = [prefill[0], {"role": "assistant", "content": "Blue "}]
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        client.messages.create(model=MODEL, max_tokens=2, messages=spaced)  # type: ignore[arg-type]


def test_output_config_holds_the_answer_to_a_json_schema(client: anthropic.Anthropic) -> None:
    """Anthropic's structured outputs: the text parses and matches the schema, streamed or not."""
    schema = {**WEATHER["input_schema"], "additionalProperties": False}
    schema["properties"] = {
        **schema["properties"],
        "city": {"type": "string", "minLength": 1, "maxLength": 20},
    }
    fmt = {"type": "json_schema", "schema": schema}
    whole = client.messages.create(
        model=MODEL, max_tokens=120, messages=QUESTION, output_config={"format": fmt}, extra_body=GREEDY
    )
    assert whole.stop_reason == "end_turn", whole.content
    assert_valid(json.loads(whole.content[0].text))  # type: ignore[union-attr]
    with client.messages.stream(
        model=MODEL, max_tokens=120, messages=QUESTION, output_config={"format": fmt}, extra_body=GREEDY
    ) as stream:
        assert stream.get_final_text() == whole.content[0].text  # type: ignore[union-attr]


def test_stop_sequences(client: anthropic.Anthropic) -> None:
    text = (
        client.messages.create(model=MODEL, max_tokens=24, messages=HELLO, extra_body=GREEDY).content[0].text
    )
    word = next(w for w in text.split()[2:] if w.isalpha() and text.index(w) > 0)
    cut = client.messages.create(
        model=MODEL, max_tokens=24, messages=HELLO, stop_sequences=["@@", word], extra_body=GREEDY
    )
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", word)
    assert cut.content[0].text == text[: text.index(word)]


def test_errors_are_anthropics(client: anthropic.Anthropic, server: BackgroundServer) -> None:
    def refused(status: type[anthropic.APIStatusError], **kw: Any) -> str:
        with pytest.raises(status) as info:
            client.messages.create(**{"model": MODEL, "max_tokens": 8, "messages": HELLO, **kw})
        body = info.value.body
        assert (
            isinstance(body, dict) and body["type"] == "error" and set(body["error"]) == {"type", "message"}
        )
        return body["error"]["message"]

    assert "ttl" in refused(anthropic.BadRequestError, cache_control={"type": "ephemeral", "ttl": "2d"})
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}
    assert "'image'" in refused(anthropic.BadRequestError, messages=[{"role": "user", "content": [image]}])
    choice = {"type": "tool", "name": "get_time"}
    assert "get_time" in refused(anthropic.BadRequestError, tools=[WEATHER], tool_choice=choice)
    assert "model" in refused(anthropic.NotFoundError, model="no-such-model")
    assert "temperature" in refused(anthropic.BadRequestError, extra_body={"temperature": 1.5})  # 0-1 only
    headers = {"x-api-key": KEY, "content-type": "application/json"}
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "messages": HELLO}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]


def test_the_key_as_x_api_key(server: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    by_header = sdk(server.url, default_headers={"x-api-key": KEY})
    assert by_header.messages.create(model=MODEL, max_tokens=2, messages=HELLO).content
    wrong = sdk(server.url, default_headers={"x-api-key": "wrong"})
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError):
        sdk(server.url, api_key="wrong").messages.create(model=MODEL, max_tokens=2, messages=HELLO)


def test_through_the_router(server: BackgroundServer) -> None:
    """The router passes /v1/messages on (the key given as x-api-key reaches the replica), streamed too,
    and answers its own refusals in Anthropic's shape."""
    settings = RouterSettings(replicas=[server.url], api_key=KEY, poll_interval=0.2)
    router = serve_in_thread(router_app(settings))  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 60
        while httpx.get(router.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the router found no healthy replica"
            time.sleep(0.1)
        client = sdk(router.url, default_headers={"x-api-key": KEY})
        direct = sdk(server.url, api_key=KEY).messages.create(
            model=MODEL, max_tokens=12, messages=HELLO, extra_body=GREEDY
        )
        routed = client.messages.create(model=MODEL, max_tokens=12, messages=HELLO, extra_body=GREEDY)
        assert routed.content[0].text == direct.content[0].text
        with client.messages.stream(model=MODEL, max_tokens=12, messages=HELLO, extra_body=GREEDY) as stream:
            assert stream.get_final_text() == direct.content[0].text
        assert client.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens > 5
        with pytest.raises(anthropic.AuthenticationError) as info:
            sdk(router.url, default_headers={"x-api-key": "no"}).messages.create(
                model=MODEL, max_tokens=2, messages=HELLO
            )
        assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    finally:
        router.stop()
