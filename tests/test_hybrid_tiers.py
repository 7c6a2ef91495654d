"""A hybrid model's KV groups through the shared and compact tiers: a second engine resumes a Gemma 3
conversation from Redis, and int8 / fp8 KV blocks of every group come back byte for byte from host
memory, disk and a restart.

The model is the tiny random Gemma 3 of ``tests/test_hybrid_engine.py`` (6 layers ``s s F s s F``, a
6-token window over 4-token blocks: one full group and two sliding groups of 2 slots), so prompts of
60-90 tokens release sliding blocks all the time and every returning prefix needs blocks of all three
groups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier import LLM
from kvtier.stats import Medium
from tests.test_hybrid_engine import BLOCK, hf_continuation, prompts_of, tiny_gemma
from tests.test_qwen3 import GREEDY, token_ids


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gemma(tmp_path_factory.mktemp("gemma"))


def make(directory: Path, **kwargs: Any) -> LLM:
    return LLM(str(directory), **{"block_size": BLOCK, "kv_device_blocks": 64, **kwargs})


def group_blocks(llm: LLM) -> dict[bytes, torch.Tensor]:
    """Every cached device block's raw bytes (its layer slots of one group), by group key."""
    raw = llm.engine.runner.kv_cache
    return {bytes(key): raw[b].clone() for b, key in llm.engine.kv.cached_blocks()}


def turns(directory: Path) -> tuple[list[int], list[int]]:
    """A 60-token first turn, and the 15 tokens the user adds after the answer."""
    prompts = prompts_of(directory)
    return prompts[6], prompts[2]


def test_a_second_engine_resumes_a_gemma_conversation_from_redis(gemma: Path, redis_server: Any) -> None:
    first_turn, follow_up = turns(gemma)
    shared = dict(kv_host_gb=0.001, kv_remote_url=redis_server.url)
    with make(gemma, **shared) as writer:
        answer = token_ids(writer.generate([{"prompt_token_ids": first_turn}], GREEDY))[0]
        writer.engine.flush_tiers()  # the write-through stores land in Redis
        written = {bytes(k) for _, k in writer.engine.kv.cached_blocks()}
    assert answer == hf_continuation(gemma, first_turn)
    second_turn = first_turn + answer + follow_up
    with make(gemma, **shared) as reader:  # another replica: empty device pool and host tier
        out = reader.generate([{"prompt_token_ids": second_turn}], GREEDY)[0]
        loaded = {bytes(k) for _, k in reader.engine.kv.cached_blocks()} & written
        remote = reader.engine.stats().tiers[Medium.REMOTE]
    assert out.outputs[0].token_ids == hf_continuation(gemma, second_turn)
    assert out.cached_tokens_by_tier.get(Medium.REMOTE, 0) > 0
    # the hit loaded the full group's blocks of every cached token and each sliding group's window
    num_full = out.num_cached_tokens // BLOCK
    assert remote.blocks_loaded > num_full
    sliding = [g for g, spec in enumerate(reader.engine.kv.layout.groups) if spec.window is not None]
    assert len(sliding) == 2 and len(loaded) >= num_full + len(sliding)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_compact_gemma_blocks_of_every_group_come_back_byte_for_byte(
    gemma: Path, tmp_path: Path, kv_dtype: str
) -> None:
    first_turn, follow_up = turns(gemma)
    tiers = dict(kv_cache_dtype=kv_dtype, kv_host_gb=0.0005, kv_disk_dir=str(tmp_path / "kv"))
    with make(gemma, kv_cache_dtype=kv_dtype, enable_prefix_caching=False) as plain:
        answer = token_ids(plain.generate([{"prompt_token_ids": first_turn}], GREEDY))[0]
        second_turn = first_turn + answer + follow_up
        want = token_ids(plain.generate([{"prompt_token_ids": second_turn}], GREEDY))[0]
    with make(gemma, **tiers) as first:
        assert token_ids(first.generate([{"prompt_token_ids": first_turn}], GREEDY))[0] == answer
        computed = group_blocks(first)
    with make(gemma, **tiers) as restarted:  # a new engine finds each group's blocks on disk
        out = restarted.generate([{"prompt_token_ids": second_turn}], GREEDY)[0]
        reloaded = group_blocks(restarted)
        disk = restarted.engine.stats().tiers[Medium.DISK]
    assert out.outputs[0].token_ids == want  # the cache never changes the answer of this KV dtype
    assert out.cached_tokens_by_tier.get(Medium.DISK, 0) > 0 and disk.blocks_loaded > 0
    common = computed.keys() & reloaded.keys()  # the hit's blocks: every full one, each window's
    assert len(common) > out.num_cached_tokens // BLOCK  # sliding groups' blocks came back too
    for key in common:
        assert torch.equal(computed[key], reloaded[key]), "a block came back with other bytes"


def test_a_restart_reads_each_block_a_returning_gemma_prompt_needs_once(gemma: Path, tmp_path: Path) -> None:
    """A restarted engine, its host tier only a little larger than one returning prompt's blocks:
    the prompt's blocks come up from disk once each (no group's reads evict another's, no window is
    read for a prefix the prompt will not end at), in a few steps, and the whole prefix is a hit."""
    first_turn, follow_up = turns(gemma)
    disk = str(tmp_path / "kv")
    with make(gemma, kv_host_gb=0.01, kv_disk_dir=disk) as first:
        answer = token_ids(first.generate([{"prompt_token_ids": first_turn}], GREEDY))[0]
        second_turn = first_turn + answer + follow_up
        answer = token_ids(first.generate([{"prompt_token_ids": second_turn}], GREEDY))[0]
        block_bytes = first.engine.runner.kv_cache[0].nbytes
    third_turn = second_turn + answer + follow_up
    num_full = (len(third_turn) - 1) // BLOCK
    num_computed = (len(second_turn) + len(answer) - 1) // BLOCK  # full blocks turn 2 computed
    host_gb = (num_full * 2 + 8) * block_bytes / 2**30  # one prompt's full blocks and windows, and some
    with make(gemma, kv_host_gb=host_gb, kv_disk_dir=disk) as restarted:
        engine = restarted.engine
        request_id = engine.add_request({"prompt_token_ids": third_turn}, GREEDY)
        steps, outputs = 0, []
        while not engine.scheduler.running:  # waiting for its blocks to come up from disk
            outputs += engine.step()
            steps += 1
        while not any(o.finished for o in outputs):
            outputs += engine.step()
        tiers = engine.stats().tiers
    out = next(o for o in outputs if o.request_id == request_id and o.finished)
    assert out.outputs[0].token_ids == hf_continuation(gemma, third_turn)
    assert out.num_cached_tokens == num_computed * BLOCK  # every block turn 2 computed: no recompute
    assert tiers[Medium.DISK].blocks_loaded == tiers[Medium.HOST].blocks_loaded  # each read was used
    assert steps <= 3, f"{steps} steps waited for the reads (one per block read)"
