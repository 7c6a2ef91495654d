"""KV events: each engine publishes which blocks it holds, per medium, on a Redis Stream of its own.

A cache-aware router reads every replica's stream and knows precisely which prefixes each one holds
(device, host, disk, remote), instead of guessing. The pieces::

    device pool (KVCacheManager.listener) ──┐
    host, disk, remote tiers (.listener)  ──┴─► KVEventRecorder ──end_step()──► EventBatch
                                                (engine thread: appends only)      │
                                                                                   ▼
              RedisStreamPublisher (its own thread): XADD kvtier:v1:events:<replica> MAXLEN ~ 10000
                                                                                   │
    router ◄── BlockIndex.apply(batch) ◄── read_batches(client, replica, after_id) ◄┘

One stream entry is one :class:`EventBatch`: everything that changed during one engine step, in order.
Its fields (all strings; the wire format is documented in ``docs/kv-events.md``)::

    v         "1"                       the wire format version
    replica   "host-a:8000"             the replica id (also the stream's name)
    instance  "3f9c0a1e5b7d4c21"        random per engine start: seq restarts at 1 with a new instance
    seq       "42"                      1, 2, 3, ... per instance, without gaps
    ts        "1732312345.123456"       Unix time the batch was closed (seconds)
    events    '[{"type": "stored", "medium": "device", "hashes": ["<64 hex>", ...]}, ...]'

KV groups (a hybrid model, ``kvtier/kv/groups.py``; Gemma 3: full-attention and sliding-window layers):
an event names the blocks of one group, ``"group": g``, and its hashes are that group's keys,
``group_key(h_i, g)`` (``docs/block-hashes.md``): the names the tiers store them under, the ones
``GET /v1/kv/blocks`` lists. Group 0 keeps the chain's own hashes and is the only group of a dense model;
its events leave ``group`` out (absent means 0), so a dense model's events are what they were before
the groups and a consumer that knows nothing of them reads them unchanged::

    {"type": "stored", "medium": "host", "hashes": ["<key(h_7, 2)>", ...], "group": 2}

A router scores a hybrid prefix from the chain it computes: ``group_key(h_i, g)`` of each group in the
replica's layout (``GET /v1/kv/info``: ``kv_groups``) looked up among the announced hashes, the full
groups' for every block of the prefix, each sliding group's for the blocks of its window before the
prefix's end (``kvtier/router/groups.py``).

Event types: ``stored`` (the blocks became visible to lookups on that medium), ``removed`` (they
stopped being: evicted, invalidated, dropped, the tier disabled) and ``cleared`` (no medium: forget
everything this replica announced before; the first event of every instance, followed by what its
tiers already hold, e.g. the disk tier's files found at start-up).

Publishing never blocks the engine: ``end_step`` appends the batch to a bounded buffer and returns.
When Redis is unreachable the publisher keeps the newest ``max_buffered`` batches, drops the oldest
(a consumer sees a ``seq`` gap and resyncs from ``GET /v1/kv/blocks``), logs once per outage and
retries with backoff. The remote tier can only announce what the engine itself stores and removes:
entries that Redis evicts on its own (``maxmemory``, TTL) produce no ``removed`` event.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvtier.kv.hashing import BlockHash
from kvtier.stats import Medium

logger = logging.getLogger("kvtier.kv_events")

WIRE_VERSION = 1
STREAM_PREFIX = "kvtier:v1:events:"
STREAM_MAXLEN = 10_000  # batches kept per replica stream (approximate trimming)
MAX_BUFFERED_BATCHES = 10_000  # batches kept while Redis is unreachable
EventType = Literal["stored", "removed", "cleared"]


def stream_key(replica_id: str) -> str:
    """The Redis Stream of one replica's events."""
    return STREAM_PREFIX + replica_id


def default_replica_id(port: int | None = None) -> str:
    """``hostname:port`` for a server; ``hostname:pid`` for an engine without one."""
    return f"{socket.gethostname()}:{port if port is not None else os.getpid()}"


def check_replica_id(replica_id: str) -> None:
    if not replica_id or len(replica_id) > 200 or any(c.isspace() or not c.isprintable() for c in replica_id):
        raise ValueError(
            f"a replica id must be 1-200 printable characters without spaces, got {replica_id!r}"
        )


# ---------------------------------------------------------------------------------------- the format
@dataclass(frozen=True)
class KVEvent:
    type: EventType
    medium: Medium | None  # None for "cleared"
    hashes: tuple[BlockHash, ...] = ()
    group: int = 0  # the KV group whose keys ``hashes`` are (0 for "cleared": it clears every group)

    def to_json(self) -> dict[str, Any]:
        medium = None if self.medium is None else str(self.medium)
        obj: dict[str, Any] = {"type": self.type, "medium": medium, "hashes": [h.hex() for h in self.hashes]}
        if self.group:
            obj["group"] = self.group  # absent: 0 (a dense model's events are unchanged)
        return obj

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> KVEvent:
        kind = obj["type"]
        if kind not in ("stored", "removed", "cleared"):
            raise ValueError(f"unknown KV event type {kind!r}")
        medium = None if obj.get("medium") is None else Medium(obj["medium"])
        if kind != "cleared" and medium is None:
            raise ValueError(f"a {kind!r} event needs a medium")
        group = obj.get("group") or 0
        if not isinstance(group, int) or isinstance(group, bool) or group < 0:
            raise ValueError(f"a KV group is a non-negative integer, got {group!r}")
        hashes = tuple(BlockHash(bytes.fromhex(h)) for h in obj.get("hashes", ()))
        return cls(kind, medium, hashes, group)


@dataclass(frozen=True)
class EventBatch:
    """The events of one engine step, in the order they happened."""

    replica_id: str
    instance: str
    seq: int
    ts: float
    events: tuple[KVEvent, ...]

    def to_fields(self) -> dict[str, str]:
        """The stream entry's fields."""
        return {
            "v": str(WIRE_VERSION),
            "replica": self.replica_id,
            "instance": self.instance,
            "seq": str(self.seq),
            "ts": f"{self.ts:.6f}",
            "events": json.dumps([e.to_json() for e in self.events], separators=(",", ":")),
        }

    @classmethod
    def from_fields(cls, fields: dict[Any, Any]) -> EventBatch:
        """Parse a stream entry (bytes or str keys and values)."""
        f = {_text(k): _text(v) for k, v in fields.items()}
        if int(f.get("v", "0")) != WIRE_VERSION:
            raise ValueError(f"unsupported KV event wire version {f.get('v')!r}")
        events = tuple(KVEvent.from_json(e) for e in json.loads(f["events"]))
        return cls(f["replica"], f["instance"], int(f["seq"]), float(f["ts"]), events)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


# ---------------------------------------------------------------------------------------- producer
_Pending = tuple[EventType, Medium | None, int, list[BlockHash]]  # type, medium, KV group, keys


class KVEventRecorder:
    """The engine's :class:`~kvtier.kv.lower.BlockListener`: records events during a step (on the
    engine thread, appends only) and closes them into one numbered batch per ``end_step``.

    Consecutive events of the same type and medium are merged (one per KV group of a hybrid model), so a
    step that stores 40 blocks on the device makes one event; order across types and media is kept (a
    block stored then evicted in one step ends removed). A new recorder starts with a ``cleared`` event: the
    previous instance's blocks are gone."""

    def __init__(self, replica_id: str, publisher: RedisStreamPublisher | None = None) -> None:
        check_replica_id(replica_id)
        self.replica_id = replica_id
        self.instance = secrets.token_hex(8)
        self.publisher = publisher
        self.last_seq = 0  # the seq of the last closed batch (0: none yet)
        # (type, medium, KV group, keys) of the events recorded since the last batch
        self._pending: list[_Pending] = [("cleared", None, 0, [])]

    def blocks_stored(self, medium: Medium, keys: Sequence[BlockHash], group: int = 0) -> None:
        self._record("stored", medium, group, keys)

    def blocks_removed(self, medium: Medium, keys: Sequence[BlockHash], group: int = 0) -> None:
        self._record("removed", medium, group, keys)

    def _record(self, kind: EventType, medium: Medium, group: int, keys: Sequence[BlockHash]) -> None:
        """Extend the event of (kind, medium, group) in the trailing run of (kind, medium) events, else
        start one. Within such a run the groups' events commute (no key is in two groups), so a step
        that caches position by position over the groups makes one event per group, not per block."""
        if not keys:
            return
        for pending in reversed(self._pending):
            if pending[:2] != (kind, medium):
                break
            if pending[2] == group:
                pending[3].extend(keys)
                return
        self._pending.append((kind, medium, group, list(keys)))

    def end_step(self) -> EventBatch | None:
        """Close the events recorded since the last call into a batch and hand it to the publisher."""
        if not self._pending:
            return None
        self.last_seq += 1
        events = tuple(KVEvent(k, m, tuple(keys), g) for k, m, g, keys in self._pending)
        self._pending = []
        batch = EventBatch(self.replica_id, self.instance, self.last_seq, time.time(), events)
        if self.publisher is not None:
            self.publisher.publish(batch)
        return batch

    def close(self, timeout: float = 5.0) -> None:
        """Publish what is pending, wait (up to ``timeout``) for it to reach Redis, stop the thread."""
        self.end_step()
        if self.publisher is not None:
            self.publisher.close(timeout)


@dataclass
class PublisherStats:
    batches_published: int = 0
    batches_dropped: int = 0  # the buffer overflowed during an outage: consumers see a seq gap
    outages: int = 0


class RedisStreamPublisher:
    """XADDs batches to one replica's stream on a daemon thread; ``publish`` never waits on the network.

    Batches are kept in a bounded buffer (the oldest dropped on overflow) until Redis accepts them,
    pipelined several per round trip. A connection failure is logged once per outage (and its end
    once); the thread retries with backoff up to ``RETRY_MAX_S``."""

    RETRY_MIN_S = 0.1
    RETRY_MAX_S = 5.0

    def __init__(
        self,
        url: str,
        replica_id: str,
        *,
        maxlen: int = STREAM_MAXLEN,
        max_buffered: int = MAX_BUFFERED_BATCHES,
        timeout_s: float = 2.0,
    ) -> None:
        import redis  # a dependency; imported here so that the module loads without it

        self.url = url
        self.stream = stream_key(replica_id)
        self.maxlen = maxlen
        self.stats = PublisherStats()
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._buffer: deque[EventBatch] = deque()
        self._max_buffered = max_buffered
        self._in_flight = 0
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvtier-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        with self._cond:
            if len(self._buffer) >= self._max_buffered:
                self._buffer.popleft()
                self.stats.batches_dropped += 1
            self._buffer.append(batch)
            self._cond.notify_all()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every batch published so far reached Redis; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._buffer or self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Flush (up to ``timeout``), then stop the thread; what Redis did not take is dropped."""
        self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        self._client.close()

    def _take(self) -> list[EventBatch]:
        with self._cond:
            while not self._buffer and not self._closing:
                self._cond.wait()
            batches = list(self._buffer)
            self._buffer.clear()
            self._in_flight = len(batches)
            return batches

    def _run(self) -> None:
        delay = self.RETRY_MIN_S
        down = False
        while True:
            batches = self._take()
            if not batches:
                return  # closing, nothing left
            try:
                self._send(batches)
            except Exception as exc:  # redis.RedisError, OSError: keep the batches, retry later
                self._put_back(batches)
                if not down:
                    down = True
                    self.stats.outages += 1
                    logger.warning("KV events: cannot publish to %s (%s); buffering, retrying", self.url, exc)
                if self._closing:
                    return
                time.sleep(delay)
                delay = min(delay * 2, self.RETRY_MAX_S)
                continue
            if down:
                down = False
                logger.warning("KV events: publishing to %s again", self.url)
            delay = self.RETRY_MIN_S
            with self._cond:
                self.stats.batches_published += len(batches)
                self._in_flight = 0
                self._cond.notify_all()

    def _send(self, batches: list[EventBatch]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for batch in batches:
            pipe.xadd(self.stream, batch.to_fields(), maxlen=self.maxlen, approximate=True)
        pipe.execute()

    def _put_back(self, batches: list[EventBatch]) -> None:
        """Return unsent batches to the front of the buffer, keeping only the newest ``max_buffered``."""
        with self._cond:
            self._buffer.extendleft(reversed(batches))
            while len(self._buffer) > self._max_buffered:
                self._buffer.popleft()
                self.stats.batches_dropped += 1
            self._in_flight = 0
            self._cond.notify_all()


# ---------------------------------------------------------------------------------------- consumer
@dataclass
class BlockIndex:
    """What one replica holds, rebuilt from its event stream: ``blocks[medium]`` is a set of hashes (a
    hybrid model's: every group's keys, which never collide; ``GET /v1/kv/blocks`` lists them alike).

    ``apply`` batches in stream order. ``gaps`` counts batches that were missed (a ``seq`` jump within
    one instance: trimmed by MAXLEN or dropped during an outage): after one the index is incomplete,
    and a router should resync from ``GET /v1/kv/blocks`` (``seed``) and go on from there."""

    blocks: dict[Medium, set[BlockHash]] = field(default_factory=dict)
    instance: str | None = None
    seq: int = 0  # the last applied batch's seq
    last_id: str = "0"  # the last applied stream entry id: read on from here
    gaps: int = 0

    def apply(self, batch: EventBatch, entry_id: str | None = None) -> None:
        if batch.instance == self.instance and batch.seq <= self.seq:
            return  # already applied (a snapshot taken after it, or a replay overlap)
        expected = 1 if batch.instance != self.instance else self.seq + 1
        if batch.seq != expected:
            self.gaps += 1  # missed batches (trimmed, dropped, or a new instance's first ones)
        self.instance, self.seq = batch.instance, batch.seq
        for event in batch.events:
            self._apply_event(event)
        if entry_id is not None:
            self.last_id = entry_id

    def _apply_event(self, event: KVEvent) -> None:
        if event.type == "cleared":
            self.blocks.clear()
            return
        assert event.medium is not None
        held = self.blocks.setdefault(event.medium, set())
        if event.type == "stored":
            held.update(event.hashes)
        else:
            held.difference_update(event.hashes)

    def seed(self, snapshot: dict[str, Any]) -> None:
        """Start from a ``GET /v1/kv/blocks`` answer; batches up to its ``seq`` are then skipped."""
        self.blocks = {
            Medium(m): {BlockHash(bytes.fromhex(h)) for h in hashes}
            for m, hashes in snapshot["blocks"].items()
        }
        self.instance = snapshot.get("instance")
        self.seq = snapshot.get("seq") or 0

    def hex_blocks(self) -> dict[str, set[str]]:
        """``{medium: {hex hash}}`` without empty media, comparable to ``/v1/kv/blocks``."""
        return {str(m): {h.hex() for h in hs} for m, hs in self.blocks.items() if hs}


def read_batches(
    client: Any, replica_id: str, after_id: str = "0", count: int = 1000, block_ms: int | None = None
) -> list[tuple[str, EventBatch]]:
    """Up to ``count`` entries of a replica's stream after ``after_id`` (``"0"``: from the start),
    as ``(entry id, batch)``; ``block_ms`` waits that long for new ones (XREAD BLOCK)."""
    answer = client.xread({stream_key(replica_id): after_id}, count=count, block=block_ms)
    entries: Iterable[tuple[Any, dict[Any, Any]]] = answer[0][1] if answer else []
    return [(_text(entry_id), EventBatch.from_fields(fields)) for entry_id, fields in entries]


def last_entry_id(client: Any, replica_id: str) -> str:
    """The id of the newest entry of a replica's stream (``"0"`` when empty): to resync, take this,
    then ``GET /v1/kv/blocks`` (``BlockIndex.seed``), then read on after this id."""
    entries = client.xrevrange(stream_key(replica_id), count=1)
    return _text(entries[0][0]) if entries else "0"


def replay(client: Any, replica_id: str, index: BlockIndex | None = None) -> BlockIndex:
    """Apply every entry of the stream after ``index.last_id`` (a fresh index: from the start)."""
    index = index if index is not None else BlockIndex()
    while True:
        entries = read_batches(client, replica_id, index.last_id)
        if not entries:
            return index
        for entry_id, batch in entries:
            index.apply(batch, entry_id)
