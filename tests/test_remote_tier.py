"""The remote tier (L4) against a real redis-server: exact round trips, the key namespace, TTLs, values
that must never load, blocks evicted under our feet, and a dead store that costs nothing per request.

Every test starts its own redis-server on a free loopback port (``tests/redis_server.py``); tiny block
shapes keep them fast, one realistic shape checks a full-size block. ``K("A")`` is a valid block key.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import torch

from kvtier.config import ConfigError, EngineArgs
from kvtier.server.metrics import ServerMetrics
from kvtier.stats import EngineStats, Medium
from kvtier.tiers.base import TierIdentity
from kvtier.tiers.block_format import HEADER_NBYTES, encode_block_value
from kvtier.tiers.breaker import BreakerState
from kvtier.tiers.remote import RedisBlockIO, RemoteTier
from kvtier.tiers.remote_store import KEY_PREFIX, RemoteStore, redacted, redis_key
from kvtier.transfer.io_worker import BlockIOWorker, IOResult
from kvtier.transfer.mover import byte_view
from tests.redis_server import RedisServer, free_port
from tests.tier_blocks import IDENT, REAL_SHAPE, K, block, empty, ident, same_bytes

LOGGER = "kvtier.tiers.remote"


class Replica:
    """One engine's remote tier as the coordinator drives it: store, its I/O worker, bookkeeping."""

    def __init__(
        self, url: str, identity: TierIdentity = IDENT, *, secret: bytes | None = None, ttl_s: int = 3600
    ):
        self.identity = identity
        self.store = RemoteStore(url, ttl_s=ttl_s)
        self.tier = RemoteTier(self.store, identity)
        self.worker = BlockIOWorker(RedisBlockIO(self.store, identity, secret))

    def put(self, names: str, seed: int = 0) -> list[IOResult]:
        spec = self.tier.prepare_store([K(n) for n in names])
        for i, (key, address) in enumerate(zip(spec.keys, spec.addresses, strict=True)):
            self.worker.submit_store(key, address, byte_view(block(self.identity, seed + i)))
        results = self.worker.drain(timeout=30)
        for r in results:
            self.tier.complete_store([r.key], ok=r.ok, seconds=r.seconds)
        return results

    def get(self, names: str) -> tuple[list[IOResult], list[torch.Tensor]]:
        """Look up, pin, read, invalidate what failed, unpin: what the coordinator does."""
        keys = [K(n) for n in names]
        n = self.tier.lookup(keys)
        assert n == len(keys), f"only {n} of {len(keys)} found"
        spec = self.tier.prepare_load(keys)
        outs = [empty(self.identity) for _ in keys]
        for key, address, out in zip(spec.keys, spec.addresses, outs, strict=True):
            self.worker.submit_load(key, address, byte_view(out))
        results = self.worker.drain(timeout=30)
        for r in results:
            if not r.ok:
                assert not r.fatal and r.error
                self.tier.invalidate(r.key, r.error)
        self.tier.complete_load([r.key for r in results if r.ok], sum(r.seconds for r in results))
        return results, outs

    def close(self) -> None:
        self.worker.close(timeout=10)
        self.tier.close()


@pytest.fixture
def server(redis_server: RedisServer) -> RedisServer:
    return redis_server


@pytest.fixture
def client(server: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(server.url)
    yield c
    c.close()


@pytest.fixture
def replica(server: RedisServer) -> Iterator[Replica]:
    r = Replica(server.url)
    yield r
    r.close()


def remote_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize(
    "identity",
    [ident("float32"), ident("bfloat16"), ident("float16"), ident("float32", REAL_SHAPE)],
    ids=["float32", "bfloat16", "float16", "float32-real-shape"],
)
def test_round_trip_is_byte_identical(
    server: RedisServer, client: redis.Redis, identity: TierIdentity
) -> None:
    writer, reader = Replica(server.url, identity), Replica(server.url, identity)
    try:
        assert all(r.ok for r in writer.put("ABC"))
        # One value per block, under the documented name, exactly the block format's encoding.
        assert client.get(KEY_PREFIX + K("A").hex().encode()) == encode_block_value(
            K("A"), identity, byte_view(block(identity, 0)), None
        )
        assert not reader.tier.contains(K("A"))  # another replica: it learns from the store
        results, outs = reader.get("ABC")
        assert all(r.ok for r in results)
        for i, out in enumerate(outs):
            assert same_bytes(out, block(identity, i))
        snap = reader.tier.snapshot(4)
        assert snap.blocks_loaded == 3 and snap.bytes_loaded == 3 * identity.block_bytes
        assert writer.tier.snapshot(4).blocks_stored == 3
        assert sum(reader.store.error_counts().values()) == 0
    finally:
        writer.close()
        reader.close()


def test_lookup_counts_leading_keys_known_or_found_in_one_round_trip(
    server: RedisServer, replica: Replica, client: redis.Redis
) -> None:
    replica.put("ABC")
    other = Replica(server.url)
    try:
        before = client.info("commandstats").get("cmdstat_exists", {}).get("calls", 0)
        assert other.tier.lookup([K("A"), K("B"), K("X"), K("C")]) == 2  # stops at the first miss
        assert client.info("commandstats")["cmdstat_exists"]["calls"] == before + 4  # one pipeline
        assert other.tier.contains(K("A")) and not other.tier.contains(K("C"))
        assert other.tier.lookup([K("A"), K("B")]) == 2
    finally:
        other.close()


def test_presence_counts_every_held_key_from_another_thread_and_knows_nothing_new(
    server: RedisServer, replica: Replica
) -> None:
    """``/v1/kv/publish`` polls the store off the engine thread: all held keys count, not only leading
    ones, and the tier's own bookkeeping (what lookups announce) is left alone."""
    replica.put("AB")
    other = Replica(server.url)
    try:
        count = other.tier.presence()
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(count, [K("X"), K("A"), K("B")]).result() == 2
        assert not other.tier.contains(K("A"))  # nothing announced: a lookup would
        server.kill()
        assert count([K("A")]) is None  # no answer is not "none held"
    finally:
        other.close()


def test_blocks_already_in_the_store_are_not_sent_again(
    server: RedisServer, replica: Replica, client: redis.Redis
) -> None:
    replica.put("AB")
    assert replica.tier.prepare_store([K("A"), K("B")]).keys == ()  # known locally: not even snapshotted
    sets = client.info("commandstats")["cmdstat_set"]["calls"]
    other = Replica(server.url)  # does not know: one EXISTS batch finds them, no SET goes out
    try:
        assert all(r.ok for r in other.put("ABC"))
        assert client.info("commandstats")["cmdstat_set"]["calls"] == sets + 1  # C only
    finally:
        other.close()


def test_ttl_is_set_on_store_and_refreshed_by_a_hit(
    server: RedisServer, client: redis.Redis, replica: Replica
) -> None:
    replica.put("A")
    name = redis_key(K("A"))
    assert 3500 < client.ttl(name) <= 3600
    client.expire(name, 5)
    results, _ = replica.get("A")
    assert results[0].ok
    assert client.ttl(name) > 3500  # the hit refreshed it
    forever = Replica(server.url, ttl_s=0)
    try:
        forever.put("Z")
        assert client.ttl(redis_key(K("Z"))) == -1  # 0: no expiry
    finally:
        forever.close()


# ------------------------------------------------------------------------------ values that never load
def _foreign(identity: TierIdentity) -> bytes:
    return encode_block_value(K("A"), identity, byte_view(block(identity)), None)


TAMPERS = {
    "truncated": ("corrupt", lambda v: v[: len(v) - 100]),
    "header-only": ("corrupt", lambda v: v[:HEADER_NBYTES]),
    "payload-bit-flip": ("corrupt", lambda v: v[:-1] + bytes([v[-1] ^ 1])),
    "header-bit-flip": ("corrupt", lambda v: v[:300] + bytes([v[300] ^ 1]) + v[301:]),
    "another-model": ("foreign", lambda v: _foreign(ident(fingerprint="cd" * 32))),
    "another-dtype": ("foreign", lambda v: _foreign(ident("float16", (2, 4, 2, 2, 8)))),
    "not-a-block": ("corrupt", lambda v: b"hello"),
}


@pytest.mark.parametrize("tamper", list(TAMPERS), ids=list(TAMPERS))
def test_bad_values_are_counted_misses_never_loaded_and_deleted(
    server: RedisServer, client: redis.Redis, replica: Replica, tamper: str
) -> None:
    kind, edit = TAMPERS[tamper]
    replica.put("A")
    name = redis_key(K("A"))
    client.set(name, edit(client.get(name)))
    results, outs = replica.get("A")
    assert not results[0].ok and kind in (results[0].error or "")  # so the host block is never published
    assert replica.store.error_counts()[kind] == 1
    snap = replica.tier.snapshot(4)
    assert snap.load_failures == 1 and snap.blocks_loaded == 0 and not replica.tier.contains(K("A"))
    assert client.exists(name) == 0  # deleted: the next replica does not trip over it


def test_bad_mac_and_unsigned_values_never_load(server: RedisServer, client: redis.Redis) -> None:
    signed = Replica(server.url, secret=b"our secret")
    forger = Replica(server.url, secret=b"not the secret")
    unsigned = Replica(server.url)
    try:
        forger.put("A")
        unsigned.put("B")
        signed.put("C")
        for name in "AB":
            results, outs = signed.get(name)
            assert not results[0].ok and "bad_mac" in (results[0].error or "")
            assert client.exists(redis_key(K(name))) == 0
        assert signed.store.error_counts()["bad_mac"] == 2
        results, outs = signed.get("C")
        assert results[0].ok and same_bytes(outs[0], block())
    finally:
        for r in (signed, forger, unsigned):
            r.close()


def test_a_value_evicted_between_lookup_and_load_is_a_counted_miss(
    server: RedisServer, client: redis.Redis, replica: Replica
) -> None:
    replica.put("AB")
    assert replica.tier.lookup([K("A"), K("B")]) == 2
    client.delete(redis_key(K("B")))  # evicted (or expired) after the lookup
    spec = replica.tier.prepare_load([K("A"), K("B")])
    outs = [empty(), empty()]
    for key, address, out in zip(spec.keys, spec.addresses, outs, strict=True):
        replica.worker.submit_load(key, address, byte_view(out))
    results = {r.key: r for r in replica.worker.drain(timeout=30)}
    assert results[K("A")].ok and same_bytes(outs[0], block(IDENT, 0))
    assert not results[K("B")].ok and "missing" in (results[K("B")].error or "")
    replica.tier.invalidate(K("B"), results[K("B")].error or "")
    replica.tier.complete_load([K("A")])
    assert replica.store.error_counts()["missing"] == 1
    assert not replica.tier.contains(K("B")) and replica.tier.contains(K("A"))


def test_a_value_rewritten_after_a_bad_read_is_not_deleted(server: RedisServer, client: redis.Redis) -> None:
    r = Replica(server.url)
    try:
        r.put("A")
        name = redis_key(K("A"))
        good = client.get(name)
        assert good is not None
        r.store.delete_if_same(name, b"x" * HEADER_NBYTES)  # the bad value we read is gone: keep this one
        assert client.get(name) == good
    finally:
        r.close()


# ------------------------------------------------------------------------------------ a store that dies
def _wait_for(condition, timeout: float = 15.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_dead_store_costs_under_2ms_logs_once_per_outage_and_recovers(
    server: RedisServer, replica: Replica, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    replica.put("AB")
    assert all(r.ok for r in replica.get("AB")[0])  # pooled connections exist when it dies
    server.kill()  # the real process, by pid
    keys = [K(c) for c in "ABCDEFGH"]
    replica.tier.lookup([K("X"), *keys])  # the first failure opens the breaker
    assert replica.store.breaker.state is BreakerState.OPEN
    assert not replica.tier.contains(K("A"))  # a restarted store may be empty: forgotten
    costs = []
    for _ in range(500):
        t = time.perf_counter()
        assert replica.tier.lookup([K("Y"), *keys]) == 0
        assert replica.tier.prepare_store(keys).keys == ()  # stores are dropped at once
        costs.append(time.perf_counter() - t)
    costs.sort()
    assert sum(costs) / len(costs) < 0.002 and costs[int(0.9 * len(costs))] < 0.002  # no timeout paid
    assert replica.put("C") == []  # nothing reaches the worker
    outage = [r for r in remote_records(caplog) if "unreachable" in r.getMessage()]
    assert len(outage) == 1, [r.getMessage() for r in remote_records(caplog)]
    assert replica.store.error_counts()["connect"] >= 1
    assert replica.tier.snapshot(4).breaker_state == 1

    server.start()  # the same port
    _wait_for(lambda: replica.store.breaker.allow())
    assert len([r for r in remote_records(caplog) if "answers again" in r.getMessage()]) == 1
    assert all(r.ok for r in replica.put("AB"))
    results, outs = replica.get("AB")
    assert all(r.ok for r in results) and same_bytes(outs[1], block(IDENT, 1))
    assert len([r for r in remote_records(caplog) if "unreachable" in r.getMessage()]) == 1  # no stale socket

    server.kill()  # a second outage is a second line
    replica.tier.lookup([K("X")])
    outage = [r for r in remote_records(caplog) if "unreachable" in r.getMessage()]
    assert len(outage) == 2


def test_an_outage_during_a_lookup_is_a_miss_not_a_load_of_forgotten_keys(
    server: RedisServer, replica: Replica
) -> None:
    """The store dies while a lookup asks it about the blocks after those known to be there: the
    outage forgets the known ones, so the lookup must not report them (a load would find no key)."""
    replica.put("AB")
    assert replica.tier.lookup([K("A"), K("B")]) == 2  # known: the next lookup asks only about C...
    server.kill()
    assert replica.tier.lookup([K("A"), K("B"), K("C")]) == 0  # ...and that round trip fails
    assert not replica.tier.contains(K("A"))
    assert replica.tier.prepare_store([K("A")]).keys == ()  # nothing is promised while it is down
    server.start()
    _wait_for(lambda: replica.store.breaker.allow())
    assert replica.tier.lookup([K("A"), K("B")]) == 0  # it restarted empty: still a miss, never a KeyError
    assert all(r.ok for r in replica.put("AB"))
    results, _ = replica.get("AB")
    assert all(r.ok for r in results)


def test_a_store_restarted_between_two_commands_is_noticed_and_its_blocks_forgotten(
    server: RedisServer, replica: Replica, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis restarts (empty) while this tier sends it nothing: no command failed, so no breaker opened,
    yet the blocks it knew are gone. Its next lookup (or the snapshot a router reads) sees the new
    ``run_id`` and forgets them, instead of promising blocks that a load would not find."""
    monkeypatch.setattr("kvtier.tiers.remote_store.INSTANCE_CHECK_S", 0.0)
    replica.put("AB")
    assert replica.tier.lookup([K("A"), K("B")]) == 2
    assert replica.tier.held_keys() == [K("A"), K("B")]
    server.kill()
    server.start()
    assert replica.store.breaker.allow()  # nothing noticed the outage
    assert replica.tier.held_keys() == []
    assert replica.tier.lookup([K("A"), K("B")]) == 0
    assert all(r.ok for r in replica.put("A"))
    assert replica.tier.lookup([K("A"), K("B")]) == 1  # the same instance: known blocks stay known


def test_store_unreachable_at_start_up_is_one_line_and_no_cost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    port = free_port()  # nothing listens there yet
    r = Replica(f"redis://127.0.0.1:{port}/0")
    try:
        t0 = time.perf_counter()
        for _ in range(200):
            assert r.tier.lookup([K("A")]) == 0
            assert r.tier.prepare_store([K("A")]).keys == ()
        assert (time.perf_counter() - t0) / 200 < 0.002
        assert len(remote_records(caplog)) == 1
        server = RedisServer(tmp_path / "late", port).start()  # it comes up later
        try:
            _wait_for(lambda: r.store.breaker.allow())
            assert all(x.ok for x in r.put("A"))
        finally:
            server.stop()
    finally:
        r.close()


def test_password_urls_are_redacted_and_wrong_passwords_disable_the_tier(tmp_path: Path) -> None:
    assert redacted("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert redacted("rediss://user:s3cret@host/0") == "rediss://user:***@host/0"
    server = RedisServer(tmp_path / "auth", None, "--requirepass", "right").start()
    try:
        good = Replica(f"redis://:right@127.0.0.1:{server.port}/3")  # a password and a database
        bad = Replica(f"redis://:wrong@127.0.0.1:{server.port}/3")
        try:
            assert all(r.ok for r in good.put("A"))
            results, outs = good.get("A")  # the bulk read path authenticates and selects the same way
            assert results[0].ok and same_bytes(outs[0], block())
            auth = redis.Redis(port=server.port, password="right", db=3)
            assert auth.exists(redis_key(K("A"))) == 1
            auth.close()
            assert bad.tier.disabled and bad.tier.lookup([K("A")]) == 0
            assert "s3cret" not in repr(bad.store.url) and "wrong" not in bad.store.url
        finally:
            good.close()
            bad.close()
    finally:
        server.stop()


# ------------------------------------------------------------------------------------ config and metrics
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_remote_url": "http://127.0.0.1:6379", "kv_host_gb": 1}, "redis://, rediss:// or unix://"),
        ({"kv_remote_url": "redis://127.0.0.1:6379/0"}, "needs kv_host_gb > 0"),
        ({"kv_remote_policy": "sometimes"}, "kv_remote_policy must be"),
        ({"kv_remote_ttl_s": -1}, "kv_remote_ttl_s must be"),
        ({"kv_remote_ttl_s": 1.5}, "kv_remote_ttl_s must be"),
        ({"kv_remote_ttl_s": float("inf")}, "kv_remote_ttl_s must be"),
    ],
)
def test_bad_remote_arguments_are_one_line_config_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        EngineArgs(**kwargs).validate()
    assert "\n" not in str(info.value)


def test_a_password_is_not_repeated_in_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        EngineArgs(kv_remote_url="http://:hunter2@host:1/0", kv_host_gb=1).validate()
    assert "hunter2" not in str(info.value)


def test_cli_has_the_remote_flags() -> None:
    from kvtier.cli import build_parser

    ns = build_parser().parse_args(
        ["generate", "x", "--kv-remote-url", "redis://h:1/0", "--kv-remote-policy", "write_back"]
        + ["--kv-remote-ttl-s", "60"]
    )
    assert (ns.kv_remote_url, ns.kv_remote_policy, ns.kv_remote_ttl_s) == (
        "redis://h:1/0",
        "write_back",
        60.0,
    )


def test_errors_and_breaker_state_reach_metrics(
    server: RedisServer, replica: Replica, client: redis.Redis
) -> None:
    replica.put("A")
    client.set(redis_key(K("A")), b"garbage")
    replica.get("A")
    snap = replica.tier.snapshot(4)
    stats = EngineStats(0, 0, 0.0, 0, 0, {}, 0, 0, {Medium.REMOTE: snap})
    text = ServerMetrics(lambda: stats).render().decode()
    assert 'kvtier:remote_errors_total{kind="corrupt"} 1.0' in text
    assert 'kvtier:remote_errors_total{kind="connect"} 0.0' in text
    assert "kvtier:remote_breaker_state 0.0" in text
    assert 'kvtier:tier_blocks_stored_total{tier="remote"} 1.0' in text


def test_worker_batches_keep_submission_order_across_kinds(server: RedisServer, replica: Replica) -> None:
    """Queued jobs are batched by kind without reordering: a load queued after a store sees it."""
    tier, worker = replica.tier, replica.worker
    outs = {name: empty() for name in "ABCD"}
    for i, name in enumerate("ABCD"):
        (address,) = tier.prepare_store([K(name)]).addresses
        worker.submit_store(K(name), address, byte_view(block(IDENT, i)))
        worker.submit_load(K(name), address, byte_view(outs[name]))
    results = worker.drain(timeout=30)
    assert [(r.kind, r.key) for r in results] == [
        (kind, K(name)) for name in "ABCD" for kind in ("store", "load")
    ]
    assert all(r.ok for r in results)
    for i, name in enumerate("ABCD"):
        assert same_bytes(outs[name], block(IDENT, i))


def test_a_hung_store_costs_one_timeout_then_nothing(
    server: RedisServer, replica: Replica, caplog: pytest.LogCaptureFixture
) -> None:
    import os
    import signal

    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)  # alive but not answering: connections hang
    try:
        t0 = time.perf_counter()
        assert replica.tier.lookup([K("A")]) == 0
        assert time.perf_counter() - t0 < 3.0  # the lookup's own timeout (1 s), once
        assert replica.store.error_counts()["timeout"] == 1
        t0 = time.perf_counter()
        for _ in range(100):
            assert replica.tier.lookup([K("A")]) == 0
        assert (time.perf_counter() - t0) / 100 < 0.002
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    _wait_for(lambda: replica.store.breaker.allow())
    assert all(r.ok for r in replica.put("A"))


def test_story_write_through_remote_publishes_blocks_as_they_fill_then_another_engine_reads_them(
    server: RedisServer, client: redis.Redis
) -> None:
    """The host tier's own policy is write-back, the remote level's write-through: a full block goes
    device -> host -> Redis at once (not when evicted), and a second engine's rig is served from it."""
    from kvtier.kv.hashing import hash_full_blocks, root_hash
    from kvtier.tiers.coordinator import ExternalLevel
    from tests.test_tiers import BS, KEYS, A, Rig

    rigs = []
    for _ in range(2):
        rig = Rig(None, host_blocks=8)  # host policy: write_back
        remote = Replica(server.url, rig.identity)
        rig.tiers.external.append(ExternalLevel(remote.tier, remote.worker, "write_through"))
        rigs.append((rig, remote))
    try:
        (first, first_remote), (second, second_remote) = rigs
        first.prefill("A", A)
        first.run_plan()  # the full blocks' device -> host copies
        for r in first_remote.worker.drain(timeout=30):
            first.tiers._apply(first.tiers.external[0], r)
        hashes = hash_full_blocks(A, BS, root_hash(KEYS))
        assert all(client.exists(redis_key(h)) for h in hashes)  # published while A still runs
        hit = second.kv.get_computed_blocks(A, KEYS)  # a cold engine: the reads start
        assert hit.lower.num_pending_blocks == 3
        second.tiers.wait(30.0)
        while second.tiers.has_pending_io:
            second.tiers.wait(30.0)
        assert second.prefill("A2", A)["remote"] == 3 * BS
        assert second_remote.tier.snapshot(BS).blocks_loaded == 3
    finally:
        for _, remote in rigs:
            remote.close()
