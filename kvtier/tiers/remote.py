"""The remote tier (L4): KV blocks in a Redis or Valkey server shared by every replica of a model.

Three pieces, torch-free like the disk tier:

* :class:`RemoteStore` (``tiers/remote_store.py``): the connection (two bounded pools with timeouts:
  one for the scheduler's lookups, one for the I/O worker), the circuit breaker and the error counts,
  shared by
* :class:`RemoteTier`: the bookkeeping, on the scheduler's thread (what the coordinator calls), and
* :class:`RedisBlockIO`: the block reads and writes, on the tier's ``BlockIOWorker`` thread, pipelined:
  a batch of queued loads is one round trip of bounded reads (``GETRANGE`` of at most a block's size
  plus one byte, and ``EXPIRE``) whose replies land straight in the host blocks (``tiers/redis_bulk.py``:
  no parser copies; at most ``READ_BATCH_BYTES`` per round trip, a longer batch is split); a batch of
  stores is one ``EXISTS`` round trip (blocks already there are not sent again, their expiry is
  refreshed) and one of ``SET ... EX``.

Keys and values::

    kvtier:v1:<64 hex digits>     the block's chained sha256 hash (kv/hashing.py), which is rooted in
                                  the model fingerprint, the KV dtype and the request's cache salt
    value                         one block in the format of tiers/block_format.py: a 4 KiB header
                                  (version, model fingerprint, dtype, shape, key, KV group, crc32s,
                                  optional HMAC-SHA256) then the payload, written with one SET: never
                                  half a value; read for another KV group than its header's, a miss

Every value is written with ``EX kv_remote_ttl_s`` (0: no expiry), and a hit refreshes it (``EXPIRE``),
to a retained block's remaining retention when longer (kvtier/kv/retention.py: never shortened), so
``volatile-lru``/``allkeys-lru`` eviction reclaims cold blocks. The tier cannot see what the store
evicts: ``contains`` is a local, bounded set of keys known to be there, and a load that finds nothing
is a counted miss (``missing``). A value that is truncated, corrupt, written for another model, dtype or
shape, or whose MAC does not verify is never loaded: a miss, counted by kind, and deleted if the store
still holds that same value (a compare-and-delete script on the header and the size). A value longer
than a block (header and payload) is never read whole, whoever wrote it: only its first block's worth
of bytes arrives, it counts as ``foreign`` and is deleted if still that long with that header. So a
writer without the secret can make loads miss (a slowdown), but cannot make a replica allocate more
than ``READ_BATCH_BYTES`` per read round trip.

Faults never fail a request: a refused, reset or timed-out command opens the breaker (one warning line);
while open, lookups return 0 and stores are dropped, and a probe reconnects with backoff (one line when
the store answers). The keys known to be there are forgotten at each outage (a store may restart empty).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.kv.lower import KeyGroups
from kvtier.kv.retention import Retention
from kvtier.stats import Medium, TierCounters, TierSnapshot
from kvtier.tiers.base import BlockKey, ExternalTier, LoadSpec, StoreSpec, TierIdentity
from kvtier.tiers.block_format import (
    HEADER_NBYTES,
    ByteBuffer,
    CorruptBlock,
    check_payload,
    decode_block_value,
    encode_block_value,
    validate_header,
)
from kvtier.tiers.redis_bulk import BulkResult, Oversized
from kvtier.tiers.remote_store import (
    ANY_SIZE,
    RemoteMiss,
    RemoteStore,
    StoreUnavailable,
    corrupt_kind,
    redis_key,
)

logger = logging.getLogger("kvtier.tiers.remote")

READ_BATCH_BYTES = 64 << 20
"""The most bytes one read round trip may ask for: a batch of larger blocks is split (one block at
least per round trip). Every value is read bounded (``GETRANGE``), so this caps the replies in flight."""


class RedisBlockIO:
    """The remote tier's reads and writes, run by a ``BlockIOWorker`` (addresses are store key names).

    Both paths are batched (the worker hands over each run of queued jobs of one kind): one pipeline per
    batch. A failed read is a miss for that block; nothing is fatal (an outage is the breaker's job)."""

    def __init__(
        self,
        store: RemoteStore,
        identity: TierIdentity,
        secret: bytes | None = None,
        retention: Retention | None = None,
    ) -> None:
        self.store = store
        self.identity = identity
        self.secret = secret
        self.retention = retention  # a retained block's value lives at least as long as its retention
        self._heads: list[memoryview] = []  # scratch block headers (the worker's thread only)

    def read(self, key: BlockKey, address: object, out: ByteBuffer, group: int = 0) -> None:
        (error,) = self.read_batch([(key, address, out)], [group])
        if error is not None:
            raise error

    def write(self, key: BlockKey, address: object, data: ByteBuffer, group: int = 0) -> None:
        (error,) = self.write_batch([(key, address, data)], [group])
        if error is not None:
            raise error

    @staticmethod
    def is_fatal(exc: BaseException) -> bool:
        return False

    def _execute(self, commands: list[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        """One pipelined round trip; per-command errors come back in place."""
        pipe = self.store.io.pipeline(transaction=False)
        for name, args, kwargs in commands:
            getattr(pipe, name)(*args, **kwargs)
        return pipe.execute(raise_on_error=False)

    def read_batch(
        self, jobs: list[tuple[BlockKey, object, ByteBuffer]], groups: KeyGroups = ()
    ) -> list[BaseException | None]:
        """Read every block of ``jobs`` (of KV ``groups``, parallel; () = all group 0), each payload
        received straight into its ``out`` and validated there, in round trips of at most
        ``READ_BATCH_BYTES`` (``BulkReader.get_many``: bounded reads that refresh the expiry)."""
        per_round_trip = max(1, READ_BATCH_BYTES // (HEADER_NBYTES + self.identity.block_bytes))
        groups = groups or [0] * len(jobs)
        errors: list[BaseException | None] = []
        for start in range(0, len(jobs), per_round_trip):
            end = start + per_round_trip
            errors += self._read_round_trip(jobs[start:end], groups[start:end])
        return errors

    def _read_round_trip(
        self, jobs: list[tuple[BlockKey, object, ByteBuffer]], groups: KeyGroups
    ) -> list[BaseException | None]:
        store = self.store
        if not store.breaker.allow():
            return [StoreUnavailable("the remote store is not answering")] * len(jobs)
        while len(self._heads) < len(jobs):
            self._heads.append(memoryview(bytearray(HEADER_NBYTES)))
        outs = [memoryview(out).cast("B") for _, _, out in jobs]
        names, ttls = [address for _, address, _ in jobs], [self._ttl(key) for key, _, _ in jobs]
        longer = any(ttl != store.ttl_s for ttl in ttls)  # a retained value's expiry is never shortened:
        try:  # read with EXISTS then, and EXPIRE each to its own TTL (one more round trip)
            values = store.bulk.get_many(names, 0 if longer else store.ttl_s, self._heads[: len(jobs)], outs)  # type: ignore[arg-type]
            if longer:
                self._execute([("expire", (name, ttl), {}) for name, ttl in zip(names, ttls, strict=True)])
        except Exception as exc:  # noqa: BLE001 (the store went away: every read is a miss)
            store.failed(exc)
            return [exc] * len(jobs)
        return [
            self._check(job, value, head, group)
            for job, value, head, group in zip(jobs, values, self._heads, groups, strict=False)
        ]

    def _check(
        self, job: tuple[BlockKey, object, ByteBuffer], value: BulkResult, head: memoryview, group: int
    ) -> BaseException | None:
        """Validate one reply (of KV group ``group``'s block): a value of the expected size already sits
        in ``head`` and ``out``."""
        key, address, out = job
        if isinstance(value, Exception):
            self.store.failed(value)
            return value
        if value is None:
            self.store.count("missing")
            return RemoteMiss("missing", "gone between lookup and load (evicted, expired or flushed)")
        if isinstance(value, Oversized):  # not ours, whatever its header says: never read whole
            self.store.count("foreign")
            self.store.delete_if_same(address, head, (int(value), ANY_SIZE[1]))  # type: ignore[arg-type]
            return RemoteMiss("foreign", f"a value over {int(value) - 1} B (header and block): not read")
        try:
            if isinstance(value, int):
                header = validate_header(head, value, key, self.identity, group)
                check_payload(header, memoryview(out).cast("B"), self.secret)
            else:
                decode_block_value(value, key, self.identity, out, self.secret, group)
        except CorruptBlock as exc:
            kind = corrupt_kind(exc)
            self.store.count(kind)
            size = value if isinstance(value, int) else len(value)
            self.store.delete_if_same(address, head if isinstance(value, int) else value, (size, size))  # type: ignore[arg-type]
            return RemoteMiss(kind, str(exc))
        return None

    def _ttl(self, key: BlockKey) -> int:
        """A value's expiry, written or refreshed: ``kv_remote_ttl_s``, never below its retention."""
        ttl_s = self.store.ttl_s
        return ttl_s if self.retention is None else self.retention.ttl_at_least(key, ttl_s)

    def write_batch(
        self, jobs: list[tuple[BlockKey, object, ByteBuffer]], groups: KeyGroups = ()
    ) -> list[BaseException | None]:
        """Send the blocks of ``jobs`` (of KV ``groups``, parallel; () = all group 0) the store lacks (one
        ``EXISTS`` round trip first), each as one ``SET name value EX ttl``; the expiry of those already
        there is refreshed instead."""
        store = self.store
        if not store.breaker.allow():
            return [StoreUnavailable("the remote store is not answering: store dropped")] * len(jobs)
        try:
            present = self._execute([("exists", (address,), {}) for _, address, _ in jobs])
            commands = []
            groups = groups or [0] * len(jobs)
            for (key, address, data), there, group in zip(jobs, present, groups, strict=True):
                ttl = self._ttl(key)
                if there is True or there == 1:
                    if ttl:
                        commands.append(("expire", (address, ttl), {}))
                    continue
                value = encode_block_value(key, self.identity, data, self.secret, group)
                commands.append(("set", (address, value), {"ex": ttl or None}))
            replies = self._execute(commands) if commands else []
        except Exception as exc:  # noqa: BLE001 (the store went away: the stores are dropped)
            store.failed(exc)
            return [exc] * len(jobs)
        errors = [r for r in replies if isinstance(r, Exception)]
        for error in errors[:1]:
            store.failed(error)  # e.g. OOM under maxmemory with noeviction: rejected
        if errors:
            return [errors[0]] * len(jobs)
        return [None] * len(jobs)


class RemoteTier(ExternalTier):
    """Bookkeeping of the remote tier: the keys known to be in the store, pins, reservations.

    ::

        known      in _known (bounded, oldest first)    contains() is True; the store may have evicted it
        reserved   in _reserved: a write in flight       invisible to lookup
        pinned     a load in flight (_pins)

    ``lookup`` walks the known keys, then asks the store about the next ``lookup_limit`` keys in one
    pipelined ``EXISTS`` round trip (bounded by the lookup timeout; skipped while the breaker is open),
    and remembers what it found. ``capacity_blocks`` is 0: the store's size is the store's business.
    """

    medium = Medium.REMOTE

    def __init__(
        self,
        store: RemoteStore,
        identity: TierIdentity,
        *,
        max_known_blocks: int = 1 << 20,
        lookup_limit: int = 256,
    ) -> None:
        self.counters = TierCounters()
        self.store = store
        self.identity = identity
        self.max_known_blocks = max_known_blocks
        self.lookup_limit = lookup_limit
        self._known: OrderedDict[BlockKey, None] = OrderedDict()
        self._reserved: set[BlockKey] = set()
        self._pins: Counter[BlockKey] = Counter()
        self._key_groups: dict[BlockKey, int] = {}
        self._generation = store.generation
        self.disabled = False
        self.disabled_reason: str | None = None
        if store.rejected_reason is not None:
            self.disable(store.rejected_reason)

    # ------------------------------------------------------------------------ occupancy
    @property
    def capacity_blocks(self) -> int:
        return 0

    @property
    def num_used_blocks(self) -> int:
        return len(self._known) + len(self._reserved)

    def contains(self, key: BlockKey, group: int = 0) -> bool:
        self._forget_after_outage()
        return key in self._known

    def _forget_after_outage(self) -> None:
        """After an outage the store may have restarted empty: forget the keys known to be there."""
        if self._generation == self.store.generation:
            return
        self._generation = self.store.generation
        forgotten = [k for k in self._known if not self._pins[k]]
        for key in forgotten:
            del self._known[key]
        self._announce_removed(forgotten)

    @property
    def available(self) -> bool:
        """Enabled and the store answering (a read of the breaker's state: no network)."""
        self._forget_after_outage()
        return not self.disabled and self.store.breaker.allow()

    @property
    def generation(self) -> int:
        """Bumped at each outage or restart seen (the coordinator then writes its host blocks again)."""
        self._forget_after_outage()
        return self._generation

    @property
    def accepting(self) -> bool:
        return self.available

    def check_store(self) -> None:
        self.store.check_instance(every_s=0.0)  # the caller keeps the pace

    def lookup(self, keys: Sequence[BlockKey], group: int = 0) -> int:
        """Leading ``keys`` known or found in the store; a key found is taken as KV group ``group``'s
        (its reader checks the header)."""
        self.store.check_instance()
        if not self.available:
            return 0
        n = 0
        while n < len(keys) and keys[n] in self._known:
            n += 1
        rest = keys[n : n + self.lookup_limit]
        found = self.store.count_leading([redis_key(k) for k in rest])
        if self._generation != self.store.generation:
            self._forget_after_outage()  # the store failed during this lookup: the n known keys may be gone
            return 0
        new = [k for k in rest[:found] if k not in self._known]
        self._note_groups(new, [group] * len(new))
        self._announce_stored(new)
        for key in rest[:found]:
            self._remember(key)
        return n + found

    def presence(self) -> Callable[[Sequence[BlockKey]], int | None]:
        """A count of how many of ``keys`` (KV group 0's names) the store holds now, callable from any
        thread (``RemoteStore.count_present``; None: no answer): ``/v1/kv/publish`` polls with it
        without waiting for the engine's steps."""
        store = self.store
        return lambda keys: store.count_present([redis_key(k) for k in keys])

    def held_keys(self) -> list[BlockKey]:
        """The keys known to be in the store (announced as KV events), oldest first."""
        self.store.check_instance()
        self._forget_after_outage()
        return list(self._known)

    def _remember(self, key: BlockKey) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        while len(self._known) > self.max_known_blocks:
            oldest = next(iter(self._known))
            if self._pins[oldest]:
                break
            del self._known[oldest]  # only forgotten here: a lookup asks the store again
            self._announce_removed([oldest])

    # ------------------------------------------------------------------------ loads
    def prepare_load(self, keys: Sequence[BlockKey]) -> LoadSpec:
        for key in keys:
            if key not in self._known:
                raise KeyError(f"remote tier: load of a key not known to be there ({key.hex()[:12]})")
        self._pins.update(keys)
        return LoadSpec(tuple(keys), tuple(redis_key(key) for key in keys))

    def complete_load(self, keys: Sequence[BlockKey], seconds: float = 0.0) -> None:
        self._finish_loads(keys, self._known, self._pins, seconds)

    # ------------------------------------------------------------------------ stores
    def prepare_store(self, keys: Sequence[BlockKey], groups: KeyGroups = ()) -> StoreSpec:
        """Reserve the keys not known to be there; nothing while the store is not answering."""
        if not self.available:
            return StoreSpec((), ())
        accepted = [k for k in dict.fromkeys(keys) if k not in self._known and k not in self._reserved]
        self._reserved.update(accepted)
        self._note_groups(keys, groups, accepted)
        return StoreSpec(tuple(accepted), tuple(redis_key(key) for key in accepted))

    def complete_store(self, keys: Sequence[BlockKey], ok: bool = True, seconds: float = 0.0) -> None:
        stored = []
        for key in keys:
            if key not in self._reserved:
                continue
            self._reserved.discard(key)
            if ok and not self.disabled:
                self._remember(key)
                stored.append(key)
            else:
                self._forget_groups([key])
        if stored:
            self.counters.record_stores(len(stored), len(stored) * self.identity.block_bytes, seconds)
            self._announce_stored(stored)

    # ------------------------------------------------------------------------ failures
    def invalidate(self, key: BlockKey, reason: str) -> None:
        """A load found no usable value (the kind is counted by the I/O): a miss; forget the key."""
        self.counters.load_failures += 1
        self._pins.pop(key, None)
        if key in self._known:
            del self._known[key]
            self._announce_removed([key])
        self._forget_groups([key])

    def disable(self, reason: str) -> None:
        if self.disabled:
            return
        self.disabled = True
        self.disabled_reason = reason
        removed = list(self._known)
        self._known.clear()
        self._reserved.clear()
        self._pins.clear()
        self._announce_removed(removed)
        self._key_groups.clear()
        logger.warning("remote tier disabled, running without it: %s (%s)", reason, self.store.url)

    def close(self) -> None:
        self.store.close()

    def snapshot(self, block_size: int) -> TierSnapshot:
        snap = super().snapshot(block_size)
        snap.errors = self.store.error_counts()
        snap.breaker_state = int(self.store.breaker.state)
        return snap
