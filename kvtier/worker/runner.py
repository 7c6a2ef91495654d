"""Model runner: owns the device KV pool and turns a ``SchedulerOutput`` into one forward pass.

The pool holds blocks of ``layout.layers_per_group`` layer slots; every KV group's blocks are the same
size and share it (``kvtier/kv/groups.py``). A step's metadata is one ``AttentionMetadata`` per group,
built from each scheduled sequence's table in that group (``ScheduledSeq.block_tables[g]``)::

    position p of a sequence, group g   ->  written at block tables[g][p // BS], offset p % BS
    group g's decode / prefill tables    ->  tables[g], null entries (a sliding group's released
                                             blocks, NULL_BLOCK_ID) replaced by the row's first block:
                                             masked and never read, but never another request's bytes

The groups share the step's tokens, positions, slot offsets and masks; only the block ids differ. A
dense model is one group: one metadata, exactly the objects it had before the groups.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from kvtier.kv.groups import NULL_BLOCK_ID, KVLayout
from kvtier.models.attention import AttentionMetadata, DecodeGroup, PrefillGroup
from kvtier.models.kv_quant import KVFormat, PagedKVCache
from kvtier.models.llama import LlamaModel
from kvtier.scheduler.scheduler import ScheduledSeq, SchedulerOutput
from kvtier.sequence import Sequence, TokenLogprobs
from kvtier.worker.sampler import prompt_logprobs

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def allocate_kv_pool(
    model: LlamaModel,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    kv_dtype: str | None = None,
    layout: KVLayout | None = None,
) -> PagedKVCache:
    """The zeroed device pool: raw [num_blocks, S, BS, 2, KVH, D] in ``kv_dtype`` (default: the model's
    dtype), S = the layer slots of a KV group's block (``layout``, default the model's: a dense model's
    S is its layer count), or its compact form for fp8_e4m3/fp8_e5m2/int8 (``kvtier/models/kv_quant.py``)."""
    c = model.config
    slots = (layout or model.kv_layout).layers_per_group
    fmt = KVFormat(kv_dtype or _DTYPE_NAMES[model.dtype], model.dtype)
    return PagedKVCache(fmt, num_blocks, (slots, block_size, c.num_kv_heads, c.head_dim), device)


def readable_table(table: Seq[int]) -> Seq[int]:
    """A block table with its null entries (``NULL_BLOCK_ID``: they only lead a sliding group's table)
    replaced by the row's first valid block: a gather may read them (padding, a view's leading blocks)
    but the mask discards them, and 0 x NaN is NaN, so they must hold this request's own bytes."""
    if not table or table[0] != NULL_BLOCK_ID:
        return table
    fill = next(b for b in table if b != NULL_BLOCK_ID)
    return [fill if b == NULL_BLOCK_ID else b for b in table]


PROMPT_LOGITS_ROWS = 256  # prompt-logprob rows turned into logits at once ([256, V] float32: ~50 MB)


@dataclass
class StepLogits:
    """What a forward pass hands to sampling: the logits of the rows that sample, and the prompt
    logprobs it computed (``SamplingParams.prompt_logprobs``), per sequence, in prompt order."""

    logits: torch.Tensor  # [N, V] float32: the scheduled seqs whose ``samples`` is True, in row order
    prompt_logprobs: list[tuple[Sequence, list[TokenLogprobs]]] = field(default_factory=list)


@dataclass(frozen=True)
class _PromptRows:
    """Rows [row, row + count) of the step's hidden states predict prompt tokens first..first+count-1."""

    seq: Sequence
    row: int
    first: int
    count: int


def _prompt_rows(s: ScheduledSeq, row: int) -> _PromptRows | None:
    """The rows of chunk ``s`` (its first token at hidden row ``row``) whose logits give prompt tokens
    still lacking a logprob: position p predicts token p + 1, for tokens up to the prompt's last."""
    seq = s.seq
    if not seq.needs_prompt_logprobs:
        return None
    assert seq.prompt_logprobs is not None
    c, have = s.num_computed_tokens, len(seq.prompt_logprobs)
    lo, hi = max(c, have - 1), min(c + s.num_new_tokens, seq.num_prompt_tokens - 1)
    if lo != have - 1 or hi <= lo:  # nothing new here (a gap cannot be: its prefill took no cache hit)
        return None
    return _PromptRows(seq, row + lo - c, lo + 1, hi - lo)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: str | None = None,
        layout: KVLayout | None = None,
    ):
        """``layout``: the KV groups the block manager keeps (None: the model's own); it must be the
        model's, whose layers read and write the slots it names."""
        if layout is not None and layout != model.kv_layout:
            raise ValueError("the KV layout differs from the model's (layer slots would not match)")
        self.model = model
        self.block_size = block_size
        self.device = device
        self.num_groups = model.kv_layout.num_groups
        self.cache = allocate_kv_pool(model, num_blocks, block_size, device, kv_dtype)
        self.kv_cache = self.cache.raw  # [NB, *block_shape]: the bytes the tiers move, block by block

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: whole blocks (every layer) from src to dst, one indexed copy."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
        self.kv_cache.index_copy_(0, dst, self.kv_cache.index_select(0, src))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepLogits:
        """Run the step: logits [N, V] (float32) for the scheduled seqs whose ``samples`` is True, in
        row order (decodes, then prefills), and the prompt logprobs of the chunks that want them."""
        self.copy_blocks(out.block_copies)
        input_ids, positions, meta, logits_rows = self._prepare(out)
        hidden = self.model.forward(input_ids, positions, self.cache, meta)  # [T, hidden]
        wanted = [r for r in self._prompt_rows(out) if r is not None]
        found = [(r.seq, self._prompt_logprobs(hidden, r)) for r in wanted]
        if len(logits_rows) != hidden.shape[0]:
            hidden = hidden.index_select(0, torch.tensor(logits_rows, dtype=torch.long, device=self.device))
        return StepLogits(self.model.compute_logits(hidden), found)

    @staticmethod
    def _prompt_rows(out: SchedulerOutput) -> list[_PromptRows | None]:
        """Each chunk's prompt-logprob rows, its first token's row counted as ``_prepare`` lays them out."""
        rows = [_prompt_rows(s, i) for i, s in enumerate(out.decodes)]
        start = len(out.decodes)
        for s in out.prefills:
            rows.append(_prompt_rows(s, start))
            start += s.num_new_tokens
        return rows

    def _prompt_logprobs(self, hidden: torch.Tensor, r: _PromptRows) -> list[TokenLogprobs]:
        k = r.seq.params.prompt_logprobs or 0
        targets = r.seq.token_ids[r.first : r.first + r.count]
        entries: list[TokenLogprobs] = []
        for i in range(0, r.count, PROMPT_LOGITS_ROWS):  # bounded memory: [rows, V] at a time
            n = min(PROMPT_LOGITS_ROWS, r.count - i)
            logits = self.model.compute_logits(hidden[r.row + i : r.row + i + n])
            entries += prompt_logprobs(logits.float(), targets[i : i + n], k)
        return entries

    # ----------------------------------------------------------------------------------------
    def _prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[AttentionMetadata, ...], list[int]]:
        """The step's tokens [T], positions [T], one metadata per KV group, and the rows that sample."""
        ids: list[int] = []
        pos: list[int] = []
        logits_rows: list[int] = []
        for s in out.decodes:
            p = s.num_computed_tokens
            ids.append(s.seq.token_ids[p])
            pos.append(p)
            if s.samples:  # a 1-token chunk in the middle of a prompt yields no logits
                logits_rows.append(len(ids) - 1)
        for s in out.prefills:
            c, n = s.num_computed_tokens, s.num_new_tokens
            ids.extend(s.seq.token_ids[c : c + n])
            pos.extend(range(c, c + n))
            if s.samples:
                logits_rows.append(len(ids) - 1)
        first = self._metadata(out, 0, None)
        metas = (first, *(self._metadata(out, g, first) for g in range(1, self.num_groups)))
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        return input_ids, positions, metas, logits_rows

    def _metadata(self, out: SchedulerOutput, g: int, like: AttentionMetadata | None) -> AttentionMetadata:
        """KV group ``g``'s metadata: its slot mapping and block tables. ``like`` (group 0's, this step):
        the slot offsets and masks to share (they do not depend on the group)."""
        bs, dev = self.block_size, self.device
        slot_blocks: list[int] = []
        offsets: list[int] = []
        for s in out.decodes:
            p = s.num_computed_tokens
            slot_blocks.append(s.block_tables[g][p // bs])
            offsets.append(p % bs)
        decode = None
        if out.decodes:
            decode = self._decode_group(out.decodes, g, None if like is None else like.decode)
        prefills: list[PrefillGroup] = []
        start = len(out.decodes)
        for k, s in enumerate(out.prefills):
            c, n, table = s.num_computed_tokens, s.num_new_tokens, s.block_tables[g]
            slot_blocks.extend(table[p // bs] for p in range(c, c + n))
            if like is None:
                offsets.extend(p % bs for p in range(c, c + n))
            prefills.append(
                self._prefill_group(start, c, n, table, None if like is None else like.prefills[k])
            )
            start += n
        return AttentionMetadata(
            slot_block_ids=torch.tensor(slot_blocks, dtype=torch.long, device=dev),
            slot_offsets=torch.tensor(offsets, dtype=torch.long, device=dev)
            if like is None
            else like.slot_offsets,
            decode=decode,
            prefills=prefills,
        )

    def _prefill_group(
        self, start: int, c: int, n: int, table: Seq[int], like: PrefillGroup | None
    ) -> PrefillGroup:
        """A chunk of ``n`` tokens after ``c`` cached ones, its first row ``start``, over ``table``."""
        if c == 0:
            return PrefillGroup(start, n, 0, None, None)
        dev = self.device
        num_blocks = -(-(c + n) // self.block_size)
        rows = torch.tensor(readable_table(table[:num_blocks]), dtype=torch.long, device=dev)
        if like is not None:
            return PrefillGroup(start, n, c, rows, like.mask)
        q_pos = torch.arange(c, c + n, device=dev)
        mask = torch.arange(c + n, device=dev)[None, :] <= q_pos[:, None]  # [n, c+n]
        return PrefillGroup(start, n, c, rows, mask)

    def _decode_group(self, decodes: list[ScheduledSeq], g: int, like: DecodeGroup | None) -> DecodeGroup:
        """The decode rows over group ``g``'s tables, padded to the longest context (``like``: the same
        rows' group in another KV group, whose sizes and mask it shares)."""
        if like is None:
            context_lens = [s.num_computed_tokens + 1 for s in decodes]
            max_context = max(context_lens)
            max_blocks = -(-max_context // self.block_size)
            mask = None
            if len(decodes) > 1 and min(context_lens) != max_context:
                lens = torch.tensor(context_lens, device=self.device)
                mask = (torch.arange(max_context, device=self.device)[None, :] < lens[:, None])[
                    :, None, None, :
                ]
        else:
            max_context, max_blocks, mask = like.max_context, like.max_blocks, like.mask
        table: list[int] = []
        for s in decodes:
            row = list(readable_table(s.block_tables[g][:max_blocks]))
            # padding is masked out, but a zero weight times NaN is NaN: pad with the sequence's own
            # first block, so one request's corrupt block never reaches another's attention
            table.extend(row + row[:1] * (max_blocks - len(row)))
        return DecodeGroup(
            num_seqs=len(decodes),
            block_tables=torch.tensor(table, dtype=torch.long, device=self.device),
            max_blocks=max_blocks,
            max_context=max_context,
            mask=mask,
        )
