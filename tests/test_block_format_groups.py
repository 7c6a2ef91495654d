"""Block headers carry the KV group (format version 2): a block of one group read for another is a miss.

A hybrid model's group ``g`` keeps its blocks under ``group_key(h, g)``; the header records ``g`` and a
reader loading the key for group ``h != g`` refuses it like a damaged block: in the disk tier, through the
real coordinator, it is removed, counted in ``load_failures``, announced removed, and the prefix is a
miss; in the shared remote store it is a ``foreign`` miss and deleted. A version-1 header (written
before the groups) still reads, as group 0.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import zlib
from pathlib import Path

import pytest
import redis
import torch

from kvtier.kv_events import KVEvent, KVEventRecorder
from kvtier.stats import Medium
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
from kvtier.tiers.coordinator import ExternalLevel, TierCoordinator
from kvtier.tiers.disk import DiskBlockIO, DiskTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.remote import RedisBlockIO, RemoteTier
from kvtier.tiers.remote_store import RemoteStore, redis_key
from kvtier.transfer.io_worker import BlockIOWorker
from kvtier.transfer.mover import TierMover, byte_view
from tests.redis_server import RedisServer

SHAPE = (2, 4, 2, 1, 8)  # [slots, block_size, 2, kv heads, head dim]
IDENT = TierIdentity("ab" * 32, "float32", SHAPE, 4)


def K(name: str) -> BlockKey:
    return BlockKey(hashlib.sha256(name.encode()).digest())


def block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def as_version_1(header: bytes, payload: torch.Tensor, secret: bytes | None) -> bytes:
    """``header`` as kvtier wrote it before the groups: version 1, no group field (zero padding), its
    MAC over bytes [0, 504) + payload only."""
    raw = bytearray(header)
    raw[8:10] = struct.pack("<H", 1)
    raw[536:540] = bytes(4)
    if secret is not None:
        mac = hmac.new(secret, bytes(raw[:504]), hashlib.sha256)
        mac.update(byte_view(payload))
        raw[504:536] = mac.digest()
    raw[-4:] = struct.pack("<I", zlib.crc32(raw[:-4]))
    return bytes(raw)


# ------------------------------------------------------------------------------------------ the header
@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_a_block_is_read_for_its_own_group_only(tmp_path: Path, secret: bytes | None) -> None:
    data, out = block(1), torch.empty(SHAPE)
    path = str(tmp_path / "a.kvb")
    write_block_file(path, K("A"), IDENT, byte_view(data), secret, group=2)
    assert decode_header(Path(path).read_bytes()[:HEADER_NBYTES]).group == 2
    read_block_file(path, K("A"), IDENT, byte_view(out), secret, group=2)
    assert torch.equal(out, data)
    for other in (0, 1, 3):
        with pytest.raises(CorruptBlock, match=f"a block of KV group 2, loaded for group {other}"):
            read_block_file(path, K("A"), IDENT, byte_view(out), secret, group=other)
    value = encode_block_value(K("A"), IDENT, byte_view(data), secret, 5)
    decode_block_value(value, K("A"), IDENT, byte_view(out), secret, 5)
    with pytest.raises(CorruptBlock, match="KV group 5"):
        decode_block_value(value, K("A"), IDENT, byte_view(out), secret, 0)


def test_the_group_is_signed_by_the_mac(tmp_path: Path) -> None:
    """An attacker without the secret who edits the group (and fixes the header checksum) is refused."""
    secret, data = b"k", block(2)
    value = bytearray(encode_block_value(K("A"), IDENT, byte_view(data), secret, 1))
    value[536:540] = struct.pack("<I", 2)
    value[HEADER_NBYTES - 4 : HEADER_NBYTES] = struct.pack("<I", zlib.crc32(value[: HEADER_NBYTES - 4]))
    out = torch.empty(SHAPE)
    decode_block_value(value, K("A"), IDENT, byte_view(out), None, 2)  # checksums alone accept it...
    with pytest.raises(CorruptBlock, match="bad MAC"):  # ...the MAC does not
        decode_block_value(value, K("A"), IDENT, byte_view(out), secret, 2)


@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_a_version_1_block_reads_as_group_0(tmp_path: Path, secret: bytes | None) -> None:
    data, out = block(3), torch.empty(SHAPE)
    v2 = encode_block_value(K("A"), IDENT, byte_view(data), secret)
    old = as_version_1(v2[:HEADER_NBYTES], data, secret) + v2[HEADER_NBYTES:]
    header = decode_header(old[:HEADER_NBYTES])
    assert struct.unpack_from("<H", old, 8)[0] == 1 and header.group == 0
    decode_block_value(old, K("A"), IDENT, byte_view(out), secret, 0)
    assert torch.equal(out, data)
    with pytest.raises(CorruptBlock, match="KV group 0, loaded for group 1"):
        decode_block_value(old, K("A"), IDENT, byte_view(out), secret, 1)
    future = bytearray(v2[:HEADER_NBYTES])
    future[8:10] = struct.pack("<H", 3)
    future[-4:] = struct.pack("<I", zlib.crc32(future[:-4]))
    with pytest.raises(CorruptBlock, match="format version 3"):
        decode_header(bytes(future))
    assert encode_header(K("A"), IDENT, IDENT.block_bytes, 0, group=7)[536:540] == struct.pack("<I", 7)


# ------------------------------------------------------------------------------------------ the disk tier
class Rig:
    """Real host and disk tiers under a coordinator, with the mover's host buffer and the disk worker;
    a recorder hears what they announce."""

    def __init__(self, directory: Path) -> None:
        self.host = HostTier(4)
        self.disk = DiskTier(directory, 1 << 20, IDENT)
        self.worker = BlockIOWorker(self.disk.block_io(), name="test-disk-io")
        self.tiers = TierCoordinator(self.host, [ExternalLevel(self.disk, self.worker)])
        self.mover = TierMover(torch.zeros((2, *SHAPE)), 4, self.host.counters)
        self.tiers.host_bytes = self.mover
        self.events = KVEventRecorder("rig")
        self.tiers.attach_listener(self.events)

    def lookup(self, keys: list[BlockKey], group: int) -> int:
        """Ask for ``keys`` of ``group``, wait for the reads it starts, ask again: the host hits."""
        self.tiers.lookup(keys, group)
        for _ in range(200):
            if not self.tiers.has_pending_io:
                break
            self.tiers.wait(0.05)
        return len(self.tiers.lookup(keys, group).host_keys)

    def close(self) -> None:
        self.tiers.close(timeout=10)


def test_story_a_block_stored_for_one_group_and_loaded_for_another_is_a_miss(tmp_path: Path) -> None:
    """Two files on disk from an earlier run: A of group 1, B of group 2. A restarted tier indexes both
    with their groups; asking for A as group 2 reads it, finds group 1 in its header, and drops it (a
    counted miss, the file removed, a ``removed`` event of group 1); B asked as group 2 loads, exactly."""
    writer = DiskBlockIO(IDENT)
    disk_dir = tmp_path / "kv"
    rig0 = DiskTier(disk_dir, 1 << 20, IDENT)  # lays out the directory
    writer.write(K("A"), rig0.path_of(K("A")), byte_view(block(10)), group=1)
    writer.write(K("B"), rig0.path_of(K("B")), byte_view(block(11)), group=2)
    rig = Rig(disk_dir)
    try:
        assert (rig.disk.group_of(K("A")), rig.disk.group_of(K("B"))) == (1, 2)
        attached = rig.events.end_step()
        assert attached is not None and set(attached.events[1:]) == {
            KVEvent("stored", Medium.DISK, (K("A"),), 1),
            KVEvent("stored", Medium.DISK, (K("B"),), 2),
        }

        # Act 1: A loaded for group 2 (the group its header does not name): a miss, never used.
        assert rig.lookup([K("A")], group=2) == 0
        assert not rig.host.contains(K("A")) and not rig.disk.contains(K("A"), 2)
        assert rig.disk.counters.load_failures == 1 and rig.disk.counters.blocks_loaded == 0
        assert not os.path.exists(rig.disk.path_of(K("A")))
        removed = rig.events.end_step()
        assert removed is not None and KVEvent("removed", Medium.DISK, (K("A"),), 1) in removed.events
        assert rig.disk.group_of(K("A")) == 0  # forgotten with the key

        # Act 2: B loaded for its own group: a host hit holding B's bytes, still group 2's.
        assert rig.lookup([K("B")], group=2) == 1
        host_block = rig.host.host_block_of(K("B"))
        assert host_block is not None and rig.host.group_of(K("B")) == 2
        assert torch.equal(rig.mover.host.block(host_block), block(11))
        assert rig.disk.counters.load_failures == 1 and rig.disk.counters.blocks_loaded == 1
        rig.host.check_integrity()
    finally:
        rig.close()


def test_story_a_demoted_block_keeps_its_group_on_disk(tmp_path: Path) -> None:
    """The host tier keeps each key's group from its store; evicted to disk, the file's header says it,
    and a restarted tier reads it back for that group only."""
    rig = Rig(tmp_path / "kv")
    try:
        for name, group in [("A", 0), ("B", 1), ("C", 2), ("D", 1)]:  # device -> host stores
            assert rig.tiers.store(0, K(name), group)
        plan = rig.tiers.take_plan()
        rig.mover.execute(plan)
        rig.tiers.complete_plan(plan)
        assert [rig.host.group_of(K(n)) for n in "ABCD"] == [0, 1, 2, 1]
        rig.tiers.flush(timeout=30)  # every host block written down
        headers = {
            n: decode_header(Path(rig.disk.path_of(K(n))).read_bytes()[:HEADER_NBYTES]).group for n in "ABCD"
        }
        assert headers == {"A": 0, "B": 1, "C": 2, "D": 1}
    finally:
        rig.close()
    again = Rig(tmp_path / "kv")
    try:
        assert [again.disk.group_of(K(n)) for n in "ABCD"] == [0, 1, 2, 1]
        assert again.lookup([K("C")], group=2) == 1 and again.lookup([K("D")], group=2) == 0
        assert again.disk.counters.load_failures == 1
    finally:
        again.close()


# ------------------------------------------------------------------------------------------ the remote tier
def test_story_a_shared_store_serves_a_block_for_its_own_group_only(redis_server: RedisServer) -> None:
    """Replica 1 writes A as group 1 and B as group 2 (batched, through its worker); replica 2 finds both
    by lookup. Read for the wrong group, A is a miss counted ``foreign`` and deleted from the store; B
    read for its group loads exactly."""
    stores = [RemoteStore(redis_server.url) for _ in range(2)]
    workers = [BlockIOWorker(RedisBlockIO(store, IDENT), name="test-remote-io") for store in stores]
    try:
        writer = RemoteTier(stores[0], IDENT)
        spec = writer.prepare_store([K("A"), K("B")], [1, 2])
        for key, address, group, seed in zip(spec.keys, spec.addresses, (1, 2), (20, 21), strict=True):
            workers[0].submit_store(key, address, byte_view(block(seed)), group)
        assert all(r.ok for r in workers[0].drain(timeout=30))
        writer.complete_store(spec.keys)

        reader = RemoteTier(stores[1], IDENT)
        assert reader.lookup([K("A"), K("B")], group=2) == 2  # EXISTS only: the headers are read on load
        outs = [torch.empty(SHAPE), torch.empty(SHAPE)]
        load = reader.prepare_load([K("A"), K("B")])
        for key, address, out in zip(load.keys, load.addresses, outs, strict=True):
            workers[1].submit_load(key, address, byte_view(out), 2)
        a, b = sorted(workers[1].drain(timeout=30), key=lambda r: r.key != K("A"))
        assert not a.ok and "KV group 1, loaded for group 2" in (a.error or "")
        assert b.ok and torch.equal(outs[1], block(21))
        assert stores[1].error_counts()["foreign"] == 1
        client = redis.Redis.from_url(redis_server.url)
        assert client.exists(redis_key(K("A"))) == 0 and client.exists(redis_key(K("B"))) == 1
    finally:
        for worker in workers:
            worker.close(timeout=10)
        for store in stores:
            store.close()
