"""The multi-round chat workload of ``kvtier bench cluster`` and its streaming HTTP client.

Like LMCache's multi-round QA benchmark: ``U`` users, each one conversation of ``R`` rounds. Every
conversation starts with one system prompt shared by all users and a document of its own; each round
adds a question, and the model's streamed answer joins the history, so a returning user's prompt is
the whole conversation so far (chat messages: the router and the replicas render the template).
Users run as concurrent tasks, each waiting for its answer before asking again (a user thinks for
``think_s``); at most ``concurrency`` requests are in flight at once. Users start one after another
(``stagger_s`` apart), so the rounds of different users interleave as on a real service.

Every request is measured on the client: time to first token (first content chunk), the gaps between
content chunks (ITL), and the usage the server reports (prompt tokens, cached tokens per tier).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvtier.bench.multiturn import WORDS

TIERS = ("device", "host", "disk", "remote")
REPLICA_HEADER = "x-kvtier-replica"  # the router's answer to "who served this" (when it sends one)


@dataclass(frozen=True)
class WorkloadSpec:
    users: int
    rounds: int
    system_tokens: int
    doc_tokens: int
    question_tokens: int
    answer_tokens: int
    concurrency: int
    stagger_s: float = 0.5
    think_s: float = 0.0
    seed: int = 0


@dataclass
class Conversation:
    user: int
    system: str
    document: str
    questions: list[str]
    answers: list[str] = field(default_factory=list)

    def messages(self, round_: int) -> list[dict[str, str]]:
        """The chat of round ``round_`` (0-based): the history of the earlier rounds + its question."""
        first = f"Document {self.user}:\n{self.document}\n\n{self.questions[0]}"
        msgs = [{"role": "system", "content": self.system}, {"role": "user", "content": first}]
        for r in range(1, round_ + 1):
            msgs += [
                {"role": "assistant", "content": self.answers[r - 1]},
                {"role": "user", "content": self.questions[r]},
            ]
        return msgs


def _text(rng: random.Random, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of text (SmolLM2's tokenizer: ~1.1 tokens per word of this list)."""
    words = [rng.choice(WORDS) for _ in range(max(4, int(n_tokens / 1.1)))]
    return " ".join(words).capitalize() + "."


def build_conversations(spec: WorkloadSpec) -> list[Conversation]:
    rng = random.Random(spec.seed)
    system = "You are a careful assistant. Answer from the document. " + _text(rng, spec.system_tokens)
    return [
        Conversation(
            user,
            system,
            _text(rng, spec.doc_tokens),
            [f"Question {r + 1}: {_text(rng, spec.question_tokens)}" for r in range(spec.rounds)],
        )
        for user in range(spec.users)
    ]


@dataclass
class Record:
    """One request as the client saw it."""

    user: int
    round: int  # 0-based; round >= 1 is a returning user
    start: float  # seconds since the run started
    end: float = 0.0
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    replica: str | None = None  # from the router's header, when it sends one
    text: str = ""

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached_tokens


async def chat_request(
    client: httpx.AsyncClient, messages: list[dict[str, str]], max_tokens: int, rec: Record, t0: float
) -> None:
    """Stream one chat completion into ``rec`` (greedy, ``ignore_eos``: a fixed answer length)."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t_start = time.perf_counter()
    last: float | None = None
    parts: list[str] = []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            rec.replica = r.headers.get(REPLICA_HEADER)
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.error = str(chunk["error"].get("message"))[:200]
                    return
                if chunk.get("usage"):
                    _read_usage(chunk["usage"], rec)
                text = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices", []))
                if text:
                    now = time.perf_counter()
                    if last is None:
                        rec.ttft = now - t_start
                    else:
                        rec.itls.append(now - last)
                    last = now
                    parts.append(text)
        rec.text = "".join(parts)
        rec.ok = rec.ttft is not None and rec.prompt_tokens > 0
        if not rec.ok:
            rec.error = "stream ended without content or usage"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        rec.end = time.perf_counter() - t0


def _read_usage(usage: dict[str, Any], rec: Record) -> None:
    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    by_tier = ((usage.get("kvtier") or {}).get("cached_tokens_by_tier")) or {}
    rec.by_tier = {t: int(by_tier.get(t, 0)) for t in TIERS}


Hook = Callable[[list[Record], float], Awaitable[None]]


async def run_workload(
    base_url: str,
    spec: WorkloadSpec,
    convs: list[Conversation],
    on_progress: Hook | None = None,
    timeout_s: float = 600.0,
) -> tuple[list[Record], float]:
    """Every user's rounds against ``base_url``; ``(records, seconds)``. ``on_progress(records, now)``
    runs after every finished request (the scenarios kill and start processes from it). A failed
    request's answer is left empty in the history; the user goes on with the next round."""
    records: list[Record] = []
    gate = asyncio.Semaphore(spec.concurrency)
    limits = httpx.Limits(max_connections=spec.concurrency + 4, max_keepalive_connections=spec.concurrency)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:

        async def user_task(conv: Conversation) -> None:
            await asyncio.sleep(conv.user * spec.stagger_s)
            for round_ in range(spec.rounds):
                async with gate:
                    rec = Record(conv.user, round_, time.perf_counter() - t0)
                    records.append(rec)
                    await chat_request(client, conv.messages(round_), spec.answer_tokens, rec, t0)
                conv.answers.append(rec.text)
                if on_progress is not None:
                    await on_progress(records, time.perf_counter() - t0)
                if spec.think_s:
                    await asyncio.sleep(spec.think_s)

        await asyncio.gather(*(user_task(c) for c in convs))
    return records, time.perf_counter() - t0


async def probe_latency(client: httpx.AsyncClient, messages: list[dict[str, str]]) -> float:
    """Seconds for one short non-streamed chat completion (one token): the router-overhead probe."""
    body = {"messages": messages, "max_tokens": 1, "temperature": 0.0}
    t = time.perf_counter()
    r = await client.post("/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - t
    r.raise_for_status()
    return elapsed
