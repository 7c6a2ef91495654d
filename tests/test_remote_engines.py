"""The remote tier with the real model: two engine processes share one redis-server, and Redis dies
(the real process, by pid) while requests generate. The cache never changes the answer: every greedy
output equals a run with no tiers, and the statistics prove the remote tier really served."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
from typing import Any

import pytest

from kvtier.config import EngineArgs
from kvtier.engine import LLMEngine
from kvtier.llm import LLM
from kvtier.sampling_params import SamplingParams
from kvtier.stats import Medium
from tests.redis_server import RedisServer

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
LONG_DOC = " ".join(f"Record {i}: the shipment to depot {i % 7} weighs {i * 13 % 97} kg." for i in range(40))
QUESTIONS = ["Which depot gets record 5?", "What does record 12 weigh?", "Summarize the records."]


def prompts_for(tag: str) -> list[str]:
    return [f"{LONG_DOC}\n[{tag}] {q}" for q in QUESTIONS]


def _engine_process(url: str, prompts: list[str], queue: Any) -> None:
    """One engine in a process of its own: generate, report outputs and remote statistics, flush."""
    with LLM(kv_device_blocks=256, kv_host_gb=0.05, kv_remote_url=url, num_threads=1) as llm:
        outs = llm.generate(prompts, GREEDY)
        llm.engine.flush_tiers()  # the write-through stores still in flight land
        remote = llm.engine.stats().tiers[Medium.REMOTE]
        queue.put(
            (
                [o.outputs[0].token_ids for o in outs],
                [int(o.cached_tokens_by_tier.get(Medium.REMOTE, 0)) for o in outs],
                remote.hit_blocks,
                remote.blocks_stored,
            )
        )


def _run_in_process(url: str, prompts: list[str]) -> tuple[list[list[int]], list[int], int, int]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_engine_process, args=(url, prompts, queue))
    proc.start()
    try:
        result = queue.get(timeout=300)
    finally:
        proc.join(60)
    assert proc.exitcode == 0
    return result


def reference(prompts: list[str]) -> list[list[int]]:
    with LLM(kv_device_blocks=256) as plain:
        return [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]


def test_second_engine_process_is_served_from_the_first_ones_blocks(
    redis_server: RedisServer, converted_default_model: Any
) -> None:
    prompts = prompts_for("shared")
    expected = reference(prompts)
    first, first_remote, first_hits, stored = _run_in_process(redis_server.url, prompts)
    assert first == expected and stored > 0 and first_hits == 0
    second, second_remote, second_hits, _ = _run_in_process(redis_server.url, prompts)
    assert second == expected  # the remote tier never changes the answer
    assert second_hits > 0 and second_remote[0] >= 16 * 30  # the long shared document came from Redis


def _engine(url: str) -> LLMEngine:
    args = EngineArgs(kv_device_blocks=256, kv_host_gb=0.05, kv_remote_url=url, num_threads=1)
    return LLMEngine(args)


def _generate_all(engine: LLMEngine, prompts: list[str], on_step: Any = None) -> list[list[int]]:
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
        if on_step is not None:
            on_step(step)
    return [done[i] for i in ids]


def test_redis_killed_mid_run_every_request_completes_exactly_and_hits_resume_after_restart(
    redis_server: RedisServer,
    converted_default_model: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.tiers.remote")
    monkeypatch.setattr("kvtier.tiers.remote_store.INSTANCE_CHECK_S", 0.0)
    warm, cold = prompts_for("warm"), prompts_for("cold")
    expected = reference(warm + cold)
    writer = _engine(redis_server.url)
    assert _generate_all(writer, warm) == expected[: len(warm)]  # the warm prompts are now in Redis
    writer.close()

    engine = _engine(redis_server.url)  # loads the warm prefixes from Redis, computes the cold ones

    def kill_early(step: int) -> None:
        if step == 2:
            redis_server.kill()  # the real process, by pid, while reads and writes are in flight

    assert _generate_all(engine, warm + cold, kill_early) == expected
    # On a fast machine every read and write may have finished before the kill: a router's snapshot
    # (or the next lookup) asks the store whether it restarted, and that is how the outage shows.
    engine.kv_blocks()
    outages = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(outages) == 1, [r.getMessage() for r in caplog.records]
    remote = engine.stats().tiers[Medium.REMOTE]
    assert remote.breaker_state == 1 and sum(remote.errors.values()) > 0

    redis_server.start()  # the same port, empty (no persistence)
    deadline = time.monotonic() + 30
    while engine.stats().tiers[Medium.REMOTE].breaker_state != 0:
        assert time.monotonic() < deadline, "the remote tier did not come back"
        time.sleep(0.05)
    assert len([r for r in caplog.records if "answers again" in r.getMessage()]) == 1
    fresh = prompts_for("after")
    stored = engine.stats().tiers[Medium.REMOTE].blocks_stored
    assert _generate_all(engine, fresh) == reference(fresh)  # write-through publishes them again
    engine.close()
    messages = [r.getMessage() for r in caplog.records]
    assert engine.stats().tiers[Medium.REMOTE].blocks_stored > stored, messages
    reader = _engine(redis_server.url)
    assert _generate_all(reader, fresh) == reference(fresh)
    assert reader.stats().tiers[Medium.REMOTE].hit_blocks > 0, messages  # remote hits resumed
    reader.close()


def _settle(engine: LLMEngine, timeout: float = 60.0) -> None:
    """Poll the external tiers until no write (nor a write still to make) is pending."""
    assert engine.tiers is not None
    deadline = time.monotonic() + timeout
    engine.tiers.poll()
    while any(level.republish or level.storing for level in engine.tiers.external):
        assert time.monotonic() < deadline, "the tier writes did not settle"
        time.sleep(0.01)
        engine.tiers.poll()


def test_story_a_restarted_redis_gets_the_host_tiers_blocks_again(
    redis_server: RedisServer, converted_default_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis restarts empty. The replica that wrote the blocks still holds them in host memory: it
    notices the restart (a new run_id, seen here by the snapshot a router reads), writes them to Redis
    again, and another engine is served from them as before."""
    import redis

    monkeypatch.setattr("kvtier.tiers.remote_store.INSTANCE_CHECK_S", 0.0)
    warm = prompts_for("republish")
    writer = _engine(redis_server.url)
    expected = _generate_all(writer, warm)
    _settle(writer)
    held = len(writer.tiers.host.held_keys())
    redis_server.kill()
    redis_server.start()  # the same port, empty
    client = redis.Redis.from_url(redis_server.url)
    assert client.dbsize() == 0
    writer.kv_blocks()  # a router's resync: the remote tier sees the new run_id
    _settle(writer)
    assert client.dbsize() >= held > 0
    writer.close()
    reader = _engine(redis_server.url)
    assert _generate_all(reader, warm[:1]) == expected[:1]
    assert reader.stats().tiers[Medium.REMOTE].hit_blocks > 0  # served from the blocks written again
    reader.close()
    client.close()


def test_story_an_idle_replica_notices_a_restarted_redis_by_itself(
    redis_server: RedisServer, converted_default_model: Any
) -> None:
    """Nobody asks this time: no request, no router's snapshot. The server's engine loop, idle, looks at
    the store every second (``UPKEEP_S``): it sees the new run_id, forgets the blocks it had
    announced there (a router would otherwise count them as cheap hits) and writes its host blocks again."""
    import redis

    from kvtier.server.async_engine import AsyncEngine

    writer = _engine(redis_server.url)
    _generate_all(writer, prompts_for("idle"))
    _settle(writer)
    held = len(writer.tiers.host.held_keys())
    server = AsyncEngine(lambda: writer)  # the loop `kvtier serve` runs, with nothing to do
    loop = asyncio.new_event_loop()
    server.start(loop)
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert server.wait_ready(60)
        redis_server.kill()
        redis_server.start()  # the same port, empty
        deadline = time.monotonic() + 15
        while (in_store := sum(1 for _ in client.scan_iter(match="kvtier:v1:*"))) < held:
            assert time.monotonic() < deadline, f"{in_store} of {held} host blocks written again"
            time.sleep(0.1)
        stats = server.stats
        assert stats is not None and stats.tiers[Medium.REMOTE].used_blocks <= in_store
    finally:
        server.shutdown()
        loop.close()
        client.close()
