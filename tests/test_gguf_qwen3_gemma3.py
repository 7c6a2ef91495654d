"""Qwen3 and Gemma 3 GGUF files: tiny ones written here the way llama.cpp writes them, converted by kvtier
and loaded by transformers (``gguf_file=``) from the same bytes; the two must agree exactly.

How a tiny file is made: a transformers ``Qwen3ForCausalLM`` / ``Gemma3ForCausalLM`` with seeded random
weights, its tensors renamed with gguf-py's own ``TensorNameMap`` (llama.cpp's names), Gemma's norms stored
as ``1 + w`` (llama.cpp's convention), matrices quantized to Q8_0, metadata as ``convert_hf_to_gguf``
writes it. transformers reads ``head_dim`` of a Qwen3 file as its default 128 and Gemma 3's query scale as
its default 256 whatever the file says, so the tiny models use those sizes (kvtier follows llama.cpp
there: ``attention.key_length`` and ``head_dim``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.config import ConfigError
from kvtier.models.loader import load_model
from tests.conftest import _CORPUS, _tokenizer_metadata

CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>")
GEMMA_USER_DEFINED = ("[multimodal]", "\n", "\n\n", "  ", "   ", "\t\t")
SAMPLE_TEXTS = (
    *_CORPUS,
    " leading space, trailing  ",
    "Ωmega ß ← ☃ ⅞ \u00a0nbsp 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",  # characters outside the vocabulary: byte fallback
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "[multimodal] <mask> <bos>text",
)


# ------------------------------------------------------------------------------------------ tiny files


def gemma_vocabulary() -> list[str]:
    """A small Gemma-shaped vocabulary: control tokens, user-defined newline / space runs, the 256 byte
    tokens, then pieces of the corpus (with and without a leading ▁), most frequent shapes first."""
    pieces: dict[str, None] = {}
    for word in " ".join(_CORPUS).split(" "):
        for form in (word, "\u2581" + word):
            pieces.update(dict.fromkeys(form))
            pieces.update(dict.fromkeys(form[:k] for k in range(2, len(form) + 1)))
    pieces.pop("", None)
    pieces = {p: None for p in pieces if " " not in p and p not in GEMMA_USER_DEFINED}
    return [*GEMMA_SPECIALS, *GEMMA_USER_DEFINED, *(f"<0x{b:02X}>" for b in range(256)), *list(pieces)[:900]]


def _gemma_tokenizer_metadata(writer: Any, chat_template: str | None) -> int:
    tokens = gemma_vocabulary()
    types = [3] * len(GEMMA_SPECIALS) + [4] * len(GEMMA_USER_DEFINED) + [6] * 256
    types += [1] * (len(tokens) - len(types))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-1000.0 if t != 1 else 0.0 for t in types])
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    return len(tokens)


def _hf_model(arch: str, vocab: int, tie: bool, heads: int, kv_heads: int, layers: int, seed: int) -> Any:
    """A transformers model of the tiny shape with seeded weights (norms around 0 for Gemma, 1 else)."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers)
    common.update(num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tie)
    if arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=128, **common))
    else:
        config = transformers.Gemma3TextConfig(head_dim=256, sliding_window=8, **common)
        model = transformers.Gemma3ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            values = torch.randn(param.shape, generator=gen) * 0.05
            param.copy_(values + (1.0 if "norm" in name and arch == "qwen3" else 0.0))
    return model


def _write_metadata(writer: Any, arch: str, layers: int, heads: int, kv_heads: int, meta: dict) -> None:
    head_dim = 128 if arch == "qwen3" else 256
    writer.add_block_count(layers)
    writer.add_context_length(meta.pop("context_length", 256))
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(meta.pop("value_length", head_dim))
    writer.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(7)  # mostly Q8_0
    if arch == "gemma3" and meta.get("sliding_window", 8) is not None:
        writer.add_sliding_window(meta.pop("sliding_window", 8))
    if (pattern := meta.pop("sliding_window_pattern", None)) is not None:
        writer.add_sliding_window_pattern(pattern)


def write_tiny_gguf(
    path: Path,
    arch: str,
    *,
    tie: bool = True,
    heads: int = 2,
    kv_heads: int = 1,
    layers: int = 7,
    chat_template: str | None = None,
    seed: int = 0,
    **meta: Any,
) -> Path:
    """A tiny ``qwen3`` / ``gemma3`` GGUF as llama.cpp would convert it (see the module doc)."""
    from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
    from gguf.quants import quantize

    writer = GGUFWriter(str(path), arch)
    if arch == "qwen3":
        vocab = _tokenizer_metadata(writer, add_bos=False, chat_template=chat_template, pre="qwen2")
    else:
        vocab = _gemma_tokenizer_metadata(writer, chat_template)
    meta = dict(meta)
    _write_metadata(writer, arch, layers, heads, kv_heads, meta)
    model = _hf_model(arch, vocab, tie, heads, kv_heads, layers, seed)
    names = get_tensor_name_map(MODEL_ARCH.QWEN3 if arch == "qwen3" else MODEL_ARCH.GEMMA3, layers)
    for hf_name, tensor in model.state_dict().items():
        if tie and hf_name == "lm_head.weight":
            continue
        base, kind = hf_name.rsplit(".", 1)
        data = tensor.numpy().astype(np.float32)
        if data.ndim == 1:
            data = data + np.float32(1.0) if arch == "gemma3" else data  # llama.cpp stores Gemma's 1 + w
            writer.add_tensor(f"{names.get_name(base)}.{kind}", data)
        else:
            stored = quantize(data, GGMLQuantizationType.Q8_0)
            writer.add_tensor(f"{names.get_name(base)}.{kind}", stored, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory of tiny files, cached per parameter set (the same bytes for the same parameters)."""
    made: dict[str, Path] = {}

    def make(arch: str, **kwargs: Any) -> Path:
        key = repr((arch, sorted(kwargs.items())))
        if key not in made:
            made[key] = write_tiny_gguf(tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf", arch, **kwargs)
        return made[key]

    return make


def _transformers_load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """transformers' own load of the GGUF (the reference): its state dict and its saved config."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return {n: t.detach() for n, t in model.state_dict().items()}, model.config.to_dict()


# --------------------------------------------------------------------------------- parity with transformers

# The keys transformers' GGUF load fills in from the file (the rest of its config is class defaults).
_CONFIG_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "rope_parameters",
    "bos_token_id",
    "pad_token_id",
)
_GEMMA3_KEYS = ("sliding_window", "layer_types", "query_pre_attn_scalar", "hidden_activation")
_GEMMA3_KEYS += ("final_logit_softcapping", "attn_logit_softcapping")


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("heads,kv_heads", [(2, 1), (4, 2), (4, 4)], ids=["gqa2", "gqa4-2", "mha"])
def test_conversion_equals_transformers_gguf_load(
    tiny_file: Callable[..., Path], tmp_path: Path, arch: str, tie: bool, heads: int, kv_heads: int
) -> None:
    layers = 7 if arch == "gemma3" else 2
    path = tiny_file(arch, tie=tie, heads=heads, kv_heads=kv_heads, layers=layers)
    model = load_model(path, cache_dir=tmp_path)
    reference, ref_config = _transformers_load(path)
    expected = set(reference) - ({"lm_head.weight"} if tie else set())
    assert set(model.weights) == expected
    for name in sorted(expected):  # bitwise: same dequantization, same norm offset, no permutation
        ours = model.weights[name]
        assert ours.dtype == torch.float32 and torch.equal(ours, reference[name]), name
    config = json.loads((model.converted / "config.json").read_text())
    keys = _CONFIG_KEYS + (_GEMMA3_KEYS if arch == "gemma3" else ())
    assert {k: config[k] for k in keys} == {k: ref_config[k] for k in keys}
    assert config["architectures"] == ["Qwen3ForCausalLM" if arch == "qwen3" else "Gemma3ForCausalLM"]
    assert set(_ids(ref_config["eos_token_id"])) <= set(config["eos_token_id"])
    cfg = model.config
    assert (cfg.family, cfg.num_heads, cfg.num_kv_heads) == (arch, heads, kv_heads)
    assert cfg.tie_word_embeddings is tie
    assert cfg.layer_types == tuple(ref_config["layer_types"])


def _ids(value: Any) -> list[int]:
    return [value] if isinstance(value, int) else list(value or [])


def test_gemma3_norms_are_stored_plus_one(tiny_file: Callable[..., Path], tmp_path: Path) -> None:
    """Every Gemma norm (q/k norms and the final norm too) comes back as the file's value minus 1."""
    from gguf import GGUFReader

    path = tiny_file("gemma3", tie=True, heads=2, kv_heads=1, layers=7)
    stored = {t.name: np.array(t.data, dtype=np.float32) for t in GGUFReader(str(path)).tensors}
    model = load_model(path, cache_dir=tmp_path)
    pairs = {
        "output_norm.weight": "model.norm.weight",
        "blk.0.attn_q_norm.weight": "model.layers.0.self_attn.q_norm.weight",
        "blk.0.attn_k_norm.weight": "model.layers.0.self_attn.k_norm.weight",
        "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "blk.0.post_attention_norm.weight": "model.layers.0.post_attention_layernorm.weight",
        "blk.0.ffn_norm.weight": "model.layers.0.pre_feedforward_layernorm.weight",
        "blk.0.post_ffw_norm.weight": "model.layers.0.post_feedforward_layernorm.weight",
    }
    for gguf_name, hf_name in pairs.items():
        np.testing.assert_array_equal(model.weights[hf_name].numpy(), stored[gguf_name] - np.float32(1.0))


def test_gemma3_config_and_turn_end(tiny_file: Callable[..., Path], tmp_path: Path) -> None:
    """llama.cpp's pattern (every 6th layer full), both rope bases, and <end_of_turn> ending a turn."""
    model = load_model(tiny_file("gemma3", layers=7), cache_dir=tmp_path)
    cfg = model.config
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta) == (8, 1e6, 10000.0)
    assert cfg.query_pre_attn_scalar == 256 and cfg.final_logit_softcapping is None
    end_of_turn = model.tokenizer.token_to_id("<end_of_turn>")
    assert end_of_turn in cfg.eos_token_ids and end_of_turn in model.tokenizer.eos_token_ids
    assert cfg.eos_token_ids[0] == 1 and model.tokenizer.bos_token_id == 2


@pytest.mark.parametrize(
    "pattern,expected",
    [
        (3, "SSFSSF"),
        (2, "SFSFSF"),
        ([True, False, True, True, False, True], "SFSSFS"),
    ],
    ids=["period3", "period2", "per-layer"],
)
def test_gemma3_layer_pattern_from_metadata(tmp_path: Path, pattern: Any, expected: str) -> None:
    path = write_tiny_gguf(tmp_path / "p.gguf", "gemma3", layers=6, sliding_window_pattern=pattern)
    cfg = load_model(path, cache_dir=tmp_path / "cache").config
    kinds = {"S": "sliding_attention", "F": "full_attention"}
    assert cfg.layer_types == tuple(kinds[c] for c in expected)


def test_gemma3_window_larger_than_context_is_clamped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_tiny_gguf(tmp_path / "w.gguf", "gemma3", layers=6, sliding_window=1024, context_length=256)
    with caplog.at_level(logging.INFO, logger="kvtier"):
        cfg = load_model(path, cache_dir=tmp_path / "cache").config
    assert cfg.sliding_window == 256 and cfg.max_position_embeddings == 256
    assert any("1024" in r.getMessage() and "clamp" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "arch,kwargs,message",
    [
        ("gemma3", {"heads": 4, "kv_heads": 3}, "head_count 4 is not a multiple of head_count_kv 3"),
        ("qwen3", {"heads": 4, "kv_heads": 3}, "head_count 4 is not a multiple of head_count_kv 3"),
        ("gemma3", {"sliding_window_pattern": [True, False, True]}, "has 3 entries for 6 layers"),
        ("gemma3", {"sliding_window_pattern": 9}, "sliding_window_pattern 9 does not fit 6 layers"),
        ("gemma3", {"sliding_window": None}, "missing gemma3.attention.sliding_window"),
        ("gemma3", {"value_length": 128}, "key_length 256 differs from value_length 128"),
    ],
    ids=["gemma3-heads", "qwen3-heads", "pattern-length", "pattern-period", "no-window", "value-length"],
)
def test_contradictory_metadata_is_one_line_error(
    tmp_path: Path, arch: str, kwargs: dict[str, Any], message: str
) -> None:
    heads, kv_heads = kwargs.pop("heads", 2), kwargs.pop("kv_heads", 1)
    # the tensors are a consistent model's (4 heads, 1 KV head): the metadata alone is what contradicts
    path = tmp_path / "bad.gguf"
    _write_inconsistent(path, arch, heads, kv_heads, kwargs)
    with pytest.raises(ConfigError) as info:
        load_model(path, cache_dir=tmp_path / "cache")
    assert message in str(info.value) and "\n" not in str(info.value)


def _write_inconsistent(path: Path, arch: str, heads: int, kv_heads: int, meta: dict[str, Any]) -> None:
    """A GGUF with only metadata (and an embedding): conversion must stop at the metadata."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    _gemma_tokenizer_metadata(writer, None)
    _write_metadata(writer, arch, 6, heads, kv_heads, dict(meta))
    writer.add_tensor("token_embd.weight", np.zeros((len(gemma_vocabulary()), 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "phi.gguf"
    writer = GGUFWriter(str(path), "phi3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ConfigError, match=r"unsupported GGUF architecture 'phi3' \(supported: .*qwen3.*gemma3"
    ):
        load_model(path, cache_dir=tmp_path / "cache")


# ------------------------------------------------------------------------------------------------ tokenizers


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_tokenizer_equals_transformers_gguf_tokenizer(
    tiny_file: Callable[..., Path], tmp_path: Path, arch: str
) -> None:
    """Same ids as transformers' tokenizer built from the same file (Gemma: SentencePiece with byte
    fallback, ▁ for spaces, user-defined newline runs, BOS added); decoding gives the text back."""
    from transformers import AutoTokenizer

    path = tiny_file(arch, layers=7 if arch == "gemma3" else 2)
    ours = load_model(path, cache_dir=tmp_path).tokenizer
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in SAMPLE_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
        if arch == "gemma3" and not any(s in text for s in GEMMA_SPECIALS):
            assert ours.decode(ids) == text  # byte fallback: every character comes back
    assert ours.add_bos is (arch == "gemma3")
