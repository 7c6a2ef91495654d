"""The engine loop: poll tiers → schedule → move blocks → execute → sample → update.

::

    add_request ──► Scheduler.waiting
    step():
        _poll_tiers()                  finished reads from disk become host hits, finished writes held blocks
        out = scheduler.schedule()     which tokens run, their block tables, copy-on-write copies, and the
                                       step's SwapPlan (a request whose prefix is still being read from
                                       disk is held back; if nothing at all can run, wait briefly for a read)
        _move_blocks(out.swap)         the plan's device→host stores, then host→device loads
        result = _execute(out)         one forward over the step's flattened tokens (sampling rows' logits,
                                       prompt logprobs); the scheduler then publishes the blocks that
                                       became full (prefix cache, write-through)
        samples = _sample(out, result.logits)  one token per sampling row; n > 1: children fork here
        _fail_rows(failures)           a row that could not be sampled ends its own request with an
                                       error (finish_reason "error"); non-finite model logits also
                                       quarantine the tier the corrupt blocks came from (row_faults.py)
        outputs = _update(samples)     stop conditions, text deltas, finished requests leave

With KV events on (``kv_events_url``), the device pool and every tier tell a ``KVEventRecorder`` what
they store and remove; ``step`` closes each step's events into one batch, published to Redis by a
background thread (``kvtier/kv_events.py``).

``LLMEngine.__init__`` loads the model and takes its parts from ``kvtier.assembly.assemble`` (which
resolves ``EngineArgs`` against the model and builds and wires every piece); ``engine.py`` keeps request
intake (``add_request``, with admission by capacity when asked: kvtier/scheduler/admission.py) and the
step loop. The cache's reports (``kv_info``, ``kv_blocks``, ``kv_advice``, the canary's quarantine) are
``kvtier/insight/inspector.py``'s.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import Any

import torch

from kvtier.assembly import assemble
from kvtier.config import ConfigError, EngineArgs
from kvtier.insight.hub import IDLE_SLICE_S
from kvtier.kv.hashing import BlockHash
from kvtier.kv.plan import SwapPlan
from kvtier.kv.retention import RetentionSpan
from kvtier.kv.write_ahead import WriteBackAhead
from kvtier.models.loader import LoadedModel, load_model
from kvtier.output_processor import OutputProcessor
from kvtier.outputs import RequestOutput
from kvtier.prompt_input import PromptType, check_prompt, prompt_token_ids
from kvtier.row_faults import contain
from kvtier.sampling_params import SamplingParams
from kvtier.scheduler.inspection import describe_requests
from kvtier.scheduler.scheduler import SchedulerOutput
from kvtier.sequence import Request, Sequence, SequenceStatus, seq_id_for
from kvtier.stats import EngineStats, KVGroupUsage, Medium
from kvtier.tokenizer import Tokenizer
from kvtier.worker.runner import StepLogits
from kvtier.worker.sampler import RowError, SampleRequest
from kvtier.worker.structured import Grammars

Sample = tuple[Sequence, tuple[int, Any]]  # (sequence, (token id, logprobs or None))
Failure = tuple[Sequence, RowError]  # (the sequence whose row sampled, why it could not)
TIER_WAIT_S = 0.05  # how long a step with nothing to run waits for a lower-tier read
UPKEEP_S = 1.0  # how often an idle engine with a tier below the host looks after them (settle_tiers)


class LLMEngine:
    """Request intake and the step loop over the parts ``kvtier.assembly.assemble`` builds."""

    def __init__(self, args: EngineArgs, *, progress: bool = False, loaded: LoadedModel | None = None):
        args.validate()  # before loading anything: a bad argument fails at once
        self.args = args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.loaded = (
            loaded
            if loaded is not None
            else load_model(args.model, progress=progress, chat_template=args.chat_template)
        )
        self.tokenizer = self.loaded.tokenizer
        parts = assemble(args, self.loaded)
        self.config, self.model_config = parts.config, parts.config.model
        self.dtype, self.device, self.model, self.runner = (
            parts.dtype,
            parts.device,
            parts.model,
            parts.runner,
        )
        self.tiers, self.mover, self.kv = parts.tiers, parts.mover, parts.kv
        self.eos_token_ids, self.cost_model = parts.eos_token_ids, parts.cost_model
        self.scheduler, self.admission, self.sampler = parts.scheduler, parts.admission, parts.sampler
        self.insight, self.inspector, self.kv_events = parts.insight, parts.inspector, parts.kv_events
        self.cache_identity, self.replica_id = parts.cache_identity, parts.replica_id
        if self.tiers is not None:  # a hit's loads start as soon as they are planned (start_loads)
            self.tiers.run_now = self._move_blocks
        self.write_ahead = WriteBackAhead(self.kv.pool, self.tiers, self.config.tiers.write_ahead_blocks)
        self.outputs = OutputProcessor(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_retained_hit_tokens = 0  # prompt tokens read from the cache within a retention
        self._last_step_s = 0.0  # what the insight replay before the next step may take a share of
        self._closed = False
        # time.monotonic() of the next idle upkeep of the tiers (None: no tier below the host)
        below_host = self.tiers is not None and bool(self.tiers.external)
        self._next_upkeep: float | None = time.monotonic() + UPKEEP_S if below_host else None

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.config.cache.block_size

    @property
    def grammars(self) -> Grammars | None:
        """The structured-output compiler (thread-safe: the server compiles off the engine thread)."""
        return self.sampler.grammars

    # --------------------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        *,
        priority: int = 0,
        tenant: str | None = None,
        arrival_time: float | None = None,
        admit: bool = False,
        retention: Seq[RetentionSpan] = (),
        final_only: bool = False,
    ) -> str:
        """Validate and queue one request; raises ``ConfigError`` (and queues nothing) on bad input.
        ``priority``: lower runs first; ``tenant``: its fair-share key; ``arrival_time``: monotonic
        seconds when it arrived (the HTTP layer's; default now). ``admit``: refuse it when the engine
        is past its capacity (``KVCapacityExceeded`` / ``QueueWaitExceeded``, both with
        ``retry_after_s``: kvtier/scheduler/admission.py) instead of queueing every request.
        ``retention``: keep the prompt's first tokens cached for a while (kvtier/kv/retention.py).
        ``final_only``: ``step`` returns its output once, finished (no copy of the answer each step)."""
        params = params if params is not None else SamplingParams()
        params.validate()
        text, token_ids = prompt_token_ids(prompt, self.tokenizer)
        check_prompt(token_ids, self.model_config.vocab_size, self.max_model_len)
        self._check_token_params(params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ConfigError(f"request id {request_id!r} is already in use")
        extra_keys = (self.cache_identity, cache_salt or "")
        if admit:
            self.admission.check(token_ids, extra_keys, params)
        seq = self._first_sequence(request_id, token_ids, params, extra_keys)
        request = Request(request_id, list(token_ids), params, [seq], prompt=text)
        if arrival_time is not None:
            request.arrival_time = seq.arrival_time = arrival_time
        request.priority = seq.priority = priority
        request.tenant = seq.tenant = tenant or ""
        request.retention, request.final_only = tuple(retention), final_only
        self.requests[request_id] = request
        self.scheduler.add(seq)
        self._num_prompt_tokens += len(token_ids)
        return request_id

    def _first_sequence(
        self, request_id: str, token_ids: list[int], params: SamplingParams, extra_keys: tuple[str, str]
    ) -> Sequence:
        """Completion 0 of a new request (the others fork from it when its prompt is done)."""
        max_total = self.max_model_len
        if params.max_tokens is not None:
            max_total = min(max_total, len(token_ids) + params.max_tokens)
        seq_id = seq_id_for(request_id, 0)
        seq = Sequence(seq_id, request_id, 0, list(token_ids), len(token_ids), params, extra_keys, max_total)
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first token has no context: no logprob
        return seq

    def _check_token_params(self, params: SamplingParams) -> None:
        """Token ids named by the parameters must be in the vocabulary (the sampler indexes by them); bad
        words tokenized, a thinking budget needs a parser, a grammar compiled (unless the server did)."""
        vocab = self.model_config.vocab_size
        named = [("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)]
        named.append(("allowed_token_ids", params.allowed_token_ids or []))
        for name, ids in named:
            for t in ids:
                if not 0 <= t < vocab:
                    raise ConfigError(f"{name}: token id {t} is outside the vocabulary [0, {vocab})")
        params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        spec = params.structured_outputs
        if params.thinking_token_budget is not None and (spec is None or spec.reasoning is None):
            raise ConfigError(
                "thinking_token_budget needs a reasoning parser: SamplingParams.reason_first(parser)"
            )
        if params.structured_outputs is not None:  # a bad schema fails before queueing
            assert self.sampler.grammars is not None
            # pinned to params: compiled here only when the caller (the server) did not compile it first
            self.sampler.grammars.prepare(params)

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
        # The sizing trackers' backlog, a slice at a time under steady load: before this step, not
        # after the last one, whose tokens were out without waiting for it.
        self.insight.catch_up(self._last_step_s)
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self._last_step_s = time.perf_counter() - t0
            if self.kv_events is not None:
                self.kv_events.end_step()  # the step's KV events, one batch (published in the background)

    def _step(self) -> list[RequestOutput]:
        self._poll_tiers()
        out = self.scheduler.schedule()
        self._move_blocks(out.swap)
        if out.is_empty and self._wait_for_tiers():
            out = self.scheduler.schedule()
            self._move_blocks(out.swap)
        if out.is_empty:
            return []
        self.write_ahead.after_step()  # the pool's eviction order changed: written back when idle
        t0 = time.perf_counter()
        result = self._execute(out)
        samples, failures = self._sample(out, result.logits)  # on the device: Sampler.sample decides
        failed = self._fail_rows(failures)
        gone = {request.request_id for request in failed}
        outputs = self._update([x for x in samples if x[0].request_id not in gone]) + self._emit(failed)
        # The whole step (forward, sampling, outputs) is what a stream waits between tokens.
        prefill_tokens = sum(s.num_new_tokens for s in out.prefills)
        self.cost_model.observe_step(len(out.decodes), prefill_tokens, time.perf_counter() - t0)
        return outputs

    def _poll_tiers(self) -> None:
        """Reads from disk that finished become host hits; finished writes become held blocks."""
        if self.tiers is not None:
            self.tiers.poll()

    def _wait_for_tiers(self) -> bool:
        """Nothing could run: if a request waits for a lower-tier read, wait for it rather than spin."""
        if self.tiers is None or not self.tiers.has_pending_io or not self.scheduler.waiting:
            return False
        self.tiers.wait(TIER_WAIT_S)
        return True

    def _move_blocks(self, plan: SwapPlan) -> None:
        """Run the step's device↔host copies (the mover records them in the host tier's counters)."""
        if plan.is_empty:
            return
        assert self.tiers is not None and self.mover is not None
        moved = self.mover.execute(plan)
        self.tiers.complete_plan(plan)
        self.cost_model.observe_transfer(moved.nbytes, moved.seconds)

    def _execute(self, out: SchedulerOutput) -> StepLogits:
        """One forward pass; afterwards the step's K/V exist and the scheduler advances."""
        if self.insight.canary.capturing:
            self.runner.settle_loads()  # the sampled hits' bytes: loaded ones too
        self.insight.canary.capture(self.runner.cache)  # the bytes sampled hits were served
        result = self.runner.execute(out)
        for seq, entries in result.prompt_logprobs:
            assert seq.prompt_logprobs is not None
            seq.prompt_logprobs.extend(entries)
        self.scheduler.advance(out)
        self._retain(out)
        return result

    def _retain(self, out: SchedulerOutput) -> None:
        """Prompts computed this step keep their retention spans' blocks (a hit refreshes them). Every
        scheduled sequence is looked at: a prompt cached but for its last token computes a 1-token
        chunk, which the step runs among the decodes."""
        for s in out.scheduled:
            request = self.requests.get(s.seq.request_id)
            prompt = s.num_computed_tokens < s.seq.num_prompt_tokens  # this chunk holds prompt tokens
            done = prompt and s.num_computed_tokens + s.num_new_tokens >= s.seq.num_prompt_tokens
            if request is not None and request.retention and done and s.seq.seq_id in self.kv:
                request.num_retained_tokens = retained = self.kv.retain(s.seq.seq_id, request.retention)
                self._num_retained_hit_tokens += min(s.seq.num_cached_tokens or 0, retained)

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> tuple[list[Sample], list[Failure]]:
        """A token for every sequence whose chunk reached its newest token, or the row's failure. A
        prompt with n > 1 samples n tokens from its one row; the children fork from the prompt before
        any append (not those of a request whose row failed)."""
        requests: list[SampleRequest] = []
        targets: list[tuple[Sequence, int]] = []  # (parent seq, child index) per sample request
        for row, s in enumerate(x for x in out.scheduled if x.samples):
            seq = s.seq
            for i in range(seq.params.n) if seq.forks_on_prompt_done else [seq.index]:
                sid = seq.seq_id if i == seq.index else seq_id_for(seq.request_id, i)
                penalties = (seq.token_ids, seq.num_prompt_tokens) if seq.params.penalized else ()
                requests.append(SampleRequest(row, sid, i, seq.params, self._banned(seq), *penalties))
                targets.append((seq, i))
        results = self.sampler.sample(logits, requests)
        failures = [(p, r) for (p, _), r in zip(targets, results, strict=True) if isinstance(r, RowError)]
        failed = {parent.request_id for parent, _ in failures}
        samples = [
            (self._seq_for(parent, i), result)
            for (parent, i), result in zip(targets, results, strict=True)
            if parent.request_id not in failed
        ]
        return samples, failures

    def _fail_rows(self, failures: list[Failure]) -> list[Request]:
        """End each failed row's request with its error, no other request. Non-finite model logits
        also contain the corrupt K/V (``kvtier.row_faults.contain``: the tier the blocks were loaded
        from is quarantined), and every other live request holding a corrupt block ends too."""
        errors: dict[str, str] = {}
        for seq, error in failures:
            errors.setdefault(seq.request_id, error.message)
            if error.model:
                held = contain(
                    self.kv,
                    self.runner.cache,
                    self.tiers,
                    self.requests,
                    seq.seq_id,
                    self.inspector.quarantine,
                )
                for request_id in held:
                    errors.setdefault(request_id, error.message)
        failed = [self.requests[rid] for rid in errors if rid in self.requests]
        for request in failed:
            request.error = errors[request.request_id]
            for seq in request.seqs:
                if not seq.status.finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
                    self.outputs.on_finish(seq)
            for i in range(request.params.n):  # forks not made yet may have a generator already
                self.sampler.release(seq_id_for(request.request_id, i))
        return failed

    def _update(self, samples: list[Sample]) -> list[RequestOutput]:
        """Append the sampled tokens, apply stop conditions, and emit one output per touched request."""
        touched: dict[str, Request] = {}
        now = time.monotonic()
        self._num_generation_tokens += len(samples)
        for seq, (token, logprob) in samples:
            touched[seq.request_id] = self.requests[seq.request_id]
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
        return self._emit(touched.values())

    def _emit(self, requests: Iterable[Request]) -> list[RequestOutput]:
        outputs = []
        for request in requests:
            finished = request.finished
            if finished or not request.final_only:
                outputs.append(self.outputs.make_output(request))
            if finished:
                self.outputs.forget(request)
                del self.requests[request.request_id]
                freed = sum(self.kv.num_blocks_for(seq.num_tokens) for seq in request.seqs)
                self.admission.on_finished(freed)  # the drain rate behind Retry-After
        return outputs

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
        """The tokens ``seq`` may not take next: EOS and stop ids before ``min_tokens``, and the last token
        of a bad word whose other tokens end the output."""
        p = seq.params
        if not p.bad_words_token_ids and seq.num_output_tokens >= p.min_tokens:
            return ()  # the usual row: nothing banned
        banned: set[int] = set()
        if seq.num_output_tokens < p.min_tokens:
            banned |= set(p.stop_token_ids)
            if not p.ignore_eos:
                banned |= set(self.eos_token_ids)
        for word in p.bad_words_token_ids:
            head = len(word) - 1
            if head == 0 or (head <= seq.num_output_tokens and tuple(seq.token_ids[-head:]) == word[:-1]):
                banned.add(word[-1])
        return tuple(sorted(banned))

    # ------------------------------------------------------------------------------ idle work
    @property
    def has_tier_work(self) -> bool:
        """Copies the last step planned, tier reads and writes in flight, the pool's next evictions to
        write back, or the lower tiers' idle upkeep due (``settle_tiers``)."""
        return self.tiers is not None and (
            self.tiers.has_pending_work or self.write_ahead.pending or self.upkeep_in() == 0.0
        )

    def upkeep_in(self) -> float | None:
        """Seconds until an idle engine looks after its lower tiers again (0.0: due); None: it has none."""
        if self._next_upkeep is None:
            return None
        return max(0.0, self._next_upkeep - time.monotonic())

    def settle_tiers(self) -> None:
        """With no request to step: run the copies the last step planned and apply finished reads and
        writes. A finished prompt's last blocks become full in its last step; their copies to the host
        tier, and from there to the disk and remote tiers, would otherwise wait for this replica's next
        request, and other replicas (and a router) would not see them meanwhile.

        Every ``UPKEEP_S`` it also looks after the tiers below the host while idle: it asks a shared
        store whether it restarted (an idle replica would otherwise notice only at its next request, and
        until then go on announcing the blocks the restart emptied, which a router counts as cheap hits,
        and not write its host blocks there again), and the step's ``tick`` writes the disk tier's
        retention file down when due. After a step with requests, it also stores the pool's next
        evictions to the host tier, a few per call (``kvtier/kv/write_ahead.py``)."""
        if self.has_unfinished_requests():
            return
        if self.tiers is not None and self.upkeep_in() == 0.0:
            self.tiers.check_stores()
            self._next_upkeep = time.monotonic() + UPKEEP_S
        self.write_ahead.plan()  # a few of the pool's next evictions, stored now (kv/write_ahead.py)
        self.step()  # nothing to schedule: the step runs the planned copies and polls the tiers

    @property
    def has_idle_work(self) -> bool:
        """The cache's bookkeeping (the sizing trackers' backlog, canary checks) waits for a moment with
        no request to step (``run_idle_work``)."""
        return self.insight.has_backlog or self.insight.canary.has_pending

    def run_idle_work(self) -> bool:
        """Replay the sizing trackers' backlog and run one pending canary check (a recomputation of a
        cached prefix); False if nothing waited."""
        drained = self.insight.has_backlog
        if drained:  # a slice: the server's loop looks for new requests between calls
            self.insight.drain(budget_s=IDLE_SLICE_S)
        return self.insight.canary.run_one(self.model) or drained

    # ------------------------------------------------------------------------------ the cache's reports
    # (kvtier/insight/inspector.py: the answers of /v1/kv/*, the canary's quarantine)
    def quarantined(self) -> list[Medium]:
        return self.inspector.quarantined()

    def release_quarantine(self, media: Iterable[Medium]) -> list[Medium]:
        """Lift the quarantine of ``media`` (an admin call); returns those that were quarantined."""
        return self.inspector.release(media)

    def kv_canary(self) -> dict[str, Any]:
        return self.inspector.canary_report()

    def kv_advice(self, sentences: bool = True) -> dict[str, Any]:
        """Miss-ratio curves per tier, the measured hit ratios and sizing sentences."""
        return self.inspector.advice(sentences)

    def kv_blocks(self) -> tuple[dict[Medium, list[BlockHash]], int | None]:
        """Every block hash each medium holds, and the seq of the last event batch it reflects (None
        without events). Call between steps (``AsyncEngine.call``)."""
        return self.inspector.blocks()

    def kv_info(self) -> dict[str, Any]:
        """What a router needs to compute this engine's block hashes and to follow its events."""
        return self.inspector.info()

    def describe(self, limit: int) -> dict[str, Any]:
        """The live view of a dashboard: each device block's state and up to ``limit`` running and
        waiting sequences (``scheduler/inspection.py``). Call between steps (``AsyncEngine.call``)."""
        return {
            "replica_id": self.replica_id,
            "block_size": self.kv.block_size,
            "block_states": self.kv.block_map(),
            "requests": describe_requests(self.scheduler, limit),
        }

    # ------------------------------------------------------------------------------ stats
    def stats(self) -> EngineStats:
        """A snapshot of the engine's gauges and each tier's counters (see ``kvtier.stats``)."""
        kv, scheduler = self.kv, self.scheduler
        tiers = {Medium.DEVICE: kv.snapshot()}
        if self.tiers is not None:
            tiers.update((t.medium, t.snapshot(kv.block_size)) for t in self.tiers.tiers)
        admission = self.admission.kv
        return EngineStats(
            num_requests_running=len(scheduler.running),
            num_requests_waiting=len(scheduler.waiting),
            kv_cache_usage=kv.usage(),
            prefix_cache_queries=kv.stats.prefix_cache_queries,
            prefix_cache_hits=kv.stats.prefix_cache_hits,
            num_preemptions=dict(scheduler.preemptions_by_mode),
            prompt_tokens=self._num_prompt_tokens,
            generation_tokens=self._num_generation_tokens,
            tiers=tiers,
            canary_checks=self.insight.canary.checks_by_label(),
            mrc_hit_ratio=self.inspector.mrc_gauges(),
            kv_dtype=self.config.cache.kv_dtype,
            kv_block_bytes=self.config.cache.block_bytes,
            running_cap=scheduler.goodput.running_cap.cap(),
            num_seqs_waiting=scheduler.waiting_weight(),
            kv_demand_blocks=scheduler.kv_demand_blocks() if admission.enabled else 0,
            kv_admission_limit_blocks=admission.limit_blocks if admission.enabled else 0,
            kv_groups=tuple(
                KVGroupUsage(g, spec.kind, spec.window, len(spec.layers), in_use)
                for g, (spec, in_use) in enumerate(
                    zip(kv.layout.groups, kv.num_blocks_in_use_by_group(), strict=True)
                )
            ),
            retained_keys=0 if kv.pool.retention is None else len(kv.pool.retention),
            retained_hit_tokens=self._num_retained_hit_tokens,
        )

    # ------------------------------------------------------------------------------ shutdown
    def flush_tiers(self) -> None:
        """Copy every cached device block down to the host tier and every host block to disk, and
        wait for the writes: after this, a restarted engine on the same disk directory finds them."""
        if self.tiers is None or not self.tiers.persists:
            return  # nothing outlives the process without a disk tier
        for block_id, block_hash in self.kv.cached_blocks():
            self.tiers.store(block_id, block_hash, self.kv.pool.group_of(block_hash))  # its KV group's block
        self._move_blocks(self.tiers.take_plan())
        self.tiers.flush()

    def close(self) -> None:
        """Flush the tiers (a restart finds the blocks on disk) and stop their workers. Safe to
        call twice; the engine must not be stepped afterwards."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.tiers is not None:
                try:
                    self.flush_tiers()
                finally:
                    self.tiers.close()
        finally:
            if self.kv_events is not None:
                self.kv_events.close()  # the last events (the flush's stores) reach Redis first


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[tuple[int, ...]]:
    """Each bad word's token ids as written and after a space (vLLM's two spellings), once each."""
    found: list[tuple[int, ...]] = []
    for word in words:
        for text in (word.strip(), " " + word.strip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in found:
                found.append(ids)
    return found
