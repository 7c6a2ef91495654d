"""The disk tier (L3) and its I/O worker: exact round trips, persistence, damaged files, LRU, failures.

Tiny block shapes keep every test fast; one realistic shape checks a full-size block. The stories use
one-letter keys: ``K("A")`` is the sha256 of "A", a valid 32-byte block key.
"""

from __future__ import annotations

import logging
import os
import threading
import zlib
from pathlib import Path

import pytest
import torch

from kvtier.tiers.base import BlockKey, TierIdentity
from kvtier.tiers.block_format import (
    HEADER_NBYTES,
    CorruptBlock,
    decode_block_value,
    decode_header,
    encode_block_value,
    encode_header,
    read_block_file,
    write_block_file,
)
from kvtier.tiers.disk import DiskBlockIO, DiskTier
from kvtier.transfer.io_worker import BlockIOWorker, IOResult
from kvtier.transfer.mover import byte_view
from tests.tier_blocks import IDENT, REAL_SHAPE, SHAPE, K, block, ident, same_bytes

LOGGER = "kvtier.tiers.disk"


def disk_worker(identity: TierIdentity = IDENT) -> BlockIOWorker:
    """The disk tier's background I/O: the generic worker running the disk's own reads and writes."""
    return BlockIOWorker(DiskBlockIO(identity))


def read_block(path: str, key: BlockKey, identity: TierIdentity = IDENT) -> torch.Tensor:
    out = torch.empty(identity.block_shape, dtype=getattr(torch, identity.dtype))
    read_block_file(path, key, identity, byte_view(out))
    return out


def make_tier(directory: Path, num_blocks: int = 8, identity: TierIdentity = IDENT) -> DiskTier:
    return DiskTier(directory, num_blocks * (HEADER_NBYTES + identity.block_bytes), identity)


def store(tier: DiskTier, worker: BlockIOWorker, names: str, seed: int = 0) -> tuple[BlockKey, ...]:
    """What the coordinator does: prepare, write on the worker, publish. Returns the evicted keys."""
    spec = tier.prepare_store([K(n) for n in names])
    for i, (key, path) in enumerate(zip(spec.keys, spec.addresses, strict=True)):
        worker.submit_store(key, path, byte_view(block(tier.identity, seed + i)))
    for result in worker.drain(timeout=30):
        assert result.ok, result.error
        tier.complete_store([result.key], ok=True)
    return spec.evicted


def load(tier: DiskTier, worker: BlockIOWorker, names: str) -> list[IOResult]:
    """What the coordinator does: pin, read on the worker, invalidate what failed, then unpin."""
    keys = [K(n) for n in names]
    spec = tier.prepare_load(keys)
    for key, path in zip(spec.keys, spec.addresses, strict=True):
        worker.submit_load(key, path, byte_view(torch.empty(tier.identity.block_shape, dtype=torch.float32)))
    results = worker.drain(timeout=30)
    for result in results:
        if not result.ok:
            assert not result.fatal and result.error
            tier.invalidate(result.key, result.error)  # before complete_load: not counted as loaded
    tier.complete_load(keys)
    return results


def names_of(tier: DiskTier) -> str:
    inverse = {K(c): c for c in "ABCDEFGHIJ"}
    held = tier.keys()  # least recently used first
    return "".join(inverse[key] for key in held)


def disk_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER]


@pytest.fixture
def worker():
    w = disk_worker(IDENT)
    yield w
    w.close(timeout=10)


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize(
    "identity",
    [ident("float32"), ident("bfloat16"), ident("float16"), ident("float32", REAL_SHAPE)],
    ids=["float32", "bfloat16", "float16", "float32-real-shape"],
)
def test_round_trip_is_byte_identical(tmp_path: Path, identity: TierIdentity) -> None:
    tier = make_tier(tmp_path, identity=identity)
    worker = disk_worker(identity)
    data = block(identity, seed=7)
    spec = tier.prepare_store([K("A")])
    worker.submit_store(K("A"), spec.addresses[0], byte_view(data.clone()))
    (stored,) = worker.drain(timeout=30)
    assert stored.ok and stored.kind == "store" and stored.nbytes == identity.block_bytes
    tier.complete_store(spec.keys)
    host = torch.zeros((3, *identity.block_shape), dtype=data.dtype)  # the host tier's buffer
    worker.submit_load(K("A"), tier.prepare_load([K("A")]).addresses[0], byte_view(host[1]))
    (loaded,) = worker.drain(timeout=30)
    tier.complete_load([K("A")])
    assert loaded.ok and loaded.kind == "load" and loaded.error is None
    assert same_bytes(host[1], data)
    assert not host[0].view(torch.uint8).any() and not host[2].view(torch.uint8).any()  # no spill
    assert os.path.getsize(spec.addresses[0]) == HEADER_NBYTES + identity.block_bytes
    assert worker.close(timeout=10) == []


def test_header_round_trip_and_long_fingerprint() -> None:
    identity = ident("bfloat16", fingerprint="x" * 1000)
    raw = encode_header(K("A"), identity, identity.block_bytes, 1234)
    assert len(raw) == HEADER_NBYTES
    header = decode_header(raw)
    assert header.key == K("A") and header.dtype == "bfloat16" and header.block_shape == SHAPE
    assert header.payload_nbytes == identity.block_bytes and header.payload_crc32 == 1234
    assert header.model_fingerprint.startswith("sha256:")  # too long for the field: stored hashed
    with pytest.raises(CorruptBlock):
        decode_header(raw[:100])


def test_persistence_across_restart(tmp_path: Path, worker: BlockIOWorker) -> None:
    first = make_tier(tmp_path)
    store(first, worker, "ABC", seed=10)
    second = make_tier(tmp_path)  # a restarted engine, same model
    assert second.lookup([K("A"), K("B"), K("C"), K("D")]) == 3
    assert [r.ok for r in load(second, worker, "ABC")] == [True, True, True]
    out = read_block(second.path_of(K("B")), K("B"))
    assert same_bytes(out, block(IDENT, seed=11))


def test_restart_orders_lru_by_mtime_and_trims_to_capacity(tmp_path: Path, worker: BlockIOWorker) -> None:
    first = make_tier(tmp_path)
    store(first, worker, "ABCDE")
    for age, name in enumerate("CAEBD"):  # C oldest ... D newest
        os.utime(first.path_of(K(name)), ns=(10**18 + age * 10**9,) * 2)
    second = make_tier(tmp_path, num_blocks=3)
    assert names_of(second) == "EBD"  # C and A were the oldest: removed at startup
    assert not os.path.exists(first.path_of(K("C"))) and not os.path.exists(first.path_of(K("A")))
    assert second.counters.blocks_evicted == 0


# ------------------------------------------------------------------------------------------ damaged files
def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 1)


def _flip(offset: int):
    def flip(path: str) -> None:
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x01]))

    return flip


def _foreign(identity: TierIdentity):
    def rewrite(path: str) -> None:
        os.unlink(path)
        write_block_file(path, K("A"), identity, byte_view(block(identity)))

    return rewrite


@pytest.mark.parametrize(
    "damage",
    [
        _truncate,
        _flip(0),  # magic
        _flip(30),  # inside the key
        _flip(2000),  # header padding: still covered by the header checksum
        _foreign(ident(fingerprint="cd" * 32)),
        _foreign(ident("float16")),
        _foreign(ident(shape=(2, 8, 2, 1, 8))),
        _foreign(ident(shape=(4, 4, 2, 1, 4))),  # same byte count, other shape
        lambda path: open(path, "wb").close(),  # empty file
    ],
    ids=["truncated", "magic", "key", "padding", "fingerprint", "dtype", "block-size", "shape", "empty"],
)
def test_damaged_or_foreign_file_is_removed_at_startup(
    tmp_path: Path, worker: BlockIOWorker, caplog: pytest.LogCaptureFixture, damage
) -> None:
    first = make_tier(tmp_path)
    store(first, worker, "AB")
    path = first.path_of(K("A"))
    damage(path)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        tier = make_tier(tmp_path)
    assert not tier.contains(K("A")) and tier.contains(K("B"))
    assert not os.path.exists(path)
    records = disk_records(caplog)
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "1 invalid" in records[0].getMessage()


def test_many_bad_files_and_temp_leftovers_give_one_log_line(
    tmp_path: Path, worker: BlockIOWorker, caplog: pytest.LogCaptureFixture
) -> None:
    first = make_tier(tmp_path)
    store(first, worker, "ABCD")
    for name in "ABC":
        _truncate(first.path_of(K(name)))
    leftover = first.path_of(K("D")) + ".tmp.123.0"
    Path(leftover).write_bytes(b"half a block")
    os.utime(leftover, (0, 0))  # a crashed run's: old (a fresh one may be a live engine's write)
    unrelated = tmp_path / "README"
    unrelated.write_text("not ours")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        tier = make_tier(tmp_path)
    assert names_of(tier) == "D"
    assert not os.path.exists(leftover) and unrelated.exists()
    assert len(disk_records(caplog)) == 1
    assert "3 invalid, 1 unfinished" in disk_records(caplog)[0].getMessage()


@pytest.mark.parametrize(
    "damage", [_flip(HEADER_NBYTES + 5), _truncate, os.unlink], ids=["payload", "cut", "gone"]
)
def test_file_damaged_while_running_is_a_miss_on_load(
    tmp_path: Path, worker: BlockIOWorker, caplog: pytest.LogCaptureFixture, damage
) -> None:
    tier = make_tier(tmp_path)
    store(tier, worker, "AB")
    damage(tier.path_of(K("A")))
    damage(tier.path_of(K("B")))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        results = load(tier, worker, "AB")
    assert [r.ok for r in results] == [False, False]
    assert tier.lookup([K("A")]) == 0 and tier.lookup([K("B")]) == 0 and tier.num_used_blocks == 0
    assert not os.path.exists(tier.path_of(K("A"))) and not os.path.exists(tier.path_of(K("B")))
    assert len(disk_records(caplog)) == 1  # once per tier, not once per file
    assert tier.counters.load_failures == 2 and tier.counters.blocks_loaded == 0


def test_read_never_returns_a_damaged_payload(tmp_path: Path) -> None:
    path = str(tmp_path / "a.kvb")
    write_block_file(path, K("A"), IDENT, byte_view(block()))
    _flip(os.path.getsize(path) - 1)(path)
    with pytest.raises(CorruptBlock, match="checksum"):
        read_block(path, K("A"))
    with pytest.raises(CorruptBlock, match="another block"):
        read_block(path, K("B"))


# ------------------------------------------------------------------------------------------ LRU stories
def test_capacity_3_store_abc_load_a_store_d_evicts_b(tmp_path: Path, worker: BlockIOWorker) -> None:
    tier = make_tier(tmp_path, num_blocks=3)
    assert tier.capacity_blocks == 3
    assert store(tier, worker, "ABC") == ()
    assert all(r.ok for r in load(tier, worker, "A"))
    assert store(tier, worker, "D") == (K("B"),)
    assert names_of(tier) == "CAD"
    assert not os.path.exists(tier.path_of(K("B")))
    assert (
        tier.counters.blocks_evicted == 1
        and tier.counters.blocks_stored == 4
        and tier.counters.blocks_loaded == 1
    )


def test_pinned_blocks_are_not_evicted(tmp_path: Path, worker: BlockIOWorker) -> None:
    tier = make_tier(tmp_path, num_blocks=2)
    store(tier, worker, "AB")
    tier.prepare_load([K("A")])  # a load of A in flight: A is pinned
    assert store(tier, worker, "C") == (K("B"),)  # B is older than C but A is pinned
    tier.prepare_load([K("C")])
    spec = tier.prepare_store([K("D")])  # everything pinned: D does not fit
    assert spec.keys == () and spec.evicted == ()
    tier.complete_load([K("A")])
    assert tier.prepare_store([K("D")]).evicted == (K("A"),)  # unpinned again: evictable


def test_reserved_keys_are_invisible_skipped_and_released(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, num_blocks=2)
    spec = tier.prepare_store([K("A"), K("A"), K("B")])  # a repeated key is reserved once
    assert spec.keys == (K("A"), K("B")) and tier.num_used_blocks == 2
    assert not tier.contains(K("A"))  # a store in flight is not a hit
    assert tier.prepare_store([K("A"), K("C")]).keys == ()  # A reserved; C: full of reservations
    tier.complete_store([K("A")], ok=False)  # the write failed
    tier.complete_store([K("B")], ok=True)
    assert tier.keys() == [K("B")] and tier.num_used_blocks == 1
    assert tier.prepare_store([K("B")]).keys == ()  # held: nothing to store
    with pytest.raises(KeyError):
        tier.prepare_load([K("A")])  # only held keys can be loaded


# -------------------------------------------------------------------------------------- concurrency, worker
def test_concurrent_store_and_load_never_tear_a_block(tmp_path: Path) -> None:
    identity = ident("float32", (4, 16, 2, 2, 32))
    patterns = [block(identity, seed=1), torch.full(identity.block_shape, -2.5)]
    path = str(tmp_path / "a.kvb")
    write_block_file(path, K("A"), identity, byte_view(patterns[0]))
    stop = threading.Event()
    errors: list[BaseException] = []

    def rewrite() -> None:
        try:
            for i in range(200):
                write_block_file(path, K("A"), identity, byte_view(patterns[i % 2]))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            stop.set()

    writer = threading.Thread(target=rewrite)
    writer.start()
    num_reads = 0
    out = torch.empty(identity.block_shape)
    while not stop.is_set() or num_reads < 50:
        read_block_file(path, K("A"), identity, byte_view(out))  # never fails: the rename is atomic
        assert any(same_bytes(out, p) for p in patterns), "a torn block"
        num_reads += 1
    writer.join()
    assert not errors and num_reads >= 50
    assert [name for name in os.listdir(tmp_path) if ".tmp." in name] == []


def test_worker_runs_jobs_in_order_and_drains(tmp_path: Path, worker: BlockIOWorker) -> None:
    assert worker.poll() == [] and worker.wait(timeout=0.01) == [] and worker.pending == 0
    path = str(tmp_path / "sub" / "a.kvb")  # missing directories are created
    worker.submit_store(K("A"), path, byte_view(block(seed=1)))
    worker.submit_load(K("A"), path, byte_view(out := torch.empty(SHAPE)))  # runs after the store: sees it
    worker.submit_load(K("B"), str(tmp_path / "missing.kvb"), byte_view(torch.empty(SHAPE)))
    worker.submit_store(
        K("C"), str(tmp_path / "c.kvb"), byte_view(torch.zeros(3))
    )  # wrong shape: a failed job
    results = worker.drain(timeout=30)
    assert [(r.kind, r.key, r.ok, r.fatal) for r in results] == [
        ("store", K("A"), True, False),
        ("load", K("A"), True, False),
        ("load", K("B"), False, False),
        ("store", K("C"), False, False),
    ]
    assert "ENOENT" in (results[2].error or "") and "ValueError" in (results[3].error or "")
    assert same_bytes(out, block(seed=1)) and worker.pending == 0 and worker.poll() == []
    assert all(r.seconds >= 0 for r in results) and results[0].nbytes == IDENT.block_bytes


def test_worker_close_finishes_queued_jobs_and_rejects_new_ones(tmp_path: Path) -> None:
    worker = disk_worker(IDENT)
    for i in range(5):
        worker.submit_store(K(str(i)), str(tmp_path / f"{i}.kvb"), byte_view(block(seed=i)))
    results = worker.close(timeout=30)
    assert len(results) == 5 and all(r.ok for r in results) and worker.closed
    assert worker.close(timeout=1) == []  # idempotent
    with pytest.raises(RuntimeError):
        worker.submit_load(K("0"), str(tmp_path / "0.kvb"), byte_view(torch.empty(SHAPE)))


# ------------------------------------------------------------------------------------------ authenticity
def forge(path: str, identity: TierIdentity = IDENT) -> None:
    """What an attacker with write access does: edit the payload, then make every checksum agree."""
    raw = bytearray(Path(path).read_bytes())
    raw[HEADER_NBYTES:] = bytes(len(raw) - HEADER_NBYTES)  # zero the KV
    header = decode_header(raw[:HEADER_NBYTES])
    payload = memoryview(raw)[HEADER_NBYTES:]
    raw[:HEADER_NBYTES] = encode_header(
        K("A"), identity, header.payload_nbytes, zlib.crc32(payload), header.mac
    )
    Path(path).write_bytes(raw)


def test_secret_signs_blocks_and_refuses_forged_or_unsigned_ones(tmp_path: Path) -> None:
    """Checksums alone accept a forged block; with a secret, only blocks signed with it load."""
    secret, path, data = b"s3cret", str(tmp_path / "a.kvb"), block(seed=3)
    write_block_file(path, K("A"), IDENT, byte_view(data), secret)
    assert same_bytes(read_block(path, K("A")), data)  # no secret configured: the CRC still checks
    out = torch.empty(SHAPE)
    read_block_file(path, K("A"), IDENT, byte_view(out), secret)
    assert same_bytes(out, data)
    with pytest.raises(CorruptBlock, match="bad MAC"):
        read_block_file(path, K("A"), IDENT, byte_view(out), b"another secret")

    forge(path)
    assert not read_block(path, K("A")).any()  # the forgery passes every checksum...
    with pytest.raises(CorruptBlock, match="bad MAC"):  # ...but not the MAC
        read_block_file(path, K("A"), IDENT, byte_view(out), secret)

    write_block_file(path, K("A"), IDENT, byte_view(data))  # unsigned, e.g. from a run without the secret
    with pytest.raises(CorruptBlock, match="unsigned"):
        read_block_file(path, K("A"), IDENT, byte_view(out), secret)


def test_block_values_round_trip_and_refuse_what_does_not_match() -> None:
    """The one-value form (header + payload) a store keyed by name holds."""
    data, out = block(seed=4), torch.empty(SHAPE)
    value = encode_block_value(K("A"), IDENT, byte_view(data), b"k")
    assert len(value) == HEADER_NBYTES + IDENT.block_bytes
    decode_block_value(value, K("A"), IDENT, byte_view(out), b"k")
    assert same_bytes(out, data)
    for bad, match in [
        (value[:-1], "file of"),  # truncated
        (value[:HEADER_NBYTES] + bytes(IDENT.block_bytes), "checksum"),  # corrupt payload
    ]:
        with pytest.raises(CorruptBlock, match=match):
            decode_block_value(bad, K("A"), IDENT, byte_view(out), b"k")
    with pytest.raises(CorruptBlock, match="another block"):
        decode_block_value(value, K("B"), IDENT, byte_view(out), b"k")
    with pytest.raises(CorruptBlock, match="another model"):
        decode_block_value(value, K("A"), ident(fingerprint="cd" * 32), byte_view(out), b"k")
    with pytest.raises(CorruptBlock, match="bad MAC"):
        decode_block_value(value, K("A"), IDENT, byte_view(out), b"other")
