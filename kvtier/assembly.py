"""Building an engine's parts from ``EngineArgs`` and a loaded model, in dependency order.

::

    EngineArgs + LoadedModel ─► EngineConfig (resolve_engine_config: pool sizes, max_model_len)
      model          the forward pass, weights packed or dense           build_model
      runner         the device KV pool and the step's forward            ModelRunner
      tiers, mover   host / disk / remote under the pool                  build_tiers (tier_stack.py)
      kv             block tables, prefix cache, swap plans               KVCacheManager
      scheduler      who runs each step; admission (capacity, queue wait)
      sampler        one token per row (grammars for structured output)
      insight        miss-ratio curves and the canary, told every lookup
      kv_events      what the pool and the tiers store and remove, to Redis (when a URL is set)
      inspector      /v1/kv/* answers and the canary's quarantine

This is the one place where the parts are chosen and wired: a model architecture, a KV group layout
or a serving role is decided here, and ``LLMEngine`` only runs them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvtier.config import EngineArgs, EngineConfig, TierConfig, resolve_engine_config
from kvtier.insight.hub import CacheInsight
from kvtier.insight.inspector import CacheFacts, KVInspector
from kvtier.kv.groups import kv_layout
from kvtier.kv.hashing import cache_identity
from kvtier.kv.manager import KVCacheManager
from kvtier.kv.retention import Retention
from kvtier.kv_events import KVEventRecorder, RedisStreamPublisher, default_replica_id
from kvtier.models import attention_backend, registry
from kvtier.models.kv_quant import STORAGE_DTYPES
from kvtier.models.llama import LlamaModel
from kvtier.models.loader import LoadedModel
from kvtier.models.qpack import cached_dense, keep_dense, load_packed
from kvtier.models.slot_gate import SlotGate
from kvtier.scheduler.admission import Admission
from kvtier.scheduler.preemption import CostModel
from kvtier.scheduler.scheduler import Scheduler
from kvtier.tier_stack import build_tiers
from kvtier.tiers.base import TierIdentity
from kvtier.tiers.coordinator import TierCoordinator
from kvtier.transfer import cuda_copy
from kvtier.transfer.mover import TierMover
from kvtier.worker.runner import ModelRunner
from kvtier.worker.sampler import Sampler
from kvtier.worker.structured import Grammars

log = logging.getLogger("kvtier.engine")


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@dataclass
class EngineParts:
    """Everything an ``LLMEngine`` runs, built and wired."""

    config: EngineConfig
    dtype: torch.dtype  # the compute dtype
    device: torch.device
    model: LlamaModel
    runner: ModelRunner
    tiers: TierCoordinator | None
    mover: TierMover | None
    kv: KVCacheManager
    eos_token_ids: tuple[int, ...]  # the tokenizer's and the model config's, sorted
    cost_model: CostModel
    scheduler: Scheduler
    admission: Admission
    sampler: Sampler
    insight: CacheInsight
    cache_identity: str  # the first extra key of every block-hash chain (kvtier/kv/hashing.py)
    replica_id: str
    kv_events: KVEventRecorder | None
    inspector: KVInspector


def build_model(
    loaded: LoadedModel,
    config: EngineConfig,
    device: torch.device,
    weight_dtype: str,
    attention: str = attention_backend.C,
) -> LlamaModel:
    """The model with its weights packed (gguf / int8) or dense (auto: kept fused in the conversion
    cache, so a later start maps them instead of transposing; kvtier/models/qpack.py), its attention
    run by the resolved backend ``attention`` (kvtier/models/attention_backend.py)."""
    dtype = STORAGE_DTYPES[config.dtype]
    packed, kernels = load_packed(loaded, weight_dtype, config.dtype, device.type)
    on_cpu = device.type == "cpu"  # elsewhere: the weights move there, no kept fused copies
    weights = loaded.weights if on_cpu else {k: v.to(device) for k, v in loaded.weights.items()}
    cached = cached_dense(loaded, dtype) if weight_dtype == "auto" and on_cpu else {}
    model = registry.build_model(config.model, weights, dtype, config.max_model_len, packed, kernels, cached)
    if weight_dtype == "auto" and on_cpu and not cached:
        keep_dense(loaded, dtype, model.dense_groups())
    model.select_attention(attention)
    return model


def _graphs_apply(args: EngineArgs, device: torch.device, attention: str) -> bool:
    """CUDA graphs for decode-shaped steps (kvtier/worker/graphs.py): on CUDA, with the Triton kernels,
    unless ``--enforce-eager``."""
    return device.type == "cuda" and attention == attention_backend.TRITON and not args.enforce_eager


def _use_graphs(runner: ModelRunner, mover: TierMover | None, config: EngineConfig) -> None:
    """Capture the decode-shaped steps' graphs; if that fails with the layered loads' waits inside,
    the loads stay whole and capture runs again without them."""
    rows, max_len = config.scheduler.max_num_batched_tokens, config.max_model_len
    if runner.use_graphs(rows, max_len) or runner.cache.gate is None:
        return
    log.warning("--layered-loads off: the CUDA graphs could not be captured with its waits")
    runner.cache.gate = None
    if mover is not None:
        mover.gate = None
    runner.use_graphs(rows, max_len)


def _kv_side(loaded: LoadedModel, config: EngineConfig, model: LlamaModel, device: torch.device):
    """The device pool, the tiers under it and the block manager over both, in the model's KV groups
    (one for a dense model; a hybrid one's sliding groups keep only the blocks their window reaches)."""
    cache = config.cache
    layout = kv_layout(config.model.layer_types, config.model.sliding_window)
    runner = ModelRunner(model, cache.num_device_blocks, cache.block_size, device, cache.kv_dtype, layout)
    identity = TierIdentity(  # disk and remote headers record the KV dtype: another's is a miss
        loaded.fingerprint,
        cache.kv_dtype,
        tuple(runner.kv_cache.shape[1:]),
        runner.kv_cache.element_size(),
    )
    retention = _retention(config)
    gate = _slot_gate(config.tiers, runner)
    tiers, mover = build_tiers(config.tiers, identity, runner.kv_cache, retention, gate)
    kv = KVCacheManager(
        cache.num_device_blocks, cache.block_size, cache.enable_prefix_caching, None, tiers, layout, retention
    )
    return runner, tiers, mover, kv


def _slot_gate(tiers: TierConfig, runner: ModelRunner) -> SlotGate | None:
    """The pool's gate for layered host loads (kvtier/models/slot_gate.py) when they are asked for,
    there is a host tier, and (on CUDA) the runtime's 2-D copy can be called; None otherwise."""
    if not tiers.layered_loads or tiers.num_host_blocks <= 0:
        return None
    if runner.device.type == "cuda" and not cuda_copy.available():
        log.warning("--layered-loads: the CUDA runtime's cudaMemcpy2DAsync was not found; loads stay whole")
        return None
    try:
        runner.cache.gate = SlotGate(runner.kv_cache.shape[1], runner.device)
    except TypeError as exc:  # a torch without external CUDA events (torch.cuda.Event(external=True))
        log.warning("--layered-loads: %s; loads stay whole", exc)
        return None
    return runner.cache.gate


def _retention(config: EngineConfig) -> Retention | None:
    """Prompt-cache retention (kvtier/kv/retention.py): at most the fraction of the largest tier."""
    cache, tiers = config.cache, config.tiers
    if not cache.enable_prefix_caching or cache.retain_max_fraction <= 0:
        return None
    disk_blocks = tiers.disk_bytes // cache.block_bytes if tiers.disk_dir is not None else 0
    largest = max(cache.num_device_blocks, tiers.num_host_blocks, disk_blocks)
    return Retention(int(largest * cache.retain_max_fraction), cache.retain_max_fraction)


def _start_kv_events(
    args: EngineArgs, replica_id: str, kv: KVCacheManager, tiers: TierCoordinator | None
) -> KVEventRecorder | None:
    """A recorder on the device pool and every tier when events are on (a URL is set; the remote
    tier's store is the default)."""
    url = args.kv_events_url or args.kv_remote_url
    if url is None:
        return None
    recorder = KVEventRecorder(replica_id, RedisStreamPublisher(url, replica_id))
    kv.listener = recorder
    if tiers is not None:
        tiers.attach_listener(recorder)  # announces what they hold already (the disk's files)
    recorder.end_step()  # batch 1: "cleared", then those blocks
    return recorder


def assemble(args: EngineArgs, loaded: LoadedModel) -> EngineParts:
    """Every part of an engine for ``args`` over ``loaded``, wired (``args`` already validated)."""
    config = resolve_engine_config(args, loaded.config)
    cache, tokenizer = config.cache, loaded.tokenizer
    device = default_device()
    attention = attention_backend.resolve(args.attention_backend, device.type)  # ConfigError: cannot run
    model = build_model(loaded, config, device, args.weight_dtype, attention)
    runner, tiers, mover, kv = _kv_side(loaded, config, model, device)
    if _graphs_apply(args, device, attention):
        _use_graphs(runner, mover, config)
    eos = tuple(sorted(set(tokenizer.eos_token_ids) | set(config.model.eos_token_ids)))
    cost_model = CostModel(cache.block_bytes)
    scheduler = Scheduler(config.scheduler, kv, eos, cost_model)
    admission = Admission(config.scheduler, scheduler, cache.num_device_blocks, config.max_model_len)
    vocab = max(tokenizer.vocab_size, config.model.vocab_size)
    sampler = Sampler(args.seed, Grammars(tokenizer.backend, vocab, eos))
    # Miss-ratio curves and the equivalence canary (kvtier/insight): told every adopted lookup.
    lower = [t.medium for t in tiers.tiers] if tiers is not None else []
    insight = CacheInsight(args.canary_rate, cache.block_size, cache.kv_dtype, args.seed, lower=lower)
    kv.observer = insight
    if tiers is not None:
        insight.attach(tiers)  # per-tier simulations, told of the blocks offered
    identity = cache_identity(loaded.fingerprint, config.dtype, cache.kv_dtype)
    replica_id = args.kv_replica_id or default_replica_id()
    kv_events = _start_kv_events(args, replica_id, kv, tiers)
    facts = CacheFacts(
        replica_id, loaded.fingerprint, identity, cache.kv_dtype, cache.block_bytes, cache.num_device_blocks
    )
    inspector = KVInspector(facts, kv, tiers, insight, cost_model, kv_events)
    dtype = STORAGE_DTYPES[config.dtype]
    return EngineParts(
        config, dtype, device, model, runner, tiers, mover, kv, eos, cost_model, scheduler, admission,
        sampler, insight, identity, replica_id, kv_events, inspector,
    )  # fmt: skip
