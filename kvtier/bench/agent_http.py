"""``kvtier bench agent --url URL | --cluster``: the agent workload of :mod:`.agent` as a client sees it.

The agents send real ``POST /v1/messages`` requests, streamed: a system prompt of about
``--system-tokens`` words, one tool, and the history; each step's answer (text, or a ``tool_use`` that
the next step answers with a ``tool_result`` block) joins the history with the tool's result after
``--pause-s``. The retention run marks the last block with ``cache_control`` (the top-level marker of
Anthropic's current SDK: the whole prompt kept five minutes); the baseline run sends none. Unrelated
prompts of about ``--pressure-tokens`` words go to ``/v1/completions``, ``--pressure-concurrency`` in
flight. TTFT is measured here, from sending a step to its first streamed token (``message_start`` goes
out with it); the prompt tokens by tier are the answers' own usage (``cache_read_input_tokens`` and
``kvtier_cache_read_by_tier``).

Where it runs::

    --url URL    one running server (or router): both runs against it, baseline first, each with
                 prompts of its own (nothing shared between the runs; its cache is not emptied)
    --cluster    per run, a fresh cluster (kvtier/bench/cluster_procs.py): a redis-server, --replicas
                 ``kvtier serve`` replicas sharing it as their remote tier, with the engine flags given
                 here, behind ``kvtier router`` (cache_aware); torn down after the run

Prompts are words of a small English list (about one token each with a BPE vocabulary); the table counts
real tokens from the usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench.agent_report import RunResult, print_table, write_json
from kvtier.bench.cluster_procs import Cluster, ReplicaSettings
from kvtier.config import ConfigError

_VOCABULARY = (
    "the cache keeps every block of prompt that came before and a tool reads file then writes short "
    "answer about state each server in region with its memory disk network load when an agent plans "
    "next step it asks for more data from store or queue waits"
)
WORDS = tuple(_VOCABULARY.split())  # prompts are random words of these (about a token each)
TOOL = {
    "name": "run_tool",
    "description": "Run a tool of the agent's environment and return its output.",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}


def text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


@dataclass
class _Agent:
    system: str
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Step:
    """One streamed answer: its TTFT, its content blocks and its final usage."""

    ttft_s: float | None = None
    blocks: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)


def _apply(step: _Step, kind: str, data: dict[str, Any], started: float) -> None:
    """One server-sent event of a /v1/messages stream into ``step``."""
    if kind in ("message_start", "content_block_delta") and step.ttft_s is None:
        step.ttft_s = time.perf_counter() - started
    if kind == "content_block_start":
        step.blocks.append(dict(data["content_block"], partial=""))
    elif kind == "content_block_delta":
        delta, block = data["delta"], step.blocks[-1]
        block["partial"] += delta.get("text") or delta.get("partial_json") or ""
    elif kind == "message_delta":
        step.usage = data.get("usage") or {}
    elif kind == "error":
        raise RuntimeError(f"the server ended the stream with an error: {data}")


async def _stream_step(client: httpx.AsyncClient, body: dict[str, Any]) -> _Step:
    step, kind = _Step(), ""
    started = time.perf_counter()
    async with client.stream("POST", "/v1/messages", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/v1/messages answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                _apply(step, kind, json.loads(line.removeprefix("data: ")), started)
    return step


def _turns(step: _Step, result: str) -> list[dict[str, Any]]:
    """The assistant's answer as the history keeps it, and the user turn with the tool's result: a
    ``tool_result`` block per call, or plain text after a text answer."""
    content, results = [], []
    for block in step.blocks:
        partial = block.pop("partial")
        if block["type"] == "text":
            content.append({"type": "text", "text": partial or "ok"})
        elif block["type"] == "tool_use":
            try:
                block["input"] = json.loads(partial) if partial else {}
            except ValueError:
                block["input"] = {}
            content.append(block)
            results.append({"type": "tool_result", "tool_use_id": block["id"], "content": result})
    content = content or [{"type": "text", "text": "ok"}]
    return [
        {"role": "assistant", "content": content},
        {"role": "user", "content": results or f"Tool output: {result}"},
    ]


class HttpRun:
    """One run against ``url``: the agents' loops and the unrelated traffic, until every agent is done."""

    def __init__(self, url: str, ns: argparse.Namespace, retain: bool, label: str, seed: int) -> None:
        self.url, self.ns, self.retain = url, ns, retain
        self.rng = random.Random(seed)
        self.agents = [
            _Agent(
                f"Run {seed}, agent {i}. You call tools to finish tasks. " + text(self.rng, ns.system_tokens)
            )
            for i in range(ns.agents)
        ]
        self.result = RunResult(label)
        self.headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
        self.model: str | None = None

    async def run(self) -> RunResult:
        async with httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=600) as client:
            models = await client.get("/v1/models")
            models.raise_for_status()
            self.model = models.json()["data"][0]["id"]
            done = asyncio.Event()
            pressure = [
                asyncio.create_task(self._pressure(client, done)) for _ in range(self.ns.pressure_concurrency)
            ]
            start = time.perf_counter()
            try:
                await asyncio.gather(*(self._agent(client, a) for a in self.agents))
            finally:
                self.result.seconds = time.perf_counter() - start
                done.set()
                for task in pressure:
                    task.cancel()
                await asyncio.gather(*pressure, return_exceptions=True)
        return self.result

    def _body(self, agent: _Agent) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.ns.answer_tokens,
            "temperature": 0.0,
            "stream": True,
            "system": [{"type": "text", "text": agent.system}],
            "tools": [TOOL],
            "messages": agent.messages,
        }
        if self.retain:
            body["cache_control"] = {"type": "ephemeral"}  # the last block: the whole prompt, 5 minutes
        return body

    async def _agent(self, client: httpx.AsyncClient, agent: _Agent) -> None:
        agent.messages = [{"role": "user", "content": "Task: " + text(self.rng, 24)}]
        for i in range(self.ns.steps):
            step = await _stream_step(client, self._body(agent))
            if i > 0:
                self._record(step)
            await asyncio.sleep(self.ns.pause_s)
            agent.messages += _turns(step, text(self.rng, self.ns.result_tokens))

    def _record(self, step: _Step) -> None:
        r, u = self.result, step.usage
        r.agent_ttft_s.append(step.ttft_s if step.ttft_s is not None else float("nan"))
        r.agent_prompt_tokens += sum(u.get(k, 0) for k in ("input_tokens", "cache_creation_input_tokens"))
        r.agent_prompt_tokens += u.get("cache_read_input_tokens", 0)
        for tier, n in (u.get("kvtier_cache_read_by_tier") or {}).items():
            r.agent_tokens_by_tier[tier] = r.agent_tokens_by_tier.get(tier, 0) + n

    async def _pressure(self, client: httpx.AsyncClient, done: asyncio.Event) -> None:
        while not done.is_set():
            body = {"model": self.model, "prompt": text(self.rng, self.ns.pressure_tokens), "max_tokens": 1}
            r = await client.post("/v1/completions", json={**body, "temperature": 0.0})
            if r.status_code == 200 and not done.is_set():
                self.result.pressure_prompt_tokens += r.json()["usage"]["prompt_tokens"]


@dataclass(frozen=True)
class _ReplicaFlags(ReplicaSettings):
    """A cluster replica's flags: ReplicaSettings' (``max_model_len`` 0: the model's own) and the engine
    flags this benchmark passes on."""

    more: tuple[str, ...] = ()

    def flags(self) -> list[str]:
        out = super().flags()
        if not self.max_model_len:
            at = out.index("--max-model-len")
            del out[at : at + 2]
        return [*out, *self.more]


def _replica_flags(ns: argparse.Namespace, remote_url: str | None) -> _ReplicaFlags:
    more = ["--max-num-batched-tokens", str(ns.max_num_batched_tokens)]
    more += ["--scheduling-policy", ns.scheduling_policy]
    flags = (
        ("--model", ns.model),
        ("--max-step-ms", ns.max_step_ms),
        ("--kv-retain-max-fraction", ns.kv_retain_max_fraction),
    )
    for flag, value in flags:
        if value is not None:
            more += [flag, str(value)]
    return _ReplicaFlags(
        device_blocks=ns.kv_device_blocks,
        host_gb=ns.kv_host_gb,
        max_model_len=ns.max_model_len or 0,
        threads=ns.num_threads or 1,
        remote_url=remote_url,
        more=tuple(more),
    )


def _cluster_run(ns: argparse.Namespace, retain: bool, label: str, seed: int) -> RunResult:
    with tempfile.TemporaryDirectory(prefix="kvtier-agent-") as logs, Cluster(Path(logs)) as c:
        c.start_redis()
        replicas = [c.add_replica(_replica_flags(ns, c.redis_url)) for _ in range(ns.replicas)]
        c.start_all(replicas)
        router = c.add_router("cache_aware", c.redis_url)
        c.restart(router, 60.0)
        return asyncio.run(HttpRun(router.url, ns, retain, label, seed).run())


def main(ns: argparse.Namespace) -> int:
    """Both runs side by side, over HTTP (``--url``) or through a fresh router cluster each
    (``--cluster``)."""
    if ns.cluster and not ns.kv_host_gb:
        raise ConfigError("--cluster needs --kv-host-gb > 0: the replicas read Redis blocks through it")
    results = []
    for seed, (label, retain) in enumerate((("no cache_control", False), ("cache_control (retained)", True))):
        if ns.cluster:
            results.append(_cluster_run(ns, retain, label, seed))
        else:
            results.append(asyncio.run(HttpRun(ns.url.rstrip("/"), ns, retain, label, seed).run()))
    where = f" through kvtier router, {ns.replicas} replicas + Redis" if ns.cluster else f" at {ns.url}"
    print_table(results, ns, where, unit="word")
    if ns.json:
        write_json(results, ns.json)
    return 0
