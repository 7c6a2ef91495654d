"""``kvtier router`` end to end: a real redis-server, two real ``kvtier serve`` replicas (a tiny random
model, block size 4, a shared Redis tier, KV events) and the router itself, each its own process on
loopback. The stories: hashes pinned against a replica, a returning conversation, a burst, streaming
passed through chunk for chunk, an aborted stream, the error contract, polling mode, a router restart,
a replica killed and brought back. Slow (processes start with torch): the module shares them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.redis_server import RedisServer, free_port

pytestmark = pytest.mark.slow

KEY = "router-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN_KEY = "router-admin-key"  # /admin takes this one only (kvtier.router.auth)
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
BLOCK_SIZE = 4
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class Proc:
    """A ``kvtier`` subprocess on a fixed port (so that it can be restarted where it was)."""

    def __init__(self, args: list[str], port: int | None = None, log: Path | None = None) -> None:
        self.args = args
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115
        cmd = [sys.executable, "-m", "kvtier.cli", *self.args, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=out, env=ENV)
        return self

    def wait_healthy(self, timeout: float = 120.0) -> Proc:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None and self.proc.poll() is None, (
                f"{self.args[0]} exited: see {self.log}"
            )
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{self.url} not healthy in {timeout} s"
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


def replica_args(model: Path, redis_url: str, name: str) -> list[str]:
    return [
        "serve", "--model", str(model), "--block-size", str(BLOCK_SIZE), "--kv-device-blocks", "96",
        "--kv-host-gb", "0.0002", "--kv-remote-url", redis_url, "--kv-replica-id", name,
        "--num-threads", "1", "--api-key", KEY, "--log-level", "warning",
    ]  # fmt: skip


def router_args(replicas: list[Proc], redis_url: str | None, model: Path, *extra: str) -> list[str]:
    keys = ["--api-key", KEY, "--admin-key", ADMIN_KEY]
    args = ["router", "--model", str(model), *keys, "--log-level", "warning", *extra]
    for r in replicas:
        args += ["--replica", r.url]
    return args + (["--kv-remote-url", redis_url] if redis_url else [])


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:  # noqa: ANN001
    model = tiny_llama_dir(max_position_embeddings=512)
    logs = tmp_path_factory.mktemp("router_logs")
    redis = RedisServer(logs / "redis").start()
    replicas = [
        Proc(replica_args(model, redis.url, f"r{i}"), log=logs / f"r{i}.log").start() for i in range(2)
    ]
    router = Proc(router_args(replicas, redis.url, model), log=logs / "router.log").start()
    try:
        for p in (*replicas, router):
            p.wait_healthy()
        wait_for(lambda: all(r["index_source"] == "events" for r in state(router)["replicas"]), 20)
        yield {"model": model, "redis": redis, "replicas": replicas, "router": router, "logs": logs}
    finally:
        for p in (router, *replicas):
            p.kill()
        redis.stop()


# ---------------------------------------------------------------------------------------- helpers
def wait_for(check: Callable[[], Any], timeout: float, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not true within {timeout} s"
        time.sleep(step)


def state(router: Proc) -> dict[str, Any]:
    return httpx.get(router.url + "/router/state", headers=AUTH, timeout=5).json()


def replica_state(router: Proc, replica: Proc) -> dict[str, Any]:
    return next(r for r in state(router)["replicas"] if r["url"] == replica.url)


def chat(system: str, *turns: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": None, "messages": messages, "max_tokens": 3, "temperature": 0, **extra}


def post(url: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
    body = {k: v for k, v in body.items() if v is not None}
    return httpx.post(url + path, json=body, headers=AUTH, timeout=60)


def explain(router: Proc, body: dict[str, Any], endpoint: str = "chat") -> dict[str, Any]:
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(router.url + "/router/explain", json={"endpoint": endpoint, "request": body}, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def load_settled(router: Proc, *replicas: Proc) -> None:
    """Wait until the router's load for ``replicas`` is from after now. A health answer sent while a
    request ran can still arrive (running 1: a queued request outweighs computing a short prompt, and
    the router would send a cache hit elsewhere). Health rounds are sequential: two more answers."""
    for replica in replicas:
        checks = replica_state(router, replica)["health_checks"]
        wait_for(lambda r=replica, n=checks: replica_state(router, r)["health_checks"] >= n + 2, 5)


def goes_to(
    router: Proc, body: dict[str, Any], replica: Proc | str, endpoint: str = "chat"
) -> dict[str, Any] | None:
    """The router's decision when it sends ``body`` to ``replica`` for a cache hit, else None."""
    url = replica if isinstance(replica, str) else replica.url
    decided = explain(router, body, endpoint)
    return decided if decided["ranking"][0] == url and decided["reason"] == "cache_hit" else None


def kv_blocks(replica: Proc) -> set[str]:
    blocks = httpx.get(replica.url + "/v1/kv/blocks", headers=AUTH, timeout=10).json()["blocks"]
    return set(blocks.get("device", [])) | set(blocks.get("host", []))


def running(replica: Proc) -> int:
    text = httpx.get(replica.url + "/metrics", timeout=5).text
    return int(float(re.search(r"^kvtier:num_requests_running(?:\{[^}]*\})? (\S+)$", text, re.M).group(1)))


def long_system(tag: str, words: int = 60) -> str:
    return f"[{tag}] " + " ".join(f"fact {tag}{i} the cache block" for i in range(words // 4))


# ---------------------------------------------------------------------------------------- stories
def test_story_router_hashes_are_the_engines(cluster: dict[str, Any]) -> None:
    """Act 1: a chat request through the router; every block hash the router computes for it is a block
    the replica that ran it now holds, and there is one per full block of the prompt. Act 2: the same
    request with a cache_salt: other hashes, held too. Act 3: the router now sends it there (cache hit)."""
    router = cluster["router"]
    for salt in (None, "tenant-a"):
        body = chat(long_system("pin"), "What is in the cache?", cache_salt=salt)
        r = post(router.url, body)
        assert r.status_code == 200, r.text
        served = next(p for p in cluster["replicas"] if p.url == r.headers["x-kvtier-replica"])
        mine = explain(router, body)
        hashes = mine["per_replica"][served.url]
        assert mine["num_tokens"] == r.json()["usage"]["prompt_tokens"]
        assert len(hashes) == mine["num_tokens"] // BLOCK_SIZE > 10
        assert set(hashes) <= kv_blocks(served)
        if salt is None:
            unsalted = hashes
        else:
            assert not set(hashes) & set(unsalted)
    decided = wait_for(lambda: goes_to(router, body, served), 5)
    assert decided["cached_tokens"] >= len(hashes) * BLOCK_SIZE - BLOCK_SIZE


def test_a_batched_completion_goes_where_one_of_its_prompts_is(cluster: dict[str, Any]) -> None:
    """A completion runs on one replica; then a two-prompt completion whose *second* prompt is that one
    goes there, for a cache hit worth the held prompt's full blocks."""
    router = cluster["router"]
    held = long_system("batched")
    r = post(router.url, {"prompt": held, "max_tokens": 2, "temperature": 0}, path="/v1/completions")
    assert r.status_code == 200, r.text
    served, prompt_tokens = r.headers["x-kvtier-replica"], r.json()["usage"]["prompt_tokens"]
    load_settled(router, *cluster["replicas"])
    batch = {"prompt": [long_system("never seen"), held], "max_tokens": 2, "temperature": 0}
    decided = wait_for(lambda: goes_to(router, batch, served, endpoint="completions"), 5)
    assert decided["cached_tokens"] >= prompt_tokens - BLOCK_SIZE
    # Prompt logprobs (echo + logprobs): the replica computes the prompt whole, so no cache counts.
    scored = explain(router, {"prompt": held, "max_tokens": 1, "echo": True, "logprobs": 1}, "completions")
    assert scored["reason"] == "load" and scored["cached_tokens"] == 0


def test_story_a_returning_conversation_goes_home(cluster: dict[str, Any]) -> None:
    """Four users, one turn each (spread over both replicas), then each one's second turn: every user
    comes back to the replica that holds their conversation. Each replica's 96-block pool holds both
    of its users' conversations (~35 blocks each): with longer ones (~51 blocks) a home replica evicted
    part of a user's prefix to Redis, where the other replica could load it almost as cheaply, and
    the two costs fell within the policy's near-tie slack (46.8 against 48.4 tokens): then the
    replicas take turns, and the explain and the post got different turns."""
    router = cluster["router"]
    homes, firsts = {}, {}
    for user in range(4):
        body = chat(long_system(f"user{user}", 32), f"Hello from user {user}")
        r = post(router.url, body)
        assert r.status_code == 200, r.text
        homes[user] = r.headers["x-kvtier-replica"]
        firsts[user] = r.json()["choices"][0]["message"]["content"]
    assert len(set(homes.values())) == 2  # the first turns spread
    for user in range(4):
        body = chat(long_system(f"user{user}", 32), f"Hello from user {user}", firsts[user], "And then?")
        load_settled(router, *cluster["replicas"])
        wait_for(lambda b=body, u=user: goes_to(router, b, homes[u]), 5)
        r = post(router.url, body)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvtier-replica"] == homes[user], (explain(router, body), state(router))
    routed = Counter()
    for rep in state(router)["replicas"]:
        routed.update(rep["routed"])
    assert routed["cache_hit"] >= 4


def test_a_burst_of_one_prefix_spreads(cluster: dict[str, Any]) -> None:
    """Eight concurrent requests sharing one new long prefix: both replicas take a share."""
    router = cluster["router"]
    system = long_system("burst", 100)
    served: list[str] = []

    def one(i: int) -> None:
        r = post(router.url, chat(system, f"question {i}", max_tokens=8, ignore_eos=True))
        assert r.status_code == 200, r.text
        served.append(r.headers["x-kvtier-replica"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    counts = Counter(served)
    assert len(served) == 8 and len(counts) == 2 and min(counts.values()) >= 2, counts


def test_a_prompt_cache_key_keeps_an_agents_new_prompts_on_one_replica(cluster: dict[str, Any]) -> None:
    """Four new prompts (no shared prefix) go round the replicas; with one prompt_cache_key they all go
    where the first went (the replica then holds what the key's requests share)."""
    router = cluster["router"]
    served: dict[str | None, list[str]] = {None: [], "agent-42": []}
    for key in served:
        for i in range(4):
            body = chat(long_system(f"aff-{key}-{i}", 40), "Go on.", prompt_cache_key=key)
            r = post(router.url, body)
            assert r.status_code == 200, r.text
            served[key].append(r.headers["x-kvtier-replica"])
            load_settled(router, *cluster["replicas"])
    assert len(set(served[None])) == 2, served
    assert len(set(served["agent-42"])) == 1, served


def sse_events(text: str) -> list[dict[str, Any] | str]:
    """The stream's events, with the per-request fields (id, created) taken out."""
    events: list[dict[str, Any] | str] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        if data == "[DONE]":
            events.append(data)
            continue
        event = json.loads(data)
        event.pop("id"), event.pop("created")
        events.append(event)
    return events


def test_streaming_is_the_replicas_stream_chunk_for_chunk(cluster: dict[str, Any]) -> None:
    """The same greedy stream, warm on replica 0, through the router (which sends it there) and straight
    to the replica: the same events in the same order (only the request id and time differ)."""
    router, home = cluster["router"], cluster["replicas"][0]
    body = chat(long_system("stream"), "Stream it", max_tokens=12, ignore_eos=True, stream=True)
    body["stream_options"] = {"include_usage": True}
    assert post(home.url, body).status_code == 200  # the prefix is now on replica 0 (device)
    load_settled(router, home)
    wait_for(lambda: explain(router, body)["ranking"][0] == home.url, 5)
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-kvtier-replica"] == home.url
        through = r.read().decode()
    direct = post(home.url, body).text
    got, want = sse_events(through), sse_events(direct)
    assert got == want and len(got) > 5 and got[-1] == "[DONE]"  # tokens may merge (UTF-8 pieces)
    assert got[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_an_aborted_stream_frees_the_replica(cluster: dict[str, Any]) -> None:
    """A client reads two chunks of a long stream and leaves: the replica's request ends (running 0)
    and the router forgets it (in flight 0)."""
    router = cluster["router"]
    body = chat(long_system("abort", 40), "Go on forever", max_tokens=200, ignore_eos=True, stream=True)
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200, r.read()
        replica = next(p for p in cluster["replicas"] if p.url == r.headers["x-kvtier-replica"])
        chunks = r.iter_raw()
        next(chunks), next(chunks)
        assert running(replica) == 1
    wait_for(lambda: running(replica) == 0, 5)
    wait_for(lambda: all(rep["in_flight"] == 0 for rep in state(router)["replicas"]), 5)


def test_the_error_contract_is_the_replicas(cluster: dict[str, Any]) -> None:
    router = cluster["router"]
    body = chat("hi", "hello")
    r = httpx.post(router.url + "/v1/chat/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = post(router.url, {"messages": "not a list"})  # the replica's own 400, passed back
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post(router.url, {**body, "model": "no-such-model"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(router.url + "/v1/chat/completions", content=b"{oops", headers=AUTH)
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.get(router.url + "/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    models = httpx.get(router.url + "/v1/models", headers=AUTH).json()
    assert models["data"][0]["object"] == "model"
    r = httpx.post(router.url + "/admin/replicas", json={"url": "ftp://x"}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "url"
    r = httpx.post(router.url + "/admin/replicas", json={"url": "ftp://x"}, headers=AUTH)  # a client's key
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_the_tokenizer_routes_pass_through(cluster: dict[str, Any]) -> None:
    """/tokenize and /detokenize through the router answer as a replica does, errors included."""
    router, replica = cluster["router"], cluster["replicas"][0]
    body = {"prompt": "The cache remembers."}
    mine = httpx.post(router.url + "/tokenize", json=body, headers=AUTH, timeout=30)
    theirs = httpx.post(replica.url + "/tokenize", json=body, headers=AUTH, timeout=30)
    assert mine.status_code == 200 and mine.json() == theirs.json()
    back = httpx.post(router.url + "/detokenize", json={"tokens": mine.json()["tokens"]}, headers=AUTH)
    assert back.json() == {"prompt": body["prompt"]}
    bad = httpx.post(router.url + "/tokenize", json={}, headers=AUTH, timeout=30)
    assert (
        bad.status_code == 400
        and bad.json() == httpx.post(replica.url + "/tokenize", json={}, headers=AUTH).json()
    )


def test_polling_mode_without_redis_says_so_and_still_routes_by_cache(cluster: dict[str, Any]) -> None:
    """A second router, no --kv-remote-url: /metrics says polling; it finds a conversation's home."""
    replicas = cluster["replicas"]
    poller = Proc(router_args(replicas, None, cluster["model"]), log=cluster["logs"] / "poller.log")
    poller.start().wait_healthy(30)
    try:
        metrics = httpx.get(poller.url + "/metrics").text
        assert 'kvtier_router:index_mode{mode="polling"} 1.0' in metrics
        body = chat(long_system("poll"), "Where am I?")
        home = post(replicas[1].url, body)  # straight to replica 1
        assert home.status_code == 200
        wait_for(lambda: goes_to(poller, body, replicas[1]), 5)
        assert {r["index_source"] for r in state(poller)["replicas"]} == {"polling"}
    finally:
        poller.kill()


def test_a_restarted_router_routes_by_cache_within_5_s(cluster: dict[str, Any]) -> None:
    router, replicas = cluster["router"], cluster["replicas"]
    body = chat(long_system("restart"), "Remember me")
    home = post(replicas[0].url, body)
    assert home.status_code == 200
    wait_for(lambda: explain(router, body)["ranking"][0] == replicas[0].url, 5)
    router.kill()
    start = time.monotonic()
    router.start().wait_healthy(30)
    up = time.monotonic()
    wait_for(lambda: goes_to(router, body, replicas[0]), 5)
    print(
        f"router restart: up {up - start:.2f} s after start, cache-aware {time.monotonic() - up:.2f} s later"
    )
    assert time.monotonic() - up < 5
    # The shared tier's blocks come back too: the replica's snapshot lists those it announced.
    wait_for(lambda: replica_state(router, replicas[0])["indexed_blocks"]["remote"] > 0, 5)


def remote_blocks_used(replica: Proc) -> int:
    """The blocks ``replica`` knows in the shared tier (its ``/metrics``): what it announced there."""
    text = httpx.get(replica.url + "/metrics", timeout=5).text
    found = re.search(r'^kvtier:tier_used_blocks\{[^}]*tier="remote"[^}]*\} (\S+)$', text, re.M)
    assert found, "no remote tier in the replica's /metrics"
    return int(float(found.group(1)))


def test_story_a_restarted_redis_is_empty_and_the_router_knows(cluster: dict[str, Any]) -> None:
    """Redis dies and comes back empty while nobody sends a request. Within seconds each replica notices
    (it asks the store every second when idle), forgets what it had announced there and writes its host
    tier's blocks again; the router forgets the remote blocks too. From then on the router counts, for
    each replica, exactly the blocks the replica knows in the new Redis, and the store holds them: never
    a stale cheap hit, none missed. The conversation goes home: its own tiers hold it."""
    import redis as redis_py

    router, replicas, redis = cluster["router"], cluster["replicas"], cluster["redis"]
    body = chat(long_system("outage"), "Where do I live?")
    assert post(replicas[1].url, body).status_code == 200
    wait_for(lambda: explain(router, body)["cached_tokens"] > 0, 5)
    wait_for(lambda: replica_state(router, replicas[1])["indexed_blocks"]["remote"] > 0, 5)
    wait_for(lambda: remote_blocks_used(replicas[1]) > 0, 5)
    redis.kill()
    redis.start()
    wait_for(
        lambda: (
            state(router)["redis_ok"]
            and all(r["index_source"] == "events" for r in state(router)["replicas"])
        ),
        20,
    )
    store = redis_py.Redis.from_url(redis.url)

    seen: list[tuple[int, list[tuple[int, int]]]] = []  # (in the store, [(indexed, used) a replica])

    def true_to_the_store() -> bool:
        in_store = sum(1 for _ in store.scan_iter(match="kvtier:v1:*"))
        counts = [
            (replica_state(router, r)["indexed_blocks"]["remote"], remote_blocks_used(r)) for r in replicas
        ]
        seen.append((in_store, counts))
        # Exactly what each replica knows there. Loaded CI runs once saw (72, 104) for good: the router
        # resynced while a replica wrote its host blocks again (32 a round), and replayed the stream's
        # "removed" over a newer snapshot, losing the round written in between. That interleaving is
        # pinned down in tests/test_router_resync.py; here it only happens on a loaded machine.
        return all(indexed == used <= in_store for indexed, used in counts)

    try:
        # the replicas write their host tiers to the new Redis and announce it: seconds on a loaded
        # 2-core CI machine
        wait_for(true_to_the_store, 30)
    except AssertionError:
        raise AssertionError(f"router vs replicas vs store, last seen: {seen[-1]}") from None
    finally:
        store.close()
    assert goes_to(router, body, replicas[1])  # its own tiers hold it
    assert post(router.url, body).headers["x-kvtier-replica"] == replicas[1].url


@contextlib.contextmanager
def stream_on(router: Proc, replica: Proc) -> Iterator[tuple[bytes, Iterator[bytes]]]:
    """A long stream through the router that landed on ``replica`` (others are opened and dropped until
    one does): its first chunk and the iterator over the rest."""
    body = chat("long", "Go on", max_tokens=300, ignore_eos=True, stream=True)
    for _ in range(20):
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, headers=AUTH) as r:
            if r.headers["x-kvtier-replica"] != replica.url:
                continue
            chunks = r.iter_raw()
            yield next(chunks), chunks
            return
    raise AssertionError(f"no stream landed on {replica.url}")


def test_story_a_killed_replica_and_its_return(cluster: dict[str, Any]) -> None:
    """Act 1: requests keep coming while replica 1 is killed in the middle of a stream: no request
    fails (one in progress on it may be retried), the stream it broke ends with an error event and
    [DONE], and within 2 s the router reports it down and sends it nothing more. Act 2: it comes back
    on its port: the router takes it in again. Act 3: it is removed and re-added via /admin/replicas."""
    router, replicas = cluster["router"], cluster["replicas"]
    failures: list[str] = []
    served: list[tuple[float, str]] = []
    stop = threading.Event()

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            r = post(router.url, chat(long_system(f"kill{k}"), f"turn {i}", max_tokens=2))
            i += 1
            if r.status_code != 200:
                failures.append(r.text)
            else:
                served.append((time.monotonic(), r.headers["x-kvtier-replica"]))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        with stream_on(router, replicas[1]) as (first, rest):
            replicas[1].kill()
            killed = time.monotonic()
            broken = (first + b"".join(rest)).decode()
        assert "the replica broke off the stream" in broken and broken.endswith("data: [DONE]\n\n")
        wait_for(lambda: not replica_state(router, replicas[1])["healthy"], 2)
        assert time.monotonic() - killed < 2
        time.sleep(killed + 4 - time.monotonic())  # two more seconds of traffic after the first 2 s
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert failures == []
    assert not [url for t, url in served if t > killed + 2 and url == replicas[1].url]
    assert len([1 for t, _ in served if t > killed + 2]) > 0

    replicas[1].start().wait_healthy()
    wait_for(lambda: replica_state(router, replicas[1])["index_source"] == "events", 5)
    r = httpx.request("DELETE", router.url + "/admin/replicas", json={"url": replicas[1].url}, headers=ADMIN)
    assert r.status_code == 200 and len(state(router)["replicas"]) == 1
    r = httpx.post(router.url + "/admin/replicas", json={"url": replicas[1].url + "/"}, headers=ADMIN)
    assert r.status_code == 200
    assert r.json() == {"object": "router.replica", "url": replicas[1].url, "healthy": True}
    assert [rep["healthy"] for rep in state(router)["replicas"]] == [True, True]


def broken_replica(info: dict[str, Any], status: int) -> Any:
    """An HTTP server that passes the router's health and identity checks (the real replica's
    /v1/kv/info, no blocks) but answers every chat completion ``status``, as a draining replica does."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response

    from kvtier.server.serve import serve_in_thread

    app = FastAPI()
    error = {"error": {"message": "going away", "type": "server_error", "param": None, "code": None}}

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(b"")

    @app.get("/v1/kv/info")
    def kv_info() -> dict[str, Any]:
        return {**info, "replica_id": "broken", "events": {"enabled": False}}

    @app.get("/v1/kv/blocks")
    def kv_blocks() -> dict[str, Any]:
        return {"object": "kv.blocks", "instance": None, "seq": None, "blocks": {"device": []}}

    @app.post("/v1/chat/completions")
    def completions() -> JSONResponse:
        return JSONResponse(error, status_code=status)

    return serve_in_thread(app)


def test_a_failure_before_the_first_byte_is_retried_once_elsewhere(cluster: dict[str, Any]) -> None:
    """A replica that looks healthy but answers every completion 503 (as a draining one does) or 500:
    each request sent to it first is retried on a real replica; no client sees the failure."""
    router, real = cluster["router"], cluster["replicas"]
    info = httpx.get(real[0].url + "/v1/kv/info", headers=AUTH).json()
    for status in (503, 500):
        broken = broken_replica(info, status)
        try:
            r = httpx.post(router.url + "/admin/replicas", json={"url": broken.url}, headers=ADMIN)
            assert r.json()["healthy"] is True
            retried_before = sum(rep["routed"].get("retry", 0) for rep in state(router)["replicas"])
            served = []
            for i in range(6):
                salt = (
                    f"retry{status}-{i}"  # nothing cached anywhere: the broken replica ties with the others
                )
                r = post(router.url, chat(long_system(salt), "hello", cache_salt=salt))
                assert r.status_code == 200, r.text
                served.append(r.headers["x-kvtier-replica"])
            assert broken.url not in served
            mine = next(rep for rep in state(router)["replicas"] if rep["url"] == broken.url)
            assert mine["routed"]["load"] >= 1 and mine["in_flight"] == 0
            retried = sum(rep["routed"].get("retry", 0) for rep in state(router)["replicas"])
            assert retried - retried_before == mine["routed"]["load"]
        finally:
            httpx.request("DELETE", router.url + "/admin/replicas", json={"url": broken.url}, headers=ADMIN)
            broken.stop()


def test_a_request_waiting_on_a_hung_replica_is_retried_elsewhere(cluster: dict[str, Any]) -> None:
    """A replica hangs (SIGSTOP: it still accepts connections, it never answers). A returning
    conversation sent home to it waits only until the health checks time out; nothing reached the
    client yet, so the router retries it on the other replica. Then the replica wakes up and is back."""
    router, (home, other) = cluster["router"], cluster["replicas"]
    body = chat(long_system("hung"), "Are you still there?")
    assert post(home.url, body).status_code == 200
    wait_for(lambda: goes_to(router, body, home), 5)
    assert home.proc is not None
    home.proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        r = post(router.url, body)
        waited = time.monotonic() - start
        assert r.status_code == 200, r.text
        assert r.headers["x-kvtier-replica"] == other.url
        assert not replica_state(router, home)["healthy"]
        assert waited < 20, waited  # ~2 timed-out health checks, then the retry's own prefill
    finally:
        home.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: replica_state(router, home)["healthy"], 15)
    assert replica_state(router, home)["in_flight"] == 0


def generated(replica: Proc) -> int:
    text = httpx.get(replica.url + "/metrics", timeout=5).text
    return int(float(re.search(r"^kvtier:generation_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M).group(1)))


def test_a_client_leaving_a_plain_request_frees_the_replica(cluster: dict[str, Any]) -> None:
    """Not streamed: the client gives up after 0.3 s; the router closes its connection to the replica,
    which aborts the request (running back to 0, far fewer than the 4 x 320 tokens asked for generated)
    instead of generating for nobody."""
    router, replicas = cluster["router"], cluster["replicas"]
    before = sum(generated(p) for p in replicas)
    body = chat("Be long.", "Take your time", max_tokens=320, n=4, ignore_eos=True, temperature=1.0, seed=1)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=0.3)
    wait_for(lambda: all(running(p) == 0 for p in replicas), 5)
    wait_for(lambda: all(rep["in_flight"] == 0 for rep in state(router)["replicas"]), 5)
    time.sleep(0.5)
    assert sum(generated(p) for p in replicas) - before < 4 * 320
