"""The disk tier (L3): one file per block in a local directory, LRU-evicted, kept across restarts.

This module is the bookkeeping (``DiskTier``, called from the scheduler's thread only) and the block
file header (pure functions); it does not import torch. The bytes move on a background thread, and the
files are written and read by ``write_block_file`` / ``read_block_file`` in ``kvtier/transfer/disk_io.py``.

Directory layout (one engine per directory at a time)::

    kv_disk_dir/
      00/ 00a1...9f.kvb              one file per block, named by its key (64 hex digits), sharded
      01/ ...                        into 256 subdirectories by the key's first byte
      ab/ ab3c...e2.kvb.tmp.<pid>.<n>   a write in progress; renamed over the final name when complete

Block file layout (little endian; the header is one 4 KiB page, so the payload is page-aligned)::

    offset  size  field
         0     8  magic               b"KVTBLK\\r\\n"
         8     2  format version      u16 (FORMAT_VERSION)
        10     2  header size         u16 (HEADER_NBYTES)
        12     4  payload crc32       u32, zlib.crc32 of the payload
        16     8  payload size        u64, bytes
        24    32  key                 the block's sha256 hash (also the file name)
        56     1  ndim                u8, <= 8
        57     1  dtype length        u8, <= 16
        58     2  fingerprint length  u16, <= 360
        60     4  reserved            zero
        64    64  block shape         8 x u64, unused dims zero
       128    16  dtype               ascii ("float32", "bfloat16", "float16"), zero padded
       144   360  model fingerprint   utf-8, zero padded (a longer one is stored as "sha256:<hex>")
       504  3588  zero padding
      4092     4  header crc32        u32, zlib.crc32 of bytes [0, 4092)
      4096     -  payload             the block's raw bytes, C order, shape and dtype of the identity

A file is valid only if every field matches what the reader expects (magic, version, the key in its
name, the tier's identity, the payload size, the file size, both checksums). Anything else is a miss:
the file is removed and never loaded. Writes go to a temp file in the same directory and are renamed
into place, so a reader sees either a whole old file or a whole new one, never a torn block.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import struct
import zlib
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.tiers.base import BlockKey, KVTier, LoadSpec, Medium, StoreSpec, TierIdentity, TierStats

logger = logging.getLogger("kvtier.tiers.disk")

MAGIC = b"KVTBLK\r\n"
FORMAT_VERSION = 1
HEADER_NBYTES = 4096
FILE_SUFFIX = ".kvb"
TEMP_MARKER = ".kvb.tmp."
MAX_NDIM = 8
DTYPE_FIELD_NBYTES = 16
FINGERPRINT_FIELD_NBYTES = 360
_FIXED = struct.Struct("<8sHHIQ32sBBH4x8Q16s360s")  # bytes [0, 504)
_CRC_OFFSET = HEADER_NBYTES - 4
_FILE_NAME = re.compile(r"^[0-9a-f]{64}\.kvb$")
_SHARD_NAME = re.compile(r"^[0-9a-f]{2}$")


class CorruptBlockFile(ValueError):
    """A block file that must not be loaded: truncated, damaged, or written for another identity."""


@dataclass(frozen=True)
class BlockFileHeader:
    """The decoded fixed-size header of a block file."""

    key: BlockKey
    model_fingerprint: str
    dtype: str
    block_shape: tuple[int, ...]
    payload_nbytes: int
    payload_crc32: int


def _fingerprint_field(fingerprint: str) -> bytes:
    encoded = fingerprint.encode("utf-8")
    if len(encoded) > FINGERPRINT_FIELD_NBYTES:
        encoded = b"sha256:" + hashlib.sha256(encoded).hexdigest().encode("ascii")
    return encoded


def encode_header(key: BlockKey, identity: TierIdentity, payload_nbytes: int, checksum: int) -> bytes:
    """The ``HEADER_NBYTES`` header of a block file (layout in the module docstring)."""
    if len(key) != 32:
        raise ValueError(f"a block key is 32 bytes, got {len(key)}")
    shape = tuple(identity.block_shape)
    dtype = identity.dtype.encode("ascii")
    if len(shape) > MAX_NDIM or len(dtype) > DTYPE_FIELD_NBYTES:
        raise ValueError(f"identity does not fit the header: shape {shape}, dtype {identity.dtype!r}")
    fingerprint = _fingerprint_field(identity.model_fingerprint)
    dims = shape + (0,) * (MAX_NDIM - len(shape))
    lengths = (len(shape), len(dtype), len(fingerprint))
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_NBYTES,
        checksum,
        payload_nbytes,
        bytes(key),
        *lengths,
        *dims,
        dtype,
        fingerprint,
    )
    header = fixed + bytes(_CRC_OFFSET - len(fixed))
    return header + struct.pack("<I", zlib.crc32(header))


def decode_header(header: bytes | bytearray | memoryview) -> BlockFileHeader:
    """Parse and check a header's own integrity (magic, version, size, crc); raises CorruptBlockFile."""
    if len(header) < HEADER_NBYTES:
        raise CorruptBlockFile(f"truncated header ({len(header)} of {HEADER_NBYTES} bytes)")
    header = memoryview(header)[:HEADER_NBYTES]
    if bytes(header[:8]) != MAGIC:
        raise CorruptBlockFile("not a kvtier block file (bad magic)")
    (stored_crc,) = struct.unpack_from("<I", header, _CRC_OFFSET)
    if zlib.crc32(header[:_CRC_OFFSET]) != stored_crc:
        raise CorruptBlockFile("header checksum mismatch")
    fields = _FIXED.unpack_from(header)
    _, version, header_nbytes, payload_crc, payload_nbytes, key, ndim, dtype_len, fp_len = fields[:9]
    if version != FORMAT_VERSION or header_nbytes != HEADER_NBYTES:
        raise CorruptBlockFile(
            f"format version {version} (header {header_nbytes} B), expected {FORMAT_VERSION}"
        )
    dims, dtype, fingerprint = fields[9:17], fields[17], fields[18]
    if ndim > MAX_NDIM or dtype_len > DTYPE_FIELD_NBYTES or fp_len > FINGERPRINT_FIELD_NBYTES:
        raise CorruptBlockFile("header field lengths out of range")
    try:
        return BlockFileHeader(
            key=BlockKey(key),
            model_fingerprint=fingerprint[:fp_len].decode("utf-8"),
            dtype=dtype[:dtype_len].decode("ascii"),
            block_shape=tuple(dims[:ndim]),
            payload_nbytes=payload_nbytes,
            payload_crc32=payload_crc,
        )
    except UnicodeDecodeError as exc:
        raise CorruptBlockFile(f"undecodable header text: {exc}") from exc


def validate_header(
    raw: bytes | bytearray | memoryview, file_nbytes: int, key: BlockKey, identity: TierIdentity
) -> BlockFileHeader:
    """The header of a ``file_nbytes`` file that must hold block ``key`` of ``identity``; raises
    CorruptBlockFile on any mismatch (the payload checksum is left to the reader)."""
    header = decode_header(raw)
    if header.key != key:
        raise CorruptBlockFile("the header names another block")
    expected_fp = _fingerprint_field(identity.model_fingerprint).decode("utf-8")
    if header.model_fingerprint != expected_fp:
        raise CorruptBlockFile(f"written for another model ({header.model_fingerprint[:16]}...)")
    if header.dtype != identity.dtype:
        raise CorruptBlockFile(f"written as {header.dtype}, expected {identity.dtype}")
    if header.block_shape != tuple(identity.block_shape):
        raise CorruptBlockFile(f"block shape {header.block_shape}, expected {tuple(identity.block_shape)}")
    if header.payload_nbytes != identity.block_bytes:
        raise CorruptBlockFile(f"payload of {header.payload_nbytes} B, expected {identity.block_bytes}")
    if file_nbytes != HEADER_NBYTES + header.payload_nbytes:
        raise CorruptBlockFile(f"file of {file_nbytes} B, expected {HEADER_NBYTES + header.payload_nbytes}")
    return header


def _scan_file(path: str, key: BlockKey, identity: TierIdentity) -> os.stat_result:
    """Check a block file's header and size without reading the payload; raises CorruptBlockFile."""
    with open(path, "rb") as handle:
        raw = handle.read(HEADER_NBYTES)
        stat = os.fstat(handle.fileno())
    validate_header(raw, stat.st_size, key, identity)
    return stat


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class DiskTier(KVTier):
    """Bookkeeping of the disk tier: an LRU index of the block files in one directory.

    A key is in one of three states (pins are counted on held keys)::

        reserved   in _reserved: a write in flight     invisible to lookup, never evicted
        held       in _held (LRU order, oldest first)  lookup hits; its file is deleted on eviction
        pinned     held with pins > 0: a load in flight  never evicted

    How the coordinator drives it with a ``DiskIOWorker`` (addresses are file paths)::

        spec = tier.prepare_store(keys)   -> worker.submit_store(key, path, snapshot) for each accepted key
        result ok                          -> tier.complete_store([key], True)
        result not ok                      -> tier.complete_store([key], False); if fatal: tier.disable(error)
        spec = tier.prepare_load(keys)    -> worker.submit_load(key, path, out) for each key
        result not ok, not fatal           -> tier.invalidate(key, error), *then* tier.complete_load([key])
        result fatal                       -> tier.disable(error), then tier.complete_load([key]) (a no-op)

    Disabled (the directory cannot be created or written, or ``disable`` was called after a fatal I/O
    error): holds nothing, accepts nothing; files already on disk are left for the next run.
    """

    medium = Medium.DISK

    def __init__(
        self, directory: str | os.PathLike[str], capacity_bytes: int, identity: TierIdentity
    ) -> None:
        self.stats = TierStats()
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

    def complete_load(self, keys: Sequence[BlockKey]) -> None:
        """Unpin; keys still held (not invalidated meanwhile) become the most recently used."""
        for key in keys:
            if self._pins[key] > 1:
                self._pins[key] -= 1
            else:
                self._pins.pop(key, None)
            if key in self._held:
                self._held.move_to_end(key)
                self.stats.blocks_loaded += 1
                self.stats.bytes_loaded += self.identity.block_bytes

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

    def complete_store(self, keys: Sequence[BlockKey], ok: bool = True) -> None:
        """Publish (``ok``) or release the reservations of ``keys``; unknown keys are ignored."""
        for key in keys:
            if key not in self._reserved:
                continue
            self._reserved.discard(key)
            if ok:
                self._held[key] = None
                self.stats.blocks_stored += 1
                self.stats.bytes_stored += self.identity.block_bytes

    def _evict_one(self) -> BlockKey | None:
        """Drop the least recently used unpinned held block and delete its file."""
        for key in self._held:
            if not self._pins[key]:
                del self._held[key]
                _remove(self.path_of(key))
                self.stats.blocks_evicted += 1
                return key
        return None

    # ------------------------------------------------------------------------ failures
    def invalidate(self, key: BlockKey, reason: str) -> None:
        """A load found block ``key``'s file unusable: forget it and remove the file (logged once)."""
        self.stats.load_failures += 1
        if not self._logged_invalid:
            self._logged_invalid = True
            logger.warning(
                "disk tier: block file %s is unusable (%s); removed and treated as a miss "
                "(later ones are only counted in stats.load_failures)",
                self.path_of(key),
                reason,
            )
        self._held.pop(key, None)
        self._pins.pop(key, None)
        if not self.disabled:
            _remove(self.path_of(key))

    def disable(self, reason: str) -> None:
        """Stop using the disk (logged once): forget every block, keep the files for the next run."""
        if self.disabled:
            return
        self.disabled = True
        self.disabled_reason = reason
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
                if not _FILE_NAME.match(entry.name):
                    continue
                key = BlockKey(bytes.fromhex(entry.name[:64]))
                try:
                    stat = _scan_file(entry.path, key, self.identity)
                except (CorruptBlockFile, OSError) as exc:
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
        self.stats.blocks_evicted = 0  # startup trimming is not eviction under load
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
