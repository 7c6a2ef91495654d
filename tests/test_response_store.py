"""Stored responses (``previous_response_id``): the stores, the ids that name their replica, and the
router sending a continued conversation where it is kept. The Redis store runs on a real redis-server,
and two replicas sharing it continue each other's responses."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from kvtier.router.core import owner_first
from kvtier.router.policy import Decision
from kvtier.server.app import ServerSettings
from kvtier.server.response_store import (
    REDIS_PREFIX,
    MemoryResponses,
    RedisResponses,
    StoredResponse,
    new_item_id,
    new_response_id,
    open_response_store,
    owner_tag,
    replica_tag,
    response_of_item,
)
from kvtier.server.serve import BackgroundServer
from tests.served import served_llm

MODEL = "SmolLM2-135M-Instruct"


def stored(text: str) -> StoredResponse:
    item = {"id": "msg_1", "type": "message", "role": "user", "content": text}
    return StoredResponse("owner", [item], {"id": "resp_x", "output": []})


def test_a_response_id_names_the_replica_that_made_it() -> None:
    made = new_response_id("host-a:8000")
    assert made.startswith("resp_") and owner_tag(made) == replica_tag("host-a:8000") != replica_tag("host-b")
    assert new_response_id("host-a:8000") != made
    for foreign in ("resp_1", "msg_" + made[4:], made.upper(), made + "0", None, 7):
        assert owner_tag(foreign) is None


def test_an_item_id_names_the_response_that_holds_it() -> None:
    made = new_response_id("host-a:8000")
    item = new_item_id("msg", made)
    assert (
        item.startswith("msg_")
        and response_of_item(item) == made
        and response_of_item(new_item_id("fc", made))
    )
    assert new_item_id("msg", made) != item
    for foreign in ("msg_1", new_item_id("msg", None), new_item_id("msg", "resp_1"), item.upper(), item + "0",
                    item[:-1], "msg" + item[4:], made, None, 7):  # fmt: skip
        assert response_of_item(foreign) is None


def test_the_memory_store_keeps_the_most_recent_for_their_time() -> None:
    now = [0.0]
    store = MemoryResponses(max_entries=2, ttl_s=10, clock=lambda: now[0])
    for name in ("a", "b", "c"):
        store.put(name, stored(name))
    assert store.get("a") is None and store.get("b") is not None and len(store) == 2  # a: the oldest
    now[0] = 11.0
    assert store.get("b") is None  # expired
    assert store.delete("c") and not store.delete("c") and store.nbytes == 0
    small = MemoryResponses(max_bytes=2 * len(stored("x").to_json()))  # room for two by their bytes
    for name in ("a", "b", "c"):
        small.put(name, stored("x"))
    assert small.get("a") is None and small.get("c") is not None and small.nbytes <= small.max_bytes


def test_the_redis_store_signs_what_it_keeps(redis_server) -> None:  # noqa: ANN001 - the conftest fixture
    signed = RedisResponses(redis_server.url, secret="s3cret")
    signed.put("resp_a", stored("hello"))
    assert signed.get("resp_a") == stored("hello")
    assert RedisResponses(redis_server.url, secret="other").get("resp_a") is None  # not ours: a miss...
    assert signed.get("resp_a") is None  # ...and it is gone
    plain = RedisResponses(redis_server.url)
    plain.put("resp_b", stored("hi"))
    plain._client.set(REDIS_PREFIX + b"resp_c", b"{not json")
    assert plain.get("resp_b") == stored("hi") and plain.get("resp_c") is None
    assert plain._client.exists(REDIS_PREFIX + b"resp_c") == 0  # corrupt: removed
    assert plain.delete("resp_b") and plain.get("resp_b") is None
    with pytest.raises(Exception, match="needs a Redis URL"):
        open_response_store("redis", None)
    assert open_response_store("off", None) is None


def test_the_router_sends_a_continued_conversation_where_it_is_kept() -> None:
    """owner_first puts the replica named by previous_response_id (or by a referenced item's id) first,
    whatever the scores said."""
    replicas = [SimpleNamespace(info={"replica_id": rid}) for rid in ("a:1", "b:2", "c:3")]
    decision = Decision((0, 2, 1), "cache_hit", 40)
    continued = owner_first(decision, replicas, {"previous_response_id": new_response_id("b:2")})
    assert continued.ranking == (1, 0, 2) and continued.reason == "stored_response"
    assert owner_first(decision, replicas, {"previous_response_id": new_response_id("gone:9")}) == decision
    assert owner_first(decision, replicas, {"input": "hi"}) == decision
    item_id = new_item_id("msg", new_response_id("c:3"))
    referenced = {"input": [{"role": "user", "content": "hi"}, {"type": "item_reference", "id": "msg_1"},
                            {"type": "item_reference", "id": item_id}]}  # fmt: skip
    assert owner_first(decision, replicas, referenced) == decision  # the first reference names none
    del referenced["input"][1]
    assert owner_first(decision, replicas, referenced).ranking == (2, 0, 1)  # the one that made the item


def test_a_background_response_its_replica_no_longer_runs_reads_failed() -> None:
    """A restarted replica finds its background responses stored queued or in progress, and runs none
    of them: GET answers them failed. Another replica's, a running one and a finished one read as stored,
    unless the lease their replica renews while it runs them ran out."""
    from kvtier.server.responses_background import BackgroundRuns, as_seen

    runs = BackgroundRuns()
    mine = {"id": new_response_id("a:1"), "background": True, "status": "in_progress", "error": None}
    seen = as_seen(mine, runs, "a:1")
    assert seen["status"] == "failed" and "restarted" in seen["error"]["message"]
    assert as_seen({**mine, "status": "queued"}, runs, "a:1")["status"] == "failed"
    for same in ({**mine, "status": "completed"}, {**mine, "background": False}):
        assert as_seen(same, runs, "a:1") == same
    assert as_seen(mine, runs, "b:2") == mine and as_seen(mine, runs, None) == mine
    runs._runs[mine["id"]] = None  # type: ignore[assignment]  # running here
    assert as_seen(mine, runs, "a:1") == mine
    # any replica reads a response whose lease ran out failed: the replica running it went down
    leased = {**mine, "kvtier": {"lease_until": time.time() + 30}}
    assert as_seen(leased, BackgroundRuns(), "b:2") == leased
    lapsed = as_seen({**leased, "kvtier": {"lease_until": time.time() - 1}}, BackgroundRuns(), "b:2")
    assert (
        lapsed["status"] == "failed" and "went down" in lapsed["error"]["message"] and "kvtier" not in lapsed
    )


# ----------------------------------------------------------------------------------------- served
@pytest.fixture
def shared(redis_server) -> Iterator[tuple[BackgroundServer, BackgroundServer]]:  # noqa: ANN001
    settings = ServerSettings(
        model_name=MODEL,
        response_store="redis",
        response_store_url=redis_server.url,
        response_store_secret="s",
    )
    with served_llm(settings) as a, served_llm(settings) as b:
        yield a, b


def client(srv: BackgroundServer) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.slow
def test_story_replicas_sharing_redis_continue_each_others_responses(
    shared: tuple[BackgroundServer, BackgroundServer],
    redis_server,  # noqa: ANN001
) -> None:
    """The conversation lives in the deployment's Redis: a turn answered by one replica is continued on
    the other, and the answer is the one the first replica gives; with Redis down a continuation is a
    503 and a new answer is still answered (store: false)."""
    a, b = shared
    first = client(a).responses.create(
        model=MODEL, input="Name a colour.", max_output_tokens=10, temperature=0
    )
    on_b = client(b).responses.create(
        model=MODEL, input="Another?", previous_response_id=first.id, max_output_tokens=10, temperature=0
    )
    on_a = client(a).responses.create(
        model=MODEL, input="Another?", previous_response_id=first.id, max_output_tokens=10, temperature=0
    )
    assert on_b.output_text == on_a.output_text and on_b.usage.input_tokens == on_a.usage.input_tokens
    assert client(a).responses.retrieve(on_b.id).output_text == on_b.output_text
    redis_server.kill()
    down = httpx.post(
        b.url + "/v1/responses",
        json={"model": MODEL, "input": "x", "previous_response_id": first.id},
        timeout=30,
    )
    assert down.status_code == 503 and down.json()["error"]["code"] == "store_unavailable"
    answered = client(b).responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0)
    assert answered.output_text and answered.store is False


@pytest.mark.slow
def test_a_server_that_keeps_none_says_so() -> None:
    with served_llm(ServerSettings(model_name=MODEL, response_store="off")) as srv:
        answered = client(srv).responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0)
        assert answered.store is False
        with pytest.raises(BadRequestError, match="keeps no responses"):
            client(srv).responses.create(model=MODEL, input="Hi", previous_response_id=answered.id)
        with pytest.raises(NotFoundError):
            client(srv).responses.retrieve(answered.id)
