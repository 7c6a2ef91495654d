"""Keeping each replica's :class:`~kvtier.router.index.ReplicaIndex` in step with the replica.

Two sources (``docs/kv-events.md``), chosen per replica, never a silent guess::

    events   (--kv-remote-url)  resync: XREVRANGE the stream's newest id, GET /v1/kv/blocks, seed;
                                then XREAD BLOCK every followed stream after its last id, apply in order;
                                a gap (lost batches) or a new instance not at seq 1: resync again
    polling  (no Redis, a replica without events, or Redis down)
                                GET /v1/kv/blocks every POLL_INTERVAL_S, seed
    Redis restarted  (its run_id changed, seen at a resync)
                                forget every remote-tier block: the restarted store is empty

A router that restarts has nothing: it resyncs every healthy replica from a snapshot as soon as the
replica's health check passes (well under a second), so cache-aware decisions resume at once. When
Redis fails, every replica falls back to polling until Redis answers again (logged once each way).
``/metrics`` and ``/router/state`` say which source each replica's index has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx

from kvtier.kv_events import EventBatch
from kvtier.router.replicas import Replica, ReplicaSet

logger = logging.getLogger("kvtier.router")

POLL_INTERVAL_S = 1.0
XREAD_BLOCK_MS = 250
REDIS_RETRY_S = 1.0


class IndexSync:
    """Runs the event follower (with a Redis URL) and the poller; see the module docstring."""

    def __init__(self, replicas: ReplicaSet, redis_url: str | None, poll_interval: float = POLL_INTERVAL_S):
        self.replicas = replicas
        self.redis_url = redis_url
        self.poll_interval = poll_interval
        self.redis_ok = redis_url is not None
        self.redis_run_id: str | None = None  # the Redis server instance the remote-tier index describes

    @property
    def mode(self) -> str:
        """What the operator asked for: ``events`` with a Redis URL, else ``polling``."""
        return "events" if self.redis_url else "polling"

    async def snapshot(self, replica: Replica, last_id: str | None = None) -> bool:
        """Seed ``replica``'s index from ``GET /v1/kv/blocks``; False (and the replica's error) on failure.
        ``last_id`` None: the poller's. Its answer is dropped when the event follower took the replica
        over while it was in flight: that index is newer, and seeding the older answer would roll it
        back (blocks since removed counted until the next batch) or mark it unsynced for good."""
        answer: dict[str, Any] | None = None
        error = ""
        try:
            answer = await self.replicas.get_json(replica, "/v1/kv/blocks")
        except (httpx.HTTPError, ValueError) as exc:
            error = f"/v1/kv/blocks: {type(exc).__name__}: {exc}"
        if last_id is None and replica.following:
            return True
        if answer is None:
            replica.last_error, replica.synced = error, False
            return False
        replica.index.seed(answer, last_id)
        replica.synced = True
        return True

    # ------------------------------------------------------------------------------ polling
    async def run_polling(self) -> None:
        """Snapshot every healthy replica that no event stream keeps up to date, every interval."""
        while True:
            todo = [r for r in self.replicas.healthy() if not r.following and r.problem is None]
            await asyncio.gather(*(self.snapshot(r) for r in todo))
            with contextlib.suppress(TimeoutError):  # a replica came up: poll at once
                await asyncio.wait_for(self.replicas.changed.wait(), self.poll_interval)
            self.replicas.changed.clear()

    # ------------------------------------------------------------------------------ events
    async def run_events(self) -> None:
        """Follow the event streams; on a Redis failure, hand every replica to the poller and retry."""
        import redis.asyncio as aioredis

        assert self.redis_url is not None
        client = aioredis.Redis.from_url(self.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        try:
            while True:
                if not await self.follow_round(client):
                    await asyncio.sleep(REDIS_RETRY_S)
        finally:
            await client.aclose()

    async def follow_round(self, client: Any) -> bool:
        """One round of the follower (resync the replicas not followed yet, one XREAD); False when Redis
        failed: every replica is handed to the poller until a later round succeeds."""
        import redis

        try:
            await self._follow(client)
        except (redis.RedisError, OSError, ValueError, KeyError) as exc:
            self._redis_failed(exc)
            return False
        if not self.redis_ok:
            logger.warning("router: KV events from %s again", self.redis_url)
            self.redis_ok = True
        return True

    def _redis_failed(self, exc: BaseException) -> None:
        if self.redis_ok:
            logger.warning("router: KV events unavailable (%s); polling /v1/kv/blocks meanwhile", exc)
        self.redis_ok = False
        for replica in self.replicas.replicas.values():
            replica.following = False

    async def _follow(self, client: Any) -> None:
        """One round: resync the replicas not followed yet, then one XREAD over every followed stream."""
        todo = [r for r in self.replicas.healthy() if r.stream and not r.following and r.problem is None]
        if todo:
            await self._check_restart(client)
        for replica in todo:
            await self._resync(client, replica)
        followed = {r.stream: r for r in self.replicas.healthy() if r.following and r.stream}
        if not followed:
            await asyncio.sleep(XREAD_BLOCK_MS / 1000)
            return
        streams = {name: r.index.last_id for name, r in followed.items()}
        answer = await client.xread(streams, count=1000, block=XREAD_BLOCK_MS)
        for name, entries in answer or []:
            replica = followed.get(_text(name))
            if replica is None or not replica.following:
                continue
            for entry_id, fields in entries:
                if not replica.index.apply(EventBatch.from_fields(fields), _text(entry_id)):
                    logger.info("router: missed KV events of %s; resyncing", replica.url)
                    replica.following = False
                    break

    async def _resync(self, client: Any, replica: Replica) -> None:
        """The stream's newest id ``L``, then the snapshot, then (``_follow``) read on after ``L``. The
        replica keeps working meanwhile: its snapshot is the state after some batch at or after ``L``,
        and the batches between come again; the index skips them for the media the snapshot lists.

        Its remote tier lists what it announced, so a snapshot with the remote medium is the whole
        truth: replaying the stream up to ``L`` over it would apply older events over newer ones. After a
        Redis restart that lost blocks for good: the replica's "removed" for everything (before ``L``)
        undid the blocks it had written again since (after ``L``, skipped as in the snapshot). Only a
        snapshot without the medium takes it from the stream (``ReplicaIndex`` module docstring)."""
        newest = await client.xrevrange(replica.stream, count=1)
        last_id = _text(newest[0][0]) if newest else "0"
        if not await self.snapshot(replica, last_id):
            return
        if replica.index.remote_from_stream:
            await self._replay_remote(client, replica, last_id)
        replica.following = True

    async def _check_restart(self, client: Any) -> None:
        """A Redis that restarted (a new ``run_id``) is empty: forget every remote-tier block the index
        holds, at once. Each replica announces its own forgetting only when it notices (within about a
        second when idle), and a snapshot that leaves the remote medium out never says so; meanwhile the
        router would count a returning prefix as a cheap remote hit on every replica, and route it by
        load to one that must recompute it."""
        run_id = (await client.info("server")).get("run_id")
        if self.redis_run_id is not None and run_id != self.redis_run_id:
            logger.warning("router: Redis restarted (a new run_id): forgetting the remote-tier blocks")
            for replica in self.replicas.replicas.values():
                replica.index.drop_remote()
        self.redis_run_id = run_id

    async def _replay_remote(self, client: Any, replica: Replica, last_id: str) -> None:
        """The remote-tier blocks the replica announced (its stream up to ``last_id``, at most
        ``STREAM_MAXLEN`` entries): what its ``/v1/kv/blocks`` did not list."""
        if last_id == "0" or replica.stream is None:
            return
        start = "-"
        while True:
            entries = await client.xrange(replica.stream, min=start, max=last_id, count=1000)
            replica.index.replay_remote([EventBatch.from_fields(fields) for _, fields in entries])
            if len(entries) < 1000:
                return
            start = "(" + _text(entries[-1][0])


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
