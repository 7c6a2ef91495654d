"""The canary's bfloat16 tolerance (5e-2): honest bf16 blocks, computed in chunks by the engine and in
one prefill by the canary, never trip it over repeated rounds; a flipped bf16 block is caught."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvtier.llm import LLM
from kvtier.stats import Medium
from tests.test_canary import FILLERS, PROMPT, answer, drain, flip, prompt_keys

BF16_BLOCK_BYTES = 4096  # the tiny model: 2 layers x 16 tokens x K,V x 2 heads x 16 x 2 bytes


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtypes",
    [{"dtype": "bfloat16"}, {"dtype": "float32", "kv_cache_dtype": "bfloat16"}],
    ids=["bf16-compute", "bf16-kv"],
)
def test_story_bf16_blocks_match_when_honest_and_a_flipped_one_is_caught(
    tiny_llama_dir: Any, dtypes: dict[str, str]
) -> None:
    llm = LLM(
        model=str(tiny_llama_dir()),
        kv_device_blocks=16,
        kv_host_gb=64 * BF16_BLOCK_BYTES / 2**30,
        max_num_batched_tokens=32,  # the engine prefills in chunks of 32; the canary in one go
        canary_rate=1.0,
        **dtypes,
    )
    e = llm.engine
    assert e.config.cache.kv_dtype == "bfloat16" and e.insight.canary.tolerance == 5e-2
    assert e.config.cache.block_bytes == BF16_BLOCK_BYTES
    e.insight.canary.max_pending = 64  # every sampled request checked
    reference, _ = answer(llm, PROMPT)

    # Act 1: honest rounds, the prompt served from the host tier and from the device pool.
    for _ in range(3):
        for f in FILLERS:
            answer(llm, f)
        again, by_tier = answer(llm, PROMPT)
        assert again == reference and by_tier[Medium.HOST] > 0
        again, by_tier = answer(llm, PROMPT)
        assert again == reference and by_tier[Medium.DEVICE] > 0
    drain(llm)
    report = e.kv_canary()
    assert report["checks"]["mismatch"] == 0 and report["quarantined"] == []
    assert report["by_tier"]["host"]["match"] >= 3 and report["by_tier"]["device"]["match"] >= 3

    # Act 2: one bf16 host block goes bad (32 values' sign and exponent bits inverted).
    for f in FILLERS:
        answer(llm, f)
    drain(llm)
    keys = prompt_keys(llm, PROMPT)
    bad = keys[2]
    flip(e.mover.host.block(e.tiers.host.host_block_of(bad)).view(-1).view(torch.uint8), at=512)
    _, by_tier = answer(llm, PROMPT)
    assert by_tier[Medium.HOST] > 0
    drain(llm)
    report = e.kv_canary()
    assert report["quarantined"] == ["host"] and report["last_mismatch"]["block_keys"] == [bad.hex()]
    assert report["by_tier"]["host"]["mismatch"] == 1

    # Act 3: no more host loads; the prompt is recomputed and the answer is the reference again.
    for f in FILLERS[:2]:
        answer(llm, f)
    again, by_tier = answer(llm, PROMPT)
    assert again == reference and by_tier[Medium.HOST] == 0
    llm.close()
