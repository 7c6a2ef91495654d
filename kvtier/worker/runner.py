"""Model runner: owns the device KV pool and turns a ``SchedulerOutput`` into one forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier.models.attention import AttentionMetadata, DecodeGroup, PrefillGroup
from kvtier.models.kv_quant import KVFormat, PagedKVCache
from kvtier.models.llama import LlamaModel
from kvtier.scheduler.scheduler import ScheduledSeq, SchedulerOutput
from kvtier.sequence import Sequence, TokenLogprobs
from kvtier.worker.sampler import prompt_logprobs

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def allocate_kv_pool(
    model: LlamaModel, num_blocks: int, block_size: int, device: torch.device, kv_dtype: str | None = None
) -> PagedKVCache:
    """The zeroed device pool: raw [num_blocks, L, BS, 2, KVH, D] in ``kv_dtype`` (default: the model's
    dtype), or its compact form for fp8_e4m3/fp8_e5m2/int8 (``kvtier/models/kv_quant.py``)."""
    c = model.config
    fmt = KVFormat(kv_dtype or _DTYPE_NAMES[model.dtype], model.dtype)
    return PagedKVCache(fmt, num_blocks, (c.num_layers, block_size, c.num_kv_heads, c.head_dim), device)


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
    ):
        self.model = model
        self.block_size = block_size
        self.device = device
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
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        dev = self.device
        ids: list[int] = []
        pos: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        logits_rows: list[int] = []

        decode = None
        if out.decodes:
            decode = self._decode_group(out.decodes)
            for s in out.decodes:
                p = s.num_computed_tokens
                ids.append(s.seq.token_ids[p])
                pos.append(p)
                slot_blocks.append(s.block_ids[p // bs])
                slot_offsets.append(p % bs)
                if s.samples:  # a 1-token chunk in the middle of a prompt yields no logits
                    logits_rows.append(len(ids) - 1)

        prefills: list[PrefillGroup] = []
        for s in out.prefills:
            start, c, n = len(ids), s.num_computed_tokens, s.num_new_tokens
            ids.extend(s.seq.token_ids[c : c + n])
            pos.extend(range(c, c + n))
            slot_blocks.extend(s.block_ids[p // bs] for p in range(c, c + n))
            slot_offsets.extend(p % bs for p in range(c, c + n))
            if s.samples:
                logits_rows.append(len(ids) - 1)
            if c == 0:
                prefills.append(PrefillGroup(start, n, 0, None, None))
            else:
                num_blocks = -(-(c + n) // bs)
                table = torch.tensor(s.block_ids[:num_blocks], dtype=torch.long, device=dev)
                q_pos = torch.arange(c, c + n, device=dev)
                mask = torch.arange(c + n, device=dev)[None, :] <= q_pos[:, None]  # [n, c+n]
                prefills.append(PrefillGroup(start, n, c, table, mask))

        meta = AttentionMetadata(
            slot_block_ids=torch.tensor(slot_blocks, dtype=torch.long, device=dev),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=dev),
            decode=decode,
            prefills=prefills,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        return input_ids, positions, meta, logits_rows

    def _decode_group(self, decodes: list[ScheduledSeq]) -> DecodeGroup:
        bs = self.block_size
        context_lens = [s.num_computed_tokens + 1 for s in decodes]
        max_context = max(context_lens)
        max_blocks = -(-max_context // bs)
        table: list[int] = []
        for s in decodes:
            row = list(s.block_ids[:max_blocks])
            # padding is masked out, but a zero weight times NaN is NaN: pad with the sequence's own
            # first block, so one request's corrupt block never reaches another's attention
            table.extend(row + row[:1] * (max_blocks - len(row)))
        mask = None
        if len(decodes) > 1 and min(context_lens) != max_context:
            lens = torch.tensor(context_lens, device=self.device)
            mask = (torch.arange(max_context, device=self.device)[None, :] < lens[:, None])[:, None, None, :]
        return DecodeGroup(
            num_seqs=len(decodes),
            block_tables=torch.tensor(table, dtype=torch.long, device=self.device),
            max_blocks=max_blocks,
            max_context=max_context,
            mask=mask,
        )
