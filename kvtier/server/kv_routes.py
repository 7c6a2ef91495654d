"""KV inspection for a cache-aware router: ``GET /v1/kv/info`` and ``GET /v1/kv/blocks``.

::

    GET /v1/kv/info      {"object": "kv.info", "model": ..., "replica_id": ..., "hash_spec_version": 1,
                          "block_size": 16, "model_fingerprint": ..., "kv_dtype": "float32",
                          "cache_identity": "<fingerprint>:<dtype>", "enable_prefix_caching": true,
                          "media": ["device", "host", ...],
                          "events": {"enabled": ..., "stream": "kvtier:v1:events:<replica_id>",
                                     "wire_version": 1, "instance": ...}}
    GET /v1/kv/blocks    {"object": "kv.blocks", "replica_id": ..., "instance": ..., "seq": 42,
                          "block_size": 16, "blocks": {"device": ["<64 hex>", ...], "host": [...], ...}}
    GET /v1/kv/blocks?medium=host&medium=disk     only those media (also ?medium=host,disk)

``blocks`` is taken on the engine thread between two steps, so it is exactly the state after event batch
``seq`` of ``instance`` (``null`` without events): a router seeds its index from it and applies the
stream's batches after ``seq`` (``kvtier.kv_events.BlockIndex.seed``). Both routes need the API key
when the server has one; errors are OpenAI-shaped (400 for an unknown medium, 503 while loading).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from kvtier.engine import LLMEngine
from kvtier.server.async_engine import AsyncEngine
from kvtier.server.protocol import APIError
from kvtier.stats import Medium


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


def kv_router(check_key: Callable[[Request], None]) -> APIRouter:
    """The ``/v1/kv`` routes, behind the same key check as the other ``/v1`` routes; they read the
    engine and the settings from ``request.app.state``."""
    router = APIRouter(prefix="/v1/kv", dependencies=[Depends(check_key)])

    @router.get("/info")
    async def info(request: Request) -> dict[str, Any]:
        engine: AsyncEngine = request.app.state.engine
        answer = await engine.call(LLMEngine.kv_info)
        return {"object": "kv.info", "model": request.app.state.settings.model_name, **answer}

    @router.get("/blocks")
    async def blocks(request: Request, medium: list[str] | None = Query(default=None)) -> dict[str, Any]:  # noqa: B008
        wanted = _media(medium)

        def snapshot(e: LLMEngine) -> tuple[dict[Medium, list[bytes]], int | None, str | None, str, int]:
            held, seq = e.kv_blocks()
            instance = e.kv_events.instance if e.kv_events is not None else None
            return held, seq, instance, e.replica_id, e.kv.block_size

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

    return router
