"""Gemma 3 (text) against transformers on tiny random checkpoints, sliding-window layers included.

Checkpoints are built with transformers' own ``Gemma3TextConfig`` / ``Gemma3ForCausalLM`` (several
windows and layer patterns, prompts longer than the window) and loaded by kvtier's loader as HF
directories. The window follows HF's mask exactly: the query at position q sees the keys at
q - W < k <= q (``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``), which
``test_window_is_hfs_to_the_token`` pins: a window one token shorter or longer gives other logits.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kvtier.models import registry
from kvtier.models.attention import AttentionMetadata, DecodeGroup, PrefillGroup
from kvtier.models.gemma3 import Gemma3Model
from kvtier.models.kv_quant import KVFormat, PagedKVCache
from kvtier.models.llama import LlamaModel
from kvtier.models.loader import load_model
from tests.test_model_parity import hf_logits, paged_logits
from tests.test_qwen3 import (
    GREEDY,
    SCENARIOS,
    check_engine,
    check_logits,
    engine_prompts,
    hf_greedy,
    tiny_checkpoint,
)

BLOCK = 4
PATTERNS = {
    # W 5 over 3 layers, a full one between two sliding ones
    "w5-sfs": dict(
        num_hidden_layers=3,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    # W 8, every 2nd layer full (the pattern form), linear RoPE scaling on the full layers, an untied
    # head, a query_pre_attn_scalar other than head_dim and a logit softcap
    "w8-every2nd-scaled-capped-untied": dict(
        num_hidden_layers=4,
        sliding_window=8,
        sliding_window_pattern=2,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        query_pre_attn_scalar=20,
        final_logit_softcapping=3.0,
        tie_word_embeddings=False,
    ),
    # W 3, every layer sliding (3 layers under the default pattern of 6), multi-head attention
    "w3-all-sliding-mha": dict(num_hidden_layers=3, sliding_window=3, num_key_value_heads=4),
    # head_dim 256 as Gemma 3 270M, one KV head of four: the fused decode kernel's shapes
    "w6-headdim256-kernel": dict(
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: tiny_checkpoint(tmp_path_factory.mktemp(name), "gemma3", **cfg)
        for name, cfg in PATTERNS.items()
    }


def build(directory: Path, **changes) -> Gemma3Model:
    loaded = load_model(directory)
    config = dataclasses.replace(loaded.config, **changes)
    model = registry.build_model(config, loaded.weights, torch.float32, 256)
    assert isinstance(model, Gemma3Model)
    return model


# ------------------------------------------------------------------------------------------------ logits


@pytest.mark.parametrize("pattern", PATTERNS)
def test_logits_match_transformers(gemma_dirs: dict[str, Path], pattern: str) -> None:
    # 37 tokens: a fresh prefill of 18 (longer than every window), a chunk of 18 over them, a decode
    check_logits(gemma_dirs[pattern], 37, 18)


def test_config_reads_the_layer_pattern(gemma_dirs: dict[str, Path]) -> None:
    config = load_model(gemma_dirs["w8-every2nd-scaled-capped-untied"]).config
    assert config.family == "gemma3" and config.sliding_window == 8
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0} and config.rope_local_theta == 1e4
    assert config.query_pre_attn_scalar == 20 and config.final_logit_softcapping == 3.0


def test_window_is_hfs_to_the_token(gemma_dirs: dict[str, Path]) -> None:
    """W matches HF; W - 1 and W + 1 do not (past the window), so the window's edge is HF's."""
    directory = gemma_dirs["w5-sfs"]
    ids = torch.randint(3, 500, (20,), generator=torch.Generator().manual_seed(4))
    ref = hf_logits(directory, ids)
    for window, equal in ((5, True), (4, False), (6, False)):
        ours = paged_logits(build(directory, sliding_window=window), ids, split=9)
        assert torch.allclose(ours[:4], ref[:4], atol=1e-4)  # within every window: the same
        assert torch.allclose(ours, ref, atol=1e-4) == equal, window


def test_transformers4_config_form_matches(gemma_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A config.json as transformers 4 wrote it (flat rope keys, ``sliding_window_pattern``) runs the
    same model as the transformers 5 form, and transformers reads it the same way."""
    import shutil

    directory = shutil.copytree(gemma_dirs["w8-every2nd-scaled-capped-untied"], tmp_path / "v4")
    cfg = json.loads((directory / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.pop("layer_types")
    cfg.pop("_sliding_window_pattern", None)
    cfg.update(sliding_window_pattern=2, rope_theta=rope["full_attention"]["rope_theta"])
    cfg.update(rope_local_base_freq=rope["sliding_attention"]["rope_theta"])
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    (directory / "config.json").write_text(json.dumps(cfg))
    assert load_model(directory).config == load_model(gemma_dirs["w8-every2nd-scaled-capped-untied"]).config
    check_logits(directory, 30, 11)


# ------------------------------------------------------------------------------------ batched decode


def batched_decode_logits(model: LlamaModel, seqs: list[torch.Tensor]) -> torch.Tensor:  # [B, V]
    """Each sequence but its last token prefilled into scattered blocks (a fresh chunk of 7, then the
    rest over it), then every last token decoded in one group padded to the longest context."""
    c = model.config
    lens = [len(s) for s in seqs]
    per_seq = -(-max(lens) // BLOCK)
    shape = (c.num_layers, BLOCK, c.num_kv_heads, c.head_dim)
    kv = PagedKVCache(KVFormat("float32", torch.float32), per_seq * len(seqs), shape, torch.device("cpu"))
    pool = torch.randperm(per_seq * len(seqs), generator=torch.Generator().manual_seed(0))
    tables = [pool[i * per_seq : (i + 1) * per_seq] for i in range(len(seqs))]
    with torch.inference_mode():
        for ids, table in zip(seqs, tables, strict=True):
            for lo, hi in ((0, min(7, len(ids) - 1)), (min(7, len(ids) - 1), len(ids) - 1)):
                if hi > lo:
                    pos = torch.arange(lo, hi)
                    mask = None if lo == 0 else torch.arange(hi)[None, :] <= pos[:, None]
                    group = PrefillGroup(0, hi - lo, lo, None if lo == 0 else table[: -(-hi // BLOCK)], mask)
                    model.forward(
                        ids[pos], pos, kv, AttentionMetadata(table[pos // BLOCK], pos % BLOCK, None, [group])
                    )
        pos = torch.tensor([n - 1 for n in lens])
        max_blocks = -(-max(lens) // BLOCK)
        flat = torch.cat([t[:max_blocks] for t in tables])  # each row's own blocks (padding included)
        mask = (torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
        decode = DecodeGroup(len(seqs), flat, max_blocks, max(lens), mask)
        slots = torch.stack([t[p // BLOCK] for t, p in zip(tables, pos.tolist(), strict=True)])
        meta = AttentionMetadata(slots, pos % BLOCK, decode, [])
        last = torch.stack([s[-1] for s in seqs])
        return model.compute_logits(model.forward(last, pos, kv, meta))


@pytest.mark.parametrize(
    ("pattern", "lens"),
    [
        ("w5-sfs", [23, 3, 14, 9]),  # contexts longer and shorter than W in one padded group
        ("w6-headdim256-kernel", [22, 5, 13]),  # the window cut: sliding rows through torch
        ("w6-headdim256-kernel", [4, 6, 2]),  # every context within W: the fused kernel for all rows
    ],
)
def test_batched_decode_matches_transformers(
    gemma_dirs: dict[str, Path], pattern: str, lens: list[int]
) -> None:
    directory = gemma_dirs[pattern]
    model = build(directory)
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in lens]
    ours = batched_decode_logits(model, seqs)
    for row, ids in zip(ours, seqs, strict=True):
        torch.testing.assert_close(row, hf_logits(directory, ids)[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "bfloat16"])
@pytest.mark.parametrize("pattern", ["w5-sfs", "w6-headdim256-kernel"])
def test_compact_kv_window_decode_agrees_with_the_chunk_path(
    gemma_dirs: dict[str, Path], pattern: str, kv_dtype: str
) -> None:
    """Over a compact pool, a decode row of a sliding layer (its window rows, the scales folded into
    scores and probabilities) and a one-token chunk (the dequantized gather) read the same stored K/V:
    the same logits."""
    model = build(gemma_dirs[pattern])
    c = model.config
    shape = (c.num_layers, BLOCK, c.num_kv_heads, c.head_dim)
    kv = PagedKVCache(KVFormat(kv_dtype, torch.float32), 8, shape, torch.device("cpu"))
    table = torch.tensor([5, 2, 7, 0, 3, 6])
    ids = torch.randint(3, c.vocab_size, (22,), generator=torch.Generator().manual_seed(8))
    n = len(ids) - 1
    with torch.inference_mode():
        pos = torch.arange(n)
        model.forward(
            ids[:n],
            pos,
            kv,
            AttentionMetadata(table[pos // BLOCK], pos % BLOCK, None, [PrefillGroup(0, n, 0, None, None)]),
        )
        last, used = torch.tensor([n]), table[: -(-(n + 1) // BLOCK)]
        slot = (table[last // BLOCK], last % BLOCK)
        decode = DecodeGroup(1, used, len(used), n + 1, None)
        by_decode = model.compute_logits(
            model.forward(ids[n:], last, kv, AttentionMetadata(*slot, decode, []))
        )
        chunk = PrefillGroup(0, 1, n, used, torch.ones(1, n + 1, dtype=torch.bool))
        by_chunk = model.compute_logits(
            model.forward(ids[n:], last, kv, AttentionMetadata(*slot, None, [chunk]))
        )
    torch.testing.assert_close(by_decode, by_chunk, atol=1e-4, rtol=0)


def test_sliding_reads_start_at_the_windows_first_block() -> None:
    """A chunk of positions 10..13 (W 5) reads from position 6's block (4..7) on; a decode at position
    13 (context 14) from block 2 (8..11), each row masked to q - W < k <= q."""
    chunk = PrefillGroup(0, 4, 10, torch.arange(4), torch.ones(4, 14, dtype=torch.bool))
    view = chunk.window(5, BLOCK, torch.device("cpu"))
    assert view.start == 4 and view.block_table.tolist() == [1, 2, 3]
    assert view.mask.tolist()[0] == [False, False, True, True, True, True, True] + [False] * 3  # q = 10
    mask = (torch.arange(14)[None, :] < torch.tensor([14, 6])[:, None])[:, None, None, :]
    group = DecodeGroup(2, torch.tensor([10, 11, 12, 13, 20, 21, 20, 20]), 4, 14, mask)
    cut = group.window(5, BLOCK)
    assert cut.num_blocks == 2 and cut.block_tables.tolist() == [12, 13, 20, 21]
    assert cut.mask[:, 0, 0].tolist() == [
        [False] + [True] * 5 + [False] * 2,
        [False] + [True] * 5 + [False] * 2,
    ]
    assert group.window(14, BLOCK) is None  # every context fits: the full rows


# ------------------------------------------------------------------------------------------------ engine


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """W 6 (not a multiple of the 4-token block) over 3 layers: sliding, sliding, full. An untied head:
    a tied tiny Gemma mostly repeats its input token (the sqrt(hidden)-scaled embedding), a weak check."""
    return tiny_checkpoint(
        tmp_path_factory.mktemp("gemma3"),
        "gemma3",
        num_hidden_layers=3,
        sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def gemma_reference(engine_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = engine_prompts(load_model(engine_dir).config.vocab_size)
    return prompts, hf_greedy(engine_dir, prompts)


# The hybrid layout (a full group, two sliding ones of one slot each) holds a 100-token sequence in
# 25 full + 2 x 3 sliding blocks: 34 blocks preempt as 28 do for one group (kvtier/kv/groups.py).
HYBRID_POOL = {"pool_that_preempts": dict(kv_device_blocks=34)}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_engine_greedy_matches_transformers(engine_dir: Path, gemma_reference, scenario: str) -> None:
    # prompts of up to 81 tokens (+12 generated) against a 6-token window; chunks of 7 cross it; the
    # sliding groups release what the window left behind
    llm = check_engine(engine_dir, *gemma_reference, scenario, **HYBRID_POOL.get(scenario, {}))
    assert llm.engine.kv.layout.num_groups == 3 and llm.engine.runner.kv_cache.shape[1] == 1


def test_engine_answers_depend_on_the_window(engine_dir: Path, gemma_reference, tmp_path: Path) -> None:
    """The same weights with a window covering every prompt answer otherwise: the scenarios above
    would see a window that the engine ignored."""
    import shutil

    from kvtier import LLM

    directory = shutil.copytree(engine_dir, tmp_path / "wide")
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**cfg, "sliding_window": 256}))
    prompts, reference = gemma_reference
    llm = LLM(str(directory), block_size=BLOCK, kv_device_blocks=256)
    wide = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert sum(w != r for w, r in zip(wide, reference, strict=True)) >= len(prompts) // 2
