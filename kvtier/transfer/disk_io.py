"""The disk I/O worker: moves block bytes between block files and CPU tensors on a background thread.

The block files themselves (header layout in ``kvtier/tiers/disk.py``) are written and read here:
``write_block_file`` (temp file + rename) and ``read_block_file`` (validates everything, or raises).

The scheduler's thread never touches the disk for a block's bytes; it submits jobs and collects their
results between steps::

    scheduler thread                         worker thread (one, daemon)
    ────────────────                         ───────────────────────────
    submit_store(key, path, data) ──jobs──►  write_block_file(path, ...)   temp file + rename
    submit_load(key, path, out)   ──(FIFO)─► read_block_file(path, ..., out)  validate, fill ``out``
    poll() / wait() / drain()     ◄─results─ IOResult(kind, key, ok, error, fatal, nbytes, seconds)

Jobs run one at a time in submission order, so a load submitted after a store of the same path sees
the stored file. The worker owns ``data`` from ``submit_store`` on (pass a snapshot) and writes into
``out`` (a view into the host tier's buffer) only for a load: ``out`` is valid only if that load's
result has ``ok=True``.

Failures never escape the thread. ``fatal=True`` means the disk as a whole is unusable (full, read-only,
no permission, over quota, file too large): the coordinator should ``DiskTier.disable`` it. A load that
finds a missing, truncated, corrupt or foreign file is ``ok=False, fatal=False``: a miss; the coordinator
should ``DiskTier.invalidate`` that key.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import queue
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Literal

import torch

from kvtier.tiers.base import BlockKey, TierIdentity
from kvtier.tiers.disk import HEADER_NBYTES, CorruptBlockFile, encode_header, validate_header

FATAL_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EROFS,
        errno.EACCES,
        errno.EPERM,
        errno.EFBIG,
        getattr(errno, "EDQUOT", errno.ENOSPC),
    }
)
"""I/O errors that mean the whole disk tier is unusable, not just one file."""
_temp_ids = itertools.count()


# ------------------------------------------------------------------------------ block files
def _torch_dtype(identity: TierIdentity) -> torch.dtype:
    dtype = getattr(torch, identity.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {identity.dtype!r}")
    return dtype


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor (works for bfloat16, which numpy lacks)."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _check_tensor(tensor: torch.Tensor, identity: TierIdentity, what: str) -> None:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"{what} must be a contiguous CPU tensor")
    if tuple(tensor.shape) != tuple(identity.block_shape) or tensor.dtype != _torch_dtype(identity):
        expected = f"{tuple(identity.block_shape)} {identity.dtype}"
        raise ValueError(f"{what} is {tuple(tensor.shape)} {tensor.dtype}, expected {expected}")


def write_block_file(
    path: str | os.PathLike[str], key: BlockKey, identity: TierIdentity, data: torch.Tensor
) -> int:
    """Write ``data`` (a contiguous CPU tensor of the identity's shape and dtype) as block ``key``.

    Atomic: the bytes go to ``<path>.tmp.<pid>.<n>`` in the same directory (created if missing), which is
    renamed over ``path`` once complete; on any error the temp file is removed and the error re-raised.
    Not fsynced: a crash can lose recent files or leave a damaged one, which the checksums turn into a
    miss. Returns the file size in bytes.
    """
    _check_tensor(data, identity, "data")
    payload = _raw_bytes(data)
    header = encode_header(key, identity, payload.nbytes, zlib.crc32(payload))
    path = os.fspath(path)
    temp = f"{path}.tmp.{os.getpid()}.{next(_temp_ids)}"
    try:
        try:
            handle = open(temp, "wb")  # noqa: SIM115 (closed below, before the rename)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            handle = open(temp, "wb")  # noqa: SIM115
        with handle:
            handle.write(header)
            handle.write(payload)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return HEADER_NBYTES + payload.nbytes


def _read_exactly(fd: int, buffer: memoryview) -> int:
    """Fill ``buffer`` from ``fd``; returns the bytes read (fewer only at end of file)."""
    total = 0
    while total < buffer.nbytes:
        n = os.readv(fd, [buffer[total:]])
        if n == 0:
            break
        total += n
    return total


def read_block_file(
    path: str | os.PathLike[str], key: BlockKey, identity: TierIdentity, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Read and fully validate block ``key``; returns ``out`` (filled) or a new tensor.

    Raises CorruptBlockFile if anything does not match (then ``out`` holds garbage and must not be used),
    OSError (e.g. FileNotFoundError) if the file cannot be read, ValueError if ``out`` is unsuitable.
    """
    if out is None:
        out = torch.empty(identity.block_shape, dtype=_torch_dtype(identity))
    else:
        _check_tensor(out, identity, "out")
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        raw = bytearray(HEADER_NBYTES)
        got = _read_exactly(fd, memoryview(raw))
        header = validate_header(memoryview(raw)[:got], os.fstat(fd).st_size, key, identity)
        payload = _raw_bytes(out)
        if _read_exactly(fd, payload) != payload.nbytes:
            raise CorruptBlockFile("truncated payload")
    finally:
        os.close(fd)
    if zlib.crc32(payload) != header.payload_crc32:
        raise CorruptBlockFile("payload checksum mismatch")
    return out


# ------------------------------------------------------------------------------ the worker
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
    path: str
    tensor: torch.Tensor


def is_fatal(exc: BaseException) -> bool:
    """Whether ``exc`` means the disk itself is unusable (full, read-only, no permission, ...)."""
    return isinstance(exc, OSError) and exc.errno in FATAL_ERRNOS


def describe(exc: BaseException) -> str:
    """A one-line description of a job's failure: the errno name when there is one."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror} ({exc.filename})"
    return f"{type(exc).__name__}: {exc}"


class DiskIOWorker:
    """One daemon thread running block file reads and writes; the results come back through ``poll``."""

    def __init__(self, identity: TierIdentity, *, name: str = "kvtier-disk-io") -> None:
        self.identity = identity
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._results: deque[IOResult] = deque()
        self._done = threading.Condition()
        self._num_pending = 0  # submitted, no result yet (guarded by _done)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------ submitting
    def submit_store(self, key: BlockKey, path: str | os.PathLike[str], data: torch.Tensor) -> None:
        """Write ``data`` (a contiguous CPU tensor the worker now owns) as block ``key`` at ``path``."""
        self._submit(_Job("store", key, os.fspath(path), data))

    def submit_load(self, key: BlockKey, path: str | os.PathLike[str], out: torch.Tensor) -> None:
        """Read block ``key`` from ``path`` into ``out``; ``out`` is valid only if the result is ok."""
        self._submit(_Job("load", key, os.fspath(path), out))

    def _submit(self, job: _Job) -> None:
        with self._done:
            if self._closed:
                raise RuntimeError("the disk I/O worker is closed")
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
        while True:
            job = self._jobs.get()
            if job is None:
                return
            result = self._execute(job)
            del job  # a store's snapshot is freed now, not when the next job arrives
            with self._done:
                self._results.append(result)
                self._num_pending -= 1
                self._done.notify_all()

    def _execute(self, job: _Job) -> IOResult:
        start = time.perf_counter()
        try:
            if job.kind == "store":
                write_block_file(job.path, job.key, self.identity, job.tensor)
            else:
                read_block_file(job.path, job.key, self.identity, job.tensor)
                _touch(job.path)
        except BaseException as exc:  # noqa: BLE001 (nothing may escape the worker thread)
            seconds = time.perf_counter() - start
            return IOResult(job.kind, job.key, False, describe(exc), is_fatal(exc), 0, seconds)
        return IOResult(
            job.kind, job.key, True, None, False, self.identity.block_bytes, time.perf_counter() - start
        )


def _touch(path: str) -> None:
    """Bump a loaded file's mtime, so the LRU order rebuilt at the next start reflects the loads."""
    with contextlib.suppress(OSError):
        os.utime(path)
