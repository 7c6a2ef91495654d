"""The asyncio ↔ engine-thread bridge, without HTTP and without a model: a fake engine that emits one
numbered token per step and records which thread called it."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from kvtier.config import ConfigError
from kvtier.outputs import CompletionOutput, RequestOutput
from kvtier.sampling_params import SamplingParams
from kvtier.server.async_engine import AsyncEngine, EngineDeadError, EngineNotReady
from kvtier.stats import EngineStats


class FakeEngine:
    def __init__(self, step_s: float = 0.002):
        self.step_s = step_s
        self.requests: dict[str, tuple[int, list[int]]] = {}  # id -> (max_tokens, tokens)
        self.threads: set[str] = set()
        self.fail_next_step = False
        self.closed = False
        self.tokenizer = SimpleNamespace(max_token_chars=1)  # AsyncEngine copies these three when loaded
        self.max_model_len = 64
        self.block_size = 16
        self.grammars = None  # no structured output
        self.has_idle_work = False  # no canary checks waiting (kvtier/insight)
        self.has_tier_work = False  # no KV tier copies or writes pending
        self.tiers = None  # no KV tiers (so no shared tier for /v1/kv/publish)

    def upkeep_in(self) -> float | None:
        return None  # no tier below the host to look after while idle

    def _touch(self) -> None:
        self.threads.add(threading.current_thread().name)

    def add_request(self, prompt, params, request_id=None, cache_salt=None, **scheduling) -> str:  # noqa: ANN001
        self._touch()
        if prompt == "bad":
            raise ConfigError("the prompt is bad")
        self.requests[request_id] = (params.max_tokens, [])
        return request_id

    def abort_request(self, request_id: str) -> bool:
        self._touch()
        return self.requests.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        self._touch()
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self._touch()
        time.sleep(self.step_s)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        outs = []
        for rid, (max_tokens, tokens) in list(self.requests.items()):
            tokens.append(len(tokens))
            done = len(tokens) >= max_tokens
            completion = CompletionOutput(
                0,
                "".join(map(str, tokens)),
                list(tokens),
                "length" if done else None,
                text_delta=str(tokens[-1]),
            )
            outs.append(RequestOutput(rid, None, [1], [completion], done))
            if done:
                del self.requests[rid]
        return outs

    def stats(self) -> EngineStats:
        self._touch()
        return EngineStats(len(self.requests), 0, 0.0, 0, 0, {}, 0, 0, {})

    def close(self) -> None:
        self.closed = True


def run(coro_fn, engine: FakeEngine | None = None, **kwargs):  # noqa: ANN001, ANN201
    """Start an AsyncEngine over ``engine`` in a fresh event loop, run ``coro_fn(async_engine)``, stop it."""
    fake = engine or FakeEngine()

    async def main():  # noqa: ANN202
        ae = AsyncEngine(lambda: fake, **kwargs)
        ae.start()
        await asyncio.to_thread(ae.wait_ready, 10)
        try:
            return await coro_fn(ae)
        finally:
            await asyncio.to_thread(ae.shutdown)

    result = asyncio.run(main())
    assert fake.threads <= {"kvtier-engine"}, fake.threads
    return result


def test_outputs_arrive_in_order_and_the_engine_is_only_touched_by_its_thread() -> None:
    async def go(ae: AsyncEngine) -> list[list[str]]:
        async def one(n: int) -> list[str]:
            stream = await ae.add("p", SamplingParams(max_tokens=n))
            async with stream:
                return [out.outputs[0].text_delta async for out in stream]

        return await asyncio.gather(*(one(n) for n in (1, 5, 3)))

    assert run(go) == [["0"], ["0", "1", "2", "3", "4"], ["0", "1", "2"]]


def test_the_model_facts_are_copied_when_it_has_loaded() -> None:
    fake = FakeEngine()
    before = AsyncEngine(lambda: fake)
    assert (before.tokenizer, before.max_model_len) == (None, None)

    async def go(ae: AsyncEngine) -> tuple[object, int | None]:
        return ae.tokenizer, ae.max_model_len

    assert run(go, fake) == (fake.tokenizer, 64)


def test_bad_input_raises_and_queues_nothing() -> None:
    async def go(ae: AsyncEngine) -> int:
        with pytest.raises(ConfigError, match="bad"):
            await ae.add("bad", SamplingParams())
        return await ae.call(lambda e: len(e.requests))

    assert run(go) == 0


def test_closing_a_stream_early_aborts_its_request() -> None:
    async def go(ae: AsyncEngine) -> tuple[int, str]:
        stream = await ae.add("p", SamplingParams(max_tokens=10_000))
        async with stream:
            async for _ in stream:
                break
        await asyncio.sleep(0.05)
        left = await ae.call(lambda e: len(e.requests))
        return left, await ae.call(lambda e: threading.current_thread().name)

    assert run(go) == (0, "kvtier-engine")


def test_a_failed_step_fails_its_requests_and_the_engine_keeps_serving() -> None:
    fake = FakeEngine()

    async def go(ae: AsyncEngine) -> list[str]:
        stream = await ae.add("p", SamplingParams(max_tokens=1000))
        await ae.call(lambda e: setattr(e, "fail_next_step", True))
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        again = await ae.add("p", SamplingParams(max_tokens=2))
        return [out.outputs[0].text async for out in again]

    assert run(go, fake) == ["0", "01"]


def test_a_failure_outside_a_step_ends_every_stream_and_refuses_new_requests() -> None:
    """A bug in the engine thread's own bookkeeping (here: the stats after a step raise) must not leave
    streams waiting forever: they end with EngineDeadError, and new requests get EngineNotReady (503)."""
    fake = FakeEngine()

    async def go(ae: AsyncEngine) -> None:
        stream = await ae.add("p", SamplingParams(max_tokens=1000))
        await ae.call(lambda e: setattr(e, "stats", _raise))
        with pytest.raises(EngineDeadError, match="engine failed: RuntimeError: stats broke"):
            async for _ in stream:
                pass
        assert not ae.ready
        with pytest.raises(EngineNotReady, match="engine failed"):
            await ae.add("p", SamplingParams(max_tokens=2))

    run(go, fake)
    assert fake.closed


def _raise() -> None:
    raise RuntimeError("stats broke")


def test_queue_limit_and_stopped_engine() -> None:
    async def go(ae: AsyncEngine) -> None:
        assert ae.queue_depth() == 0
        assert not ae.overloaded(2)
        assert ae.overloaded(3)
        await asyncio.to_thread(ae.shutdown)
        with pytest.raises(EngineNotReady, match="stopped"):
            await ae.add("p", SamplingParams())

    run(go, max_queue=2)


def test_load_failure_is_reported() -> None:
    seen: list[BaseException] = []

    def factory() -> FakeEngine:
        raise ConfigError("model not found: 'nope'")

    async def go() -> None:
        ae = AsyncEngine(factory, on_load_error=seen.append)
        ae.start()
        assert not await asyncio.to_thread(ae.wait_ready, 10)
        assert not ae.loading and isinstance(ae.load_error, ConfigError)
        with pytest.raises(EngineNotReady, match="failed to load"):
            await ae.add("p", SamplingParams())

    asyncio.run(go())
    assert len(seen) == 1
