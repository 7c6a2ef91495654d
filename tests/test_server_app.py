"""The HTTP layer without a model: the engine factory blocks (the model "is loading"), so every answer
here comes from key, body, model-name and parameter checks, ``/health`` and ``/metrics``."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvtier.cli import build_parser
from kvtier.config import ConfigError
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.protocol import ChatCompletionRequest

MODEL = "test-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _app_client(api_key: str | None = None) -> Iterator[tuple[TestClient, threading.Event]]:
    release = threading.Event()

    def factory():  # noqa: ANN202 - never returns an engine
        release.wait(30)
        raise ConfigError("model not found: 'test'")

    app = create_app(factory, ServerSettings(model_name=MODEL, api_key=api_key))
    with TestClient(app) as client:
        try:
            yield client, release
        finally:
            release.set()


@pytest.fixture()
def loading() -> Iterator[tuple[TestClient, threading.Event]]:
    yield from _app_client()


@pytest.fixture()
def client(loading: tuple[TestClient, threading.Event]) -> TestClient:
    return loading[0]


def assert_error(r, status: int, param: str | None = None, code: str | None = None) -> dict:  # noqa: ANN001
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_health_while_loading_then_failed(loading: tuple[TestClient, threading.Event]) -> None:
    client, release = loading
    r = client.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "loading"} and r.headers["retry-after"]
    r = client.post("/v1/chat/completions", json=CHAT)
    assert_error(r, 503, code="model_not_ready")
    assert r.headers["retry-after"]
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert client.get("/metrics").status_code == 200
    release.set()
    app_engine = client.app.state.engine
    app_engine.wait_ready(10)
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "error" and "not found" in r.json()["message"]


BAD_CHAT = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"n": 0}, "n"),
    ({"n": True}, "n"),
    ({"seed": "x"}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": "high"}, "repetition_penalty"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"cache_salt": 7}, "cache_salt"),
]


@pytest.mark.parametrize(("change", "param"), BAD_CHAT, ids=[repr(c) for c, _ in BAD_CHAT])
def test_invalid_chat_parameters_are_400(client: TestClient, change: dict, param: str) -> None:
    err = assert_error(client.post("/v1/chat/completions", json={**CHAT, **change}), 400, param=param)
    assert err["type"] == "invalid_request_error"


BAD_COMPLETION = [
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "x", "max_tokens": -2}, "max_tokens"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo (the prompt alone)
    ({}, "prompt"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETION, ids=[repr(b) for b, _ in BAD_COMPLETION])
def test_invalid_completion_parameters_are_400(client: TestClient, body: dict, param: str) -> None:
    assert_error(client.post("/v1/completions", json={"model": MODEL, **body}), 400, param=param)


def test_malformed_bodies_unknown_models_and_routes(client: TestClient) -> None:
    headers = {"content-type": "application/json"}
    assert_error(client.post("/v1/chat/completions", content=b"{not json", headers=headers), 400)
    assert_error(client.post("/v1/chat/completions", content=b"[1, 2]", headers=headers), 400)
    assert_error(
        client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"}), 404, "model", "model_not_found"
    )
    assert_error(client.get("/v1/models/gpt-4"), 404, "model", "model_not_found")
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_error(client.get("/v1/nothing-here"), 404, code="not_found")
    assert_error(client.get("/v1/chat/completions"), 405)
    rejected = [line for line in client.get("/metrics").text.splitlines() if "invalid_request" in line]
    assert rejected and float(rejected[-1].split()[-1]) >= 2


def test_api_key_guards_v1_and_the_tokenizer_routes() -> None:
    for client, _ in _app_client(api_key="sekrit"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            err = assert_error(client.post("/v1/chat/completions", json=CHAT, headers=headers), 401)
            assert err["code"] == "invalid_api_key"
            assert_error(client.get("/v1/models", headers=headers), 401)
        # Auth comes before body checks; the right key gets through to them.
        assert_error(client.post("/v1/completions", json={}), 401)
        ok = {"Authorization": "Bearer sekrit"}
        assert client.get("/v1/models", headers=ok).status_code == 200
        assert_error(client.post("/v1/completions", json={}, headers=ok), 400)
        assert_error(client.post("/tokenize", json={"prompt": "a"}), 401)  # the tokenizer routes too
        assert_error(client.post("/tokenize", json={"prompt": "a"}, headers=ok), 503)  # loading
        assert_error(client.post("/detokenize", json={"tokens": [1]}, headers=ok), 503)
        assert client.get("/health").status_code == 503  # loading, but no key needed
        assert client.get("/metrics").status_code == 200


def test_serve_command_line() -> None:
    ns = build_parser().parse_args(
        ["serve", "--port", "0", "--max-queue", "3", "--api-key", "k", "--kv-device-blocks", "64"]
    )
    assert (ns.host, ns.port, ns.max_queue, ns.api_key, ns.kv_device_blocks) == ("127.0.0.1", 0, 3, "k", 64)
    ns = build_parser().parse_args(["bench", "serve", "--rates", "4,1", "--num-requests", "3"])
    assert ns.rates == [1.0, 4.0] and ns.num_requests == 3 and ns.url is None


# ----------------------------------------------------------------------------- hostile input, no model
UNSUPPORTED = [
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}, "guided_json": {}},
        "response_format",
    ),
    ({"guided_choice": []}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"echo": True}, "echo"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"bad_words": ["  "]}, "bad_words"),  # not a word
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"logit_bias": {"abc": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"n": 17}, "n"),  # --max-n 16 by default
    ({"n": 1000}, "n"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ({"model": "\udfff"}, "model"),
    ({"stop": ["ok", "\ud83d"]}, "stop"),
    ({"stop": [str(i) for i in range(17)]}, "stop"),
    ({"stop_token_ids": list(range(300))}, "stop_token_ids"),
]


@pytest.mark.parametrize(("change", "param"), UNSUPPORTED, ids=[ascii(c) for c, _ in UNSUPPORTED])
def test_unsupported_and_invalid_parameters_are_named(client: TestClient, change: dict, param: str) -> None:
    """Unsupported parameters (tools, ...), a bad response_format, n over --max-n and a lone surrogate are
    each a 400 naming the parameter: never silently ignored, never a 500."""
    body = json.dumps({**CHAT, **change}, ensure_ascii=True)  # "\ud800" escaped, as a client would send it
    r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, param=param)


def test_too_many_prompts_is_400_before_tokenizing(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": ["a"] * 5000, "max_tokens": 1})
    assert_error(r, 400, param="prompt")


def test_an_assistants_reasoning_is_passed_to_the_template() -> None:
    """vLLM's reasoning_content (or reasoning) on an assistant message goes to the template, which
    writes it or drops it (Qwen3's writes it within the current turn: the prompt the model saw)."""
    from kvtier.server.protocol import conversation_of

    body = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", "reasoning": "Greet."},
        ]
    }
    chat = ChatCompletionRequest.model_validate(body)
    assert conversation_of(chat.messages)[1] == {
        "role": "assistant",
        "content": "Hello",
        "reasoning_content": "Greet.",
    }


def test_vllms_output_fields_reach_the_sampling_params() -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "stop": "x"}
    given = {"skip_special_tokens": False, "include_stop_str_in_output": True}
    params = ChatCompletionRequest.model_validate({**body, **given}).sampling_params()
    assert (params.skip_special_tokens, params.include_stop_str_in_output) == (False, True)
    default = ChatCompletionRequest.model_validate(body).sampling_params()
    assert (default.skip_special_tokens, default.include_stop_str_in_output) == (True, False)


def test_defaults_of_unsupported_parameters_pass(client: TestClient) -> None:
    """Clients that send tools=[] or response_format text are not refused (503: the model is loading)."""
    extra = {
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "logit_bias": {},
        "echo": False,
    }
    assert_error(client.post("/v1/chat/completions", json={**CHAT, **extra}), 503)


def test_error_messages_do_not_echo_huge_input(client: TestClient) -> None:
    """A 1 MB model name is quoted in the 404 cut short, not whole."""
    r = client.post("/v1/chat/completions", json={**CHAT, "model": "m" * 2**20})
    err = assert_error(r, 404, "model", "model_not_found")
    assert len(r.content) < 500 and "characters" in err["message"]


def test_a_body_without_json_content_type_is_told_so(client: TestClient) -> None:
    """curl -d sends form encoding; the 400 says which header to send."""
    r = client.post("/v1/chat/completions", content=json.dumps(CHAT))
    err = assert_error(r, 400, code="invalid_content_type")
    assert "Content-Type: application/json" in err["message"]


def test_body_size_limit_is_413_before_the_body_is_read() -> None:
    """A declared Content-Length over the limit is refused at once, a chunked body as it streams."""
    release = threading.Event()

    def factory():  # noqa: ANN202 - never returns an engine
        release.wait(30)
        raise ConfigError("no model here")

    app = create_app(factory, ServerSettings(model_name=MODEL, max_request_bytes=1000))
    with TestClient(app) as client:
        try:
            big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]})
            headers = {"content-type": "application/json"}
            err = assert_error(client.post("/v1/chat/completions", content=big, headers=headers), 413)
            assert err["code"] == "request_too_large" and "1000" in err["message"]

            def chunks() -> Iterator[bytes]:
                for i in range(0, len(big), 100):
                    yield big[i : i + 100].encode()

            r = client.post("/v1/chat/completions", content=chunks(), headers=headers)
            assert_error(r, 413, code="request_too_large")
            assert_error(client.post("/v1/chat/completions", json=CHAT), 503)  # small: on to the engine
        finally:
            release.set()


def test_new_server_flags() -> None:
    ns = build_parser().parse_args(["serve"])
    assert (ns.max_n, ns.max_request_bytes, ns.prefix_cache_scope) == (16, 4 * 2**20, "shared")
    assert (ns.shutdown_timeout, ns.timeout_keep_alive, ns.timeout_header, ns.timeout_body) == (30, 5, 10, 30)
    ns = build_parser().parse_args(["serve", "--prefix-cache-scope", "user", "--max-n", "4"])
    assert (ns.prefix_cache_scope, ns.max_n) == ("user", 4)


def test_taken_port_is_named() -> None:
    """A taken port is named in the error, not a bare '[Errno 98] Address already in use'."""
    from kvtier.server.serve import bind

    taken = bind("127.0.0.1", 0)
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}.*--port"):
            bind("127.0.0.1", port).close()
    finally:
        taken.close()


def test_truncation_keeps_the_last_tokens_and_room_for_the_answer() -> None:
    from kvtier.server.prompts import truncated

    ids = list(range(10))
    assert truncated(ids, None, 4, 16) is None  # not asked
    assert truncated(ids, 3, 4, 16) == [7, 8, 9]
    assert truncated(ids, 30, 4, 16) is None  # shorter already
    assert truncated(ids, -1, 4, 12) == list(range(2, 10))  # 12 - 4 leave room for max_tokens
    assert truncated(ids, -1, None, 8) == list(range(3, 10))  # no max_tokens: room for one
