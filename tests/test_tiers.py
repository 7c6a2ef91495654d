"""The tiers under the device pool, driven through the KV manager on real tensors (no model).

Each story writes known bytes into device blocks as a forward pass would, lets the device pool evict
them (write-back stores to host, host evictions demoted to disk), then asks for the same prefix
again and checks that the blocks loaded back are byte-identical to what was stored.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.config import SchedulerConfig
from kvtier.kv.hashing import hash_full_blocks, root_hash
from kvtier.kv.manager import KVCacheManager
from kvtier.kv.plan import SwapPlan
from kvtier.sampling_params import SamplingParams
from kvtier.scheduler.preemption import CostModel
from kvtier.scheduler.scheduler import Scheduler
from kvtier.sequence import Sequence, SequenceStatus
from kvtier.tiers.base import TierIdentity
from kvtier.tiers.coordinator import ExternalLevel, TierCoordinator
from kvtier.tiers.disk import DiskBlockIO, DiskTier
from kvtier.tiers.host import HostTier
from kvtier.transfer.copy_plan import consecutive
from kvtier.transfer.io_worker import BlockIOWorker
from kvtier.transfer.mover import TierMover

BS = 4
KEYS = ("fp-tiers", "")
BLOCK_SHAPE = (2, BS, 2, 1, 8)  # [L, BS, 2, KVH, D]


class Rig:
    """A device pool tensor, a manager over it, and the real host/disk tiers and mover."""

    def __init__(
        self,
        tmp_path: Path | None,
        num_blocks: int = 4,
        host_blocks: int = 2,
        dtype: torch.dtype = torch.float32,
        policy: str = "write_back",
    ) -> None:
        self.device_kv = torch.zeros((num_blocks, *BLOCK_SHAPE), dtype=dtype)
        self.identity = TierIdentity(
            "fp-tiers", str(dtype).removeprefix("torch."), BLOCK_SHAPE, self.device_kv.element_size()
        )
        self.host = HostTier(host_blocks)
        self.disk = DiskTier(tmp_path, 1 << 20, self.identity) if tmp_path is not None else None
        external = []
        if self.disk is not None:
            external.append(ExternalLevel(self.disk, BlockIOWorker(DiskBlockIO(self.identity)), policy))
        self.tiers = TierCoordinator(self.host, external, policy)  # type: ignore[arg-type]
        self.mover = TierMover(self.device_kv, host_blocks, self.host.counters)
        self.tiers.host_bytes = self.mover
        self.kv = KVCacheManager(num_blocks, BS, True, tiers=self.tiers)
        self.gen = torch.Generator().manual_seed(0)
        self.last_plan = SwapPlan()

    def run_plan(self) -> None:
        """End the scheduling step and run its plan (the mover counts the copies in
        ``host.counters``, as in the engine); the plan is kept in ``last_plan``."""
        plan = self.last_plan = self.kv.end_schedule_step()
        self.mover.execute(plan)  # records the copies in host.counters, as in the engine
        self.tiers.complete_plan(plan)

    def prefill(self, seq_id: str, tokens: list[int]) -> dict[str, int]:
        """One scheduling step for a whole prompt: lookup, allocate, swap plan, 'forward' (random KV
        into the computed slots' blocks), cache. Returns the hit's tokens by tier."""
        computed = self.kv.get_computed_blocks(tokens, KEYS)
        n = computed.num_computed_tokens
        assert self.kv.allocate_slots(seq_id, tokens, n, len(tokens) - n, computed, KEYS)
        self.run_plan()
        for block_id in self.kv.block_ids(seq_id)[n // BS :]:
            self.device_kv[block_id] = self.random_block()
        self.kv.cache_blocks(seq_id, tokens, len(tokens), KEYS)
        return computed.tokens_by_tier(BS)

    def random_block(self) -> torch.Tensor:
        return torch.randn(BLOCK_SHAPE, generator=self.gen).to(self.device_kv.dtype)

    def blocks_of(self, seq_id: str, n: int) -> list[torch.Tensor]:
        return [self.device_kv[b].clone() for b in self.kv.block_ids(seq_id)[:n]]

    def wait_for_disk(self) -> None:
        for _ in range(100):
            if not self.tiers.has_pending_io:
                return
            self.tiers.wait(0.1)
        raise AssertionError("disk I/O did not finish")


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


A = list(range(100, 113))  # 13 tokens: 3 full blocks + 1 slot
B = list(range(200, 216))  # 16 tokens: 4 full blocks, needs the whole pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_story_evicted_to_host_and_disk_and_loaded_back_byte_identical(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """A's 3 cached blocks are evicted one step at a time by 1-block sequences into the 3-block host
    tier; then Y's block is evicted too, and the host tier demotes its oldest block (A's third) to
    disk. A's prompt again: 2 host hits and 1 disk hit, read back into host in the background (Y's
    block makes room), then all 3 loaded into the device, bytes unchanged."""
    rig = Rig(tmp_path, host_blocks=3, dtype=dtype)
    rig.prefill("A", A)
    original = rig.blocks_of("A", 3)
    rig.kv.free("A")  # free queue: A's partial block, then blocks 2, 1, 0 (its head is evicted last)

    def take_all_blocks(tag: str) -> None:
        for i in range(4):  # one block each, one step each
            rig.prefill(f"{tag}{i}", [300 + i] * 3)
            rig.run_plan()
        for i in range(4):
            rig.kv.free(f"{tag}{i}")

    take_all_blocks("X")  # evicts A's blocks 2, 1, 0 into the host tier
    assert len(rig.host.held_keys()) == 3 and rig.host.counters.blocks_evicted == 0
    rig.prefill("Y", list(range(400, 405)))  # 1 full block + 1 slot
    rig.kv.free("Y")
    take_all_blocks("Z")  # evicts Y's block: the host tier demotes A's block 2 to disk
    rig.wait_for_disk()
    assert rig.host.counters.blocks_evicted == 1
    assert rig.disk is not None and len(rig.disk.keys()) == 1

    first = rig.kv.get_computed_blocks(A, KEYS)
    assert len(first.lower.host_keys) == 2 and first.lower.num_pending_blocks == 1
    rig.wait_for_disk()  # the disk block is now promoted into the host tier
    assert rig.prefill("A2", A) == {"device": 0, "host": 8, "disk": 4, "remote": 0}
    rig.kv.check_integrity()
    for got, want in zip(rig.blocks_of("A2", 3), original, strict=True):
        assert same_bytes(got, want)
    assert rig.disk.counters.blocks_loaded == 1


def test_story_restart_finds_blocks_on_disk(tmp_path: Path) -> None:
    """After a flush, a new rig on the same directory serves A's prefix from disk, byte-identical."""
    rig = Rig(tmp_path, host_blocks=4)
    rig.prefill("A", A)
    original = rig.blocks_of("A", 3)
    rig.kv.free("A")
    rig.prefill("B", B)  # evicts A to host
    rig.run_plan()
    rig.tiers.flush()
    rig.tiers.close()
    assert rig.disk is not None and len(rig.disk.keys()) == 3

    again = Rig(tmp_path, host_blocks=4)
    assert again.disk is not None and len(again.disk.keys()) == 3
    assert again.kv.get_computed_blocks(A, KEYS).lower.num_pending_blocks == 3
    again.wait_for_disk()
    assert again.prefill("A", A) == {"device": 0, "host": 0, "disk": 12, "remote": 0}
    for got, want in zip(again.blocks_of("A", 3), original, strict=True):
        assert same_bytes(got, want)


def test_story_corrupt_disk_file_is_a_miss_and_removed(tmp_path: Path) -> None:
    rig = Rig(tmp_path, host_blocks=4)
    rig.prefill("A", A)
    rig.kv.free("A")
    rig.prefill("B", B)
    rig.run_plan()
    rig.tiers.flush()
    rig.tiers.close()
    files = sorted(tmp_path.rglob("*.kvb"))
    assert len(files) == 3
    for f in files:  # flip one payload byte in every file: headers still parse, checksums fail
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))

    again = Rig(tmp_path, host_blocks=4)
    assert again.kv.get_computed_blocks(A, KEYS).lower.num_pending_blocks == 3
    again.wait_for_disk()
    assert again.prefill("A", A) == {"device": 0, "host": 0, "disk": 0, "remote": 0}  # all misses: computed
    assert again.disk is not None and again.disk.keys() == [] and not list(tmp_path.rglob("*.kvb"))
    again.kv.check_integrity()


def test_story_write_through_stores_blocks_as_soon_as_they_fill() -> None:
    rig = Rig(None, host_blocks=8, policy="write_through")
    rig.prefill("A", A)
    rig.run_plan()
    assert len(rig.host.held_keys()) == 3 and rig.kv.pool.num_cached_blocks == 3
    hashes = hash_full_blocks(A, BS, root_hash(KEYS))
    assert set(rig.host.held_keys()) == set(hashes)


def test_story_write_back_skips_blocks_the_host_already_holds() -> None:
    """A is evicted to host, loaded back by A2, evicted again: the second eviction stores nothing.

    The step that evicts A2's blocks is B2's prefill step (B2 needs the whole pool), so its own plan
    is the one to read: ``prefill`` runs it and keeps it in ``last_plan``."""
    rig = Rig(None, host_blocks=8)
    a_keys = hash_full_blocks(A, BS, root_hash(KEYS))
    rig.prefill("A", A)
    rig.kv.free("A")
    rig.prefill("B", B)  # evicts A's 3 cached blocks: stored to host
    rig.kv.free("B")
    assert rig.host.counters.blocks_stored == 3 and set(rig.host.held_keys()) == set(a_keys)

    assert rig.prefill("A2", A)["host"] == 12  # loads A's blocks, evicts B's 4: stored to host
    assert rig.last_plan.store_keys != [] and rig.last_plan.load_keys == a_keys
    a2_block_ids = set(rig.kv.block_ids("A2"))
    rig.kv.free("A2")
    stored_before, held_before = rig.host.counters.blocks_stored, rig.host.held_keys()
    assert stored_before == 3 + 4 and len(held_before) == 7

    assert rig.prefill("B2", B)["host"] == 12  # takes the whole pool: evicts A2's blocks
    plan = rig.last_plan
    assert set(rig.kv.block_ids("B2")) == a2_block_ids  # this step reused (evicted) A2's blocks
    assert len(plan.loads) == 3  # B's host hits
    assert plan.stores == [] and plan.store_keys == []  # A's blocks are already in the host tier
    assert rig.host.counters.blocks_stored == stored_before
    assert sorted(rig.host.held_keys()) == sorted(held_before)
    rig.kv.check_integrity()


def test_an_eviction_batch_plans_the_stores_that_storing_block_by_block_plans() -> None:
    """A busy engine's load evicts hundreds of device blocks in one call: with no external tier the host
    tier reserves them in one pass. The plan (stores paired in the device blocks' order), the keys it
    evicted and the keys it holds are those of ``_store`` called block by block."""
    from dataclasses import dataclass

    from kvtier.tiers.base import BlockKey

    @dataclass
    class Evicted:
        block_id: int
        block_hash: BlockKey
        group: int = 0
        cold: bool = False

    def key(i: int) -> BlockKey:
        return BlockKey(i.to_bytes(32, "little"))

    def coordinator() -> tuple[TierCoordinator, list[BlockKey]]:
        evicted: list[BlockKey] = []
        host = HostTier(8)
        host.complete_store(host.prepare_store([key(i) for i in range(8)]).keys)  # full: keys 0-7
        host.pin([key(1), key(4)])
        coordinator = TierCoordinator(host)
        host.on_evict = lambda k, slot: evicted.append(k)
        return coordinator, evicted

    # device blocks 40, 39, ... (tail first): key 5 is held already, key 20 comes twice
    blocks = [Evicted(40 - j, key(i)) for j, i in enumerate([20, 21, 5, 22, 20, 23, 24, 25, 26, 27])]
    batched, batch_evicted = coordinator()
    batched.on_device_evict(blocks)
    one_by_one, evicted = coordinator()
    for block in blocks:
        one_by_one._store(block.block_id, block.block_hash, block.group, block.cold)
    one_by_one._pair_stores(0)
    assert batched._plan.stores == one_by_one._plan.stores and len(batched._plan.stores) == 6
    assert (
        batched._plan.store_keys == one_by_one._plan.store_keys == [key(i) for i in (20, 21, 22, 23, 24, 25)]
    )
    assert batch_evicted == evicted == [key(i) for i in (0, 2, 3, 5, 6, 7)]  # key 5 too, as block by block
    assert sorted(batched.host.held_keys() + list(batched.host._reserved)) == sorted(
        one_by_one.host.held_keys() + list(one_by_one.host._reserved)
    )
    batched.host.check_integrity()


def test_story_a_full_host_tier_keeps_its_room_for_blocks_no_tier_holds(tmp_path: Path) -> None:
    """With the host tier full, a device block the disk already holds is not stored into it (that would
    evict another block to make room for a copy that is safe anyway); one held nowhere else is. A step
    that loads a returning prompt pins most of a small host tier, and the blocks it evicts from the
    device were dropped for want of room while copies of disk blocks took it."""
    rig = Rig(tmp_path, host_blocks=3)
    a_keys = hash_full_blocks(A, BS, root_hash(KEYS))
    rig.prefill("A", A)
    rig.kv.free("A")
    rig.prefill("B", B)  # evicts A's 3 blocks into the host tier
    rig.run_plan()
    rig.tiers.flush()  # and down to disk
    assert rig.disk is not None and set(rig.disk.keys()) == set(a_keys)
    assert rig.tiers.store(0, b"\x01" * 32)  # held nowhere else: evicts A's oldest block (on disk)
    rig.run_plan()
    held = rig.host.held_keys()
    on_disk_only = next(k for k in a_keys if k not in held)
    assert rig.host.num_used_blocks == rig.host.capacity_blocks

    assert not rig.tiers.store(1, on_disk_only)  # safe below: the host tier keeps what it holds
    assert rig.host.held_keys() == held and rig.tiers.take_plan().stores == []
    assert rig.tiers.store(1, b"\x02" * 32)  # held nowhere else: takes the least recently used room
    assert len(rig.tiers.take_plan().stores) == 1


def test_story_blocks_evicted_while_the_host_tier_is_all_pinned_go_straight_to_disk(tmp_path: Path) -> None:
    """A step whose loads pin the whole host tier also evicts device blocks: with no host room they
    were dropped; now each is snapshotted from the device and written straight to disk, and comes
    back byte-identical."""
    rig = Rig(tmp_path, host_blocks=3)
    a_keys = hash_full_blocks(A, BS, root_hash(KEYS))
    rig.prefill("A", A)
    original = rig.blocks_of("A", 3)
    rig.kv.free("A")
    busy = [bytes([i]) * 32 for i in range(3)]
    rig.host.prepare_store(busy)  # every host block reserved (bytes on their way): no room
    rig.prefill("B", B)  # evicts A's 3 blocks
    assert rig.host.counters.blocks_stored == 0 and {d.key for d in rig.last_plan.demotes} == set(a_keys)
    rig.wait_for_disk()
    assert rig.disk is not None and set(rig.disk.keys()) == set(a_keys)
    rig.host.complete_store(busy, ok=False)
    rig.kv.free("B")

    assert rig.kv.get_computed_blocks(A, KEYS).lower.num_pending_blocks == 3
    rig.wait_for_disk()
    assert rig.prefill("A2", A)["disk"] == 12
    for got, want in zip(rig.blocks_of("A2", 3), original, strict=True):
        assert same_bytes(got, want)
    rig.kv.check_integrity()


def test_story_a_cold_block_without_host_room_goes_to_free_disk_room_only(tmp_path: Path) -> None:
    """A sliding window's block released out of the window (cold) takes only free host room; with none
    it goes straight to a disk tier that has free room (it displaces nothing there), so an earlier turn
    of a conversation stays loadable after a restart. A cold block is never demoted into a full disk
    tier, nor without one."""
    rig = Rig(tmp_path, host_blocks=1)
    assert rig.tiers.store(0, b"\x01" * 32)  # warm: the host tier's only block
    rig.run_plan()
    cold = b"\x02" * 32
    rig.device_kv[1] = rig.random_block()
    assert rig.tiers.store(1, cold, cold=True)  # no free host room: demoted to disk
    plan = rig.tiers.take_plan()
    assert plan.stores == [] and [d.key for d in plan.demotes] == [cold]
    rig.mover.execute(plan)
    rig.tiers.complete_plan(plan)
    rig.wait_for_disk()
    assert rig.disk is not None and rig.disk.keys() == [cold] and rig.host.held_keys() == [b"\x01" * 32]

    no_disk = Rig(None, host_blocks=1)
    assert no_disk.tiers.store(0, b"\x01" * 32)
    no_disk.run_plan()
    assert not no_disk.tiers.store(1, cold, cold=True)  # nowhere to put it: dropped


def test_story_swap_out_and_in_restores_a_partial_block() -> None:
    """A running sequence with 13 computed tokens (3 full blocks + 1 slot) is swapped out: all 4
    blocks go to host, pinned; the device blocks are reused; swap-in brings back the same bytes, into
    fresh blocks paired in the host blocks' order (one run each way: no gather, no scatter on CUDA)."""
    rig = Rig(None, host_blocks=4)
    rig.prefill("A", A)
    original = rig.blocks_of("A", 4)
    assert rig.kv.swap_out("A", len(A))
    rig.run_plan()
    assert rig.kv.is_swapped("A") and "A" in rig.kv
    devices, hosts = zip(*sorted(rig.last_plan.stores), strict=True)
    assert len(devices) == 4 and consecutive(devices) and consecutive(hosts)
    rig.device_kv.zero_()
    assert rig.kv.swap_in("A", A + [7], len(A), 1)
    rig.run_plan()
    hosts, devices = zip(*sorted(rig.last_plan.loads), strict=True)
    assert len(devices) == 4 and consecutive(devices) and consecutive(hosts)
    assert rig.blocks_of("A", 4)[0].abs().sum() > 0
    for got, want in zip(rig.blocks_of("A", 4), original, strict=True):
        assert same_bytes(got, want)
    rig.kv.check_integrity()
    assert len(rig.host.held_keys()) == 3  # the private (partial) block is dropped after loading


def test_story_a_hits_loads_run_the_moment_it_is_adopted() -> None:
    """Wired as the engine wires it (``run_now``), a prefix hit's loads run inside the allocation that
    adopts it, before the step's scheduling ends: A's blocks are back on the device while the step
    still plans; the step's budget still counts them; the end of the step has only the rest. A
    swap-in's loads run at once too."""
    rig = Rig(None, host_blocks=4)
    ran: list[SwapPlan] = []

    def run_now(plan: SwapPlan) -> None:
        ran.append(plan)
        rig.mover.execute(plan)
        rig.tiers.complete_plan(plan)

    rig.tiers.run_now = run_now
    rig.prefill("A", A)
    original = rig.blocks_of("A", 3)
    rig.kv.free("A")
    for i in range(4):  # one-block sequences take the whole pool: A's 3 full blocks go to the host tier
        rig.prefill(f"X{i}", [300 + i] * 3)
    for i in range(4):
        rig.kv.free(f"X{i}")
    assert not ran  # no hit yet: every store waited for its step's end
    computed = rig.kv.get_computed_blocks(A, KEYS)
    assert len(computed.lower.host_keys) == 3
    assert rig.kv.allocate_slots("A2", A, 12, 1, computed, KEYS)
    assert [len(plan.loads) for plan in ran] == [3]
    for got, want in zip(rig.blocks_of("A2", 3), original, strict=True):
        assert same_bytes(got, want)  # on the device already, mid-step
    assert rig.kv.num_planned_loads == 3  # what the step's budget charges
    assert not rig.kv.end_schedule_step().loads and rig.kv.num_planned_loads == 0

    assert rig.kv.swap_out("A2", len(A))
    rig.run_plan()
    rig.device_kv.zero_()
    assert rig.kv.swap_in("A2", A + [7], len(A), 1)
    assert [len(plan.loads) for plan in ran] == [3, 4]
    for got, want in zip(rig.blocks_of("A2", 3), original, strict=True):
        assert same_bytes(got, want)
    rig.run_plan()
    rig.kv.check_integrity()


def test_story_blocks_go_down_and_come_back_in_runs_of_consecutive_blocks() -> None:
    """B's 4 blocks go to the host tier as another prompt takes the pool, which evicts them tail first:
    the stores pair the host blocks with the device blocks in the same order (one run, no gather on
    CUDA). B again: its loads pair them in the same order too, so the plan is one run of consecutive
    blocks on both sides (one copy, no scatter), and the bytes come back unchanged."""
    rig = Rig(None, num_blocks=8, host_blocks=8)
    rig.prefill("B", B)
    original = rig.blocks_of("B", 4)
    rig.kv.free("B")
    rig.prefill("X", list(range(500, 532)))  # 8 blocks: B's 4 stored down, the pool all X's
    rig.kv.free("X")
    devices, hosts = zip(*sorted(rig.last_plan.stores), strict=True)  # evicted tail first, paired in order
    assert len(devices) == 4 and consecutive(devices) and consecutive(hosts)
    computed = rig.kv.get_computed_blocks(B, KEYS)
    assert len(computed.lower.host_keys) == 3  # the last block is computed again, for the logits
    assert rig.kv.allocate_slots("B2", B, 12, 4, computed, KEYS)
    plan = rig.kv.end_schedule_step()
    hosts, devices = zip(*sorted(plan.loads), strict=True)
    assert list(devices) == sorted(devices) and consecutive(devices) and consecutive(hosts)
    rig.mover.execute(plan)
    rig.tiers.complete_plan(plan)
    for got, want in zip(rig.blocks_of("B2", 3), original[:3], strict=True):
        assert same_bytes(got, want)
    rig.kv.check_integrity()


def test_swap_out_without_room_changes_nothing() -> None:
    rig = Rig(None, host_blocks=2)
    rig.prefill("A", A)
    assert not rig.kv.swap_out("A", len(A))  # 4 blocks, 2 slots
    assert rig.kv.end_schedule_step().is_empty and rig.host.num_used_blocks == 0
    rig.kv.check_integrity()


def test_abort_of_a_swapped_out_sequence_releases_its_host_blocks() -> None:
    rig = Rig(None, host_blocks=4)
    rig.prefill("A", A)
    assert rig.kv.swap_out("A", len(A))
    rig.run_plan()
    rig.kv.free("A")
    assert "A" not in rig.kv and len(rig.host.held_keys()) == 3  # hashed blocks stay cached, unpinned
    rig.kv.check_integrity()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_mover_copies_on_its_stream_from_pinned_memory() -> None:
    device_kv = torch.randn((8, *BLOCK_SHAPE), device="cuda")
    mover = TierMover(device_kv, 4)
    assert mover.host.pinned_bytes == mover.host.nbytes
    original = device_kv[[1, 3, 5]].clone()
    mover.execute(SwapPlan(stores=[(1, 0), (3, 1), (5, 2)]))
    device_kv.zero_()  # on the compute stream: ordered after the stores by the plan's event
    mover.execute(SwapPlan(loads=[(0, 6), (1, 2), (2, 7)]))
    torch.cuda.synchronize()
    assert torch.equal(device_kv[6], original[0])
    assert torch.equal(device_kv[2], original[1])
    assert torch.equal(device_kv[7], original[2])


def test_the_schedulers_cheap_estimate_counts_host_hits_and_starts_no_read(tmp_path: Path) -> None:
    """A prompt whose blocks were evicted to the host tier (and one to disk) is mostly cached: the
    scheduler's estimate (``num_prefix_blocks``) counts the device and host hits, a
    pure lookup that reads nothing from disk; the device-only count (admission's KV estimate) is 0."""
    rig = Rig(tmp_path, host_blocks=2)
    rig.prefill("A", A)
    rig.kv.free("A")
    for i in range(4):  # one block each: A's blocks 2, 1, 0 go down; the host keeps 2, disk takes 1
        rig.prefill(f"X{i}", [300 + i] * 3)
        rig.run_plan()
    rig.wait_for_disk()
    lookups = (rig.host.counters.lookups, rig.disk.counters.lookups)
    assert rig.kv.num_device_prefix_blocks(A, KEYS) == 0
    assert rig.kv.num_prefix_blocks(A, KEYS)[1] == 2  # blocks 0 and 1; block 2 is on disk
    assert rig.disk is not None and len(rig.disk.keys()) == 1
    assert not rig.tiers.has_pending_io  # nothing was read from disk for an estimate
    assert (rig.host.counters.lookups, rig.disk.counters.lookups) == lookups  # and counted nothing


def test_a_prompt_held_back_for_a_read_counts_the_blocks_on_their_way_as_cached(tmp_path: Path) -> None:
    """A's blocks went down to the host tier (two) and to disk (one), as in the first story. A returns:
    the scheduler's cheap estimate at arrival counts the two host blocks; its first step starts the disk
    read and holds it back, and from then on the estimate counts the block on its way too (so once read,
    its one uncached token may take a short step, as a decode replica's handoff read from Redis does)."""
    rig = Rig(tmp_path, host_blocks=3)
    rig.prefill("A", A)
    rig.kv.free("A")
    for tag, prompt in (("X", None), ("Y", list(range(400, 405))), ("Z", None)):
        if prompt is not None:
            rig.prefill(tag, prompt)
            rig.kv.free(tag)
            continue
        for i in range(4):  # one block each, one step each: the pool's blocks go down
            rig.prefill(f"{tag}{i}", [300 + i] * 3)
            rig.run_plan()
        for i in range(4):
            rig.kv.free(f"{tag}{i}")
    rig.wait_for_disk()
    assert rig.disk is not None and len(rig.disk.keys()) == 1
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), rig.kv, [0], CostModel(block_bytes=1))
    seq = Sequence("A2-0", "A2", 0, list(A), len(A), SamplingParams(max_tokens=1), KEYS, 64)
    scheduler.add(seq)
    assert seq.cached_prefix_blocks == 2
    out = scheduler.schedule()
    assert not out.scheduled and seq.status is SequenceStatus.WAITING  # held back for the read
    assert seq.cached_prefix_blocks == 3 and scheduler.uncached_tokens(seq) == 1
    rig.wait_for_disk()
