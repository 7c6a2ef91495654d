"""Write-back ahead (kvtier/kv/write_ahead.py): while the engine idles, the blocks the device pool will
evict next are stored to the host tier, so the step that evicts them copies nothing down.

The story: a conversation's prompt is cached and finished; the engine idles, and its blocks (next in
line for eviction) are written back, a few per idle step; a long prompt then evicts them all without
planning a single store; the conversation returns and is loaded from the host tier with the answer it
had the first time.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvtier.bench.gpu_speed import settle
from kvtier.config import EngineArgs, ModelConfig, resolve_engine_config
from kvtier.config_checks import ConfigError
from kvtier.kv.manager import KVCacheManager
from kvtier.kv.write_ahead import WriteBackAhead, default_blocks
from kvtier.llm import LLM
from kvtier.sampling_params import SamplingParams
from kvtier.tiers.coordinator import TierCoordinator
from kvtier.tiers.host import HostTier

BS = 4
KEYS = ("fp-ahead", "")
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def prefill(kv: KVCacheManager, seq_id: str, tokens: list[int]) -> None:
    computed = kv.get_computed_blocks(tokens, KEYS)
    n = computed.num_computed_tokens
    assert kv.allocate_slots(seq_id, tokens, n, len(tokens) - n, computed, KEYS)
    kv.cache_blocks(seq_id, tokens, len(tokens), KEYS)


def bookkeeping(num_blocks: int, host_blocks: int) -> tuple[KVCacheManager, TierCoordinator]:
    tiers = TierCoordinator(HostTier(host_blocks))
    return KVCacheManager(num_blocks, BS, True, tiers=tiers), tiers


def run_plan(kv: KVCacheManager, tiers: TierCoordinator) -> list[tuple[int, int]]:
    """The step's copies "ran": what a step does after the scheduler; the stores it planned."""
    plan = kv.end_schedule_step()
    tiers.complete_plan(plan)
    return list(plan.stores)


def test_idle_steps_write_the_next_evictions_back_and_the_evicting_step_stores_nothing() -> None:
    kv, tiers = bookkeeping(num_blocks=8, host_blocks=16)
    prefill(kv, "chat", list(range(100, 124)))  # 6 full blocks, cached
    kv.free("chat")
    run_plan(kv, tiers)
    ahead = WriteBackAhead(kv.pool, tiers, num_blocks=8, step_blocks=4)
    assert not ahead.pending  # nothing ran yet: no budget
    ahead.after_step()
    assert ahead.plan() == 4 and len(run_plan(kv, tiers)) == 4  # a few per idle step
    assert ahead.plan() == 2 and len(run_plan(kv, tiers)) == 2  # the rest of the chat's blocks
    assert ahead.plan() == 0 and not ahead.pending  # all clean: the period's work is done
    assert all(tiers.host.contains(key) for _, key in kv.cached_blocks())

    prefill(kv, "long", list(range(500, 532)))  # 8 blocks: evicts all six of the chat's
    assert run_plan(kv, tiers) == []  # ... and copies nothing down
    assert tiers.host.counters.blocks_evicted == 0 and kv.device_counters.blocks_evicted == 6
    kv.check_integrity()
    tiers.check_integrity()


def test_a_host_tier_smaller_than_the_window_cannot_keep_an_idle_engine_copying() -> None:
    """Each idle period plans at most ``num_blocks`` stores, even when the host tier evicts what was
    just written back (every pass would find dirty blocks again)."""
    kv, tiers = bookkeeping(num_blocks=8, host_blocks=2)
    prefill(kv, "chat", list(range(100, 132)))
    kv.free("chat")
    ahead = WriteBackAhead(kv.pool, tiers, num_blocks=8, step_blocks=3)
    ahead.after_step()
    planned = []
    while ahead.pending:
        planned.append(ahead.plan())
        run_plan(kv, tiers)
    assert sum(planned) == 8 and len(planned) >= 3 and tiers.host.num_used_blocks == 2


def test_the_default_window_is_one_steps_blocks_within_half_the_host_tier() -> None:
    assert default_blocks(2048, 16, 1000) == 128 and default_blocks(8192, 16, 600) == 300
    model = ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16,
    )  # fmt: skip
    host = EngineArgs(kv_host_gb=0.01, kv_device_blocks=64)
    assert resolve_engine_config(host, model).tiers.write_ahead_blocks == 2048 // 16
    chosen = EngineArgs(kv_host_gb=0.01, kv_device_blocks=64, kv_write_ahead_blocks=5)
    assert resolve_engine_config(chosen, model).tiers.write_ahead_blocks == 5
    for off in (
        EngineArgs(kv_device_blocks=64),  # no host tier: nothing to write back to
        EngineArgs(kv_host_gb=0.01, kv_device_blocks=64, kv_store_policy="write_through"),  # stored when full
    ):
        assert resolve_engine_config(off, model).tiers.write_ahead_blocks == 0
    with pytest.raises(ConfigError, match="kv_write_ahead_blocks"):
        EngineArgs(kv_write_ahead_blocks=-1).validate()
    for useless in (
        EngineArgs(kv_device_blocks=64, kv_write_ahead_blocks=5),
        EngineArgs(
            kv_host_gb=0.01, kv_device_blocks=64, kv_store_policy="write_through", kv_write_ahead_blocks=5
        ),
    ):
        with pytest.raises(ConfigError, match="needs a write_back host tier"):
            resolve_engine_config(useless, model)
    off = EngineArgs(kv_device_blocks=64, kv_write_ahead_blocks=0)  # 0: off, asked anywhere
    assert resolve_engine_config(off, model).tiers.write_ahead_blocks == 0
    half = resolve_engine_config(host, model).tiers.num_host_blocks // 2
    churn = EngineArgs(kv_host_gb=0.01, kv_device_blocks=64, kv_write_ahead_blocks=half + 1)
    with pytest.raises(ConfigError, match="more than half the host tier"):
        resolve_engine_config(churn, model)
    assert (
        resolve_engine_config(replace(churn, kv_write_ahead_blocks=half), model).tiers.write_ahead_blocks
        == half
    )


def test_a_returning_prompt_written_back_ahead_answers_as_before(tiny_llama_dir: Any) -> None:
    chat = [7 + (i * 13) % 480 for i in range(60)]  # 3 full blocks of 16 and a partial one
    filler = [11 + (i * 31) % 470 for i in range(120)]
    with LLM(model=str(tiny_llama_dir())) as plain:
        reference = plain.generate([{"prompt_token_ids": chat}], GREEDY)[0]

    llm = LLM(model=str(tiny_llama_dir()), kv_device_blocks=8, kv_host_gb=64 * 8192 / 2**30)
    host = llm.engine.tiers.host
    llm.generate([{"prompt_token_ids": chat}], GREEDY)
    assert settle(llm.engine, max_steps=100)  # what a server does between requests
    stored_ahead = host.counters.blocks_stored
    assert stored_ahead >= 3  # the chat's blocks, next in line, now in the host tier too

    llm.generate([{"prompt_token_ids": filler}], GREEDY)  # 8 blocks: evicts the chat's from the device
    assert llm.engine.kv.device_counters.blocks_evicted >= 3
    assert host.counters.blocks_stored == stored_ahead  # the evicting steps copied nothing down

    again = llm.generate([{"prompt_token_ids": chat}], GREEDY)[0]
    assert again.outputs[0].token_ids == reference.outputs[0].token_ids
    assert llm.engine.stats().tiers["host"].hit_blocks >= 3  # served from the host tier
    llm.engine.kv.check_integrity()
    llm.close()
