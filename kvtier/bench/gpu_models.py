"""Random-weight checkpoints of real model shapes for ``kvtier bench gpu``: no download, no model file.

A lent GPU machine reaches no registry and only a few MiB of files travel with a command, so the models
are built on the spot: transformers' own config class (``LlamaConfig``, ``Qwen3Config``,
``Gemma3TextConfig``) written as
``config.json``, seeded random weights under the HF tensor names in ``model.safetensors``, and a
byte-level BPE tokenizer with no merges (every byte is a token). Both kvtier and transformers load the
directory as they load a downloaded checkpoint.

Weights are scaled so that activations keep their size through the layers, the layers' outputs outweigh
the token's own embedding (the next token depends on the context, not on the last token alone), and the
logits are spread (an untied head of std ~4): greedy decoding then has no near-ties, and a token that
differs between two devices means a real difference, not rounding.

    shape          layers  hidden  heads/kv  head_dim  vocab    (what it stands for)
    llama-3.2-1b   16      2048    32/8      64        128256   Llama 3.2 1B
    qwen3-0.6b     28      1024    16/8      128       151936   Qwen3 0.6B (q/k RMSNorm)
    gemma3-270m    18      640     4/1       256       262144   Gemma 3 270M: 5 sliding layers to 1 full,
                                                                 window 32 (512 in the real model: the
                                                                 exactness prompts must outgrow it)
    tiny-llama     2       64      4/2       16        512      CPU smoke runs
    tiny-qwen3     2       64      4/2       32        512
    tiny-gemma3    2       64      4/2       32        512      a sliding layer (window 16), a full one
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")


@dataclass(frozen=True)
class Shape:
    name: str
    arch: str  # "llama" | "qwen3"
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    max_positions: int = 40_960
    window: int | None = None  # gemma3: the sliding layers' window
    full_every: int = 0  # gemma3: every full_every-th layer attends to the whole context

    def params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.intermediate) + self.vocab * self.hidden

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * element_bytes

    def layer_types(self) -> list[str]:
        """Each layer's attention kind, as its checkpoint's config writes them (HF's names)."""
        if not self.full_every:
            return ["full_attention"] * self.layers
        return [
            "full_attention" if (i + 1) % self.full_every == 0 else "sliding_attention"
            for i in range(self.layers)
        ]

    def kv_groups(self) -> int:
        """The KV groups kvtier gives it (``kvtier/kv/groups.py``): a pool block holds one group's K/V."""
        from kvtier.kv.groups import kv_layout

        return kv_layout(self.layer_types(), self.window).num_groups


SHAPES = {
    s.name: s
    for s in (
        Shape("llama-3.2-1b", "llama", 16, 2048, 8192, 32, 8, 64, 128_256, 500_000.0),
        Shape("qwen3-0.6b", "qwen3", 28, 1024, 3072, 16, 8, 128, 151_936, 1_000_000.0),
        Shape("tiny-llama", "llama", 2, 64, 128, 4, 2, 16, 512, 10_000.0, 4096),
        Shape("tiny-qwen3", "qwen3", 2, 64, 128, 4, 2, 32, 512, 10_000.0, 4096),
        Shape("gemma3-270m", "gemma3", 18, 640, 2048, 4, 1, 256, 262_144, 1_000_000.0, 32_768, 32, 6),
        Shape("tiny-gemma3", "gemma3", 2, 64, 128, 4, 2, 32, 512, 10_000.0, 4096, 16, 2),
    )
}


def hf_config(shape: Shape):  # noqa: ANN201 - a transformers PretrainedConfig
    """The shape as transformers' own config class (the reference loads the directory with it)."""
    import transformers

    common = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        rms_norm_eps=1e-6,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    if shape.arch == "qwen3":
        return transformers.Qwen3Config(**common)
    if shape.arch == "gemma3":
        kinds = shape.layer_types()
        return transformers.Gemma3TextConfig(
            **common, sliding_window=shape.window, layer_types=kinds, query_pre_attn_scalar=shape.head_dim
        )
    return transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)


def _tensors(shape: Shape) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of the shape's checkpoint."""
    h, d, inter = shape.hidden, shape.head_dim, shape.intermediate
    names: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (shape.vocab, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (shape.vocab, h),
    }
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        names |= {
            p + "self_attn.q_proj.weight": (shape.heads * d, h),
            p + "self_attn.k_proj.weight": (shape.kv_heads * d, h),
            p + "self_attn.v_proj.weight": (shape.kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, shape.heads * d),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if shape.arch in ("qwen3", "gemma3"):
            names |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if shape.arch == "gemma3":  # norms around the MLP too
            names |= {
                p + "pre_feedforward_layernorm.weight": (h,),
                p + "post_feedforward_layernorm.weight": (h,),
            }
    return names


def _weight(
    name: str, size: tuple[int, ...], gen: torch.Generator, device: torch.device, shape: Shape
) -> torch.Tensor:
    """Norms 1 ± 5%, embeddings N(0, 1), projections N(0, 1/fan_in): activations keep their scale.
    Gemma 3 multiplies by ``1 + w`` in its norms and scales the embeddings by sqrt(hidden) itself."""
    x = torch.randn(size, generator=gen, device=device)
    gemma = shape.arch == "gemma3"
    if "norm" in name:
        return 0.05 * x if gemma else 1.0 + 0.05 * x
    if "embed" in name:  # small beside the layers' outputs: the answer depends on the context
        return 0.1 * x / (shape.hidden**0.5 if gemma else 1.0)
    if "lm_head" in name:
        return 4.0 * x / size[1] ** 0.5  # logits of std ~4: a clear greedy choice
    return x / size[1] ** 0.5


def write_checkpoint(shape: Shape, directory: Path, seed: int = 0) -> Path:
    """``directory`` holding the shape's random checkpoint (bfloat16) and the byte tokenizer."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # randn is instant there
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {
        name: _weight(name, size, gen, device, shape).to(torch.bfloat16).cpu()
        for name, size in _tensors(shape).items()
    }
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    hf_config(shape).save_pretrained(directory)
    write_byte_tokenizer(directory)
    return directory


def write_byte_tokenizer(directory: Path) -> int:
    """A byte-level BPE without merges: ids 0..2 are the special tokens, then the 256 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate((*SPECIAL_TOKENS, *alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "add_bos_token": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return len(vocab)


def random_prompts(
    num: int, length: int, seed: int, vocab: int, prefix: list[int] | None = None
) -> list[list[int]]:
    """``num`` prompts of ``length`` random token ids (after ``prefix`` when given), never a special id."""
    gen = torch.Generator().manual_seed(seed)
    head = list(prefix or [])
    return [head + torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(num)]
