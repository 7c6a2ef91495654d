"""KV events: the recorder's batches, the wire format, the Redis Stream publisher (a real redis-server,
including an outage), the consumer's index, and every medium announcing exactly what it holds."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import redis

from kvtier.config import ConfigError, EngineArgs
from kvtier.kv.manager import KVCacheManager
from kvtier.kv_events import (
    BlockIndex,
    EventBatch,
    KVEvent,
    KVEventRecorder,
    RedisStreamPublisher,
    last_entry_id,
    read_batches,
    replay,
    stream_key,
)
from kvtier.stats import Medium
from kvtier.tiers.base import BlockKey, TierIdentity
from kvtier.tiers.block_format import write_block_file
from kvtier.tiers.coordinator import ExternalLevel, TierCoordinator
from kvtier.tiers.disk import DiskBlockIO, DiskTier
from kvtier.tiers.host import HostTier
from kvtier.transfer.io_worker import BlockIOWorker
from tests.redis_server import RedisServer


def k(name: str) -> BlockKey:
    return BlockKey(name.encode().ljust(32, b"."))


class Mirror:
    """A recorder (no publisher) and the index its batches rebuild: what a consumer would see."""

    def __init__(self) -> None:
        self.recorder = KVEventRecorder("test-replica")
        self.index = BlockIndex()

        self.mentioned: set[BlockKey] = set()  # every hash any event named

    def sync(self) -> dict[Medium, set[BlockKey]]:
        batch = self.recorder.end_step()
        if batch is not None:
            self.index.apply(batch)
            self.mentioned.update(h for event in batch.events for h in event.hashes)
        return {m: hs for m, hs in self.index.blocks.items() if hs}


# ------------------------------------------------------------------------------------------ recorder
def test_recorder_closes_one_batch_per_step_merging_runs_in_order() -> None:
    rec = KVEventRecorder("r1")
    rec.blocks_stored(Medium.DEVICE, [k("a"), k("b")])
    rec.blocks_stored(Medium.DEVICE, [k("c")])
    rec.blocks_removed(Medium.HOST, [k("a")])
    rec.blocks_stored(Medium.DEVICE, [k("d")])
    rec.blocks_stored(Medium.DISK, [])  # nothing: no event
    batch = rec.end_step()
    assert batch is not None and batch.seq == 1 and batch.replica_id == "r1"
    assert batch.events == (
        KVEvent("cleared", None),
        KVEvent("stored", Medium.DEVICE, (k("a"), k("b"), k("c"))),
        KVEvent("removed", Medium.HOST, (k("a"),)),
        KVEvent("stored", Medium.DEVICE, (k("d"),)),
    )
    assert rec.end_step() is None  # an idle step publishes nothing
    rec.blocks_removed(Medium.DEVICE, [k("d")])
    second = rec.end_step()
    assert second is not None and second.seq == 2 and second.instance == batch.instance
    assert KVEventRecorder("r1").instance != batch.instance  # a new engine is a new instance


def test_wire_format_round_trips_and_is_plain_json() -> None:
    batch = EventBatch(
        "host-a:8000",
        "00ff",
        7,
        1732312345.25,
        (
            KVEvent("cleared", None),
            KVEvent("stored", Medium.DISK, (k("a"),)),
            KVEvent("removed", Medium.HOST, (k("b"),)),
        ),
    )
    fields = batch.to_fields()
    assert fields["v"] == "1" and fields["seq"] == "7" and fields["replica"] == "host-a:8000"
    assert json.loads(fields["events"])[1] == {"type": "stored", "medium": "disk", "hashes": [k("a").hex()]}
    as_bytes = {key.encode(): value.encode() for key, value in fields.items()}  # what redis-py returns
    assert EventBatch.from_fields(as_bytes) == batch
    with pytest.raises(ValueError, match="wire version"):
        EventBatch.from_fields({**fields, "v": "2"})


def test_events_name_the_kv_group_and_a_dense_models_wire_is_unchanged() -> None:
    """A hybrid model caches position by position over its groups: one event per group within a run of
    one type and medium; a removal in between keeps its place. Group 0 leaves ``group`` out."""
    rec = KVEventRecorder("r1")
    for name in ("a", "b"):
        rec.blocks_stored(Medium.DEVICE, [k(name + "0")], 0)
        rec.blocks_stored(Medium.DEVICE, [k(name + "1")], 1)
    rec.blocks_removed(Medium.DEVICE, [k("a1")], 1)
    rec.blocks_stored(Medium.DEVICE, [k("c1")], 1)
    batch = rec.end_step()
    assert batch is not None and batch.events == (
        KVEvent("cleared", None),
        KVEvent("stored", Medium.DEVICE, (k("a0"), k("b0"))),
        KVEvent("stored", Medium.DEVICE, (k("a1"), k("b1")), 1),
        KVEvent("removed", Medium.DEVICE, (k("a1"),), 1),
        KVEvent("stored", Medium.DEVICE, (k("c1"),), 1),
    )
    fields = batch.to_fields()
    wire = json.loads(fields["events"])
    assert wire[1] == {"type": "stored", "medium": "device", "hashes": [k("a0").hex(), k("b0").hex()]}
    assert wire[2] == {
        "type": "stored",
        "medium": "device",
        "hashes": [k("a1").hex(), k("b1").hex()],
        "group": 1,
    }
    assert EventBatch.from_fields(fields).events == batch.events
    for bad in (-1, "1", True, 1.5):
        event = {"type": "stored", "medium": "host", "hashes": [], "group": bad}
        with pytest.raises(ValueError, match="KV group"):
            KVEvent.from_json(event)


def test_index_applies_in_order_detects_gaps_and_seeds_from_a_snapshot() -> None:
    rec, index = KVEventRecorder("r1"), BlockIndex()
    rec.blocks_stored(Medium.DEVICE, [k("a"), k("b")])
    index.apply(rec.end_step())  # type: ignore[arg-type]
    rec.blocks_removed(Medium.DEVICE, [k("a")])
    rec.blocks_stored(Medium.HOST, [k("a")])
    rec.end_step()  # lost: never applied
    rec.blocks_stored(Medium.DEVICE, [k("c")])
    index.apply(rec.end_step())  # type: ignore[arg-type]
    assert index.gaps == 1 and index.seq == 3

    seeded = BlockIndex()
    snapshot = {
        "instance": rec.instance,
        "seq": 3,
        "blocks": {"device": [k("b").hex(), k("c").hex()], "host": [k("a").hex()]},
    }
    seeded.seed(snapshot)
    rec.blocks_removed(Medium.HOST, [k("a")])
    batch = rec.end_step()
    assert batch is not None
    seeded.apply(batch)
    seeded.apply(batch)  # a replayed duplicate is ignored
    assert seeded.gaps == 0 and seeded.hex_blocks() == {"device": {k("b").hex(), k("c").hex()}}


# ------------------------------------------------------------------------------------------ Redis
def test_batches_reach_the_stream_and_a_consumer_resumes_where_it_was(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    rec = KVEventRecorder("replica-1", RedisStreamPublisher(redis_server.url, "replica-1"))
    rec.blocks_stored(Medium.DEVICE, [k("a"), k("b")])
    rec.end_step()
    rec.blocks_stored(Medium.HOST, [k("a")])
    rec.blocks_removed(Medium.DEVICE, [k("a")])
    rec.end_step()
    assert rec.publisher is not None and rec.publisher.flush(10)
    entries = client.xrange(stream_key("replica-1"))
    assert [e[1][b"seq"] for e in entries] == [b"1", b"2"]
    assert set(entries[0][1]) == {b"v", b"replica", b"instance", b"seq", b"ts", b"events"}

    index = replay(client, "replica-1")
    assert index.hex_blocks() == {"device": {k("b").hex()}, "host": {k("a").hex()}}
    assert index.last_id == last_entry_id(client, "replica-1") == entries[-1][0].decode()

    rec.blocks_removed(Medium.HOST, [k("a")])  # the consumer is away ...
    rec.end_step()
    rec.close()
    replay(client, "replica-1", index)  # ... and reads on from its last id
    assert index.seq == 3 and index.gaps == 0
    assert index.hex_blocks() == {"device": {k("b").hex()}}
    assert read_batches(client, "replica-1", index.last_id) == []


def test_maxlen_trims_the_stream_and_a_replay_from_the_start_sees_the_gap(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    publisher = RedisStreamPublisher(redis_server.url, "r", maxlen=100)
    rec = KVEventRecorder("r", publisher)
    for i in range(1000):
        rec.blocks_stored(Medium.DEVICE, [k(f"b{i}")])
        rec.end_step()
    assert publisher.flush(20)
    rec.close()
    assert 100 <= client.xlen(stream_key("r")) < 1000  # approximate trimming: whole macro nodes
    index = replay(client, "r")
    assert index.seq == 1000 and index.gaps == 1  # the first batches are gone: resync needed


def test_a_dead_redis_never_blocks_the_engine_and_the_buffer_is_bounded(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    redis_server.stop()
    publisher = RedisStreamPublisher(redis_server.url, "r", max_buffered=5, timeout_s=0.5)
    publisher.RETRY_MAX_S = 0.2
    rec = KVEventRecorder("r", publisher)
    with caplog.at_level(logging.WARNING, logger="kvtier.kv_events"):
        t0 = time.perf_counter()
        for i in range(20):
            rec.blocks_stored(Medium.HOST, [k(f"h{i}")])
            rec.end_step()
        assert time.perf_counter() - t0 < 0.05  # no network wait on the step loop
        time.sleep(1.0)  # several failed retries
        assert [r.message for r in caplog.records].count(
            next(r.message for r in caplog.records if "cannot publish" in r.message)
        ) == 1  # logged once per outage
        assert publisher.stats.batches_dropped == 15 and publisher.stats.outages == 1
        redis_server.start()
        assert publisher.flush(15)
    assert any("publishing to" in r.message and "again" in r.message for r in caplog.records)
    rec.close()
    index = replay(redis.Redis.from_url(redis_server.url), "r")
    assert index.seq == 20 and index.gaps == 1  # the 5 newest batches survived the outage
    assert index.hex_blocks() == {"host": {k(f"h{i}").hex() for i in range(15, 20)}}


# ------------------------------------------------------------------------------------------ media
def test_host_tier_announces_stores_evictions_and_discards() -> None:
    mirror, host = Mirror(), HostTier(3)
    host.listener = mirror.recorder
    spec = host.prepare_store([k("a"), k("b"), k("c")])
    assert mirror.sync() == {}  # reserved keys are not announced
    host.complete_store(spec.keys)
    assert mirror.sync() == {Medium.HOST: set(host.held_keys())}
    host.complete_store(host.prepare_store([k("d")]).keys)  # evicts a
    host.discard([k("b")])
    failed = host.prepare_store([k("e"), k("f")])  # b's freed block, then evicts c; the writes fail
    host.complete_store(failed.keys, ok=False)
    assert mirror.sync() == {Medium.HOST: {k("d")}} and host.held_keys() == [k("d")]


def identity() -> TierIdentity:
    return TierIdentity("fp", "float32", (1, 4, 2, 1, 4), 4)


def test_disk_tier_announces_stores_evictions_invalidations_and_disable(tmp_path: Path) -> None:
    mirror = Mirror()
    disk = DiskTier(
        tmp_path / "disk", 2 * DiskTier(tmp_path / "probe", 0, identity()).file_nbytes, identity()
    )
    disk.listener = mirror.recorder

    def store(*names: str) -> None:  # as the worker does: the file, then the completion
        spec = disk.prepare_store([k(n) for n in names])
        for key, path in zip(spec.keys, spec.addresses, strict=True):
            write_block_file(path, key, identity(), bytes(identity().block_bytes))
        disk.complete_store(spec.keys)

    spec = disk.prepare_store([k("a"), k("b")])
    write_block_file(spec.addresses[0], k("a"), identity(), bytes(identity().block_bytes))
    disk.complete_store([k("a")], ok=True)
    disk.complete_store([k("b")], ok=False)
    assert mirror.sync() == {Medium.DISK: {k("a")}}
    store("c")
    store("d")  # evicts a
    assert mirror.sync() == {Medium.DISK: {k("c"), k("d")}} == {Medium.DISK: set(disk.held_keys())}
    disk.invalidate(k("c"), "corrupt")
    assert mirror.sync() == {Medium.DISK: {k("d")}}
    disk.disable("disk full")
    assert mirror.sync() == {} and disk.held_keys() == [] and spec.keys == (k("a"), k("b"))


def test_coordinator_announces_what_tiers_hold_when_attached_and_hides_private_swap_blocks(
    tmp_path: Path,
) -> None:
    disk = DiskTier(tmp_path / "disk", 1 << 20, identity())
    disk.complete_store(disk.prepare_store([k("old")]).keys)  # as if found by the start-up scan
    worker = BlockIOWorker(DiskBlockIO(identity()), name="test-disk-io")
    coordinator = TierCoordinator(HostTier(4), [ExternalLevel(disk, worker)])
    mirror = Mirror()
    coordinator.attach_listener(mirror.recorder)
    assert mirror.sync() == {Medium.DISK: {k("old")}}

    out = coordinator.swap_out([(0, k("shared")), (1, None)])  # one hashed block, one private
    assert out is not None
    coordinator.complete_plan(coordinator.take_plan())
    assert coordinator.host.held_keys() == [k("shared"), *out.private_keys]
    assert mirror.sync() == {Medium.DISK: {k("old")}, Medium.HOST: {k("shared")}}
    assert coordinator.held_keys() == {Medium.HOST: [k("shared")], Medium.DISK: [k("old")]}
    coordinator.swap_in(out, [5, 6])
    coordinator.complete_plan(coordinator.take_plan())  # loads, then drops the private block
    assert coordinator.host.held_keys() == [k("shared")]
    assert mirror.sync() == {Medium.DISK: {k("old")}, Medium.HOST: {k("shared")}}
    assert mirror.index.seq == mirror.recorder.last_seq and mirror.index.gaps == 0
    assert not mirror.mentioned & out.private_keys  # neither stored nor removed: never named at all
    coordinator.close()


def test_device_pool_announces_cached_blocks_and_evictions() -> None:
    mirror = Mirror()
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True)
    kv.listener = mirror.recorder
    tokens = [1, 2, 3, 4, 5]
    computed = kv.get_computed_blocks(tokens, ("id", ""))
    assert kv.allocate_slots("s1", tokens, 0, len(tokens), computed, ("id", ""))
    kv.cache_blocks("s1", tokens, len(tokens))
    cached = {h for _, h in kv.cached_blocks()}
    assert len(cached) == 2 and mirror.sync() == {Medium.DEVICE: cached}
    kv.free("s1")
    other = [9, 9, 8, 8, 7, 7, 6]  # needs all 4 blocks: evicts both cached ones
    assert kv.allocate_slots(
        "s2", other, 0, len(other), kv.get_computed_blocks(other, ("id", "")), ("id", "")
    )
    assert mirror.sync() == {} and kv.cached_blocks() == []


# ------------------------------------------------------------------------------------------ arguments
def test_flags_become_engine_args_and_bad_values_are_refused() -> None:
    from kvtier.cli import build_parser, engine_args_from

    argv = ["serve", "--kv-events-url", "redis://127.0.0.1:1/0", "--kv-replica-id", "pod-7:8000"]
    args = engine_args_from(build_parser().parse_args(argv))
    assert (args.kv_events_url, args.kv_replica_id) == ("redis://127.0.0.1:1/0", "pod-7:8000")
    with pytest.raises(ConfigError, match="kv_events_url"):
        EngineArgs(kv_events_url="http://127.0.0.1:6379").validate()
    with pytest.raises(ConfigError, match="kv_replica_id"):
        EngineArgs(kv_replica_id="pod 7").validate()
    assert stream_key("pod-7:8000") == "kvtier:v1:events:pod-7:8000"
