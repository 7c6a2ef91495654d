"""Lossless re-encoding of GGUF blocks into a block type that has a kernel (``qmatmul.c``).

Q5_0 (and Q4_0) blocks hold ``w = d * (q - offset)`` with one fp16 scale per 32 weights and a small
unsigned code; the same weights are Q8_0 blocks with the same ``d`` and the signed code ``q - offset``
(it fits int8). So a Q5_0 tensor, or a group that mixes Q5_0, Q4_0 and Q8_0 tensors (Gemma 3's
``q|k|v``, Q4_K_M files' ``attn_v``), runs on the Q8_0 kernel with every weight the same fp32 value the
dequantized model holds: no requantization, only wider codes (34 bytes per 32 weights instead of 22).

Block layouts (GGML, little-endian)::

    Q4_0  d fp16 | qs[16]             weight j < 16: qs[j] & 15, j >= 16: qs[j - 16] >> 4;  q - 8
    Q5_0  d fp16 | qh u32 | qs[16]    as Q4_0 plus bit 4 of weight j from bit j of qh;      q - 16
    Q8_0  d fp16 | int8 q[32]
"""

from __future__ import annotations

import numpy as np

BLOCK_BYTES = {"Q4_0": 18, "Q5_0": 22, "Q8_0": 34}
TO_Q8_0 = frozenset({"Q4_0", "Q5_0"})  # block types whose weights Q8_0 holds exactly


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """qs [..., 16] uint8 -> the 32 low-4-bit codes [..., 32] (weights 0-15 low nibbles, 16-31 high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def to_q8_0(qtype: str, data: np.ndarray) -> np.ndarray:
    """Rows of ``qtype`` blocks [N, nb * block bytes] (uint8) -> the same weights as Q8_0 blocks
    [N, nb * 34]. Q8_0 rows are returned as they are; ValueError for a type Q8_0 cannot hold exactly."""
    if qtype == "Q8_0":
        return data
    if qtype not in TO_Q8_0:
        raise ValueError(f"{qtype} blocks have no exact Q8_0 form")
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, BLOCK_BYTES[qtype])  # [N, nb, bytes]
    d = blocks[..., :2]  # the fp16 scale, bytes as they are
    if qtype == "Q4_0":
        q = _nibbles(blocks[..., 2:]).astype(np.int16) - 8
    else:
        qh = blocks[..., 2:6].copy().view("<u4")  # [N, nb, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4  # [N, nb, 32]
        q = (_nibbles(blocks[..., 6:]) | high).astype(np.int16) - 16
    codes = q.astype(np.int8).view(np.uint8)  # [N, nb, 32]
    return np.concatenate([d, codes], axis=-1).reshape(n, -1)  # [N, nb * 34]
