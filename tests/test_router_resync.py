"""The router's resync from a snapshot, against a real redis-server and the real event publisher.

A resync is: XREVRANGE the stream's newest id ``L``, ``GET /v1/kv/blocks`` (the state after its ``seq``
``S``), read on after ``L``. A replica that keeps working publishes batches between the two, so the
snapshot is newer than ``L``: batches ``(L, S]`` are already in it. These tests put the replica's steps
exactly there (the snapshot answer runs them first) and check that the router's index ends equal to
what the replica announced, for a snapshot that lists the remote medium (the engine's remote tier lists
the keys it announced) and for one that leaves it out (then the stream is the only source of it).

The replica is a fake on ``httpx.MockTransport`` around the real ``KVEventRecorder`` and
``RedisStreamPublisher``; its snapshot is its own announcements, as the engine's is. Fast: no model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx
import pytest

from kvtier.kv.hashing import HASH_SPEC_VERSION, BlockHash, hash_full_blocks, root_hash
from kvtier.kv_events import BlockIndex, KVEventRecorder, RedisStreamPublisher, stream_key
from kvtier.router.replicas import Replica, ReplicaSet
from kvtier.router.sync import IndexSync
from kvtier.stats import Medium

URL = "http://replica-0.test:8000"
DEVICE, HOST, REMOTE = Medium.DEVICE, Medium.HOST, Medium.REMOTE
Hook = Callable[[], Awaitable[None]]
Events = Sequence[tuple[Medium, list[BlockHash]]]


class FakeReplica:
    """``/health``, ``/v1/kv/info`` and ``/v1/kv/blocks`` of one replica whose events go to a real Redis.

    ``truth`` applies every batch the replica closes: what it announced, i.e. what its snapshot lists.
    ``lists_remote``: the snapshot lists the remote medium (the engine's ``RemoteTier.held_keys``);
    False: it leaves it out (a remote tier that cannot list). ``before_snapshot``: run once, when the
    next snapshot is asked for, before it is taken: steps the replica makes meanwhile."""

    def __init__(self, redis_url: str, replica_id: str, *, lists_remote: bool) -> None:
        self.publisher = RedisStreamPublisher(redis_url, replica_id)
        self.recorder = KVEventRecorder(replica_id, self.publisher)
        self.truth = BlockIndex()
        self.lists_remote = lists_remote
        self.before_snapshot: Hook | None = None

    def step(self, stored: Events = (), removed: Events = ()) -> None:
        """One engine step: its events, closed into a batch and in the stream when this returns."""
        for medium, keys in stored:
            self.recorder.blocks_stored(medium, keys)
        for medium, keys in removed:
            self.recorder.blocks_removed(medium, keys)
        batch = self.recorder.end_step()
        assert batch is not None
        self.truth.apply(batch)
        assert self.publisher.flush(10), "the publisher did not reach Redis"

    def snapshot(self) -> dict[str, Any]:
        media = [DEVICE, HOST, REMOTE] if self.lists_remote else [DEVICE, HOST]
        blocks = {str(m): sorted(h.hex() for h in self.truth.blocks.get(m, ())) for m in media}
        return {"object": "kv.blocks", "instance": self.recorder.instance, "seq": self.recorder.last_seq,
                "block_size": 4, "blocks": blocks}  # fmt: skip

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200, json={"num_requests_running": 0, "num_requests_waiting": 0})
        if path == "/v1/kv/info":
            events = {"enabled": True, "stream": stream_key(self.recorder.replica_id), "wire_version": 1,
                      "instance": self.recorder.instance}  # fmt: skip
            return httpx.Response(200, json={"hash_spec_version": HASH_SPEC_VERSION, "block_size": 4,
                                             "events": events})  # fmt: skip
        assert path == "/v1/kv/blocks", path
        hook, self.before_snapshot = self.before_snapshot, None
        if hook is not None:
            await hook()
        return httpx.Response(200, json=self.snapshot())

    def close(self) -> None:
        self.publisher.close(5)


def _hashes(n: int) -> list[BlockHash]:
    return hash_full_blocks(list(range(4 * n)), 4, root_hash(("id:float32", "")))


class Router:
    """The router's replica set and index sync on the fake replica, driven one follower round at a time."""

    def __init__(self, replica: FakeReplica, redis_url: str) -> None:
        import redis.asyncio as aioredis

        self.http = httpx.AsyncClient(transport=httpx.MockTransport(replica.handle))
        self.replicas = ReplicaSet(self.http, {})
        self.replica: Replica = self.replicas.add(URL)
        self.sync = IndexSync(self.replicas, redis_url)
        self.redis = aioredis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)

    async def start(self) -> None:
        await self.replicas.check(self.replica)
        assert self.replica.healthy and self.replica.stream == stream_key("r0")

    async def round(self) -> bool:
        return await self.sync.follow_round(self.redis)

    async def close(self) -> None:
        await self.redis.aclose()
        await self.http.aclose()


def run_story(replica: FakeReplica, redis_url: str, story: Callable[[Router], Awaitable[None]]) -> None:
    """``story`` with a router on ``replica``, both closed afterwards."""

    async def main() -> None:
        router = Router(replica, redis_url)
        try:
            await story(router)
        finally:
            await router.close()

    try:
        asyncio.run(main())
    finally:
        replica.close()


# ---------------------------------------------------------------------------------------- stories
@pytest.mark.parametrize("lists_remote", [True, False], ids=["snapshot-lists-remote", "stream-only"])
def test_a_restarted_redis_mid_republish_leaves_the_router_knowing_every_block(
    redis_server: Any, lists_remote: bool
) -> None:
    """The CI failure of ``test_router.py``'s restarted-Redis story, step by step. Redis dies: the
    router's XREAD fails, it hands the replica to the poller. Redis comes back empty: the replica
    notices (a new run_id), announces its remote blocks removed and writes its host blocks again, a
    round per step (``REPUBLISH_IN_FLIGHT``). The router resyncs in the middle: its XREVRANGE sees the
    removal and the first round; the next rounds land before its snapshot. Before the fix the router
    replayed the stream up to ``L`` (the removal) over the newer snapshot and skipped the rounds after
    ``L`` as "in the snapshot": those blocks were lost from its index for good ((72, 104) in CI: one
    round of 32)."""
    h = _hashes(8)
    replica = FakeReplica(redis_server.url, "r0", lists_remote=lists_remote)

    async def story(router: Router) -> None:
        replica.step(stored=[(DEVICE, h), (HOST, h), (REMOTE, h)])  # written through to Redis
        await router.start()
        assert await router.round() and router.replica.following
        assert router.replica.index.hex_blocks() == replica.truth.hex_blocks()

        redis_server.kill()
        assert not await router.round()  # its XREAD fails: polling meanwhile
        assert not router.replica.following
        redis_server.start()
        replica.step(removed=[(REMOTE, h)])  # the store restarted empty: forget what was there
        replica.step(stored=[(REMOTE, h[:2])])  # republish, round 1

        async def republish_rest() -> None:  # between the router's XREVRANGE and its snapshot
            for i in range(2, 8, 2):
                replica.step(stored=[(REMOTE, h[i : i + 2])])

        replica.before_snapshot = republish_rest
        assert await router.round() and router.replica.following  # the resync
        assert replica.before_snapshot is None, "the resync did not ask for a snapshot"
        assert await router.round()  # reads on: nothing new
        assert router.replica.index.seq == replica.recorder.last_seq
        assert router.replica.index.hex_blocks() == replica.truth.hex_blocks()
        assert router.replica.index.counts()["remote"] == 8

    run_story(replica, redis_server.url, story)


@pytest.mark.parametrize("lists_remote", [True, False], ids=["snapshot-lists-remote", "stream-only"])
def test_a_restarted_router_resyncing_while_the_replica_works_misses_nothing(
    redis_server: Any, lists_remote: bool
) -> None:
    """No restart of Redis: a new router follows a replica whose stream holds a remote block removed
    (its load failed) and, between the router's XREVRANGE and its snapshot, stored again. The router
    ends knowing it in the remote tier, as the replica does."""
    h = _hashes(4)
    replica = FakeReplica(redis_server.url, "r0", lists_remote=lists_remote)

    async def story(router: Router) -> None:
        replica.step(stored=[(DEVICE, h), (REMOTE, h)])
        replica.step(removed=[(REMOTE, h[1:2])])

        async def store_again() -> None:
            replica.step(stored=[(REMOTE, h[1:2])], removed=[(DEVICE, h[3:])])

        replica.before_snapshot = store_again
        await router.start()
        assert await router.round() and router.replica.following
        assert replica.before_snapshot is None
        assert router.replica.index.seq == replica.recorder.last_seq
        assert router.replica.index.hex_blocks() == replica.truth.hex_blocks()
        assert router.replica.index.counts()["remote"] == 4

    run_story(replica, redis_server.url, story)


def test_a_poll_answer_landing_after_the_follower_took_over_is_dropped(redis_server: Any) -> None:
    """The poller asks for a snapshot while Redis is back; before its answer arrives the replica steps
    and the event follower resyncs (a newer snapshot) and follows. The poller's older answer must not
    roll the index back: it would count blocks the replica has since removed until its next batch."""
    h = _hashes(4)
    replica = FakeReplica(redis_server.url, "r0", lists_remote=True)

    async def story(router: Router) -> None:
        replica.step(stored=[(DEVICE, h), (REMOTE, h)])
        await router.start()
        stale = replica.snapshot()

        async def follower_takes_over() -> None:
            replica.step(removed=[(DEVICE, h[:2]), (REMOTE, h[:2])])
            assert await router.round() and router.replica.following
            replica.snapshot = lambda: stale  # type: ignore[method-assign] (the answer taken before)

        replica.before_snapshot = follower_takes_over
        assert await router.sync.snapshot(router.replica)  # the poller's call
        assert router.replica.following and router.replica.synced
        assert router.replica.index.seq == replica.recorder.last_seq == 2
        assert router.replica.index.hex_blocks() == replica.truth.hex_blocks()

    run_story(replica, redis_server.url, story)
