"""KV groups: which layers share a block table, and how many blocks a sequence holds in each.

A hybrid model mixes attention kinds (Gemma 3: every 6th layer full attention, the others a sliding
window of W tokens). Layers of one kind form a *KV group*; the manager keeps one block table per group
and sequence, and a sliding group keeps only the blocks its window can still reach. Every group has the
same number of layer *slots*, so a block (``block_size`` tokens x ``slots_per_group`` layers) is the
same size in every group: one device pool of equal blocks serves them all, and every tier keeps one
block size. A kind whose layer count is not a multiple of the group size leaves a group with padded
(unused) slots.

Gemma 3 270M (18 layers, layer i full when (i + 1) % 6 == 0; W = 512), grouped by vLLM's rule::

    group 0  full      layers  5 11 17        <- the first full group: keyed by the chain itself
    group 1  sliding   layers  0  6 12
    group 2  sliding   layers  1  7 13         3 slots per group (the smaller kind's layer count),
    group 3  sliding   layers  2  8 14         each kind split into groups by stride
    group 4  sliding   layers  3  9 15         (layers[i::num_groups]), full groups first
    group 5  sliding   layers  4 10 16

A dense model (every layer full) is one group of all its layers, slot = layer: today's layout.

The group size is vLLM's (``_get_kv_cache_groups_uniform_page_size``): the smallest kind's layer
count, or the largest kind's when it is under 1.5x the smallest (12 sliding + 13 full layers become
two groups of 13 slots, the sliding one with a padded slot, rather than three groups of 12 slots with
the two full ones half empty).

Blocks a sequence of ``n`` computed tokens holds in one group (its next query sits at position ``n``;
a sliding query at ``q`` sees keys ``q - W < k <= q``)::

    full       ceil(n / B)                       blocks 0 .. ceil(n/B) - 1
    sliding    ceil(n / B) - max(0, n - W + 1) // B
               blocks before block max(0, n - W + 1) // B are out of every later query's reach

Pure Python: no tensors, no model config (the caller passes ``layer_types`` and ``sliding_window``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

GroupKind = Literal["full", "sliding"]

# HF ``layer_types`` names -> group kinds (kvtier.config.LAYER_TYPES names the same two).
_KIND_OF_LAYER_TYPE: dict[str, GroupKind] = {"full_attention": "full", "sliding_attention": "sliding"}

NULL_BLOCK_ID = -1
"""The block id the manager's int tables (``KVCacheManager.block_ids`` / ``block_tables``) give a
*null entry*: a sliding group's block that its window no longer reaches and that was released. The
runner must never read or write it (attention masks those positions anyway: they are out of the
window), e.g. by clamping it to any valid block id for gathers whose result the mask discards."""

# vLLM's heuristic: use the largest kind's layer count as the group size when it is this close to
# the smallest one (fewer padded slots than splitting the smallest kind's way).
_PAD_RATIO = 1.5


@dataclass(frozen=True)
class KVGroupSpec:
    """One KV group: its attention kind, its window, and the model layers in its slots (slot ``s``
    holds ``layers[s]``; slots past ``len(layers)`` are padding)."""

    kind: GroupKind
    window: int | None  # tokens a sliding query sees, itself included; None for full attention
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.kind not in ("full", "sliding"):
            raise ValueError(f"unknown KV group kind {self.kind!r} (full, sliding)")
        if self.kind == "full" and self.window is not None:
            raise ValueError(f"a full-attention group has no window, got {self.window}")
        if self.kind == "sliding" and (self.window is None or self.window <= 0):
            raise ValueError(f"a sliding group needs a positive window, got {self.window}")

    def first_reachable_block(self, query_pos: int, block_size: int) -> int:
        """The first block a query at ``query_pos`` (or any later one) can read: 0 for full attention;
        for a sliding window, the block holding position ``query_pos - window + 1``."""
        if self.window is None:
            return 0
        return max(0, query_pos - self.window + 1) // block_size

    def num_blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks a sequence of ``num_tokens`` computed tokens keeps in this group."""
        num_blocks = -(-num_tokens // block_size)
        if self.window is None:
            return num_blocks
        return max(0, num_blocks - self.first_reachable_block(num_tokens, block_size))


@dataclass(frozen=True)
class KVLayout:
    """The KV groups of a model, full groups first (group 0 is keyed by the block-hash chain itself,
    see ``kvtier.kv.hashing.group_key``), each with ``slots_per_group`` layer slots."""

    groups: tuple[KVGroupSpec, ...]
    slots_per_group: int

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a KV layout needs at least one group")
        for spec in self.groups:
            if len(spec.layers) > self.slots_per_group:
                raise ValueError(f"a group holds {len(spec.layers)} layers in {self.slots_per_group} slots")
        layers = [layer for spec in self.groups for layer in spec.layers]
        if len(set(layers)) != len(layers):
            raise ValueError("a layer appears in two KV groups")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def layers_per_group(self) -> int:
        """Layer slots in every group's block (padding included)."""
        return self.slots_per_group

    @cached_property
    def is_dense(self) -> bool:
        """One full-attention group: the layout every dense model has (the manager's fast path)."""
        return len(self.groups) == 1 and self.groups[0].window is None

    @cached_property
    def has_sliding(self) -> bool:
        return any(spec.window is not None for spec in self.groups)

    def slot_of(self, layer: int) -> tuple[int, int]:
        """``(group, slot)`` holding model layer ``layer``."""
        for g, spec in enumerate(self.groups):
            if layer in spec.layers:
                return g, spec.layers.index(layer)
        raise KeyError(f"layer {layer} is in no KV group")

    def padded_slots(self) -> tuple[tuple[int, int], ...]:
        """``(group, slot)`` of every slot that holds no layer."""
        return tuple(
            (g, s)
            for g, spec in enumerate(self.groups)
            for s in range(len(spec.layers), self.slots_per_group)
        )

    def blocks_held_by_group(self, num_tokens: int, block_size: int) -> tuple[int, ...]:
        """Blocks a sequence of ``num_tokens`` computed tokens keeps in each group."""
        return tuple(spec.num_blocks_held(num_tokens, block_size) for spec in self.groups)

    def num_blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks a sequence of ``num_tokens`` computed tokens keeps over all groups (one group of full
        attention: ``ceil(num_tokens / block_size)``)."""
        return sum(self.blocks_held_by_group(num_tokens, block_size))

    def max_tokens(self, num_blocks: int, block_size: int) -> int:
        """The longest sequence a pool of ``num_blocks`` holds at every length on its way (one full
        group: ``num_blocks * block_size``). A sliding group never holds more than
        ``ceil((W - 1) / B) + 1`` blocks; the full groups share the rest. Without a full group: as if
        it were one (the bound the pool had before the groups)."""
        full = sum(1 for spec in self.groups if spec.window is None)
        sliding = sum(
            -(-(spec.window - 1) // block_size) + 1 for spec in self.groups if spec.window is not None
        )
        if not full:
            return num_blocks * block_size
        return max(0, (num_blocks - sliding) // full) * block_size

    def group_bytes_per_token(self, layer_token_bytes: int) -> int:
        """Bytes one token's KV takes in one group's block: ``slots_per_group`` layers of
        ``layer_token_bytes`` (K and V of one layer and token), padded slots included."""
        return self.slots_per_group * layer_token_bytes

    def block_bytes(self, block_size: int, layer_token_bytes: int) -> int:
        """Bytes of one block, the same in every group and every tier."""
        return block_size * self.group_bytes_per_token(layer_token_bytes)

    def kv_bytes_held(self, num_tokens: int, block_size: int, layer_token_bytes: int) -> int:
        """Device bytes a sequence of ``num_tokens`` computed tokens holds (whole blocks)."""
        return self.num_blocks_held(num_tokens, block_size) * self.block_bytes(block_size, layer_token_bytes)

    def kv_bytes_held_by_group(
        self, num_tokens: int, block_size: int, layer_token_bytes: int
    ) -> tuple[int, ...]:
        """Device bytes a sequence of ``num_tokens`` computed tokens holds in each group (whole blocks;
        they sum to ``kv_bytes_held``): a full group's grow with the sequence, a sliding group's stop
        at the blocks its window reaches."""
        block = self.block_bytes(block_size, layer_token_bytes)
        return tuple(n * block for n in self.blocks_held_by_group(num_tokens, block_size))

    def max_sequences(self, num_blocks: int, num_tokens: int, block_size: int) -> int:
        """Sequences of ``num_tokens`` computed tokens that a pool of ``num_blocks`` holds at once, each
        keeping ``num_blocks_held`` blocks (on its way there, a sliding group may hold one block more
        at some lengths: ``max_tokens`` counts that peak for one sequence)."""
        return num_blocks // max(1, self.num_blocks_held(num_tokens, block_size))


DENSE_LAYOUT = KVLayout((KVGroupSpec("full", None, ()),), slots_per_group=0)
"""What a manager built without a layout assumes: one full-attention group. Its layers are not named
(the manager never needs them; a dense model's runner maps layer ``i`` to slot ``i``). Build a real
model's layout with :func:`kv_layout`."""


def _group_size(layer_counts: Sequence[int]) -> int:
    smallest, largest = min(layer_counts), max(layer_counts)
    return largest if largest < smallest * _PAD_RATIO else smallest


def kv_layout(layer_types: Sequence[str], sliding_window: int | None) -> KVLayout:
    """The KV groups of a model whose layer ``i`` has attention kind ``layer_types[i]`` (HF names:
    ``"full_attention"``, ``"sliding_attention"``; see the module docstring for the rule)."""
    if not layer_types:
        raise ValueError("a model needs at least one layer")
    by_kind: dict[GroupKind, list[int]] = {"full": [], "sliding": []}
    for layer, layer_type in enumerate(layer_types):
        kind = _KIND_OF_LAYER_TYPE.get(layer_type)
        if kind is None:
            raise ValueError(
                f"layer {layer}: unsupported layer type {layer_type!r} "
                f"(supported: {', '.join(_KIND_OF_LAYER_TYPE)})"
            )
        by_kind[kind].append(layer)
    kinds = [(kind, layers) for kind, layers in by_kind.items() if layers]
    size = _group_size([len(layers) for _, layers in kinds])
    groups = []
    for kind, layers in kinds:
        window = sliding_window if kind == "sliding" else None
        num_groups = -(-len(layers) // size)
        groups += [KVGroupSpec(kind, window, tuple(layers[i::num_groups])) for i in range(num_groups)]
    return KVLayout(tuple(groups), size)


def readable_table(table: Sequence[int]) -> Sequence[int]:
    """A block table with its null entries (``NULL_BLOCK_ID``: they only lead a sliding group's table)
    replaced by the row's first valid block: a gather may read them (padding, a view's leading blocks)
    but the mask discards them, and 0 x NaN is NaN, so they must hold this request's own bytes."""
    if not table or table[0] != NULL_BLOCK_ID:
        return table
    fill = next(b for b in table if b != NULL_BLOCK_ID)
    return [fill if b == NULL_BLOCK_ID else b for b in table]
