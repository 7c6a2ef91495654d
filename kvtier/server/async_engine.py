"""The bridge between asyncio and the single-threaded :class:`LLMEngine`.

::

    event loop thread                          engine thread (owns the LLMEngine)
    ─────────────────                          ─────────────────────────────────
    await add(prompt, params) ──► commands ──► add_request / abort_request / call(fn)
                                  (SimpleQueue) while work: step() → outputs, stats()
    RequestStream (asyncio.Queue) ◄── loop.call_soon_threadsafe(dispatch, outputs)
                                               idle: a canary check, the KV tiers' copies and
                                               finished writes (settle_tiers), else block on the
                                               command queue (a second at most with a disk or remote
                                               tier: their upkeep, settle_tiers)

Only the engine thread touches the engine: requests, aborts and inspection calls (``call(fn)``) go
through the command queue and run between two steps. After every step the thread takes one
``engine.stats()`` snapshot and publishes it (a single reference assignment) for ``/metrics`` and for
the admission check; an :class:`EngineObserver` (the Prometheus metrics) sees every step's outputs on
the engine thread. A stream that is closed before its request finished aborts the request, whose blocks
are then freed before the next step.

What the HTTP layer needs of the model itself, fixed when it has loaded, is copied onto the
``AsyncEngine`` then (``tokenizer``, ``max_model_len``; None before), so nothing outside the engine
thread holds the ``LLMEngine``.

Admission counts sequences, not API calls: a request with ``n`` completions weighs ``n`` in the queue
(``add(..., weight=n)``), so ``queue_depth()`` is the number of sequences waiting to start. It also
weighs KV blocks and the predicted wait: the engine decides as the request is handed over
(``add_request(..., admit=True)``, kvtier/scheduler/admission.py), and a refused one fails with
:class:`KVCapacityExceeded` or :class:`QueueWaitExceeded`.
A request's ``arrival_time`` (when the HTTP layer received it), ``priority`` and ``tenant`` go into the
engine with it: the scheduler orders by them and ``RequestOutput.metrics`` measures from that arrival.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kvtier.config import ConfigError
from kvtier.engine import LLMEngine
from kvtier.kv.retention import RetentionSpan
from kvtier.outputs import RequestOutput
from kvtier.prompt_input import PromptType
from kvtier.sampling_params import SamplingParams
from kvtier.stats import EngineStats
from kvtier.worker.structured import COMPILE_TIMEOUT_S, Grammars

if TYPE_CHECKING:
    from kvtier.kv.hashing import BlockHash
    from kvtier.tokenizer import Tokenizer

logger = logging.getLogger("kvtier.server")
T = TypeVar("T")
TIER_SETTLE_S = 0.02  # an idle engine with KV tier work looks at it this often (writes finishing)


class EngineNotReady(RuntimeError):
    """The model is still loading (or failed to load, or the engine has stopped)."""


class EngineDeadError(RuntimeError):
    """A step failed; the requests that were running in it are aborted."""


class RequestFailed(EngineDeadError):
    """This request alone ended with an error (its sampling failed, or its K/V was corrupt): raised on
    its stream only; the engine and every other request go on."""


class EngineObserver(Protocol):
    """Called on the engine thread (keep it cheap)."""

    def on_add(self, request_id: str, arrival_time: float) -> None: ...
    def on_abort(self, request_id: str) -> None: ...
    def on_step(self, outputs: list[RequestOutput], stats: EngineStats, now: float) -> None: ...


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    future: asyncio.Future[None]
    weight: int = 1  # sequences this request will run (its n)
    priority: int = 0
    tenant: str | None = None
    retention: tuple[RetentionSpan, ...] = ()  # prompt-cache retention (kvtier/kv/retention.py)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]


_STOP = object()


class RequestStream:
    """The outputs of one request, in step order; iterate it with ``async for``.

    Leaving ``async with stream:`` (or calling :meth:`abort`) before the final output aborts the request.
    """

    def __init__(self, owner: AsyncEngine, request_id: str):
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it has finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()


class AsyncEngine:
    """Owns an ``LLMEngine`` (built by ``factory`` on the engine thread) and serves it to asyncio code."""

    def __init__(
        self,
        factory: Callable[[], LLMEngine],
        *,
        observer: EngineObserver | None = None,
        max_queue: int | None = None,
        on_load_error: Callable[[BaseException], None] | None = None,
        on_ready: Callable[[LLMEngine], None] | None = None,
    ):
        self.max_queue = max_queue
        self.load_error: BaseException | None = None
        self.dead_error: BaseException | None = None  # what ended the engine thread outside a step
        # Set from the engine when the model has loaded (fixed from then on; read from any thread).
        self.tokenizer: Tokenizer | None = None
        self.max_model_len: int | None = None
        self.block_size: int | None = None  # tokens per KV block, once the model has loaded
        self.grammars: Grammars | None = None
        # the write-through shared tier's own key count, callable from any thread (/v1/kv/publish)
        self.shared_presence: Callable[[Sequence[BlockHash]], int | None] | None = None
        self._factory = factory
        self._observer = observer
        self._on_load_error = on_load_error
        self._on_ready = on_ready
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._loaded = threading.Event()
        self._engine: LLMEngine | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._num_submitted = 0  # weight of the adds sent (event loop thread)
        self._num_processed = 0  # weight of the adds taken from the queue (engine thread)
        # (latest stats, weight processed when it was taken, weight waiting in the scheduler):
        # replaced whole, read without a lock.
        self._snapshot: tuple[EngineStats | None, int, int] = (None, 0, 0)
        self._stopped = False

    # ----------------------------------------------------------------------------- lifecycle
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; the model loads there (``ready`` turns true when it is done)."""
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvtier-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (running requests end with ``EngineNotReady``)."""
        if self._thread is None or self._stopped:
            return
        self._stopped = True
        self._commands.put(_STOP)
        self._thread.join(timeout)

    @property
    def ready(self) -> bool:
        return self._engine is not None and not self._stopped

    @property
    def replica_id(self) -> str | None:
        """The engine's replica id (KV events, response ids); None before the model has loaded."""
        return self._engine.replica_id if self._engine is not None else None

    @property
    def loading(self) -> bool:
        return not self._loaded.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block (a plain thread, not the event loop) until the model has loaded or failed to."""
        self._loaded.wait(timeout)
        return self.ready

    @property
    def stats(self) -> EngineStats | None:
        """The snapshot taken after the latest step (None before the model has loaded)."""
        return self._snapshot[0]

    def queue_depth(self) -> int:
        """Sequences waiting: those in the scheduler's waiting queue (a prompt with ``n`` completions
        counts ``n``) plus those not handed to it yet."""
        _, processed, waiting = self._snapshot
        return waiting + self._num_submitted - processed

    def overloaded(self, num_new: int = 1) -> bool:
        return self.max_queue is not None and self.queue_depth() + num_new > self.max_queue

    def fits(self, num_new: int) -> bool:
        """Whether ``num_new`` sequences could ever be admitted (an empty queue would take them)."""
        return self.max_queue is None or num_new <= self.max_queue

    @property
    def num_active(self) -> int:
        """Requests added and not finished (their streams are open)."""
        return len(self._streams)

    def abort_all(self, exc: BaseException) -> None:
        """End every open stream with ``exc`` and abort its request (graceful shutdown's last step)."""
        ids = list(self._streams)
        self._fail(ids, exc)
        if not self._stopped:
            for rid in ids:
                self._commands.put(_Abort(rid))

    # ------------------------------------------------------------------ event loop thread API
    async def add(
        self,
        prompt: PromptType,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        weight: int = 1,
        priority: int = 0,
        tenant: str | None = None,
        retention: tuple[RetentionSpan, ...] = (),
    ) -> RequestStream:
        """Queue a request (``weight``: the sequences it runs, its ``n``); raises the engine's
        ``ConfigError`` for bad input and ``KVCapacityExceeded`` (nothing is queued then)."""
        if not self.ready:
            raise EngineNotReady(self.not_ready_reason())
        await self._compile_grammar(params)  # off the engine thread; pinned to params
        loop = asyncio.get_running_loop()
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        future: asyncio.Future[None] = loop.create_future()
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._num_submitted += weight
        add = _Add(
            request_id, prompt, params, cache_salt, arrival, future, weight, priority, tenant, retention
        )
        self._commands.put(add)
        try:
            await future
        except BaseException:
            self._streams.pop(request_id, None)
            stream.finished = True
            self._commands.put(_Abort(request_id))  # harmless when the engine rejected it
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if not self._stopped:
            self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result."""
        if not self.ready:
            raise EngineNotReady(self.not_ready_reason())
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._commands.put(_Call(fn, future))
        return await future

    def call_sync(self, fn: Callable[[LLMEngine], T], timeout: float | None = 30.0) -> T:
        """``call(fn)`` from a thread other than the event loop's (tests, benchmarks)."""
        assert self._loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(self.call(fn), self._loop).result(timeout)

    def not_ready_reason(self) -> str:
        if self.load_error is not None:
            return f"the model failed to load: {self.load_error}"
        if self.dead_error is not None:
            return f"the engine failed: {type(self.dead_error).__name__}: {self.dead_error}"
        return "the engine has stopped" if self._stopped else "the model is loading"

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Compile ``params``' structured output on a compile thread (never the engine's) and pin it
        to ``params``, so ``add_request`` finds it compiled; ConfigError when over a limit, invalid,
        or not compiled within ``COMPILE_TIMEOUT_S``."""
        if params.structured_outputs is None or self.grammars is None:
            return
        future = self.grammars.submit(params.structured_outputs)
        try:
            compiled = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), COMPILE_TIMEOUT_S)
        except TimeoutError:
            raise ConfigError(
                f"structured output: the grammar did not compile within {COMPILE_TIMEOUT_S:g} s"
            ) from None
        params.compiled_grammar = compiled

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if out.finished:
                del self._streams[out.request_id]
            if out.finished and out.error is not None:  # this request alone failed: its stream only
                stream._queue.put_nowait(RequestFailed(f"the request failed: {out.error}"))
                continue
            stream._queue.put_nowait(out)

    def _fail(self, request_ids: list[str] | None, exc: BaseException) -> None:
        ids = list(self._streams) if request_ids is None else request_ids
        for rid in ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._queue.put_nowait(exc)

    # ---------------------------------------------------------------------------- engine thread
    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
            self._loop.call_soon_threadsafe(fn, *args)

    @staticmethod
    def _resolve(future: asyncio.Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def _run(self) -> None:
        try:
            engine = self._factory()
        except BaseException as exc:
            logger.error("the model failed to load: %s", exc)
            self.load_error = exc
            self._loaded.set()
            if self._on_load_error is not None:
                self._on_load_error(exc)
            return
        self._snapshot = (engine.stats(), 0, 0)
        _ = engine.tokenizer.max_token_chars  # computed once here, not on the event loop
        self.tokenizer, self.max_model_len = engine.tokenizer, engine.max_model_len
        self.block_size = engine.block_size
        self.grammars = engine.grammars  # thread-safe compiles (kvtier/worker/structured.py)
        self.shared_presence = engine.tiers.shared_presence() if engine.tiers is not None else None
        self._engine = engine  # ready from here on
        self._loaded.set()
        if self._on_ready is not None:
            self._on_ready(engine)
        try:
            self._serve(engine)
        except BaseException as exc:  # a bug outside a step: end every stream, answer 503 from now on
            logger.exception("the engine thread failed; its requests are aborted and new ones refused")
            self.dead_error = exc
            self._stopped = True
            self._stop_all(EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}"))
        finally:
            engine.close()

    def _serve(self, engine: LLMEngine) -> None:
        while True:
            commands = self._next_commands(engine)
            for cmd in commands:
                if cmd is _STOP:
                    self._stop_all(EngineNotReady("the engine has stopped"))
                    return
                self._handle(engine, cmd)
            outputs: list[RequestOutput] = []
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as exc:
                    logger.exception("engine step failed; aborting its requests")
                    ids = list(engine.requests)
                    for rid in ids:
                        engine.abort_request(rid)
                    self._post(self._fail, ids, EngineDeadError(f"engine step failed: {exc}"))
            elif engine.has_idle_work:  # no request to step: the insight backlog or one canary check
                try:
                    engine.run_idle_work()
                except Exception:
                    logger.exception("idle work (cache insight) failed")
            elif engine.has_tier_work:  # the last step's copies, tier writes finishing
                try:
                    engine.settle_tiers()
                except Exception:
                    logger.exception("settling the KV tiers failed")
            now = time.monotonic()
            stats = engine.stats()
            if self._observer is not None:
                self._observer.on_step(outputs, stats, now)
            self._snapshot = (stats, self._num_processed, stats.num_seqs_waiting)
            if outputs:
                self._post(self._dispatch, outputs)
            elif stats.num_requests_running == 0 and engine.has_unfinished_requests():
                time.sleep(0.001)  # nothing schedulable this step: don't spin at full speed

    def _next_commands(self, engine: LLMEngine) -> list[Any]:
        """The commands waiting now; with nothing to step, block for the next one (at most
        ``TIER_SETTLE_S`` while the KV tiers have work, else until their next idle upkeep:
        ``LLMEngine.settle_tiers``)."""
        commands = []
        if not (engine.has_unfinished_requests() or engine.has_idle_work):
            timeout = TIER_SETTLE_S if engine.has_tier_work else engine.upkeep_in()
            try:
                commands.append(self._commands.get(timeout=timeout))
            except queue.Empty:
                return []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _stop_all(self, stopped: BaseException) -> None:
        self._post(self._fail, None, stopped)
        while True:  # commands sent after the stop: answer them instead of leaving them waiting
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add | _Call):
                self._post(self._resolve, cmd.future, None, stopped)

    def _handle(self, engine: LLMEngine, cmd: Any) -> None:
        if isinstance(cmd, _Add):
            self._num_processed += cmd.weight
            try:  # refused past capacity: KVCapacityExceeded / QueueWaitExceeded (503 + Retry-After)
                engine.add_request(
                    cmd.prompt,
                    cmd.params,
                    cmd.request_id,
                    cache_salt=cmd.cache_salt,
                    priority=cmd.priority,
                    tenant=cmd.tenant,
                    arrival_time=cmd.arrival_time,
                    admit=True,
                    retention=cmd.retention,
                )
            except Exception as exc:
                self._post(self._resolve, cmd.future, None, exc)
                return
            if self._observer is not None:
                self._observer.on_add(cmd.request_id, cmd.arrival_time)
            self._post(self._resolve, cmd.future, None)
        elif isinstance(cmd, _Abort):
            if engine.abort_request(cmd.request_id) and self._observer is not None:
                self._observer.on_abort(cmd.request_id)
        elif isinstance(cmd, _Call):
            try:
                result = cmd.fn(engine)
            except Exception as exc:
                self._post(self._resolve, cmd.future, None, exc)
            else:
                self._post(self._resolve, cmd.future, result)
