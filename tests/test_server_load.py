"""The server under load (loopback only, bounded): 64 concurrent streaming clients, the ``--max-queue``
limit, the API key, and ``kvtier serve`` itself as a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import torch
from openai import AsyncOpenAI

from kvtier import LLM
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.serve import BackgroundServer, serve_in_thread

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENGINE = dict(kv_device_blocks=256, max_num_seqs=32, num_threads=1)  # 64 clients: two waves
WORDS = ["cache", "block", "tier", "host", "disk", "device", "prefix", "token", "memory", "page", "swap"]


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    threads = torch.get_num_threads()
    settings = ServerSettings(model_name=MODEL, api_key=KEY)
    srv = serve_in_thread(create_app(lambda: LLM(**ENGINE).engine, settings))
    srv.wait_ready()
    yield srv
    srv.stop()
    torch.set_num_threads(threads)


def metric(server: BackgroundServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def assert_idle(server: BackgroundServer) -> None:
    def check(engine) -> tuple[float, bool, int]:  # noqa: ANN001
        engine.kv.check_integrity()
        return engine.kv.usage(), engine.has_unfinished_requests(), len(engine.scheduler.waiting)

    assert server.app.state.engine.call_sync(check) == (0.0, False, 0)
    assert metric(server, "kvtier:num_requests_running") == 0
    assert metric(server, "kvtier:num_requests_waiting") == 0


def test_64_concurrent_streaming_clients(server: BackgroundServer) -> None:
    rng = random.Random(7)
    jobs = [(" ".join(rng.choices(WORDS, k=rng.randint(3, 40))), rng.randint(2, 12)) for _ in range(64)]
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)

    async def one(i: int, prompt: str, max_tokens: int) -> tuple[int, int, str | None]:
        chat = i % 2 == 0
        kw = dict(
            model=MODEL,
            max_tokens=max_tokens,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        if chat:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": prompt}], **kw
            )
        else:
            stream = await client.completions.create(prompt=prompt, **kw)
        finish, usage = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        return max_tokens, usage.completion_tokens, finish

    async def all_jobs() -> list[tuple[int, int, str | None]]:
        try:
            return await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(jobs)))
        finally:
            await client.close()

    # A deadline for a hang, not a speed target: on a busy 2-core machine this takes minutes.
    results = asyncio.run(asyncio.wait_for(all_jobs(), timeout=600))
    assert [(n, "length") for n, _, _ in results] == [(got, finish) for _, got, finish in results]
    assert_idle(server)
    assert metric(server, 'kvtier:request_success_total{finished_reason="length"}') >= 64


def test_max_queue_overflow_gets_503_and_the_admitted_complete(server: BackgroundServer) -> None:
    """With --max-queue 4: the engine thread is held between two steps (a blocking ``call``), so the
    first 4 requests wait in the queue; then every further request is turned away with a 503 at
    once. Released, the engine completes the 4 admitted ones."""
    engine = server.app.state.engine
    body = {"model": MODEL, "prompt": "Tell me about tiers", "max_tokens": 6, "ignore_eos": True}
    rejected_before = metric(server, 'kvtier:requests_rejected_total{reason="queue_full"}')
    held, release = threading.Event(), threading.Event()

    def hold(_engine: object) -> None:
        held.set()
        release.wait(120)

    async def wait_for(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.01)

    async def post_turned_away(c: httpx.AsyncClient) -> httpx.Response | None:
        """A 503 comes at once; an admitted request would wait for the held engine (None)."""
        try:
            return await c.post("/v1/completions", json=body, timeout=30)
        except httpx.ReadTimeout:
            return None

    async def fire() -> tuple[list[httpx.Response], list[httpx.Response | None]]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as c:
            admitted = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(4)]
            await wait_for(lambda: engine.queue_depth() == 4, "the 4 requests never reached the queue")
            turned_away = [await post_turned_away(c) for _ in range(3)]
            release.set()
            return list(await asyncio.gather(*admitted)), turned_away

    holder = threading.Thread(target=engine.call_sync, args=(hold, 150))
    holder.start()
    engine.max_queue = 4
    try:
        assert held.wait(60), "the engine thread never ran the blocking call"
        ok, busy = asyncio.run(fire())
    finally:
        release.set()
        engine.max_queue = None
        holder.join(150)
    assert [r.status_code if r is not None else "admitted" for r in busy] == [503] * 3
    assert [r.status_code for r in ok] == [200] * 4
    for r in busy:
        assert r is not None and r.headers["retry-after"] and r.json()["error"]["code"] == "queue_full"
    assert all(r.json()["usage"]["completion_tokens"] == 6 for r in ok)
    rejected = metric(server, 'kvtier:requests_rejected_total{reason="queue_full"}') - rejected_before
    assert rejected == len(busy)
    assert_idle(server)


def test_api_key_required(server: BackgroundServer) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert httpx.post(server.url + "/v1/completions", json=body, headers=AUTH).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_kvtier_serve_command(server: BackgroundServer) -> None:
    """The real CLI: free port, key, a chat request answered like the in-process server answers it,
    then Ctrl-C ends it cleanly (no traceback)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", "--port", "0", "--api-key", KEY, "--max-queue", "8"]
    cmd += ["--kv-device-blocks", "64", "--num-threads", "1", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()
        url = re.search(r"on (http://\S+) ", line).group(1)
        deadline = time.monotonic() + 120
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        body |= {"temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200
        got = json.loads(r.text)
        assert got["model"] == MODEL and got["usage"]["completion_tokens"] == 3
        assert got["choices"][0]["finish_reason"] == "length"
        want = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        assert got["choices"][0]["message"]["content"] != ""
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"] > 0
        proc.send_signal(signal.SIGINT)
        # A clean stop: uvicorn re-raises the captured SIGINT after its graceful shutdown (130), unless
        # the shutdown completes before it does (0). Either way, no traceback.
        assert proc.wait(30) in (0, 130)
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kvtier_serve_bad_model_is_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "serve", "--model", "/nonexistent/model.gguf"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("kvtier: error: model not found") and proc.stderr.count("\n") == 1
