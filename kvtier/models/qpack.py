"""Packed weights for ``weight_dtype`` gguf / int8: built once, kept in the conversion cache.

A model's linear layers are packed into fused groups, in the row order ``LlamaModel`` computes in::

    layers.{i}.qkv      q_proj | k_proj | v_proj   (q, k rows in the interleaved RoPE order)
    layers.{i}.o        o_proj
    layers.{i}.gate_up  gate_proj | up_proj
    layers.{i}.down     down_proj
    lm_head             lm_head (or the tied embedding)

Each group is ``{group}.data`` (uint8 ``[N, K/32 * block bytes]``) plus, for int8, ``{group}.scale``
(fp32 ``[N]``); the safetensors metadata maps each group to its block type. ``gguf`` copies the GGUF
file's own blocks (no requantization: the weights are bit for bit the file's), each row's blocks
regrouped by field (``by_field``: scales, mins, codes); a group whose tensors are
of a type without a kernel (or of mixed types) is left out and runs dense from the fp32 conversion.
``int8`` quantizes the fp weights per output channel: ``scale = max|w_row| / 127``, ``q = round(w / scale)``.

The packed file lives next to the conversion: ``<cache>/<fingerprint>/packed-<mode>-v<N>.safetensors``,
written to a temp file and renamed, under the conversion lock; a second start memory-maps it and packs
nothing.

``auto`` (dense fp32 or bf16) keeps its fused groups too, for a GGUF's conversion only:
``fused-<dtype>-v<N>.safetensors`` holds each group as the transposed matrix ``DenseLinear`` multiplies
by (``{group}`` ``[K, N]``), so a later start memory-maps them instead of transposing ~0.5 s of the
default model's weights. It is as large as the conversion's own linears and LM head (+538 MB for the
default model). An HF directory's weights are not copied: that model transposes at every start.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from kvtier.config import ConfigError, ModelConfig
from kvtier.models.loader import LoadedModel, _conversion_lock, _gguf_in, default_cache_dir

PACK_VERSION = 3  # bump when the packed layout changes (2: block fields regrouped; 3: Q5_0 as Q8_0)
DENSE_VERSION = 1  # bump when LlamaModel's dense layout changes (row order, RoPE interleave, transpose)
Rows = tuple[str, torch.Tensor, torch.Tensor | None]  # (block type, uint8 [N, bytes], fp32 scale [N] | None)


def group_parts(config: ModelConfig) -> dict[str, list[str]]:
    """Group name -> the HF weight names it fuses, in row order."""
    groups: dict[str, list[str]] = {}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        groups[f"layers.{i}.qkv"] = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        groups[f"layers.{i}.o"] = [p + "self_attn.o_proj.weight"]
        groups[f"layers.{i}.gate_up"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        groups[f"layers.{i}.down"] = [p + "mlp.down_proj.weight"]
    return groups


def interleave(rows: torch.Tensor, name: str, config: ModelConfig) -> torch.Tensor:
    """q/k rows from HF's half-split order to the interleaved RoPE order ``LlamaModel`` uses."""
    from kvtier.models.llama import _interleave_rows

    if ".self_attn.q_proj." in name:
        return _interleave_rows(rows, config.num_heads, config.head_dim)
    if ".self_attn.k_proj." in name:
        return _interleave_rows(rows, config.num_kv_heads, config.head_dim)
    return rows


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: w [N, K] -> (q int8 [N, K], scale fp32 [N]), w ≈ q * scale."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [N]
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack_groups(
    config: ModelConfig, rows_of: Callable[[str], Rows | None], head_name: str
) -> dict[str, Rows]:
    """Every group whose parts all have kernel rows of one block type, fused in row order."""
    packed: dict[str, Rows] = {}
    for group, names in [*group_parts(config).items(), ("lm_head", [head_name])]:
        parts = _one_type([rows_of(name) for name in names])
        if parts is None:
            continue
        data = torch.cat([interleave(p[1], n, config) for p, n in zip(parts, names, strict=True)])
        scales = [p[2] for p in parts]
        scale = None
        if scales[0] is not None:
            scale = torch.cat([interleave(s, n, config) for s, n in zip(scales, names, strict=True)])
        packed[group] = (parts[0][0], by_field(parts[0][0], data), scale)
    return packed


def _one_type(parts: list[Rows | None]) -> list[Rows] | None:
    """``parts`` in one block type: as they are, or all as Q8_0 where they mix types Q8_0 holds exactly
    (Q4_0, Q5_0, Q8_0: ``qconvert.py``); None where a part has no kernel rows or the types cannot meet."""
    from kvtier.models.qconvert import TO_Q8_0, to_q8_0

    if any(p is None for p in parts):
        return None
    types = {p[0] for p in parts}  # type: ignore[index]
    if len(types) == 1:
        return parts  # type: ignore[return-value]
    if not types <= TO_Q8_0 | {"Q8_0"}:
        return None
    return [("Q8_0", torch.from_numpy(to_q8_0(t, d.numpy())), s) for t, d, s in parts]  # type: ignore[misc]


def by_field(qtype: str, data: torch.Tensor) -> torch.Tensor:
    """GGUF blocks [N, nb * block bytes] (each {d fp16, (m fp16,) codes}) regrouped per row as
    [d x nb | (m x nb |) codes x nb]: the same bytes, in the order ``qmatmul.c`` reads them (it converts
    a row's scales eight at a time). INT8 rows are codes only: returned as they are."""
    from kvtier.models.qkernels import BLOCK_BYTES

    if qtype == "INT8":
        return data.contiguous()
    n, block = data.shape[0], BLOCK_BYTES[qtype]
    blocks = data.reshape(n, -1, block)  # [N, nb, block bytes]
    head = 4 if qtype == "Q4_1" else 2
    fields = [blocks[:, :, i : i + 2] for i in range(0, head, 2)] + [blocks[:, :, head:]]
    return torch.cat([f.reshape(n, -1) for f in fields], dim=1).contiguous()


def int8_rows(weights: dict[str, torch.Tensor]) -> Callable[[str], Rows | None]:
    """``rows_of`` for int8: quantize the fp weight (K must be a multiple of 32)."""

    def rows_of(name: str) -> Rows | None:
        w = weights[name]
        if w.shape[1] % 32:
            return None
        q, scale = quantize_int8(w)
        return "INT8", q.view(torch.uint8), scale

    return rows_of


def gguf_rows(path: Path, config: ModelConfig) -> Callable[[str], Rows | None]:
    """``rows_of`` for gguf: the file's raw blocks (q/k rows un-permuted like the fp32 conversion)."""
    import numpy as np

    from kvtier.models.gguf_loader import hf_tensor_name, open_reader, unpermute_rows
    from kvtier.models.qconvert import TO_Q8_0, to_q8_0
    from kvtier.models.qkernels import QTYPES

    reader = open_reader(path)
    arch = next((f.contents() for k, f in reader.fields.items() if k == "general.architecture"), None)
    by_name = {hf_tensor_name(t.name): t for t in reader.tensors}

    def rows_of(name: str) -> Rows | None:
        tensor = by_name.get(name)
        qtype = None if tensor is None else tensor.tensor_type.name
        if qtype is None or qtype == "INT8" or (qtype not in QTYPES and qtype not in TO_Q8_0):
            return None
        data = np.asarray(tensor.data)  # [N, K/32 * block bytes] uint8
        if qtype not in QTYPES:  # Q5_0: no kernel of its own, the same weights as Q8_0 blocks
            qtype, data = "Q8_0", to_q8_0(qtype, data)
        if arch == "llama" and ".self_attn.q_proj." in name:
            data = unpermute_rows(data, config.num_heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            data = unpermute_rows(data, config.num_kv_heads)
        return qtype, torch.from_numpy(np.array(data, dtype=np.uint8)), None

    return rows_of


def _head_name(loaded: LoadedModel) -> str:
    tied = loaded.config.tie_word_embeddings or "lm_head.weight" not in loaded.weights
    return "model.embed_tokens.weight" if tied else "lm_head.weight"


def _source_gguf(loaded: LoadedModel) -> Path:
    """The GGUF file behind ``loaded``; ConfigError for an HF directory."""
    path = loaded.path
    if path.is_dir():
        if (path / "config.json").is_file():
            raise ConfigError(
                f"weight_dtype=gguf needs a GGUF model file, and {path} is an HF directory "
                "(use weight_dtype=int8 or auto)"
            )
        path = _gguf_in(path)
    return path


def _save_tensors(tensors: dict[str, torch.Tensor], target: Path, metadata: dict[str, str]) -> None:
    """Write ``tensors`` to ``target`` atomically (temp file in the same directory, then rename)."""
    from safetensors.torch import save_file

    fd, tmp = tempfile.mkstemp(prefix=".tmp-packed-", dir=target.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _save(packed: dict[str, Rows], target: Path) -> None:
    tensors = {f"{g}.data": d for g, (_, d, _) in packed.items()}
    tensors.update({f"{g}.scale": s for g, (_, _, s) in packed.items() if s is not None})
    _save_tensors(tensors, target, {g: qtype for g, (qtype, _, _) in packed.items()})


def _read(target: Path) -> dict[str, Rows]:
    """The packed groups of a file written by ``_save`` (memory-mapped)."""
    from safetensors import safe_open

    with safe_open(str(target), framework="pt") as f:
        meta = f.metadata() or {}
        keys = set(f.keys())
        return {
            g: (
                qtype,
                f.get_tensor(f"{g}.data"),
                f.get_tensor(f"{g}.scale") if f"{g}.scale" in keys else None,
            )
            for g, qtype in meta.items()
        }


def packed_weights(loaded: LoadedModel, mode: str) -> dict[str, Rows]:
    """The packed groups of ``loaded`` for ``mode`` ("gguf" / "int8"), from the cache or packed now.

    Kept in the GGUF's conversion directory, or ``<default cache>/<fingerprint>/`` for an HF directory."""
    directory = loaded.converted or default_cache_dir() / loaded.fingerprint
    root = directory.parent
    target = directory / f"packed-{mode}-v{PACK_VERSION}.safetensors"
    source = _source_gguf(loaded) if mode == "gguf" else None
    with contextlib.suppress(Exception):
        if target.is_file():
            return _read(target)
    rows_of = gguf_rows(source, loaded.config) if source is not None else int8_rows(loaded.weights)
    packed = pack_groups(loaded.config, rows_of, _head_name(loaded))
    if not packed:
        raise ConfigError(f"weight_dtype={mode}: no weight of this model has a Q8_0/Q4_0/Q4_1/Q5_0 kernel")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with _conversion_lock(root, loaded.fingerprint):
            _save(packed, target)
    except OSError:
        pass  # a read-only cache: run from memory, pack again next time
    return packed


def load_packed(
    loaded: LoadedModel, weight_dtype: str, dtype: str, device: str = "cpu"
) -> tuple[dict[str, Rows], object]:
    """``(packed groups, kernel library)`` for ``LlamaModel``; ``({}, None)`` for auto or without kernels.

    ConfigError (one line) for combinations that cannot run: a non-fp32 compute dtype, a GPU, gguf on
    an HF directory. When the kernels cannot be built, one log line and the dense fp32 weights."""
    if weight_dtype == "auto":
        return {}, None
    if dtype != "float32":
        raise ConfigError(
            f"weight_dtype={weight_dtype} computes in float32, but this model resolves to dtype={dtype}; "
            "pass dtype=float32"
        )
    if device != "cpu":
        raise ConfigError(f"weight_dtype={weight_dtype} runs on CPU only (its kernels are AVX2 C code)")
    if weight_dtype == "gguf":
        _source_gguf(loaded)  # an HF directory is an error even where the kernels are missing
    from kvtier.models.qkernels import kernels

    lib = kernels()
    if lib is None:
        return {}, None
    return packed_weights(loaded, weight_dtype), lib


def _dense_target(loaded: LoadedModel, dtype: torch.dtype) -> Path | None:
    if loaded.converted is None:
        return None
    return loaded.converted / f"fused-{str(dtype).removeprefix('torch.')}-v{DENSE_VERSION}.safetensors"


def cached_dense(loaded: LoadedModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``auto``'s fused transposed matrices by group, memory-mapped from the conversion cache; ``{}`` when
    there are none. A file that cannot be read is a miss and is removed (``LlamaModel`` also checks each
    matrix's shape and dtype, and builds any that do not fit)."""
    from safetensors import safe_open

    target = _dense_target(loaded, dtype)
    if target is None or not target.is_file():
        return {}
    try:
        with safe_open(str(target), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception:  # a truncated or corrupt file: rebuilt at this start
        with contextlib.suppress(OSError):
            target.unlink()
        return {}


def keep_dense(loaded: LoadedModel, dtype: torch.dtype, dense: dict[str, torch.Tensor]) -> None:
    """Store ``dense`` (group -> [K, N]) for later starts; nothing where there is no conversion directory
    or it cannot be written, or ``$KVTIER_KEEP_FUSED`` is ``0`` (then every start transposes again)."""
    target = _dense_target(loaded, dtype)
    if target is None or not dense or os.environ.get("KVTIER_KEEP_FUSED", "1") == "0":
        return
    # a full or read-only cache (OSError, safetensors' own errors) fails no start
    with contextlib.suppress(Exception), _conversion_lock(target.parent.parent, loaded.fingerprint):
        _save_tensors(dense, target, {"layout": f"kvtier-dense-v{DENSE_VERSION}"})
