"""The hybrid KV cache through the engine: Gemma 3 and Qwen3 with sliding layers on KV groups.

Tiny random checkpoints built by transformers (``tests/test_qwen3.py``'s ``tiny_checkpoint``), a 6-token
window over 4-token blocks, prompts and outputs well past it, so the sliding groups release blocks all
the time. The engine's greedy answers equal transformers' token for token::

    gemma   6 layers  s s F s s F    groups: full (2, 5) | sliding (0, 3) | sliding (1, 4)   2 slots each
    qwen3   4 layers  F F s s        groups: full (0, 1) | sliding (2, 3)                     2 slots each

and a long generation holds exactly the blocks ``KVLayout.num_blocks_held`` predicts, a fraction of an
all-full layout's bytes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.config import kv_block_bytes
from kvtier.kv.groups import kv_layout
from kvtier.kv.hashing import extend_block_hashes, group_key, root_hash
from kvtier.models.loader import load_model
from kvtier.stats import Medium
from tests.test_qwen3 import GREEDY, SCENARIOS, check_engine, engine_prompts, tiny_checkpoint, token_ids

BLOCK = 4
WINDOW = 6
SLIDING_GEMMA = ["sliding_attention", "sliding_attention", "full_attention"] * 2
# Pools that preempt as 28 blocks do for one group: a 100-token sequence holds 25 full-group blocks and
# up to 3 per sliding group (ceil((W - 1) / B) + 1).
PREEMPTING = {"gemma": 34, "qwen3": 31}


def tiny_gemma(directory: Path) -> Path:
    """The tiny hybrid Gemma 3 of the hybrid tests: 6 layers ``s s F s s F``, window 6; its head untied
    (a tied tiny model mostly repeats its input token, a weak greedy check)."""
    return tiny_checkpoint(
        directory,
        "gemma3",
        num_hidden_layers=6,
        sliding_window=WINDOW,
        layer_types=SLIDING_GEMMA,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    gemma = tiny_gemma(tmp_path_factory.mktemp("gemma"))
    qwen3 = tiny_checkpoint(
        tmp_path_factory.mktemp("qwen3"),
        "qwen3",
        num_hidden_layers=4,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=2,
    )
    return {"gemma": gemma, "qwen3": qwen3}


_REFERENCE: dict[tuple[Path, tuple[int, ...], int], list[int]] = {}


def hf_continuation(directory: Path, prompt: list[int], max_new_tokens: int = 12) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (past EOS), cached per test session."""
    key = (directory, tuple(prompt), max_new_tokens)
    if key not in _REFERENCE:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        _REFERENCE[key] = out[0, len(prompt) :].tolist()
    return _REFERENCE[key]


def prompts_of(directory: Path) -> list[list[int]]:
    return engine_prompts(load_model(directory).config.vocab_size)


def make(directory: Path, **kwargs: Any) -> LLM:
    return LLM(str(directory), **{"block_size": BLOCK, "kv_device_blocks": 256, **kwargs})


def check_idle(llm: LLM) -> None:
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_free_blocks() == llm.engine.config.cache.num_device_blocks


# ------------------------------------------------------------------------------------------ the layout


def test_the_engine_runs_the_models_kv_groups(dirs: dict[str, Path]) -> None:
    """Gemma: three groups of two slots over one pool of 2-slot blocks (a third of an all-full block)."""
    llm = make(dirs["gemma"])
    layout = llm.engine.kv.layout
    assert [(g.kind, g.layers) for g in layout.groups] == [
        ("full", (2, 5)),
        ("sliding", (0, 3)),
        ("sliding", (1, 4)),
    ]
    config = llm.engine.config
    c = config.model
    assert llm.engine.runner.kv_cache.shape == (256, 2, BLOCK, 2, c.num_kv_heads, c.head_dim)
    all_full = dataclasses.replace(c, layer_types=("full_attention",) * 6, sliding_window=None)
    assert config.cache.block_bytes == kv_block_bytes(c, BLOCK, "float32")
    assert 3 * config.cache.block_bytes == kv_block_bytes(all_full, BLOCK, "float32")
    groups = llm.engine.stats().kv_groups
    assert [(g.group, g.kind, g.window, g.num_layers, g.blocks_in_use) for g in groups] == [
        (0, "full", None, 2, 0),
        (1, "sliding", WINDOW, 2, 0),
        (2, "sliding", WINDOW, 2, 0),
    ]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("model", ["gemma", "qwen3"])
def test_engine_greedy_matches_transformers(dirs: dict[str, Path], model: str, scenario: str) -> None:
    """One at a time, in 7-token chunks, with prefix hits, under a pool that preempts: prompts of up
    to 81 tokens (+12) against a 6-token window."""
    directory = dirs[model]
    prompts = prompts_of(directory)
    reference = [hf_continuation(directory, p) for p in prompts]
    pool = {"kv_device_blocks": PREEMPTING[model]} if scenario == "pool_that_preempts" else {}
    check_engine(directory, prompts, reference, scenario, **pool)


# ----------------------------------------------------------------------------------- memory held


def test_a_long_generation_holds_what_the_layout_predicts(dirs: dict[str, Path]) -> None:
    """After every step of a 30 + 60 token generation the sequence holds ``num_blocks_held`` blocks:
    every full block, at most 2 per sliding group; at the end 0.39x an all-full layout's bytes."""
    directory = dirs["gemma"]
    llm = make(directory)
    engine, kv = llm.engine, llm.engine.kv
    prompt = prompts_of(directory)[5][:30]
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    seq = next(iter(engine.requests.values())).seqs[0]
    held: list[tuple[int, int, int]] = []  # (computed tokens, blocks held, blocks predicted)
    while engine.has_unfinished_requests():
        engine.step()
        if not seq.status.finished:
            n = seq.num_computed_tokens
            held.append((n, kv.num_held_blocks(seq.seq_id), kv.layout.num_blocks_held(n, BLOCK)))
            in_use = [g.blocks_in_use for g in engine.stats().kv_groups]
            assert in_use == list(kv.layout.blocks_held_by_group(n, BLOCK))
    assert all(ours == predicted for _, ours, predicted in held), held
    assert seq.token_ids[len(prompt) :] == hf_continuation(directory, prompt, 60)
    n, blocks, _ = held[-1]
    hybrid, all_full = blocks * kv.layout.layers_per_group, -(-n // BLOCK) * 6  # layer-blocks held
    assert (n, blocks) == (88, 22 + 2 * 2) and hybrid / all_full < 0.4, (hybrid, all_full)
    check_idle(llm)


# ------------------------------------------------------------------------------------ prefix hits


def _forget_sliding(llm: LLM, prompt: list[int], positions: list[int], group: int) -> None:
    """Evict the blocks of ``group`` at block ``positions`` of ``prompt`` from the device prefix cache."""
    engine = llm.engine
    hashes: list = []
    extend_block_hashes(hashes, prompt, BLOCK, root_hash((engine.cache_identity, "")), len(prompt))
    for i in positions:
        assert engine.kv.forget_block(group_key(hashes[i], group))


def test_a_hit_whose_sliding_blocks_were_evicted_is_shorter_and_exact(dirs: dict[str, Path]) -> None:
    """A 60-token prompt hits 56 tokens (the query at 56 needs the sliding keys 51..55: blocks 12, 13).
    With group 1's blocks 12 and 13 gone, the longest exact hit is 48 (keys 43..47: blocks 10, 11);
    the full group's blocks 12 and 13 are not used, and the answer is still transformers'."""
    directory = dirs["gemma"]
    prompt = prompts_of(directory)[6]
    assert len(prompt) == 60
    reference = hf_continuation(directory, prompt)
    llm = make(directory)
    assert token_ids(llm.generate({"prompt_token_ids": prompt}, GREEDY)) == [reference]
    again = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert again.num_cached_tokens == 56 and again.outputs[0].token_ids == reference
    _forget_sliding(llm, prompt, [12, 13], group=1)
    shorter = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert shorter.num_cached_tokens == 48 and shorter.outputs[0].token_ids == reference
    check_idle(llm)


def test_n2_forks_past_the_window(dirs: dict[str, Path]) -> None:
    """Two greedy completions forked after prompts of 33 and 60 tokens (the children share the parent's
    tables, null entries included; each copies the shared partial block on its first write)."""
    directory = dirs["gemma"]
    prompts = [prompts_of(directory)[i] for i in (5, 6)]
    llm = make(directory, enable_prefix_caching=False)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True)
    for out, prompt in zip(
        llm.generate([{"prompt_token_ids": p} for p in prompts], params), prompts, strict=True
    ):
        reference = hf_continuation(directory, prompt)
        assert [c.token_ids for c in out.outputs] == [reference, reference]
    check_idle(llm)


# ------------------------------------------------------------------------------------- preemption


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_by_swap_and_by_recompute(dirs: dict[str, Path], mode: str) -> None:
    """Ten prompts in a pool of 34 blocks: sequences are swapped out to the host tier (each sliding group
    storing only its window's blocks) or dropped and recomputed, and every answer is transformers'."""
    directory = dirs["gemma"]
    prompts = prompts_of(directory)
    llm = make(
        directory,
        kv_device_blocks=PREEMPTING["gemma"],
        max_model_len=100,
        preemption_mode=mode,
        kv_host_gb=0.001,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert token_ids(outs) == [hf_continuation(directory, p) for p in prompts]
    assert llm.engine.scheduler.preemptions_by_mode[mode] > 0
    check_idle(llm)


@pytest.mark.parametrize("policy", ["legacy", "stall_free"])
def test_a_long_prompt_in_a_small_pool_without_prefix_caching_finishes(
    dirs: dict[str, Path], policy: str
) -> None:
    """A 100-token prompt in 40 blocks: its whole prompt needs 25 blocks in each of 3 groups, so each
    chunk is halved to fit, and the sliding groups release as it goes. (Once, the legacy policy preempted
    the only sequence for its second chunk instead; without prefix caching it then started over, forever.)"""
    directory = dirs["gemma"]
    prompt = list(range(3, 103))
    llm = make(
        directory,
        kv_device_blocks=40,
        max_model_len=120,
        enable_prefix_caching=False,
        scheduling_policy=policy,
    )
    assert token_ids(llm.generate([{"prompt_token_ids": prompt}], GREEDY)) == [
        hf_continuation(directory, prompt)
    ]
    assert sum(llm.engine.scheduler.preemptions_by_mode.values()) == 0
    check_idle(llm)


# ------------------------------------------------------------------------------------------ tiers


def test_host_and_disk_tiers_and_a_restart_resume_a_conversation(
    dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Turn 1 on one engine; closing it flushes every cached block (each group's, under its own key) to
    disk; a new engine on the same directory answers turn 2 from those blocks, exactly."""
    directory = dirs["gemma"]
    prompts = prompts_of(directory)
    first_turn = prompts[6]
    tiers = dict(kv_device_blocks=64, kv_host_gb=0.001, kv_disk_dir=str(tmp_path / "kv"))
    first = make(directory, **tiers)
    try:
        answer = token_ids(first.generate({"prompt_token_ids": first_turn}, GREEDY))[0]
    finally:
        first.close()
    assert answer == hf_continuation(directory, first_turn)
    second_turn = first_turn + answer + prompts[2]  # 60 + 12 + 15 tokens
    restarted = make(directory, **tiers)
    try:
        out = restarted.generate({"prompt_token_ids": second_turn}, GREEDY)[0]
        check_idle(restarted)
    finally:
        restarted.close()
    # turn 1 computed 71 tokens: 17 full blocks, each group's on disk
    assert out.num_cached_tokens == 68 and out.cached_tokens_by_tier.get(Medium.DISK, 0) > 0
    assert out.outputs[0].token_ids == hf_continuation(directory, second_turn)


def test_all_full_layout_of_the_same_model_is_one_group() -> None:
    """The layout rule the engine applies: a dense model is one group, slot = layer."""
    layout = kv_layout(("full_attention",) * 4, None)
    assert layout.is_dense and [layout.slot_of(i) for i in range(4)] == [(0, i) for i in range(4)]
    assert layout.max_tokens(28, BLOCK) == 28 * BLOCK


# ----------------------------------------------------------------------------------------- canary


def test_the_canary_compares_the_full_groups_slots_with_their_layers(dirs: dict[str, Path]) -> None:
    """Honest hits match (group 0's slots hold layers 2 and 5, recomputed in a pool of one slot per
    layer); the same hit with layer 5's slot of every full-group block shifted is caught."""
    directory = dirs["gemma"]
    prompt = prompts_of(directory)[6]
    llm = make(directory, canary_rate=1.0)
    e = llm.engine
    reference = token_ids(llm.generate({"prompt_token_ids": prompt}, GREEDY))
    assert token_ids(llm.generate({"prompt_token_ids": prompt}, GREEDY)) == reference  # a 56-token hit
    while e.run_idle_work():
        pass
    report = e.kv_canary()
    assert report["checks"]["match"] >= 1 and report["checks"]["mismatch"] == 0
    hashes: list = []
    extend_block_hashes(hashes, prompt, BLOCK, root_hash((e.cache_identity, "")), 56)
    for i, key in enumerate(hashes):  # group 0 keeps the chain's own keys
        block = e.kv.pool.get_cached_block(key, prompt[i * BLOCK : (i + 1) * BLOCK])
        assert block is not None
        e.runner.kv_cache[block.block_id, 1] += 1.0  # slot 1: layer 5
    llm.generate({"prompt_token_ids": prompt}, GREEDY)
    while e.run_idle_work():
        pass
    report = e.kv_canary()
    assert report["checks"]["mismatch"] >= 1 and report["last_mismatch"]["tier"] == "device"
