"""``BlockIOWorker``: moves block bytes between host memory and a tier outside the process, on a
background thread, so the scheduler's thread never waits on a disk or a network.

It knows nothing about where the bytes go: the tier plugs in a :class:`BlockIO` (its own ``read`` and
``write`` of one block at an address: a file path for the disk tier, an object name for a network
store). Buffers are plain byte buffers (``memoryview``), so this module is torch-free::

    scheduler thread                         worker thread (one, daemon)
    ────────────────                         ───────────────────────────
    submit_store(key, address, data, group) ─jobs─► io.write(key, address, data, group)
    submit_load(key, address, out, group)   ─FIFO─► io.read(key, address, out, group)   validate, fill
    poll() / wait() / drain()               ◄─────  IOResult(kind, key, ok, error, fatal, nbytes, seconds)

``group`` is the block's KV group (``kvtier/kv/groups.py``; 0 for a dense model): a write records it
in the block's header, a read refuses a block whose header names another group (a miss).

Jobs run one at a time in submission order, so a load submitted after a store of the same address
sees the stored block. The worker owns ``data`` from ``submit_store`` on (pass a snapshot) and writes
into ``out`` (a view into the host tier's buffer) only for a load: ``out`` is valid only if that
load's result has ``ok=True``.

A tier whose store pays per round trip (a network store) may also give its ``BlockIO`` ``read_batch``
and ``write_batch`` (:class:`BatchBlockIO`): the worker then hands it each run of queued jobs of one kind
(up to ``max_batch``, still in submission order) to move in one pipelined round trip. A BlockIO without
them (the disk's) runs one job at a time.

Failures never escape the thread. ``fatal=True`` (``io.is_fatal``) means the tier as a whole is
unusable and should be turned off; otherwise a failed load is a miss for that one block.
"""

from __future__ import annotations

import errno
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from kvtier.tiers.base import BlockKey

ByteBuffer = bytes | bytearray | memoryview


class BlockIO(Protocol):
    """One tier's block reads and writes (of KV group ``group``'s block); each raises on failure."""

    def read(self, key: BlockKey, address: object, out: ByteBuffer, group: int = 0) -> None: ...
    def write(self, key: BlockKey, address: object, data: ByteBuffer, group: int = 0) -> None: ...
    def is_fatal(self, exc: BaseException) -> bool: ...


Jobs = list[tuple[BlockKey, object, ByteBuffer]]


class BatchBlockIO(BlockIO, Protocol):
    """A BlockIO that moves many blocks per call (of KV ``groups``, parallel to the jobs; () = all
    group 0); each returns one exception (or None) per job."""

    def read_batch(self, jobs: Jobs, groups: Sequence[int] = ()) -> list[BaseException | None]: ...
    def write_batch(self, jobs: Jobs, groups: Sequence[int] = ()) -> list[BaseException | None]: ...


@dataclass(frozen=True)
class IOResult:
    """The outcome of one job. ``nbytes``: payload bytes moved (0 on failure)."""

    kind: Literal["load", "store"]
    key: BlockKey
    ok: bool
    error: str | None = None
    fatal: bool = False
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class _Job:
    kind: Literal["load", "store"]
    key: BlockKey
    address: object
    buffer: ByteBuffer
    group: int = 0  # the block's KV group


def describe(exc: BaseException) -> str:
    """A one-line description of a job's failure: the errno name when there is one."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror} ({exc.filename})"
    return f"{type(exc).__name__}: {exc}"


class BlockIOWorker:
    """One daemon thread running a tier's block reads and writes; results come back through ``poll``."""

    def __init__(self, io: BlockIO, *, name: str = "kvtier-block-io", max_batch: int = 32) -> None:
        self.io = io
        self.max_batch = max_batch if hasattr(io, "read_batch") and hasattr(io, "write_batch") else 1
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._results: deque[IOResult] = deque()
        self._done = threading.Condition()
        self._num_pending = 0  # submitted, no result yet (guarded by _done)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------ submitting
    def submit_store(self, key: BlockKey, address: object, data: ByteBuffer, group: int = 0) -> None:
        """Write ``data`` (bytes the worker now owns) as KV group ``group``'s block ``key`` at ``address``."""
        self._submit(_Job("store", key, address, data, group))

    def submit_load(self, key: BlockKey, address: object, out: ByteBuffer, group: int = 0) -> None:
        """Read KV group ``group``'s block ``key`` from ``address`` into ``out``; ``out`` is valid only if
        the result is ok (a block of another group is not)."""
        self._submit(_Job("load", key, address, out, group))

    def _submit(self, job: _Job) -> None:
        with self._done:
            if self._closed:
                raise RuntimeError("the block I/O worker is closed")
            self._num_pending += 1
        self._jobs.put(job)

    # ------------------------------------------------------------------------ collecting
    @property
    def pending(self) -> int:
        """Jobs submitted whose result is not ready yet."""
        with self._done:
            return self._num_pending

    def poll(self) -> list[IOResult]:
        """The results ready now (never blocks)."""
        with self._done:
            return self._take()

    def wait(self, timeout: float | None = None) -> list[IOResult]:
        """Block until at least one result is ready (or ``timeout`` seconds pass, or nothing is pending)."""
        with self._done:
            self._done.wait_for(lambda: self._results or not self._num_pending, timeout)
            return self._take()

    def drain(self, timeout: float | None = None) -> list[IOResult]:
        """Block until every submitted job has finished; all results not yet taken. After a timeout,
        the results ready so far (``pending`` then says how many are still running)."""
        with self._done:
            self._done.wait_for(lambda: not self._num_pending, timeout)
            return self._take()

    def close(self, timeout: float | None = None) -> list[IOResult]:
        """Finish the submitted jobs, stop the thread, and return the results not yet taken. Idempotent."""
        with self._done:
            already = self._closed
            self._closed = True
        if not already:
            self._jobs.put(None)
        self._thread.join(timeout)
        return self.poll()

    @property
    def closed(self) -> bool:
        return self._closed

    def _take(self) -> list[IOResult]:
        results = list(self._results)
        self._results.clear()
        return results

    # ------------------------------------------------------------------------ the thread
    def _run(self) -> None:
        carry: _Job | None = None  # a job taken while batching that did not fit the batch: runs next
        while True:
            job, carry = (carry, None) if carry is not None else (self._jobs.get(), None)
            if job is None:
                return
            batch = [job]
            while len(batch) < self.max_batch:  # more queued jobs of the same kind join the batch
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None or nxt.kind != job.kind:
                    if nxt is None:
                        self._jobs.put(None)  # the end of the queue stays the end
                    else:
                        carry = nxt
                    break
                batch.append(nxt)
            results = [self._execute(job)] if len(batch) == 1 else self._execute_batch(batch)
            del job, batch  # a store's snapshot is freed now, not when the next job arrives
            with self._done:
                self._results.extend(results)
                self._num_pending -= len(results)
                self._done.notify_all()

    def _execute(self, job: _Job) -> IOResult:
        start = time.perf_counter()
        try:
            if job.kind == "store":
                self.io.write(job.key, job.address, job.buffer, job.group)
            else:
                self.io.read(job.key, job.address, job.buffer, job.group)
        except BaseException as exc:  # noqa: BLE001 (nothing may escape the worker thread)
            seconds = time.perf_counter() - start
            return IOResult(job.kind, job.key, False, describe(exc), self.io.is_fatal(exc), 0, seconds)
        nbytes = memoryview(job.buffer).nbytes
        return IOResult(job.kind, job.key, True, None, False, nbytes, time.perf_counter() - start)

    def _execute_batch(self, batch: list[_Job]) -> list[IOResult]:
        """Run jobs of one kind in one call of the BlockIO's batched path; the time is shared evenly."""
        io: BatchBlockIO = self.io  # type: ignore[assignment]
        start = time.perf_counter()
        jobs = [(job.key, job.address, job.buffer) for job in batch]
        groups = [job.group for job in batch]
        try:
            errors = io.write_batch(jobs, groups) if batch[0].kind == "store" else io.read_batch(jobs, groups)
        except BaseException as exc:  # noqa: BLE001 (nothing may escape the worker thread)
            errors = [exc] * len(batch)
        seconds = (time.perf_counter() - start) / len(batch)
        results = []
        for job, exc in zip(batch, errors, strict=True):
            if exc is None:
                nbytes = memoryview(job.buffer).nbytes
                results.append(IOResult(job.kind, job.key, True, None, False, nbytes, seconds))
            else:
                results.append(
                    IOResult(job.kind, job.key, False, describe(exc), io.is_fatal(exc), 0, seconds)
                )
        return results
