"""The model registry: which class runs a checkpoint, and the ModelConfig fields a config.json fills in.

Torch-free apart from the last tests (they build the models of tiny checkpoints).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.config import ConfigError, ModelConfig
from kvtier.models import registry
from kvtier.models.hf_loader import expected_shapes, parse_config

BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 100,
    "max_position_embeddings": 256,
}
QWEN3 = {**BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu"}
# Gemma 3 as transformers 5 saves it (rope_parameters per layer type, layer_types spelled out)
GEMMA3 = {
    **BASE,
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 24,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "tie_word_embeddings": True,
}
# ... and as transformers 4 saved it (flat rope keys, a layer pattern instead of the list)
GEMMA3_V4 = {
    **{k: v for k, v in GEMMA3.items() if k not in ("layer_types", "rope_parameters")},
    "sliding_window_pattern": 2,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 5000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
}


@pytest.mark.parametrize(
    ("arch", "family"),
    [
        ("LlamaForCausalLM", "llama"),
        ("MistralForCausalLM", "llama"),
        ("Qwen2ForCausalLM", "llama"),
        ("Qwen3ForCausalLM", "qwen3"),
        ("Gemma3ForCausalLM", "gemma3"),
    ],
)
def test_hf_architectures_map_to_families(arch: str, family: str) -> None:
    assert registry.hf_architecture({"architectures": [arch]}) == arch
    assert registry.family_of(arch).name == family


@pytest.mark.parametrize(
    ("gguf", "arch"),
    [
        ("llama", "LlamaForCausalLM"),
        ("mistral", "MistralForCausalLM"),
        ("qwen2", "Qwen2ForCausalLM"),
        ("qwen3", "Qwen3ForCausalLM"),
        ("gemma3", "Gemma3ForCausalLM"),
    ],
)
def test_gguf_architectures_map_to_hf_ones(gguf: str, arch: str) -> None:
    assert registry.gguf_hf_architecture(gguf) == arch


def test_model_type_names_the_architecture_when_architectures_is_absent() -> None:
    cfg = {k: v for k, v in GEMMA3.items() if k != "architectures"}
    assert registry.hf_architecture(cfg) == "Gemma3ForCausalLM"
    assert parse_config(cfg).family == "gemma3"


def test_unsupported_architectures_name_the_supported_ones() -> None:
    supported = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM"
    with pytest.raises(
        ConfigError, match=f"unsupported architecture Phi3ForCausalLM \\(supported: {supported}\\)"
    ):
        parse_config({**QWEN3, "architectures": ["Phi3ForCausalLM"]})
    with pytest.raises(ConfigError, match="unsupported architecture model_type='gpt2'"):
        parse_config({k: v for k, v in {**QWEN3, "model_type": "gpt2"}.items() if k != "architectures"})
    with pytest.raises(
        ConfigError, match="unsupported GGUF architecture 'phi3' \\(supported: llama, mistral, qwen2"
    ):
        registry.gguf_hf_architecture("phi3")


def test_qwen3_config_and_its_extra_tensors() -> None:
    config = parse_config(QWEN3)
    assert config.family == "qwen3" and config.head_dim == 32 and not config.attention_bias
    assert config.layer_types == ("full_attention",) * 4 and config.sliding_window is None
    shapes = expected_shapes(config)
    assert shapes["model.layers.3.self_attn.q_norm.weight"] == (32,)
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (32,)
    assert shapes["lm_head.weight"] == (100, 64)


def test_qwen3_slides_from_max_window_layers_only_with_use_sliding_window() -> None:
    cfg = {**QWEN3, "sliding_window": 16, "max_window_layers": 2}
    assert parse_config(cfg).layer_types == ("full_attention",) * 4  # use_sliding_window false
    config = parse_config({**cfg, "use_sliding_window": True})
    assert config.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2
    assert config.sliding_window == 16 and config.max_position_embeddings == 256  # no context cap


def test_gemma3_config_transformers5_form() -> None:
    config = parse_config(GEMMA3)
    assert config.family == "gemma3" and config.tie_word_embeddings
    assert config.layer_types == tuple(GEMMA3["layer_types"]) and config.sliding_window == 8
    assert [config.layer_window(i) for i in range(4)] == [8, 8, 8, None]
    assert config.rope_theta == 1e6 and config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.rope_local_theta == 1e4 and config.query_pre_attn_scalar == 24.0
    assert config.final_logit_softcapping is None
    shapes = expected_shapes(config)
    assert shapes["model.layers.1.pre_feedforward_layernorm.weight"] == (64,)
    assert shapes["model.layers.1.post_feedforward_layernorm.weight"] == (64,)
    assert shapes["model.layers.1.self_attn.q_norm.weight"] == (32,)
    assert "lm_head.weight" not in shapes


def test_gemma3_config_transformers4_form() -> None:
    config = parse_config(GEMMA3_V4)
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert config.rope_theta == 1e6 and config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.rope_local_theta == 5000.0


def test_gemma3_window_longer_than_the_context_is_clamped_with_a_log_line(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="kvtier.models.hf_loader"):
        config = parse_config({**GEMMA3, "sliding_window": 4096})
    assert config.sliding_window == 256
    assert "sliding_window 4096 exceeds the 256-token context" in caplog.text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attn_logit_softcapping": 50.0}, "unsupported attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "unsupported use_bidirectional_attention"),
        ({"hidden_activation": "silu"}, "unsupported activation 'silu'"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types has 3 entries for 4 layers"),
        ({"layer_types": ["chunked_attention"] * 4}, "unsupported layer type 'chunked_attention'"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "unsupported rope type 'linear' for sliding_attention layers",
        ),
    ],
)
def test_gemma3_options_kvtier_does_not_run_are_errors(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({**GEMMA3, **change})


def test_model_config_checks_its_layer_types() -> None:
    sizes = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1)
    assert ModelConfig(**sizes, head_dim=4).layer_types == ("full_attention", "full_attention")
    with pytest.raises(ConfigError, match="need a positive sliding_window"):
        ModelConfig(**sizes, head_dim=4, layer_types=("sliding_attention", "full_attention"))


def test_llama_family_keeps_its_context_cap_and_full_layers() -> None:
    mistral = {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 128}
    config = parse_config(mistral)
    assert config.family == "llama" and config.max_position_embeddings == 128
    assert config.layer_types == ("full_attention",) * 4 and config.sliding_window is None


def test_build_model_picks_the_family_class(tiny_llama_dir: Callable[..., Path]) -> None:
    import torch

    from kvtier.models.gemma3 import Gemma3Model
    from kvtier.models.llama import LlamaModel
    from kvtier.models.loader import load_model
    from kvtier.models.qwen3 import Qwen3Model

    assert registry.model_class(parse_config(QWEN3)) is Qwen3Model
    assert registry.model_class(parse_config(GEMMA3)) is Gemma3Model
    loaded = load_model(tiny_llama_dir())
    model = registry.build_model(loaded.config, loaded.weights, torch.float32, 64)
    assert type(model) is LlamaModel
