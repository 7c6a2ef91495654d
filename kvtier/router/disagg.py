"""Disaggregated prefill and decode: a long prompt is computed on a ``prefill`` replica, its KV blocks
reach a ``decode`` replica through the shared remote tier, and the client gets the decode replica's
answer as one OpenAI response. Used for every completion while some healthy replica has the prefill
role (``kvtier serve --role``, read from its ``/v1/kv/info``); otherwise the router is unchanged.

::

    prompt (kvtier.router.prompt) ──► decode route: the decode and both replicas, by the cost model
    no handoff (``why_not``) ──► straight to the decode route (proxy.forward), when:
        no prompt (no tokenizer yet, a body the replica would refuse, prompt logprobs: computed whole),
        no healthy replica of one side, or fewer uncached tokens on the best decode replica than
        --disagg-min-prompt-tokens (a returning conversation: its prefix is cached already)
    handoff:
      1. prefill route: the prefill replicas, by the same cost model (cached blocks, queued prefill);
         the request with max_tokens 1, stream false (``prefill_body``), its answer awaited whole and
         thrown away. Refused or reset, a 5xx, marked down meanwhile: the next prefill replica, once;
         a 4xx (the body itself) or no second one: no prefill, the decode replica computes the prompt
      2. POST /v1/kv/publish on it with the prompt's full-block hashes: answered once they are in the
         remote tier, or never will be, or --disagg-publish-timeout passed
      3. the decode route again (loads moved meanwhile; the published blocks now count as remote); the
         client's request, unchanged, through proxy.forward: streamed back as it comes, retried on the
         next decode replica before its first byte

Exact by construction: the decode replica runs the client's request as sent. Its prefix lookup finds the
prompt's full blocks in the remote tier (read into its host tier, then loaded) and it computes only the
rest: the partial last block (recomputed, never moved), and any block that did not arrive (evicted in
between, Redis down, a prefill that failed). The first token is its own (the prefill's is discarded), so
nothing is lost or duplicated, and ``usage`` counts the prompt once, its remote part in
``cached_tokens_by_tier``. Step 2 is needed: a prefill step's last full blocks are copied to the host tier,
and so written to Redis, at the start of the next step, which an idle prefill replica never takes; its
answer comes before them (``tests/test_disagg_publish.py``). Nothing reaches the client before step 3,
so a failure in steps 1-2 costs time, never the answer; a client that leaves meanwhile ends them (499).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvtier.router.core import INLINE_BODY_BYTES, NoReplica, Route, Router
from kvtier.router.prompt import RESPONSES_PATH, Prompt
from kvtier.router.proxy import RETRY_STATUSES, Hold, forward, opens_chat, unless, until_disconnected
from kvtier.router.replicas import Replica

PREFILL_REASON = "prefill"  # requests_routed's reason of a prefill (its retry: "retry")
HANDOFF_REASON = "handoff"  # ...and of the decode replica's part after one
PREFILL_HEADER = "x-kvtier-prefill-replica"  # on the client's answer: where its prompt was computed
MAX_PUBLISH_BLOCKS = 1 << 16  # what one /v1/kv/publish may name (kvtier.server.kv_routes)
# Fields a prefill does not need: its one token is thrown away (the prompt never depends on them).
_DROPPED = (
    "stream_options", "max_completion_tokens", "min_tokens", "best_of", "logprobs", "top_logprobs",
    "echo", "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "text",
)  # fmt: skip
_TIMEOUT = httpx.Timeout(connect=2.0, read=None, write=30.0, pool=10.0)  # a long prompt takes its time


@dataclass(frozen=True)
class Prefilled:
    """A prefill that answered: where, how many of the prompt's blocks it published, how long it took."""

    replica: Replica
    num_published: int
    seconds: float
    answered_at: float  # perf_counter when its answer came back (publishing follows)


def is_prefill(r: Replica) -> bool:
    return r.role == "prefill"


def answers(r: Replica) -> bool:
    """Serves a client's request whole: a decode or both replica."""
    return r.role != "prefill"


def active(router: Router) -> bool:
    """Some healthy replica has the prefill role: completions go through :func:`route`."""
    return any(is_prefill(r) for r in router.replicas.healthy())


def prefill_body(given: dict[str, Any], path: str = "") -> dict[str, Any]:
    """The request a prefill replica computes: the prompt as the client sent it, one token, no stream
    (the Responses API's limit is ``max_output_tokens``)."""
    body = {k: v for k, v in given.items() if k not in _DROPPED}
    limit = "max_output_tokens" if path == RESPONSES_PATH else "max_tokens"
    body.update({limit: 1, "stream": False})
    if "n" in body:
        body["n"] = 1
    return body


def why_not(router: Router, prompt: Prompt | None, decode: Route) -> str | None:
    """Why a request goes straight to ``decode`` (a ``HANDOFF_OUTCOMES`` label); None: hand it off."""
    if not any(answers(r) for r in decode.replicas):
        return "no_decode"
    if prompt is None or prompt.uncached:
        return "unscored"
    uncached = prompt.num_tokens - decode.decision.cached_tokens
    if uncached < router.settings.disagg_min_prompt_tokens:
        return "short"
    return None


def _answering(router: Router) -> Any:
    """The replicas a client's request may go to: decode and both ones, else (none healthy) any."""
    return answers if any(answers(r) for r in router.replicas.healthy()) else None


async def route(
    router: Router, request: Request, path: str, body: bytes, given: Any, authorization: str
) -> Response:
    """A completion while prefill replicas are up: the handoff, or straight to a decode replica."""
    start = time.perf_counter()
    prompt = await router.prompt(path, given, authorization, inline=len(body) <= INLINE_BODY_BYTES)
    decode = router.rank(prompt, given, authorization, among=_answering(router))
    router.metrics.latency.observe(time.perf_counter() - start)
    why = why_not(router, prompt, decode)
    if why is not None:
        router.metrics.handoffs.labels(why).inc()
        return await forward(router, request, decode, path, body)
    assert prompt is not None and isinstance(given, dict)
    prefilled = await _watched(request, _prefill(router, request, path, given, prompt, authorization))
    if isinstance(prefilled, Response):
        return prefilled  # the client left
    router.metrics.handoffs.labels("handoff" if prefilled else "prefill_failed").inc()
    with contextlib.suppress(NoReplica):  # none is healthy now: the first pick's forward says so (502)
        decode = router.rank(prompt, given, authorization, among=_answering(router))
    if prefilled is not None:
        decode = replace(decode, decision=replace(decode.decision, reason=HANDOFF_REASON))
    answer = await forward(router, request, decode, path, body)
    if prefilled is not None:
        answer.headers[PREFILL_HEADER] = prefilled.replica.url
        _time_first_byte(router, answer, prefilled.answered_at)
    return answer


def _time_first_byte(router: Router, answer: Response, since: float) -> None:
    """Observe ``handoff_overhead_seconds`` when the decode replica's first token goes to the client
    (its first chunk that is not a chat stream's role event; a whole answer: now)."""
    observe = router.metrics.handoff_overhead_seconds.observe
    if not isinstance(answer, StreamingResponse):
        observe(time.perf_counter() - since)
        return
    chunks = answer.body_iterator

    async def timed() -> AsyncIterator[Any]:
        first = True
        async for chunk in chunks:
            if first and not opens_chat(chunk):
                observe(time.perf_counter() - since)
                first = False
            yield chunk

    answer.body_iterator = timed()


async def _watched(request: Request, work: Any) -> Prefilled | None | Response:
    """``work``'s result, or a 499 (``work`` cancelled) when the client leaves first."""
    task, _ = await unless(work, until_disconnected(request))
    if task.cancelled():
        return Response(status_code=499)
    return task.result()


async def _prefill(
    router: Router, request: Request, path: str, given: dict[str, Any], prompt: Prompt, authorization: str
) -> Prefilled | None:
    """Steps 1 and 2 (module docstring): the prefill replica that computed the prompt and published its
    blocks, or None when none did (the decode replica then computes the prompt itself)."""
    try:
        prefill = router.rank(prompt, given, authorization, among=is_prefill, affinity=False)
    except NoReplica:
        return None
    content = json.dumps(prefill_body(given, path)).encode()
    headers = {k: v for k in ("authorization", "content-type") if (v := request.headers.get(k)) is not None}
    start = time.perf_counter()
    for i, replica in enumerate(prefill.replicas[:2]):
        reason = PREFILL_REASON if i == 0 else "retry"
        replica.routed[reason] += 1
        router.metrics.routed.labels(replica.url, reason).inc()
        work = prefill.work[i] if i < len(prefill.work) else 0
        status = await _compute(router, replica, path, content, headers, work)
        if status == "ok":
            answered_at = time.perf_counter()
            num_published = await _publish(router, replica, prompt)
            router.metrics.handoff_publish_seconds.observe(time.perf_counter() - answered_at)
            seconds = time.perf_counter() - start
            router.metrics.handoff_seconds.observe(seconds)
            return Prefilled(replica, num_published, seconds, answered_at)
        if status == "refused":
            break  # the request itself (a 4xx): the decode replica gives the client its own answer
    return None


async def _compute(
    router: Router, replica: Replica, path: str, content: bytes, headers: dict[str, str], work: int
) -> str:
    """One prefill try: ``ok``, ``failed`` (try the next: unreachable, broke off, 5xx, marked down) or
    ``refused`` (any other status: the request itself). Its load counts while it runs (proxy.Hold)."""
    hold = Hold(replica, work)
    try:
        answer = await _post(router, replica, path, content, headers, _TIMEOUT)
    except httpx.TransportError as exc:
        if not isinstance(exc, httpx.TimeoutException):  # refused or reset: down now (as proxy.attempt)
            router.replicas.mark_down(replica, f"{type(exc).__name__} on {path}")
        return "failed"
    finally:
        hold.release()
    if answer.status_code < 300:
        return "ok"
    return "failed" if answer.status_code in RETRY_STATUSES else "refused"


async def _post(
    router: Router,
    replica: Replica,
    path: str,
    content: bytes,
    headers: dict[str, str],
    timeout: httpx.Timeout,
) -> httpx.Response:
    """The replica's whole answer; httpx.TransportError when it could not be reached or broke off, a
    ReadTimeout when it was marked down (hung: its health checks timed out) before answering."""
    posting = router.client.post(replica.url + path, content=content, headers=headers, timeout=timeout)
    call, _ = await unless(posting, replica.down.wait())
    if call.cancelled():
        raise httpx.ReadTimeout(f"{replica.url} was marked down before it answered")
    return call.result()


async def _publish(router: Router, replica: Replica, prompt: Prompt) -> int:
    """Step 2: ask the prefill replica to make sure the prompt's full blocks are in the remote tier;
    how many it reports there (0 when it has no remote tier or does not answer: the handoff goes on)."""
    info = replica.info or {}
    if "remote" not in info.get("media", ()) or "cache_identity" not in info:
        return 0
    chains = prompt.all_block_hashes(info["cache_identity"], int(info["block_size"]))
    hashes = list(dict.fromkeys(h for chain in chains for h in chain))[:MAX_PUBLISH_BLOCKS]
    if not hashes:
        return 0
    wait = router.settings.disagg_publish_timeout
    content = json.dumps({"block_hashes": [h.hex() for h in hashes], "timeout_s": wait}).encode()
    headers = {**router.replicas.headers, "content-type": "application/json"}
    try:
        r = await _post(router, replica, "/v1/kv/publish", content, headers, httpx.Timeout(wait + 5.0))
        num_published = int(r.json().get("published") or 0) if r.status_code == 200 else 0
    except (httpx.HTTPError, ValueError, TypeError, AttributeError):
        return 0
    if num_published == len(hashes):
        replica.index.note_remote(hashes)  # the decode pick counts them as remote at once
    router.metrics.handoff_blocks.inc(num_published)
    router.metrics.handoff_bytes.inc(num_published * int(info.get("kv_block_bytes") or 0))
    return num_published
