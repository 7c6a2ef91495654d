"""Content hashes of KV blocks: the keys of the prefix cache.

A block's hash names the exact KV it holds. KV of a token depends on every token before it, so the
hash of block ``i`` chains the hash of block ``i - 1`` (its *parent*) with block ``i``'s own tokens::

    root_hash(extra_keys) ──► hash_block(·, tokens[0:B]) ──► hash_block(·, tokens[B:2B]) ──► ...
          h_root                        h_0                            h_1

    h_i = sha256(DOMAIN | "block" | h_{i-1} | len | tokens of block i as int64 little endian)

Two sequences share ``h_i`` only if they share the root and all ``(i + 1) * B`` leading tokens,
so a hash hit means a whole prefix hit, never just one block in the middle.

The root carries ``extra_keys``: everything besides the tokens that changes the KV or must keep
two requests apart. The engine passes the model fingerprint (a hex string) and the request's
``cache_salt``; a different salt starts a different chain, so tenants never see each other's blocks.

The hashes are stable: the same in every process and after a restart (sha256 over an explicit,
length-prefixed byte encoding; never Python's ``hash()``, which changes with ``PYTHONHASHSEED``).
That matters once blocks outlive the process on a lower tier.

Only *full* blocks have a hash. A partial tail block is still being written and is never shared.

A hybrid model keeps its KV in several *groups* (``kvtier/kv/groups.py``: layers of one attention kind,
e.g. Gemma 3's full-attention layers and its sliding-window layers). The chain stays one per sequence;
group ``g``'s block ``i`` is keyed ``group_key(h_i, g)``. Group 0 keeps ``h_i`` itself, so a dense model
(one group) keys its blocks exactly as before, and every other group's keys are distinct from it and
from each other: every tier below the device sees one flat key space::

    group_key(h_i, 0) = h_i
    group_key(h_i, g) = sha256(DOMAIN | "group" | h_i | g as u64)        for g >= 1
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""A 32-byte sha256 digest naming the KV of one full block and of everything before it."""

BLOCK_HASH_NUM_BYTES = 32

# Bump the version if the encoding below ever changes: old hashes (e.g. on disk) must not match.
# docs/block-hashes.md specifies the encoding; GET /v1/kv/info reports the version to routers.
HASH_SPEC_VERSION = 1
_DOMAIN = b"kvtier-block-v%d" % HASH_SPEC_VERSION
_ROOT_TAG = b"\x00root"
_BLOCK_TAG = b"\x01block"
_GROUP_TAG = b"\x02group"
_BLOCK_HASHER = hashlib.sha256(_DOMAIN + _BLOCK_TAG)  # each block's hash starts as a copy of it

ExtraKey = str | bytes | int


def _encode_extra_key(key: ExtraKey) -> bytes:
    """Type tag + 8-byte length + payload: no two different keys (or key lists) share an encoding."""
    if isinstance(key, bool):  # bool is an int subclass; True must not collide with 1
        tag, payload = b"?", b"1" if key else b"0"
    elif isinstance(key, int):
        tag, payload = b"i", str(key).encode("ascii")
    elif isinstance(key, str):
        tag, payload = b"s", key.encode("utf-8")
    elif isinstance(key, bytes):
        tag, payload = b"b", key
    else:
        raise TypeError(f"extra key must be str, bytes or int, got {type(key).__name__}")
    return tag + struct.pack("<Q", len(payload)) + payload


def cache_identity(model_fingerprint: str, dtype: str, kv_dtype: str) -> str:
    """The first extra key of every request's chain: blocks are only ever reused by the same weights
    computing in the same precision. A compact KV dtype (docs/kv-dtype.md) adds ``:kv=<dtype>``; KV
    stored in the compute dtype keeps the plain ``<fingerprint>:<dtype>`` root."""
    identity = f"{model_fingerprint}:{dtype}"
    return identity if kv_dtype == dtype else f"{identity}:kv={kv_dtype}"


def root_hash(extra_keys: tuple[ExtraKey, ...]) -> BlockHash:
    """The parent hash of a sequence's first block.

    ``extra_keys`` (model fingerprint, ``cache_salt``, ...) are order-sensitive: ``("a", "b")`` and
    ``("b", "a")`` give different roots, and so do ``("ab",)`` and ``("a", "b")``.
    """
    h = hashlib.sha256(_DOMAIN + _ROOT_TAG)
    h.update(struct.pack("<Q", len(extra_keys)))
    for key in extra_keys:
        h.update(_encode_extra_key(key))
    return BlockHash(h.digest())


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """``H(parent, tokens)``: the hash of a full block given its parent's hash.

    Tokens are encoded as a count followed by int64 little endian values, so the encoding does
    not depend on the platform's byte order and ``[1, 2]`` never collides with ``[258]``.
    """
    if len(parent) != BLOCK_HASH_NUM_BYTES:
        raise ValueError(f"parent hash must be {BLOCK_HASH_NUM_BYTES} bytes, got {len(parent)}")
    num_tokens = len(token_ids)
    h = _BLOCK_HASHER.copy()
    h.update(parent)
    h.update(struct.pack(f"<Q{num_tokens}q", num_tokens, *token_ids))
    return BlockHash(h.digest())


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockHash,
    start_block: int = 0,
    num_tokens: int | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks ``start_block, start_block + 1, ...`` of ``token_ids[:num_tokens]``.

    ``parent`` is the hash of block ``start_block - 1`` (the root hash when ``start_block`` is 0).
    Only full blocks are hashed: a trailing partial block yields nothing. Cost is proportional to
    the number of *new* blocks, so a growing sequence extends its chain each step without rehashing
    its prefix (see :func:`extend_block_hashes`).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start_block < 0:
        raise ValueError(f"start_block must be >= 0, got {start_block}")
    if num_tokens is None:
        num_tokens = len(token_ids)
    elif not 0 <= num_tokens <= len(token_ids):
        raise ValueError(f"num_tokens {num_tokens} out of range for {len(token_ids)} tokens")
    num_blocks = num_tokens // block_size - start_block
    if num_blocks <= 0:
        return []
    if len(parent) != BLOCK_HASH_NUM_BYTES:
        raise ValueError(f"parent hash must be {BLOCK_HASH_NUM_BYTES} bytes, got {len(parent)}")
    # hash_block's bytes, all blocks' tokens encoded at once: int64 little endian, then sliced per block
    lo = start_block * block_size
    tokens = array("q", token_ids[lo : lo + num_blocks * block_size])
    if sys.byteorder != "little":
        tokens.byteswap()
    data, step = memoryview(tokens).cast("B"), 8 * block_size
    count = struct.pack("<Q", block_size)
    hashes: list[BlockHash] = []
    for i in range(num_blocks):
        h = _BLOCK_HASHER.copy()
        h.update(parent)
        h.update(count)
        h.update(data[i * step : (i + 1) * step])
        parent = BlockHash(h.digest())
        hashes.append(parent)
    return hashes


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    root: BlockHash,
    num_tokens: int | None = None,
) -> int:
    """Append to ``block_hashes`` (the chain so far) the hashes of blocks that became full.

    ``block_hashes[i]`` must be the hash of block ``i`` of ``token_ids``; the chain resumes from its
    last entry (or ``root`` when empty). Returns how many hashes were appended.
    """
    parent = block_hashes[-1] if block_hashes else root
    new_hashes = hash_full_blocks(token_ids, block_size, parent, len(block_hashes), num_tokens)
    block_hashes.extend(new_hashes)
    return len(new_hashes)


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The key of KV group ``group``'s block whose chained hash is ``block_hash`` (docs/block-hashes.md).

    Group 0 (a dense model's only group; a hybrid model's first full-attention group) is keyed by the
    chain itself. Any other group's key is a domain-separated SHA-256 over the chain hash and the
    group index, so it never equals a chain hash or another group's key.
    """
    if group < 0:
        raise ValueError(f"group must be >= 0, got {group}")
    if len(block_hash) != BLOCK_HASH_NUM_BYTES:
        raise ValueError(f"block hash must be {BLOCK_HASH_NUM_BYTES} bytes, got {len(block_hash)}")
    if group == 0:
        return block_hash
    h = hashlib.sha256(_DOMAIN + _GROUP_TAG)
    h.update(block_hash)
    h.update(struct.pack("<Q", group))
    return BlockHash(h.digest())


FEW_BLOCKS = 4  # ChainMemo hashes this many new blocks directly


class ChainMemo:
    """The hash chains of the last few token sequences hashed: a prompt is hashed once, though the
    scheduler looks it up when it arrives, again when it is admitted, and caches its blocks after its
    prefill (8,192 tokens are 512 SHA-256 blocks, ~1.5 ms of Python each time). Each entry is the root,
    the tokens (a tuple: building and comparing one is ~100x cheaper than hashing it) and their chain,
    most recent last, in a plain list: a dict keyed by the tuples would hash each one (8k ints, ~50 µs)
    on every lookup, and an ``OrderedDict`` even while iterating."""

    def __init__(self, block_size: int, size: int = 8) -> None:
        self.block_size = block_size
        self.size = size
        self._chains: list[tuple[BlockHash, tuple[int, ...], list[BlockHash]]] = []

    def extend(
        self, block_hashes: list[BlockHash], token_ids: Sequence[int], root: BlockHash, num_tokens: int
    ) -> None:
        """``extend_block_hashes(block_hashes, token_ids, block_size, root, num_tokens)``, from a chain
        hashed before where one covers these tokens."""
        bs = self.block_size
        n = num_tokens // bs
        if n - len(block_hashes) <= FEW_BLOCKS:  # a decode's newest block: hashing is cheaper than a lookup
            extend_block_hashes(block_hashes, token_ids, bs, root, n * bs)
            return
        tokens = tuple(token_ids[: n * bs])
        best, chain = self._longest(root, tokens)
        if len(chain) > len(block_hashes):
            block_hashes.extend(chain[len(block_hashes) :])
        if len(block_hashes) == n:
            if best is not None:
                self._chains.append(self._chains.pop(best))  # the most recent
            return
        extend_block_hashes(block_hashes, token_ids, bs, root, n * bs)
        if best is not None:
            del self._chains[best]  # a chain of a prefix of these tokens: this one covers it
        self._chains.append((root, tokens, list(block_hashes)))
        del self._chains[: -self.size]

    def _longest(self, root: BlockHash, tokens: tuple[int, ...]) -> tuple[int | None, list[BlockHash]]:
        """The entry sharing the most leading blocks with ``tokens``: its index (None when none) and the
        hashes of the shared blocks."""
        best: tuple[int | None, list[BlockHash]] = (None, [])
        bs = self.block_size
        for i, (r, known, chain) in enumerate(self._chains):
            m = min(len(known), len(tokens))
            if r != root or m // bs <= len(best[1]) or known[:bs] != tokens[:bs]:
                continue  # another root, no longer than the best, or another first block: no slicing
            if known == tokens or known[:m] == tokens[:m]:
                best = (i, chain[: m // bs])
        return best
