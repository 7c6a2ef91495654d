"""What each GGUF architecture means in HF terms: tensor names, config keys, and value conventions.

The GGUF names are llama.cpp's (gguf-py's ``TensorNameMap``); the HF names and values are what
transformers' own GGUF loader produces for the same file::

    GGUF tensor (blk.N.*)    HF tensor (model.layers.N.*)       llama  qwen2  qwen3  gemma3
    ─────────────────────    ───────────────────────────────    ─────  ─────  ─────  ──────
    attn_norm                input_layernorm                      x      x      x      x
    attn_q_norm, attn_k_norm self_attn.q_norm, self_attn.k_norm                  x      x
    post_attention_norm      post_attention_layernorm                                  x
    ffn_norm                 post_attention_layernorm             x      x      x
    ffn_norm                 pre_feedforward_layernorm                                 x
    post_ffw_norm            post_feedforward_layernorm                                x
    attn_q/k/v/output, ffn_gate/up/down: the projections, the same in every architecture

Values: llama.cpp permutes the rows of ``attn_q`` / ``attn_k`` for llama only (the rotary halves of each
head interleaved; qwen2/qwen3/gemma3 are stored as HF has them; the registry's ``mistral`` name is
treated as llama). Gemma computes an RMSNorm as ``x * (1 + w)`` and llama.cpp's converter stores
``1 + w`` in every ``*norm.weight`` (q/k norms and the final norm included), so the HF weight is the
stored value minus 1 (transformers' ``Gemma2TensorProcessor`` does the same).

Gemma 3's layer pattern: llama.cpp makes layer ``i`` sliding-window unless ``(i + 1) % 6 == 0`` (every
6th layer full), local rope base 10000, query scale ``1/sqrt(head_dim)`` (``hidden / heads`` for the
62-layer 27B); a ``gemma3.attention.sliding_window_pattern`` key (a period, or one bool per layer,
true = sliding) and ``gemma3.rope.freq_base_swa`` override those when a file has them.
"""

from __future__ import annotations

from typing import Any

from kvtier.config import ConfigError
from kvtier.models.registry import gguf_hf_architecture

_PROJECTIONS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_DENSE_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
LAYER_TENSORS: dict[str, dict[str, str]] = {
    "llama": {**_PROJECTIONS, **_DENSE_NORMS},
    "mistral": {**_PROJECTIONS, **_DENSE_NORMS},
    "qwen2": {**_PROJECTIONS, **_DENSE_NORMS},
    "qwen3": {**_PROJECTIONS, **_DENSE_NORMS, **_QK_NORMS},
    "gemma3": {**_PROJECTIONS, **_GEMMA_NORMS, **_QK_NORMS},
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tokens that end a chat turn, added to the end-of-sequence ids when the vocabulary has them.
_TURN_END_TOKENS = {"qwen3": ("<|im_end|>", "<|endoftext|>"), "gemma3": ("<end_of_turn>",)}
GEMMA3_SWA_PERIOD = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0


def check_architecture(meta: dict[str, Any]) -> str:
    """``general.architecture`` (one the registry knows, and this module too), or a ConfigError listing
    the supported ones."""
    arch = meta.get("general.architecture")
    gguf_hf_architecture(arch)  # ConfigError naming the supported ones
    if arch not in LAYER_TENSORS:
        raise ConfigError(f"kvtier cannot convert GGUF architecture {arch!r} yet (no tensor map)")
    return str(arch)


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF name of a GGUF tensor: ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    base, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if base in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[base]}.{kind}"
    parts = base.split(".")
    layer_tensors = LAYER_TENSORS.get(arch, LAYER_TENSORS["llama"])
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{kind}"
    return None


def permutes_qk(arch: str) -> bool:
    """Whether llama.cpp stored ``attn_q`` / ``attn_k`` with the rotary halves interleaved: llama's converter
    does (a Mistral is converted by it, as ``llama``; gguf-py has no plain ``mistral`` name), Qwen and
    Gemma's do not."""
    return arch in ("llama", "mistral")


def norm_offset(arch: str) -> float:
    """What llama.cpp added to every ``*norm.weight`` (Gemma's ``1 + w``); the loader subtracts it."""
    return 1.0 if arch == "gemma3" else 0.0


# ------------------------------------------------------------------------------------------------ config


def head_counts(meta: dict[str, Any], arch: str) -> tuple[int, int, int]:
    """``(heads, kv heads, head dim)``; ConfigError when the metadata contradicts itself."""
    hidden, heads = int(meta[f"{arch}.embedding_length"]), _one_count(meta, arch, "head_count")
    if heads <= 0:
        raise ConfigError(f"GGUF metadata is missing {arch}.attention.head_count")
    kv_heads = _one_count(meta, arch, "head_count_kv") or heads
    key_length = meta.get(f"{arch}.attention.key_length")
    if heads % kv_heads:
        raise ConfigError(
            f"inconsistent GGUF metadata: {arch}.attention.head_count {heads} is not a multiple of "
            f"head_count_kv {kv_heads}"
        )
    if key_length is None and hidden % heads:
        raise ConfigError(
            f"inconsistent GGUF metadata: {arch}.embedding_length {hidden} is not a multiple of "
            f"attention.head_count {heads} (and no attention.key_length)"
        )
    value_length = meta.get(f"{arch}.attention.value_length")
    head_dim = int(key_length) if key_length is not None else hidden // heads
    if value_length is not None and int(value_length) != head_dim:
        raise ConfigError(f"unsupported GGUF: key_length {head_dim} differs from value_length {value_length}")
    return heads, kv_heads, head_dim


def _one_count(meta: dict[str, Any], arch: str, name: str) -> int:
    """A head count that may be stored per layer (then all layers must agree)."""
    value = meta.get(f"{arch}.attention.{name}")
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ConfigError(f"unsupported GGUF: {arch}.attention.{name} differs between layers ({value})")
        value = value[0]
    return int(value or 0)


def turn_end_ids(arch: str, tokens: list[str]) -> list[int]:
    """Ids of the tokens that end a chat turn for ``arch`` (Gemma's ``<end_of_turn>``)."""
    index = {token: i for i, token in enumerate(tokens) if token in _TURN_END_TOKENS.get(arch, ())}
    return [index[t] for t in _TURN_END_TOKENS.get(arch, ()) if t in index]


def qwen3_config(meta: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    """Qwen3's ``config.json`` (transformers 5 form): q/k norms are implied by the architecture."""
    rope = common.pop("rope_parameters")
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **common,
        "hidden_act": "silu",
        "rope_parameters": rope,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * common["num_hidden_layers"],
    }


def gemma3_config(meta: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's text ``config.json``: sliding/full layer pattern, two rope bases, query scale, softcaps."""
    layers = common["num_hidden_layers"]
    window = int(meta.get("gemma3.attention.sliding_window") or 0)
    if window <= 0:  # a window past the context stays: parse_config clamps it, with a log line
        raise ConfigError("GGUF metadata is missing gemma3.attention.sliding_window (a positive size)")
    full_rope = common.pop("rope_parameters")
    local_base = float(meta.get("gemma3.rope.freq_base_swa") or GEMMA3_LOCAL_ROPE_BASE)
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    # llama.cpp: the 27B (62 layers) scales queries by hidden / heads, every other size by head_dim
    scalar = hidden // heads if layers == 62 else common["head_dim"]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **common,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            "full_attention": full_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": local_base},
        },
        "sliding_window": window,
        "layer_types": gemma3_layer_types(meta.get("gemma3.attention.sliding_window_pattern"), layers),
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": _optional_float(meta.get("gemma3.attn_logit_softcapping")),
        "final_logit_softcapping": _optional_float(meta.get("gemma3.final_logit_softcapping")),
    }


def gemma3_layer_types(pattern: Any, num_layers: int) -> list[str]:
    """Per-layer attention kinds: llama.cpp's period of 6 (last of each period full) unless the file says."""
    if pattern is None:
        pattern = GEMMA3_SWA_PERIOD
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ConfigError(
                f"inconsistent GGUF metadata: gemma3.attention.sliding_window_pattern has {len(pattern)} "
                f"entries for {num_layers} layers"
            )
        return ["sliding_attention" if bool(s) else "full_attention" for s in pattern]
    period = int(pattern)
    if period <= 0 or period > num_layers:
        raise ConfigError(
            f"inconsistent GGUF metadata: gemma3.attention.sliding_window_pattern {period} does not fit "
            f"{num_layers} layers"
        )
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(num_layers)]


def _optional_float(value: Any) -> float | None:
    return float(value) if value is not None and float(value) > 0 else None
