"""KV inspection for a cache-aware router: ``GET /v1/kv/info`` and ``GET /v1/kv/blocks``.

::

    GET /v1/kv/info      {"object": "kv.info", "model": ..., "replica_id": ..., "hash_spec_version": 1,
                          "block_size": 16, "model_fingerprint": ..., "kv_dtype": "float32",
                          "cache_identity": "<fingerprint>:<dtype>", "enable_prefix_caching": true,
                          "media": ["device", "host", ...],
                          "events": {"enabled": ..., "stream": "kvtier:v1:events:<replica_id>",
                                     "wire_version": 1, "instance": ...},
                          "kv_groups": [{"group": 0, "kind": "full", "window": null, "layers": [...]},
                                        {"group": 1, "kind": "sliding", "window": 512, ...}, ...]}
    GET /v1/kv/blocks    {"object": "kv.blocks", "replica_id": ..., "instance": ..., "seq": 42,
                          "block_size": 16, "blocks": {"device": ["<64 hex>", ...], "host": [...], ...}}
    GET /v1/kv/blocks?medium=host&medium=disk     only those media (also ?medium=host,disk)
    GET /v1/kv/advice    {"object": "kv.advice",
                          "tiers": {"host": {"capacity_blocks": ..., "capacity_bytes": ...,
                                    "curve": [{"size_factor": 0.25, "size_blocks": ..., "hit_ratio": ...},
                                              ... 0.5, 1, 2, 4, 8],
                                    "current_hit_ratio": ..., "measured_hit_ratio": ...}, "device": ..., ...},
                          "sampled_accesses": ..., "lookups": ..., "sampling_rate": ...,
                          "tracked_blocks": ...,
                          "advice": ["a host tier of 6.00 GiB (2× today's) would have served 31% more ..."]}
    GET /v1/kv/canary    {"rate": 0.01, "checks": {"match": n, "mismatch": n, "skipped": n}, "pending": n,
                          "tolerance": 1e-4, "by_tier": {"host": {"match": n, "mismatch": n}, ...},
                          "by_group": {"0": {"match": n, "mismatch": n}, ...},
                          "quarantined": ["host"], "last_mismatch": null | {"tier": "host",
                          "block_keys": ["<64 hex>"], "groups": [0], "max_abs_diff": 3.2,
                          "time": <unix seconds>}}
    POST /v1/kv/publish  {"block_hashes": ["<64 hex>", ...], "timeout_s": 5}
                         -> {"object": "kv.publish", "role": "prefill", "shared_tier": true,
                             "num_blocks": 12, "published": 12, "storing": 0, "missing": 0, "seconds": 0.03}
                         disaggregated prefill (docs/disaggregation.md): returns once every block of the
                         list (KV group 0's keys, as a router hashes a prompt) is in the write-through
                         remote tier, or will never be (missing), or ``timeout_s`` (at most 30) passed
    POST /admin/kv/quarantine  {"release": ["host"]}  lift quarantines (canary mismatches) ->
                          {"released": ["host"], "quarantined": []}; 400 for an unknown medium

``role`` is the replica's ``kvtier serve --role`` (``both``, ``prefill``, ``decode``): how a router
learns which replicas compute prompts and which stream answers.

A prompt's last blocks become full in the step that computes them; their copies to the host tier (and
from there the writes to the remote tier) are planned then and run at the start of the next step, which
an idle replica takes on its own (``LLMEngine.settle_tiers``). ``/v1/kv/publish`` says when the writes
have landed: it asks the shared tier itself (pipelined ``EXISTS``, off the engine thread) until every
block is there, and the engine (``TierCoordinator.publish``, between two steps) only when the tier shows
no progress for a moment: the engine then writes down host blocks the tier lacks, and knows which blocks
will never come. A look through the engine waits for the step in progress, and on a prefill replica
computing the next long prompt that step lasts seconds.

``kv_groups`` is the KV layout (``kvtier/kv/groups.py``): one full group for a dense model; a hybrid
model's groups, full-attention first. Group ``g``'s blocks are announced and listed under
``group_key(h, g)`` (``docs/block-hashes.md``): a router scores a prefix over every group with it
(``kvtier/router/groups.py``).

``blocks`` is taken on the engine thread between two steps, so it is exactly the state after event batch
``seq`` of ``instance`` (``null`` without events): a router seeds its index from it and applies the
stream's batches after ``seq`` (``kvtier.kv_events.BlockIndex.seed``). Errors are OpenAI-shaped (400 for
an unknown medium, 503 while loading).

The keys (:mod:`.auth`)::

    GET  /v1/kv/info                the client key (or the kv reader's, or the admin's): the router's check
    GET  /v1/kv/blocks, /canary,    --kv-read-key or the admin key; without --kv-read-key the client key.
         /advice, POST /publish     Block hashes let a reader test guesses of other users' prompts
    POST /admin/kv/quarantine       --admin-key only; 404 when the server has none
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from kvtier.engine import LLMEngine
from kvtier.kv.groups import KVLayout
from kvtier.kv.hashing import BLOCK_HASH_NUM_BYTES, BlockHash
from kvtier.server.async_engine import AsyncEngine
from kvtier.server.auth import check_admin, check_kv_info, check_kv_reader
from kvtier.server.bodies import parse_json
from kvtier.server.protocol import APIError
from kvtier.stats import Medium
from kvtier.tiers.coordinator import SharedProgress

PUBLISH_MAX_BLOCKS = 1 << 16  # block hashes one /v1/kv/publish may name (a 1M-token prompt at 16)
PUBLISH_MAX_WAIT_S = 30.0
PUBLISH_DEFAULT_WAIT_S = 5.0
PUBLISH_POLL_S = 0.01  # between two looks at the writes
PUBLISH_ENGINE_LOOK_S = 0.25  # no new block in the shared tier this long: ask the engine


def _media(requested: list[str] | None) -> set[Medium] | None:
    """The ``?medium=`` filter (repeated or comma-separated), or None for every medium."""
    if not requested:
        return None
    names = [name.strip() for value in requested for name in value.split(",") if name.strip()]
    try:
        return {Medium(name) for name in names}
    except ValueError:
        valid = ", ".join(m.value for m in Medium)
        raise APIError(400, f"unknown medium in {names!r}; valid: {valid}", param="medium") from None


def kv_groups_json(layout: KVLayout) -> list[dict[str, Any]]:
    """``/v1/kv/info``'s ``kv_groups``: each KV group's index, kind, window (null: full attention) and
    the model layers in its slots (what ``kvtier.router.groups.RouterLayout.from_info`` reads)."""
    return [
        {"group": g, "kind": spec.kind, "window": spec.window, "layers": list(spec.layers)}
        for g, spec in enumerate(layout.groups)
    ]


def kv_router() -> APIRouter:
    """The ``/v1/kv`` routes (each behind its role's key) and ``/admin/kv``; they read the engine and the
    settings from ``request.app.state``."""
    router = APIRouter(prefix="/v1/kv", dependencies=[Depends(check_kv_reader)])
    _insight_routes(router)
    info_router = APIRouter(prefix="/v1/kv", dependencies=[Depends(check_kv_info)])

    @info_router.get("/info")
    async def info(request: Request) -> dict[str, Any]:
        def info_of(e: LLMEngine) -> dict[str, Any]:
            return {**e.kv_info(), "kv_groups": kv_groups_json(e.config.model.kv_layout())}

        engine: AsyncEngine = request.app.state.engine
        answer = await engine.call(info_of)
        model, role = request.app.state.settings.model_name, _role(request)
        return {"object": "kv.info", "model": model, "role": role, **answer}

    @router.get("/blocks")
    async def blocks(request: Request, medium: list[str] | None = Query(default=None)) -> dict[str, Any]:  # noqa: B008
        wanted = _media(medium)

        def snapshot(e: LLMEngine) -> tuple[dict[Medium, list[bytes]], int | None, str | None, str, int]:
            held, seq = e.kv_blocks()
            instance = e.kv_events.instance if e.kv_events is not None else None
            return held, seq, instance, e.replica_id, e.block_size

        engine: AsyncEngine = request.app.state.engine
        held, seq, instance, replica_id, block_size = await engine.call(snapshot)
        return {
            "object": "kv.blocks",
            "replica_id": replica_id,
            "instance": instance,
            "seq": seq,
            "block_size": block_size,
            "blocks": {
                str(m): [h.hex() for h in hashes]
                for m, hashes in held.items()
                if wanted is None or m in wanted
            },
        }

    _publish_route(router)
    outer = APIRouter()
    outer.include_router(info_router)
    outer.include_router(router)
    outer.include_router(_admin_router())
    return outer


def _role(request: Request) -> str:
    """The replica's ``--role`` (``kvtier.server.serve.set_role``; an app built without it: ``both``)."""
    return getattr(request.app.state, "role", "both")


def _publish_request(body: Any) -> tuple[list[BlockHash], float]:
    """``/v1/kv/publish``'s block keys and wait, checked (a 400 naming the field)."""
    hashes = body.get("block_hashes") if isinstance(body, dict) else None
    if not isinstance(hashes, list) or len(hashes) > PUBLISH_MAX_BLOCKS:
        message = f'send {{"block_hashes": ["<64 hex>", ...]}} (at most {PUBLISH_MAX_BLOCKS})'
        raise APIError(400, message, param="block_hashes")
    keys = []
    for h in hashes:
        if not isinstance(h, str) or len(h) != 2 * BLOCK_HASH_NUM_BYTES:
            raise APIError(400, "a block hash is 64 hex digits", param="block_hashes")
        try:
            keys.append(BlockHash(bytes.fromhex(h)))
        except ValueError:
            raise APIError(400, "a block hash is 64 hex digits", param="block_hashes") from None
    wait = body.get("timeout_s", PUBLISH_DEFAULT_WAIT_S)
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= PUBLISH_MAX_WAIT_S:
        raise APIError(400, f"timeout_s must be a number in [0, {PUBLISH_MAX_WAIT_S:g}]", param="timeout_s")
    return keys, float(wait)


async def _publish_wait(
    engine: AsyncEngine, presence: Callable[..., int | None] | None, keys: list[BlockHash], wait: float
) -> SharedProgress | None:
    """Until every key is in the shared tier, or will never be, or ``wait`` passed. The tier itself is
    asked (``presence``, off the engine thread: a look through the engine waits for its step in
    progress, seconds on a prefill replica computing the next long prompt); the engine is asked only
    when the tier shows no progress for ``PUBLISH_ENGINE_LOOK_S`` (it writes down host blocks the tier
    lacks, and knows which will never come)."""
    start = time.monotonic()
    names = list(dict.fromkeys(keys))
    held, progress_at, progress = -1, start, None
    while True:
        if presence is not None:
            found = await asyncio.to_thread(presence, names)
            if found is not None and found > held:
                held, progress_at = found, time.monotonic()
            if held == len(names):
                return SharedProgress(held, 0, 0, active=True)
        if presence is None or time.monotonic() - progress_at >= PUBLISH_ENGINE_LOOK_S:
            progress = await engine.call(lambda e: publish_round(e, keys))
            progress_at = time.monotonic()
            if progress is None or progress.settled:
                return progress
        if time.monotonic() - start >= wait:
            return progress
        await asyncio.sleep(PUBLISH_POLL_S)


def publish_round(e: LLMEngine, keys: list[BlockHash]) -> SharedProgress | None:
    """One look at ``keys`` in the shared tier, on the engine thread between two steps (None: no tiers).
    An idle engine is stepped once first: the copies its last step planned run, finished writes apply."""
    e.settle_tiers()  # an idle engine runs its planned copies now, not at the next settling round
    return e.tiers.publish(keys) if e.tiers is not None else None


def _publish_route(router: APIRouter) -> None:
    """``POST /v1/kv/publish``: wait until a prompt's blocks are in the shared tier (module docstring)."""

    @router.post("/publish")
    async def publish(request: Request) -> dict[str, Any]:
        keys, wait = _publish_request(parse_json(await request.body()))
        engine: AsyncEngine = request.app.state.engine
        start = time.monotonic()
        # taken when the model loaded: fetching it through the engine here waited for the step in
        # progress, seconds on a prefill replica computing the next long prompt (the first handoff)
        progress = await _publish_wait(engine, engine.shared_presence, keys, wait)
        progress = progress or SharedProgress(0, 0, len(set(keys)), active=False)
        return {
            "object": "kv.publish",
            "role": _role(request),
            "shared_tier": progress.active,
            "num_blocks": len(set(keys)),
            "published": progress.num_held,
            "storing": progress.num_storing,
            "missing": progress.num_missing,
            "seconds": round(time.monotonic() - start, 6),
        }


def _insight_routes(router: APIRouter) -> None:
    """``GET /v1/kv/advice`` (miss-ratio curves, sizing) and ``GET /v1/kv/canary`` (kvtier/insight)."""

    @router.get("/advice")
    async def advice(request: Request) -> dict[str, Any]:
        engine: AsyncEngine = request.app.state.engine
        return await engine.call(LLMEngine.kv_advice)

    @router.get("/canary")
    async def canary(request: Request) -> dict[str, Any]:
        engine: AsyncEngine = request.app.state.engine
        return {"object": "kv.canary", **await engine.call(LLMEngine.kv_canary)}


def _admin_router() -> APIRouter:
    """``POST /admin/kv/quarantine``: lift a tier's quarantine after the canary caught it (the admin key;
    404 without ``--admin-key``)."""
    router = APIRouter(prefix="/admin/kv", dependencies=[Depends(check_admin)])

    @router.post("/quarantine")
    async def quarantine(request: Request) -> dict[str, Any]:
        body = parse_json(await request.body())  # read after the key: a stranger learns nothing from it
        names = body.get("release") if isinstance(body, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise APIError(400, 'the body must be {"release": ["host", ...]}', param="release")
        media = _media(names) or set()

        def release(e: LLMEngine) -> tuple[list[Medium], list[Medium]]:
            return e.release_quarantine(sorted(media, key=list(Medium).index)), e.quarantined()

        engine: AsyncEngine = request.app.state.engine
        released, left = await engine.call(release)
        return {"released": [str(m) for m in released], "quarantined": [str(m) for m in left]}

    return router
