"""What one replica holds, per medium, in bounded memory: the router's view of its KV blocks.

Built from the replica's KV event batches (``apply``, in stream order) or from a ``GET /v1/kv/blocks``
snapshot (``seed``); see ``docs/kv-events.md``. One entry per block hash, holding a bit per medium::

    held: {hash: media bits}     insertion order = oldest first (a stored block moves to the end)

    LOCAL  = device | host | disk     the replica loads these itself: a prefix hit on that replica
    REMOTE = remote                   the shared store: a cheap hit on every replica

Bounded: past ``max_blocks`` the oldest entries are forgotten (``num_forgotten`` counts them); a
forgotten block only makes the router underestimate that replica's cache, never route wrongly.

``apply`` returns False on a gap (a ``seq`` jump within one instance, or a new instance not starting
at 1): batches were lost, the index is incomplete, and the owner must resync from a snapshot.

A resync reads the stream on after its newest id ``L`` taken *before* the snapshot, so the batches
between ``L`` and the snapshot's ``seq`` come again. For the media a snapshot lists they are skipped (the
snapshot is newer). The engine's remote tier lists what it announced, so its snapshot is the whole
truth; a snapshot that leaves the remote medium out (a tier that cannot list) is completed from the
stream: its remote events up to ``L`` (``replay_remote``), then those of the batches it skips.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from kvtier.kv.hashing import BlockHash
from kvtier.kv_events import EventBatch, KVEvent
from kvtier.stats import Medium

_BITS = {Medium.DEVICE: 1, Medium.HOST: 2, Medium.DISK: 4, Medium.REMOTE: 8}
LOCAL_BITS = _BITS[Medium.DEVICE] | _BITS[Medium.HOST] | _BITS[Medium.DISK]
REMOTE_BIT = _BITS[Medium.REMOTE]
DEFAULT_MAX_BLOCKS = 262_144  # per replica: ~40 MB of Python objects at most


class ReplicaIndex:
    """The blocks one replica announced, newest last; see the module docstring."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self.held: dict[BlockHash, int] = {}
        self.instance: str | None = None
        self.seq = 0  # the last applied batch's seq
        self.last_id = "0"  # the last applied stream entry id
        self.num_gaps = 0
        self.num_forgotten = 0
        # The last snapshot left the remote medium out: the stream's announcements are its only source.
        self.remote_from_stream = False

    def __len__(self) -> int:
        return len(self.held)

    # ------------------------------------------------------------------------------ updates
    def apply(self, batch: EventBatch, entry_id: str | None = None) -> bool:
        """Apply one batch; False on a gap (then resync: :meth:`seed`)."""
        if entry_id is not None:
            self.last_id = entry_id
        if batch.instance == self.instance and batch.seq <= self.seq:
            if self.remote_from_stream:  # in the snapshot, but for the remote medium it left out
                self._apply_remote(batch)
            return True
        expected = 1 if batch.instance != self.instance else self.seq + 1
        self.instance, self.seq = batch.instance, batch.seq
        for event in batch.events:
            self._apply_event(event)
        if batch.seq != expected:
            self.num_gaps += 1
            return False
        return True

    def _apply_event(self, event: KVEvent) -> None:
        if event.type == "cleared":
            self.held.clear()
            return
        assert event.medium is not None
        bit = _BITS[event.medium]
        if event.type == "stored":
            self._store(event.hashes, bit)
            return
        for h in event.hashes:
            bits = self.held.get(h, 0) & ~bit
            if bits:
                self.held[h] = bits
            else:
                self.held.pop(h, None)

    def _store(self, hashes: Sequence[BlockHash], bit: int) -> None:
        held = self.held
        for h in hashes:
            held[h] = held.pop(h, 0) | bit  # to the end: the newest
        excess = len(held) - self.max_blocks
        if excess > 0:
            for h in list(itertools.islice(held, excess)):  # the oldest
                del held[h]
            self.num_forgotten += excess

    def seed(self, snapshot: dict[str, Any], last_id: str | None = None) -> None:
        """Start over from a ``GET /v1/kv/blocks`` answer (the state after its ``seq``). Remote blocks
        are kept when the snapshot does not list the remote medium (a tier that cannot list its keys);
        the stream completes them then (module docstring). A listed remote medium replaces them: the
        replica's remote tier lists exactly what it announced up to that ``seq``."""
        media = snapshot.get("blocks") or {}
        self.remote_from_stream = str(Medium.REMOTE) not in media
        keep = REMOTE_BIT if self.remote_from_stream else 0
        old = self.held
        self.held = {h: bits & keep for h, bits in old.items() if bits & keep}
        for name, hashes in media.items():
            self._store([BlockHash(bytes.fromhex(h)) for h in hashes], _BITS[Medium(name)])
        self.instance = snapshot.get("instance")
        self.seq = snapshot.get("seq") or 0
        if last_id is not None:
            self.last_id = last_id

    def replay_remote(self, batches: Sequence[EventBatch]) -> None:
        """Take the remote-tier blocks from ``batches`` of the current instance (a stream read from its
        start up to the id taken before a ``seed`` whose snapshot left the remote medium out). Only for
        such a seed: over a snapshot that lists it, these older events would undo newer ones (a block
        removed, then stored again after that id, would end removed)."""
        for batch in batches:
            if batch.instance == self.instance:
                self._apply_remote(batch)

    def _apply_remote(self, batch: EventBatch) -> None:
        for event in batch.events:
            if event.type == "cleared":
                self.drop_remote()
            elif event.medium == Medium.REMOTE:
                self._apply_event(event)

    def note_remote(self, hashes: Sequence[BlockHash]) -> None:
        """The replica confirmed ``hashes`` in the remote tier (a disaggregated prefill's publish,
        ``kvtier.router.disagg``): what its event stream will announce, known now."""
        self._store(hashes, REMOTE_BIT)

    def drop_remote(self) -> None:
        """Forget every block's remote-tier bit (the shared store was emptied or restarted)."""
        for h in [h for h, bits in self.held.items() if bits & REMOTE_BIT]:
            bits = self.held[h] & ~REMOTE_BIT
            if bits:
                self.held[h] = bits
            else:
                del self.held[h]

    def clear(self) -> None:
        self.held.clear()
        self.instance, self.seq, self.last_id = None, 0, "0"
        self.remote_from_stream = False

    # ------------------------------------------------------------------------------ queries
    def local_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading ``hashes`` this replica holds on its own media (device, host, disk)."""
        held = self.held
        for i, h in enumerate(hashes):
            if not held.get(h, 0) & LOCAL_BITS:
                return i
        return len(hashes)

    def has_remote(self, h: BlockHash) -> bool:
        return bool(self.held.get(h, 0) & REMOTE_BIT)

    def hex_blocks(self) -> dict[str, set[str]]:
        """``{medium: {hex hash}}`` without empty media: comparable to ``BlockIndex.hex_blocks``."""
        out: dict[str, set[str]] = {}
        for h, bits in self.held.items():
            for m, bit in _BITS.items():
                if bits & bit:
                    out.setdefault(str(m), set()).add(h.hex())
        return out

    def counts(self) -> dict[str, int]:
        """Blocks per medium (for ``/router/state``)."""
        out = {str(m): 0 for m in _BITS}
        for bits in self.held.values():
            for m, bit in _BITS.items():
                if bits & bit:
                    out[str(m)] += 1
        return out


def remote_run(indexes: Sequence[ReplicaIndex], hashes: Sequence[BlockHash], start: int) -> int:
    """How many of ``hashes[start:]``, in a row, some replica announced in the shared remote tier."""
    n = 0
    for h in hashes[start:]:
        if not any(index.has_remote(h) for index in indexes):
            break
        n += 1
    return n


def prompt_blocks(
    index: ReplicaIndex, indexes: Sequence[ReplicaIndex], chains: Sequence[Sequence[BlockHash]]
) -> tuple[int, int]:
    """``(local, remote)`` blocks of a request's prompts (one hash chain each) for the replica of
    ``index``: each prompt's leading blocks on its own media, then the run right after them that some
    replica announced in the remote tier, summed over the prompts."""
    local = remote = 0
    for hashes in chains:
        held = index.local_prefix(hashes)
        local += held
        remote += remote_run(indexes, hashes, held)
    return local, remote
