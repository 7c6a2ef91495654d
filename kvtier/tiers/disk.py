"""The disk tier (L3): one file per block in a local directory, LRU-evicted, kept across restarts,
shareable by several engines on one host.

``DiskTier`` is the bookkeeping, called from the scheduler's thread only; ``DiskBlockIO`` is how the
background I/O worker (``kvtier/transfer/io_worker.py``) reads and writes the files, in the block
format of ``kvtier/tiers/block_format.py``. Neither imports torch.

Directory layout::

    kv_disk_dir/                     created 0700 if missing (an existing one keeps its mode: a warning
      .kvtier-usage                  if others may write it); the shared usage ledger (disk_dir.py)
      00/ 00a1...9f.kvb              one file per block (0600), named by its key (64 hex digits),
      01/ ...                        sharded into 256 subdirectories (0700) by the key's first byte
      ab/ ab3c...e2.kvb.tmp.<pid>.<token>.<n>   a write in progress; linked or renamed into place

The directory is not trusted:

- nothing follows a symlink: the start-up scan skips (and counts) symlinked shards and files, reads and
  writes refuse them (ELOOP, a miss or a failed store), and every removal goes through
  ``disk_dir.remove_inside``, which only unlinks entries of real shard directories of this directory;
- nothing but a regular file is opened: every open adds ``O_NONBLOCK`` and checks ``fstat`` first, so
  a FIFO or device at a block's path is a miss (removed), one at the ledger's name turns the tier off,
  and the start-up probe has an unguessable name created ``O_EXCL``; at shutdown a worker that finishes
  nothing for ``coordinator.IO_STALL_S`` turns the tier off (one line) instead of being waited on;
- with a secret (``kv_remote_secret`` / ``$KVTIER_REMOTE_SECRET``, the remote tier's), blocks are signed
  and a block that was edited and re-checksummed, or is unsigned, is refused on load: a counted miss.

Sharing (several engines, same user, one host): each engine indexes what it found at start-up, what
it wrote, and what another engine wrote: ``contains`` stats the expected path of a key it does not
hold (one stat per lookup miss) and adopts the file, checked in full when read. Temp files carry the
writer's pid and are removed by the scan only when stale (writer dead, or older than 10 minutes). The
size cap is the directory's: the flock-protected ledger counts every engine's files and reservations,
and a store that would exceed the cap evicts this engine's least recently used blocks first (which may
be files another engine also indexes: its load then misses, which it counts and forgets). An engine
whose own blocks are all pinned while the directory is full re-lists the directory (at most every
``RESCAN_INTERVAL_S``) to adopt the others' blocks and correct the ledger.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import stat
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.kv.lower import KeyGroups
from kvtier.kv.retention import Retention, TierProtection
from kvtier.stats import Medium, TierCounters
from kvtier.tiers import retention_file
from kvtier.tiers.base import BlockKey, ExternalTier, LoadSpec, StoreSpec, TierIdentity
from kvtier.tiers.block_format import (
    DIR_MODE,
    FILE_MODE,
    FILE_NAME,
    FILE_SUFFIX,
    HEADER_NBYTES,
    TEMP_MARKER,
    BlockExists,
    ByteBuffer,
    CorruptBlock,
    check_block_file,
    open_regular,
    read_block_file,
    write_block_file,
)
from kvtier.tiers.disk_dir import DirectoryLedger, Usage, is_stale_temp, remove_inside, tighten_mode

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
RESCAN_INTERVAL_S = 10.0
"""At most this often, a tier that is full of blocks it does not hold re-lists the directory."""


def _touch(path: str) -> None:
    """Bump a loaded file's mtime, so the LRU order rebuilt at the next start reflects the loads."""
    with contextlib.suppress(OSError, NotImplementedError):
        os.utime(path, follow_symlinks=False)


class DiskBlockIO:
    """The disk tier's reads and writes, run by a ``BlockIOWorker`` (addresses are file paths).

    A load that finds a missing, truncated, corrupt, foreign, unsigned or forged file fails without
    being fatal: a miss, and the coordinator invalidates that key. A fatal failure (the disk is full,
    read-only, not ours) turns the tier off. With the tier's ``ledger`` (``DiskTier.block_io``), a write
    never replaces a block file that is already there (another engine wrote it first): the reservation
    it made in the ledger is given back instead."""

    def __init__(
        self, identity: TierIdentity, secret: bytes | None = None, ledger: DirectoryLedger | None = None
    ) -> None:
        self.identity = identity
        self.secret = secret  # with a secret, blocks are signed on write and verified on read
        self.ledger = ledger

    def read(self, key: BlockKey, address: object, out: ByteBuffer, group: int = 0) -> None:
        read_block_file(str(address), key, self.identity, out, self.secret, group=group)
        _touch(str(address))

    def write(self, key: BlockKey, address: object, data: ByteBuffer, group: int = 0) -> None:
        if self.ledger is None:
            write_block_file(str(address), key, self.identity, data, self.secret, group=group)
            return
        try:
            write_block_file(str(address), key, self.identity, data, self.secret, exclusive=True, group=group)
        except BlockExists:
            with contextlib.suppress(OSError):  # no new file: the same block is there already
                self.ledger.add(-1)

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

        spec = tier.prepare_store(keys, groups) -> worker.submit_store(key, path, snapshot, group) each
        result ok                          -> tier.complete_store([key], True, seconds)
        result not ok                      -> tier.complete_store([key], False); if fatal: tier.disable(error)
        spec = tier.prepare_load(keys)    -> worker.submit_load(key, path, out, group) for each key
        result ok                          -> tier.complete_load([key], seconds)
        result not ok, not fatal           -> tier.invalidate(key, error), *then* tier.complete_load([key])
        result fatal                       -> tier.disable(error), then tier.complete_load([key]) (a no-op)

    A load names the KV group it reads the block for; a file whose header names another group is a
    miss like a damaged one (invalidated: removed, counted in ``counters.load_failures``).

    The tier counts its own loads, stores, evictions and load failures as they complete.

    ``capacity_blocks`` is the directory's cap, shared with every engine on it (the ledger);
    ``num_used_blocks`` counts this engine's index only. ``contains`` also finds (and from then on
    holds) a key whose file another engine wrote.

    Disabled (the directory cannot be created or written, or ``disable`` was called after a fatal I/O
    error): holds nothing, accepts nothing; files already on disk are left for the next run.
    """

    medium = Medium.DISK

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int,
        identity: TierIdentity,
        retention: Retention | None = None,
    ) -> None:
        self.counters = TierCounters()
        self.identity = identity
        self.directory = os.path.realpath(os.fspath(directory))
        self.file_nbytes = HEADER_NBYTES + identity.block_bytes
        self._capacity_blocks = max(0, capacity_bytes) // self.file_nbytes
        self.protection = TierProtection(retention, self._capacity_blocks)  # retained keys evicted last
        self.retention = retention
        self._next_save = time.monotonic() + retention_file.SAVE_INTERVAL_S
        self._held: OrderedDict[BlockKey, None] = OrderedDict()
        self._reserved: set[BlockKey] = set()
        self._pins: Counter[BlockKey] = Counter()
        self._key_groups: dict[BlockKey, int] = {}
        self.disabled = False
        self.disabled_reason: str | None = None
        self.ledger: DirectoryLedger | None = None
        self._logged_invalid = False
        self._last_rescan = float("-inf")
        reason = self._probe_directory()
        if reason is not None:
            self.disable(reason)
            return
        self._scan()
        if retention is not None:  # what clients were promised before a restart (retention_file.py)
            for key, until in retention_file.load(self.directory, retention.clock()).items():
                retention.restore(key, until)

    def tick(self) -> None:
        """Write the retention file down every ``SAVE_INTERVAL_S``."""
        if self.retention is not None and time.monotonic() >= self._next_save:
            self._next_save = time.monotonic() + retention_file.SAVE_INTERVAL_S
            self.save_retention()

    def save_retention(self) -> None:
        """Merge the engine's retention into the directory's file (a failure is logged, not raised)."""
        if self.retention is None or self.disabled or self.ledger is None:
            return
        try:
            with self.ledger.update():  # one writer at a time, across engines
                retention_file.save(self.directory, self.retention.entries(), self.retention.clock())
        except OSError as exc:
            logger.warning("disk tier: cannot write the retention file: %s", exc)

    def close(self) -> None:
        self.save_retention()

    def block_io(self, secret: bytes | None = None) -> DiskBlockIO:
        """The reads and writes for this tier's worker, sharing its ledger."""
        return DiskBlockIO(self.identity, secret, self.ledger)

    # ------------------------------------------------------------------------ occupancy
    @property
    def capacity_blocks(self) -> int:
        return 0 if self.disabled else self._capacity_blocks

    @property
    def num_used_blocks(self) -> int:
        return len(self._held) + len(self._reserved)

    def num_retained_blocks(self) -> int:
        return self.protection.count(self._held)

    def contains(self, key: BlockKey, group: int = 0) -> bool:
        """Held; or not reserved and its file is there (another engine wrote it): adopted, held now, as
        a block of KV group ``group`` (the read checks its header)."""
        if key in self._held:
            return True
        if self.disabled or key in self._reserved:
            return False
        path = self.path_of(key)
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != self.file_nbytes:
            return False
        if os.path.islink(os.path.dirname(path)):
            return False  # never adopt a file behind a symlinked shard
        self._held[key] = None  # checked in full when read; a bad one is invalidated then
        self._note_groups([key], [group])
        self._announce_stored([key])
        return True

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
        self._finish_loads(keys, self._held, self._pins, seconds)

    # ------------------------------------------------------------------------ stores
    def prepare_store(self, keys: Sequence[BlockKey], groups: KeyGroups = ()) -> StoreSpec:
        """Reserve the keys not held yet in the shared ledger, evicting to stay under the cap."""
        new = [k for k in dict.fromkeys(keys) if k not in self._held and k not in self._reserved]
        if self.disabled or not new or self.ledger is None:
            return StoreSpec((), ())
        accepted: list[BlockKey] = []
        evicted: list[BlockKey] = []
        try:
            with self.ledger.update() as usage:
                for key in new:
                    if not self._make_room(usage, evicted):
                        break  # everything pinned or reserved: later keys will not fit either
                    usage.num_blocks += 1
                    self._reserved.add(key)
                    accepted.append(key)
        except OSError as exc:  # the ledger could not be read or written: nothing reserved
            self._reserved.difference_update(accepted)
            self.disable(f"cannot use the usage ledger {self.ledger.path}: {exc}")
            return StoreSpec((), (), tuple(evicted))
        self._note_groups(keys, groups, accepted)
        return StoreSpec(tuple(accepted), tuple(self.path_of(key) for key in accepted), tuple(evicted))

    def complete_store(self, keys: Sequence[BlockKey], ok: bool = True, seconds: float = 0.0) -> None:
        """Publish (``ok``: written in ``seconds``) or release the reservations of ``keys``; unknown
        keys are ignored."""
        num_stored = 0
        num_released = 0
        for key in keys:
            if key not in self._reserved:
                continue
            self._reserved.discard(key)
            if ok:
                self._held[key] = None
                num_stored += 1
                self._announce_stored([key])
            else:
                num_released += 1
                self._forget_groups([key])
        if num_released and self.ledger is not None:
            self._ledger_add(-num_released)
        if num_stored:
            self.counters.record_stores(num_stored, num_stored * self.identity.block_bytes, seconds)

    def _make_room(self, usage: Usage, evicted: list[BlockKey]) -> bool:
        """Evict until one more block fits under the cap; False if nothing more can be evicted. Stuck
        (all of this engine's blocks pinned, or the directory full of blocks it does not hold), it
        re-lists the directory first, at most every ``RESCAN_INTERVAL_S``."""
        while usage.num_blocks >= self._capacity_blocks:
            victim = self._evict_one(usage)
            if victim is None:
                if time.monotonic() - self._last_rescan < RESCAN_INTERVAL_S:
                    return False
                self._last_rescan = time.monotonic()
                self._rescan(usage)  # another engine's blocks, a count that drifted after a crash
                continue
            evicted.append(victim)
        return True

    def _evict_one(self, usage: Usage) -> BlockKey | None:
        """Drop the least recently used unpinned, unprotected held block and delete its file (a file
        another engine already deleted is only forgotten); protected ones passed over move to the end."""
        victim = self.protection.victim(self._held, self._pins)
        if victim is None:
            return None
        del self._held[victim]
        self.protection.forget(victim)
        if remove_inside(self.directory, self.path_of(victim)):
            usage.num_blocks -= 1
        self.counters.blocks_evicted += 1
        self._announce_removed([victim])
        return victim

    def _ledger_add(self, delta: int) -> None:
        assert self.ledger is not None
        try:
            self.ledger.add(delta)
        except OSError as exc:
            logger.warning("disk tier: cannot update the usage ledger %s: %s", self.ledger.path, exc)

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
        self.protection.forget(key)
        self._forget_groups([key])
        self._pins.pop(key, None)
        if not self.disabled and remove_inside(self.directory, self.path_of(key)):
            self._ledger_add(-1)

    def disable(self, reason: str) -> None:
        """Stop using the disk (logged once): forget every block, keep the files for the next run."""
        if self.disabled:
            return
        self.disabled = True
        self.disabled_reason = reason
        self._announce_removed(list(self._held))
        self._held.clear()
        self.protection.keys.clear()
        if self._reserved and self.ledger is not None:
            with contextlib.suppress(OSError):
                self.ledger.add(-len(self._reserved))
        self._reserved.clear()
        self._key_groups.clear()
        self._pins.clear()
        logger.warning("disk tier disabled, running without it: %s (%s)", reason, self.directory)

    # ------------------------------------------------------------------------ startup
    def _probe_directory(self) -> str | None:
        """Create the directory (``DIR_MODE``), write a probe file, open the ledger; the reason it is
        unusable, or None. An existing directory keeps its mode (a warning if others may write it).
        The probe's name is unguessable and created ``O_EXCL``: nothing planted there (a FIFO would
        block the open for good) is ever opened."""
        probe = os.path.join(self.directory, f".probe.{secrets.token_hex(16)}{TEMP_MARKER}")
        try:
            if not os.path.isdir(self.directory):
                os.makedirs(self.directory, mode=DIR_MODE, exist_ok=True)
            elif os.stat(self.directory).st_mode & 0o022:
                logger.warning(
                    "disk tier: %s is writable by other users, who can plant or edit blocks "
                    "(chmod 700 it, or set kv_remote_secret to sign blocks)",
                    self.directory,
                )
            fd = open_regular(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            try:
                os.write(fd, b"\0")
            finally:
                os.close(fd)
            self.ledger = DirectoryLedger(self.directory)
        except OSError as exc:
            return (
                f"cannot write to kv_disk_dir: {exc.strerror or exc} [{errno.errorcode.get(exc.errno or 0)}]"
            )
        finally:
            with contextlib.suppress(OSError):
                os.unlink(probe)  # never anyone else's: the name is unguessable
        return None

    def _scan(self) -> None:
        """Index the valid block files (oldest mtime first), remove invalid ones and stale temp files,
        leave symlinks alone, then count the directory into the ledger and evict to capacity."""
        tally = _ScanTally()
        try:
            shards = list(os.scandir(self.directory))
        except OSError as exc:
            self.disable(f"cannot list kv_disk_dir: {exc}")
            return
        for shard in shards:
            if not _SHARD_NAME.match(shard.name):
                continue
            if shard.is_symlink():
                tally.num_links += 1  # never followed: could lead anywhere
            elif shard.is_dir(follow_symlinks=False):
                tighten_mode(shard.path, DIR_MODE, directory=True)
                self._scan_shard(shard.path, tally)
        tally.found.sort()
        self._held.update((key, None) for _, key, _ in tally.found)
        self._note_groups([key for _, key, _ in tally.found], [group for _, _, group in tally.found])
        num_over = self._count_and_trim()
        self.counters.blocks_evicted = 0  # startup trimming is not eviction under load
        self._log_scan(tally, num_over)

    def _scan_shard(self, shard: str, tally: _ScanTally) -> None:
        try:
            entries = list(os.scandir(shard))
        except OSError:
            return
        now = time.time()
        for entry in entries:
            if entry.is_symlink():
                tally.num_links += 1
                continue
            if not entry.is_file(follow_symlinks=False):
                continue
            if TEMP_MARKER in entry.name:
                with contextlib.suppress(OSError):
                    mtime = entry.stat(follow_symlinks=False).st_mtime
                    if is_stale_temp(entry.name, mtime, now) and remove_inside(self.directory, entry.path):
                        tally.num_temp += 1  # a write that never finished (a crashed writer)
                continue
            if not FILE_NAME.match(entry.name):
                continue
            key = BlockKey(bytes.fromhex(entry.name[:64]))
            try:
                st, group = check_block_file(entry.path, key, self.identity)
            except (CorruptBlock, OSError) as exc:
                tally.reasons[str(exc).split(" (")[0]] += 1
                tally.num_invalid += remove_inside(self.directory, entry.path)
                continue
            if st.st_mode & 0o077:
                tighten_mode(entry.path, FILE_MODE)  # written by an older version, 0644
            tally.found.append((st.st_mtime_ns, key, group))

    def _count_and_trim(self) -> int:
        """Set the ledger from the directory and evict down to the cap; the number of files evicted."""
        if self.ledger is None:
            return 0
        num_over = 0
        try:
            with self.ledger.update() as usage:
                self._rescan(usage)
                while usage.num_blocks > self._capacity_blocks and self._evict_one(usage) is not None:
                    num_over += 1
        except OSError as exc:
            self.disable(f"cannot use the usage ledger: {exc}")
        return num_over

    def _rescan(self, usage: Usage) -> None:
        """Re-list the directory (ledger locked): files this engine does not hold are adopted as its
        oldest, held keys whose files are gone (another engine evicted them) are forgotten unless
        pinned, and the count becomes the files present plus this engine's reservations (alone) or at
        least that (other engines' reservations are invisible here)."""
        present: dict[BlockKey, str] = {}
        for shard in _real_shards(self.directory):
            with contextlib.suppress(OSError):
                for entry in os.scandir(shard):
                    if FILE_NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                        present[BlockKey(bytes.fromhex(entry.name[:64]))] = entry.path
        gone = [k for k in self._held if k not in present and not self._pins[k]]
        for key in gone:
            del self._held[key]
            self.protection.forget(key)
        self._announce_removed(gone)
        unknown = [(_mtime_ns(path), key) for key, path in present.items() if key not in self._held]
        adopted = OrderedDict((key, None) for _, key in sorted(unknown) if key not in self._reserved)
        self._announce_stored(list(adopted))
        adopted.update(self._held)
        self._held = adopted
        counted = len(present) + len(self._reserved)
        alone = self.ledger is not None and self.ledger.alone()
        usage.num_blocks = counted if alone else max(usage.num_blocks, counted)

    def _log_scan(self, tally: _ScanTally, num_over: int) -> None:
        message = (
            f"disk tier: {len(self._held)} blocks ({len(self._held) * self.file_nbytes / 2**30:.2f} GiB of "
            f"{self._capacity_blocks * self.file_nbytes / 2**30:.2f}) in {self.directory}; removed "
            f"{tally.num_invalid} invalid, {tally.num_temp} unfinished and {num_over} over-capacity files"
        )
        if tally.num_links:
            message += f"; skipped {tally.num_links} symlinks (never followed)"
        if tally.num_invalid:
            details = ", ".join(f"{count} x {reason}" for reason, count in tally.reasons.most_common(3))
            message += f" ({details})"
        logger.log(logging.WARNING if tally.num_invalid or tally.num_links else logging.INFO, message)


@dataclass
class _ScanTally:
    # (mtime ns, key, KV group) of the valid files
    found: list[tuple[int, BlockKey, int]] = field(default_factory=list)
    num_invalid: int = 0
    num_temp: int = 0
    num_links: int = 0
    reasons: Counter[str] = field(default_factory=Counter)


def _real_shards(directory: str) -> list[str]:
    """The shard directories of ``directory`` that are real directories (symlinks skipped)."""
    try:
        return [
            e.path
            for e in os.scandir(directory)
            if _SHARD_NAME.match(e.name) and e.is_dir(follow_symlinks=False)
        ]
    except OSError:
        return []


def _mtime_ns(path: str) -> int:
    try:
        return os.stat(path, follow_symlinks=False).st_mtime_ns
    except OSError:
        return 0
