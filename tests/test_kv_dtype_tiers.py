"""Compact KV blocks through every tier: the bytes a device block holds (data and scales) come back
byte for byte from host memory, disk and Redis, each tier holds 2-4x more of them for the same bytes,
and a stored block of another KV dtype is never loaded (its header says so: a counted miss)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.llm import LLM
from kvtier.sampling_params import SamplingParams
from kvtier.tiers.base import BlockKey, TierIdentity
from kvtier.tiers.block_format import (
    CorruptBlock,
    decode_block_value,
    encode_block_value,
    read_block_file,
    write_block_file,
)
from kvtier.transfer.mover import byte_view

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = [list(range(10 + 7 * i, 10 + 7 * i + 70)) for i in range(4)]  # 4 prompts of 70 tokens
POOL = 12  # device blocks: two prompts' worth, so the device evicts


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_dir: Any) -> str:
    return str(tiny_llama_dir(num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=64))


def device_blocks(llm: LLM) -> dict[bytes, torch.Tensor]:
    """Every cached device block's raw bytes, by block hash."""
    raw = llm.engine.runner.kv_cache
    return {bytes(h): raw[b].clone() for b, h in llm.engine.kv.cached_blocks()}


def serve(llm: LLM, seen: dict[bytes, torch.Tensor]) -> list[list[int]]:
    """Generate every prompt twice over, recording each block's bytes while it sits on the device."""
    answers = []
    for _ in range(2):
        for prompt in PROMPTS:
            answers.append(llm.generate([prompt], GREEDY)[0].outputs[0].token_ids)
            for key, value in device_blocks(llm).items():
                if key in seen:  # a block loaded back from a tier holds the bytes first computed
                    assert torch.equal(seen[key], value), "a block came back with other bytes"
                seen.setdefault(key, value)
    return answers


@pytest.mark.slow
@pytest.mark.parametrize("kd", ["int8", "fp8_e4m3"])
def test_compact_blocks_round_trip_byte_identical_through_host_and_disk(
    tiny_dir: str, tmp_path: Path, kd: str
) -> None:
    seen: dict[bytes, torch.Tensor] = {}
    kwargs = dict(kv_cache_dtype=kd, kv_device_blocks=POOL, kv_host_gb=0.0005, kv_disk_dir=str(tmp_path))
    with LLM(tiny_dir, **kwargs) as llm:
        answers = serve(llm, seen)
        host = llm.engine.stats().tiers["host"]
        block_bytes = llm.engine.config.cache.block_bytes
        assert host.blocks_loaded > 0 and host.bytes_loaded == host.blocks_loaded * block_bytes
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > block_bytes]
    assert files and all(p.stat().st_size == 4096 + block_bytes for p in files)  # header + compact payload
    with LLM(tiny_dir, **kwargs) as restarted:  # a new process finds them on disk
        assert serve(restarted, seen) == answers
        disk = restarted.engine.stats().tiers["disk"]
        assert disk.blocks_loaded > 0 and disk.bytes_loaded == disk.blocks_loaded * block_bytes


@pytest.mark.slow
def test_compact_blocks_round_trip_byte_identical_through_redis(tiny_dir: str, redis_server: Any) -> None:
    seen: dict[bytes, torch.Tensor] = {}
    kwargs = dict(
        kv_cache_dtype="int8", kv_device_blocks=POOL, kv_host_gb=0.0005, kv_remote_url=redis_server.url
    )
    with LLM(tiny_dir, **kwargs) as writer:
        answers = serve(writer, seen)
        writer.engine.tiers.flush()
    with LLM(tiny_dir, **kwargs) as reader:  # another engine: an empty device pool and host tier
        assert serve(reader, seen) == answers
        remote = reader.engine.stats().tiers["remote"]
        assert remote.blocks_loaded > 0
        assert remote.bytes_loaded == remote.blocks_loaded * reader.engine.config.cache.block_bytes


def test_host_tier_holds_3_7x_the_blocks_of_fp32_for_the_same_bytes(tiny_dir: Any) -> None:
    from kvtier.config import EngineArgs, resolve_engine_config
    from kvtier.models.loader import load_model

    model = load_model(tiny_dir).config
    host = {
        kd: resolve_engine_config(EngineArgs(kv_cache_dtype=kd, kv_host_gb=1), model).tiers.num_host_blocks
        for kd in ("auto", "bfloat16", "int8")
    }
    # head_dim 32 here: 32 one-byte values + a 4-byte scale per (token, layer, K/V, head) = 3.55x
    assert host["int8"] >= 3.5 * host["auto"] and host["int8"] >= 1.75 * host["bfloat16"]


# ------------------------------------------------------------------------------ another KV dtype
SHAPE = (2, 16 * 2 * 2 * (32 + 4))  # [L, layer_bytes] of an fp8/int8 block of the tiny model


def identity(kv_dtype: str) -> TierIdentity:
    return TierIdentity("ab" * 32, kv_dtype, SHAPE, 1)


def test_a_disk_block_of_another_kv_dtype_is_never_loaded(tmp_path: Path) -> None:
    """fp8_e4m3, fp8_e5m2 and int8 blocks have the same shape and size: only the header tells them apart."""
    key = BlockKey(hashlib.sha256(b"A").digest())
    block = torch.randint(0, 256, SHAPE, dtype=torch.uint8)
    path = tmp_path / "block"
    write_block_file(str(path), key, identity("fp8_e4m3"), byte_view(block))
    out = torch.zeros(SHAPE, dtype=torch.uint8)
    read_block_file(str(path), key, identity("fp8_e4m3"), byte_view(out))
    assert torch.equal(out, block)
    for other in ("fp8_e5m2", "int8"):
        with pytest.raises(CorruptBlock, match="written as fp8_e4m3"):
            read_block_file(str(path), key, identity(other), byte_view(torch.zeros(SHAPE, dtype=torch.uint8)))


def test_a_remote_value_of_another_kv_dtype_is_never_loaded() -> None:
    key = BlockKey(hashlib.sha256(b"B").digest())
    block = torch.randint(0, 256, SHAPE, dtype=torch.uint8)
    value = encode_block_value(key, identity("int8"), byte_view(block), None)
    with pytest.raises(CorruptBlock, match="written as int8"):
        decode_block_value(
            value, key, identity("fp8_e4m3"), byte_view(torch.zeros(SHAPE, dtype=torch.uint8)), None
        )


@pytest.mark.slow
def test_an_engine_of_another_kv_dtype_on_the_same_disk_finds_nothing(tiny_dir: str, tmp_path: Path) -> None:
    common = dict(kv_device_blocks=POOL, kv_host_gb=0.0005, kv_disk_dir=str(tmp_path))
    with LLM(tiny_dir, kv_cache_dtype="fp8_e4m3", **common) as llm:
        serve(llm, {})
    with LLM(tiny_dir, kv_cache_dtype="fp8_e5m2", **common) as other:
        alone = [other.generate([p], GREEDY)[0] for p in PROMPTS]
        assert all(o.cached_tokens_by_tier.get("disk", 0) == 0 for o in alone)
        assert other.engine.stats().tiers["disk"].blocks_loaded == 0
