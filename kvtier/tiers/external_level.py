"""An external tier as the coordinator drives it: the tier, its background worker and the keys in
flight, and the protocols of the worker and of the host tier's bytes (kept torch-free)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.config import StorePolicy
from kvtier.tiers.base import BlockKey, ExternalTier


class IOResultLike(Protocol):
    kind: str  # "load" | "store"
    key: BlockKey
    ok: bool
    error: str | None
    fatal: bool
    seconds: float


class IOWorker(Protocol):
    """The background worker of an external tier (``kvtier.transfer.io_worker.BlockIOWorker``)."""

    def submit_load(self, key: BlockKey, address: object, out: memoryview, group: int = 0) -> None: ...
    def submit_store(self, key: BlockKey, address: object, data: memoryview, group: int = 0) -> None: ...
    def poll(self) -> Sequence[IOResultLike]: ...
    def wait(self, timeout: float | None = None) -> Sequence[IOResultLike]: ...
    def drain(self, timeout: float | None = None) -> Sequence[IOResultLike]: ...
    def close(self, timeout: float | None = None) -> Sequence[IOResultLike]: ...
    @property
    def pending(self) -> int: ...


class HostBytes(Protocol):
    """The host tier's bytes (``kvtier.transfer.mover.TierMover``)."""

    def host_view(self, host_block_id: int) -> memoryview:
        """The host block's bytes, to read an external block into."""

    def host_snapshot(self, host_block_id: int) -> memoryview:
        """A copy of the host block's bytes (after any copy in flight into it), to write down."""


@dataclass
class ExternalLevel:
    """One external tier under the host tier, with its worker and its in-flight keys."""

    tier: ExternalTier
    worker: IOWorker
    policy: StorePolicy = "write_back"
    promoting: set[BlockKey] = field(default_factory=set)  # reads into the host tier in flight
    storing: set[BlockKey] = field(default_factory=set)  # writes from the host tier in flight
    generation: int | None = None  # the tier's outage generation its host blocks were last written at
    republish: list[BlockKey] = field(default_factory=list)  # host blocks to write again, newest last
    stalled: bool = False  # its worker finished nothing for IO_STALL_S at shutdown: never waited on again

    @property
    def active(self) -> bool:
        return not self.tier.disabled

    def in_flight(self, key: BlockKey) -> bool:
        return key in self.promoting or key in self.storing

    def settle(self, timeout: float, stall_s: float, apply: Callable[[IOResultLike], None]) -> None:
        """``apply`` the worker's results until it has nothing pending or ``timeout`` passes. A worker
        that finishes nothing for ``stall_s`` is stalled: the tier is turned off (one log line) and it
        is not waited on again."""
        deadline = time.monotonic() + timeout
        progress = time.monotonic()  # when the worker last finished a job
        while self.worker.pending and not self.stalled:
            now = time.monotonic()
            if now >= deadline:
                return
            if now - progress >= stall_s:
                self.stalled = True
                self.tier.disable(
                    f"block I/O stalled: no read or write finished in {stall_s:.0f} s "
                    f"({self.worker.pending} pending), left behind"
                )
                return
            results = self.worker.wait(min(deadline, progress + stall_s) - now)
            if results:
                progress = time.monotonic()
            for r in results:
                apply(r)


@dataclass(frozen=True)
class SharedProgress:
    """Where a prompt's blocks stand in the shared (remote) tier: what a disaggregated prefill replica
    reports while a router waits to hand the prompt to a decode replica (``publish``)."""

    num_held: int  # in the shared tier (written by this replica, or found there)
    num_storing: int  # on their way: in the step's device -> host copies or being written down
    num_missing: int  # neither: not in the host tier either, so nothing will write them
    active: bool  # a write-through shared tier takes blocks (False: nothing to wait for)

    @property
    def settled(self) -> bool:
        """Nothing more will arrive: every block is there or will never be."""
        return not self.active or self.num_storing == 0
