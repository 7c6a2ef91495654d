"""The cache never changes the answer, whatever the engine's settings: random engines (pool size, policy,
preemption by swap or recompute, a host tier or none, chunk sizes, sequences per step, partial
prefills) over tiny random models (dense Qwen3, hybrid Gemma 3, Qwen3 with sliding layers) answer random
prompts, some sharing a prefix, twice (the second time from the caches), and each answer is the one an
engine with a large pool and no prefix caching gives. The KV manager's books balance afterwards.

1,500 such engines (seed 2) all answered alike when this was written; this runs 60 each time."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvtier import LLM, SamplingParams
from kvtier.config_checks import ConfigError
from tests.test_hybrid_engine import tiny_gemma
from tests.test_qwen3 import tiny_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("models")
    return {
        "gemma3 (hybrid)": tiny_gemma(tmp / "gemma"),
        "qwen3 (sliding layers)": tiny_checkpoint(
            tmp / "sliding",
            "qwen3",
            num_hidden_layers=4,
            num_key_value_heads=1,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=2,
        ),  # fmt: skip
        "qwen3": tiny_checkpoint(tmp / "qwen3", "qwen3"),
    }


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def answers(llm: LLM, prompts: list[list[int]], n: int, order: list[int]) -> list[list[int]]:
    """Each prompt's answer, in prompt order, the prompts submitted in ``order``."""
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in order], greedy(n))
    got = {i: out.outputs[0].token_ids for i, out in zip(order, outs, strict=True)}
    return [got[i] for i in range(len(prompts))]


def random_engine(rng: random.Random, max_model_len: int) -> dict[str, Any]:
    return dict(
        block_size=4,
        max_model_len=max_model_len,
        kv_device_blocks=rng.choice([48, 64, 96, 160, 512]),
        scheduling_policy=rng.choice(["legacy", "stall_free"]),
        preemption_mode=rng.choice(["swap", "recompute", "auto"]),
        kv_host_gb=rng.choice([0.0, 0.001, 0.01]),
        max_num_batched_tokens=rng.choice([16, 32, 64, 2048]),
        max_num_seqs=rng.choice([2, 4, 64]),
        max_num_partial_prefills=rng.choice([0, 1, 2]),
    )


def test_random_engines_answer_as_a_plain_one(models: dict[str, Path]) -> None:
    ran = 0
    for trial in range(60):
        rng = random.Random(trial)
        name = rng.choice(sorted(models))
        shared = [rng.randrange(3, 200) for _ in range(rng.choice([0, 9, 21]))]
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 7))]
        prompts = [shared + [rng.randrange(3, 200) for _ in range(k)] for k in lengths]
        n = rng.randint(1, 24)
        longest = max(map(len, prompts)) + n + 4
        reference = dict(block_size=4, kv_device_blocks=2048, enable_prefix_caching=False)
        with LLM(str(models[name]), **reference) as plain:
            expected = answers(plain, prompts, n, list(range(len(prompts))))
        settings = random_engine(rng, longest)
        try:
            llm = LLM(str(models[name]), **settings)
        except ConfigError:  # a pool too small for max_model_len: refused at start, as it should be
            continue
        with llm:
            for round_ in range(2):  # the second round from the prefix cache and the host tier
                order = list(range(len(prompts)))
                rng.shuffle(order)
                assert answers(llm, prompts, n, order) == expected, (trial, name, settings, round_)
            llm.engine.kv.check_integrity()
        ran += 1
    assert ran >= 40  # most settings were valid engines
