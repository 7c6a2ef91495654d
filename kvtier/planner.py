"""``kvtier plan``: a first-order capacity planner for serving one model on one tensor-parallel group.

Pure arithmetic on architecture numbers (no torch, no weights loaded). Units: bytes, seconds, and decimal
GB (1 GB = 1e9 bytes, as device memory and bandwidth are specified). The model (the capacity model of
"How the KV cache speeds up LLM inference on GPUs", which it reproduces exactly):

* KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x KV dtype bytes. Under tensor
  parallelism each device holds ``kv_heads / tp`` heads (one replicated head when ``tp > kv_heads``).
* usable bytes per device = device memory x utilisation - reserve (activations, CUDA graphs, slack).
* weight bytes per device = params x weight dtype bytes / tp (embeddings and norms assumed sharded too).
* KV pool per device = usable - weights; max sequences = floor(pool / (KV bytes per device x context)).
  Every sequence is assumed to hold the full context (worst case, no prefix sharing).
* decode step = max(bandwidth term, compute term): (weights + batch x context x KV bytes) per device over
  the memory bandwidth, vs 2 x params x batch FLOPs over the device's peak FLOPS.
* reloading one full context: its KV over the host<->device link (every device loads its own shard in
  parallel) vs recomputing it: 2 x params x tokens FLOPs at peak x MFU (the quadratic attention-score
  FLOPs are left out, so the recompute estimate is optimistic).

A hybrid model (sliding-window layers beside full ones: Gemma 3, Qwen3 with ``use_sliding_window``) is
counted as the engine allocates it instead: its KV groups in ``--block-size`` blocks, a sliding group
holding only the blocks its window reaches (``kvtier.planner_groups``, on ``kvtier/kv/groups.py``). Its
KV per sequence, max sequences, pool tokens, host tier, decode reads and reload time use those bytes,
and the plan adds each group's bytes and the comparison with the same model with every layer full.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config import LAYER_TYPES, ConfigError, kv_token_bytes
from kvtier.kv.groups import KVLayout, kv_layout
from kvtier.planner_groups import GroupedKV, GroupRow, VsAllFull, grouped_kv, render_groups
from kvtier.planner_presets import PRESETS, gguf_spec, hf_spec

GB = 1e9
# bytes per element; int4 is half a byte (group scales ignored)
DTYPE_BYTES: dict[str, float] = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
# KV dtypes: the capacity model's (one scale per tensor, ignored: fp8 is exactly half of fp16), then
# kvtier's own ``--kv-cache-dtype`` values, counted as the engine allocates them (per-token scales
# included, ``kvtier.config.kv_token_bytes``; a test pins planner == engine).
PAPER_KV_DTYPES = ("fp32", "fp16", "bf16", "fp8")
ENGINE_KV_DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8")
KV_DTYPES = PAPER_KV_DTYPES + ENGINE_KV_DTYPES


def kv_bytes(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """K and V bytes of one token over ``num_layers`` layers and ``num_kv_heads`` heads in ``kv_dtype``."""
    if kv_dtype in ENGINE_KV_DTYPES:
        return kv_token_bytes(num_layers, num_kv_heads, head_dim, kv_dtype)
    return int(2 * num_layers * num_kv_heads * head_dim * DTYPE_BYTES[kv_dtype])


DECODE_BATCHES = (1, 8, 32, 64)


@dataclass(frozen=True)
class ModelSpec:
    """The architecture numbers the planner needs (a decoder-only transformer with GQA)."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_params: int = 0  # 0: derived from the numbers above by count_params
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3-style per-head q/k RMSNorm (counts 2 x head_dim params per layer)
    sandwich_norm: bool = False  # Gemma 3: RMSNorms after attention and MLP too (4 per layer, not 2)
    # Each layer's attention kind in HF's names ("full_attention", "sliding_attention") and the window
    # of the sliding ones (ModelConfig's fields); () and None: every layer full, a dense model.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    max_context: int | None = None  # the model's own context limit, tokens
    source: str = "preset"  # preset | hf | gguf

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model {self.name}: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model {self.name}: {self.num_heads} heads is not a multiple of {self.num_kv_heads} KV heads"
            )
        self._check_layer_types()
        if self.num_params <= 0:
            object.__setattr__(self, "num_params", count_params(self))

    def _check_layer_types(self) -> None:
        """Layer types as a tuple, one per layer, known kinds; all full becomes ``()`` and no window."""
        types = tuple(self.layer_types)
        if types and len(types) != self.num_layers:
            raise ConfigError(f"model {self.name}: {len(types)} layer types for {self.num_layers} layers")
        if unknown := set(types) - set(LAYER_TYPES):
            raise ConfigError(
                f"model {self.name}: unsupported layer type {sorted(unknown)[0]!r} "
                f"(supported: {', '.join(LAYER_TYPES)})"
            )
        if "sliding_attention" not in types:
            types, window = (), None
        elif not (isinstance(window := self.sliding_window, int) and window > 0):
            raise ConfigError(f"model {self.name}: sliding layers need a positive window, got {window}")
        object.__setattr__(self, "layer_types", types)
        object.__setattr__(self, "sliding_window", window)

    @property
    def is_hybrid(self) -> bool:
        """Some layers slide: the engine keeps its KV in several groups (``kv_layout``)."""
        return bool(self.layer_types)

    def kv_layout(self) -> KVLayout:
        """The engine's KV groups of this model (``kvtier/kv/groups.py``): one group for a dense one."""
        types = self.layer_types or ("full_attention",) * self.num_layers
        return kv_layout(types, self.sliding_window)

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """K and V bytes of one token over all layers (whole model, all TP ranks together)."""
        return kv_bytes(self.num_layers, self.num_kv_heads, self.head_dim, kv_dtype)


def count_params(m: ModelSpec) -> int:
    """Parameter count of a Llama-style decoder (embeddings, attention, gated MLP, RMSNorms, lm_head)."""
    h, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    layer = h * q * 2 + h * kv * 2 + 3 * h * m.intermediate_size + 2 * h
    layer += 2 * m.head_dim if m.qk_norm else 0
    layer += 2 * h if m.sandwich_norm else 0
    embeddings = m.vocab_size * h * (1 if m.tie_word_embeddings else 2)
    return m.num_layers * layer + embeddings + h


@dataclass(frozen=True)
class Deployment:
    """Where the model runs. Defaults: one 80 GB H100-SXM-class device (3.35 TB/s HBM3, 989 dense BF16
    TFLOPS, PCIe Gen5 x16 at ~50 GB/s achievable), vLLM's 0.9 memory utilisation, 2 GB reserve, 8k context.
    """

    gpu_mem_gb: float = 80.0  # device memory per GPU, GB
    gpu_util: float = 0.9  # fraction of device memory the engine may use
    reserve_gb: float = 2.0  # per device: activations, CUDA graphs, fragmentation, GB
    tp: int = 1  # tensor-parallel degree (devices in the group)
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    context: int = 8192  # tokens per sequence (prompt + output)
    block_size: int = 16  # tokens per KV block, the engine's (a hybrid model's KV is counted in blocks)
    host_mem_gb: float = 256.0  # host RAM given to the KV host tier (whole group), GB
    mem_bw_gbs: float = 3350.0  # device memory bandwidth per GPU, GB/s
    link_gbs: float = 50.0  # host<->device link per GPU, GB/s
    tflops: float = 989.0  # dense peak per GPU at the weight dtype, TFLOPS
    prefill_mfu: float = 0.5  # fraction of peak a prefill (recompute) achieves

    def validate(self) -> None:
        """ConfigError naming the first bad field (``--flag`` spelling)."""
        for name, (ok, rule) in _RULES.items():
            value = getattr(self, name)
            if isinstance(value, float | int) and not math.isfinite(value) or not ok(value):
                raise ConfigError(f"--{name.replace('_', '-')} must be {rule}, got {value!r}")


_POSITIVE = (lambda v: v > 0, "positive")
_FRACTION = (lambda v: 0 < v <= 1, "in (0, 1]")
_NON_NEGATIVE = (lambda v: v >= 0, "zero or more")
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "gpu_mem_gb": _POSITIVE,
    "gpu_util": _FRACTION,
    "reserve_gb": _NON_NEGATIVE,
    "tp": (lambda v: v >= 1, "at least 1"),
    "weight_dtype": (lambda v: v in DTYPE_BYTES, f"one of {', '.join(DTYPE_BYTES)}"),
    "kv_dtype": (lambda v: v in KV_DTYPES, f"one of {', '.join(KV_DTYPES)}"),
    "context": (lambda v: v >= 1, "at least 1 token"),
    "block_size": (lambda v: v >= 1 and not v & (v - 1), "a positive power of two"),
    "host_mem_gb": _NON_NEGATIVE,
    "mem_bw_gbs": _POSITIVE,
    "link_gbs": _POSITIVE,
    "tflops": _POSITIVE,
    "prefill_mfu": _FRACTION,
}


@dataclass(frozen=True)
class DecodeRow:
    """One decode step at a batch of ``batch`` full-context sequences."""

    batch: int
    step_s: float  # seconds per step (every sequence emits one token)
    tokens_per_s: float  # batch / step_s, the whole group
    kv_share: float  # fraction of the bytes read in the step that are KV (the rest are weights)
    bound: str  # "bandwidth" or "compute"


@dataclass(frozen=True)
class Plan:
    """The numbers ``kvtier plan`` prints; bytes unless named otherwise, per device where named so."""

    model: ModelSpec
    deployment: Deployment
    kv_bytes_per_token: int  # whole model
    kv_bytes_per_token_per_device: int
    kv_bytes_per_seq_per_device: int  # at deployment.context
    weight_bytes_per_device: float
    usable_bytes_per_device: float  # gpu_mem x util - reserve
    kv_pool_bytes_per_device: float
    max_seqs: int  # full-context sequences the device pools hold
    pool_tokens: int  # tokens the pool holds (a hybrid model: the longest one sequence, the engine's cap)
    host_seqs: int  # full-context sequences the host tier holds
    decode: tuple[DecodeRow, ...]
    host_load_s: float  # one full context's KV from host over the link
    recompute_s: float  # one full context's prefill recomputed
    notes: tuple[str, ...] = field(default=())
    kv_groups: tuple[GroupRow, ...] = ()  # a hybrid model's KV groups per device; () for a dense one
    vs_all_full: VsAllFull | None = None  # a hybrid model against every layer full; None for a dense one

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (the model and deployment nested)."""
        return dataclasses.asdict(self)


def _kv_heads_per_device(m: ModelSpec, tp: int) -> int:
    """KV heads one device holds: ``kv_heads / tp``, or 1 (replicated) when ``tp`` exceeds them."""
    if m.num_heads % tp:
        raise ConfigError(f"--tp {tp} does not divide {m.name}'s {m.num_heads} attention heads")
    if m.num_kv_heads >= tp:
        if m.num_kv_heads % tp:
            raise ConfigError(f"--tp {tp} does not divide {m.name}'s {m.num_kv_heads} KV heads")
        return m.num_kv_heads // tp
    if tp % m.num_kv_heads:
        raise ConfigError(f"--tp {tp} is not a multiple of {m.name}'s {m.num_kv_heads} KV heads")
    return 1


def plan(model: ModelSpec, dep: Deployment, batches: tuple[int, ...] = DECODE_BATCHES) -> Plan:
    """Size the deployment; ConfigError when the model does not fit or cannot hold one full sequence."""
    dep.validate()
    tp, ctx = dep.tp, dep.context
    heads_dev = _kv_heads_per_device(model, tp)
    kv_tok = model.kv_bytes_per_token(dep.kv_dtype)
    kv_dev = kv_bytes(model.num_layers, heads_dev, model.head_dim, dep.kv_dtype)
    weights_dev, usable, pool = _device_budget(model, dep)
    seqs = _sequences(model, dep, heads_dev, pool)
    if seqs.max_seqs < 1:
        raise ConfigError(
            f"{model.name} at TP={tp} leaves a {_gb(pool)} KV pool per device, less than one {ctx:,}-token "
            f"sequence ({_gb(seqs.seq_dev)} per device); lower --context, use --kv-dtype fp8 or raise --tp"
        )
    notes = []
    if model.max_context is not None and ctx > model.max_context:
        notes.append(f"--context {ctx:,} exceeds {model.name}'s own limit of {model.max_context:,} tokens")
    grouped = seqs.grouped
    return Plan(
        model=model,
        deployment=dep,
        kv_bytes_per_token=kv_tok,
        kv_bytes_per_token_per_device=kv_dev,
        kv_bytes_per_seq_per_device=seqs.seq_dev,
        weight_bytes_per_device=weights_dev,
        usable_bytes_per_device=usable,
        kv_pool_bytes_per_device=pool,
        max_seqs=seqs.max_seqs,
        pool_tokens=seqs.pool_tokens,
        host_seqs=int(dep.host_mem_gb * GB // seqs.seq_bytes),
        decode=_decode_rows(model, dep, weights_dev, seqs, batches),
        host_load_s=seqs.seq_dev / (dep.link_gbs * GB),
        recompute_s=2 * model.num_params * ctx / (tp * dep.tflops * 1e12 * dep.prefill_mfu),
        notes=tuple(notes),
        kv_groups=grouped.groups if grouped else (),
        vs_all_full=grouped.vs_all_full if grouped else None,
    )


def _device_budget(model: ModelSpec, dep: Deployment) -> tuple[float, float, float]:
    """``(weights, usable, KV pool)`` bytes per device; ConfigError when nothing is left for the KV."""
    weights_dev = model.num_params * DTYPE_BYTES[dep.weight_dtype] / dep.tp
    usable = dep.gpu_mem_gb * GB * dep.gpu_util - dep.reserve_gb * GB
    budget = f"{_gb(dep.gpu_mem_gb * GB)} x {dep.gpu_util:g} - {_gb(dep.reserve_gb * GB)} reserve"
    if usable <= 0:
        raise ConfigError(f"no usable device memory: {budget} = {_gb(usable)}")
    pool = usable - weights_dev
    if pool <= 0:
        raise ConfigError(
            f"{model.name} does not fit at TP={dep.tp}: {_gb(weights_dev)} of {dep.weight_dtype} weights per "
            f"device exceed the {_gb(usable)} usable ({budget}); "
            "raise --tp, shrink --weight-dtype or add memory"
        )
    return weights_dev, usable, pool


@dataclass(frozen=True)
class _Sequences:
    """What one ``context``-token sequence holds and how many the pool fits."""

    seq_dev: int  # KV bytes of one sequence per device
    seq_bytes: int  # the same, whole model (every TP rank together)
    max_seqs: int
    pool_tokens: int
    grouped: GroupedKV | None  # a hybrid model's groups; None for a dense one


def _sequences(model: ModelSpec, dep: Deployment, heads_dev: int, pool: float) -> _Sequences:
    """A dense model: ``context`` x KV bytes per token. A hybrid one: its KV groups, in whole blocks."""
    ctx, kv_dtype = dep.context, dep.kv_dtype
    if not model.is_hybrid:
        kv_dev = kv_bytes(model.num_layers, heads_dev, model.head_dim, kv_dtype)
        seq_dev = kv_dev * ctx
        seq = model.kv_bytes_per_token(kv_dtype) * ctx
        return _Sequences(seq_dev, seq, int(pool // seq_dev), int(pool // kv_dev), None)
    layout, bs = model.kv_layout(), dep.block_size
    grouped = grouped_kv(
        layout, model.num_layers, ctx, bs, kv_bytes(1, heads_dev, model.head_dim, kv_dtype), pool
    )
    seq = layout.kv_bytes_held(ctx, bs, kv_bytes(1, model.num_kv_heads, model.head_dim, kv_dtype))
    return _Sequences(grouped.seq_bytes, seq, grouped.max_seqs, grouped.max_tokens, grouped)


def _decode_rows(
    model: ModelSpec, dep: Deployment, weights_dev: float, seqs: _Sequences, batches: tuple[int, ...]
) -> tuple[DecodeRow, ...]:
    """One decode step at each batch below the pool's maximum, and at the maximum."""
    rows = []
    for batch in sorted({b for b in batches if 1 <= b < seqs.max_seqs} | {seqs.max_seqs}):
        kv_read = batch * seqs.seq_dev
        t_mem = (weights_dev + kv_read) / (dep.mem_bw_gbs * GB)
        t_compute = 2 * model.num_params * batch / (dep.tp * dep.tflops * 1e12)
        step = max(t_mem, t_compute)
        bound = "compute" if t_compute > t_mem else "bandwidth"
        rows.append(DecodeRow(batch, step, batch / step, kv_read / (weights_dev + kv_read), bound))
    return tuple(rows)


# ------------------------------------------------------------------------------------------ model inputs


def load_model_spec(model: str | None) -> ModelSpec:
    """A preset name (``llama-3.1-8b``...), an HF directory / ``config.json``, a ``.gguf`` file (or a
    directory holding one), or None for the embedded default GGUF."""
    if model is None:
        from kvtier.models.loader import default_model_path  # torch-free at import

        return ModelSpec(**gguf_spec(default_model_path()))
    name = model.strip().lower()
    path = Path(model).expanduser()
    alias = name.rsplit("/", 1)[-1].removesuffix("-instruct")  # meta-llama/Llama-3.1-8B-Instruct
    if name in PRESETS or (alias in PRESETS and not path.exists()):
        key = name if name in PRESETS else alias
        return ModelSpec(name=key, **PRESETS[key])
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").is_file():
            return ModelSpec(**hf_spec(path / "config.json"))
        if len(ggufs) != 1:
            raise ConfigError(f"{path} holds no config.json and {len(ggufs)} GGUF files; name one file")
        path = ggufs[0]
    if path.is_file():
        with open(path, "rb") as f:
            is_gguf = f.read(4) == b"GGUF"
        return ModelSpec(**(gguf_spec(path) if is_gguf else hf_spec(path)))
    raise ConfigError(
        f"unknown model {model!r}: not a file or directory, nor a preset ({', '.join(PRESETS)})"
    )


# ---------------------------------------------------------------------------------------------- printing


def _gb(n: float) -> str:
    return f"{n / GB:,.2f} GB"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.2f} ms" if s < 10 else f"{s:,.1f} s"


def render(p: Plan) -> str:
    """The human-readable table of ``kvtier plan``."""
    m, d = p.model, p.deployment
    ctx, per_dev = f"{d.context:,}", " per device" if d.tp > 1 else ""
    devices = f"{d.tp} x {d.gpu_mem_gb:g} GB devices" if d.tp > 1 else f"one {d.gpu_mem_gb:g} GB device"
    rows = [
        ("model", f"{m.num_layers} layers, {m.num_heads} heads / {m.num_kv_heads} KV heads x {m.head_dim}, "
                  f"{m.num_params / 1e9:,.3f} B params"),
        ("KV per token", f"{p.kv_bytes_per_token:,} B ({d.kv_dtype})"),
        ("KV per token per device", f"{p.kv_bytes_per_token_per_device:,} B (TP={d.tp})"),
        ("KV per sequence", f"{_gb(p.kv_bytes_per_seq_per_device)}{per_dev} at {ctx} tokens"),
        ("weights", f"{_gb(p.weight_bytes_per_device)}{per_dev} ({d.weight_dtype})"),
        ("usable memory", f"{_gb(p.usable_bytes_per_device)}{per_dev} "
                          f"({d.gpu_mem_gb:g} GB x {d.gpu_util:g} - {d.reserve_gb:g} GB reserve)"),
        ("KV pool", f"{_gb(p.kv_pool_bytes_per_device)}{per_dev} = {p.pool_tokens:,} tokens"),
        ("max sequences", f"{p.max_seqs:,} concurrent at {ctx} tokens"),
        ("host tier", f"{p.host_seqs:,} sequences at {ctx} tokens in {d.host_mem_gb:g} GB of host memory"),
    ]  # fmt: skip
    if m.is_hybrid:
        num_full = m.layer_types.count("full_attention")
        sliding = f"{m.num_layers - num_full} sliding (a {m.sliding_window:,}-token window)"
        rows.insert(1, ("attention", f"{num_full} full + {sliding} layers"))
    lines = [f"kvtier plan: {m.name} ({m.source}) on {devices}, TP={d.tp}"]
    lines += [f"  {label:<25} {value}" for label, value in rows]
    if p.vs_all_full is not None:  # a hybrid model: what its KV groups hold
        slots = m.kv_layout().slots_per_group
        lines += render_groups(p.kv_groups, p.vs_all_full, slots, d.context, d.block_size, per_dev)
    lines += [
        "",
        f"  decode step: weights + every sequence's KV read once at {d.mem_bw_gbs:g} GB/s per device "
        f"(compute: {d.tflops:g} TFLOPS)",
        f"  {'batch':>7}  {'step':>10}  {'tokens/s':>10}  {'tok/s/seq':>9}  {'KV bytes':>8}  bound",
    ]
    for r in p.decode:
        label = f"{r.batch:,}" + ("*" if r.batch == p.max_seqs else "")
        lines.append(
            f"  {label:>7}  {_ms(r.step_s):>10}  {r.tokens_per_s:>10,.0f}  {1 / r.step_s:>9,.1f}  "
            f"{r.kv_share:>8.0%}  {r.bound}"
        )
    faster = p.recompute_s / p.host_load_s
    lines += [
        "  (* the most sequences the KV pool holds; tokens/s for the whole group)",
        "",
        f"  one full {ctx}-token context back on the device:",
        f"    load from host  {_ms(p.host_load_s):>10}  "
        f"({_gb(p.kv_bytes_per_seq_per_device)}{per_dev} over a {d.link_gbs:g} GB/s link)",
        f"    recompute       {_ms(p.recompute_s):>10}  "
        f"(2 x params x tokens FLOPs at {d.prefill_mfu:g} x {d.tflops:g} TFLOPS{per_dev}; "
        "attention FLOPs left out)",
        f"    loading is {faster:,.1f}x {'faster' if faster >= 1 else 'slower'} than recomputing",
    ]
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- CLI


_HELP = {
    "gpu_mem_gb": "device memory per GPU, GB",
    "gpu_util": "fraction of device memory the engine may use",
    "reserve_gb": "per-device reserve for activations / CUDA graphs, GB",
    "tp": "tensor-parallel degree",
    "weight_dtype": "weight precision",
    "kv_dtype": "KV cache precision",
    "context": "tokens per sequence (prompt + output)",
    "block_size": "tokens per KV block: the live pool's and a hybrid model's KV groups'",
    "host_mem_gb": "host memory for the KV host tier, GB",
    "mem_bw_gbs": "device memory bandwidth per GPU, GB/s",
    "link_gbs": "host<->device link per GPU, GB/s",
    "tflops": "dense peak TFLOPS per GPU",
    "prefill_mfu": "fraction of peak a recompute (prefill) reaches",
}


def add_args(parser: argparse.ArgumentParser) -> None:
    """The ``kvtier plan`` flags (defaults: one 80 GB H100-class device, see ``Deployment``)."""
    parser.description = (
        "Capacity planner: KV bytes per token, KV pool, concurrent sequences, host tier, decode step "
        "estimate and host-load vs recompute time for a model on a tensor-parallel group; for a hybrid "
        "model (Gemma 3) each KV group's bytes and the gain over every layer full. Pure arithmetic: "
        "nothing is loaded. GB = 1e9 bytes."
    )
    presets = ", ".join(PRESETS)
    parser.add_argument(
        "--model", help=f"preset ({presets}), HF directory or .gguf file (default: the embedded SmolLM2 GGUF)"
    )
    for f in dataclasses.fields(Deployment):
        flag, default = "--" + f.name.replace("_", "-"), f.default
        help_text = f"{_HELP[f.name]} (default {default})"
        if f.name.endswith("dtype"):
            choices = tuple(DTYPE_BYTES) if f.name == "weight_dtype" else KV_DTYPES
            parser.add_argument(flag, choices=choices, default=default, help=help_text)
        else:
            parser.add_argument(flag, type=type(default), default=default, help=help_text)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--from-server",
        metavar="URL",
        help="instead: a running `kvtier serve`'s sizing advice from its miss-ratio curves "
        "(GET /v1/kv/advice)",
    )
    parser.add_argument("--api-key", default=None, help="the server's API key (with --from-server)")
    live = parser.add_argument_group("the live kvtier pool (what `kvtier serve` with these flags allocates)")
    live.add_argument("--kv-device-gb", type=float, help="device KV pool in GiB, as the engine flag")
    live.add_argument("--kv-cache-dtype", default="auto", help="as the engine flag (auto: float32)")
    live.add_argument("--server", metavar="URL", help="read the pool of a running `kvtier serve` instead")
    parser.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    """``kvtier plan``: print the plan of ``ns`` (ConfigError on bad input or a model that does not fit)."""
    if ns.from_server:
        from kvtier.insight.report import fetch_advice, render_advice

        advice = fetch_advice(ns.from_server, ns.api_key)
        print(json.dumps(advice, indent=2) if ns.json else render_advice(advice, ns.from_server))
        return 0
    names = [f.name for f in dataclasses.fields(Deployment)]
    dep = Deployment(**{n: getattr(ns, n) for n in names})
    dep.validate()  # flags first: a bad number fails before the model is read
    pool = None
    if getattr(ns, "server", None):
        pool = pool_of_server(ns.server, dep.context)
    elif getattr(ns, "kv_device_gb", None) is not None:
        pool = pool_of_flags(
            load_model_spec(ns.model), ns.kv_device_gb, ns.kv_cache_dtype, ns.block_size, dep.context
        )
    result = plan(load_model_spec(ns.model), dep)
    if ns.json:
        out = result.to_dict() | ({"live_pool": dataclasses.asdict(pool)} if pool else {})
        print(json.dumps(out, indent=2), file=sys.stdout)
    else:
        print(render(result) + (f"\n\n{render_pool(pool)}" if pool else ""), file=sys.stdout)
    return 0


# ------------------------------------------------------------------------------------ the live pool


@dataclass(frozen=True)
class PoolCapacity:
    """A kvtier device pool: what the engine allocates for these flags, or what a server reports."""

    source: str  # "flags" or the server URL
    kv_dtype: str  # resolved: float32, bfloat16, float16, fp8_e4m3, fp8_e5m2, int8
    block_size: int
    block_bytes: int  # one block, every layer, scales included
    num_blocks: int
    context: int
    # blocks one ``context``-token sequence keeps over the model's KV groups (``KVLayout.num_blocks_held``);
    # None: one full-attention group, ceil(context / block_size) (a server whose /v1/kv/info lists no groups)
    blocks_per_seq: int | None = None

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_seqs(self) -> int:
        """Full ``context``-token sequences the pool holds at once (whole blocks each)."""
        return self.num_blocks // (self.blocks_per_seq or -(-self.context // self.block_size))


def pool_of_flags(
    model: ModelSpec, kv_device_gb: float, kv_cache_dtype: str, block_size: int, context: int
) -> PoolCapacity:
    """The pool ``kvtier serve --kv-device-gb G --kv-cache-dtype X`` allocates for ``model`` (the engine's
    own arithmetic: ``kvtier.config`` and the model's KV groups, ``kvtier/kv/groups.py``); ``auto`` is
    taken as float32 (the embedded GGUF's)."""
    from kvtier.config import KVCacheDType, check_choice, device_pool_blocks, resolve_kv_dtype

    check_choice("kv_cache_dtype", kv_cache_dtype, KVCacheDType)
    if kv_device_gb <= 0 or not math.isfinite(kv_device_gb):
        raise ConfigError(f"--kv-device-gb must be positive, got {kv_device_gb}")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ConfigError(f"--block-size must be a positive power of two, got {block_size}")
    kv_dtype = resolve_kv_dtype(kv_cache_dtype, "float32")
    layout = model.kv_layout()
    block_bytes = layout.block_bytes(block_size, kv_bytes(1, model.num_kv_heads, model.head_dim, kv_dtype))
    num_blocks = device_pool_blocks(kv_device_gb, block_bytes)
    held = layout.num_blocks_held(context, block_size)
    return PoolCapacity("flags", kv_dtype, block_size, block_bytes, num_blocks, context, held)


def pool_of_server(url: str, context: int) -> PoolCapacity:
    """The pool of a running server, from its ``GET /v1/kv/info`` (its KV groups too: a hybrid model's
    sequence keeps every full-attention block but only its windows' sliding ones)."""
    import httpx

    from kvtier.router.groups import layout_of

    info_url = url.rstrip("/").removesuffix("/v1") + "/v1/kv/info"
    try:
        info = httpx.get(info_url, timeout=10).raise_for_status().json()
        fields = (
            info["kv_dtype"],
            int(info["block_size"]),
            int(info["kv_block_bytes"]),
            int(info["num_device_blocks"]),
        )
        layout = layout_of(info)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        raise ConfigError(f"--server {url}: cannot read the pool from {info_url} ({exc})") from None
    held = None if layout is None else layout.num_blocks_held(context, fields[1])
    return PoolCapacity(url, *fields, context, held)


def render_pool(pool: PoolCapacity) -> str:
    """The live pool section of ``kvtier plan``."""
    per_token = pool.block_bytes / pool.block_size
    return "\n".join(
        [
            f"kvtier device pool ({pool.source}): KV dtype {pool.kv_dtype}",
            f"  {'block':<25} {pool.block_bytes:,} B = {pool.block_size} tokens x {per_token:,.0f} B "
            "(scales included)",
            f"  {'pool':<25} {pool.num_blocks:,} blocks = {pool.tokens:,} tokens",
            f"  {'max sequences':<25} {pool.max_seqs:,} concurrent at {pool.context:,} tokens",
        ]
    )
