"""Disaggregated prefill and decode end to end: a real redis-server, a ``kvtier serve --role prefill`` and
a ``kvtier serve --role decode`` replica (a tiny random model, block size 4) behind ``kvtier router``,
each its own process on loopback, and a lone ``kvtier serve`` (role both, no Redis) as the reference.

    exact      greedy answers through the handoff equal the lone server's: chat, completions and the
               Responses API, streamed and not, n > 1, stop strings, logprobs, a JSON schema, a choice
    served     the decode replica's usage and /metrics show the prompt's blocks loaded from Redis
    faults     the prefill replica killed mid-handoff (frozen while the router waits on it): that
               request is answered exactly by the decode replica; Redis killed: the next handoffs fail
               nothing (the decode replica computes the prompt); the prefill replica killed: neither
               (the router sends the request straight to decode)

Slow (four processes start with torch); the module shares them.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.redis_server import RedisServer
from tests.test_router import AUTH, BLOCK_SIZE, Proc, replica_args, router_args, sse_events, wait_for

pytestmark = pytest.mark.slow

PREFILL_HEADER = "x-kvtier-prefill-replica"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:  # noqa: ANN001
    model = tiny_llama_dir(max_position_embeddings=512)
    logs = tmp_path_factory.mktemp("disagg_logs")
    redis = RedisServer(logs / "redis").start()
    prefill = Proc([*replica_args(model, redis.url, "p0"), "--role", "prefill"], log=logs / "p0.log")
    decode = Proc([*replica_args(model, redis.url, "d0"), "--role", "decode"], log=logs / "d0.log")
    lone = [a for a in replica_args(model, redis.url, "lone") if a not in ("--kv-remote-url", redis.url)]
    reference = Proc(lone, log=logs / "lone.log")
    extra = ("--disagg-min-prompt-tokens", "100")
    router = Proc(router_args([prefill, decode], redis.url, model, *extra), log=logs / "router.log")
    procs = [p.start() for p in (prefill, decode, reference, router)]
    try:
        for p in procs:
            p.wait_healthy()
        wait_for(lambda: len(healthy_roles(router)) == 2, 20)
        yield {"redis": redis, "prefill": prefill, "decode": decode, "reference": reference, "router": router}
    finally:
        for p in procs:
            p.kill()
        redis.stop()


def healthy_roles(router: Proc) -> list[str]:
    state = httpx.get(router.url + "/router/state", headers=AUTH, timeout=5).json()
    return sorted(r["role"] for r in state["replicas"] if r["healthy"])


def post(url: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
    r = httpx.post(url + path, json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r


def document(tag: str, words: int = 32) -> str:
    return f"[{tag}] " + " ".join(f"record {tag}{i} holds block {i % 7}" for i in range(words // 4))


def chat(tag: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": document(tag)}, {"role": "user", "content": "Summarize."}]
    return {
        "model": None,
        "messages": messages,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def remote_tokens(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["kvtier"]["cached_tokens_by_tier"].get("remote", 0))


def metric(proc: Proc, name: str, **labels: str) -> float:
    text = httpx.get(proc.url + "/metrics", timeout=10).text
    selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^kvtier:{name}\{{{selector}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def without_cache(usage: dict[str, Any]) -> dict[str, Any]:
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


# ---------------------------------------------------------------------------------------- stories
def test_story_a_handoff_answers_like_one_server_from_the_prefills_blocks(cluster: dict[str, Any]) -> None:
    """Act 1: a long chat through the router is computed on the prefill replica, answered by the decode
    replica, and equals the lone server's answer. Act 2: the decode replica served the prompt's full
    blocks from Redis (usage, and its /metrics). Act 3: the roles show on each replica."""
    router, decode, prefill = cluster["router"], cluster["decode"], cluster["prefill"]
    body = chat("story")
    r = post(router.url, body)
    assert r.headers[PREFILL_HEADER] == prefill.url and r.headers["x-kvtier-replica"] == decode.url
    want = post(cluster["reference"].url, body).json()
    got = r.json()
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert without_cache(got["usage"]) == without_cache(want["usage"])  # the prompt counted once
    prompt_tokens = got["usage"]["prompt_tokens"]
    full = (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last token is always computed
    assert remote_tokens(got) == full == got["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert metric(decode, "tier_hit_tokens_total", tier="remote") >= full
    assert metric(decode, "role", role="decode") == 1 and metric(prefill, "role", role="prefill") == 1
    info = httpx.get(decode.url + "/v1/kv/info", headers=AUTH, timeout=5).json()
    assert info["role"] == "decode"


def test_streams_and_completions_through_a_handoff_equal_the_lone_server(cluster: dict[str, Any]) -> None:
    router, reference = cluster["router"], cluster["reference"]
    body = chat("stream", stream=True, stream_options={"include_usage": True}, max_tokens=10)
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200 and r.headers[PREFILL_HEADER] == cluster["prefill"].url
        through = sse_events(r.read().decode())
    direct = sse_events(post(reference.url, body).text)
    assert [e["choices"] for e in through[:-2]] == [e["choices"] for e in direct[:-2]]
    assert through[-1] == "[DONE]" and remote_tokens(through[-2]) > 0
    assert without_cache(through[-2]["usage"]) == without_cache(direct[-2]["usage"])

    prompt = document("completion", 40)
    body = {"model": None, "prompt": prompt, "max_tokens": 8, "temperature": 0, "n": 2, "logprobs": 2}
    body["stop"] = ["block 3"]
    got = post(router.url, body, "/v1/completions")
    want = post(reference.url, body, "/v1/completions").json()
    assert got.headers[PREFILL_HEADER] == cluster["prefill"].url
    for mine, theirs in zip(got.json()["choices"], want["choices"], strict=True):
        assert mine["text"] == theirs["text"] and mine["finish_reason"] == theirs["finish_reason"]
        assert mine["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]
        for a, b in zip(
            mine["logprobs"]["token_logprobs"], theirs["logprobs"]["token_logprobs"], strict=True
        ):
            assert a == pytest.approx(b, abs=1e-4)
    assert remote_tokens(got.json()) > 0


def test_the_responses_api_through_a_handoff_equals_the_lone_server(cluster: dict[str, Any]) -> None:
    """/v1/responses is routed as chat: the prefill replica computes it with max_output_tokens 1, the
    decode replica answers from the prompt's blocks in Redis, the same items as the lone server."""
    messages = chat("responses")["messages"]
    body = {
        "model": None,
        "instructions": messages[0]["content"],
        "input": messages[1:],
        "max_output_tokens": 12,
    }
    body["temperature"] = 0
    got = post(cluster["router"].url, body, "/v1/responses")
    assert got.headers[PREFILL_HEADER] == cluster["prefill"].url
    want = post(cluster["reference"].url, body, "/v1/responses").json()
    strip = lambda r: [{k: v for k, v in i.items() if k != "id"} for i in r["output"]]  # noqa: E731
    assert strip(got.json()) == strip(want) and got.json()["status"] == want["status"]
    usage = got.json()["usage"]
    assert usage["input_tokens"] == want["usage"]["input_tokens"]
    assert usage["kvtier"]["cached_tokens_by_tier"]["remote"] > 0


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 10}, "count": {"type": "integer"}},
    "required": ["answer", "count"],
}


def test_structured_output_through_a_handoff_equals_the_lone_server(cluster: dict[str, Any]) -> None:
    """A JSON-schema answer and a choice, streamed and not: the decode replica constrains the whole
    answer itself, from the prefill's blocks, and answers as the lone server does."""
    router, reference = cluster["router"], cluster["reference"]
    response_format = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    bodies = [
        chat("schema", response_format=response_format, max_tokens=24, ignore_eos=False),
        chat("choice", guided_choice=["block 3", "block 5", "no block"], ignore_eos=False),
    ]
    for body in bodies:
        r = post(router.url, body)
        assert r.headers[PREFILL_HEADER] == cluster["prefill"].url, body
        got, want = r.json(), post(reference.url, body).json()
        assert got["choices"] == want["choices"] and remote_tokens(got) > 0
    assert got["choices"][0]["message"]["content"] in ("block 3", "block 5", "no block")

    # a new prompt: the decode replica now holds the last one's blocks, and gets it without a handoff
    body = chat("schema streamed", response_format=response_format, max_tokens=24, ignore_eos=False)
    body["stream"] = True
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200 and r.headers[PREFILL_HEADER] == cluster["prefill"].url
        through = sse_events(r.read().decode())
    direct = sse_events(post(reference.url, body).text)
    assert [e["choices"] for e in through[:-1]] == [e["choices"] for e in direct[:-1]]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in through[:-1] if e["choices"])
    assert text.startswith("{"), text  # constrained from the first token (the prefill's is not kept)


def test_a_short_prompt_skips_the_prefill_replica(cluster: dict[str, Any]) -> None:
    body = {"model": None, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    r = post(cluster["router"].url, body)
    assert PREFILL_HEADER not in r.headers and r.headers["x-kvtier-replica"] == cluster["decode"].url
    want = post(cluster["reference"].url, body).json()
    assert r.json()["choices"][0]["message"] == want["choices"][0]["message"]


def test_zy_the_prefill_replica_killed_mid_handoff_fails_no_request(cluster: dict[str, Any]) -> None:
    """The prefill replica is frozen while the router waits on its answer, then killed: the request,
    which has sent no byte to the client yet, is answered exactly by the decode replica computing the
    prompt. The replica is started again where it was, for the test after this one."""
    router, reference, prefill = cluster["router"], cluster["reference"], cluster["prefill"]
    body = chat("killed-mid-handoff")
    assert prefill.proc is not None
    prefill.proc.send_signal(signal.SIGSTOP)  # it takes the prompt and never answers
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(post, router.url, body)
        time.sleep(1.0)  # the router has sent the prompt to the frozen replica
        assert not answer.done()
        prefill.kill()
        got = answer.result(timeout=60)
    assert got.status_code == 200 and got.headers["x-kvtier-replica"] == cluster["decode"].url
    assert got.json()["choices"][0]["message"] == post(reference.url, body).json()["choices"][0]["message"]
    prefill.start().wait_healthy()
    wait_for(lambda: healthy_roles(router) == ["decode", "prefill"], 20)


def test_zz_redis_then_the_prefill_replica_die_and_no_request_fails(cluster: dict[str, Any]) -> None:
    """Last (it kills): with Redis gone the handoff still runs and the decode replica computes the
    prompt itself; with the prefill replica gone too, the router sends requests straight to decode."""
    router, reference = cluster["router"], cluster["reference"]
    cluster["redis"].kill()
    for i in range(2):
        body = chat(f"no-redis-{i}")
        got = post(router.url, body).json()
        assert got["choices"][0]["message"] == post(reference.url, body).json()["choices"][0]["message"]
        assert remote_tokens(got) == 0
    cluster["prefill"].kill()
    for i in range(3):  # the first may try the dead replica before its health check notices
        body = chat(f"no-prefill-{i}")
        got = post(router.url, body)
        assert got.headers["x-kvtier-replica"] == cluster["decode"].url
        assert (
            got.json()["choices"][0]["message"] == post(reference.url, body).json()["choices"][0]["message"]
        )
    wait_for(lambda: healthy_roles(router) == ["decode"], 10)
