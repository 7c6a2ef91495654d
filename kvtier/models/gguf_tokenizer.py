"""Tokenizers rebuilt from GGUF metadata with the ``tokenizers`` library, the way transformers builds them.

``tokenizer.ggml.model`` picks the model: ``gpt2`` is byte-level BPE (the file's merges, the split regex of
``tokenizer.ggml.pre``; Qwen2/Qwen3 files say ``qwen2``), ``llama`` is SentencePiece BPE with byte fallback.
Gemma files (``general.architecture`` gemma*) say ``llama`` too but need Gemma's own shape: spaces become
``▁`` in a normalizer (no prefix space, no pre-split), the tokens that are runs of spaces are respelled as
runs of ``▁``, and the merges are ranked by the tokens' order in the file (Gemma's scores do not follow
its merge order). Token types: control (3) becomes a special added token, user-defined (4, e.g. Gemma's
``\n\n`` runs) a plain added token matched whole, byte (6) tokens are the byte-fallback alphabet.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.config import ConfigError

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


def _gemma_model(tokens: list[str], meta: dict[str, Any]) -> tuple[Any, Callable[[str], bool]]:
    """Gemma's SentencePiece BPE, as transformers' ``GemmaTokenizer`` from a GGUF (see the module doc)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    respelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    merges = _merges_from_scores(respelled, [-float(i) for i in range(len(respelled))])
    vocab = {token: index for index, token in enumerate(respelled)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    bpe = models.BPE(
        vocab=vocab, merges=merges, fuse_unk=True, unk_token=unk, dropout=None, byte_fallback=True
    )
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tok, lambda token: True


_TOKENIZER_MODELS = {"gpt2": (_byte_level_model, False), "llama": (_sentencepiece_model, True)}
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


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
    if model == "llama" and meta.get("general.architecture") in _GEMMA_ARCHITECTURES:
        builder = _gemma_model
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
