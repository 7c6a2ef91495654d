"""What the tier tests share: a small block identity, keys from names, and blocks of random bytes."""

from __future__ import annotations

import hashlib

import torch

from kvtier.tiers.base import BlockKey, TierIdentity

SHAPE = (2, 4, 2, 1, 8)  # [num_layers, block_size, 2, num_kv_heads, head_dim]
REAL_SHAPE = (30, 16, 2, 3, 64)  # SmolLM2-135M, block size 16: 737,280 bytes in fp32
ELEMENT_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def ident(
    dtype: str = "float32", shape: tuple[int, ...] = SHAPE, fingerprint: str = "ab" * 32
) -> TierIdentity:
    return TierIdentity(fingerprint, dtype, shape, ELEMENT_SIZE[dtype])


IDENT = ident()


def K(name: str) -> BlockKey:
    return BlockKey(hashlib.sha256(name.encode()).digest())


def block(identity: TierIdentity = IDENT, seed: int = 0) -> torch.Tensor:
    """Random bytes (NaN payloads and all) viewed as a block of the identity's dtype and shape."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (identity.block_bytes,), dtype=torch.uint8, generator=gen)
    return raw.view(getattr(torch, identity.dtype)).reshape(identity.block_shape)


def empty(identity: TierIdentity = IDENT) -> torch.Tensor:
    """A block to read into, filled with 7s (a read that wrote nothing shows)."""
    return torch.full(identity.block_shape, 7, dtype=getattr(torch, identity.dtype))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
