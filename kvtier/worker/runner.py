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

A step is built in two passes: ``_plan`` gathers every integer list (tokens, positions, slot mapping,
block tables, context lengths, sampling rows, copy-on-write pairs) as Python ints into one
``StepStaging`` (``kvtier/worker/staging.py``), which goes to the device in ONE transfer (pinned and
asynchronous on CUDA); ``_build`` then makes the metadata from views of that one tensor, its masks
built on the device. No other host-to-device copy happens in ``execute``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier.kv.groups import KVLayout, readable_table
from kvtier.models.attention import AttentionMetadata, DecodeGroup, PrefillGroup
from kvtier.models.kv_quant import KVFormat, PagedKVCache
from kvtier.models.llama import LlamaModel
from kvtier.scheduler.scheduler import ScheduledSeq, SchedulerOutput
from kvtier.sequence import Sequence, TokenLogprobs
from kvtier.worker.graphs import Rows, StepGraphs, graph_rows, try_capture
from kvtier.worker.sampler import prompt_logprobs
from kvtier.worker.staging import StepStaging

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


@dataclass
class _DecodePlan:
    """The decode rows' sizes and staged parts (``StepStaging`` handles), shared by the KV groups."""

    num_seqs: int
    max_blocks: int
    max_context: int
    lens: int | None  # [B] context lengths, the mask's; None: every row has max_context tokens (no mask)
    tables: tuple[int, ...]  # per KV group: [B * max_blocks] padded block tables
    host_lens: tuple[int, ...] | None  # the same lengths as host ints (with ``lens``)


@dataclass
class _ChunkPlan:
    """A prefill chunk: ``num_tokens`` rows from ``start``, after ``num_cached`` cached tokens."""

    start: int
    num_tokens: int
    num_cached: int
    tables: tuple[int, ...] | None  # per KV group: [n_blocks] its block table; None: nothing cached


@dataclass
class _StepPlan:
    """A step's integer metadata as ``StepStaging`` handles: gathered on the host, uploaded at once."""

    ids: int  # [T] token ids
    positions: int  # [T]
    offsets: int  # [T] slot offsets (every KV group's)
    slot_blocks: tuple[int, ...]  # per KV group: [T] block each new token's K/V is written to
    decode: _DecodePlan | None
    chunks: list[_ChunkPlan]
    logits_rows: int | None  # [N] the rows that sample; None: every row does


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
        self.cache = allocate_kv_pool(model, num_blocks + 1, block_size, device, kv_dtype)
        self.kv_cache = self.cache.raw[:num_blocks]  # [NB, *block_shape]: the bytes the tiers move
        self.spare_block = num_blocks  # owned by no sequence: the padding rows of a graph write there
        self.graphs: StepGraphs | None = None  # CUDA graphs of decode-shaped steps (``use_graphs``)

    def use_graphs(self, max_rows: int, max_context: int, capture: bool = True) -> bool:
        """Run decode-shaped steps of up to ``max_rows`` rows through captured forwards
        (``kvtier/worker/graphs.py``); False, logged, when capture fails (steps stay eager).
        ``capture=False``: the same padded static steps, eagerly (how a CPU test runs them)."""
        graphs = StepGraphs(self.model, self.cache, self.spare_block, max_rows, max_context, capture)
        self.graphs = try_capture(graphs)
        return self.graphs is not None

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: whole blocks (every layer) from src to dst, one indexed copy (the block ids in
        one transfer; ``execute`` folds them into the step's own)."""
        if not copies:
            return
        stage = StepStaging()
        pairs = self._stage_copies(stage, copies)
        stage.upload(self.device)
        self._copy_staged(stage, pairs)

    @staticmethod
    def _stage_copies(stage: StepStaging, copies: list[tuple[int, int]]) -> tuple[int, int] | None:
        """Stage the src and dst block ids of ``copies``: their handles; None when there are none."""
        if not copies:
            return None
        return stage.add(c[0] for c in copies), stage.add(c[1] for c in copies)

    def _copy_staged(self, stage: StepStaging, pairs: tuple[int, int] | None) -> None:
        if pairs is not None:
            self.settle_loads()  # a copied block may be one a layered plan is loading
            src, dst = stage.get(pairs[0]), stage.get(pairs[1])
            self.kv_cache.index_copy_(0, dst, self.kv_cache.index_select(0, src))

    def settle_loads(self) -> None:
        """The compute stream waits for every layered load in flight (``kvtier/models/slot_gate.py``):
        what a reader of the pool other than the forward's layers calls first."""
        if self.cache.gate is not None:
            self.cache.gate.settle()

    def execute(self, out: SchedulerOutput) -> StepLogits:
        """Run the step: logits [N, V] (float32) for the scheduled seqs whose ``samples`` is True, in
        row order (decodes, then prefills), and the prompt logprobs of the chunks that want them. Its
        layers waited for their slots of a layered load; afterwards the compute stream has waited for
        all of it."""
        try:
            return self._execute(out)
        finally:
            self.settle_loads()

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput) -> StepLogits:
        """The step's integer metadata, copy-on-write pairs included, reaches the device in one transfer
        (``StepStaging``): gathered as Python ints, uploaded, then read through views."""
        graphs = self.graphs
        rows = None if graphs is None else graph_rows(out, self.block_size, graphs.max_rows, self.num_groups)
        if rows is not None:
            return self._execute_rows(out, rows)
        stage = StepStaging()
        copies = self._stage_copies(stage, out.block_copies)
        plan = self._plan(out, stage)
        stage.upload(self.device)
        self._copy_staged(stage, copies)  # before the step reads or writes the copied blocks
        input_ids, positions, meta = self._build(plan, stage)
        hidden = self.model.forward(input_ids, positions, self.cache, meta)  # [T, hidden]
        wanted = [r for r in self._prompt_rows(out) if r is not None]
        found = [(r.seq, self._prompt_logprobs(hidden, r)) for r in wanted]
        if plan.logits_rows is not None:
            hidden = hidden.index_select(0, stage.get(plan.logits_rows))
        return StepLogits(self.model.compute_logits(hidden), found)

    def _execute_rows(self, out: SchedulerOutput, rows: Rows) -> StepLogits:
        """A decode-shaped step through its bucket's graph (the same rows, logits and prompt logprobs)."""
        assert self.graphs is not None
        self.copy_blocks(out.block_copies)  # before the step reads or writes the copied blocks
        hidden, sampled = self.graphs.run(rows)
        wanted = [r for r in self._prompt_rows(out) if r is not None]
        found = [(r.seq, self._prompt_logprobs(hidden, r)) for r in wanted]
        return StepLogits(self.model.compute_logits(sampled), found)

    @staticmethod
    def _prompt_rows(out: SchedulerOutput) -> list[_PromptRows | None]:
        """Each chunk's prompt-logprob rows, its first token's row counted as ``_plan`` lays them out."""
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

    # ---------------------------------------------------------------------------- host side
    def _plan(self, out: SchedulerOutput, stage: StepStaging) -> _StepPlan:
        """Stage the step's tokens, positions, slot mapping, block tables, context lengths and sampling
        rows (decodes first, then prefill chunks), every list as Python ints."""
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
        bs, groups = self.block_size, range(self.num_groups)
        return _StepPlan(
            ids=stage.add(ids),
            positions=stage.add(pos),
            offsets=stage.add(p % bs for p in pos),
            slot_blocks=tuple(stage.add(self._slot_blocks(out, g)) for g in groups),
            decode=self._plan_decode(out.decodes, stage) if out.decodes else None,
            chunks=self._plan_chunks(out.prefills, len(out.decodes), stage),
            logits_rows=None if len(logits_rows) == len(ids) else stage.add(logits_rows),
        )

    def _slot_blocks(self, out: SchedulerOutput, g: int) -> list[int]:
        """[T] the block of KV group ``g`` each new token is written to (position p: tables[g][p // BS])."""
        bs = self.block_size
        blocks = [s.block_tables[g][s.num_computed_tokens // bs] for s in out.decodes]
        for s in out.prefills:
            c, n, table = s.num_computed_tokens, s.num_new_tokens, s.block_tables[g]
            blocks.extend(table[p // bs] for p in range(c, c + n))
        return blocks

    def _plan_decode(self, decodes: list[ScheduledSeq], stage: StepStaging) -> _DecodePlan:
        """The decode rows padded to the longest context, each KV group's tables staged (the lengths
        only when they differ: the mask's)."""
        context_lens = [s.num_computed_tokens + 1 for s in decodes]
        max_context = max(context_lens)
        max_blocks = -(-max_context // self.block_size)
        masked = len(decodes) > 1 and min(context_lens) != max_context
        tables = [
            stage.add_table([readable_table(s.block_tables[g]) for s in decodes], max_blocks)
            for g in range(self.num_groups)
        ]
        lens, host_lens = (stage.add(context_lens), tuple(context_lens)) if masked else (None, None)
        return _DecodePlan(len(decodes), max_blocks, max_context, lens, tuple(tables), host_lens)

    def _plan_chunks(self, prefills: list[ScheduledSeq], start: int, stage: StepStaging) -> list[_ChunkPlan]:
        """Each prefill chunk, its first row ``start`` on; a chunk after cached tokens stages each KV
        group's block table (the blocks of its ``c + n`` positions)."""
        chunks: list[_ChunkPlan] = []
        for s in prefills:
            c, n = s.num_computed_tokens, s.num_new_tokens
            tables = None
            if c > 0:
                num_blocks = -(-(c + n) // self.block_size)
                groups = range(self.num_groups)
                tables = tuple(stage.add(readable_table(s.block_tables[g][:num_blocks])) for g in groups)
            chunks.append(_ChunkPlan(start, n, c, tables))
            start += n
        return chunks

    # -------------------------------------------------------------------------- device side
    def _build(
        self, plan: _StepPlan, stage: StepStaging
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[AttentionMetadata, ...]]:
        """The step's tokens [T], positions [T] and one metadata per KV group, as views of the uploaded
        tensor. The groups share the slot offsets and the masks (the same objects); only block ids differ.
        Masks are built on the device (no transfer)."""
        offsets = stage.get(plan.offsets)
        lens, decode_mask = self._decode_mask(plan.decode, stage)
        chunk_masks = [self._chunk_mask(ch) for ch in plan.chunks]
        metas = tuple(
            AttentionMetadata(
                slot_block_ids=stage.get(plan.slot_blocks[g]),
                slot_offsets=offsets,
                decode=self._decode_group(plan.decode, g, lens, decode_mask, stage),
                prefills=[
                    self._prefill_group(ch, g, mask, stage)
                    for ch, mask in zip(plan.chunks, chunk_masks, strict=True)
                ],
            )
            for g in range(self.num_groups)
        )
        return stage.get(plan.ids), stage.get(plan.positions), metas

    def _decode_mask(
        self, plan: _DecodePlan | None, stage: StepStaging
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The decode rows' context lengths [B] and mask [B, 1, 1, max_context] (True = attend); (None,
        None) when there are no decode rows or every row has ``max_context`` tokens."""
        if plan is None or plan.lens is None:
            return None, None
        lens = stage.get(plan.lens)
        cols = torch.arange(plan.max_context, device=self.device)
        return lens, (cols[None, :] < lens[:, None])[:, None, None, :]

    def _chunk_mask(self, chunk: _ChunkPlan) -> torch.Tensor | None:
        """A chunk's causal mask [n, c + n] after its ``c`` cached tokens; None with nothing cached."""
        c, n, dev = chunk.num_cached, chunk.num_tokens, self.device
        if chunk.tables is None:
            return None
        q_pos = torch.arange(c, c + n, device=dev)
        return torch.arange(c + n, device=dev)[None, :] <= q_pos[:, None]  # [n, c+n]

    @staticmethod
    def _decode_group(
        plan: _DecodePlan | None,
        g: int,
        lens: torch.Tensor | None,
        mask: torch.Tensor | None,
        stage: StepStaging,
    ) -> DecodeGroup | None:
        """The decode rows over KV group ``g``'s tables (None: no decode rows)."""
        if plan is None:
            return None
        group = DecodeGroup(
            num_seqs=plan.num_seqs,
            block_tables=stage.get(plan.tables[g]),
            max_blocks=plan.max_blocks,
            max_context=plan.max_context,
            mask=mask,
        )
        if lens is not None:
            # the lengths the mask was built from, on the device (``context_lens()`` need not sum the
            # mask) and on the host (a sliding layer's window cut then reads no device value)
            group._lens, group._host_lens = lens, plan.host_lens
        return group

    @staticmethod
    def _prefill_group(
        chunk: _ChunkPlan, g: int, mask: torch.Tensor | None, stage: StepStaging
    ) -> PrefillGroup:
        """A chunk over KV group ``g``'s block table (none when nothing is cached: no gather)."""
        if chunk.tables is None:
            return PrefillGroup(chunk.start, chunk.num_tokens, 0, None, None)
        table = stage.get(chunk.tables[g])
        return PrefillGroup(chunk.start, chunk.num_tokens, chunk.num_cached, table, mask)
