"""``TierMover``: the only code that copies KV bytes between the device pool, host memory and disk.

::

    device pool  [num_blocks, L, BS, 2, KVH, D]      (the runner's kv_cache)
        ▲   │ execute(plan): stores first, then loads; runs of consecutive ids become one slice copy
        │   ▼
    host buffer  chunks of [slots_per_chunk, L, BS, 2, KVH, D]   (pinned on CUDA, allocated once)
        ▲   │ start_disk_store: the slot is snapshotted at once, a background thread writes the file
        │   ▼ start_disk_load: a background thread reads, checks and copies into a reserved slot
    disk files   (kvtier/tiers/disk.py format, kvtier/transfer/disk_io.py worker)

On CUDA the plan's copies run on a dedicated stream (non-blocking, from pinned memory) and the
compute stream waits on one event recorded after them, so the forward starts as soon as the step's
loads are in place. On CPU they are ordinary memcpys, timed for the statistics and the cost model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.tiers.base import BlockKey
from kvtier.tiers.plan import SwapPlan
from kvtier.transfer.disk_io import DiskIOWorker, IOResult

CHUNK_BYTES = 256 * 2**20  # host buffer allocation unit: pinning one huge buffer can fail or stall


class HostBuffer:
    """``num_slots`` blocks of host memory in chunks; slot ``s`` is ``block(s)``."""

    def __init__(self, num_slots: int, block_shape: Sequence[int], dtype: torch.dtype, pin: bool) -> None:
        self.block_bytes = block_bytes = math.prod(block_shape) * torch.empty((), dtype=dtype).element_size()
        self.slots_per_chunk = max(1, CHUNK_BYTES // block_bytes)
        self.num_slots = num_slots
        self.chunks: list[torch.Tensor] = []
        remaining = num_slots
        while remaining > 0:
            n = min(remaining, self.slots_per_chunk)
            self.chunks.append(torch.zeros((n, *block_shape), dtype=dtype, pin_memory=pin))
            remaining -= n
        self.pinned_bytes = sum(c.numel() * c.element_size() for c in self.chunks if c.is_pinned())
        self.nbytes = num_slots * block_bytes

    def block(self, slot: int) -> torch.Tensor:
        return self.chunks[slot // self.slots_per_chunk][slot % self.slots_per_chunk]

    def runs(self, slot: int, n: int) -> torch.Tensor:
        """Slots ``[slot, slot + n)``, which must lie in one chunk."""
        c, i = divmod(slot, self.slots_per_chunk)
        return self.chunks[c][i : i + n]


@dataclass(frozen=True)
class PlanTiming:
    blocks_stored: int = 0
    bytes_stored: int = 0
    store_seconds: float = 0.0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0


def coalesce(
    pairs: Sequence[tuple[int, int]], src_run_limit: int, dst_run_limit: int
) -> list[tuple[int, int, int]]:
    """``(src, dst)`` block pairs → ``(src, dst, n)`` runs where both ids advance by one; a run never
    crosses a multiple of ``src_run_limit``/``dst_run_limit`` (a host chunk boundary)."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs:
            s0, d0, n = runs[-1]
            if src == s0 + n and dst == d0 + n and src % src_run_limit != 0 and dst % dst_run_limit != 0:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


class TierMover:
    def __init__(
        self,
        device_kv: torch.Tensor,
        num_host_slots: int,
        disk_worker: DiskIOWorker | None = None,
    ) -> None:
        self.device_kv = device_kv  # [num_blocks, *block_shape]
        self.cuda = device_kv.device.type == "cuda"
        self.host = HostBuffer(num_host_slots, device_kv.shape[1:], device_kv.dtype, pin=self.cuda)
        self.block_bytes = self.host.block_bytes
        self.worker = disk_worker
        self._stream = torch.cuda.Stream() if self.cuda else None

    # ------------------------------------------------------------------------ device ↔ host
    @torch.inference_mode()
    def execute(self, plan: SwapPlan) -> PlanTiming:
        """Run the plan's stores, then its loads. On CUDA the compute stream waits for them."""
        if not plan.stores and not plan.loads:
            return PlanTiming()
        if self._stream is not None:
            return self._execute_cuda(plan)
        t0 = time.perf_counter()
        self._copy_stores(plan.stores, non_blocking=False)
        t1 = time.perf_counter()
        self._copy_loads(plan.loads, non_blocking=False)
        t2 = time.perf_counter()
        return self._timing(plan, t1 - t0, t2 - t1)

    def _execute_cuda(self, plan: SwapPlan) -> PlanTiming:
        assert self._stream is not None
        compute = torch.cuda.current_stream()
        self._stream.wait_stream(compute)  # the blocks to store were written by earlier forwards
        t0 = time.perf_counter()
        with torch.cuda.stream(self._stream):
            self._copy_stores(plan.stores, non_blocking=True)
            self._copy_loads(plan.loads, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        compute.wait_event(done)  # the forward reads the loaded blocks and overwrites stored ones
        t1 = time.perf_counter()  # enqueue time; the copies overlap with host-side work
        return self._timing(plan, t1 - t0, 0.0)

    def _timing(self, plan: SwapPlan, store_s: float, load_s: float) -> PlanTiming:
        return PlanTiming(
            len(plan.stores),
            len(plan.stores) * self.block_bytes,
            store_s,
            len(plan.loads),
            len(plan.loads) * self.block_bytes,
            load_s,
        )

    def _copy_stores(self, stores: Sequence[tuple[int, int]], non_blocking: bool) -> None:
        big = len(self.device_kv) + 1
        for block_id, slot, n in coalesce(stores, big, self.host.slots_per_chunk):
            self.host.runs(slot, n).copy_(self.device_kv[block_id : block_id + n], non_blocking=non_blocking)

    def _copy_loads(self, loads: Sequence[tuple[int, int]], non_blocking: bool) -> None:
        big = len(self.device_kv) + 1
        for slot, block_id, n in coalesce(loads, self.host.slots_per_chunk, big):
            self.device_kv[block_id : block_id + n].copy_(self.host.runs(slot, n), non_blocking=non_blocking)

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    # ------------------------------------------------------------------------ host ↔ disk
    def start_disk_load(self, key: BlockKey, path: str, host_slot: int) -> None:
        assert self.worker is not None
        self.worker.submit_load(key, path, self.host.block(host_slot))

    def start_disk_store(self, key: BlockKey, path: str, host_slot: int) -> None:
        assert self.worker is not None
        self.synchronize()  # the slot may have been filled by a copy still in flight
        self.worker.submit_store(key, path, self.host.block(host_slot).clone())

    def poll_io(self) -> list[IOResult]:
        return self.worker.poll() if self.worker is not None else []

    def wait_io(self, timeout: float) -> list[IOResult]:
        return self.worker.wait(timeout) if self.worker is not None else []

    def drain_io(self, timeout: float) -> list[IOResult]:
        return self.worker.drain(timeout) if self.worker is not None else []

    def close(self) -> None:
        if self.worker is not None and not self.worker.closed:
            self.worker.close(timeout=30.0)
