"""``kvtier bench agent``: agents in tool loops under unrelated pressure, with and without retention.

``--agents`` agents each run ``--steps`` steps. A step's prompt is the agent's system prompt (its
instructions and tool definitions: ``--system-tokens`` tokens of its own) plus its history; the model
answers (a short tool call, ``--answer-tokens``), the tool runs for ``--pause-s`` seconds, and its
result (``--result-tokens``) joins the history before the next step. Meanwhile unrelated long prompts
(``--pressure-tokens`` each, ``--pressure-concurrency`` in flight at all times) keep the device pool and
the host tier under pressure. The same workload runs twice in this process, a fresh engine each time,
side by side: without retention, and with every agent request retaining its whole prompt for five
minutes (what Anthropic's ``cache_control`` on the last block, or a client's
``prompt_cache_retention``, asks for: kvtier/kv/retention.py).

Reported per run: the agents' step TTFT (steps after the first, whose prefix was computed before)
p50/p90, the share of their prompt tokens read from each tier, and the unrelated traffic's prompt
tokens/s (:mod:`.agent_report`). By default the engine runs in this process and is stepped here (no
HTTP): the numbers are the cache's. ``--url URL`` (a running server or router) and ``--cluster`` (two
``kvtier serve`` replicas sharing a Redis behind ``kvtier router``, started for each run) drive the same
workload as a client, with real streamed ``/v1/messages`` requests (:mod:`.agent_http`).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.args import add_engine_args, engine_args_from, engine_kwargs
from kvtier.bench import agent_http
from kvtier.bench.agent_report import RunResult, print_table, write_json

RETAIN_TTL_S = 300.0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="steps per agent")
    p.add_argument("--system-tokens", type=int, default=768, help="each agent's system prompt + tools")
    p.add_argument("--answer-tokens", type=int, default=16, help="tokens of each answer (a tool call)")
    p.add_argument("--result-tokens", type=int, default=48, help="tokens of each tool result")
    p.add_argument("--pause-s", type=float, default=5.0, help="each tool call's duration")
    p.add_argument("--pressure-tokens", type=int, default=512, help="each unrelated prompt")
    p.add_argument("--pressure-concurrency", type=int, default=2, help="unrelated prompts in flight")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", default=None, help="drive a running server (or router) over HTTP instead")
    where.add_argument(
        "--cluster",
        action="store_true",
        help="over HTTP through kvtier router in front of --replicas replicas sharing a Redis (started here)",
    )
    p.add_argument("--replicas", type=int, default=2, help="--cluster: kvtier serve replicas")
    p.add_argument("--api-key", default=None, help="--url: the server's API key")
    add_engine_args(
        p,
        [
            "model",
            "kv_device_blocks",
            "kv_host_gb",
            "num_threads",
            "max_num_batched_tokens",
            "scheduling_policy",
            "max_step_ms",
            "max_model_len",
            "kv_retain_max_fraction",
        ],
        defaults={
            "kv_device_blocks": 192,
            "kv_host_gb": 0.2,
            "max_num_batched_tokens": 512,
            "scheduling_policy": "stall_free",
            "kv_retain_max_fraction": 0.9,  # the agents' prompts need ~0.9 of the host tier
        },
    )
    p.set_defaults(func=main)


@dataclass
class _Agent:
    system: list[int]
    history: list[int] = field(default_factory=list)
    step: int = 0
    ready_at: float = 0.0
    request_id: str | None = None
    submitted_at: float = 0.0
    first_seen: bool = False


class _Run:
    """One run's driver: submits agent steps when their tool pause is over, keeps the pressure up, and
    steps the engine."""

    def __init__(self, llm: Any, ns: argparse.Namespace, retain: bool, label: str) -> None:
        from kvtier import SamplingParams
        from kvtier.kv.retention import WHOLE_PROMPT, RetentionSpan

        self.llm, self.ns, self.engine = llm, ns, llm.engine
        self.rng = random.Random(7)
        vocab = min(llm.engine.model_config.vocab_size, 32_000)
        self.tokens = lambda n: [self.rng.randrange(100, vocab) for _ in range(n)]
        self.agents = [_Agent(self.tokens(ns.system_tokens)) for _ in range(ns.agents)]
        self.answer = SamplingParams(temperature=0.0, max_tokens=ns.answer_tokens, ignore_eos=True)
        self.pressure_params = SamplingParams(temperature=0.0, max_tokens=1)
        self.retention = (RetentionSpan(WHOLE_PROMPT, RETAIN_TTL_S),) if retain else ()
        self.pressure: set[str] = set()
        self.result = RunResult(label)

    def run(self) -> RunResult:
        start = time.monotonic()
        while any(a.step < self.ns.steps for a in self.agents):
            now = time.monotonic()
            self._submit(now)
            if not self.engine.has_unfinished_requests():
                time.sleep(0.005)
                continue
            for out in self.engine.step():
                self._observe(out, time.monotonic())
        self.result.seconds = time.monotonic() - start
        for rid in list(self.pressure):
            self.engine.abort_request(rid)
        return self.result

    def _submit(self, now: float) -> None:
        for a in self.agents:
            if a.request_id is None and a.step < self.ns.steps and now >= a.ready_at:
                prompt = a.system + a.history
                a.request_id = self.engine.add_request(prompt, self.answer, retention=self.retention)
                a.submitted_at, a.first_seen = now, False
        while len(self.pressure) < self.ns.pressure_concurrency:
            self.pressure.add(
                self.engine.add_request(self.tokens(self.ns.pressure_tokens), self.pressure_params)
            )

    def _observe(self, out: Any, now: float) -> None:
        if out.request_id in self.pressure:
            if out.finished:
                self.pressure.discard(out.request_id)
                self.result.pressure_prompt_tokens += len(out.prompt_token_ids)
            return
        a = next(a for a in self.agents if a.request_id == out.request_id)
        if not a.first_seen and out.outputs[0].token_ids:
            a.first_seen = True
            if a.step > 0:
                self._record(a, out, now)
        if out.finished:
            a.history += out.outputs[0].token_ids + self.tokens(self.ns.result_tokens)
            a.step, a.request_id, a.ready_at = a.step + 1, None, now + self.ns.pause_s

    def _record(self, a: _Agent, out: Any, now: float) -> None:
        r = self.result
        r.agent_ttft_s.append(now - a.submitted_at)
        r.agent_prompt_tokens += len(out.prompt_token_ids)
        for tier, n in out.cached_tokens_by_tier.items():
            r.agent_tokens_by_tier[str(tier)] = r.agent_tokens_by_tier.get(str(tier), 0) + n


def main(ns: argparse.Namespace) -> int:
    from kvtier import LLM

    args = engine_args_from(ns)  # a bad flag fails before anything loads
    if ns.url or ns.cluster:
        return agent_http.main(ns)
    results = []
    for label, retain in (("no retention", False), ("cache_control (retained)", True)):
        with LLM(args.model, **engine_kwargs(args)) as llm:
            results.append(_Run(llm, ns, retain, label).run())
    print_table(results, ns)
    if ns.json:
        write_json(results, ns.json)
    return 0
