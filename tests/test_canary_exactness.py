"""The canary never fires on the exactness suite's tiered workloads (``tests/test_tier_exactness.py``)
beyond the host-tier run of ``test_canary.py``: a host tier small enough that the disk tier serves,
then a restarted process served from that disk; write-through stores with small prefill chunks and
swap preemption. Every request served from cache is checked (rate 1.0); none may mismatch."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.llm import LLM
from kvtier.sampling_params import SamplingParams
from tests.test_canary import drain
from tests.test_tier_exactness import SMALL_POOL, multiturn, shared_system_prompt

pytestmark = pytest.mark.slow


def checked(**engine: object) -> LLM:
    llm = LLM(kv_device_blocks=SMALL_POOL, canary_rate=1.0, **engine)
    llm.engine.insight.canary.max_pending = 64  # every sampled request checked, none skipped
    return llm


def assert_honest(llm: LLM, *tiers: str) -> None:
    drain(llm)
    report = llm.engine.kv_canary()
    assert report["checks"]["mismatch"] == 0 and report["quarantined"] == [], report
    assert report["checks"]["skipped"] == 0
    for tier in tiers:
        assert report["by_tier"][tier]["match"] > 0, (tier, report["by_tier"])


def test_host_and_disk_then_a_restart_served_from_disk(tmp_path: Path) -> None:
    llm = checked(kv_host_gb=0.02, kv_disk_dir=str(tmp_path))  # host holds ~28 blocks: disk serves
    multiturn(llm)
    shared_system_prompt(llm)
    assert_honest(llm, "device", "disk")  # the small host tier passes blocks on to disk, which serves
    llm.close()
    restarted = checked(kv_host_gb=0.02, kv_disk_dir=str(tmp_path))
    multiturn(restarted)
    assert_honest(restarted, "disk")
    restarted.close()


def test_write_through_small_chunks_and_swap_preemption() -> None:
    llm = checked(
        kv_host_gb=0.25,
        kv_store_policy="write_through",
        max_num_batched_tokens=48,
        preemption_mode="swap",
    )
    multiturn(llm)
    shared_system_prompt(llm)
    stories = [f"Write a long story about a robot named R{i} who learns to paint." for i in range(4)]
    llm.generate(stories, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    assert_honest(llm, "device", "host")
    llm.close()
