"""The disk tier (L3): one file per block in a local directory, LRU-evicted, kept across restarts.

``DiskTier`` is the bookkeeping, called from the scheduler's thread only; ``DiskBlockIO`` is how the
background I/O worker (``kvtier/transfer/io_worker.py``) reads and writes the files, in the block
format of ``kvtier/tiers/block_format.py``. Neither imports torch.

Directory layout (one engine per directory at a time)::

    kv_disk_dir/
      00/ 00a1...9f.kvb              one file per block, named by its key (64 hex digits), sharded
      01/ ...                        into 256 subdirectories by the key's first byte
      ab/ ab3c...e2.kvb.tmp.<pid>.<n>   a write in progress; renamed over the final name when complete
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
from collections import Counter, OrderedDict
from collections.abc import Sequence

from kvtier.stats import Medium, TierCounters
from kvtier.tiers.base import BlockKey, ExternalTier, LoadSpec, StoreSpec, TierIdentity
from kvtier.tiers.block_format import (
    FILE_NAME,
    FILE_SUFFIX,
    HEADER_NBYTES,
    TEMP_MARKER,
    ByteBuffer,
    CorruptBlock,
    check_block_file,
    read_block_file,
    write_block_file,
)

logger = logging.getLogger("kvtier.tiers.disk")

_SHARD_NAME = re.compile(r"^[0-9a-f]{2}$")
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


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _touch(path: str) -> None:
    """Bump a loaded file's mtime, so the LRU order rebuilt at the next start reflects the loads."""
    with contextlib.suppress(OSError):
        os.utime(path)


class DiskBlockIO:
    """The disk tier's reads and writes, run by a ``BlockIOWorker`` (addresses are file paths).

    A load that finds a missing, truncated, corrupt or foreign file fails without being fatal: a miss,
    and the coordinator invalidates that key. A fatal failure (the disk is full, read-only, not ours)
    turns the tier off."""

    def __init__(self, identity: TierIdentity, secret: bytes | None = None) -> None:
        self.identity = identity
        self.secret = secret  # with a secret, blocks are signed on write and verified on read

    def read(self, key: BlockKey, address: object, out: ByteBuffer) -> None:
        read_block_file(str(address), key, self.identity, out, self.secret)
        _touch(str(address))

    def write(self, key: BlockKey, address: object, data: ByteBuffer) -> None:
        write_block_file(str(address), key, self.identity, data, self.secret)

    @staticmethod
    def is_fatal(exc: BaseException) -> bool:
        return isinstance(exc, OSError) and exc.errno in FATAL_ERRNOS


class DiskTier(ExternalTier):
    """Bookkeeping of the disk tier: an LRU index of the block files in one directory.

    A key is in one of three states (pins are counted on held keys)::

        reserved   in _reserved: a write in flight     invisible to lookup, never evicted
        held       in _held (LRU order, oldest first)  lookup hits; its file is deleted on eviction
        pinned     held with pins > 0: a load in flight  never evicted

    How the coordinator drives it with a ``BlockIOWorker`` over ``DiskBlockIO`` (addresses are paths)::

        spec = tier.prepare_store(keys)   -> worker.submit_store(key, path, snapshot) for each accepted key
        result ok                          -> tier.complete_store([key], True, seconds)
        result not ok                      -> tier.complete_store([key], False); if fatal: tier.disable(error)
        spec = tier.prepare_load(keys)    -> worker.submit_load(key, path, out) for each key
        result ok                          -> tier.complete_load([key], seconds)
        result not ok, not fatal           -> tier.invalidate(key, error), *then* tier.complete_load([key])
        result fatal                       -> tier.disable(error), then tier.complete_load([key]) (a no-op)

    The tier counts its own loads, stores, evictions and load failures as they complete.

    Disabled (the directory cannot be created or written, or ``disable`` was called after a fatal I/O
    error): holds nothing, accepts nothing; files already on disk are left for the next run.
    """

    medium = Medium.DISK

    def __init__(
        self, directory: str | os.PathLike[str], capacity_bytes: int, identity: TierIdentity
    ) -> None:
        self.counters = TierCounters()
        self.identity = identity
        self.directory = os.path.abspath(os.fspath(directory))
        self.file_nbytes = HEADER_NBYTES + identity.block_bytes
        self._capacity_blocks = max(0, capacity_bytes) // self.file_nbytes
        self._held: OrderedDict[BlockKey, None] = OrderedDict()
        self._reserved: set[BlockKey] = set()
        self._pins: Counter[BlockKey] = Counter()
        self.disabled = False
        self.disabled_reason: str | None = None
        self._logged_invalid = False
        reason = self._probe_directory()
        if reason is not None:
            self.disable(reason)
            return
        self._scan()

    # ------------------------------------------------------------------------ occupancy
    @property
    def capacity_blocks(self) -> int:
        return 0 if self.disabled else self._capacity_blocks

    @property
    def num_used_blocks(self) -> int:
        return len(self._held) + len(self._reserved)

    def contains(self, key: BlockKey) -> bool:
        return key in self._held

    def keys(self) -> list[BlockKey]:
        """Held keys, least recently used first."""
        return list(self._held)

    held_keys = keys  # what the tier announced to its listener (the start-up scan's when it attached)

    def path_of(self, key: BlockKey) -> str:
        """The final path of block ``key``'s file."""
        name = key.hex()
        return os.path.join(self.directory, name[:2], name + FILE_SUFFIX)

    # ------------------------------------------------------------------------ loads
    def prepare_load(self, keys: Sequence[BlockKey]) -> LoadSpec:
        for key in keys:
            if key not in self._held:
                raise KeyError(f"disk tier: load of a key it does not hold ({key.hex()[:12]})")
        self._pins.update(keys)
        return LoadSpec(tuple(keys), tuple(self.path_of(key) for key in keys))

    def complete_load(self, keys: Sequence[BlockKey], seconds: float = 0.0) -> None:
        """Unpin; keys still held (not invalidated meanwhile) were read (in ``seconds``) and become the
        most recently used."""
        num_loaded = 0
        for key in keys:
            if self._pins[key] > 1:
                self._pins[key] -= 1
            else:
                self._pins.pop(key, None)
            if key in self._held:
                self._held.move_to_end(key)
                num_loaded += 1
        if num_loaded:
            self.counters.record_loads(num_loaded, num_loaded * self.identity.block_bytes, seconds)

    # ------------------------------------------------------------------------ stores
    def prepare_store(self, keys: Sequence[BlockKey]) -> StoreSpec:
        accepted: list[BlockKey] = []
        evicted: list[BlockKey] = []
        if self.disabled:
            return StoreSpec((), ())
        for key in dict.fromkeys(keys):
            if key in self._held or key in self._reserved:
                continue
            if self.num_used_blocks >= self._capacity_blocks:
                victim = self._evict_one()
                if victim is None:
                    break  # everything pinned or reserved: later keys will not fit either
                evicted.append(victim)
            self._reserved.add(key)
            accepted.append(key)
        return StoreSpec(tuple(accepted), tuple(self.path_of(key) for key in accepted), tuple(evicted))

    def complete_store(self, keys: Sequence[BlockKey], ok: bool = True, seconds: float = 0.0) -> None:
        """Publish (``ok``: written in ``seconds``) or release the reservations of ``keys``; unknown
        keys are ignored."""
        num_stored = 0
        for key in keys:
            if key not in self._reserved:
                continue
            self._reserved.discard(key)
            if ok:
                self._held[key] = None
                num_stored += 1
                self._announce_stored([key])
        if num_stored:
            self.counters.record_stores(num_stored, num_stored * self.identity.block_bytes, seconds)

    def _evict_one(self) -> BlockKey | None:
        """Drop the least recently used unpinned held block and delete its file."""
        for key in self._held:
            if not self._pins[key]:
                del self._held[key]
                _remove(self.path_of(key))
                self.counters.blocks_evicted += 1
                self._announce_removed([key])
                return key
        return None

    # ------------------------------------------------------------------------ failures
    def invalidate(self, key: BlockKey, reason: str) -> None:
        """A load found block ``key``'s file unusable: forget it and remove the file (logged once)."""
        self.counters.load_failures += 1
        if not self._logged_invalid:
            self._logged_invalid = True
            logger.warning(
                "disk tier: block file %s is unusable (%s); removed and treated as a miss "
                "(later ones are only counted in counters.load_failures)",
                self.path_of(key),
                reason,
            )
        if key in self._held:
            del self._held[key]
            self._announce_removed([key])
        self._pins.pop(key, None)
        if not self.disabled:
            _remove(self.path_of(key))

    def disable(self, reason: str) -> None:
        """Stop using the disk (logged once): forget every block, keep the files for the next run."""
        if self.disabled:
            return
        self.disabled = True
        self.disabled_reason = reason
        self._announce_removed(list(self._held))
        self._held.clear()
        self._reserved.clear()
        self._pins.clear()
        logger.warning("disk tier disabled, running without it: %s (%s)", reason, self.directory)

    # ------------------------------------------------------------------------ startup
    def _probe_directory(self) -> str | None:
        """Create the directory and write a probe file; the reason it is unusable, or None."""
        probe = os.path.join(self.directory, f".probe.{os.getpid()}{TEMP_MARKER}")
        try:
            os.makedirs(self.directory, exist_ok=True)
            with open(probe, "wb") as handle:
                handle.write(b"\0")
        except OSError as exc:
            _remove(probe)
            return (
                f"cannot write to kv_disk_dir: {exc.strerror or exc} [{errno.errorcode.get(exc.errno or 0)}]"
            )
        _remove(probe)
        return None

    def _scan(self) -> None:
        """Index the valid block files (oldest mtime first), remove the others, evict to capacity."""
        found: list[tuple[int, BlockKey]] = []
        num_invalid = num_temp = 0
        reasons: Counter[str] = Counter()
        try:
            shards = [e.path for e in os.scandir(self.directory) if e.is_dir() and _SHARD_NAME.match(e.name)]
        except OSError as exc:
            self.disable(f"cannot list kv_disk_dir: {exc}")
            return
        for shard in shards:
            try:
                entries = list(os.scandir(shard))
            except OSError:
                continue
            for entry in entries:
                if TEMP_MARKER in entry.name:
                    _remove(entry.path)  # a write that never finished (a previous run's crash)
                    num_temp += 1
                    continue
                if not FILE_NAME.match(entry.name):
                    continue
                key = BlockKey(bytes.fromhex(entry.name[:64]))
                try:
                    stat = check_block_file(entry.path, key, self.identity)
                except (CorruptBlock, OSError) as exc:
                    reasons[str(exc).split(" (")[0]] += 1
                    _remove(entry.path)
                    num_invalid += 1
                    continue
                found.append((stat.st_mtime_ns, key))
        found.sort()
        self._held.update((key, None) for _, key in found)
        num_over = 0
        while len(self._held) > self._capacity_blocks and self._evict_one() is not None:
            num_over += 1
        self.counters.blocks_evicted = 0  # startup trimming is not eviction under load
        message = (
            f"disk tier: {len(self._held)} blocks ({len(self._held) * self.file_nbytes / 2**30:.2f} GiB of "
            f"{self._capacity_blocks * self.file_nbytes / 2**30:.2f}) in {self.directory}; removed "
            f"{num_invalid} invalid, {num_temp} unfinished and {num_over} over-capacity files"
        )
        if num_invalid:
            details = ", ".join(f"{count} x {reason}" for reason, count in reasons.most_common(3))
            logger.warning("%s (%s)", message, details)
        else:
            logger.info(message)
