"""kvtier's paged forward pass gives the logits of HF transformers on tiny random Llama checkpoints.

Each checkpoint is run three ways through the paged KV pool — a fresh prefill, a chunk that reads a
cached prefix through its block table, and a one-token decode — and every position's logits are
compared with transformers' single full-sequence forward.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.models.attention import AttentionMetadata, DecodeGroup, PrefillGroup
from kvtier.models.kv_quant import KVFormat, PagedKVCache
from kvtier.models.llama import LlamaModel
from kvtier.models.loader import load_model

BLOCK = 4


def paged_logits(model: LlamaModel, ids: torch.Tensor, split: int) -> torch.Tensor:
    """Prefill ids[:split], then ids[split:-1] as a cached-prefix chunk, then decode ids[-1]."""
    c = model.config
    n = ids.shape[0]
    num_blocks = -(-n // BLOCK) + 3
    shape = (c.num_layers, BLOCK, c.num_kv_heads, c.head_dim)
    kv = PagedKVCache(KVFormat("float32", torch.float32), num_blocks, shape, torch.device("cpu"))
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))  # scattered blocks
    pos = torch.arange(n)

    def slots(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return table[p // BLOCK], p % BLOCK

    def run(p: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        with torch.inference_mode():
            return model.compute_logits(model.forward(ids[p], p, kv, meta))

    p = pos[:split]
    first = run(p, AttentionMetadata(*slots(p), None, [PrefillGroup(0, split, 0, None, None)]))
    p = pos[split : n - 1]
    used = table[: -(-(n - 1) // BLOCK)]
    mask = torch.arange(n - 1)[None, :] <= p[:, None]
    chunk = run(p, AttentionMetadata(*slots(p), None, [PrefillGroup(0, len(p), split, used, mask)]))
    p = pos[n - 1 :]
    used = table[: -(-n // BLOCK)]
    last = run(p, AttentionMetadata(*slots(p), DecodeGroup(1, used, len(used), n, None), []))
    return torch.cat([first, chunk, last])


def hf_logits(directory, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0]


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "tie"),
    [(4, 4, True), (4, 2, False), (6, 2, True), (6, 3, False)],
    ids=["mha-tied", "gqa2-untied", "gqa3-tied", "gqa2-6heads-untied"],
)
def test_logits_match_transformers(tiny_llama_dir, num_heads: int, num_kv_heads: int, tie: bool) -> None:
    directory = tiny_llama_dir(
        num_heads=num_heads, num_kv_heads=num_kv_heads, tie_word_embeddings=tie, hidden_size=96
    )
    loaded = load_model(directory)
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, 256)
    ids = torch.randint(0, loaded.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1))
    ours = paged_logits(model, ids, split=18)
    ref = hf_logits(directory, ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ],
    ids=["linear", "llama3"],
)
def test_rope_scaling_matches_transformers(tiny_llama_dir, rope_scaling) -> None:
    directory = tiny_llama_dir(rope_scaling=rope_scaling)
    loaded = load_model(directory)
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, 256)
    ids = torch.randint(0, loaded.config.vocab_size, (70,), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(
        paged_logits(model, ids, split=33), hf_logits(directory, ids), atol=1e-4, rtol=0
    )


def test_attention_and_mlp_biases_match_transformers(tiny_llama_dir) -> None:
    directory = tiny_llama_dir(arch="qwen2", num_heads=4, num_kv_heads=2)
    loaded = load_model(directory)
    assert loaded.config.attention_bias
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, 256)
    ids = torch.randint(0, loaded.config.vocab_size, (21,), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(
        paged_logits(model, ids, split=9), hf_logits(directory, ids), atol=1e-4, rtol=0
    )
