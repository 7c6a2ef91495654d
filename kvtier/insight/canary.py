"""The equivalence canary: does the cache still give the K/V a recomputation gives?

For a sampled fraction (``canary_rate``) of the requests whose prompt was partly served from cache,
the canary checks a few of the cached blocks it served::

    adopt (scheduler)   the request's hit: blocks b0..b5 from device, host, disk    on_adopt: sampled?
                        pick up to BLOCKS_PER_CHECK of them, lower tiers first       (seeded RNG)
    _execute (engine)   after this step's loads, copy those blocks' bytes out        capture(kv_cache)
    idle (engine)       recompute the prompt up to the deepest picked block in a     run_one(model)
                        scratch pool, without the cache; compare block by block
    mismatch            log the block keys and the tier the bytes came from, count   on_mismatch(tier, keys)
                        it, and the engine quarantines that tier (no more loads)

With several KV groups (a hybrid model, ``kvtier/kv/groups.py``) it samples the hit blocks of every
group (``AdoptedPrefix.groups``): up to ``BLOCKS_PER_CHECK`` per group, lower tiers first. A group's
block holds only that group's layers (a sliding group's: its window's blocks, at the end of the hit),
so each picked block's slots are compared with the recomputed rows of the layers in them
(``group.layers``, padded slots left out)::

    hit of n = 8 blocks, W = 3 blocks' worth      picked (per group)     compared with
    group 0 (full)     b0 .. b7                   e.g. b1 b4 b6 b7       layers 5, 11, 17 of the recomputation
    group 1 (sliding)  b5 b6 b7                   b5 b6 b7               layers 0, 6, 12
    ...

A dense model is one group whose slots are its layers: the whole block, as before. Counts and the last
mismatch say which group each block belongs to (``by_group``, ``last_mismatch.groups``).

Checks wait in a queue of at most ``MAX_PENDING`` (more are skipped and counted) and run only when the
engine has no request to step (``LLMEngine.run_idle_work``): they never share a step with user work.

Tolerance (elementwise, NaN/inf always a mismatch): ``|served - recomputed| <= atol + rtol *
max|recomputed|`` over the block, with ``atol = rtol = 1e-4`` in float32 and ``5e-2`` in bfloat16/float16.
Honest blocks differ only by the summation order of a different batch or chunking (measured below
1e-5 relative in float32); a flipped byte in a value's exponent or high mantissa is far outside.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.kv.computed import AdoptedPrefix
from kvtier.kv.hashing import BlockHash
from kvtier.models.attention import AttentionMetadata, PrefillGroup
from kvtier.models.kv_quant import KVFormat, PagedKVCache, dequantize
from kvtier.models.llama import LlamaModel
from kvtier.stats import Medium

logger = logging.getLogger("kvtier.canary")

BLOCKS_PER_CHECK = 4  # blocks compared per sampled request (lower-tier blocks first)
MAX_PENDING = 4  # checks waiting for idle capacity; more are skipped (counted)
MAX_RECOMPUTE_TOKENS = 2048  # blocks deeper than this are never picked (bounds one check's cost)
# atol = rtol, per KV dtype. A compact block is compared after dequantizing; a recomputation may land
# one quantization step away (another summation order): int8 one step is 1/127 of a token's largest
# value, fp8 one step up to 1/8 (e4m3) or 1/4 (e5m2) of the value itself.
TOLERANCE = {
    "float32": 1e-4,
    "bfloat16": 5e-2,
    "float16": 5e-2,
    "int8": 2e-2,
    "fp8_e4m3": 0.13,
    "fp8_e5m2": 0.26,
}


@dataclass
class _Candidate:
    """A sampled request's picked blocks, before their bytes are captured."""

    token_ids: list[int]  # the prompt up to the end of the deepest picked block
    indices: list[int]  # picked block indices in the prompt
    keys: list[BlockHash]
    tiers: list[Medium]
    block_ids: list[int]  # device blocks holding the served bytes this step
    groups: list[int]  # the KV group of each picked block (its slots hold that group's layers)


@dataclass
class _Check:
    candidate: _Candidate
    served: torch.Tensor  # [k, S, BS, 2, KVH, D] (raw rows): the bytes the cache served, copied out


@dataclass
class Mismatch:
    tier: Medium
    block_keys: list[str]  # hex
    max_abs_diff: float
    time: float
    groups: list[int] = field(default_factory=list)  # the KV group of each of block_keys


@dataclass
class CanaryStats:
    match: int = 0
    mismatch: int = 0
    skipped: int = 0  # sampled, but the queue was full
    checks_run: int = 0  # sampled requests checked
    recomputed_tokens: int = 0  # tokens the checks ran through the model (the canary's work)
    seconds: float = 0.0  # spent capturing served bytes and running checks
    by_tier: dict[Medium, dict[str, int]] = field(default_factory=dict)
    by_group: dict[int, dict[str, int]] = field(default_factory=dict)  # blocks compared, by KV group
    last_mismatch: Mismatch | None = None


def recompute_kv(model: LlamaModel, token_ids: Sequence[int], block_size: int, fmt: KVFormat) -> PagedKVCache:
    """K/V of ``token_ids`` (a whole number of blocks) computed from scratch, in one causal prefill
    into a private pool of the engine's KV format with one slot per layer (its ``raw`` rows: one per
    block, [n / BS, L, ...], whatever the model's KV groups). The engine's pool is not touched."""
    c = model.config
    n = len(token_ids)
    device = model.embed.device
    shape = (c.num_layers, block_size, c.num_kv_heads, c.head_dim)
    scratch = PagedKVCache(fmt, n // block_size, shape, device)
    positions = torch.arange(n, device=device)  # [n]
    meta = AttentionMetadata(
        slot_block_ids=positions // block_size,
        slot_offsets=positions % block_size,
        decode=None,
        prefills=[PrefillGroup(0, n, 0, None, None)],
    )
    with torch.inference_mode():
        model.forward(
            torch.tensor(list(token_ids), dtype=torch.long, device=device), positions, scratch, meta
        )
    return scratch


def block_values(cache: PagedKVCache, raw_block: torch.Tensor) -> torch.Tensor:
    """One block's raw row (as the tiers hold it) -> its K/V values in float32 (dequantized)."""
    if cache.scales is None:
        return raw_block.float()
    data = raw_block[:, : cache.data_bytes].view(cache.fmt.storage)  # [L, BS*2*KVH*D]
    scale = raw_block[:, cache.data_bytes :].view(torch.float32)  # [L, BS*2*KVH]
    return dequantize(data.unflatten(1, (-1, cache.token_shape[-1])), scale, torch.float32)


def block_diff(served: torch.Tensor, recomputed: torch.Tensor, tol: float) -> tuple[bool, float]:
    """(within tolerance, max |served - recomputed|) of one block's values; non-finite never match."""
    a, b = served.float(), recomputed.float()
    if not bool(torch.isfinite(a).all()):
        return False, float("inf")
    diff = float((a - b).abs().max())
    return diff <= tol + tol * float(b.abs().max()), diff


def _group_hits(adopted: AdoptedPrefix, limit: int) -> dict[int, list[tuple[int, BlockHash, Medium, int]]]:
    """Each KV group's hit blocks before position ``limit``: ``(position, key, tier, device block)``. A
    one-group hit (a dense model) is the flat fields: group 0's."""
    if not adopted.groups:
        n = min(len(adopted.served_by), limit)
        return {0: [(i, adopted.keys[i], adopted.served_by[i], adopted.block_ids[i]) for i in range(n)]}
    hits: dict[int, list[tuple[int, BlockHash, Medium, int]]] = {}
    for hit in adopted.groups:
        hits[hit.group] = [
            (hit.first + j, key, tier, block_id)
            for j, (key, tier, block_id) in enumerate(
                zip(hit.keys, hit.served_by, hit.block_ids, strict=True)
            )
            if hit.first + j < limit and block_id is not None
        ]
    return hits


def _layer_rows(layers: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """The rows of a one-slot-per-layer recomputation holding ``layers`` (None: the first rows, as is)."""
    return None if layers == tuple(range(len(layers))) else torch.tensor(layers, device=device)


class Canary:
    """Samples requests served from cache, captures the served bytes, checks them when idle."""

    def __init__(self, rate: float, block_size: int, dtype: str, seed: int = 0) -> None:
        self.rate = rate
        self.block_size = block_size
        self.tolerance = TOLERANCE[dtype]
        self.blocks_per_check = BLOCKS_PER_CHECK
        self.max_pending = MAX_PENDING
        self.stats = CanaryStats()
        self.on_mismatch: Callable[[Medium, list[BlockHash]], None] | None = None
        self._rng = random.Random(seed)
        self._capturing: list[_Candidate] = []
        self._pending: deque[_Check] = deque()
        self._cache: PagedKVCache | None = None  # the engine's pool (its KV format), from capture

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def capturing(self) -> bool:
        """Whether the next ``capture`` copies bytes out of the pool (a sampled request this step)."""
        return bool(self._capturing)

    # ------------------------------------------------------------------------------ sampling
    def on_adopt(self, token_ids: Sequence[int], adopted: AdoptedPrefix) -> None:
        """A request adopted a cached prefix: sample it, and pick the blocks to check in every group."""
        limit = MAX_RECOMPUTE_TOKENS // self.block_size
        hits = _group_hits(adopted, limit)
        if self.rate <= 0 or not any(hits.values()) or self._rng.random() >= self.rate:
            return
        picked: list[tuple[int, int, BlockHash, Medium, int]] = []  # (position, group, key, tier, block)
        for g, blocks in hits.items():
            lower = [b for b in blocks if b[2] != Medium.DEVICE]
            device = [b for b in blocks if b[2] == Medium.DEVICE]
            mine = self._rng.sample(lower, min(len(lower), self.blocks_per_check))
            mine += self._rng.sample(device, min(len(device), self.blocks_per_check - len(mine)))
            picked += [(i, g, key, tier, block_id) for i, key, tier, block_id in mine]
        picked.sort(key=lambda p: (p[0], p[1]))
        end = (max(p[0] for p in picked) + 1) * self.block_size
        positions, groups, keys, tiers, block_ids = (list(column) for column in zip(*picked, strict=True))
        self._capturing.append(_Candidate(list(token_ids[:end]), positions, keys, tiers, block_ids, groups))

    def take_picked(self) -> list[_Candidate]:
        """Sampled requests' picks not captured yet, removed (a replay without a model has no bytes)."""
        picked, self._capturing = self._capturing, []
        return picked

    def capture(self, cache: PagedKVCache) -> None:
        """Copy out the bytes the sampled requests were served (call after the step's loads ran)."""
        self._cache, kv_cache = cache, cache.raw
        t0 = time.perf_counter() if self._capturing else 0.0
        for cand in self._capturing:
            if len(self._pending) >= self.max_pending:
                self.stats.skipped += 1
                continue
            ids = torch.tensor(cand.block_ids, dtype=torch.long, device=kv_cache.device)
            self._pending.append(_Check(cand, kv_cache.index_select(0, ids)))  # a copy
        if self._capturing:
            self.stats.seconds += time.perf_counter() - t0
        self._capturing.clear()

    # ------------------------------------------------------------------------------ checking
    def run_one(self, model: LlamaModel) -> bool:
        """Run the oldest pending check; False if there was none."""
        if not self._pending:
            return False
        t0 = time.perf_counter()
        check = self._pending.popleft()
        cand = check.candidate
        assert self._cache is not None  # set by the capture that queued this check
        scratch = recompute_kv(model, cand.token_ids, self.block_size, self._cache.fmt)
        self.stats.checks_run += 1
        self.stats.recomputed_tokens += len(cand.token_ids)
        bad: dict[Medium, list[tuple[BlockHash, float, int]]] = {}
        rows: dict[int, torch.Tensor | None] = {}
        for j, (index, tier, g) in enumerate(zip(cand.indices, cand.tiers, cand.groups, strict=True)):
            layers = model.kv_layout.groups[g].layers  # the layers in group g's slots 0, 1, ...
            if g not in rows:
                rows[g] = _layer_rows(layers, scratch.raw.device)
            served = block_values(self._cache, check.served[j][: len(layers)])  # padded slots left out
            block = scratch.raw[index]  # [L, ...] one row per layer
            picked = rows[g]
            recomputed = block_values(scratch, block if picked is None else block.index_select(0, picked))
            ok, diff = block_diff(served, recomputed, self.tolerance)
            self._count(tier, ok, g)
            if not ok:
                bad.setdefault(tier, []).append((cand.keys[j], diff, g))
        for tier, blocks in bad.items():
            self._mismatch(tier, blocks)
        self.stats.seconds += time.perf_counter() - t0
        return True

    def _count(self, tier: Medium, ok: bool, group: int) -> None:
        result = "match" if ok else "mismatch"
        setattr(self.stats, result, getattr(self.stats, result) + 1)
        for counts in (
            self.stats.by_tier.setdefault(tier, {"match": 0, "mismatch": 0}),
            self.stats.by_group.setdefault(group, {"match": 0, "mismatch": 0}),
        ):
            counts[result] += 1

    def _mismatch(self, tier: Medium, blocks: list[tuple[BlockHash, float, int]]) -> None:
        keys = [key for key, _, _ in blocks]
        worst = max(diff for _, diff, _ in blocks)
        shown = min(worst, 1e30)  # finite, for JSON (a non-finite served value reads as 1e30)
        groups = [g for _, _, g in blocks]
        self.stats.last_mismatch = Mismatch(tier, [k.hex() for k in keys], shown, time.time(), groups)
        logger.error(
            "canary: %d cached block(s) served from the %s tier differ from a recomputation "
            "(max |diff| %.3g): %s; quarantining the %s tier",
            len(keys),
            tier,
            worst,
            ", ".join(f"{k.hex()} (KV group {g})" for k, g in zip(keys, groups, strict=True)),
            tier,
        )
        if self.on_mismatch is not None:
            self.on_mismatch(tier, keys)

    def checks_by_label(self) -> dict[tuple[str, str], int]:
        """``{(result, tier): n}`` for ``kvtier:canary_checks_total``."""
        return {(r, str(t)): n for t, c in self.stats.by_tier.items() for r, n in c.items()}

    def report(self, quarantined: Sequence[Medium]) -> dict[str, Any]:
        """``GET /v1/kv/canary``'s body."""
        s = self.stats
        last = s.last_mismatch
        return {
            "rate": self.rate,
            "checks": {"match": s.match, "mismatch": s.mismatch, "skipped": s.skipped},
            "recomputed_tokens": s.recomputed_tokens,
            "pending": len(self._pending),
            "tolerance": self.tolerance,
            "by_tier": {str(t): dict(c) for t, c in s.by_tier.items()},
            "by_group": {str(g): dict(c) for g, c in sorted(s.by_group.items())},
            "quarantined": [str(m) for m in quarantined],
            "last_mismatch": None
            if last is None
            else {
                "tier": str(last.tier),
                "block_keys": last.block_keys,
                "groups": last.groups,
                "max_abs_diff": last.max_abs_diff,
                "time": last.time,
            },
        }
