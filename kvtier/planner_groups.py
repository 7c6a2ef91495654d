"""``kvtier plan`` for a hybrid model: the engine's KV groups, counted at one context length.

A hybrid model (Gemma 3: every 6th layer full attention, the others a sliding window of W tokens) keeps
its KV in groups of equal layer slots (``kvtier/kv/groups.py``, the layout the engine allocates). A full
group holds every token of a sequence; a sliding group only the blocks its window still reaches. Every
number here comes from that module's functions, for the model's own layout and for the same model with
every layer full (the comparison the plan prints)::

    per group      bytes per token    KVLayout.group_bytes_per_token(layer bytes)
                   bytes held at N    KVLayout.kv_bytes_held_by_group(N, B, layer bytes)
    one sequence   bytes held at N    KVLayout.kv_bytes_held(N, B, layer bytes)
    the pool       blocks             pool bytes // KVLayout.block_bytes(B, layer bytes)
                   sequences at N     KVLayout.max_sequences(blocks, N, B)
                   longest sequence   KVLayout.max_tokens(blocks, B)

``layer bytes`` is K and V of one token in one layer on one device (``kvtier.planner.kv_bytes`` of one
layer), ``B`` the block size in tokens. Pure arithmetic: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.kv.groups import KVLayout, kv_layout


@dataclass(frozen=True)
class GroupRow:
    """One KV group at the deployment's context, per device."""

    kind: str  # "full" or "sliding"
    window: int | None  # tokens a sliding layer attends to; None for full attention
    layers: tuple[int, ...]  # the model layers in its slots
    bytes_per_token: int  # one token in this group's block (every slot, padded ones included)
    blocks_held: int  # blocks one context-long sequence keeps in this group
    bytes_held: int  # blocks_held x block bytes


@dataclass(frozen=True)
class VsAllFull:
    """The hybrid layout against the same model with every layer full, at the deployment's context
    and on the same device pool (per device)."""

    seq_bytes: int  # KV one sequence holds, hybrid
    all_full_seq_bytes: int  # the same with every layer full
    bytes_ratio: float  # seq_bytes / all_full_seq_bytes
    max_seqs: int  # concurrent sequences the pool holds, hybrid
    all_full_max_seqs: int  # the same with every layer full
    concurrency_gain: float  # max_seqs / all_full_max_seqs (inf when all-full holds none)


@dataclass(frozen=True)
class GroupedKV:
    """What the engine's KV groups hold for ``context``-token sequences on one device."""

    groups: tuple[GroupRow, ...]
    slots_per_group: int
    seq_bytes: int  # one sequence, every group
    num_blocks: int  # the pool's blocks
    max_seqs: int  # concurrent sequences the pool holds
    max_tokens: int  # the longest one sequence the pool holds
    vs_all_full: VsAllFull


def all_full_layout(num_layers: int) -> KVLayout:
    """The same model with every layer full attention: one group, slot = layer."""
    return kv_layout(("full_attention",) * num_layers, None)


def grouped_kv(
    layout: KVLayout, num_layers: int, context: int, block_size: int, layer_bytes: int, pool_bytes: float
) -> GroupedKV:
    """Count ``layout``'s groups at ``context`` tokens with ``layer_bytes`` per token and layer, on a pool
    of ``pool_bytes`` (all per device)."""
    per_group = layout.kv_bytes_held_by_group(context, block_size, layer_bytes)
    rows = tuple(
        GroupRow(
            kind=spec.kind,
            window=spec.window,
            layers=spec.layers,
            bytes_per_token=layout.group_bytes_per_token(layer_bytes),
            blocks_held=blocks,
            bytes_held=held,
        )
        for spec, blocks, held in zip(
            layout.groups, layout.blocks_held_by_group(context, block_size), per_group, strict=True
        )
    )
    num_blocks = int(pool_bytes // layout.block_bytes(block_size, layer_bytes))
    max_seqs = layout.max_sequences(num_blocks, context, block_size)
    full = all_full_layout(num_layers)
    full_seq = full.kv_bytes_held(context, block_size, layer_bytes)
    full_seqs = full.max_sequences(
        int(pool_bytes // full.block_bytes(block_size, layer_bytes)), context, block_size
    )
    seq = layout.kv_bytes_held(context, block_size, layer_bytes)
    vs = VsAllFull(
        seq_bytes=seq,
        all_full_seq_bytes=full_seq,
        bytes_ratio=seq / full_seq,
        max_seqs=max_seqs,
        all_full_max_seqs=full_seqs,
        concurrency_gain=max_seqs / full_seqs if full_seqs else float("inf"),
    )
    return GroupedKV(
        rows, layout.slots_per_group, seq, num_blocks, max_seqs, layout.max_tokens(num_blocks, block_size), vs
    )


def render_groups(
    groups: tuple[GroupRow, ...],
    vs: VsAllFull,
    slots_per_group: int,
    context: int,
    block_size: int,
    per_device: str,
) -> list[str]:
    """The KV group lines of ``kvtier plan`` for a hybrid model (``per_device``: " per device" or "")."""
    ctx = f"{context:,}"
    names = [" ".join(str(layer) for layer in row.layers) for row in groups]
    width = max(20, *map(len, names))
    lines = [
        "",
        f"  KV groups (kvtier/kv/groups.py): {len(groups)} groups x {slots_per_group} layer slots, "
        f"{block_size}-token blocks{per_device}",
        f"    {'group':>5}  {'kind':<8} {'window':>6}  {'layers':<{width}} {'B/token':>8}  at {ctx} tokens",
    ]
    for g, (row, layers) in enumerate(zip(groups, names, strict=True)):
        window = f"{row.window:,}" if row.window is not None else "-"
        grows = "grows with the context" if row.window is None else "capped by the window"
        lines.append(
            f"    {g:>5}  {row.kind:<8} {window:>6}  {layers:<{width}} {row.bytes_per_token:>8,}  "
            f"{row.blocks_held:>6,} blocks = {row.bytes_held:>13,} B  {grows}"
        )
    gain = f"{vs.concurrency_gain:,.2f}x" if vs.all_full_max_seqs else "all-full holds none"
    held, full_held = f"{vs.seq_bytes:,} B", f"{vs.all_full_seq_bytes:,} B"
    seqs, full_seqs = f"{vs.max_seqs:,}", f"{vs.all_full_max_seqs:,}"
    lines += [
        f"  vs every layer full, at {ctx} tokens on the same KV pool{per_device}:",
        f"    one sequence holds    {held} vs {full_held} = {vs.bytes_ratio:.3f}x",
        f"    the KV pool fits      {seqs} vs {full_seqs} concurrent sequences = {gain}",
    ]
    return lines
