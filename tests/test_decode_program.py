"""The decode program: a decode step's layers in one C call, bit for bit the Python layer loop.

The story: three sequences of different lengths are prefilled into scattered blocks, then decode
together for a few steps. Each step runs twice over the same cache: through the Python loop, then
through the program (which writes the same K/V to the same slots again): the hidden states are equal
bit for bit, for quantized weights (gguf Q4_1 / Q8_0, int8 with biases on qkv and o) and for dense
fp32 weights on the GEMV, over a float32 pool and over compact fp8/int8 pools (whose stored codes and
scales are the loop's too). Steps the program does not cover (a prefill chunk, a bf16 KV pool, a
dense weight on MKL, more rows than the GEMV takes) run the loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.models import qkernels, qpack
from kvtier.models.attention import AttentionMetadata, DecodeGroup, PrefillGroup
from kvtier.models.decode_program import DecodeProgram
from kvtier.models.kv_quant import KVFormat, PagedKVCache
from kvtier.models.llama import LlamaModel
from kvtier.models.loader import load_model
from kvtier.models.qlinear import GEMV_ROWS

pytestmark = pytest.mark.skipif(qkernels.kernels() is None, reason="no C compiler / AVX2: kernels off")
BLOCK = 16


class Batch:
    """Sequences in one float32 (or ``kv_dtype``) paged cache, their blocks scattered over the pool."""

    def __init__(self, model: LlamaModel, lengths: list[int], kv_dtype: str = "float32", steps: int = 4):
        c = model.config
        self.model, self.lengths = model, list(lengths)
        per_seq = -(-(max(lengths) + steps) // BLOCK)
        num_blocks = per_seq * len(lengths)
        shape = (c.num_layers, BLOCK, c.num_kv_heads, c.head_dim)
        self.cache = PagedKVCache(KVFormat(kv_dtype, torch.float32), num_blocks, shape, torch.device("cpu"))
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))
        self.tables = order.view(len(lengths), per_seq)  # [B, per_seq]
        gen = torch.Generator().manual_seed(2)
        self.ids = [torch.randint(0, c.vocab_size, (n,), generator=gen) for n in lengths]

    def slots(self, seq: int, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tables[seq][pos // BLOCK], pos % BLOCK

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.forward(ids, pos, self.cache, meta)

    def prefill(self) -> list[int]:
        """Each sequence's prompt, one forward each; the greedy next tokens."""
        nxt = []
        for s, ids in enumerate(self.ids):
            pos = torch.arange(len(ids))
            meta = AttentionMetadata(*self.slots(s, pos), None, [PrefillGroup(0, len(ids), 0, None, None)])
            nxt.append(int(self.model.compute_logits(self.forward(ids, pos, meta)[-1:]).argmax()))
        return nxt

    def decode_meta(self) -> tuple[torch.Tensor, AttentionMetadata]:
        pos = torch.tensor(self.lengths)  # each sequence's new token
        ctx = [n + 1 for n in self.lengths]
        max_ctx, max_blocks = max(ctx), -(-max(ctx) // BLOCK)
        ids, offs = zip(*(self.slots(s, pos[s : s + 1]) for s in range(len(ctx))), strict=True)
        mask = torch.arange(max_ctx)[None, :] < torch.tensor(ctx)[:, None]
        tables = self.tables[:, :max_blocks].reshape(-1)
        mask4 = None if len(ctx) == 1 else mask[:, None, None, :]
        group = DecodeGroup(len(ctx), tables, max_blocks, max_ctx, mask4)
        return pos, AttentionMetadata(torch.cat(ids), torch.cat(offs), group, [])

    def decode_both_ways(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of every sequence through the loop, then (same cache) through the program."""
        pos, meta = self.decode_meta()
        program, self.model.program = self.model.program, None
        loop = self.forward(torch.tensor(tokens), pos, meta)
        written = self.cache.raw.clone()
        self.model.program = program
        pos, meta = self.decode_meta()
        prog = self.forward(torch.tensor(tokens), pos, meta)
        assert torch.equal(self.cache.raw, written)  # the program wrote the loop's bytes to the same slots
        self.lengths = [n + 1 for n in self.lengths]
        return loop, prog


def story(model: LlamaModel, lengths: list[int], steps: int = 4, kv_dtype: str = "float32") -> None:
    """Prefill, then ``steps`` decode steps: the program's hidden states equal the loop's bit for bit."""
    assert model.program is not None
    batch = Batch(model, lengths, kv_dtype, steps=steps)
    tokens = batch.prefill()
    ran = model.program.steps
    for _ in range(steps):
        loop, prog = batch.decode_both_ways(tokens)
        assert torch.equal(loop, prog)
        tokens = model.compute_logits(prog).argmax(-1).tolist()
    assert model.program.steps == ran + steps  # the program ran every decode step


def quantized(loaded: Any, weight_dtype: str) -> LlamaModel:
    packed, lib = qpack.load_packed(loaded, weight_dtype, "float32")
    return LlamaModel(loaded.config, loaded.weights, torch.float32, 256, packed, lib)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_gguf_blocks_decode_bit_for_bit(tiny_gguf: Any, tmp_path: Path, qtype: str) -> None:
    gguf = tiny_gguf(qtype=qtype, num_heads=1, num_kv_heads=1)  # head_dim 64
    loaded = load_model(str(gguf.path), cache_dir=tmp_path)
    story(quantized(loaded, "gguf"), [5, 19, 33])


def test_int8_with_biases_decodes_bit_for_bit(
    tiny_llama_dir: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """attention_bias: a bias on qkv (added after the kernel) and on o (x + (a @ W + b), via scratch)."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))  # an HF model's packed rows: not the user's cache
    directory = tiny_llama_dir(num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=128, attention_bias=True)
    model = quantized(load_model(str(directory)), "int8")
    assert model.layers[0].o.bias is not None
    story(model, [3, 16, 40])


def test_dense_fp32_on_the_gemv_decodes_bit_for_bit(
    tiny_llama_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tiny_llama_dir(num_heads=4, num_kv_heads=1, head_dim=64, hidden_size=128, attention_bias=True)
    loaded = load_model(str(directory))
    monkeypatch.setenv("KVTIER_DENSE_GEMV", "1")
    story(LlamaModel(loaded.config, loaded.weights, torch.float32, 256), [7, 30])
    story(LlamaModel(loaded.config, loaded.weights, torch.float32, 256), [12])  # one sequence: no mask


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "int8", "bfloat16"])
def test_compact_kv_decodes_bit_for_bit(
    tiny_gguf: Any, tiny_llama_dir: Any, tmp_path: Path, kv_dtype: str
) -> None:
    """A compact pool: RoPE, then the rotation, quantize and scatter of kv_store_quantized (bfloat16: the
    rounding), then the compact attention, all inside the program, for quantized and dense weights."""
    loaded = load_model(str(tiny_gguf(qtype="Q4_1", num_heads=1, num_kv_heads=1).path), cache_dir=tmp_path)
    story(quantized(loaded, "gguf"), [5, 19, 33], kv_dtype=kv_dtype)
    directory = tiny_llama_dir(num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=128, attention_bias=True)
    loaded = load_model(str(directory))
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, 256)
    for layer in model.layers:  # every dense weight on the GEMV (the calibration may choose MKL here)
        for lin in [*layer.linears]:
            lin.gemv = (model.ops.lib, 2)
    story(model, [7, 30], kv_dtype=kv_dtype)


def test_steps_it_does_not_cover_run_the_loop(tiny_llama_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_model(str(tiny_llama_dir(num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=128)))
    monkeypatch.setenv("KVTIER_DENSE_GEMV", "1")
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, 256)
    program = model.program
    assert isinstance(program, DecodeProgram)
    batch = Batch(model, [4, 9])
    tokens = batch.prefill()
    assert program.steps == 0  # prefill chunks: the loop
    too_many = Batch(model, [3] * (GEMV_ROWS + 1))
    too_many.prefill()
    too_many.decode_both_ways([1] * (GEMV_ROWS + 1))
    assert program.steps == 0  # more rows than the GEMV takes: the loop (MKL)
    fp16 = Batch(model, [4, 9], kv_dtype="float16")
    fp16.decode_both_ways(fp16.prefill())
    assert program.steps == 0  # a float16 pool: the loop (torch writes, no decode kernel)
    model.layers[1].down.gemv = None  # one weight on MKL
    model.program = DecodeProgram(model)
    batch.decode_both_ways(tokens)
    assert model.program.steps == 0
