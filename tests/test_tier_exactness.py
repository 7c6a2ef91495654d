"""The cache never changes the answer: greedy outputs on the real model are identical with the tiers
off, host only, host + disk, after a restart on the disk tier, and under swap or recompute
preemption — and the statistics prove the later runs really were served by those tiers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.llm import LLM
from kvtier.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful assistant for a logistics company. Answer in one short sentence. " * 3
TOPICS = ["shipping delays", "customs forms", "pallet sizes"]
FOLLOW_UPS = ["Why?", "Give an example."]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SMALL_POOL = 20  # blocks: about two conversations' worth, so the device pool evicts all the time


def multiturn(llm: LLM) -> list[list[int]]:
    """Round-robin chat: turn t of every conversation, then turn t + 1; history carries answers."""
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Tell me about {t}."}]
        for t in TOPICS
    ]
    answers: list[list[int]] = []
    for turn in range(len(FOLLOW_UPS)):
        for conv in histories:
            out = llm.generate(llm.render_chat(conv), GREEDY)[0]
            answers.append(out.outputs[0].token_ids)
            conv += [
                {"role": "assistant", "content": out.outputs[0].text},
                {"role": "user", "content": FOLLOW_UPS[turn]},
            ]
    return answers


def shared_system_prompt(llm: LLM) -> list[list[int]]:
    docs = [
        f"Document {i}: " + " ".join(f"item {i}-{j} weighs {j * 7 + i} kg." for j in range(10))
        for i in range(5)
    ]
    prompts = [
        llm.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": d}]) for d in docs
    ]
    return [o.outputs[0].token_ids for o in llm.generate(prompts + prompts, GREEDY)]


def run(**kwargs: Any) -> tuple[list[list[int]], list[list[int]], LLM]:
    llm = LLM(kv_device_blocks=SMALL_POOL, **kwargs)
    return multiturn(llm), shared_system_prompt(llm), llm


@pytest.fixture(scope="module")
def reference(converted_default_model: Any) -> tuple[list[list[int]], list[list[int]]]:
    mt, ss, llm = run()
    stats = llm.engine.stats()
    assert stats.tiers["device"].blocks_evicted > 0  # the small pool really evicts
    return mt, ss


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("kv-disk")


def test_host_tier_serves_evicted_prefixes_with_identical_output(reference: Any) -> None:
    mt, ss, llm = run(kv_host_gb=0.25)
    assert (mt, ss) == reference
    host = llm.engine.stats().tiers["host"]
    assert host.blocks_stored > 0 and host.blocks_loaded > 0 and host.hit_blocks > 0
    llm.engine.kv.check_integrity()
    llm.close()


def test_host_and_disk_then_restart_serve_from_disk_with_identical_output(
    reference: Any, disk_dir: Path
) -> None:
    mt, ss, llm = run(kv_host_gb=0.02, kv_disk_dir=str(disk_dir))  # host holds ~28 blocks: disk works too
    assert (mt, ss) == reference
    stats = llm.engine.stats()
    assert stats.tiers["host"].blocks_loaded > 0 and stats.tiers["disk"].blocks_stored > 0
    llm.engine.kv.check_integrity()
    llm.close()
    assert list(disk_dir.rglob("*.kvb"))

    restarted = LLM(kv_device_blocks=SMALL_POOL, kv_host_gb=0.02, kv_disk_dir=str(disk_dir))
    first = restarted.generate(
        restarted.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}]),
        GREEDY,
    )[0]
    assert first.cached_tokens_by_tier["disk"] > 0  # a cold process, a warm prefix
    assert (multiturn(restarted), shared_system_prompt(restarted)) == reference
    disk = restarted.engine.stats().tiers["disk"]
    assert disk.blocks_loaded > 0 and disk.hit_blocks > 0
    restarted.close()


def test_write_through_policy_gives_identical_output(reference: Any) -> None:
    """Write-through stores each block as it fills, before the device pool has evicted anything
    (write-back would store nothing yet); later prefixes are then served from the host tier."""
    llm = LLM(kv_device_blocks=SMALL_POOL, kv_host_gb=0.25, kv_store_policy="write_through")
    hello = llm.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}])
    llm.generate(hello, GREEDY)  # about 5 of the pool's 20 blocks: no eviction yet
    stats = llm.engine.stats()
    assert stats.tiers["device"].blocks_evicted == 0
    full_blocks = len(hello["prompt_token_ids"]) // llm.engine.config.cache.block_size
    assert stats.tiers["host"].blocks_stored >= full_blocks > 0

    assert (multiturn(llm), shared_system_prompt(llm)) == reference
    stats = llm.engine.stats()
    assert stats.tiers["device"].blocks_evicted > 0
    host = stats.tiers["host"]
    assert host.hit_blocks > 0 and host.blocks_loaded > 0
    llm.engine.kv.check_integrity()
    llm.close()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_sequences_finish_with_the_uninterrupted_tokens(
    mode: str, converted_default_model: Any
) -> None:
    prompts = [f"Write a long story about a robot named R{i} who learns to paint." for i in range(4)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    with LLM(kv_device_blocks=200) as roomy:
        expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    # 4 sequences x (~20 prompt + 32 output tokens) need ~16 blocks at the end: 9 forces preemption.
    with LLM(kv_device_blocks=9, kv_host_gb=0.05, preemption_mode=mode) as tight:
        got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
        preemptions = tight.engine.stats().num_preemptions
        tight.engine.kv.check_integrity()
    assert got == expected
    assert preemptions[mode] > 0
    assert preemptions["swap" if mode == "recompute" else "recompute"] == 0


def test_unusable_disk_dir_degrades_to_no_disk_tier_with_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, converted_default_model: Any
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    prompt = "Name three colors."
    with LLM(kv_device_blocks=20) as plain:
        expected = plain.generate(prompt, GREEDY)[0].outputs[0].token_ids
    with (
        caplog.at_level("WARNING", logger="kvtier"),
        LLM(kv_device_blocks=20, kv_host_gb=0.02, kv_disk_dir=str(blocker / "kv")) as llm,
    ):
        assert llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == expected
        assert llm.engine.stats().tiers["disk"].capacity_blocks == 0
    disk_lines = [r for r in caplog.records if r.name.startswith("kvtier.tiers.disk")]
    assert len(disk_lines) == 1 and "disabled" in disk_lines[0].getMessage()
