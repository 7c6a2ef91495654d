"""The one format of a stored block, and the block files written in it (torch-free).

Every tier whose bytes live outside the process (disk today) stores a block as one value: a fixed-size
header that says what the bytes mean, followed by the payload, the block's raw bytes. Readers check
every header field against what they expect, so a block written for another model, KV dtype or block
shape is never loaded, and both checksums, so a damaged one is a miss.

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
        60     4  flags               u32: bit 0 set = the MAC field holds a MAC (others zero)
        64    64  block shape         8 x u64, unused dims zero
       128    16  dtype               ascii ("float32", "bfloat16", "float16"), zero padded
       144   360  model fingerprint   utf-8, zero padded (a longer one is stored as "sha256:<hex>")
       504    32  MAC                 HMAC-SHA256(secret, bytes [0, 504) + bytes [536, 540) + payload),
                                      or zero
       536     4  KV group            u32 (version 2): the group whose block this is (kvtier/kv/groups.py)
       540  3552  zero padding
      4092     4  header crc32        u32, zlib.crc32 of bytes [0, 4092)
      4096     -  payload             the block's raw bytes, C order, shape and dtype of the identity

A block is valid only if every field matches what the reader expects (magic, version, the key it was
asked for, the KV group it is loaded for, the tier's identity, the payload size, the stored size, both
checksums). Anything else is a miss: the block is removed and never loaded.

**The KV group** (version 2). A hybrid model keeps several groups of layers, each with blocks of its own
keyed ``group_key(h, g)`` (``kvtier/kv/hashing.py``): group ``g``'s block holds only that group's layers.
The writer records ``g``; a reader loading the key for group ``h != g`` gets a ``CorruptBlock`` (a miss,
removed and counted like any damaged block), so a block is never loaded into another group's layers
even if a key were ever reused. A dense model's blocks are group 0.

Versions: 2 (written now) adds the group; a version-1 header (written before the groups existed, its
bytes [536, 540) zero padding) is still read, as group 0, with its MAC over bytes [0, 504) + payload.
Group 0 is what a dense model's version-1 blocks are, so a disk or remote store of such blocks stays
warm across the upgrade; a version-1 block of a sliding group (an earlier hybrid run) reads as group 0
and is a miss when loaded for its own group. Any other version is a miss.

Checksums catch damage, not forgery: anyone who can write the directory (or the store) can write a
consistent header. With a secret (``kv_remote_secret``), writers add a MAC over the header fields and
the payload and readers refuse a block whose MAC is missing or does not verify, so only a holder of
the secret can produce a block that loads. Writes go to a temp file in the same directory and are renamed
into place, so a reader sees either a whole old file or a whole new one, never a torn block. Files are
created 0600 and missing directories 0700 (whatever the umask), and no read or write follows a symlink
(a symlinked block file or directory fails with ELOOP). Nothing but a regular file is ever read or
written: every open adds ``O_NONBLOCK`` (a FIFO or device planted at a block's path opens at once
instead of blocking the I/O thread for good) and checks ``fstat`` before the first byte
(``open_regular``): anything else is a ``CorruptBlock``, a miss.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import itertools
import os
import re
import stat
import struct
import zlib
from dataclasses import dataclass

from kvtier.tiers.base import BlockKey, TierIdentity

ByteBuffer = bytes | bytearray | memoryview

MAGIC = b"KVTBLK\r\n"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1: no KV group field (read as group 0)
HEADER_NBYTES = 4096
FILE_SUFFIX = ".kvb"
TEMP_MARKER = ".kvb.tmp."
MAX_NDIM = 8
DTYPE_FIELD_NBYTES = 16
FINGERPRINT_FIELD_NBYTES = 360
_FIXED = struct.Struct("<8sHHIQ32sBBHI8Q16s360s")  # bytes [0, 504): what a MAC signs (+ the group)
MAC_NBYTES = 32
FLAG_MAC = 1
_GROUP = struct.Struct("<I")  # the KV group, right after the MAC (version 2)
_GROUP_OFFSET = _FIXED.size + MAC_NBYTES
_CRC_OFFSET = HEADER_NBYTES - 4
FILE_NAME = re.compile(r"^[0-9a-f]{64}\.kvb$")


class CorruptBlock(ValueError):
    """A stored block that must not be loaded: truncated, damaged, or written for another identity."""


@dataclass(frozen=True)
class BlockFileHeader:
    """The decoded fixed-size header of a block file."""

    key: BlockKey
    model_fingerprint: str
    dtype: str
    block_shape: tuple[int, ...]
    payload_nbytes: int
    payload_crc32: int
    mac: bytes | None = None  # the stored MAC, if the writer had a secret
    signed: bytes = b""  # the header bytes the MAC covers (with the payload)
    group: int = 0  # the KV group of the block (a version-1 header: 0)


def _fingerprint_field(fingerprint: str) -> bytes:
    encoded = fingerprint.encode("utf-8")
    if len(encoded) > FINGERPRINT_FIELD_NBYTES:
        encoded = b"sha256:" + hashlib.sha256(encoded).hexdigest().encode("ascii")
    return encoded


def encode_header(
    key: BlockKey,
    identity: TierIdentity,
    payload_nbytes: int,
    checksum: int,
    mac: bytes | None = None,
    group: int = 0,
) -> bytes:
    """The ``HEADER_NBYTES`` header of KV group ``group``'s block (layout in the module docstring)."""
    flags = FLAG_MAC if mac is not None else 0
    signed = _signed_fields(key, identity, payload_nbytes, checksum, flags, group)
    if mac is not None and len(mac) != MAC_NBYTES:
        raise ValueError(f"a MAC is {MAC_NBYTES} bytes, got {len(mac)}")
    header = signed[: _FIXED.size] + (mac or bytes(MAC_NBYTES)) + signed[_FIXED.size :]
    header += bytes(_CRC_OFFSET - len(header))
    return header + struct.pack("<I", zlib.crc32(header))


def _mac(secret: bytes, signed: bytes | memoryview, payload: memoryview) -> bytes:
    digest = hmac.new(secret, signed, hashlib.sha256)
    digest.update(payload)
    return digest.digest()


def block_header(
    key: BlockKey, identity: TierIdentity, payload: memoryview, secret: bytes | None, group: int = 0
) -> bytes:
    """The header for ``payload`` (KV group ``group``'s block): its checksum, and a MAC when there is a
    secret."""
    checksum = zlib.crc32(payload)
    if secret is None:
        return encode_header(key, identity, payload.nbytes, checksum, group=group)
    signed = _signed_fields(key, identity, payload.nbytes, checksum, FLAG_MAC, group)
    return encode_header(key, identity, payload.nbytes, checksum, _mac(secret, signed, payload), group)


def _signed_fields(
    key: BlockKey, identity: TierIdentity, payload_nbytes: int, checksum: int, flags: int, group: int
) -> bytes:
    """The header bytes a MAC covers: bytes [0, 504), then the KV group field."""
    if len(key) != 32:
        raise ValueError(f"a block key is 32 bytes, got {len(key)}")
    if not 0 <= group < 2**32:
        raise ValueError(f"a KV group is a u32, got {group}")
    shape = tuple(identity.block_shape)
    dtype = identity.dtype.encode("ascii")
    if len(shape) > MAX_NDIM or len(dtype) > DTYPE_FIELD_NBYTES:
        raise ValueError(f"identity does not fit the header: shape {shape}, dtype {identity.dtype!r}")
    fingerprint = _fingerprint_field(identity.model_fingerprint)
    dims = shape + (0,) * (MAX_NDIM - len(shape))
    lengths = (len(shape), len(dtype), len(fingerprint))
    return _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_NBYTES,
        checksum,
        payload_nbytes,
        bytes(key),
        *lengths,
        flags,
        *dims,
        dtype,
        fingerprint,
    ) + _GROUP.pack(group)


def decode_header(header: bytes | bytearray | memoryview) -> BlockFileHeader:
    """Parse and check a header's own integrity (magic, version, size, crc); raises CorruptBlock."""
    if len(header) < HEADER_NBYTES:
        raise CorruptBlock(f"truncated header ({len(header)} of {HEADER_NBYTES} bytes)")
    header = memoryview(header)[:HEADER_NBYTES]
    if bytes(header[:8]) != MAGIC:
        raise CorruptBlock("not a kvtier block file (bad magic)")
    (stored_crc,) = struct.unpack_from("<I", header, _CRC_OFFSET)
    if zlib.crc32(header[:_CRC_OFFSET]) != stored_crc:
        raise CorruptBlock("header checksum mismatch")
    fields = _FIXED.unpack_from(header)
    _, version, header_nbytes, payload_crc, payload_nbytes, key, ndim, dtype_len, fp_len = fields[:9]
    if version not in READABLE_VERSIONS or header_nbytes != HEADER_NBYTES:
        raise CorruptBlock(f"format version {version} (header {header_nbytes} B), expected {FORMAT_VERSION}")
    flags, dims, dtype, fingerprint = fields[9], fields[10:18], fields[18], fields[19]
    if ndim > MAX_NDIM or dtype_len > DTYPE_FIELD_NBYTES or fp_len > FINGERPRINT_FIELD_NBYTES:
        raise CorruptBlock("header field lengths out of range")
    if flags & ~FLAG_MAC:
        raise CorruptBlock(f"unknown header flags {flags:#x}")
    group_field = b"" if version == 1 else bytes(header[_GROUP_OFFSET : _GROUP_OFFSET + _GROUP.size])
    try:
        return BlockFileHeader(
            key=BlockKey(key),
            model_fingerprint=fingerprint[:fp_len].decode("utf-8"),
            dtype=dtype[:dtype_len].decode("ascii"),
            block_shape=tuple(dims[:ndim]),
            payload_nbytes=payload_nbytes,
            payload_crc32=payload_crc,
            mac=bytes(header[_FIXED.size : _GROUP_OFFSET]) if flags & FLAG_MAC else None,
            signed=bytes(header[: _FIXED.size]) + group_field,
            group=_GROUP.unpack(group_field)[0] if group_field else 0,
        )
    except UnicodeDecodeError as exc:
        raise CorruptBlock(f"undecodable header text: {exc}") from exc


def check_payload(header: BlockFileHeader, payload: memoryview, secret: bytes | None) -> None:
    """Raise CorruptBlock unless ``payload`` matches the header's checksum and, with a secret, its MAC."""
    if zlib.crc32(payload) != header.payload_crc32:
        raise CorruptBlock("payload checksum mismatch")
    if secret is None:
        return
    if header.mac is None:
        raise CorruptBlock("unsigned block (a secret is configured)")
    if not hmac.compare_digest(header.mac, _mac(secret, header.signed, payload)):
        raise CorruptBlock("bad MAC (not written with this secret, or edited)")


def validate_header(
    raw: bytes | bytearray | memoryview,
    file_nbytes: int,
    key: BlockKey,
    identity: TierIdentity,
    group: int | None = 0,
) -> BlockFileHeader:
    """The header of a ``file_nbytes`` file that must hold block ``key`` of ``identity``, of KV group
    ``group`` (None: any group, the caller reads ``header.group``); raises CorruptBlock on any mismatch
    (the payload checksum is left to the reader)."""
    header = decode_header(raw)
    if header.key != key:
        raise CorruptBlock("the header names another block")
    if group is not None and header.group != group:
        raise CorruptBlock(f"a block of KV group {header.group}, loaded for group {group}")
    expected_fp = _fingerprint_field(identity.model_fingerprint).decode("utf-8")
    if header.model_fingerprint != expected_fp:
        raise CorruptBlock(f"written for another model ({header.model_fingerprint[:16]}...)")
    if header.dtype != identity.dtype:
        raise CorruptBlock(f"written as {header.dtype}, expected {identity.dtype}")
    if header.block_shape != tuple(identity.block_shape):
        raise CorruptBlock(f"block shape {header.block_shape}, expected {tuple(identity.block_shape)}")
    if header.payload_nbytes != identity.block_bytes:
        raise CorruptBlock(f"payload of {header.payload_nbytes} B, expected {identity.block_bytes}")
    if file_nbytes != HEADER_NBYTES + header.payload_nbytes:
        raise CorruptBlock(f"file of {file_nbytes} B, expected {HEADER_NBYTES + header.payload_nbytes}")
    return header


def open_regular(path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
    """``os.open`` with ``O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC`` added, then ``fstat``: a descriptor of a
    regular file (back in blocking mode), or CorruptBlock for anything else (a FIFO, a device, a
    socket, a directory: closed unread). A symlink is refused (OSError ELOOP), not followed."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        st_mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(st_mode):
            raise CorruptBlock(f"not a regular file (mode {stat.filemode(st_mode)})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_block_file(path: str, key: BlockKey, identity: TierIdentity) -> tuple[os.stat_result, int]:
    """Check a block file's header and size without reading the payload; its stat and the KV group its
    header names. Raises CorruptBlock (also for anything but a regular file). A symlink is refused
    (OSError ELOOP), not followed."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        raw = bytearray(HEADER_NBYTES)
        got = _read_exactly(fd, memoryview(raw))
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return st, validate_header(memoryview(raw)[:got], st.st_size, key, identity, None).group


_temp_ids = itertools.count()
_TEMP_TOKEN = os.urandom(4).hex()  # with the pid: no two live writers share a temp name
_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_MODE = 0o600
DIR_MODE = 0o700


class BlockExists(FileExistsError):
    """An exclusive write found the block file already there (another writer published it first)."""


def _check_size(buffer: memoryview, identity: TierIdentity, what: str) -> None:
    if buffer.nbytes != identity.block_bytes or not buffer.contiguous:
        raise ValueError(f"{what} is {buffer.nbytes} B, expected {identity.block_bytes} contiguous bytes")


def _open_parent(path: str) -> int:
    """A descriptor of ``path``'s directory, created (``DIR_MODE``) if missing; never a symlink's."""
    parent = os.path.dirname(path) or "."
    try:
        return os.open(parent, _NOFOLLOW_DIR)
    except FileNotFoundError:
        os.makedirs(parent, mode=DIR_MODE, exist_ok=True)
        return os.open(parent, _NOFOLLOW_DIR)


def _write_all(fd: int, chunks: tuple[bytes | memoryview, ...]) -> None:
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view.nbytes:
            view = view[os.write(fd, view) :]


def _publish(dir_fd: int, temp: str, name: str, exclusive: bool) -> None:
    """Rename the finished temp file over ``name``; ``exclusive``: link it in only if ``name`` is not
    there yet (raising BlockExists otherwise), so a writer learns whether it created the file."""
    if not exclusive:
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return
    try:
        os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError as exc:
        raise BlockExists(errno.EEXIST, "block file already exists", name) from exc
    except OSError as exc:  # a filesystem without hard links: no way to know, replace
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return
    os.unlink(temp, dir_fd=dir_fd)


def write_block_file(
    path: str | os.PathLike[str],
    key: BlockKey,
    identity: TierIdentity,
    data: ByteBuffer,
    secret: bytes | None = None,
    *,
    exclusive: bool = False,
    group: int = 0,
) -> int:
    """Write ``data`` (the block's raw bytes) as KV group ``group``'s block ``key`` of ``identity``;
    returns the file size.

    Atomic: the bytes go to ``<path>.tmp.<pid>.<token>.<n>`` in the same directory (created ``DIR_MODE``
    if missing), mode ``FILE_MODE`` whatever the umask, which is renamed over ``path`` once complete
    (``exclusive``: linked to ``path`` only if it does not exist, else BlockExists). A symlinked
    directory or temp name is refused (ELOOP), never followed. On any error the temp file is removed and
    the error re-raised. Not fsynced: a crash can lose recent files or leave a damaged one, which the
    checksums turn into a miss.
    """
    payload = memoryview(data).cast("B")
    _check_size(payload, identity, "data")
    header = block_header(key, identity, payload, secret, group)
    path = os.fspath(path)
    name = os.path.basename(path)
    temp = f"{name}.tmp.{os.getpid()}.{_TEMP_TOKEN}.{next(_temp_ids)}"
    dir_fd = _open_parent(path)
    try:
        fd = open_regular(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE, dir_fd=dir_fd)
        try:
            os.fchmod(fd, FILE_MODE)  # the umask may have taken bits away
            _write_all(fd, (header, payload))
        finally:
            os.close(fd)
        _publish(dir_fd, temp, name, exclusive)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise
    finally:
        os.close(dir_fd)
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


def _open_nofollow(path: str) -> int:
    """Open a block file for reading; a symlinked file or directory is refused (ELOOP), not followed,
    and anything but a regular file is a CorruptBlock (``open_regular``)."""
    dir_fd = os.open(os.path.dirname(path) or ".", _NOFOLLOW_DIR)
    try:
        return open_regular(os.path.basename(path), os.O_RDONLY, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def read_block_file(
    path: str | os.PathLike[str],
    key: BlockKey,
    identity: TierIdentity,
    out: ByteBuffer,
    secret: bytes | None = None,
    *,
    group: int = 0,
) -> None:
    """Read and fully validate KV group ``group``'s block ``key`` into ``out`` (a writable buffer of the
    block's size).

    Raises CorruptBlock if anything does not match (another group's block included) or the path is not
    a regular file (then ``out``
    holds garbage and must not be used), OSError (e.g. FileNotFoundError; ELOOP for a symlinked file
    or directory, never followed) if the file cannot be read, ValueError if ``out`` is unsuitable.
    """
    payload = memoryview(out).cast("B")
    _check_size(payload, identity, "out")
    fd = _open_nofollow(os.fspath(path))
    try:
        raw = bytearray(HEADER_NBYTES)
        got = _read_exactly(fd, memoryview(raw))
        header = validate_header(memoryview(raw)[:got], os.fstat(fd).st_size, key, identity, group)
        if _read_exactly(fd, payload) != payload.nbytes:
            raise CorruptBlock("truncated payload")
    finally:
        os.close(fd)
    check_payload(header, payload, secret)


def encode_block_value(
    key: BlockKey, identity: TierIdentity, data: ByteBuffer, secret: bytes | None, group: int = 0
) -> bytes:
    """One stored value holding KV group ``group``'s block ``key``: header then payload (for stores
    keyed by name)."""
    payload = memoryview(data).cast("B")
    _check_size(payload, identity, "data")
    return block_header(key, identity, payload, secret, group) + payload


def decode_block_value(
    value: ByteBuffer,
    key: BlockKey,
    identity: TierIdentity,
    out: ByteBuffer,
    secret: bytes | None,
    group: int = 0,
) -> None:
    """Check a stored value of KV group ``group``'s block ``key`` and copy its payload into ``out``;
    raises CorruptBlock."""
    raw = memoryview(value).cast("B")
    dst = memoryview(out).cast("B")
    _check_size(dst, identity, "out")
    header = validate_header(raw[:HEADER_NBYTES], raw.nbytes, key, identity, group)
    payload = raw[HEADER_NBYTES:]
    check_payload(header, payload, secret)
    dst[:] = payload
