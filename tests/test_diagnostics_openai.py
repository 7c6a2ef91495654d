"""``cache_miss_reason`` on the OpenAI routes (kvtier's extension): ``diagnostics: {"previous_response_id":
...}`` on ``/v1/completions`` and ``/v1/chat/completions``, answered in ``usage.kvtier.cache_miss_reason``,
over real HTTP against ``kvtier serve`` (uvicorn on a thread, a tiny model, a 24-block device pool and no
lower tier, so a flood of other prompts evicts). One story per reason the server can see in real time;
retention_expired waits minutes for real and is told apart by the unit tests (tests/test_diagnostics.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvtier import LLM
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.serve import BackgroundServer, serve_in_thread

KEY = "sesame"
MODEL = "tiny"
PROMPT = [10 + (5 * j) % 480 for j in range(80)]  # 5 whole blocks of 16


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Callable[..., Path]) -> Iterator[BackgroundServer]:
    model = str(tiny_llama_dir())
    engine = dict(kv_device_blocks=24, max_num_seqs=4, num_threads=1)
    settings = ServerSettings(model_name=MODEL, api_key=KEY)
    srv = serve_in_thread(create_app(lambda: LLM(model, **engine).engine, settings))
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
        yield client


def complete(http: httpx.Client, prompt: Any, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0.0, **extra}
    answer = http.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def why(http: httpx.Client, prompt: list[int], previous: str, **extra: Any) -> dict[str, Any]:
    answer = complete(http, prompt, diagnostics={"previous_response_id": previous}, **extra)
    return answer["usage"]["kvtier"]["cache_miss_reason"]


def test_a_continued_prompt_missed_nothing_and_an_edited_one_says_where(http: httpx.Client) -> None:
    first = complete(http, PROMPT)
    assert first["id"].startswith("cmpl-") and "cache_miss_reason" not in first["usage"]["kvtier"]
    reason = why(http, PROMPT + [7, 8, 9], first["id"])
    assert reason["type"] == "none" and reason["cached_tokens"] == reason["reusable_tokens"] == 80

    edited = PROMPT[:40] + [3] + PROMPT[41:]
    reason = why(http, edited, first["id"])
    assert reason["type"] == "prompt_changed" and reason["diverged_at_token"] == 40
    assert reason["reusable_tokens"] == 32 and "token 40" in reason["message"]


def test_a_prefix_evicted_by_other_traffic_is_named_evicted(http: httpx.Client) -> None:
    mine = [11 + (3 * j) % 470 for j in range(64)]
    first = complete(http, mine)
    for i in range(8):  # 8 x 5 blocks of unrelated prompts through a 24-block pool, no lower tier
        complete(http, [20 + (7 * i + 11 * j) % 460 for j in range(80)])
    reason = why(http, mine + [5], first["id"])
    assert reason["type"] == "evicted" and reason["reusable_tokens"] == 64
    assert reason["cached_tokens"] < 64 and "evicted" in reason["message"]


def test_another_tenant_an_unknown_id_and_malformed_asks(http: httpx.Client) -> None:
    first = complete(http, PROMPT, cache_salt="alice")
    assert why(http, PROMPT, first["id"], cache_salt="bob")["type"] == "different_tenant"
    assert why(http, PROMPT, "cmpl-nope")["type"] == "previous_message_unknown"
    for bad in ({"previous_response_id": 3}, {"previous_message_id": first["id"]}, "cmpl-x"):
        refused = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "diagnostics": bad}
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "diagnostics"
    several = {"model": MODEL, "prompt": [PROMPT, PROMPT], "max_tokens": 1}
    refused = http.post(
        "/v1/completions", json={**several, "diagnostics": {"previous_response_id": first["id"]}}
    )
    assert refused.status_code == 400 and "one prompt" in refused.json()["error"]["message"]


def test_a_stream_sends_its_usage_chunk_with_the_reason(http: httpx.Client) -> None:
    first = complete(http, PROMPT)
    body = {"model": MODEL, "prompt": PROMPT + [9], "max_tokens": 3, "temperature": 0.0, "stream": True}
    body["diagnostics"] = {"previous_response_id": first["id"]}
    with http.stream("POST", "/v1/completions", json=body) as answer:
        lines = [line.removeprefix("data: ") for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    last = json.loads(lines[-2])  # include_usage was not asked: the usage chunk comes for the reason
    assert last["choices"] == [] and last["usage"]["kvtier"]["cache_miss_reason"]["type"] == "none"


def test_the_chat_route_through_the_openai_sdk(server: BackgroundServer) -> None:
    """The official client, unmodified: the ask in ``extra_body``, the answer in usage's extra fields;
    the next turn names the first answer's id."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    turn = [{"role": "user", "content": "Tell me about caches and blocks and tiers. " * 4}]
    first = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=2, temperature=0)
    assert first.id.startswith("chatcmpl-")
    later = [*turn, {"role": "assistant", "content": first.choices[0].message.content or "ok"}]
    later.append({"role": "user", "content": "And then?"})
    second = client.chat.completions.create(
        model=MODEL,
        messages=later,
        max_tokens=2,
        temperature=0,
        extra_body={"diagnostics": {"previous_response_id": first.id}},
    )
    assert second.usage is not None
    reason = (second.usage.model_extra or {})["kvtier"]["cache_miss_reason"]
    assert reason["type"] in ("none", "prompt_changed") and reason["reusable_tokens"] > 0
    assert reason["cached_tokens"] >= reason["reusable_tokens"]
