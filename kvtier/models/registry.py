"""Which model class runs a checkpoint: the one place an architecture is registered.

A checkpoint names its architecture one of three ways; each leads to one HF architecture, that to a
family, and the family to its model class::

    GGUF general.architecture   HF model_type    HF architectures[0]   family   model class
    llama                       llama            LlamaForCausalLM   ─┐
    mistral                     mistral          MistralForCausalLM ─┼─ llama   llama.LlamaModel
    qwen2                       qwen2            Qwen2ForCausalLM   ─┘
    qwen3                       qwen3            Qwen3ForCausalLM   ─── qwen3   qwen3.Qwen3Model
    gemma3                      gemma3_text      Gemma3ForCausalLM  ─── gemma3  gemma3.Gemma3Model

(``model_type`` is read only when config.json has no ``architectures``.)
Qwen2 and Mistral are configurations of the llama family (biases, a context capped at the window).
A family also names the tensors its layers hold beyond llama's nine (HF names, as transformers saves
them: the GGUF converter emits the same names) and the MLP activation its checkpoints must declare.

This module imports no torch: ``hf_loader`` reads it on the warm start-up path, and a model class is
imported only when ``build_model`` builds one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    import torch

    from kvtier.models.llama import LlamaModel


@dataclass(frozen=True)
class ModelFamily:
    """One model class and what its checkpoints carry."""

    name: str  # ModelConfig.family
    model: str  # "module:Class", imported by ``model_class``
    activation: str  # the gated MLP's activation, as config.json names it
    # per-layer weights beyond llama's, HF-named under ``model.layers.{i}.``, with their size:
    # "hidden" ([hidden_size]) or "head_dim" ([head_dim])
    layer_tensors: tuple[tuple[str, str], ...] = ()


FAMILIES = {
    "llama": ModelFamily("llama", "kvtier.models.llama:LlamaModel", "silu"),
    "qwen3": ModelFamily(
        "qwen3",
        "kvtier.models.qwen3:Qwen3Model",
        "silu",
        (("self_attn.q_norm.weight", "head_dim"), ("self_attn.k_norm.weight", "head_dim")),
    ),
    "gemma3": ModelFamily(
        "gemma3",
        "kvtier.models.gemma3:Gemma3Model",
        "gelu_pytorch_tanh",
        (
            ("self_attn.q_norm.weight", "head_dim"),
            ("self_attn.k_norm.weight", "head_dim"),
            ("pre_feedforward_layernorm.weight", "hidden"),
            ("post_feedforward_layernorm.weight", "hidden"),
        ),
    ),
}
# HF ``architectures[0]`` -> family
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
# GGUF ``general.architecture`` -> the HF architecture its converted config.json names
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# HF ``model_type`` -> architecture, for a config.json without ``architectures``
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def hf_architecture(cfg: dict[str, Any]) -> str:
    """The HF architecture of a ``config.json`` dict: ``architectures[0]``, else its ``model_type``'s;
    ConfigError naming the supported ones when it is neither."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else MODEL_TYPES.get(str(cfg.get("model_type")))
    if arch not in HF_ARCHITECTURES:
        named = arch if archs else f"model_type={cfg.get('model_type')!r}"
        raise ConfigError(f"unsupported architecture {named} (supported: {', '.join(HF_ARCHITECTURES)})")
    return arch


def family_of(hf_arch: str) -> ModelFamily:
    """The family of a supported HF architecture (``hf_architecture``'s result)."""
    return FAMILIES[HF_ARCHITECTURES[hf_arch]]


def gguf_hf_architecture(gguf_arch: object) -> str:
    """The HF architecture a GGUF's ``general.architecture`` converts to; ConfigError naming the
    supported ones otherwise."""
    if gguf_arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise ConfigError(f"unsupported GGUF architecture {gguf_arch!r} (supported: {supported})")
    return GGUF_ARCHITECTURES[str(gguf_arch)]


def layer_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The family's per-layer weights beyond llama's, HF-named, with their shapes."""
    sizes = {"hidden": config.hidden_size, "head_dim": config.head_dim}
    tensors = FAMILIES[config.family].layer_tensors
    return {
        f"model.layers.{i}.{name}": (sizes[size],) for i in range(config.num_layers) for name, size in tensors
    }


def model_class(config: ModelConfig) -> type[LlamaModel]:
    """The class that runs ``config`` (imported now)."""
    module, name = FAMILIES[config.family].model.split(":")
    return getattr(importlib.import_module(module), name)


def build_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    max_positions: int,
    packed: dict | None = None,
    lib: object = None,
    cached: dict[str, torch.Tensor] | None = None,
) -> LlamaModel:
    """The model of ``config``'s family over ``weights`` (HF names); the arguments are ``LlamaModel``'s."""
    return model_class(config)(config, weights, dtype, max_positions, packed, lib, cached)
