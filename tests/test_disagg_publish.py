"""The replica side of disaggregated prefill and decode, on a tiny random model and a real redis-server.

Two in-process replicas share one Redis: a ``prefill`` one computes a prompt (``max_tokens: 1``), a
``decode`` one then answers the client's request. The stories:

    the idle gap   the copies of a prompt's last full blocks are planned in the step that computes them
                   and run at the next one: an idle replica takes that step itself (settle_tiers), so
                   every block reaches Redis with no further request
    publish        POST /v1/kv/publish says when: it waits for the writes, and then the decode replica
                   loads every full block (usage: cached by tier, remote)
    exactness      the decode replica's greedy answer equals a lone engine's, with and without the blocks
    Redis down     publish reports no shared tier at once; the decode replica computes the prompt
    --role         in /v1/kv/info and on /metrics; prefill or decode without a remote tier: one line
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from kvtier import LLM, SamplingParams
from kvtier.config import ConfigError, EngineArgs
from kvtier.kv.hashing import hash_full_blocks, root_hash
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.serve import BackgroundServer, check_role, serve_in_thread, set_role
from tests.redis_server import RedisServer

BLOCK_SIZE = 4
PROMPT = [(7 * j + 11) % 500 + 3 for j in range(10 * BLOCK_SIZE + 1)]  # 10 full blocks and one token


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_dir) -> str:  # noqa: ANN001
    return str(tiny_llama_dir(num_heads=4, num_kv_heads=2, hidden_size=64))


def engine(model: str, redis_url: str | None) -> LLM:
    remote = {"kv_remote_url": redis_url} if redis_url else {}
    return LLM(model, block_size=BLOCK_SIZE, kv_device_blocks=64, kv_host_gb=0.002, num_threads=1, **remote)


def serve(llm: LLM, role: str) -> BackgroundServer:
    app = create_app(lambda: llm.engine, ServerSettings(model_name="tiny"))
    set_role(app, role)
    server = serve_in_thread(app)
    server.wait_ready(60)
    return server


@pytest.fixture()
def pair(tiny_dir: str, redis_server: RedisServer) -> Iterator[dict[str, Any]]:
    """A prefill and a decode replica on one Redis, with their engines."""
    llms = {role: engine(tiny_dir, redis_server.url) for role in ("prefill", "decode")}
    servers = {role: serve(llm, role) for role, llm in llms.items()}
    yield {"llm": llms, "server": servers, "redis": redis.Redis.from_url(redis_server.url)}
    for role in servers:
        servers[role].stop()
        llms[role].close()


def complete(server: BackgroundServer, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def block_hashes(server: BackgroundServer, prompt: list[int]) -> list[str]:
    """The prompt's full-block hashes as a router computes them, from ``/v1/kv/info`` alone."""
    info = httpx.get(server.url + "/v1/kv/info", timeout=10).json()
    root = root_hash((info["cache_identity"], ""))
    return [h.hex() for h in hash_full_blocks(prompt, info["block_size"], root)]


def in_redis(client: redis.Redis, hashes: list[str]) -> int:
    return sum(client.exists(f"kvtier:v1:{h}") for h in hashes)


def publish(server: BackgroundServer, hashes: list[str], timeout_s: float = 5.0) -> dict[str, Any]:
    body = {"block_hashes": hashes, "timeout_s": timeout_s}
    r = httpx.post(server.url + "/v1/kv/publish", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def reference(tiny_dir: str, prompt: list[int], max_tokens: int) -> str:
    """A lone engine's greedy answer (no tiers)."""
    with LLM(tiny_dir, block_size=BLOCK_SIZE, kv_device_blocks=64, num_threads=1) as lone:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        return lone.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].text


def test_story_an_idle_prefill_replica_writes_its_last_blocks_and_publish_confirms_them(
    pair: dict[str, Any], tiny_dir: str
) -> None:
    prefill, decode = pair["server"]["prefill"], pair["server"]["decode"]
    hashes = block_hashes(prefill, PROMPT)
    assert len(hashes) == 10

    # Act 1: the prefill answers; its prompt was computed in one step, whose blocks' copies to the host
    # tier (and so their writes to Redis) wait for a next step: the idle replica takes it on its own.
    complete(prefill, PROMPT, max_tokens=1)
    deadline = time.monotonic() + 5
    while in_redis(pair["redis"], hashes) < len(hashes):
        assert time.monotonic() < deadline, f"{in_redis(pair['redis'], hashes)} of 10 blocks in Redis"
        time.sleep(0.02)

    # Act 2: publish confirms it: every block is in Redis, none storing or missing.
    answer = publish(prefill, hashes)
    assert answer["object"] == "kv.publish" and answer["role"] == "prefill" and answer["shared_tier"]
    assert (answer["num_blocks"], answer["published"], answer["storing"], answer["missing"]) == (10, 10, 0, 0)
    assert in_redis(pair["redis"], hashes) == 10

    # Act 3: the decode replica answers the client's own request from those blocks: the prompt's
    # cacheable blocks all come from the remote tier, and the answer is a lone engine's.
    out = complete(decode, PROMPT, max_tokens=6)
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 10 * BLOCK_SIZE
    assert out["usage"]["kvtier"]["cached_tokens_by_tier"].get("remote") == 10 * BLOCK_SIZE
    assert out["choices"][0]["text"] == reference(tiny_dir, PROMPT, 6)

    # Act 4: publishing again is immediate: nothing left to write.
    again = publish(prefill, hashes, timeout_s=0)
    assert (again["published"], again["storing"], again["missing"]) == (10, 0, 0)


def test_publish_asks_redis_without_waiting_for_the_step_in_progress(pair: dict[str, Any]) -> None:
    # A prefill replica computing the next long prompt is inside a step for seconds. The blocks of the
    # last one are in Redis already: its first publish answers from Redis, not after that step.
    prefill = pair["server"]["prefill"]
    hashes = block_hashes(prefill, PROMPT)
    complete(prefill, PROMPT, max_tokens=1)
    deadline = time.monotonic() + 5
    while in_redis(pair["redis"], hashes) < len(hashes):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    engine = prefill.app.state.engine
    busy = threading.Thread(target=engine.call_sync, args=(lambda e: time.sleep(3.0),))
    busy.start()  # the engine thread is held for 3 s, as by a long step
    time.sleep(0.2)
    start = time.monotonic()
    answer = publish(prefill, hashes)
    assert answer["published"] == 10 and time.monotonic() - start < 1.5
    busy.join()


def test_unknown_blocks_are_missing_at_once_and_bad_bodies_are_400(pair: dict[str, Any]) -> None:
    prefill = pair["server"]["prefill"]
    answer = publish(prefill, ["ab" * 32, "cd" * 32])
    assert (answer["published"], answer["storing"], answer["missing"]) == (0, 0, 2)
    assert answer["seconds"] < 1.0  # settled: nothing will write them
    for body, param in (
        ({}, "block_hashes"),
        ({"block_hashes": ["xyz"]}, "block_hashes"),
        ({"block_hashes": ["zz" * 32]}, "block_hashes"),
        ({"block_hashes": [], "timeout_s": 99}, "timeout_s"),
        ({"block_hashes": [], "timeout_s": True}, "timeout_s"),
    ):
        r = httpx.post(prefill.url + "/v1/kv/publish", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_with_redis_down_publish_answers_at_once_and_decode_computes_the_prompt(
    pair: dict[str, Any], redis_server: RedisServer, tiny_dir: str
) -> None:
    prefill, decode = pair["server"]["prefill"], pair["server"]["decode"]
    prompt = PROMPT[::-1]
    redis_server.kill()
    complete(prefill, prompt, max_tokens=1)
    answer = publish(prefill, block_hashes(prefill, prompt), timeout_s=10)
    assert answer["seconds"] < 5.0 and answer["published"] == 0
    out = complete(decode, prompt, max_tokens=6)  # slower, never failed
    assert out["usage"]["kvtier"]["cached_tokens_by_tier"].get("remote", 0) == 0
    assert out["choices"][0]["text"] == reference(tiny_dir, prompt, 6)


def test_the_role_is_in_kv_info_and_on_metrics(tiny_dir: str) -> None:
    llm = engine(tiny_dir, None)
    server = serve(llm, "decode")
    plain = serve(llm, "both")
    try:
        assert httpx.get(server.url + "/v1/kv/info", timeout=10).json()["role"] == "decode"
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'kvtier:role{role="decode"} 1.0' in metrics and 'role="both"' not in metrics
        assert 'kvtier:role{role="both"} 1.0' in httpx.get(plain.url + "/metrics", timeout=10).text
        # no shared tier: publish says so at once, and the router then hands off without waiting
        answer = publish(server, ["ab" * 32])
        assert answer["shared_tier"] is False and answer["missing"] == 1
    finally:
        server.stop()
        plain.stop()
        llm.close()


def test_prefill_or_decode_without_a_remote_tier_is_a_config_error() -> None:
    for role in ("prefill", "decode"):
        with pytest.raises(ConfigError, match=f"--role {role} needs --kv-remote-url"):
            check_role(role, EngineArgs())
    remote = "redis://127.0.0.1:1/0"
    with pytest.raises(ConfigError, match="write_through"):
        check_role("prefill", EngineArgs(kv_remote_url=remote, kv_host_gb=1, kv_remote_policy="write_back"))
    check_role("decode", EngineArgs(kv_remote_url=remote, kv_host_gb=1, kv_remote_policy="write_back"))
    check_role("both", EngineArgs())
