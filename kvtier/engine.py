"""The engine loop: ``step() = schedule → forward → sample → update``.

::

    add_request ──► Scheduler.waiting
    step():
        out     = scheduler.schedule()          # which tokens run, block tables, COW copies
        logits  = runner.execute(out)           # one forward over the step's flattened tokens
        scheduler.advance(out)                  # K/V now exist: publish newly full blocks
        tokens  = sampler.sample(logits, ...)   # n > 1: children fork from the prompt here
        scheduler.append_token / outputs.on_token   # stop conditions, text, streaming deltas
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

import torch

from kvtier.config import CacheConfig, ConfigError, EngineArgs, SchedulerConfig, TierConfig
from kvtier.kv.manager import KVCacheManager
from kvtier.models.llama import LlamaModel
from kvtier.models.loader import LoadedModel, load_model
from kvtier.output_processor import OutputProcessor
from kvtier.outputs import RequestOutput
from kvtier.sampling_params import SamplingParams
from kvtier.scheduler.preemption import CostModel
from kvtier.scheduler.scheduler import Scheduler, SchedulerOutput
from kvtier.sequence import Request, Sequence, SequenceStatus, seq_id_for
from kvtier.stats import EngineStats, TierSnapshot
from kvtier.tiers.base import KVTier, TierIdentity
from kvtier.tiers.coordinator import TierCoordinator
from kvtier.transfer.mover import TierMover
from kvtier.worker.runner import ModelRunner, kv_block_bytes
from kvtier.worker.sampler import Sampler, SampleRequest

log = logging.getLogger("kvtier.engine")

PromptType = str | list[int] | Mapping[str, Any]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_KV_DEVICE_GB = 1.0


def build_tiers(
    config: TierConfig, identity: TierIdentity, device_kv: torch.Tensor
) -> tuple[TierCoordinator | None, TierMover | None]:
    """The host tier (and disk tier under it) with the mover that copies their bytes, or Nones."""
    if config.host_gb <= 0:
        return None, None
    from kvtier.tiers.disk import DiskTier
    from kvtier.tiers.host import HostTier
    from kvtier.transfer.disk_io import DiskIOWorker

    num_slots = int(config.host_gb * 2**30 // identity.block_bytes)
    if num_slots < 1:
        raise ConfigError(f"kv_host_gb={config.host_gb} holds no block of {identity.block_bytes} B")
    disk = worker = None
    if config.disk_dir is not None:
        disk = DiskTier(config.disk_dir, int(config.disk_gb * 2**30), identity)
        worker = DiskIOWorker(identity)
    coordinator = TierCoordinator(HostTier(num_slots), disk, config.store_policy)
    mover = TierMover(device_kv, num_slots, worker)
    coordinator.mover = mover
    log.info(
        "host tier: %d blocks, %.2f GiB (%d bytes pinned)",
        num_slots,
        mover.host.nbytes / 2**30,
        mover.host.pinned_bytes,
    )
    return coordinator, mover


def _tier_snapshot(tier: KVTier, block_size: int) -> TierSnapshot:
    """A lower tier's counters (the ``TierStats`` fields ``TierSnapshot`` shares) and occupancy."""
    st = tier.stats
    counters = {f.name: getattr(st, f.name) for f in dataclasses.fields(TierSnapshot) if hasattr(st, f.name)}
    return TierSnapshot(
        tier=tier.medium.value,
        capacity_blocks=tier.capacity_blocks,
        used_blocks=tier.num_used_blocks,
        hit_tokens=st.hit_blocks * block_size,
        **counters,
    )


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class LLMEngine:
    def __init__(self, args: EngineArgs, *, progress: bool = False, loaded: LoadedModel | None = None):
        args.validate()
        self.args = args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.loaded = loaded if loaded is not None else load_model(args.model, progress=progress)
        self.tokenizer = self.loaded.tokenizer
        mc = self.model_config = self.loaded.config
        dtype_name = mc.native_dtype if args.dtype == "auto" else args.dtype
        self.dtype = _DTYPES[dtype_name]
        self.device = _device()

        model_len = args.max_model_len or mc.max_position_embeddings
        self.model = LlamaModel(mc, self.loaded.weights, self.dtype, max(model_len, 1))
        block_bytes = kv_block_bytes(self.model, args.block_size)
        if args.kv_device_blocks is not None:
            num_blocks = args.kv_device_blocks
        else:
            num_blocks = int((args.kv_device_gb or DEFAULT_KV_DEVICE_GB) * 2**30 // block_bytes)
            if num_blocks < 2:
                raise ConfigError(
                    f"kv_device_gb={args.kv_device_gb} holds fewer than 2 blocks of {block_bytes} B"
                )
        capacity = num_blocks * args.block_size
        if args.max_model_len is not None and args.max_model_len > capacity:
            raise ConfigError(
                f"max_model_len={args.max_model_len} needs more KV than the device pool holds "
                f"({num_blocks} blocks x {args.block_size} = {capacity} tokens); raise kv_device_blocks/gb"
            )
        self.max_model_len = min(model_len, capacity)
        self.cache_config = CacheConfig(args.block_size, num_blocks, args.enable_prefix_caching)
        self.scheduler_config = SchedulerConfig(
            args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len, args.preemption_mode
        )
        self.tier_config = TierConfig(
            args.kv_host_gb, args.kv_disk_dir, args.kv_disk_gb, args.kv_store_policy
        )

        self.runner = ModelRunner(self.model, num_blocks, args.block_size, self.device)
        identity = TierIdentity(
            self.loaded.fingerprint,
            dtype_name,
            tuple(self.runner.kv_cache.shape[1:]),
            self.runner.kv_cache.element_size(),
        )
        self.tiers, self.mover = build_tiers(self.tier_config, identity, self.runner.kv_cache)
        self.kv = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching, tiers=self.tiers)
        eos = set(self.tokenizer.eos_token_ids) | set(mc.eos_token_ids)
        self.eos_token_ids = tuple(sorted(eos))
        self.cost_model = CostModel(block_bytes)
        self.scheduler = Scheduler(self.scheduler_config, self.kv, self.eos_token_ids, self.cost_model)
        self.sampler = Sampler(args.seed)
        self.outputs = OutputProcessor(self.tokenizer)
        # Block hashes chain from the model's identity and the KV dtype: blocks are only ever
        # reused by the same weights computing in the same precision.
        self.cache_identity = f"{self.loaded.fingerprint}:{dtype_name}"
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._closed = False

    # --------------------------------------------------------------------------- requests
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ConfigError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, Seq) and not isinstance(prompt, bytes | bytearray):
            return None, list(prompt)
        raise ConfigError(
            f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue one request; raises ``ConfigError`` (and queues nothing) on bad input."""
        params = params if params is not None else SamplingParams()
        params.validate()
        text, token_ids = self.tokenize_prompt(prompt)
        vocab = self.model_config.vocab_size
        if not token_ids:
            raise ConfigError("the prompt is empty")
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ConfigError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ConfigError(
                f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "which leaves no room for output"
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ConfigError(f"request id {request_id!r} is already in use")
        extra_keys = (self.cache_identity, cache_salt or "")
        max_total = self.max_model_len
        if params.max_tokens is not None:
            max_total = min(max_total, len(token_ids) + params.max_tokens)
        seq = Sequence(
            seq_id_for(request_id, 0),
            request_id,
            0,
            list(token_ids),
            len(token_ids),
            params,
            extra_keys,
            max_total,
        )
        if params.logprobs is not None:
            seq.logprobs = []
        self.requests[request_id] = Request(request_id, list(token_ids), params, [seq], prompt=text)
        self.scheduler.add(seq)
        self._num_prompt_tokens += len(token_ids)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Drop a request now: its blocks go back to the pool before the next step."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            self.sampler.release(seq.seq_id)
        self.outputs.forget(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        tiers = self.tiers
        if tiers is not None:
            tiers.poll()  # finished disk reads become host hits; finished writes become disk blocks
        out = self.scheduler.schedule()
        if out.is_empty and tiers is not None and tiers.has_pending_io and self.scheduler.waiting:
            tiers.wait(0.05)  # nothing can run until a disk read lands: wait for it, not spin
            out = self.scheduler.schedule()
        if not out.swap.is_empty:
            self._run_swap_plan(out)
        if out.is_empty:
            return []
        now = time.monotonic()
        for s in out.scheduled:
            if s.seq.first_scheduled_time is None:
                s.seq.first_scheduled_time = now
        t0 = time.perf_counter()
        logits = self.runner.execute(out)
        if out.prefills and not out.decodes:
            self.cost_model.observe_prefill(out.num_batched_tokens, time.perf_counter() - t0)
        self.scheduler.advance(out)

        sample_reqs: list[SampleRequest] = []
        targets: list[tuple[Sequence, int]] = []  # (parent seq, child index) per sample request
        for row, s in enumerate(x for x in out.scheduled if x.samples):
            seq = s.seq
            indices = range(seq.params.n) if seq.forks_on_prompt_done else [seq.index]
            for i in indices:
                sid = seq_id_for(seq.request_id, i)
                sample_reqs.append(SampleRequest(row, sid, i, seq.params, self._banned(seq)))
                targets.append((seq, i))
        results = self.sampler.sample(logits, sample_reqs)

        touched: dict[str, Request] = {}
        now = time.monotonic()
        seqs = [self._seq_for(parent, i) for parent, i in targets]  # forks happen before any append
        self._num_generation_tokens += len(results)
        for seq, (token, logprob) in zip(seqs, results, strict=True):
            request = self.requests[seq.request_id]
            touched[request.request_id] = request
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.logprobs is not None and logprob is not None:
                seq.logprobs.append(logprob)
            self.scheduler.append_token(seq, token)
            stop = self.outputs.on_token(seq, token)
            if stop is not None:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED, stop)
            if seq.status.finished:
                self.outputs.on_finish(seq)
                self.sampler.release(seq.seq_id)

        outputs = []
        for request in touched.values():
            outputs.append(self.outputs.make_output(request))
            if request.finished:
                self.outputs.forget(request)
                del self.requests[request.request_id]
        return outputs

    def _run_swap_plan(self, out: SchedulerOutput) -> None:
        assert self.tiers is not None and self.mover is not None
        timing = self.mover.execute(out.swap)
        self.tiers.complete_plan(out.swap)
        hs = self.tiers.host.stats
        hs.blocks_stored += timing.blocks_stored
        hs.bytes_stored += timing.bytes_stored
        hs.store_seconds += timing.store_seconds
        hs.blocks_loaded += timing.blocks_loaded
        hs.bytes_loaded += timing.bytes_loaded
        hs.load_seconds += timing.load_seconds
        self.cost_model.observe_transfer(
            timing.bytes_stored + timing.bytes_loaded, timing.store_seconds + timing.load_seconds
        )

    # ------------------------------------------------------------------------------ stats
    def stats(self) -> EngineStats:
        """A snapshot of the engine's gauges and cumulative counters (see ``kvtier.stats``)."""
        kv = self.kv
        pool = kv.pool
        device = TierSnapshot(
            tier="device",
            capacity_blocks=pool.num_blocks,
            used_blocks=pool.num_blocks - pool.num_free_blocks,
            lookups=kv.stats.device_lookup_blocks,
            hit_blocks=kv.stats.device_hit_blocks,
            hit_tokens=kv.stats.device_hit_blocks * self.cache_config.block_size,
            blocks_evicted=kv.stats.num_evicted_blocks,
        )
        tiers = {"device": device}
        if self.tiers is not None:
            tiers["host"] = _tier_snapshot(self.tiers.host, self.cache_config.block_size)
            if self.tiers.disk is not None:
                tiers["disk"] = _tier_snapshot(self.tiers.disk, self.cache_config.block_size)
        return EngineStats(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage(),
            prefix_cache_queries=kv.stats.prefix_cache_queries,
            prefix_cache_hits=kv.stats.prefix_cache_hits,
            num_preemptions=dict(self.scheduler.preemptions_by_mode),
            prompt_tokens=self._num_prompt_tokens,
            generation_tokens=self._num_generation_tokens,
            tiers=tiers,
        )

    def flush_tiers(self) -> None:
        """Copy every cached device block down to the host tier and every host block to disk, and
        wait for the writes: after this, a restarted engine on the same disk directory finds them."""
        if self.tiers is None or not self.tiers.disk_active:
            return  # nothing outlives the process without a disk tier
        for block in self.kv.pool.blocks:
            if block.block_hash is not None:
                self.tiers.store(block.block_id, block.block_hash)
        out = SchedulerOutput(swap=self.tiers.take_plan())
        if not out.swap.is_empty:
            self._run_swap_plan(out)
        self.tiers.flush()

    def close(self) -> None:
        """Flush the tiers (a restart finds the blocks on disk) and stop the disk worker. Safe to
        call twice; the engine must not be stepped afterwards."""
        if self.mover is None or self._closed:
            return
        self._closed = True
        try:
            self.flush_tiers()
        finally:
            self.mover.close()

    def _seq_for(self, parent: Sequence, index: int) -> Sequence:
        if index == parent.index:
            return parent
        child = Sequence(
            seq_id_for(parent.request_id, index),
            parent.request_id,
            index,
            parent.token_ids[: parent.num_prompt_tokens],
            parent.num_prompt_tokens,
            parent.params,
            parent.extra_keys,
            parent.max_total_tokens,
        )
        child.logprobs = [] if parent.logprobs is not None else None
        child.first_scheduled_time = parent.first_scheduled_time
        self.scheduler.fork(parent, child)
        self.requests[parent.request_id].seqs.append(child)
        return child

    def _banned(self, seq: Sequence) -> tuple[int, ...]:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            return ()
        banned = set(p.stop_token_ids)
        if not p.ignore_eos:
            banned |= set(self.eos_token_ids)
        return tuple(sorted(banned))
