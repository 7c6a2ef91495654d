"""``/dashboard``: a live page of the cache, and the JSON it polls every second.

::

    GET /dashboard                  the page (one HTML file; its script and style below; no key needed:
                                    it holds no data, its fetches carry the key)
    GET /dashboard/static/{name}    dashboard.js, dashboard.css (package data in kvtier/server/static/)
    GET /v1/kv/dashboard            the page's data: the KV reader's key (--kv-read-key, or the admin key;
                                    without --kv-read-key the API key when the server has one; see auth.py)

    {"object": "kv.dashboard", "model", "replica_id", "time", "uptime_s", "block_size",
     "totals":  {"num_requests_running", "num_requests_waiting", "kv_cache_usage", "prefix_cache_queries",
                 "prefix_cache_hits", "prompt_tokens", "generation_tokens", "num_preemptions": {mode: n},
                 "canary_checks": {"match": {tier: n}, "mismatch": {tier: n}}, "retained_keys",
                 "retained_hit_tokens", "kv_block_bytes"},
     "tiers":   {"device": {"capacity_blocks", "used_blocks", "usage", "lookups", "hit_blocks",
                            "hit_tokens", "blocks_loaded", "blocks_stored", "blocks_evicted", "hit_rate",
                            "recent_hit_rate", "retained_blocks", "retained_bytes"},
                 "host": {...}, ...},                                  (the tiers this engine has)
     "history": {"interval_s": 1, "seconds": 300, "points": [{"t", "usage": {tier: 0..1},
                 "hit_rate": {tier: 0..1 | null}, "lookups": {tier: n}, "hit_blocks": {tier: n},
                 "prefix_hit_rate", "running", "waiting", "preemptions", "prompt_tokens",
                 "generation_tokens"}, ...]},       (oldest first; counters per interval, gauges at its end)
     "block_map": {"num_blocks", "blocks_per_cell", "cells": ".dDh..", "counts": {"free", "cached", "in_use"},
                   "by_origin": {tier: {"cached", "in_use"}}},
     "requests": {"running": [seq...], "waiting": [seq...], "num_running", "num_waiting"},
     "features": {"advice": bool, "canary": bool}}

The counters are the same snapshot ``/metrics`` exposes (taken after every engine step), so when the
engine is idle the page's numbers equal the Prometheus ones. Prompt-cache retention
(docs/prompt-caching.md): ``retained_keys`` (keys retained now), ``retained_hit_tokens`` (prompt tokens of
retaining requests served from the cache) and each tier's ``retained_blocks`` (what it keeps from
eviction; recounted at most once a second), in bytes ``retained_blocks x kv_block_bytes``.
``block_map.cells`` has one character per device block (per ``blocks_per_cell`` blocks in a pool larger
than ``MAX_CELLS``: the busiest of them)::

    .        free (no KV)
    d h k r  cached idle: holds KV that was computed on the device / loaded from host, disk, remote
    D H K R  in use by a running sequence, same origins

The history holds the last ``HISTORY_S`` seconds of snapshots, one a second, taken on the server (a
background task while the app runs, and on each request of the page): it is there when the page opens.
``features`` says whether ``/v1/kv/advice`` (miss-ratio curves) and ``/v1/kv/canary`` are served, so the
page asks only for what exists. ``kvtier router`` serves the same page (``page_routes``); there it shows
the cluster from ``/router/state``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route

from kvtier.stats import EngineStats, Medium, TierSnapshot

if TYPE_CHECKING:  # plain Starlette at import, no torch nor FastAPI: ``kvtier router`` serves the page too
    from fastapi import APIRouter

    from kvtier.engine import LLMEngine
    from kvtier.server.async_engine import AsyncEngine

HISTORY_S = 300  # seconds of history kept
SAMPLE_EVERY_S = 1.0
RECENT_S = 60  # the window of a tier's "recent" hit rate
MAX_CELLS = 4096  # block-map cells; a larger pool is shown several blocks per cell
MAX_LISTED = 50  # running / waiting sequences listed (the counts are always whole)
_ORIGIN_CHARS = {Medium.DEVICE: "d", Medium.HOST: "h", Medium.DISK: "k", Medium.REMOTE: "r"}
_STATIC = {"dashboard.js": "text/javascript", "dashboard.css": "text/css", "dashboard.html": "text/html"}
_TIER_FIELDS = ("capacity_blocks", "used_blocks", "lookups", "hit_blocks", "blocks_loaded")
_TIER_FIELDS += ("blocks_stored", "blocks_evicted")


# ------------------------------------------------------------------------------------- history
@dataclass(frozen=True)
class _Sample:
    t: float  # time.time()
    stats: EngineStats


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _tier(stats: EngineStats, medium: Medium) -> TierSnapshot | None:
    return stats.tiers.get(medium)


class History:
    """The engine's snapshots of the last ``seconds``, at most one per ``every`` seconds, and the rates
    between consecutive ones. ``sample`` is called from the event loop only."""

    def __init__(self, seconds: float = HISTORY_S, every: float = SAMPLE_EVERY_S) -> None:
        self.every = every
        self.seconds = seconds
        self._samples: deque[_Sample] = deque(maxlen=int(seconds / every) + 1)

    def sample(self, stats: EngineStats | None, now: float | None = None) -> None:
        """Keep ``stats`` unless the newest sample is younger than ``every`` (minus some slack)."""
        if stats is None:
            return
        now = time.time() if now is None else now
        if self._samples and now - self._samples[-1].t < 0.9 * self.every:
            return
        self._samples.append(_Sample(now, stats))

    def points(self) -> list[dict[str, Any]]:
        """One point per interval between two samples, oldest first (rates over that interval)."""
        samples = list(self._samples)
        return [_point(a, b) for a, b in zip(samples, samples[1:], strict=False)]

    def recent_hit_rate(self, medium: Medium, window: float = RECENT_S) -> float | None:
        """The tier's hit rate over the last ``window`` seconds (None: no lookups then)."""
        if len(self._samples) < 2:
            return None
        last = self._samples[-1]
        first = next((s for s in self._samples if last.t - s.t <= window), last)
        a, b = _tier(first.stats, medium), _tier(last.stats, medium)
        if a is None or b is None:
            return None
        return _ratio(b.hit_blocks - a.hit_blocks, b.lookups - a.lookups)


def _point(a: _Sample, b: _Sample) -> dict[str, Any]:
    """What happened between samples ``a`` and ``b``: gauges as of ``b``, counters as differences."""
    sa, sb = a.stats, b.stats
    usage, lookups, hits = {}, {}, {}
    for medium, tb in sb.tiers.items():
        ta = _tier(sa, medium) or tb
        usage[str(medium)] = tb.usage
        lookups[str(medium)] = tb.lookups - ta.lookups
        hits[str(medium)] = tb.hit_blocks - ta.hit_blocks
    return {
        "t": b.t,
        "usage": usage,
        "hit_rate": {m: _ratio(hits[m], n) for m, n in lookups.items()},
        "lookups": lookups,
        "hit_blocks": hits,
        "prefix_hit_rate": _ratio(
            sb.prefix_cache_hits - sa.prefix_cache_hits, sb.prefix_cache_queries - sa.prefix_cache_queries
        ),
        "running": sb.num_requests_running,
        "waiting": sb.num_requests_waiting,
        "preemptions": sum(sb.num_preemptions.values()) - sum(sa.num_preemptions.values()),
        "prompt_tokens": sb.prompt_tokens - sa.prompt_tokens,
        "generation_tokens": sb.generation_tokens - sa.generation_tokens,
    }


# ------------------------------------------------------------------------------- the snapshot
def _totals(stats: EngineStats) -> dict[str, Any]:
    return {
        "num_requests_running": stats.num_requests_running,
        "num_requests_waiting": stats.num_requests_waiting,
        "kv_cache_usage": stats.kv_cache_usage,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "prompt_tokens": stats.prompt_tokens,
        "generation_tokens": stats.generation_tokens,
        "num_preemptions": dict(stats.num_preemptions),
        # the equivalence canary's checks by result and serving tier (kvtier/insight/canary.py)
        "canary_checks": {
            result: {tier: n for (r, tier), n in sorted(stats.canary_checks.items()) if r == result}
            for result in ("match", "mismatch")
        },
        # prompt-cache retention (kvtier/kv/retention.py)
        "retained_keys": stats.retained_keys,
        "retained_hit_tokens": stats.retained_hit_tokens,
        "kv_block_bytes": stats.kv_block_bytes,
    }


def _tiers(stats: EngineStats, history: History) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for medium, snap in stats.tiers.items():
        tier: dict[str, Any] = {name: getattr(snap, name) for name in _TIER_FIELDS}
        tier.update(
            usage=snap.usage,
            hit_tokens=snap.hit_tokens,
            hit_rate=_ratio(snap.hit_blocks, snap.lookups),
            recent_hit_rate=history.recent_hit_rate(medium),
            retained_blocks=snap.retained_blocks,
            retained_bytes=snap.retained_blocks * stats.kv_block_bytes,
        )
        out[str(medium)] = tier
    return out


def block_map(
    states: list[str], origins: dict[int, Medium] | None = None, max_cells: int = MAX_CELLS
) -> dict[str, Any]:
    """The device pool as ``cells`` (see the module doc) with counts by state and by origin tier, from
    each block's state and the origin of the blocks loaded from a lower tier (``KVCacheManager.block_map``).
    """
    origins = origins or {}
    chars = ["." if s == "free" else "D" if s == "in_use" else "d" for s in states]
    counts = {state: states.count(state) for state in ("free", "cached", "in_use")}
    by_origin = {"device": {"cached": counts["cached"], "in_use": counts["in_use"]}}
    for block_id, medium in origins.items():
        state = states[block_id]
        if state == "free":
            continue
        char = _ORIGIN_CHARS[medium]
        chars[block_id] = char.upper() if state == "in_use" else char
        by_origin["device"][state] -= 1
        by_origin.setdefault(str(medium), {"cached": 0, "in_use": 0})[state] += 1
    per_cell = max(1, -(-len(chars) // max_cells))
    if per_cell > 1:  # the busiest block of each group: in use, else cached, else free
        rank = lambda c: 2 if c.isupper() else 0 if c == "." else 1  # noqa: E731
        chars = [max(chars[i : i + per_cell], key=rank) for i in range(0, len(chars), per_cell)]
    return {
        "num_blocks": len(states),
        "blocks_per_cell": per_cell,
        "cells": "".join(chars),
        "counts": counts,
        "by_origin": {medium: n for medium, n in by_origin.items() if n["cached"] or n["in_use"]},
    }


def engine_view(engine: LLMEngine) -> dict[str, Any]:
    """What only the engine thread can read: each block's state and the sequences (``AsyncEngine.call``;
    ``block_states`` is encoded by :func:`block_map` off that thread)."""
    return engine.describe(MAX_LISTED)


def _serves(app: Starlette, path: str) -> bool:
    """Whether some route of ``app`` answers ``GET path`` (asked of the routes themselves: FastAPI may
    keep included routers nested)."""
    scope = {"type": "http", "path": path, "method": "GET", "root_path": ""}
    return any(route.matches(scope)[0] == Match.FULL for route in app.router.routes)


def _features(app: Starlette) -> dict[str, bool]:
    """Which of the cache's other JSON endpoints this app serves (the page fetches only those)."""
    return {"advice": _serves(app, "/v1/kv/advice"), "canary": _serves(app, "/v1/kv/canary")}


async def dashboard_data(request: Request) -> dict[str, Any]:
    """The whole ``/v1/kv/dashboard`` answer (503 while the model loads)."""
    state = request.app.state
    engine: AsyncEngine = state.engine
    view = await engine.call(engine_view)
    view["block_map"] = await asyncio.to_thread(block_map, *view.pop("block_states"))
    stats = engine.stats
    history: History = state.dashboard_history
    history.sample(stats)
    return {
        "object": "kv.dashboard",
        "model": state.settings.model_name,
        "time": time.time(),
        "uptime_s": time.time() - state.started,
        **view,
        "totals": _totals(stats) if stats is not None else None,
        "tiers": _tiers(stats, history) if stats is not None else {},
        "history": {"interval_s": history.every, "seconds": history.seconds, "points": history.points()},
        "features": _features(request.app),
    }


# ---------------------------------------------------------------------------------------- routes
def _asset(name: str, body: bytes | None = None) -> Response:
    """A static file of the page (``body``: its content, already read and changed)."""
    media_type = _STATIC.get(name)
    if media_type is None:
        raise HTTPException(404, f"no dashboard asset named {name!r}")  # the app's OpenAI-shaped 404
    if body is None:
        body = resources.files("kvtier.server").joinpath("static", name).read_bytes()
    return Response(body, media_type=media_type, headers={"Cache-Control": "no-cache"})


def page_routes(cluster: bool = False) -> list[Route]:
    """``GET /dashboard`` and its static files (plain Starlette routes, no data). ``cluster``: the page of
    ``kvtier router``, which polls ``router/state`` and links each replica's own page, instead of
    ``v1/kv/dashboard``."""

    async def page(request: Request) -> Response:
        html = resources.files("kvtier.server").joinpath("static", "dashboard.html").read_bytes()
        if cluster:
            html = html.replace(b'data-mode="replica"', b'data-mode="cluster"', 1)
        return _asset("dashboard.html", html)

    async def static(request: Request) -> Response:
        return _asset(request.path_params["name"])

    return [
        Route("/dashboard", page, methods=["GET"], include_in_schema=False),
        Route("/dashboard/static/{name}", static, methods=["GET"], include_in_schema=False),
    ]


@contextlib.asynccontextmanager
async def _sampling(app: Starlette) -> AsyncIterator[None]:
    """While the app runs, sample the engine's snapshot every second into the history."""
    history: History = app.state.dashboard_history

    async def loop() -> None:
        while True:
            history.sample(app.state.engine.stats)
            await asyncio.sleep(history.every)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def dashboard_router(app: Starlette, check_reader: Callable[[Request], None]) -> APIRouter:
    """The page, its static files, and ``GET /v1/kv/dashboard`` (behind ``check_reader``), for an app
    whose ``state`` has ``engine``, ``settings`` and ``started`` (``kvtier.server.app.create_app``)."""
    from fastapi import APIRouter, Depends

    app.state.dashboard_history = History()
    router = APIRouter(routes=page_routes(), lifespan=_sampling)  # type: ignore[arg-type]
    data = APIRouter(prefix="/v1/kv", dependencies=[Depends(check_reader)])
    data.add_api_route("/dashboard", dashboard_data, methods=["GET"])
    router.include_router(data)
    return router
