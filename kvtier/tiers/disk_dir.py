"""The disk tier's directory as shared ground: the usage ledger, safe removal, stale temp files.

Several engines (processes on one host, same user) may use one ``kv_disk_dir`` at once. What they
share, and how each stays out of the others' way::

    kv_disk_dir/.kvtier-usage   the ledger: one signed 64-bit count (little endian), read and written
                                under fcntl.flock by every engine: block files present + writes reserved
    kv_disk_dir/.kvtier-engines  each engine holds a shared flock on it while it runs (who is here)
    kv_disk_dir/ab/<key>.kvb    a block file: any engine may read, adopt, or evict it
    .../<key>.kvb.tmp.<pid>.<token>.<n>   one writer's temp file: removed by others only when stale

``DirectoryLedger`` is that count. An engine adds one when it reserves a write, takes one back when the
write fails or finds the block already there (another engine wrote it first), and takes one back for
each file it actually unlinks. So the directory's size cap holds for all engines together: a store
that would push the count over the cap first evicts (this engine's least recently used blocks).
A recount from a directory listing (at start-up, or when an engine is stuck) replaces the count only
when that engine is alone (``alone``): otherwise it may only raise it, since the listing cannot see
the other engines' reservations. (A crash leaks its reservations, over-counting, until a recount
made alone.)

``remove_inside`` is the only way the disk tier deletes anything: the path must be a file directly in
a real (not symlinked) shard directory of the cache directory, and the unlink goes through a directory
descriptor opened with ``O_NOFOLLOW``, so a shard swapped for a symlink never leads outside.

``is_stale_temp``: a temp file is another engine's write in flight unless its writer (the pid in its
name) is dead on this host or it is older than ``TEMP_MAX_AGE_S``. Engines sharing a directory must
share a pid namespace for the first rule to apply early; removing a live writer's temp anyway tears
nothing: that writer's rename fails and its store is a counted failure.

flock works on local filesystems; on network filesystems without it, run one engine per directory.
Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

from kvtier.tiers.block_format import FILE_MODE, CorruptBlock, open_regular

LEDGER_NAME = ".kvtier-usage"
PRESENCE_NAME = ".kvtier-engines"
TEMP_MAX_AGE_S = 600.0
"""A temp file older than this is a leftover even if its writer's pid is alive (reused pid)."""
_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TEMP_PID = re.compile(r"\.kvb\.tmp\.(\d+)\.")
_COUNT = struct.Struct("<q")


@dataclass
class Usage:
    """The ledger's count while it is locked: block files in the directory plus writes reserved."""

    num_blocks: int


class DirectoryLedger:
    """The shared block count of one disk directory (``LEDGER_NAME``), locked with fcntl.flock.

    One instance per tier: its lock also serializes the tier's scheduler and I/O threads (flock alone
    does not, since both use the same open file)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, LEDGER_NAME)
        self._fd = _open_shared_file(self.path)
        weakref.finalize(self, os.close, self._fd)
        self._presence_fd = _open_shared_file(os.path.join(directory, PRESENCE_NAME))
        weakref.finalize(self, os.close, self._presence_fd)
        fcntl.flock(self._presence_fd, fcntl.LOCK_SH)  # held for this tier's lifetime
        self._lock = threading.Lock()

    def alone(self) -> bool:
        """Whether no other engine (tier) uses the directory now. Call with the ledger locked, so that
        two engines never both think so: then a recount may drop reservations that a crash leaked."""
        try:
            fcntl.flock(self._presence_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # A conversion that fails has dropped the shared lock all the same (flock(2): the old lock
            # goes first): take it again, or the next engine to ask would think itself alone.
            fcntl.flock(self._presence_fd, fcntl.LOCK_SH)
            return False
        fcntl.flock(self._presence_fd, fcntl.LOCK_SH)
        return True

    @contextlib.contextmanager
    def update(self) -> Iterator[Usage]:
        """Lock the ledger (against every engine and thread) and write the count back on exit."""
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._fd, _COUNT.size, 0)
                usage = Usage(_COUNT.unpack(raw)[0] if len(raw) == _COUNT.size else 0)
                yield usage
                os.pwrite(self._fd, _COUNT.pack(max(0, usage.num_blocks)), 0)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def add(self, delta: int) -> None:
        with self.update() as usage:
            usage.num_blocks += delta

    def read(self) -> int:
        with self.update() as usage:
            return usage.num_blocks


def _open_shared_file(path: str) -> int:
    """Open (creating ``FILE_MODE``) one of the directory's shared files: a regular file, never a
    symlink's target, or OSError (EINVAL for a FIFO or other non-file: it would block or fail later)."""
    try:
        return open_regular(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    except CorruptBlock as exc:
        raise OSError(errno.EINVAL, str(exc), path) from exc


def remove_inside(directory: str, path: str) -> bool:
    """Unlink ``path`` if it is an entry of a real shard directory directly under ``directory`` (a
    resolved path); never follows a symlink. Whether something was removed."""
    parent, name = os.path.split(path)
    if os.path.dirname(parent) != directory or os.path.realpath(parent) != parent:
        return False  # the shard is a symlink now, or the path is not where blocks live
    try:
        fd = os.open(parent, _NOFOLLOW_DIR)
    except OSError:
        return False
    try:
        os.unlink(name, dir_fd=fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def tighten_mode(path: str, mode: int, *, directory: bool = False) -> None:
    """chmod a file or directory of ours (same owner, not a symlink) to ``mode`` if it is looser."""
    flags = _NOFOLLOW_DIR if directory else os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    with contextlib.suppress(OSError):
        fd = os.open(path, flags)
        try:
            st = os.fstat(fd)
            if st.st_uid == os.geteuid() and st.st_mode & 0o777 & ~mode:
                os.fchmod(fd, mode)
        finally:
            os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (in this pid namespace)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


def is_stale_temp(name: str, mtime: float, now: float | None = None) -> bool:
    """A temp file is a leftover (safe to remove) if its writer is dead or it is old."""
    if (now if now is not None else time.time()) - mtime > TEMP_MAX_AGE_S:
        return True
    match = _TEMP_PID.search(name)
    return match is not None and not pid_alive(int(match.group(1)))
