"""``TierMover``: the only code that copies KV bytes between the device pool and host memory.

::

    device pool  [num_blocks, L, BS, 2, KVH, D]      (the runner's kv_cache)
        ▲   │ execute(plan): stores first, then loads; runs of consecutive ids become one slice copy
        │   ▼
    host buffer  chunks of [blocks_per_chunk, L, BS, 2, KVH, D]   (pinned on CUDA, allocated once)
        ▲   │ host_snapshot(h): a copy of host block h, which a tier's BlockIOWorker writes down
        │   ▼ host_view(h): host block h's bytes, which a BlockIOWorker reads a block into
    external tiers (disk: kvtier/tiers/disk.py; the worker: kvtier/transfer/io_worker.py)

On CUDA the plan's copies run on a dedicated stream (non-blocking, from pinned memory) and the
compute stream waits on one event recorded after them, so the forward starts as soon as the step's
loads are in place. On CPU they are ordinary memcpys, timed for the statistics and the cost model.
The mover records the copies it ran in the host tier's counters (it did the work).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvtier.kv.plan import SwapPlan
from kvtier.stats import TierCounters

CHUNK_BYTES = 256 * 2**20  # host buffer allocation unit: pinning one huge buffer can fail or stall


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor, sharing its memory (works for bfloat16, which
    numpy lacks): what the torch-free block I/O reads into and writes from."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


class HostBuffer:
    """``num_blocks`` blocks of host memory in chunks; host block ``h`` is ``block(h)``."""

    def __init__(self, num_blocks: int, block_shape: Sequence[int], dtype: torch.dtype, pin: bool) -> None:
        self.block_bytes = block_bytes = math.prod(block_shape) * torch.empty((), dtype=dtype).element_size()
        self.blocks_per_chunk = max(1, CHUNK_BYTES // block_bytes)
        self.num_blocks = num_blocks
        self.chunks: list[torch.Tensor] = []
        remaining = num_blocks
        while remaining > 0:
            n = min(remaining, self.blocks_per_chunk)
            self.chunks.append(torch.zeros((n, *block_shape), dtype=dtype, pin_memory=pin))
            remaining -= n
        self.pinned_bytes = sum(c.numel() * c.element_size() for c in self.chunks if c.is_pinned())
        self.nbytes = num_blocks * block_bytes

    def block(self, host_block_id: int) -> torch.Tensor:
        return self.chunks[host_block_id // self.blocks_per_chunk][host_block_id % self.blocks_per_chunk]

    def runs(self, host_block_id: int, n: int) -> torch.Tensor:
        """Host blocks ``[host_block_id, host_block_id + n)``, which must lie in one chunk."""
        c, i = divmod(host_block_id, self.blocks_per_chunk)
        return self.chunks[c][i : i + n]


class Moved(NamedTuple):
    """Bytes a plan copied and the seconds it took (stores and loads together)."""

    nbytes: int
    seconds: float


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
        self, device_kv: torch.Tensor, num_host_blocks: int, counters: TierCounters | None = None
    ) -> None:
        self.device_kv = device_kv  # [num_blocks, *block_shape]
        self.cuda = device_kv.device.type == "cuda"
        self.host = HostBuffer(num_host_blocks, device_kv.shape[1:], device_kv.dtype, pin=self.cuda)
        self.block_bytes = self.host.block_bytes
        self.counters = counters if counters is not None else TierCounters()  # the host tier's
        self._stream = torch.cuda.Stream() if self.cuda else None

    # ------------------------------------------------------------------------ device ↔ host
    @torch.inference_mode()
    def execute(self, plan: SwapPlan) -> Moved:
        """Run the plan's stores, then its loads, and record them in the host tier's counters. On
        CUDA the compute stream waits for them."""
        for demote in plan.demotes:  # before any copy: a load may overwrite the block this step
            demote.data = self.device_snapshot(demote.device_block_id)
        if not plan.stores and not plan.loads:
            return Moved(0, 0.0)
        if self._stream is not None:
            store_s, load_s = self._execute_cuda(plan)
        else:
            t0 = time.perf_counter()
            self._copy_stores(plan.stores, non_blocking=False)
            t1 = time.perf_counter()
            self._copy_loads(plan.loads, non_blocking=False)
            store_s, load_s = t1 - t0, time.perf_counter() - t1
        bb = self.block_bytes
        self.counters.record_stores(len(plan.stores), len(plan.stores) * bb, store_s)
        self.counters.record_loads(len(plan.loads), len(plan.loads) * bb, load_s)
        return Moved(len(plan) * bb, store_s + load_s)

    def _execute_cuda(self, plan: SwapPlan) -> tuple[float, float]:
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
        return time.perf_counter() - t0, 0.0  # enqueue time; the copies overlap with host-side work

    def _copy_stores(self, stores: Sequence[tuple[int, int]], non_blocking: bool) -> None:
        big = len(self.device_kv) + 1
        for block_id, host_block_id, n in coalesce(stores, big, self.host.blocks_per_chunk):
            dst = self.host.runs(host_block_id, n)
            dst.copy_(self.device_kv[block_id : block_id + n], non_blocking=non_blocking)

    def _copy_loads(self, loads: Sequence[tuple[int, int]], non_blocking: bool) -> None:
        big = len(self.device_kv) + 1
        for host_block_id, block_id, n in coalesce(loads, self.host.blocks_per_chunk, big):
            src = self.host.runs(host_block_id, n)
            self.device_kv[block_id : block_id + n].copy_(src, non_blocking=non_blocking)

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    # ------------------------------------------------------------------------ host bytes for external tiers
    def host_view(self, host_block_id: int) -> memoryview:
        """Host block ``host_block_id``'s bytes (a block is read into it from an external tier)."""
        return byte_view(self.host.block(host_block_id))

    def device_snapshot(self, block_id: int) -> memoryview:
        """A host copy of a device block's bytes (a demote: the host tier had no room for it)."""
        if self._stream is not None:
            torch.cuda.current_stream().synchronize()  # written by earlier forwards
        return byte_view(self.device_kv[block_id].to("cpu", copy=True))

    def host_snapshot(self, host_block_id: int) -> memoryview:
        """A copy of the host block's bytes, to be written to an external tier in the background."""
        self.synchronize()  # the block may have been filled by a copy still in flight
        return byte_view(self.host.block(host_block_id).clone())
