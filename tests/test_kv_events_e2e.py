"""KV events end to end on a tiny random model: an engine with device, host and disk tiers (small enough
that every medium evicts), served over real HTTP, publishing to a real redis-server. A consumer that
replays the replica's stream rebuilds exactly the blocks ``GET /v1/kv/blocks`` reports, and a router
computing hashes from ``GET /v1/kv/info`` finds the engine's blocks under them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from kvtier import LLM, SamplingParams
from kvtier.kv.hashing import hash_full_blocks, root_hash
from kvtier.kv_events import BlockIndex, replay
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.serve import BackgroundServer, serve_in_thread
from kvtier.stats import Medium
from kvtier.tiers.block_format import HEADER_NBYTES
from tests.redis_server import RedisServer

REPLICA = "replica-e2e:1"
API_KEY = "secret-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BLOCK_SIZE = 4
BLOCK_BYTES = 2 * BLOCK_SIZE * 2 * 2 * 16 * 4  # layers x block x (K, V) x kv heads x head dim x fp32
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_dir) -> str:  # noqa: ANN001
    return str(tiny_llama_dir(num_heads=4, num_kv_heads=2, hidden_size=64))


def engine_kwargs(redis_url: str, disk_dir: Path) -> dict[str, Any]:
    return dict(
        block_size=BLOCK_SIZE,
        kv_device_blocks=24,
        kv_host_gb=10 * BLOCK_BYTES / 2**30,  # 10 host blocks
        kv_disk_dir=str(disk_dir),
        kv_disk_gb=16 * (BLOCK_BYTES + HEADER_NBYTES) / 2**30,  # 16 disk files
        preemption_mode="swap",
        max_num_seqs=6,
        num_threads=1,
        kv_events_url=redis_url,
        kv_replica_id=REPLICA,
    )


def prompts(num: int, length: int, offset: int = 0) -> list[list[int]]:
    return [[(7 * i + 13 * j + offset) % 500 + 3 for j in range(length)] for i in range(num)]


def serve(llm: LLM) -> BackgroundServer:
    app = create_app(lambda: llm.engine, ServerSettings(model_name="tiny", api_key=API_KEY))
    server = serve_in_thread(app)
    server.wait_ready(60)
    return server


def get(server: BackgroundServer, path: str, **params: Any) -> dict[str, Any]:
    r = httpx.get(server.url + path, headers=AUTH, params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def quiet_snapshot(server: BackgroundServer, timeout: float = 15.0) -> dict[str, Any]:
    """``/v1/kv/blocks`` once the replica has settled: an idle server goes on for a moment after its
    last answer (the last copies, disk writes, the pool's next evictions written back ahead), so wait
    for a batch number that holds still."""
    snapshot = get(server, "/v1/kv/blocks")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.3)
        again = get(server, "/v1/kv/blocks")
        if again["seq"] == snapshot["seq"]:
            return again
        snapshot = again
    raise AssertionError("the replica never settled")


def replay_until(client: redis.Redis, seq: int, instance: str, timeout: float = 15.0) -> BlockIndex:
    """Replay the stream until the consumer has reached batch ``seq`` of ``instance`` (published in the
    background, so it may lag the HTTP answer a little)."""
    index = BlockIndex()
    deadline = time.monotonic() + timeout
    while True:
        replay(client, REPLICA, index)
        if (index.instance, index.seq) == (instance, seq) or time.monotonic() > deadline:
            return index
        time.sleep(0.05)


def as_sets(snapshot: dict[str, Any]) -> dict[str, set[str]]:
    return {medium: set(hashes) for medium, hashes in snapshot["blocks"].items() if hashes}


@pytest.fixture()
def served(
    tiny_dir: str, redis_server: RedisServer, tmp_path: Path
) -> Iterator[tuple[LLM, BackgroundServer]]:
    llm = LLM(tiny_dir, **engine_kwargs(redis_server.url, tmp_path / "disk"))
    # A batch bigger than the device pool: swap preemption, device and host evictions, disk demotions.
    llm.generate(prompts(12, 14), GREEDY, cache_salt="tenant-a")
    server = serve(llm)
    yield llm, server
    server.stop()


def test_a_consumer_replaying_the_stream_rebuilds_exactly_the_snapshot(
    served: tuple[LLM, BackgroundServer], redis_server: RedisServer
) -> None:
    llm, server = served
    for prompt in prompts(6, 10, offset=200):  # more traffic over HTTP, another tenant
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "cache_salt": "b"}
        r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
    snapshot = quiet_snapshot(server)
    assert snapshot["replica_id"] == REPLICA and snapshot["block_size"] == BLOCK_SIZE
    assert set(snapshot["blocks"]) == {"device", "host", "disk"}
    assert all(snapshot["blocks"][m] for m in ("device", "host", "disk")), "every medium should hold blocks"
    stats = llm.engine.stats()
    assert stats.num_preemptions.get("swap", 0) > 0  # private swap blocks went through the host tier
    for medium in (Medium.DEVICE, Medium.HOST, Medium.DISK):
        assert stats.tiers[medium].blocks_evicted > 0, (
            f"{medium} never evicted: the test would not see removals"
        )

    index = replay_until(redis.Redis.from_url(redis_server.url), snapshot["seq"], snapshot["instance"])
    assert (index.instance, index.seq, index.gaps) == (snapshot["instance"], snapshot["seq"], 0)
    assert index.hex_blocks() == as_sets(snapshot)

    only = get(server, "/v1/kv/blocks", medium=["host", "disk"])
    assert set(only["blocks"]) == {"host", "disk"} and only["seq"] == snapshot["seq"]
    assert get(server, "/v1/kv/blocks", medium="device,disk")["blocks"].keys() == {"device", "disk"}


def test_a_restarted_replica_clears_its_old_blocks_and_announces_its_disk(
    tiny_dir: str, redis_server: RedisServer, tmp_path: Path
) -> None:
    kwargs = engine_kwargs(redis_server.url, tmp_path / "disk")
    with LLM(tiny_dir, **kwargs) as first:
        first.generate(prompts(8, 14), GREEDY)
    second = LLM(tiny_dir, **kwargs)
    server = serve(second)
    try:
        snapshot = get(server, "/v1/kv/blocks")
        assert (
            snapshot["blocks"]["disk"] and not snapshot["blocks"]["device"] and not snapshot["blocks"]["host"]
        )
        index = replay_until(redis.Redis.from_url(redis_server.url), snapshot["seq"], snapshot["instance"])
        assert index.hex_blocks() == as_sets(snapshot)  # from the very first entry of the stream
        assert index.gaps == 0 and snapshot["seq"] == 1  # "cleared" + the disk files, one batch
    finally:
        server.stop()


def test_info_lets_a_router_compute_the_engines_block_hashes(served: tuple[LLM, BackgroundServer]) -> None:
    llm, server = served
    info = get(server, "/v1/kv/info")
    engine = llm.engine
    assert info["object"] == "kv.info" and info["model"] == "tiny" and info["replica_id"] == REPLICA
    assert info["hash_spec_version"] == 1 and info["block_size"] == BLOCK_SIZE
    assert info["cache_identity"] == f"{info['model_fingerprint']}:{info['kv_dtype']}"
    assert info["model_fingerprint"] == engine.loaded.fingerprint and info["kv_dtype"] == "float32"
    assert info["media"] == ["device", "host", "disk"]
    assert info["events"]["stream"] == f"kvtier:v1:events:{REPLICA}" and info["events"]["enabled"]

    prompt = prompts(1, 4 * BLOCK_SIZE + 2, offset=400)[0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_salt": "router"}
    assert httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    root = root_hash((info["cache_identity"], "router"))  # computed from /v1/kv/info alone
    expected = [h.hex() for h in hash_full_blocks(prompt, info["block_size"], root)]
    held = set(get(server, "/v1/kv/blocks", medium="device")["blocks"]["device"])
    assert len(expected) == 4 and set(expected) <= held
    unsalted = hash_full_blocks(prompt, info["block_size"], root_hash((info["cache_identity"], "")))
    assert not {h.hex() for h in unsalted} & held  # the salt is part of the key


def test_kv_routes_need_the_key_and_reject_an_unknown_medium(served: tuple[LLM, BackgroundServer]) -> None:
    _, server = served
    r = httpx.get(server.url + "/v1/kv/blocks", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/v1/kv/info", timeout=30)
    assert r.status_code == 401
    r = httpx.get(server.url + "/v1/kv/blocks", headers=AUTH, params={"medium": "tape"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "medium"
