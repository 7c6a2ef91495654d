"""``TierMover``: the only code that copies KV bytes between the device pool and host memory.

::

    device pool  [num_blocks, L, BS, 2, KVH, D]      (the runner's kv_cache)
        ▲   │ execute(plan): stores, then loads; a run of consecutive host blocks is one copy
        │   │                (copy_plan.py: a gather or scatter on the device when its device
        │   │                blocks are not consecutive)
        │   ▼
    host buffer  chunks of [blocks_per_chunk, L, BS, 2, KVH, D]   (pinned on CUDA, allocated once)
        ▲   │ host_snapshot(h): a copy of host block h, which a tier's BlockIOWorker writes down
        │   ▼ host_view(h): host block h's bytes, which a BlockIOWorker reads a block into
    external tiers (disk: kvtier/tiers/disk.py; the worker: kvtier/transfer/io_worker.py)

On CUDA the plan's copies run on two dedicated streams (non-blocking, from pinned memory), stores on
one and loads on the other, so both directions of the link move at once (a load waits only for the
store of the block it overwrites); the runs' device block ids go up in one upload; the compute stream
waits for both streams, so the forward starts as soon as the step's copies are done. On CPU they are
ordinary memcpys (a slice copy, or ``index_select``/``index_copy_`` for scattered device blocks, straight
between pool and buffer), timed for the statistics and the cost model.
With a ``SlotGate`` (``--layered-loads``), a plan of loads alone goes layer slot by layer slot and the
compute stream does not wait for it: each layer waits for its own slot (``kvtier/models/slot_gate.py``).
The mover records the copies it ran in the host tier's counters (it did the work).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvtier.kv.plan import SwapPlan
from kvtier.models.slot_gate import SlotGate
from kvtier.stats import TierCounters
from kvtier.transfer import cuda_copy
from kvtier.transfer.copy_plan import Run, consecutive, load_runs, store_runs, two_way
from kvtier.worker.staging import StepStaging

CHUNK_BYTES = 256 * 2**20  # host buffer allocation unit: pinning one huge buffer can fail or stall
# The most one copy moves: small staging buffers, and a load follows the store it waits for by one run.
RUN_BYTES = 16 * 2**20


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


class TierMover:
    def __init__(
        self,
        device_kv: torch.Tensor,
        num_host_blocks: int,
        counters: TierCounters | None = None,
        gate: SlotGate | None = None,  # layered loads (None: every plan is waited for whole)
    ) -> None:
        self.device_kv = device_kv  # [num_blocks, S, ...]: S layer slots per block
        self.cuda = device_kv.device.type == "cuda"
        assert gate is None or gate.num_slots == device_kv.shape[1], "one gate event per layer slot"
        self.gate = gate
        self.host = HostBuffer(num_host_blocks, device_kv.shape[1:], device_kv.dtype, pin=self.cuda)
        self.block_bytes = self.host.block_bytes
        self.max_run = max(1, RUN_BYTES // self.block_bytes)  # blocks per copy
        self.counters = counters if counters is not None else TierCounters()  # the host tier's
        self._stream = torch.cuda.Stream() if self.cuda else None  # loads: host -> device
        self._store_stream = torch.cuda.Stream() if self.cuda else None  # stores: device -> host

    # ------------------------------------------------------------------------ device ↔ host
    @torch.inference_mode()
    def execute(self, plan: SwapPlan) -> Moved:
        """Run the plan's stores, then its loads, and record them in the host tier's counters. On
        CUDA the compute stream waits for them."""
        for demote in plan.demotes:  # before any copy: a load may overwrite the block this step
            demote.data = self.device_snapshot(demote.device_block_id)
        if not plan.stores and not plan.loads:
            return Moved(0, 0.0)
        if self.gate is not None and not plan.stores:
            store_s, load_s = 0.0, self._load_layered(plan, self.gate)
        elif self._stream is not None:
            store_s, load_s = self._execute_cuda(plan)
        else:
            t0 = time.perf_counter()
            for host, devices in store_runs(plan, self.host.blocks_per_chunk, self.max_run):
                out = self.host.runs(host, len(devices))
                if consecutive(devices):  # a slice: ~1.5x index_select's speed on a CPU
                    out.copy_(self.device_kv[devices[0] : devices[0] + len(devices)])
                else:
                    torch.index_select(self.device_kv, 0, torch.tensor(devices), out=out)
            t1 = time.perf_counter()
            for host, devices in load_runs(plan, self.host.blocks_per_chunk, self.max_run):
                src = self.host.runs(host, len(devices))
                if consecutive(devices):
                    self.device_kv[devices[0] : devices[0] + len(devices)].copy_(src)
                else:
                    self.device_kv.index_copy_(0, torch.tensor(devices), src)
            store_s, load_s = t1 - t0, time.perf_counter() - t1
        bb = self.block_bytes
        self.counters.record_stores(len(plan.stores), len(plan.stores) * bb, store_s)
        self.counters.record_loads(len(plan.loads), len(plan.loads) * bb, load_s)
        return Moved(len(plan) * bb, store_s + load_s)

    def _execute_cuda(self, plan: SwapPlan) -> tuple[float, float]:
        """Stores on one stream and loads on another, so the two directions of the link (each its own
        copy engine) run together, in the order ``two_way`` plans. The compute stream waits for both."""
        assert self._stream is not None and self._store_stream is not None
        compute = torch.cuda.current_stream()
        t0 = time.perf_counter()
        armed = self.gate.last_event() if self.gate is not None else None
        if armed is not None:  # a layered plan's copies (gated per layer) may have filled what is stored
            self._store_stream.wait_event(armed)
        store_chunks, loads = two_way(plan, self.host.blocks_per_chunk, self.max_run)
        stage = StepStaging()  # every run's device ids, one upload (on the compute stream)
        stored = [[(run, stage.add(run[1])) for run in chunk] for chunk in store_chunks]
        loaded = [(after, run, stage.add(run[1])) for after, run in loads]
        stage.upload(self.device_kv.device)
        self._store_stream.wait_stream(compute)  # the blocks to store were written by earlier forwards
        self._stream.wait_stream(compute)
        events = []
        with torch.cuda.stream(self._store_stream):
            for chunk in stored:
                for run, ids in chunk:
                    self._store_run(run, stage.get(ids))
                events.append(torch.cuda.Event())
                events[-1].record(self._store_stream)
        with torch.cuda.stream(self._stream):
            waited = None
            for after, run, ids in loaded:
                if after is not None and after != waited:
                    self._stream.wait_event(events[after])
                    waited = after
                self._load_run(run, stage.get(ids))
        compute.wait_stream(self._stream)  # the forward reads the loaded blocks
        compute.wait_stream(self._store_stream)  # ... and overwrites the stored ones
        return time.perf_counter() - t0, 0.0  # enqueue time; the copies overlap with host-side work

    def _store_run(self, run: Run, ids: torch.Tensor) -> None:
        """Device blocks -> consecutive host blocks: one slice copy, or a gather into staging first."""
        host, devices = run
        dst = self.host.runs(host, len(devices))
        if consecutive(devices):
            dst.copy_(self.device_kv[devices[0] : devices[0] + len(devices)], non_blocking=True)
        else:  # staging allocated on this stream: freed memory is reused only after the copy, in order
            dst.copy_(self.device_kv.index_select(0, ids), non_blocking=True)

    def _load_run(self, run: Run, ids: torch.Tensor) -> None:
        """Consecutive host blocks -> device blocks: one slice copy, or into staging, then a scatter."""
        host, devices = run
        src = self.host.runs(host, len(devices))
        if consecutive(devices):
            self.device_kv[devices[0] : devices[0] + len(devices)].copy_(src, non_blocking=True)
        else:
            staging = torch.empty(src.shape, dtype=src.dtype, device=self.device_kv.device)
            staging.copy_(src, non_blocking=True)
            self.device_kv.index_copy_(0, ids, staging)

    # ------------------------------------------------------------------------ layered loads
    def _load_layered(self, plan: SwapPlan, gate: SlotGate) -> float:
        """The plan's loads slot by slot, each slot's event recorded after its copies; the compute
        stream does not wait (each layer waits for its slot: ``SlotGate``). Runs span whole host chunks:
        no store is waited for. Returns the seconds spent (on CUDA: enqueueing)."""
        t0 = time.perf_counter()
        runs = load_runs(plan, self.host.blocks_per_chunk, self.host.blocks_per_chunk)
        stream = self._stream
        if stream is None:
            for slot in range(gate.num_slots):
                for host, devices in runs:
                    self._load_slot_cpu(host, devices, slot)
                gate.record(slot, None)
            gate.arm()
            return time.perf_counter() - t0
        stage = StepStaging()  # the scattered runs' device ids, one upload
        staged = [None if consecutive(devices) else stage.add(devices) for _, devices in runs]
        stage.upload(self.device_kv.device)
        stream.wait_stream(torch.cuda.current_stream())  # fresh blocks: earlier forwards may read them
        with torch.cuda.stream(stream):
            for slot in range(gate.num_slots):
                for (host, devices), ids in zip(runs, staged, strict=True):
                    self._load_slot_cuda(host, devices, None if ids is None else stage.get(ids), slot)
                gate.record(slot, stream)
        gate.arm()
        return time.perf_counter() - t0

    def _load_slot_cpu(self, host: int, devices: tuple[int, ...], slot: int) -> None:
        src = self.host.runs(host, len(devices))[:, slot]  # [n, ...] strided: one slot of each block
        if consecutive(devices):
            self.device_kv[devices[0] : devices[0] + len(devices), slot].copy_(src)
        else:
            self.device_kv[:, slot].index_copy_(0, torch.tensor(devices), src)

    def _load_slot_cuda(
        self, host: int, devices: tuple[int, ...], ids: torch.Tensor | None, slot: int
    ) -> None:
        """One slot of a run: a 2-D copy (rows of ``slot_bytes``, one per block) straight into the
        pool, or into staging and then a scatter when the run's device blocks are not consecutive."""
        n, block_bytes = len(devices), self.block_bytes
        slot_bytes = block_bytes // self.device_kv.shape[1]
        src = self.host.runs(host, n).data_ptr() + slot * slot_bytes
        stream = torch.cuda.current_stream().cuda_stream
        if ids is None:
            dst = self.device_kv[devices[0]].data_ptr() + slot * slot_bytes
            cuda_copy.copy_2d_h2d(dst, block_bytes, src, block_bytes, slot_bytes, n, stream)
            return
        staging = torch.empty((n, *self.device_kv.shape[2:]), dtype=self.device_kv.dtype, device=ids.device)
        cuda_copy.copy_2d_h2d(staging.data_ptr(), slot_bytes, src, block_bytes, slot_bytes, n, stream)
        self.device_kv[:, slot].index_copy_(0, ids, staging)

    def synchronize(self) -> None:
        if self._stream is not None and self._store_stream is not None:
            self._stream.synchronize()
            self._store_stream.synchronize()

    # ------------------------------------------------------------------------ host bytes for external tiers
    def host_view(self, host_block_id: int) -> memoryview:
        """Host block ``host_block_id``'s bytes (a block is read into it from an external tier)."""
        return byte_view(self.host.block(host_block_id))

    def device_snapshot(self, block_id: int) -> memoryview:
        """A host copy of a device block's bytes (a demote: the host tier had no room for it)."""
        if self.gate is not None:
            self.gate.settle()  # a layered plan may have loaded it
        if self._stream is not None:
            torch.cuda.current_stream().synchronize()  # written by earlier forwards
        return byte_view(self.device_kv[block_id].to("cpu", copy=True))

    def host_snapshot(self, host_block_id: int) -> memoryview:
        """A copy of the host block's bytes, to be written to an external tier in the background."""
        self.synchronize()  # the block may have been filled by a copy still in flight
        return byte_view(self.host.block(host_block_id).clone())
