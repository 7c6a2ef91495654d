"""The equivalence canary on the real model: bytes flipped in a host block (host memory has no
checksum) and in a disk file re-written with a valid checksum are caught, the tier is quarantined,
and later requests recompute instead, with the exact answer. Honest tiers never trip it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.kv.hashing import extend_block_hashes, root_hash
from kvtier.llm import LLM
from kvtier.sampling_params import SamplingParams
from kvtier.stats import Medium
from kvtier.tiers.block_format import read_block_file, write_block_file

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPT = [3 + (i * 7) % 400 for i in range(70)]  # 4 full blocks looked up
FILLERS = [[5 + (i * 131 + j * 17) % 490 for j in range(100)] for i in range(5)]
BLOCK_BYTES = 8192  # the tiny model: 2 layers x 16 tokens x K,V x 2 heads x 16 x float32


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Any) -> str:
    return str(tiny_llama_dir())


def prompt_keys(llm: LLM, prompt: list[int]) -> list[bytes]:
    """The chained keys of the prompt's full blocks, as the engine computes them."""
    e = llm.engine
    keys: list[bytes] = []
    extend_block_hashes(keys, prompt, e.kv.block_size, root_hash((e.cache_identity, "")))
    return keys[: (len(prompt) - 1) // e.kv.block_size]


def answer(llm: LLM, prompt: list[int]) -> tuple[list[int], dict[Any, int]]:
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0]
    return list(out.outputs[0].token_ids), dict(out.cached_tokens_by_tier)


def drain(llm: LLM) -> int:
    n = 0
    while llm.engine.run_idle_work():
        n += 1
    return n


def flip(raw: torch.Tensor | bytearray, at: int = 4096, n: int = 64) -> None:
    """Invert ``n`` bytes from ``at``: exponents and high mantissas included."""
    if isinstance(raw, torch.Tensor):
        raw[at : at + n].bitwise_xor_(0xFF)
    else:
        for i in range(at, at + n):
            raw[i] ^= 0xFF


def test_story_a_flipped_host_block_is_caught_and_the_host_tier_quarantined(tiny: str) -> None:
    llm = LLM(model=tiny, kv_device_blocks=16, kv_host_gb=64 * BLOCK_BYTES / 2**30, canary_rate=1.0)
    e = llm.engine
    reference, _ = answer(llm, PROMPT)
    for f in FILLERS:  # push the prompt's blocks out of the device pool into the host tier
        answer(llm, f)
    keys = prompt_keys(llm, PROMPT)
    assert 1 <= len(keys) <= 4 and all(e.tiers.host.contains(k) for k in keys)
    drain(llm)
    assert e.kv_canary()["checks"]["mismatch"] == 0

    # Act 1: one byte range of one host block goes bad; the next request is served from host.
    bad = keys[1]
    flip(e.mover.host.block(e.tiers.host.host_block_of(bad)).view(-1).view(torch.uint8), at=1024)
    _, by_tier = answer(llm, PROMPT)
    assert by_tier[Medium.HOST] > 0
    assert drain(llm) == 1
    report = e.kv_canary()
    assert report["quarantined"] == ["host"]
    assert report["by_tier"]["host"]["mismatch"] == 1 and report["by_tier"]["host"]["match"] >= 1
    assert report["last_mismatch"]["tier"] == "host" and report["last_mismatch"]["block_keys"] == [bad.hex()]
    assert report["last_mismatch"]["max_abs_diff"] > 1.0
    assert e.stats().canary_checks[("mismatch", "host")] == 1

    # Act 2: nothing more is loaded from host; the prompt is recomputed and the answer is exact again.
    loaded = e.stats().tiers[Medium.HOST].blocks_loaded
    for f in FILLERS[:2]:
        answer(llm, f)
    again, by_tier = answer(llm, PROMPT)
    assert again == reference and by_tier[Medium.HOST] == 0
    assert e.stats().tiers[Medium.HOST].blocks_loaded == loaded

    # Act 3: the admin lifts the quarantine; the host tier serves again (the bad block was dropped).
    assert e.release_quarantine([Medium.HOST]) == [Medium.HOST] and e.quarantined() == []
    e.kv.check_integrity()
    llm.close()


def test_story_a_disk_file_rewritten_with_a_valid_checksum_is_caught(tiny: str, tmp_path: Path) -> None:
    llm = LLM(
        model=tiny,
        kv_device_blocks=16,
        kv_host_gb=8 * BLOCK_BYTES / 2**30,  # 8 host blocks: the fillers push the prompt down to disk
        kv_disk_dir=str(tmp_path / "kv"),
        canary_rate=1.0,
    )
    e = llm.engine
    disk = e.tiers.tier(Medium.DISK)
    reference, _ = answer(llm, PROMPT)
    for f in FILLERS:
        answer(llm, f)
    drain(llm)
    keys = prompt_keys(llm, PROMPT)
    e.tiers.flush()  # every write on its way is on disk
    assert all(disk.contains(k) and not e.tiers.host.contains(k) for k in keys)

    # Act 1: a block file is edited and re-written with a valid header and checksum.
    bad = keys[0]
    payload = bytearray(disk.identity.block_bytes)
    read_block_file(disk.path_of(bad), bad, disk.identity, payload)
    flip(payload, at=1024)
    Path(disk.path_of(bad)).unlink()
    write_block_file(disk.path_of(bad), bad, disk.identity, payload)
    _, by_tier = answer(llm, PROMPT)
    assert by_tier[Medium.DISK] > 0  # the checksum passed: the bad bytes were served
    assert drain(llm) == 1
    report = e.kv_canary()
    assert report["quarantined"] == ["disk"] and report["last_mismatch"]["block_keys"] == [bad.hex()]
    assert report["by_tier"]["disk"]["mismatch"] == 1

    # Act 2: the disk tier is no longer read; the answer is exact again.
    loaded = e.stats().tiers[Medium.DISK].blocks_loaded
    for f in FILLERS:
        answer(llm, f)
    again, by_tier = answer(llm, PROMPT)
    assert again == reference and by_tier[Medium.DISK] == 0
    assert e.stats().tiers[Medium.DISK].blocks_loaded == loaded
    llm.close()


@pytest.mark.slow
def test_honest_tiers_never_trip_the_canary_over_a_long_run() -> None:
    """The exactness suite's workloads (multi-turn chat, a shared system prompt) on the real model over
    a host tier, every request served from cache checked: only matches, nothing quarantined."""
    from tests.test_tier_exactness import multiturn, shared_system_prompt

    llm = LLM(kv_device_blocks=20, kv_host_gb=0.25, canary_rate=1.0)  # as test_tier_exactness
    llm.engine.insight.canary.max_pending = 64  # every request checked, none skipped
    for workload in (multiturn, shared_system_prompt):
        workload(llm)
        drain(llm)
    report = llm.engine.kv_canary()
    assert report["checks"]["mismatch"] == 0 and report["quarantined"] == []
    assert report["checks"]["skipped"] == 0 and report["checks"]["match"] >= 20
    assert report["by_tier"]["host"]["match"] > 0 and report["by_tier"]["device"]["match"] > 0
    llm.close()


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_story_compact_kv_blocks_are_checked_after_dequantizing(tiny: str, kv_dtype: str) -> None:
    """With compact KV the canary compares dequantized values: honest host blocks match, a flipped
    one (data bytes inverted) is caught and the host tier is quarantined."""
    block_bytes = 2 * (16 * 2 * 2 * 16 + 16 * 2 * 2 * 4)  # 2 layers x (1-byte data + float32 scales)
    llm = LLM(
        model=tiny,
        kv_device_blocks=16,
        kv_host_gb=64 * block_bytes / 2**30,
        kv_cache_dtype=kv_dtype,
        canary_rate=1.0,
    )
    e = llm.engine
    assert e.config.cache.block_bytes == block_bytes
    reference, _ = answer(llm, PROMPT)
    for f in FILLERS:
        answer(llm, f)
    keys = prompt_keys(llm, PROMPT)
    assert all(e.tiers.host.contains(k) for k in keys)
    again, by_tier = answer(llm, PROMPT)  # honest: served from host, checked, agrees
    assert again == reference and by_tier[Medium.HOST] > 0
    drain(llm)
    report = e.kv_canary()
    assert report["checks"]["mismatch"] == 0 and report["by_tier"]["host"]["match"] >= 1

    for f in FILLERS:  # the prompt's blocks back down to the host tier
        answer(llm, f)
    drain(llm)  # the fillers' own checks (they are cached now): the queue has room again
    flip(e.mover.host.block(e.tiers.host.host_block_of(keys[1])).view(-1).view(torch.uint8), at=0)
    _, by_tier = answer(llm, PROMPT)
    assert by_tier[Medium.HOST] > 0
    drain(llm)
    report = e.kv_canary()
    assert report["quarantined"] == ["host"] and report["last_mismatch"]["block_keys"] == [keys[1].hex()]
    llm.close()
