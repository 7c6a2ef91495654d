"""CUDA graphs for decode-shaped steps: one replay instead of ~500 kernel launches from Python.

A step is *decode-shaped* when each of its rows is one token whose context is in the pool once the
step's K/V are written: a decode, or a short prefill chunk after cached tokens (a prefix hit's last
block) whose tokens become rows, token ``p`` attending to positions ``< p + 1``. Such a step runs the
Triton decode kernel over ``rows`` rows, padded to a bucket whose forward was captured once::

    buckets  1 2 4 8 16 32 64 128 256 rows (up to the step's token budget), captured at start
    static   meta    [4 + G, max_rows] int64: token ids, positions, slot offsets, context lengths, and
                     each KV group's slot blocks
             tables  [G, max_rows, max_blocks] int64: each row's block table in each KV group (a row
                     reads only the blocks its context reaches; a sliding layer only its window's)
    a step   staged in one upload (``StepStaging``), copied into the leading rows and columns of the
             static tensors, then the bucket's graph replays; its hidden states [rows, hidden] come back
             (the logits are computed eagerly, for the rows that sample)
    padding  rows past the step's: token 0 at position 0, written to the pool's spare block (never a
             sequence's), a context of 1

Why: on an H200 a batch-1 decode step of a 1B model launched ~490 kernels (RMSNorm, RoPE, the KV write,
four GEMMs, attention, per layer) from Python, 17 ms of host time around ~2 ms of device work; a host-
tier hit's time to first token was the same eager step.

Only on CUDA with the Triton backend (Llama, Qwen3, and Gemma 3's KV groups: the decode kernel starts a
sliding layer's keys at its window itself); another backend, ``--enforce-eager`` or a CPU run every step
eagerly. A capture that fails logs once and leaves every step eager. The decode kernel's parts per row
are fixed at capture for ``max_context`` (a short context leaves parts empty): a graph never recompiles.
``capture=False`` runs the same padded static step eagerly: how the tests check the padding and the
row layout on a CPU (through Triton's interpreter).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtier.kv.groups import readable_table
from kvtier.models.attention import AttentionMetadata, DecodeGroup
from kvtier.models.kv_quant import PagedKVCache
from kvtier.models.llama import LlamaModel
from kvtier.scheduler.scheduler import SchedulerOutput
from kvtier.worker.staging import StepStaging

logger = logging.getLogger("kvtier.graphs")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_CHUNK_ROWS = 32  # a prefill chunk after cached tokens of at most this many tokens runs as rows


@dataclass
class Rows:
    """A decode-shaped step, row by row (decodes first, then each chunk's tokens in order: the eager
    step's row layout, so prompt-logprob rows are the same), over ``num_groups`` KV groups."""

    num_groups: int = 1
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)  # context length, the row's own token included
    slot_blocks: list[list[int]] = field(default_factory=list)  # [G][rows] where each row's K/V goes
    tables: list[list[Sequence[int]]] = field(default_factory=list)  # [G][rows] (shared by a chunk's)
    logits_rows: list[int] = field(default_factory=list)  # the rows that sample

    def __post_init__(self) -> None:
        self.slot_blocks = [[] for _ in range(self.num_groups)]
        self.tables = [[] for _ in range(self.num_groups)]

    def add(self, token: int, position: int, tables: Sequence[Sequence[int]], block_size: int) -> None:
        """One row: ``tables`` holds the sequence's table of every KV group (``readable_table``'s)."""
        self.ids.append(token)
        self.positions.append(position)
        self.lens.append(position + 1)
        for g, table in enumerate(tables):
            self.slot_blocks[g].append(table[position // block_size])
            self.tables[g].append(table)


def graph_rows(out: SchedulerOutput, block_size: int, max_rows: int, num_groups: int = 1) -> Rows | None:
    """``out`` as rows when it is decode-shaped and fits ``max_rows``; None: run it eagerly."""
    if len(out.decodes) + sum(s.num_new_tokens for s in out.prefills) > max_rows:
        return None
    if any(s.num_computed_tokens == 0 or s.num_new_tokens > MAX_CHUNK_ROWS for s in out.prefills):
        return None
    rows = Rows(num_groups)
    for s in out.decodes:
        p = s.num_computed_tokens
        rows.add(s.seq.token_ids[p], p, _readable(s.block_tables, num_groups), block_size)
        if s.samples:
            rows.logits_rows.append(len(rows.ids) - 1)
    for s in out.prefills:
        c, n, tables = s.num_computed_tokens, s.num_new_tokens, _readable(s.block_tables, num_groups)
        for p in range(c, c + n):
            rows.add(s.seq.token_ids[p], p, tables, block_size)
        if s.samples:
            rows.logits_rows.append(len(rows.ids) - 1)
    return rows


def _readable(tables: Sequence[Sequence[int]], num_groups: int) -> list[Sequence[int]]:
    """Each group's table with a sliding group's null entries (released blocks, never read: they lie
    before the window) replaced by a block of the sequence's own."""
    return [readable_table(tables[g]) for g in range(num_groups)]


class StepGraphs:
    """The captured forwards of every bucket over static inputs, and the step that fills them."""

    def __init__(
        self,
        model: LlamaModel,
        cache: PagedKVCache,
        spare_block: int,  # a pool block no sequence owns: the padding rows write there
        max_rows: int,
        max_context: int,  # the longest context a row may have (the engine's max_model_len)
        capture: bool = True,
    ) -> None:
        self.model, self.cache, self.spare_block = model, cache, spare_block
        self.num_groups = model.kv_layout.num_groups
        self.block_size = cache.block_size
        self.max_context = max_context
        top = min(max_rows, BUCKETS[-1])
        self.buckets = tuple(b for b in BUCKETS if b < top) + (top,)
        self.max_rows = self.buckets[-1]
        self.max_blocks = -(-max_context // self.block_size)
        dev = cache.raw.device
        pad = self._pad_column()  # [4 + G, R]: ids, positions, offsets, lens, each group's slot blocks
        self.meta = torch.tensor(pad, dtype=torch.long)[:, None].repeat(1, self.max_rows).to(dev)
        self.tables = torch.full(  # [G, R, max_blocks]: each group's block table of each row
            (self.num_groups, self.max_rows, self.max_blocks), spare_block, dtype=torch.long, device=dev
        )
        self.capture = capture
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}

    def _pad_column(self) -> list[int]:
        """A padding row: token 0, position 0, offset 0, a context of 1, the spare block in every group."""
        return [0, 0, 0, 1] + [self.spare_block] * self.num_groups

    # ------------------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket's forward, smallest first (on CUDA; otherwise note them as eager)."""
        for b in self.buckets:
            self._graphs[b] = self._capture(b) if self.capture else (None, None)

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: kernels compiled, cuBLAS's workspace made (padding rows)
            for _ in range(2):
                self._forward(b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hidden = self._forward(b)
        return graph, hidden

    def _forward(self, b: int) -> torch.Tensor:  # [b, hidden]
        """The model over the first ``b`` static rows, as decode rows of every KV group."""
        metas = []
        for g in range(self.num_groups):
            decode = DecodeGroup(
                num_seqs=b,
                block_tables=self.tables[g, :b].reshape(-1),
                max_blocks=self.max_blocks,
                max_context=self.max_context,
                mask=None,
            )
            decode._lens = self.meta[3, :b]
            metas.append(AttentionMetadata(self.meta[4 + g, :b], self.meta[2, :b], decode, []))
        return self.model.forward(self.meta[0, :b], self.meta[1, :b], self.cache, tuple(metas))

    # ------------------------------------------------------------------------------ a step
    def bucket(self, num_rows: int) -> int:
        return next(b for b in self.buckets if b >= num_rows)

    @torch.inference_mode()
    def run(self, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of the step's rows [n, hidden], and of the rows that sample [N, hidden]."""
        n = len(rows.ids)
        b = self.bucket(n)
        width = -(-max(rows.lens) // self.block_size)  # the blocks a row may read
        pad = b - n
        stage = StepStaging()
        offsets = [p % self.block_size for p in rows.positions]
        columns = (rows.ids, rows.positions, offsets, rows.lens, *rows.slot_blocks)  # meta's rows
        meta = stage.add(v for column, fill in zip(columns, self._pad_column(), strict=True)
                         for v in column + [fill] * pad)  # fmt: skip
        groups = range(self.num_groups)
        tables = stage.add_table(
            [t for g in groups for t in table_rows(rows.tables[g], pad, self.spare_block)], width
        )
        sampled = stage.add(rows.logits_rows)
        stage.upload(self.meta.device)
        self.meta[:, :b].copy_(stage.get(meta).view(len(columns), b))
        self.tables[:, :b, :width].copy_(stage.get(tables).view(self.num_groups, b, width))
        graph, hidden = self._graphs[b]
        if graph is None:
            hidden = self._forward(b)
        else:
            graph.replay()
            gate = self.cache.gate  # captured with the layered loads' waits: note them as eager ones are
            if gate is not None and gate.armed:
                gate.waited.extend(slot for _, slot in self.model.kv_slots)
        assert hidden is not None
        rows_hidden = hidden[:n]
        if len(rows.logits_rows) == n:
            return rows_hidden, rows_hidden
        return rows_hidden, rows_hidden.index_select(0, stage.get(sampled))


def table_rows(tables: Sequence[Sequence[int]], pad: int, spare: int) -> list[Sequence[int]]:
    """A group's rows for ``StepStaging.add_table`` ([rows + pad, width]: each row cut to the blocks read,
    or padded with its own first block, never read past its context length), then ``pad`` rows of the
    spare block that the padding rows write to."""
    return [*tables, *[(spare,)] * pad]


def try_capture(graphs: StepGraphs) -> StepGraphs | None:
    """``graphs`` with every bucket captured, or None (logged once) when capture fails: steps stay eager."""
    try:
        graphs.capture_all()
    except Exception as exc:  # a capture that fails must never take the engine down
        logger.warning("CUDA graphs off, every step runs eagerly: capture failed (%s)", exc)
        return None
    return graphs
