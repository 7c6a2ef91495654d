"""The router's state and its one decision: which replicas (best first) serve this request.

::

    choose(path, body, authorization)
      healthy replicas ──► none: NoReplica (503)
      policy cache_aware and the tokenizer loaded:
        prompt token ids (kvtier.router.prompt) ──► per (cache identity, block size): block hashes
        per replica: cached tokens (its own tiers, from its index), remote tokens (the shared tier);
        a hybrid replica's over every KV group of its layout (kvtier.router.groups)
      kvtier.router.policy.decide(...) ──► Route(replicas best first, decision)

Tokenizing runs on a small thread pool, never on the event loop. ``RouterSettings`` holds the flags.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from kvtier.kv.hashing import BlockHash
from kvtier.router import policy as policies
from kvtier.router.affinity import Affinity, cache_key
from kvtier.router.auth import Keys
from kvtier.router.groups import request_blocks
from kvtier.router.index import DEFAULT_MAX_BLOCKS, ReplicaIndex, prompt_blocks
from kvtier.router.metrics import RouterMetrics
from kvtier.router.prompt import CHAT_PATH, Prompt, load_tokenizer, parse_prompt
from kvtier.router.replicas import Replica, ReplicaSet
from kvtier.router.sync import IndexSync
from kvtier.router.tokens import PieceEncoder
from kvtier.server.response_store import owner_tag, replica_tag, response_of_item
from kvtier.tokenizer import Tokenizer

logger = logging.getLogger("kvtier.router")

# A body this small (a short chat) is parsed and tokenized on the event loop: well under a millisecond,
# less than handing it to the tokenizer pool and back.
INLINE_BODY_BYTES = 2048


@dataclass
class RouterSettings:
    replicas: list[str]
    policy: str = "cache_aware"
    kv_remote_url: str | None = None
    api_key: str | None = None  # the client role (kvtier.router.auth)
    kv_read_key: str | None = None  # sent on the router's own calls to the replicas (None: api_key)
    admin_key: str | None = None  # the admin role: /admin/... (None: those routes are 404)
    metrics_key: str | None = None  # /metrics (None: open)
    model: str | None = None  # where the tokenizer comes from (None: the embedded default)
    prefix_cache_scope: str = "shared"
    cost: policies.CostModel = field(default_factory=policies.CostModel)
    max_index_blocks: int = DEFAULT_MAX_BLOCKS
    max_request_bytes: int = 4 * 2**20
    poll_interval: float = 1.0
    timeout_header: float = 10.0  # seconds for a request line and headers (0: none; kvtier.router.cli)
    timeout_body: float | None = 30.0  # seconds for a request body (408 after; None: none)
    # disaggregated prefill and decode (kvtier.router.disagg): a prompt with fewer uncached tokens than
    # this on the best decode replica skips the prefill replicas; how long to wait for its blocks
    disagg_min_prompt_tokens: int = 512
    disagg_publish_timeout: float = 5.0


class NoReplica(Exception):
    """No healthy replica to send the request to."""


@dataclass(frozen=True)
class Route:
    replicas: list[Replica]  # best first; a retry takes the next
    decision: policies.Decision
    work: tuple[int, ...] = ()  # per replica in ``replicas``: estimated prefill tokens (0: unknown)


def owner_index(healthy: list[Replica], response_id: Any) -> int | None:
    """Which of ``healthy`` made the stored response ``response_id`` (its id names it), or None."""
    tag = owner_tag(response_id)
    if tag is None:
        return None
    ids = [(r.info or {}).get("replica_id") for r in healthy]
    return next((i for i, rid in enumerate(ids) if isinstance(rid, str) and replica_tag(rid) == tag), None)


def stored_response_of(body: Any) -> Any:
    """The stored response a Responses request builds on: the one it continues (``previous_response_id``),
    else the one its first ``item_reference`` names (kvtier item ids name their response), or None."""
    if not isinstance(body, dict):
        return None
    if body.get("previous_response_id") is not None:
        return body["previous_response_id"]
    items = body.get("input")
    for item in items if isinstance(items, list) else ():
        if isinstance(item, dict) and item.get("type") == "item_reference":
            return response_of_item(item.get("id"))
    return None


def owner_first(decision: policies.Decision, healthy: list[Replica], body: Any) -> policies.Decision:
    """A Responses request continuing a stored response (``previous_response_id``), or referencing its
    items, first to the replica that made it, while it is healthy: the conversation is kept there
    (unless the replicas share a store) and so is its KV."""
    owner = owner_index(healthy, stored_response_of(body))
    if owner is None:
        return decision
    ranking = (owner, *(i for i in decision.ranking if i != owner))
    return replace(decision, ranking=ranking, reason="stored_response")


class Router:
    def __init__(self, settings: RouterSettings, client: httpx.AsyncClient) -> None:
        if settings.policy not in policies.POLICIES:
            raise ValueError(
                f"--policy must be one of {', '.join(policies.POLICIES)}, got {settings.policy!r}"
            )
        others = (settings.api_key, settings.kv_read_key, settings.metrics_key)
        if settings.admin_key and settings.admin_key in others:
            raise ValueError("--admin-key must differ from every other key")
        self.settings = settings
        self.keys = Keys(settings.api_key or None, settings.admin_key or None, settings.metrics_key or None)
        self.client = client
        own_key = settings.kv_read_key or settings.api_key  # /v1/kv/info and /v1/kv/blocks on the replicas
        headers = {"Authorization": f"Bearer {own_key}"} if own_key else {}
        self.replicas = ReplicaSet(
            client, headers, max_blocks=settings.max_index_blocks, fingerprint=lambda: self.fingerprint
        )
        for url in settings.replicas:
            self.replicas.add(url)
        self.sync = IndexSync(self.replicas, settings.kv_remote_url, settings.poll_interval)
        self.metrics = RouterMetrics(lambda: list(self.replicas.replicas.values()), lambda: self.sync.mode)
        self.tokenizer: Tokenizer | None = None
        self.encoder: PieceEncoder | None = None
        self.fingerprint: str | None = None
        self.tokenizer_error: str | None = None
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvtier-router-tokenize")
        self._turn = itertools.count()
        self._identity_checked = False
        self.affinity = Affinity()  # prompt_cache_key -> the replica its requests went to

    # ------------------------------------------------------------------------------ start-up
    def load_tokenizer_in_background(self) -> threading.Thread:
        """Load the tokenizer on a thread (the router serves meanwhile, by load)."""

        def load() -> None:
            try:
                tokenizer, fingerprint = load_tokenizer(self.settings.model)
            except Exception as exc:  # ConfigError, OSError: cache-aware routing stays off
                self.tokenizer_error = f"{type(exc).__name__}: {exc}"
                logger.warning("router: no tokenizer (%s); routing by load", self.tokenizer_error)
                return
            self.fingerprint = fingerprint
            self.encoder = PieceEncoder(tokenizer)
            warm_up = {
                "messages": [{"role": "user", "content": "Hi"}]
            }  # the template compiled, pydantic built
            parse_prompt(tokenizer, CHAT_PATH, warm_up, "", self.settings.prefix_cache_scope, self.encoder)
            self.tokenizer = tokenizer

        thread = threading.Thread(target=load, name="kvtier-router-tokenizer", daemon=True)
        thread.start()
        return thread

    def background_tasks(self) -> list[Any]:
        """The coroutines to run while the router serves: health checks, index polling, events."""
        tasks = [self.replicas.run(), self.sync.run_polling()]
        if self.settings.kv_remote_url:
            tasks.append(self.sync.run_events())
        return tasks

    # ------------------------------------------------------------------------------ the decision
    async def choose(self, path: str, body: Any, authorization: str = "", body_bytes: int = 0) -> Route:
        """The replicas for this request, best first; NoReplica when none is healthy. ``body_bytes``:
        the body's size (a small one is tokenized on the event loop: a thread hop costs more)."""
        start = time.perf_counter()
        if not self.replicas.healthy():
            raise NoReplica("no healthy replica")
        prompt = None
        if self.settings.policy == "cache_aware":
            prompt = await self.prompt(path, body, authorization, inline=body_bytes <= INLINE_BODY_BYTES)
        route = self.rank(prompt, body, authorization)  # again: one may have gone while it was tokenized
        self.metrics.latency.observe(time.perf_counter() - start)
        return route

    def rank(
        self,
        prompt: Prompt | None,
        body: Any,
        authorization: str,
        among: Callable[[Replica], bool] | None = None,
        *,
        affinity: bool = True,
    ) -> Route:
        """The healthy replicas ``among`` accepts (None: all), best first for a request whose prompt is
        ``prompt`` (None, or a policy other than cache_aware: by load); NoReplica when there is none.
        ``affinity``: honour and update the request's ``prompt_cache_key`` (not for a prefill's pick)."""
        healthy = [r for r in self.replicas.healthy() if among is None or among(r)]
        if not healthy:
            raise NoReplica("no healthy replica")
        if self.settings.policy != "cache_aware":
            prompt = None
        candidates, matched = self._candidates(healthy, prompt)
        num_tokens = prompt.num_tokens if prompt is not None and matched else None
        turn = next(self._turn)
        decision = policies.decide(self.settings.policy, candidates, num_tokens, self.settings.cost, turn)
        if affinity:
            decision = self._keep_affinity(decision, healthy, candidates, num_tokens, body, authorization)
        decision = owner_first(decision, healthy, body)
        if decision.reason in ("cache_hit", "load") and self.settings.policy == "cache_aware":
            self.metrics.cached_tokens.observe(decision.cached_tokens)
        work = tuple(decision.work[i] for i in decision.ranking) if decision.work else ()
        return Route([healthy[i] for i in decision.ranking], decision, work)

    def _keep_affinity(
        self,
        decision: policies.Decision,
        healthy: list[Replica],
        candidates: list[policies.Candidate],
        num_tokens: int | None,
        body: Any,
        authorization: str,
    ) -> policies.Decision:
        """The replica the request's ``prompt_cache_key`` went to before, first while it is not much
        busier (affinity.py); the key then points at this decision's winner."""
        key = cache_key(body, authorization)
        if key is None or self.settings.policy == "round_robin":
            return decision
        where = self.affinity.get(key)
        preferred = next((i for i, r in enumerate(healthy) if r.url == where), None)
        decision = policies.keep_affinity(decision, candidates, preferred, num_tokens, self.settings.cost)
        self.affinity.put(key, healthy[decision.choice].url)
        return decision

    def stored_response_replicas(self, response_id: str) -> list[Replica]:
        """Healthy replicas for a stored response's route: the one that made it first (its store, unless
        the replicas share one)."""
        healthy = self.any_replicas()
        owner = owner_index(healthy, response_id)
        return healthy if owner is None else [healthy[owner], *healthy[:owner], *healthy[owner + 1 :]]

    async def prompt(self, path: str, body: Any, authorization: str, inline: bool = False) -> Prompt | None:
        """The request's token ids and salt (on the tokenizer pool, or here when ``inline``); None
        without a tokenizer or for a body the replica would refuse."""
        if self.tokenizer is None:
            return None
        if not self._identity_checked:  # the replicas seen before the tokenizer loaded
            self._identity_checked = True
            self.replicas.recheck_identity()
        args = (self.tokenizer, path, body, authorization, self.settings.prefix_cache_scope, self.encoder)
        if inline:
            return parse_prompt(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, parse_prompt, *args)

    def any_replicas(self) -> list[Replica]:
        """Healthy replicas in turn, for a request that is not a completion (``/v1/models``)."""
        healthy = self.replicas.healthy()
        if not healthy:
            raise NoReplica("no healthy replica")
        k = next(self._turn) % len(healthy)
        return healthy[k:] + healthy[:k]

    async def block_hashes(self, path: str, body: Any, authorization: str) -> dict[str, Any]:
        """``{"num_tokens", "per_replica": {url: [hex hash]}}`` of the first prompt, as the router computes
        them (a batched completion's other prompts are scored too, but not listed here)."""
        prompt = await self.prompt(path, body, authorization)
        if prompt is None:
            return {"num_tokens": None, "per_replica": {}}
        per_replica = {
            r.url: [h.hex() for h in prompt.block_hashes(r.info["cache_identity"], int(r.info["block_size"]))]
            for r in self.replicas.replicas.values()
            if r.info is not None
        }
        return {"num_tokens": len(prompt.token_ids), "per_replica": per_replica}

    def _candidates(
        self, healthy: list[Replica], prompt: Prompt | None
    ) -> tuple[list[policies.Candidate], bool]:
        """The policy's view of each healthy replica, and whether any could be matched at all."""
        if prompt is None:
            return [policies.Candidate(r.url, r.load) for r in healthy], False
        scorable = [r for r in healthy if r.scorable]
        indexes = [r.index for r in scorable]
        chains: dict[tuple[str, int], list[list[BlockHash]]] = {}
        out = []
        for r in healthy:
            if not r.scorable:
                out.append(policies.Candidate(r.url, r.load))
                continue
            assert r.info is not None
            key = (r.info["cache_identity"], int(r.info["block_size"]))
            if key not in chains:
                chains[key] = prompt.all_block_hashes(*key)
            local, remote = (0, 0) if prompt.uncached else _blocks(r, indexes, chains[key], prompt)
            out.append(policies.Candidate(r.url, r.load, local * key[1], remote * key[1], r.pending_prefill))
        return out, bool(scorable)

    def explain(self, route: Route) -> dict[str, Any]:
        return {
            "policy": self.settings.policy,
            "reason": route.decision.reason,
            "cached_tokens": route.decision.cached_tokens,
            "ranking": [r.url for r in route.replicas],
            "costs": list(route.decision.costs),
        }

    # ------------------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        """``GET /router/state``."""
        return {
            "object": "router.state",
            "mode": self.sync.mode,
            "redis_ok": self.sync.redis_ok if self.settings.kv_remote_url else None,
            "policy": self.settings.policy,
            "tokenizer": {
                "loaded": self.tokenizer is not None,
                "model_fingerprint": self.fingerprint,
                "error": self.tokenizer_error,
            },
            "replicas": [
                _replica_state(r) for r in sorted(self.replicas.replicas.values(), key=lambda r: r.url)
            ],
        }


def _blocks(
    r: Replica, indexes: list[ReplicaIndex], chains: list[list[BlockHash]], prompt: Prompt
) -> tuple[int, int]:
    """``(local, remote)`` blocks of the request's prompts on ``r``: by the leading hashes on a dense
    replica, over every KV group on a hybrid one (``kvtier/router/groups.py``)."""
    layout = r.layout
    if layout is None or layout.is_dense:
        return prompt_blocks(r.index, indexes, chains)
    assert r.info is not None
    lengths = [len(ids) for ids in (prompt.token_ids, *prompt.more)]
    return request_blocks(layout, r.index, indexes, chains, lengths, int(r.info["block_size"]))


def _replica_state(r: Replica) -> dict[str, Any]:
    return {
        "url": r.url,
        "replica_id": (r.info or {}).get("replica_id"),
        "role": r.role,
        "healthy": r.healthy,
        "running": r.running,
        "waiting": r.waiting,
        "in_flight": r.in_flight,
        "health_checks": r.checks,
        "pending_prefill_tokens": r.pending_prefill,
        "routed": dict(r.routed),
        "indexed_blocks": r.index.counts(),
        "index_source": r.index_source(),
        "problem": r.problem,
        "last_error": r.last_error,
    }
