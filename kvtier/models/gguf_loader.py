"""One-time conversion of a llama-architecture GGUF file into an HF-format directory.

The GGUF is read with ``gguf.GGUFReader``; every tensor is dequantized to fp32 with
``gguf.quants.dequantize``, renamed to its HF name and, for ``attn_q`` / ``attn_k``, un-permuted (llama.cpp's
converter interleaves the rotary halves of each head; transformers' GGUF loader undoes it the same way).
The result is written as ``config.json`` + ``model.safetensors`` (fp32, streamed tensor by tensor) +
``tokenizer.json`` + ``tokenizer_config.json``, which the HF loader then memory-maps on every later start.

The tokenizer is rebuilt from GGUF metadata with the ``tokenizers`` library (no transformers at run time),
the way ``transformers`` builds it from a GGUF (byte-level BPE or SentencePiece BPE, control tokens as
special added tokens).
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.config import ConfigError
from kvtier.models.hf_loader import expected_shapes, optional_shapes, parse_config

SUPPORTED_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_NATIVE_DTYPE_BY_FILE_TYPE = {
    0: "float32",
    1: "float16",
    32: "bfloat16",
}  # general.file_type; rest: quantized

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_IGNORED_TENSORS = {"rope_freqs.weight"}  # llama3 frequency factors: read into rope_scaling instead

# Pre-tokenizer split regexes by ``tokenizer.ggml.pre`` (the same table transformers uses).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
# llama.cpp (and the original HF tokenizer.json) split every digit off before the byte-level regex for these.
# transformers' GGUF converter does not know these names and skips the digit split, which differs from the
# model's own tokenizer only on a whitespace run followed by a digit:
# "a  1" -> ["a", "ĠĠ", "1"] here and in llama.cpp, ["a", "Ġ", "Ġ", "1"] in transformers.
# Remove a name here to reproduce transformers' GGUF tokenizer exactly instead.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact"}

CONTROL_TOKEN_TYPE, USER_DEFINED_TOKEN_TYPE = 3, 4


def open_reader(path: Path) -> Any:
    """A ``gguf.GGUFReader`` for ``path``; ConfigError when the file is not a readable GGUF."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # pragma: no cover - gguf is a hard dependency
        raise ConfigError("reading GGUF files needs the gguf package: pip install gguf") from exc
    try:
        return GGUFReader(str(path))
    except Exception as exc:  # GGUFReader raises ValueError / struct.error / OSError on bad files
        raise ConfigError(f"cannot read GGUF file {path}: {exc}") from exc


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata key as a Python value (strings, numbers, lists)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # an exotic field we do not need must not stop the conversion
            continue
    return meta


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF name of a GGUF tensor: ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    base, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    return None


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: rows [head, dim/2, 2] -> [head, 2, dim/2] (weights and biases)."""
    half = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(w.swapaxes(2, 1).reshape(weight.shape))


def _llama3_factors(
    head_dim: int, theta: float, factor: float, low: float, high: float, orig: int
) -> np.ndarray:
    """Per-frequency divisors llama.cpp stores in ``rope_freqs.weight`` for llama3 rope scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (orig / wavelen - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, medium))


def fit_llama3_scaling(freqs: np.ndarray, head_dim: int, theta: float, ctx: int) -> dict[str, Any] | None:
    """Recover HF's llama3 ``rope_scaling`` from a ``rope_freqs`` tensor (None when it is all ones)."""
    freqs = freqs.astype(np.float64).reshape(-1)
    factor = float(freqs.max())
    if np.allclose(freqs, 1.0):
        return None
    origs = sorted({ctx, *(2**k for k in range(6, 19))})
    for orig in origs:
        for low in (1.0, 2.0, 0.5):
            for high in (4.0, 2.0, 8.0, 1.5):
                if high <= low:
                    continue
                if np.allclose(_llama3_factors(head_dim, theta, factor, low, high, orig), freqs, rtol=1e-4):
                    return {
                        "rope_type": "llama3",
                        "factor": factor,
                        "low_freq_factor": low,
                        "high_freq_factor": high,
                        "original_max_position_embeddings": orig,
                    }
    raise ConfigError("cannot map this GGUF's rope_freqs tensor to a llama3 rope scaling")


def _rope_scaling(meta: dict[str, Any], arch: str, reader: Any, head_dim: int, theta: float, ctx: int) -> Any:
    """rope_scaling from metadata (``rope.scaling.*``, ``rope.scale_linear``) or ``rope_freqs.weight``."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
    if kind is None and factor is not None:
        kind = "linear"
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)} if factor and float(factor) != 1.0 else None
    if kind not in (None, "none"):
        raise ConfigError(f"unsupported rope scaling type {kind!r} in GGUF (supported: llama3, linear)")
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            freqs = dequantize_tensor(tensor)
            return fit_llama3_scaling(freqs, head_dim, theta, ctx)
    return None


def _native_dtype(meta: dict[str, Any]) -> str:
    """``float16`` / ``bfloat16`` for unquantized half-precision files, else ``float32``."""
    return _NATIVE_DTYPE_BY_FILE_TYPE.get(int(meta.get("general.file_type", 0)), "float32")


def hf_config(meta: dict[str, Any], reader: Any) -> dict[str, Any]:
    """An HF ``config.json`` dict for the GGUF (architecture, sizes, rope, special ids)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ConfigError(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})"
        )
    names = {t.name for t in reader.tensors}

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ConfigError(f"GGUF metadata is missing {arch}.{name}")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    theta, ctx = float(key("rope.freq_base", 10000.0)), int(key("context_length", 2048))
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ConfigError("GGUF file has no token_embd.weight tensor")
    vocab = int(embd.shape[-1])  # ne = [hidden, vocab]: the embedding is the truth, padding included
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return {
        "architectures": [SUPPORTED_GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(meta, arch, reader, head_dim, theta, ctx),
        "max_position_embeddings": ctx,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(e) for e in eos if e is not None)),
        "dtype": _native_dtype(meta),
    }


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """One GGUF tensor as fp32, in numpy (row-major, HF) shape: GGUF's ``ne`` reversed."""
    from gguf.quants import dequantize

    try:
        data = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ConfigError(f"unsupported GGUF tensor type {tensor.tensor_type.name} ({tensor.name})") from exc
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return np.ascontiguousarray(data, dtype=np.float32).reshape(shape)


def plan_tensors(reader: Any, config: dict[str, Any]) -> list[tuple[Any, str, tuple[int, ...]]]:
    """``(gguf tensor, hf name, hf shape)`` for every weight, checked against the config's expected shapes."""
    model_config = parse_config(config)
    required, optional = expected_shapes(model_config), optional_shapes(model_config)
    plan = []
    for tensor in reader.tensors:
        if tensor.name in _IGNORED_TENSORS:
            continue
        name = hf_tensor_name(tensor.name)
        if name is None or (name not in required and name not in optional):
            raise ConfigError(f"unsupported tensor {tensor.name!r} in GGUF")
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        want = required.get(name) or optional[name]
        if shape != want:
            raise ConfigError(f"GGUF tensor {tensor.name} has shape {shape}, expected {want}")
        plan.append((tensor, name, shape))
    planned = {name for _, name, _ in plan}
    if missing := [n for n in required if n not in planned]:
        raise ConfigError(f"GGUF file is missing tensors for {', '.join(missing[:3])}")
    return plan


def hf_tensors(
    reader: Any, config: dict[str, Any], plan: list[tuple[Any, str, tuple[int, ...]]]
) -> Iterator[np.ndarray]:
    """The planned tensors one at a time: dequantized (fp32) and, for llama q/k, un-permuted."""
    permute = config["model_type"] == "llama"
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for tensor, name, _ in plan:
        data = dequantize_tensor(tensor)
        if permute and ".self_attn.q_proj." in name:
            data = unpermute_rows(data, heads)
        elif permute and ".self_attn.k_proj." in name:
            data = unpermute_rows(data, kv_heads)
        yield data


def write_safetensors(
    path: Path,
    entries: list[tuple[str, tuple[int, ...]]],
    tensors: Iterator[np.ndarray],
    tick: Callable[[], None],
) -> None:
    """Stream fp32 tensors into a safetensors file: header from the planned shapes, then data in order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in entries:
        size = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for (name, shape), data in zip(entries, tensors, strict=True):
            assert data.shape == shape and data.dtype == np.float32, name
            f.write(memoryview(np.ascontiguousarray(data)).cast("B"))
            tick()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _pre_tokenizer(pre: str | None) -> Any:
    """The pre-tokenizer matching ``tokenizer.ggml.pre``."""
    from tokenizers import Regex, pre_tokenizers

    if pre in _PRE_SPLITS:
        split = pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated")
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _byte_level_model(tokens: list[str], meta: dict[str, Any]) -> tuple[Any, Callable[[str], bool]]:
    """``gpt2`` vocabularies: byte-level BPE with the merges the file lists."""
    from tokenizers import Tokenizer, decoders, models

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())

    def spell(token: str) -> str:
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spell(token): index for index, token in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel: skip it.
    return tok, lambda token: set(token) <= alphabet


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens, best score
    first (transformers' ``generate_merges``, same order)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges: list[tuple[str, str, float]] = []
    for merge, score in dict(zip(tokens, scores, strict=True)).items():
        local = [(merge[:k], merge[k:], score) for k in range(1, len(merge))]
        local = [m for m in local if m[0] in vocab and m[1] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece_model(tokens: list[str], meta: dict[str, Any]) -> tuple[Any, Callable[[str], bool]]:
    """``llama`` vocabularies (SentencePiece BPE): ``▁`` for spaces, byte fallback, merges from scores."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        scores = list(meta.get("tokenizer.ggml.scores") or [])
        if len(scores) != len(tokens):
            raise ConfigError("GGUF SentencePiece tokenizer has neither merges nor one score per token")
        merges = _merges_from_scores(tokens, scores)
    vocab = {token: index for index, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok, lambda token: True


_TOKENIZER_MODELS = {"gpt2": (_byte_level_model, False), "llama": (_sentencepiece_model, True)}


def build_tokenizer(meta: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(tokenizers.Tokenizer, tokenizer_config dict)`` from GGUF metadata, built like transformers does."""
    from tokenizers import AddedToken, processors

    model = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ConfigError("GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    if model not in _TOKENIZER_MODELS:
        supported = "gpt2 (byte-level BPE), llama (SentencePiece)"
        raise ConfigError(f"unsupported GGUF tokenizer model {model!r} (supported: {supported})")
    builder, default_add_bos = _TOKENIZER_MODELS[model]
    tok, may_be_special = builder(tokens, meta)
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    control = [
        t for t, ty in zip(tokens, types, strict=False) if ty == CONTROL_TOKEN_TYPE and may_be_special(t)
    ]
    vocab = tok.get_vocab(with_added_tokens=False)
    user = [t for t, ty in zip(tokens, types, strict=False) if ty == USER_DEFINED_TOKEN_TYPE and t in vocab]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    def token_at(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    specials = {k: token_at(f"{v}_token_id") for k, v in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"))}
    specials["pad"] = token_at("padding_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos)) and specials["bos"] is not None
    single = f"{specials['bos']} $A" if add_bos else "$A"
    pair = f"{single} {specials['bos']} $B:1" if add_bos else "$A $B:1"
    special_ids = [(specials["bos"], int(meta["tokenizer.ggml.bos_token_id"]))] if add_bos else []
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special_ids)
    config: dict[str, Any] = {f"{k}_token": v for k, v in specials.items() if v is not None}
    config.update(
        add_bos_token=add_bos,
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        clean_up_tokenization_spaces=False,
        tokenizer_class="PreTrainedTokenizerFast",
    )
    if isinstance(meta.get("tokenizer.chat_template"), str):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tok, config


def save_tokenizer_json(tokenizer: Any, path: Path) -> None:
    """Write ``tokenizer.json`` compactly, merges as "a b" strings when no token has a space.

    That form parses ~25% faster than the pretty pair-list ``Tokenizer.save`` writes, and the tokenizer
    is parsed on every start.
    """
    data = json.loads(tokenizer.to_str())
    merges = data["model"].get("merges") or []
    if all(isinstance(m, list) and " " not in m[0] + m[1] for m in merges):
        data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    path.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")


def convert_gguf(
    src: Path, dst: Path, *, progress: bool = False, extra_config: dict[str, Any] | None = None
) -> None:
    """Write the HF-format conversion of GGUF ``src`` into the (existing, empty) directory ``dst``."""
    if progress:
        print(f"kvtier: converting {src} (one time) ...", file=sys.stderr, flush=True)
    reader = open_reader(src)
    meta = read_metadata(reader)
    config = hf_config(meta, reader)
    tokenizer, tokenizer_config = build_tokenizer(meta)
    if "max_position_embeddings" in config:
        tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    plan = plan_tensors(reader, config)
    config.update(extra_config or {})
    bar = _progress_bar(len(plan), enabled=progress)
    try:
        entries = [(name, shape) for _, name, shape in plan]
        write_safetensors(dst / "model.safetensors", entries, hf_tensors(reader, config, plan), bar.update)
    finally:
        bar.close()
    save_tokenizer_json(tokenizer, dst / "tokenizer.json")
    (dst / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n"
    )
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


class _NoBar:
    """Stand-in for a tqdm bar when progress is off."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, *, enabled: bool) -> Any:
    """A tqdm bar on stderr (only imported when asked for)."""
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="kvtier: dequantizing", unit="tensor", file=sys.stderr)
