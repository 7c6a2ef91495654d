"""Hostile traffic for ``kvtier bench serve --hostile``, mixed into the normal load of every rate.

::

    oversized   a POST announcing a 20 MB body (and sending its first 64 KiB), once a second: want 413
    n at limit  a non-streaming completion with n = --hostile-n (the server's --max-n), every 2 s
    slow        --hostile-slow connections sending their headers a byte every 0.5 s (reopened when the
                server closes them: --timeout-header)
    grammar     a guided_choice of GRAMMAR_CHOICES entries with n = --hostile-n, every 3 s: its compile
                must not pause the other streams (want 200)
    non-finite  temperature 1e300 with min_tokens, repetition_penalty 1e-300, each every 2 s: want 400
                (none may end the other requests)
    empty flood a chat of EMPTY_MESSAGES empty messages, every 2 s: want 400, and /health stays fast
    /health     polled every 50 ms from its own thread (its own connection): latency p50/p99/max

The normal requests' TTFT is what the bench reports as usual; compare it with a clean run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

OVERSIZED_BYTES = 20_000_000
GRAMMAR_CHOICES = 8_000  # under the server's limits (8192 entries, 64 KiB): compiled, not refused
EMPTY_MESSAGES = 127_000
NON_FINITE = (
    {"prompt": "Hi", "temperature": 1e300, "min_tokens": 3, "max_tokens": 8},
    {"prompt": "Hi", "repetition_penalty": 1e-300, "max_tokens": 8},
)


@dataclass
class HostileStats:
    statuses: Counter[str] = field(default_factory=Counter)  # "oversized 413", "n 200", "slow closed", ...
    health: list[float] = field(default_factory=list)  # seconds per /health answer
    health_errors: int = 0

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.health)

        def pick(q: float) -> float:
            return lat[min(len(lat) - 1, int(len(lat) * q))] * 1e3 if lat else float("nan")

        return {
            "health_polls": len(lat),
            "health_errors": self.health_errors,
            "health_p50_ms": pick(0.5),
            "health_p99_ms": pick(0.99),
            "health_max_ms": lat[-1] * 1e3 if lat else float("nan"),
            "answers": dict(self.statuses),
        }


KINDS = ("oversized", "n", "slow", "grammar", "non-finite", "empty")  # --hostile-kinds


class Hostile:
    """``async with Hostile(url, model, ...)``: hostile traffic runs until the block ends (``kinds``: a
    subset of ``KINDS``, default all)."""

    def __init__(
        self,
        url: str,
        model: str,
        n: int,
        slow: int,
        headers: dict[str, str],
        stats: HostileStats,
        kinds: tuple[str, ...] = KINDS,
    ):
        self.url, self.model, self.headers, self.stats = url, model, headers, stats
        self.n, self.slow, self.kinds = n, slow, kinds
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = threading.Event()
        self._health = threading.Thread(target=self._poll_health, daemon=True)

    async def __aenter__(self) -> Hostile:
        self._health.start()
        senders = {
            "oversized": self._oversized,
            "n": self._n_at_limit,
            "grammar": self._huge_grammar,
            "non-finite": self._non_finite,
            "empty": self._empty_flood,
        }
        self._tasks = [asyncio.create_task(send()) for kind, send in senders.items() if kind in self.kinds]
        if "slow" in self.kinds:
            self._tasks += [asyncio.create_task(self._slow_connection()) for _ in range(self.slow)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._stop.set()
        self._health.join()

    def _poll_health(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self._stop.wait(0.05):
                start = time.perf_counter()
                try:
                    ok = client.get("/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.stats.health.append(time.perf_counter() - start)
                self.stats.health_errors += not ok

    async def _oversized(self) -> None:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {OVERSIZED_BYTES}\r\n"
        )
        head += "".join(f"{k}: {v}\r\n" for k, v in self.headers.items()) + "\r\n"
        while True:
            reader, writer = await asyncio.open_connection(self.host, self.port)
            try:
                writer.write(head.encode() + b'{"prompt": "' + b"x" * 65536)
                with contextlib.suppress(ConnectionError):
                    await writer.drain()
                status = (await asyncio.wait_for(reader.readline(), 30)).split(b" ")[1:2]
                self.stats.statuses[f"oversized {b''.join(status).decode() or 'closed'}"] += 1
            except (ConnectionError, TimeoutError):
                self.stats.statuses["oversized closed"] += 1
            finally:
                writer.close()
            await asyncio.sleep(1.0)

    async def _n_at_limit(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "n": self.n, "max_tokens": 16}
        async with httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=None) as client:
            while True:
                r = await client.post("/v1/completions", json=body)
                self.stats.statuses[f"n={self.n} {r.status_code}"] += 1
                await asyncio.sleep(2.0)

    async def _post_every(self, label: str, path: str, bodies: list[dict[str, Any]], every_s: float) -> None:
        """POST each of ``bodies`` in turn, one every ``every_s`` seconds, counting the answers. Each body
        is encoded once: the load generator shares the server's cores, and encoding a 4 MB flood every
        time would cost the normal requests CPU the server never spent."""
        payloads = [json.dumps({"model": self.model, **body}).encode() for body in bodies]
        headers = {**self.headers, "content-type": "application/json"}
        async with httpx.AsyncClient(base_url=self.url, headers=headers, timeout=None) as client:
            while True:
                for payload in payloads:
                    try:
                        answer = await client.post(path, content=payload)
                        status = str(answer.status_code)
                    except httpx.HTTPError as exc:
                        status = type(exc).__name__
                    self.stats.statuses[f"{label} {status}"] += 1
                    await asyncio.sleep(every_s)

    async def _huge_grammar(self) -> None:
        choices = [f"c{i}" for i in range(GRAMMAR_CHOICES)]
        body = {"prompt": "Pick one:", "guided_choice": choices, "n": self.n, "max_tokens": 8}
        await self._post_every("grammar", "/v1/completions", [body], 3.0)

    async def _non_finite(self) -> None:
        await self._post_every("non-finite", "/v1/completions", [dict(b) for b in NON_FINITE], 2.0)

    async def _empty_flood(self) -> None:
        body = {"messages": [{"role": "user", "content": ""}] * EMPTY_MESSAGES, "max_tokens": 8}
        await self._post_every("empty flood", "/v1/chat/completions", [body], 2.0)

    async def _slow_connection(self) -> None:
        request = f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Length: 10\r\n\r\n"
        while True:
            reader, writer = await asyncio.open_connection(self.host, self.port)
            try:
                for byte in request.encode():
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(0.5)
                    if reader.at_eof():
                        break
                self.stats.statuses["slow closed by the server" if reader.at_eof() else "slow sent"] += 1
            except ConnectionError:
                self.stats.statuses["slow closed by the server"] += 1
            finally:
                writer.close()
