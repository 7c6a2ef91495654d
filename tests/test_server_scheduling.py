"""Admission and priorities through HTTP: the ``priority`` field, admission by KV capacity (503 +
Retry-After), the latency histograms and the KV-demand gauges on ``/metrics``, and request timings from
the HTTP arrival."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from kvtier.config import ConfigError, EngineArgs
from kvtier.engine import LLMEngine
from kvtier.sampling_params import SamplingParams
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.serve import BackgroundServer, serve_in_thread

MODEL = "test-model"


@pytest.fixture()
def loading() -> Iterator[TestClient]:
    """An app whose model never finishes loading: every answer comes from the HTTP layer's checks."""
    release = threading.Event()

    def factory():  # noqa: ANN202 - never returns an engine
        release.wait(30)
        raise ConfigError("model not found")

    with TestClient(create_app(factory, ServerSettings(model_name=MODEL))) as client:
        yield client
        release.set()


@pytest.mark.parametrize(
    ("priority", "code"),
    [("high", "invalid_type"), (1.5, "invalid_type"), (True, "invalid_type"), (2**40, "invalid_value")],
)
def test_a_bad_priority_is_a_400_naming_it(loading: TestClient, priority: object, code: str) -> None:
    for path, body in (
        ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = loading.post(path, json={**body, "priority": priority})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "priority" and err["code"] == code, err


def test_a_good_priority_passes_the_checks(loading: TestClient) -> None:
    r = loading.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "priority": -3})
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"  # past validation


def test_metrics_expose_the_latency_histograms_and_the_kv_demand(loading: TestClient) -> None:
    text = loading.get("/metrics").text
    for name in (
        "kvtier:request_queue_time_seconds_bucket",
        "kvtier:inter_token_latency_seconds_bucket",
        "kvtier:e2e_request_latency_seconds_bucket",
        "kvtier:time_to_first_token_seconds_bucket",
        "kvtier:kv_demand_blocks",
        "kvtier:kv_admission_limit_blocks",
        'kvtier:requests_rejected_total{reason="kv_capacity"}',
    ):
        assert name in text, name


# --------------------------------------------------------------------------- with a tiny real model
def _tiny_server(model_dir: Path, **engine: object) -> BackgroundServer:
    args = EngineArgs(model=str(model_dir), dtype="float32", num_threads=1, **engine)  # type: ignore[arg-type]
    srv = serve_in_thread(create_app(lambda: LLMEngine(args), ServerSettings(model_name=MODEL)))
    srv.wait_ready()
    return srv


def _hold_engine(srv: BackgroundServer) -> threading.Event:
    """Block the engine thread between two steps until the returned event is set."""
    gate = threading.Event()
    engine = srv.app.state.engine
    asyncio.run_coroutine_threadsafe(engine.call(lambda _: gate.wait(30)), engine._loop)
    return gate


def _wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.slow
def test_story_kv_admission_answers_503_with_retry_after(tiny_llama_dir: Callable[..., Path]) -> None:
    # 16 blocks of 16 tokens; admission above half the pool: 8 blocks of demand.
    srv = _tiny_server(tiny_llama_dir(), kv_device_blocks=16, kv_admission_factor=0.5)
    try:
        engine = srv.app.state.engine
        body = {"model": MODEL, "prompt": list(range(3, 23)), "max_tokens": 100, "ignore_eos": True}
        # Two requests needing 8 blocks each (20 + 100 tokens) reach the engine thread together.
        gate = _hold_engine(srv)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, srv.url + "/v1/completions", json=body, timeout=60)
            _wait_for(lambda: engine._num_submitted == 1)
            second = pool.submit(httpx.post, srv.url + "/v1/completions", json=body, timeout=60)
            _wait_for(lambda: engine._num_submitted == 2)
            gate.set()
            ok, refused = first.result(), second.result()
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 100
        # The first one alone fits (an idle server takes anything the model can hold); the second would
        # oversubscribe the cache.
        assert refused.status_code == 503, refused.text
        err = refused.json()["error"]
        assert err["code"] == "kv_capacity" and "8 blocks" in err["message"]
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'kvtier:requests_rejected_total{reason="kv_capacity"} 1.0' in metrics
        assert "kvtier:kv_admission_limit_blocks 8.0" in metrics
        # The cache drained: the same request is admitted now.
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        srv.stop()


@pytest.mark.slow
def test_story_a_request_that_would_wait_too_long_is_refused_at_once(
    tiny_llama_dir: Callable[..., Path],
) -> None:
    # The running batch holds one sequence, and a request that would wait more than 50 ms to start is
    # refused (kvtier/scheduler/goodput.py).
    srv = _tiny_server(tiny_llama_dir(), max_num_seqs=1, itl_factor=6.0, max_queue_wait_s=0.05)
    try:
        engine = srv.app.state.engine
        long = {"model": MODEL, "prompt": list(range(3, 23)), "max_tokens": 200, "ignore_eos": True}
        # Both reach the engine thread together: the first takes the one place, the second would
        # wait for its 200 tokens.
        gate = _hold_engine(srv)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, srv.url + "/v1/completions", json=long, timeout=120)
            _wait_for(lambda: engine._num_submitted == 1)
            second = pool.submit(httpx.post, srv.url + "/v1/completions", json={**long, "max_tokens": 4})
            _wait_for(lambda: engine._num_submitted == 2)
            gate.set()
            refused = second.result()
            assert refused.status_code == 503, refused.text
            err = refused.json()["error"]
            assert err["code"] == "queue_wait" and "--max-queue-wait-s 0.05" in err["message"]
            assert 1 <= int(refused.headers["retry-after"]) <= 60
            assert first.result().status_code == 200
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'kvtier:requests_rejected_total{reason="queue_wait"} 1.0' in metrics
        assert "kvtier:running_cap 1.0" in metrics  # at most --max-num-seqs
        # Nothing runs now: the same request starts at once.
        short = {**long, "max_tokens": 4}
        assert httpx.post(srv.url + "/v1/completions", json=short, timeout=60).status_code == 200
    finally:
        srv.stop()


@pytest.mark.slow
def test_request_timings_start_at_the_callers_arrival(tiny_llama_dir: Callable[..., Path]) -> None:
    engine = LLMEngine(EngineArgs(model=str(tiny_llama_dir()), dtype="float32", num_threads=1))
    try:
        arrival = time.monotonic() - 5.0  # it reached the HTTP layer 5 s ago
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=3), "r", priority=2, arrival_time=arrival)
        assert engine.scheduler.waiting[0].priority == 2
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        assert final is not None and final.finished
        m = final.metrics
        assert m["arrival_time"] == arrival and m["queue_time"] >= 5.0 and m["ttft"] >= 5.0
        assert (
            m["first_scheduled_time"] <= m["first_token_time"] <= m["last_token_time"] <= m["finished_time"]
        )
        assert m["prefill_time"] >= 0 and m["e2e"] >= m["ttft"]
    finally:
        engine.close()
