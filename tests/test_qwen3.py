"""Qwen3 (per-head q/k RMSNorm before RoPE) against transformers on tiny random checkpoints.

Each checkpoint is built with transformers' own ``Qwen3Config`` / ``Qwen3ForCausalLM``, saved with
``save_pretrained`` and loaded by kvtier's loader as an HF directory. The model's logits through the
paged pool (a fresh prefill, a chunk over a cached prefix, a decode) match transformers' within 1e-4;
the engine's greedy answers match ``generate(do_sample=False)`` token for token: one prompt at a time,
batched in small chunks, with prefix-cache hits and under a pool small enough to preempt.

The helpers here (``tiny_checkpoint``, ``hf_greedy``, ``engine_prompts``) serve test_gemma3.py too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.models import kvkernels, registry
from kvtier.models.loader import load_model
from kvtier.models.qwen3 import Qwen3Model
from tests.conftest import write_tiny_tokenizer
from tests.test_model_parity import hf_logits, paged_logits

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def tiny_checkpoint(directory: Path, family: str, seed: int = 0, **config: Any) -> Path:
    """A tiny random checkpoint of ``family`` ("qwen3" | "gemma3") with the tiny tokenizer, saved by
    transformers. Weights ~N(0, 0.1); norm weights 1 + N(0, 0.05) for Qwen3 (x * w) and N(0, 0.05) for
    Gemma 3 (x * (1 + w)), so every tensor has distinct values and no norm is near zero."""
    import transformers

    vocab_size = write_tiny_tokenizer(directory)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(config)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kwargs))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm = "norm" in name
            values = torch.randn(param.shape, generator=gen) * (0.05 if is_norm else 0.1)
            param.copy_(values + 1.0 if is_norm and family == "qwen3" else values)
    model.save_pretrained(directory)
    return directory


def check_logits(directory: Path, length: int, split: int, seed: int = 1) -> None:
    """kvtier's paged logits (prefill ``split`` tokens, a cached-prefix chunk, a decode) equal HF's."""
    loaded = load_model(directory)
    model = registry.build_model(loaded.config, loaded.weights, torch.float32, 256)
    ids = torch.randint(3, loaded.config.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(paged_logits(model, ids, split), hf_logits(directory, ids), atol=1e-4, rtol=0)


def engine_prompts(vocab: int) -> list[list[int]]:
    """Prompts of 1 to 60 tokens, three of them sharing a 21-token prefix."""
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(3, vocab, (21,), generator=gen).tolist()
    out = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 3, 15, 16, 17, 33, 60)]
    return out + [shared + torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (2, 9, 30)]


def hf_greedy(directory: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations (``MAX_TOKENS`` each, past EOS), one prompt at a time."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
        refs.append(out[0, len(p) :].tolist())
    return refs


def token_ids(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# The engine scenarios every family passes: LLM arguments (block_size 4); 256 blocks unless said
SCENARIOS = {
    "one_at_a_time": dict(enable_prefix_caching=False),
    "batched_in_7_token_chunks": dict(max_num_batched_tokens=7, enable_prefix_caching=False),
    "prefix_cache_hits": dict(max_num_batched_tokens=16),
    "pool_that_preempts": dict(kv_device_blocks=28, max_model_len=100, enable_prefix_caching=False),
}


def check_engine(
    directory: Path, prompts: list[list[int]], reference: list[list[int]], scenario: str, **changes: Any
) -> LLM:
    """The engine's greedy answers under ``scenario`` (LLM arguments: ``changes`` over the scenario's)
    equal ``reference``; the pool is idle after. Returns the engine."""
    kwargs: dict[str, Any] = {"block_size": 4, "kv_device_blocks": 256, **SCENARIOS[scenario], **changes}
    llm = LLM(str(directory), **kwargs)
    if scenario == "one_at_a_time":
        assert [token_ids(llm.generate([p], GREEDY))[0] for p in prompts] == reference
    else:
        assert token_ids(llm.generate(prompts, GREEDY)) == reference
    if scenario == "prefix_cache_hits":  # every full block of each prompt but the one of its last token
        again = llm.generate(prompts, GREEDY)
        assert token_ids(again) == reference
        assert [o.num_cached_tokens for o in again] == [((len(p) - 1) // 4) * 4 for p in prompts]
    if scenario == "pool_that_preempts":
        assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_free_blocks() == llm.engine.config.cache.num_device_blocks
    return llm


# ------------------------------------------------------------------------------------------------ logits


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "tie"),
    [(4, 4, 16, True), (4, 2, 24, False), (6, 2, 16, True), (4, 1, 64, False)],
    ids=["mha-tied", "gqa2-headdim24-untied", "gqa3-tied", "gqa4-headdim64-kernel-untied"],
)
def test_logits_match_transformers(
    tmp_path: Path, heads: int, kv_heads: int, head_dim: int, tie: bool
) -> None:
    directory = tiny_checkpoint(
        tmp_path,
        "qwen3",
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=tie,
    )
    check_logits(directory, 37, 18)


def test_sliding_window_layers_match_transformers(tmp_path: Path) -> None:
    # layers from max_window_layers on slide over the last 6 positions; the prompt is 37 long
    directory = tiny_checkpoint(
        tmp_path, "qwen3", num_hidden_layers=3, use_sliding_window=True, sliding_window=6, max_window_layers=1
    )
    config = load_model(directory).config
    assert config.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    check_logits(directory, 37, 18)


def test_family_runs_the_fused_ops_and_kernel_but_not_the_decode_program(tmp_path: Path) -> None:
    loaded = load_model(tiny_checkpoint(tmp_path, "qwen3", num_key_value_heads=1, head_dim=64))
    model = registry.build_model(loaded.config, loaded.weights, torch.float32, 64)
    assert isinstance(model, Qwen3Model) and model.program is None
    if kvkernels.kernels() is not None:
        assert model.ops.attention_kernel  # FusedOps: decode attention through kvattn.c


# ------------------------------------------------------------------------------------------------ engine


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # an untied head: a tied tiny model mostly repeats its input token, a weak greedy check
    return tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", num_key_value_heads=1)


@pytest.fixture(scope="module")
def qwen3_reference(qwen3_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = engine_prompts(load_model(qwen3_dir).config.vocab_size)
    return prompts, hf_greedy(qwen3_dir, prompts)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_engine_greedy_matches_transformers(qwen3_dir: Path, qwen3_reference, scenario: str) -> None:
    check_engine(qwen3_dir, *qwen3_reference, scenario)
