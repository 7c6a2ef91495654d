"""The disk tier's retention file: which keys clients asked kvtier to keep, until when, across restarts.

Retention (``kvtier/kv/retention.py``) lives in memory; the disk tier writes it down so that a restarted
engine (or another sharing the directory) honours what clients were promised::

    kv_disk_dir/.kvtier-retention     one line per retained key: "<64 hex digits> <until>\\n", until in
                                      wall-clock seconds (time.time), the latest expiry first

``save`` merges the file with the engine's own entries (the later expiry of each key wins, expired ones
are dropped), writes a temp file and renames it into place, under an exclusive flock of the directory's
usage ledger, so engines sharing the directory never lose each other's keys and a reader never sees a
torn file. The disk tier saves every ``SAVE_INTERVAL_S`` (``tick``) and when it closes; ``load`` reads
it at start-up. A line that does not parse is skipped; a file larger than ``MAX_BYTES`` is ignored.
What a forged file can do is bounded: keep some keys' blocks from eviction until their expiry, at most
a tier's retention cap of them (it never changes what a block holds: headers and MACs decide that).
Torch-free.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
from collections.abc import Mapping

from kvtier.tiers.base import BlockKey
from kvtier.tiers.block_format import open_regular

FILE_NAME = ".kvtier-retention"
SAVE_INTERVAL_S = 60.0
MAX_BYTES = 64 * 2**20  # ~800k keys
MAX_TTL_S = 24 * 3600.0 + 60.0  # an expiry further out than the longest TTL is not believed


def _parse(text: str, now: float) -> dict[BlockKey, float]:
    entries: dict[BlockKey, float] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2 or len(parts[0]) != 64:
            continue
        try:
            key, until = BlockKey(bytes.fromhex(parts[0])), float(parts[1])
        except ValueError:
            continue
        if math.isfinite(until) and now < until <= now + MAX_TTL_S:
            entries[key] = max(until, entries.get(key, until))
    return entries


def load(directory: str, now: float) -> dict[BlockKey, float]:
    """The unexpired entries of the directory's retention file (empty when there is none)."""
    path = os.path.join(directory, FILE_NAME)
    try:
        fd = open_regular(path, os.O_RDONLY)
    except (OSError, ValueError):
        return {}
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_size > MAX_BYTES:
            return {}
        raw = f.read(MAX_BYTES)
    return _parse(raw.decode("ascii", errors="replace"), now)


def save(directory: str, entries: Mapping[BlockKey, float], now: float) -> int:
    """Merge ``entries`` into the file (under the caller's lock on the directory); returns the keys
    written. Raises OSError when the directory cannot be written."""
    merged = load(directory, now)
    for key, until in entries.items():
        if until > now:
            merged[key] = max(until, merged.get(key, until))
    lines = "".join(
        f"{key.hex()} {until:.3f}\n" for key, until in sorted(merged.items(), key=lambda e: -e[1])
    )
    temp = os.path.join(directory, f"{FILE_NAME}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(lines)
        os.replace(temp, os.path.join(directory, FILE_NAME))
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return len(merged)
