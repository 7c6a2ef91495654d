"""What a hostile writer of the remote store or the disk directory can do to a
replica is a miss, never a memory blow-up or a hang.

* Remote: values under block keys are read bounded (``GETRANGE`` of a block's size plus one byte): a
  huge value (a valid header or not) is refused unread, counted ``foreign`` and deleted, and a replica's
  peak RSS grows by about the batch's blocks, not by the values' sizes. Batches are split to
  ``READ_BATCH_BYTES``.
* Disk: a FIFO at the old, predictable start-up probe name, at the shared ledger's name or at a held
  block's path never blocks: start-up completes, the read is a miss (the FIFO removed), and shutdown
  does not wait on a stalled worker longer than ``IO_STALL_S``.

Every FIFO test unblocks its FIFO at the end, so even a regression leaves no thread stuck for good.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch

from kvtier.tiers import coordinator as coordinator_module
from kvtier.tiers import remote as remote_module
from kvtier.tiers.base import BlockKey, TierIdentity
from kvtier.tiers.block_format import HEADER_NBYTES
from kvtier.tiers.coordinator import ExternalLevel, TierCoordinator
from kvtier.tiers.disk import DiskBlockIO, DiskTier
from kvtier.tiers.disk_dir import LEDGER_NAME
from kvtier.tiers.host import HostTier
from kvtier.tiers.remote import RedisBlockIO, RemoteTier
from kvtier.tiers.remote_store import RemoteStore, redis_key
from kvtier.transfer.io_worker import BlockIOWorker
from kvtier.transfer.mover import byte_view
from tests.redis_server import RedisServer
from tests.tier_blocks import K

SHAPE = (2, 4, 2, 1, 8)  # [num_layers, block_size, 2, num_kv_heads, head_dim]
REAL_SHAPE = (30, 16, 2, 3, 64)  # SmolLM2-135M, block size 16: 737,280 bytes in fp32
HUGE_NBYTES = 40 << 20  # each hostile value (the were 300 MB; 40 MB keeps CI cheap)


def ident(shape: tuple[int, ...] = SHAPE) -> TierIdentity:
    return TierIdentity("ab" * 32, "float32", shape, 4)


def block(identity: TierIdentity, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (identity.block_bytes,), dtype=torch.uint8, generator=gen)
    return raw.view(torch.float32).reshape(identity.block_shape)


def empty(identity: TierIdentity) -> torch.Tensor:
    return torch.full(identity.block_shape, 7, dtype=torch.float32)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# ------------------------------------------------------------------------------------------ peak RSS
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def peak_rss_growth(fn: Callable[[], object]) -> int:
    """How far this process's resident memory rose above its level before ``fn`` while ``fn`` ran:
    the kernel's peak (VmHWM, reset through clear_refs), or a 1 ms sampler where that is refused."""
    before = _rss_bytes()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        return _sampled_growth(fn, before)
    fn()
    return _hwm_bytes() - before


def _sampled_growth(fn: Callable[[], object], before: int) -> int:
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], _rss_bytes()) - before


# ------------------------------------------------------------------------------------------ remote
class Replica:
    """One engine's remote tier as the coordinator drives it (as in test_remote_tier.py)."""

    def __init__(self, url: str, identity: TierIdentity, *, ttl_s: int = 3600) -> None:
        self.identity = identity
        self.store = RemoteStore(url, ttl_s=ttl_s)
        self.tier = RemoteTier(self.store, identity)
        self.io = RedisBlockIO(self.store, identity)
        self.worker = BlockIOWorker(self.io)

    def put(self, names: str) -> None:
        spec = self.tier.prepare_store([K(n) for n in names])
        for i, (key, address) in enumerate(zip(spec.keys, spec.addresses, strict=True)):
            self.worker.submit_store(key, address, byte_view(block(self.identity, i)))
        for r in self.worker.drain(timeout=30):
            assert r.ok, r.error
            self.tier.complete_store([r.key], seconds=r.seconds)

    def read(self, names: str) -> tuple[list[BaseException | None], list[torch.Tensor]]:
        """One batch, as the worker hands it over: every name looked up, then read in one call."""
        keys = [K(n) for n in names]
        assert self.tier.lookup(keys) == len(keys)
        spec = self.tier.prepare_load(keys)
        outs = [empty(self.identity) for _ in keys]
        jobs = [(k, a, byte_view(o)) for k, a, o in zip(spec.keys, spec.addresses, outs, strict=True)]
        return self.io.read_batch(jobs), outs

    def close(self) -> None:
        self.worker.close(timeout=10)
        self.tier.close()


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_server.url)
    yield c
    c.close()


def test_huge_values_under_block_keys_are_refused_unread_counted_foreign_and_deleted(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    identity = ident(REAL_SHAPE)
    value_nbytes = HEADER_NBYTES + identity.block_bytes
    replica = Replica(redis_server.url, identity)
    try:
        replica.put("AE")  # A is then overwritten: a valid header of ours does not make it readable
        ours = client.get(redis_key(K("A")))
        assert ours is not None and len(ours) == value_nbytes
        hostile = {
            "A": ours + bytes(HUGE_NBYTES),
            "B": bytes(HUGE_NBYTES),
            "C": b"\xff" * HUGE_NBYTES,
            "D": ours + b"x",  # one byte over the limit
        }
        for name, value in hostile.items():
            client.set(redis_key(K(name)), value)
        del ours, hostile, value
        outcome: dict[str, object] = {}

        def load() -> None:
            outcome["errors"], outcome["outs"] = replica.read("ABCDE")

        growth = peak_rss_growth(load)
        errors, outs = outcome["errors"], outcome["outs"]
        assert isinstance(errors, list) and isinstance(outs, list)
        batch_nbytes = 5 * value_nbytes
        assert growth < 2 * batch_nbytes + (16 << 20), f"peak RSS grew {growth / 2**20:.1f} MiB"
        for name, error in zip("ABCD", errors, strict=False):
            assert error is not None and "foreign" in str(error), (name, error)
            assert client.exists(redis_key(K(name))) == 0, f"{name} was not deleted"
        assert errors[4] is None and same_bytes(outs[4], block(identity, 1))
        assert replica.store.error_counts()["foreign"] == 4
    finally:
        replica.close()


def test_an_oversized_value_rewritten_since_the_read_is_not_deleted(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    replica = Replica(redis_server.url, ident())
    try:
        replica.put("A")
        name = redis_key(K("A"))
        good = client.get(name)
        assert good is not None
        head = good[:HEADER_NBYTES]
        replica.store.delete_if_same(name, head, (len(good) + 1, 1 << 62))  # the long one is gone
        assert client.get(name) == good
        client.set(name, good + b"tail")
        replica.store.delete_if_same(name, head, (len(good) + 1, 1 << 62))
        assert client.exists(name) == 0
    finally:
        replica.close()


def test_a_read_batch_is_split_to_the_byte_budget_and_stays_exact(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    identity = ident()
    monkeypatch.setattr(remote_module, "READ_BATCH_BYTES", 2 * (HEADER_NBYTES + identity.block_bytes))
    replica = Replica(redis_server.url, identity)
    try:
        replica.put("ABCDE")
        sizes: list[int] = []
        get_many = replica.store.bulk.get_many

        def spy(names, *args):  # noqa: ANN001, ANN202
            sizes.append(len(names))
            return get_many(names, *args)

        monkeypatch.setattr(replica.store.bulk, "get_many", spy)
        errors, outs = replica.read("ABCDE")
        assert sizes == [2, 2, 1]
        assert errors == [None] * 5
        assert all(same_bytes(out, block(identity, i)) for i, out in enumerate(outs))
    finally:
        replica.close()


@pytest.mark.parametrize("ttl_s", [3600, 0], ids=["ttl", "no-expiry"])
def test_missing_empty_and_oversized_values_are_told_apart(
    redis_server: RedisServer, client: redis.Redis, ttl_s: int
) -> None:
    identity = ident()
    replica = Replica(redis_server.url, identity, ttl_s=ttl_s)
    try:
        replica.put("ABCD")
        client.delete(redis_key(K("A")))  # evicted after the lookup: missing
        client.set(redis_key(K("B")), b"")  # an empty value: not ours
        client.set(redis_key(K("C")), bytes(HEADER_NBYTES + identity.block_bytes + 1))
        keys = [K(n) for n in "ABCD"]
        spec = replica.tier.prepare_load(keys)
        outs = [empty(identity) for _ in keys]
        jobs = [(k, a, byte_view(o)) for k, a, o in zip(spec.keys, spec.addresses, outs, strict=True)]
        errors = replica.io.read_batch(jobs)
        kinds = [str(e).split(":")[0] if e else None for e in errors]
        assert kinds == ["missing", "corrupt", "foreign", None]
        assert same_bytes(outs[3], block(identity, 3))
        assert client.exists(*[redis_key(K(n)) for n in "ABC"]) == 0
        ttl = client.ttl(redis_key(K("D")))
        assert (ttl > 3500) if ttl_s else ttl == -1
    finally:
        replica.close()


# ------------------------------------------------------------------------------------------ disk
def _unblock(fifo: Path) -> None:
    """Open both ends of ``fifo`` without blocking, so anything stuck opening it returns."""
    for flags in (os.O_RDONLY | os.O_NONBLOCK, os.O_WRONLY | os.O_NONBLOCK):
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, flags))


def _in_thread(fn: Callable[[], object], timeout: float) -> tuple[bool, list[object]]:
    """Run ``fn`` on a daemon thread; whether it finished within ``timeout``, and its result."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive(), result


def test_a_fifo_at_the_old_probe_name_does_not_hang_start_up(tmp_path: Path) -> None:
    directory = tmp_path / "disk"
    directory.mkdir(mode=0o700)
    fifo = directory / f".probe.{os.getpid()}.kvb.tmp."
    os.mkfifo(fifo)
    try:
        finished, result = _in_thread(lambda: DiskTier(directory, 1 << 20, ident()), timeout=10)
        assert finished, "start-up hangs on a FIFO at the probe's name"
        (tier,) = result
        assert isinstance(tier, DiskTier) and not tier.disabled
        assert sorted(p.name for p in directory.iterdir() if p.name.startswith(".probe.")) == [fifo.name]
    finally:
        _unblock(fifo)


def test_a_fifo_at_the_ledger_name_disables_the_tier_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "disk"
    directory.mkdir(mode=0o700)
    fifo = directory / LEDGER_NAME
    os.mkfifo(fifo)
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
            finished, result = _in_thread(lambda: DiskTier(directory, 1 << 20, ident()), timeout=10)
        assert finished
        (tier,) = result
        assert isinstance(tier, DiskTier) and tier.disabled
        assert "not a regular file" in (tier.disabled_reason or "")
    finally:
        _unblock(fifo)


def test_a_held_block_replaced_by_a_fifo_is_a_removed_miss_and_close_is_quick(tmp_path: Path) -> None:
    identity = ident()
    tier = DiskTier(tmp_path / "disk", 1 << 20, identity)
    worker = BlockIOWorker(tier.block_io(), name="test-disk-io")
    fifo = Path(tier.path_of(K("A")))
    try:
        spec = tier.prepare_store([K("A")])
        worker.submit_store(K("A"), spec.addresses[0], byte_view(block(identity)))
        (stored,) = worker.drain(timeout=10)
        tier.complete_store([K("A")], stored.ok)
        fifo.unlink()
        os.mkfifo(fifo, 0o600)
        spec = tier.prepare_load([K("A")])
        out = empty(identity)
        worker.submit_load(K("A"), spec.addresses[0], byte_view(out))
        results = worker.drain(timeout=5)
        assert len(results) == 1, "the disk I/O thread is stuck on a FIFO"
        (loaded,) = results
        assert not loaded.ok and not loaded.fatal and "not a regular file" in (loaded.error or "")
        tier.invalidate(K("A"), loaded.error or "")
        tier.complete_load([K("A")])
        assert not fifo.exists() and not tier.contains(K("A"))
        assert tier.counters.load_failures == 1 and not tier.disabled
        start = time.monotonic()
        worker.close(timeout=5)
        assert time.monotonic() - start < 5 and not worker._thread.is_alive()
    finally:
        _unblock(fifo)


class HungIO(DiskBlockIO):
    """A disk whose reads never return (a hung mount): the worst the I/O thread can meet."""

    def __init__(self, identity: TierIdentity, release: threading.Event) -> None:
        super().__init__(identity)
        self.release = release

    def read(self, key: BlockKey, address: object, out: memoryview, group: int = 0) -> None:  # type: ignore[override]
        self.release.wait()
        raise OSError("released")


class NoHostBytes:
    def host_view(self, host_block_id: int) -> memoryview:
        raise AssertionError("no host block is read")

    host_snapshot = host_view


def test_shutdown_leaves_a_stalled_tier_behind_with_one_log_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(coordinator_module, "IO_STALL_S", 0.5)
    identity = ident()
    tier = DiskTier(tmp_path / "disk", 1 << 20, identity)
    tier.complete_store(tier.prepare_store([K("A")]).keys)
    release = threading.Event()
    worker = BlockIOWorker(HungIO(identity, release), name="test-hung-io")
    coordinator = TierCoordinator(HostTier(4), [ExternalLevel(tier, worker)])
    coordinator.host_bytes = NoHostBytes()  # the host tier holds nothing to flush
    try:
        worker.submit_load(K("A"), tier.path_of(K("A")), byte_view(empty(identity)))
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
            start = time.monotonic()
            coordinator.flush(timeout=60)
            coordinator.close()
            elapsed = time.monotonic() - start
        assert elapsed < 3, f"shutdown waited {elapsed:.1f} s on a stalled disk"
        assert tier.disabled and "stalled" in (tier.disabled_reason or "")
        lines = [r for r in caplog.records if r.name == "kvtier.tiers.disk"]
        assert len(lines) == 1 and "stalled" in lines[0].getMessage()
    finally:
        release.set()
