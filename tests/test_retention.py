"""Prompt-cache retention (kvtier/kv/retention.py), tier by tier and end to end.

The story: an agent's long system prompt is asked to stay cached for five minutes. A burst of other
traffic then fills the device pool and the host tier; without retention the agent's next step misses,
with it the blocks come back from the device (evicted last) or the host tier (passed over by its LRU).
The retention ends when its TTL runs out (a fake clock), each tier keeps at most its cap, a refresh on
every hit extends it, another tenant's prompt never hits it, and the answers never change.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvtier import LLM, SamplingParams
from kvtier.kv.block_pool import BlockPool
from kvtier.kv.retention import Retention, RetentionSpan, TierProtection
from kvtier.stats import Medium
from kvtier.tiers.base import BlockKey
from kvtier.tiers.host import HostTier


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def k(name: str) -> BlockKey:
    return BlockKey(name.encode().ljust(32, b"."))


# --------------------------------------------------------------------------------- the record
def test_a_retained_key_expires_a_refresh_extends_it_and_the_cap_refuses_the_rest() -> None:
    clock = Clock()
    r = Retention(max_blocks=3, clock=clock)
    assert r.retain([k("a"), k("b")], 300) == 2
    clock.now += 200
    assert r.retain([k("a")], 300) == 1  # a hit refreshes: a now lives until +500
    assert r.retain([k("c"), k("d"), k("e")], 60) == 1  # the cap: c fits, d and e do not
    assert r.num_refused == 2 and len(r) == 3
    clock.now += 150  # +350: b (until +300) and c (until +260) expired, a (until +500) has not
    assert [r.is_retained(k(x)) for x in "abc"] == [True, False, False]
    assert r.retain([k("d")], 60) == 1  # room again once the expired are forgotten
    assert r.until(k("a")) == pytest.approx(1_000_500.0)
    r.restore(k("z"), clock.now - 1)  # a header's expiry in the past is no retention
    assert not r.is_retained(k("z"))


def test_the_retained_count_of_a_tier_walks_the_smaller_side_and_is_cached_a_second() -> None:
    """What /metrics reads every engine step must not walk a 100k-block tier each time."""
    clock = Clock()
    r = Retention(max_blocks=10, clock=clock)
    r.retain([k("a"), k("b")], 60)
    many = {k(str(i)): None for i in range(50)} | {k("a"): None}
    assert r.count_in(many) == 1 and r.count_in({k("a"): None}) == 1 and Retention(5).count_in(many) == 0
    protection = TierProtection(r, 8)
    assert protection.count(many) == 1
    r.retain([k("0")], 60)
    assert protection.count(many) == 1  # within the second: the cached count
    clock.now += 1.5
    assert protection.count(many) == 2


def test_a_span_outside_the_ttls_is_refused() -> None:
    with pytest.raises(ValueError, match="ttl"):
        RetentionSpan(100, 0)
    with pytest.raises(ValueError, match="ttl"):
        RetentionSpan(100, 2 * 86400)


# --------------------------------------------------------------------------------- device pool
def _pool_with_idle(retention: Retention | None, cached: list[str]) -> tuple[BlockPool, dict[str, int]]:
    """A 6-block pool whose first blocks hold ``cached`` keys, all idle (freed in that order)."""
    pool = BlockPool(6, True, retention=retention)
    blocks = pool.get_new_blocks(len(cached))
    for block, name in zip(blocks, cached, strict=True):
        pool.cache_block(block, k(name), (0,), 0)
    pool.free_blocks(blocks)
    return pool, {name: b.block_id for name, b in zip(cached, blocks, strict=True)}


def test_the_device_pool_evicts_a_retained_block_last_within_its_cap() -> None:
    clock = Clock()
    retention = Retention(max_blocks=10, max_fraction=0.34, clock=clock)  # device cap: 2 of 6
    retention.retain([k("sys1"), k("sys2"), k("sys3")], 300)
    pool, ids = _pool_with_idle(retention, ["sys1", "sys2", "sys3", "other"])
    assert pool.num_retained_idle == 2  # sys3 found the cap full: an ordinary cached block
    order = pool.free_queue_block_ids()
    assert order[-2:] == [ids["sys1"], ids["sys2"]]  # taken after every other free block
    assert order.index(ids["sys3"]) < order.index(ids["other"])  # LRU among the ordinary ones
    taken = pool.get_new_blocks(4)  # 2 uncached + sys3 + other: the retained ones stay
    assert (
        pool.get_cached_block(k("sys1"), (0,)) is not None and pool.get_cached_block(k("sys3"), (0,)) is None
    )
    pool.check_integrity()
    pool.free_blocks(taken)
    pool.touch([pool.get_cached_block(k("sys1"), (0,))])  # a hit takes it out of the retained queue
    assert pool.num_retained_idle == 1
    pool.check_integrity()


# --------------------------------------------------------------------------------- host, disk
def test_the_host_tier_passes_over_retained_keys_until_they_expire() -> None:
    clock = Clock()
    retention = Retention(max_blocks=10, max_fraction=0.5, clock=clock)  # host cap: 2 of 4
    retention.retain([k("s1"), k("s2"), k("s3")], 300)
    tier = HostTier(4, retention=retention)
    for name in ("s1", "s2", "s3", "x"):
        tier.complete_store(tier.prepare_store([k(name)]).keys)
    spec = tier.prepare_store([k("y"), k("z")])  # two evictions: s3 (past the cap) and x
    assert set(spec.evicted) == {k("s3"), k("x")}
    assert tier.contains(k("s1")) and tier.contains(k("s2"))
    clock.now += 301  # expired: the next store evicts them in LRU order again
    spec = tier.prepare_store([k("w")])
    assert spec.evicted and spec.evicted[0] in (k("s1"), k("s2"))
    tier.check_integrity()


def test_a_tier_protection_takes_no_more_than_its_cap() -> None:
    retention = Retention(max_blocks=100, max_fraction=0.25)
    retention.retain([k(str(i)) for i in range(10)], 60)
    protection = TierProtection(retention, capacity_blocks=8)
    assert [protection.protects(k(str(i))) for i in range(4)] == [True, True, False, False]
    protection.forget(k("0"))
    assert protection.protects(k("3"))
    assert not TierProtection(None, 8).protects(k("1"))


def test_the_disk_tier_protects_retained_keys_and_remembers_them_across_a_restart(tmp_path: Path) -> None:
    """A 4-block disk tier keeps the retained keys through a burst of stores; closing it writes the
    retention file, and a new engine's tier (a restart) restores the promise and protects them again."""
    from tests.test_disk_tier import K, disk_worker, make_tier, store

    clock = Clock()
    retention = Retention(max_blocks=10, max_fraction=0.5, clock=clock)
    retention.retain([K("s"), K("t")], 3600)
    tier, worker = DiskTier_with(retention, tmp_path, make_tier), disk_worker()
    store(tier, worker, "st")
    evicted = [key for burst in ("abc", "def", "gh") for key in store(tier, worker, burst, seed=3)]
    assert K("s") not in evicted and K("t") not in evicted and tier.contains(K("s"))
    tier.close()
    assert (tmp_path / ".kvtier-retention").read_text().count("\n") == 2
    restarted = Retention(max_blocks=10, max_fraction=0.5, clock=clock)
    tier2 = DiskTier_with(restarted, tmp_path, make_tier)
    assert restarted.until(K("s")) == pytest.approx(clock.now + 3600, abs=0.01)
    evicted = [key for burst in ("ij", "kl") for key in store(tier2, worker, burst, seed=5)]
    assert tier2.contains(K("s")) and tier2.contains(K("t")) and len(evicted) == 4
    clock.now += 3601  # expired: the file no longer promises anything
    tier2.close()
    assert (tmp_path / ".kvtier-retention").read_text() == ""
    worker.close()


def DiskTier_with(retention: Retention, directory: Path, make_tier):  # noqa: ANN001, ANN201, N802
    """``make_tier``'s 4-block tier over ``directory`` with ``retention``."""
    from kvtier.tiers.disk import DiskTier

    plain = make_tier(directory, num_blocks=4)
    return DiskTier(
        directory, plain._capacity_blocks * plain.file_nbytes, plain.identity, retention=retention
    )


def test_a_forged_or_damaged_retention_file_is_read_line_by_line(tmp_path: Path) -> None:
    from kvtier.tiers import retention_file

    now = 1_000_000.0
    good, far, bad = "ab" * 32, "cd" * 32, "zz" * 32
    lines = [f"{good} {now + 60}", f"{far} {now + 10 * 86400}", f"{bad} {now + 60}", "garbage", f"{good} nan"]
    (tmp_path / ".kvtier-retention").write_text("\n".join(lines))
    assert retention_file.load(str(tmp_path), now) == {bytes.fromhex(good): now + 60}  # the rest ignored


def test_a_retained_blocks_redis_value_lives_at_least_as_long_as_its_retention(redis_server) -> None:
    """kv_remote_ttl_s of 60 s: an ordinary block expires in a minute, a block retained for an hour gets
    the hour, written or refreshed."""
    import redis

    from kvtier.tiers.remote import RedisBlockIO
    from kvtier.tiers.remote_store import redis_key
    from tests.test_remote_tier import K, Replica

    retention = Retention(max_blocks=10)
    retention.retain([K("r")], 3600)
    replica = Replica(redis_server.url, ttl_s=60)
    replica.worker = type(replica.worker)(RedisBlockIO(replica.store, replica.identity, None, retention))
    assert all(r.ok for r in replica.put("rx"))
    client = redis.Redis.from_url(redis_server.url)
    ttl = {name: client.ttl(redis_key(K(name))) for name in "rx"}
    assert 3500 < ttl["r"] <= 3600 and 0 < ttl["x"] <= 60
    replica.close()


def test_a_redis_hit_never_shortens_a_retained_values_expiry(redis_server) -> None:
    """kv_remote_ttl_s of 60 s below an hour's retention: a hit refreshes the ordinary block to a minute
    and the retained one to its remaining hour (it used to cut it to the minute), and the blocks read
    back intact. Once the retention is over, a hit refreshes it to the minute like any other."""
    import redis

    from kvtier.tiers.remote import RedisBlockIO
    from kvtier.tiers.remote_store import redis_key
    from tests.test_remote_tier import K, Replica

    clock = Clock()
    clock.now = time.time()
    retention = Retention(max_blocks=10, clock=clock)
    retention.retain([K("r")], 3600)
    replica = Replica(redis_server.url, ttl_s=60)
    replica.worker = type(replica.worker)(RedisBlockIO(replica.store, replica.identity, None, retention))
    assert all(r.ok for r in replica.put("rx"))
    client = redis.Redis.from_url(redis_server.url)
    for name in "rx":
        client.expire(redis_key(K(name)), 30)  # time passed: both values have half a minute left
    results, _ = replica.get("rx")
    assert all(r.ok for r in results), [r.error for r in results]
    ttl = {name: client.ttl(redis_key(K(name))) for name in "rx"}
    assert 3500 < ttl["r"] <= 3600 and 30 < ttl["x"] <= 60, ttl
    clock.now += 3601  # the retention is over: an ordinary block now
    client.expire(redis_key(K("r")), 30)
    results, _ = replica.get("r")
    assert results[0].ok and 30 < client.ttl(redis_key(K("r"))) <= 60
    replica.close()


# --------------------------------------------------------------------------------- end to end
SYSTEM = list(range(5, 5 + 96))  # an agent's system prompt: 6 blocks of 16


def _flood(llm: LLM, n: int, seed: int) -> None:
    """Unrelated prompts that fill the device pool (and the host tier) several times over."""
    prompts = [[(seed * 7 + i * 13 + j) % 300 + 120 for j in range(80)] for i in range(n)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))


def _step(llm: LLM, tail: int, retention: tuple[RetentionSpan, ...], salt: str | None = None):  # noqa: ANN202
    prompt = SYSTEM + [450 + tail, 451 + tail, 452 + tail]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return llm.generate([prompt], params, retention=retention, cache_salt=salt)[0]


@pytest.mark.parametrize(
    "host_gb, seqs", [(0.0, 2), (0.0002, 4)], ids=["device-only", "with-host-tier"]
)  # host: ~26 blocks; 2 flood sequences need 12 device blocks, 4 need all 24
def test_an_agents_system_prompt_survives_a_flood_only_with_retention(
    tiny_llama_dir, host_gb: float, seqs: int
) -> None:
    """Device-only: the retained blocks are evicted last, after the flood's own. With a host tier and a
    flood that needs the whole device pool, they leave the device, and the host tier (smaller than the
    flood) passes over them: they come back from there. The answers are the same with and without."""
    path = tiny_llama_dir()
    span = (RetentionSpan(len(SYSTEM), 300.0),)
    engine = dict(kv_device_blocks=24, kv_host_gb=host_gb, max_num_seqs=seqs)
    results = {}
    for label, retention in (("off", ()), ("on", span)):
        with LLM(str(path), **engine) as llm:
            first = _step(llm, 0, retention)
            _flood(llm, 12, seed=1)
            second = _step(llm, 10, retention)
            results[label] = (first, second)
            if label == "on":
                assert first.num_retained_tokens == len(SYSTEM)
                llm.engine.kv.check_integrity()
                _check_metrics(llm, Medium.HOST if host_gb else Medium.DEVICE)
    assert results["off"][1].num_cached_tokens == 0  # the flood pushed the system prompt out
    hit = results["on"][1]
    assert hit.num_cached_tokens == len(SYSTEM)
    from_host = hit.cached_tokens_by_tier.get(Medium.HOST, 0)
    assert from_host > 0 if host_gb else from_host == 0  # what the flood took from the device came back
    for off, on in zip(results["off"], results["on"], strict=True):
        assert off.outputs[0].token_ids == on.outputs[0].token_ids


def _check_metrics(llm: LLM, tier: Medium) -> None:
    """The engine's stats and /metrics: 6 keys retained, the tier holding them protects them, and the
    second step's 96 cached prompt tokens counted as retained hits."""
    from kvtier.server.metrics import ServerMetrics
    from tests.test_metrics import scrape

    stats = llm.engine.stats()
    assert stats.retained_keys == len(SYSTEM) // 16 and stats.retained_hit_tokens == len(SYSTEM)
    assert stats.tiers[tier].retained_blocks > 0
    samples = scrape(ServerMetrics(lambda: stats))
    assert samples["kvtier:retained_keys"][()] == len(SYSTEM) // 16
    assert samples["kvtier:tier_retained_blocks"][(("tier", str(tier)),)] == stats.tiers[tier].retained_blocks
    assert samples["kvtier:retained_hit_tokens_total"][()] == len(SYSTEM)


def test_retention_ends_with_its_ttl_and_never_crosses_tenants(tiny_llama_dir) -> None:
    path = tiny_llama_dir()
    with LLM(str(path), kv_device_blocks=24, max_num_seqs=2) as llm:
        clock = Clock()
        retention = llm.engine.kv.pool.retention
        assert retention is not None
        retention.clock = clock
        _step(llm, 0, (RetentionSpan(len(SYSTEM), 300.0),), salt="alice")
        _flood(llm, 12, seed=2)
        assert _step(llm, 1, (), salt="bob").num_cached_tokens == 0  # another tenant's keys differ
        _flood(llm, 12, seed=3)
        assert _step(llm, 2, (), salt="alice").num_cached_tokens == len(SYSTEM)  # still retained
        clock.now += 301  # the TTL ran out (the hit above did not refresh: it asked for no retention)
        _flood(llm, 12, seed=4)
        assert _step(llm, 3, (), salt="alice").num_cached_tokens == 0


def test_a_zero_fraction_turns_retention_off(tiny_llama_dir, tmp_path: Path) -> None:
    with LLM(str(tiny_llama_dir()), kv_device_blocks=24, kv_retain_max_fraction=0.0) as llm:
        assert llm.engine.kv.pool.retention is None
        assert _step(llm, 0, (RetentionSpan(len(SYSTEM), 300.0),)).num_retained_tokens == 0


def test_a_span_past_the_cap_reports_the_blocks_it_retained(tiny_llama_dir) -> None:
    """A dense model's span the cap cuts short still retains (and reports) its leading blocks."""
    with LLM(str(tiny_llama_dir()), kv_device_blocks=24) as llm:
        retention = llm.engine.kv.pool.retention
        assert retention is not None
        retention.max_blocks = 4  # the cap: 4 of the system prompt's 6 blocks
        out = _step(llm, 0, (RetentionSpan(len(SYSTEM), 300.0),))
        assert out.num_retained_tokens == 4 * 16 and retention.num_refused == 2


def test_a_repeated_prompt_cached_but_for_its_last_token_still_retains_and_refreshes(tiny_llama_dir) -> None:
    """Sent again, a prompt of 6 blocks and one token computes that one token, a chunk the step runs
    among the decodes: its retention is still taken (and refreshed), as for any other prompt."""
    with LLM(str(tiny_llama_dir()), kv_device_blocks=24) as llm:
        clock = Clock()
        retention = llm.engine.kv.pool.retention
        assert retention is not None
        retention.clock = clock
        prompt = [*SYSTEM, 450]  # 6 full blocks + 1 token
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        span = (RetentionSpan(len(prompt), 300.0),)
        first = llm.generate([prompt], params, retention=span)[0]
        assert first.num_retained_tokens == len(SYSTEM)
        clock.now += 200
        again = llm.generate([prompt], params, retention=span)[0]
        assert again.num_cached_tokens == len(SYSTEM)  # one token left to compute
        assert again.num_retained_tokens == len(SYSTEM)
        clock.now += 200  # 400 s after the first request: retained only because the second refreshed it
        assert len(retention) == 6  # the first request's expiry (300 s) is past: the second refreshed it


def test_an_idle_server_writes_the_disk_tiers_retention_file_down(
    tiny_llama_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk tier writes its retention file from its ``tick``, once per engine step. A server that
    fell idle right after an agent asked for retention steps once a second anyway (``UPKEEP_S``), so
    the promise reaches the file without waiting for a shutdown or the next request (a crash keeps it)."""
    import asyncio

    from kvtier.server.async_engine import AsyncEngine

    monkeypatch.setattr("kvtier.tiers.retention_file.SAVE_INTERVAL_S", 0.0)  # due at every tick
    saved = tmp_path / ".kvtier-retention"
    llm = LLM(str(tiny_llama_dir()), kv_device_blocks=24, kv_host_gb=0.0002, kv_disk_dir=str(tmp_path))
    _step(llm, 0, (RetentionSpan(len(SYSTEM), 300.0),))
    llm.engine.flush_tiers()  # no write left in flight: nothing else makes the idle loop step
    saved.unlink(missing_ok=True)
    server = AsyncEngine(lambda: llm.engine)
    loop = asyncio.new_event_loop()
    server.start(loop)
    try:
        assert server.wait_ready(60)
        for _ in range(3):  # again and again while idle, not once
            deadline = time.monotonic() + 10
            while not (saved.exists() and saved.read_text().count("\n") == len(SYSTEM) // 16):
                assert time.monotonic() < deadline, "the idle server did not write the retention file"
                time.sleep(0.05)
            saved.unlink()
    finally:
        server.shutdown()
        loop.close()
