"""Who may call what on ``kvtier serve``: four keys, each a role, checked before a body is read.

::

    role      its key (flag, env)                          routes
    ────────  ───────────────────────────────────────────  ──────────────────────────────────────────────
    open      none                                         GET /health, GET /dashboard (+ /dashboard/static/*:
                                                           the page holds no data; its fetches carry a key)
    client    --api-key ($KVTIER_API_KEY)                  POST /v1/chat/completions, /v1/completions,
                                                           /tokenize, /detokenize; GET /v1/models[/...],
                                                           GET /openapi.json
    kv info   the client's, the kv reader's or the admin's GET /v1/kv/info (model identity: the router's
                                                           check of a replica)
    kv reader --kv-read-key ($KVTIER_KV_READ_KEY), or the  GET /v1/kv/blocks, /v1/kv/canary, /v1/kv/advice,
              admin's; without --kv-read-key the client's  /v1/kv/dashboard
    metrics   --metrics-key ($KVTIER_METRICS_KEY), or the  GET /metrics (open when no --metrics-key is set:
              admin's                                      Prometheus scrapes it as before)
    admin     --admin-key ($KVTIER_ADMIN_KEY) only         /admin/* (POST /admin/kv/quarantine)

A key that is not set leaves its role open, except the admin's: **without ``--admin-key`` every
``/admin/*`` route answers 404** (the route does not exist for anyone; ``kvtier router`` follows the same
convention), and with it a wrong or missing key is a 401 and the client key is never accepted there.
The admin key must differ from every other key (``check_distinct``), so holding a lower role's key
never grants it. A key is sent as ``Authorization: Bearer <key>`` and compared in constant time; a
wrong one is a 401 with ``WWW-Authenticate: Bearer`` and OpenAI's error body.

Why ``/v1/kv/blocks`` has its own role: its block hashes let whoever reads them test guesses of other
users' prompts (hash a guess, look it up). ``kvtier router`` reads ``/v1/kv/info`` and ``/v1/kv/blocks``
with the one key it holds for its replicas (its ``--api-key``), so without ``--kv-read-key`` those
routes take the client key and the router keeps working; an operator whose clients must not read block
hashes sets ``--kv-read-key`` and gives the router that key for its own calls to the replicas.

``tenant_salt`` and ``tenant_of`` derive a request's prefix-cache salt and fair-share key from the
client key it presented (``--prefix-cache-scope user``).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import TYPE_CHECKING, Protocol

from fastapi import Request

from kvtier.config import ConfigError
from kvtier.server.protocol import APIError

if TYPE_CHECKING:
    from kvtier.server.protocol import GenerationRequest


class Keys(Protocol):
    """The keys of a server's settings (``ServerSettings``); None: not set."""

    api_key: str | None
    admin_key: str | None
    kv_read_key: str | None
    metrics_key: str | None


def check_distinct(keys: Keys) -> None:
    """ConfigError when the admin key equals another role's key (that role would then be admin too)."""
    if keys.admin_key is None:
        return
    others = (("--api-key", keys.api_key), ("--kv-read-key", keys.kv_read_key))
    for flag, other in (*others, ("--metrics-key", keys.metrics_key)):
        if other is not None and secrets.compare_digest(other.encode(), keys.admin_key.encode()):
            raise ConfigError(f"--admin-key must differ from {flag} (its holders would be admins)")


def _bearer(request: Request) -> bytes | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else None


def _presents(request: Request, *keys: str | None) -> bool:
    """Whether the request carries one of ``keys`` (the Nones skipped); every key compared."""
    token = _bearer(request)
    if token is None:
        return False
    matches = [secrets.compare_digest(token, key.encode()) for key in keys if key is not None]
    return any(matches)


def _refuse(what: str) -> APIError:
    return APIError(
        401,
        f"Incorrect or missing {what} (send 'Authorization: Bearer <key>').",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _keys(request: Request) -> Keys:
    return request.app.state.settings


# -------------------------------------------------------------------------- the roles' dependencies
def check_key(request: Request) -> None:
    """The client role: 401 unless the request carries the ``--api-key`` (when one is set)."""
    keys = _keys(request)
    if keys.api_key is not None and not _presents(request, keys.api_key):
        raise _refuse("API key")


def check_kv_info(request: Request) -> None:
    """``/v1/kv/info``: any of the client, kv reader and admin keys (open when no client key is set)."""
    keys = _keys(request)
    if keys.api_key is not None and not _presents(request, keys.api_key, keys.kv_read_key, keys.admin_key):
        raise _refuse("API key")


def check_kv_reader(request: Request) -> None:
    """The cache's internals: ``--kv-read-key`` or the admin key; without ``--kv-read-key``, as the
    client role (the client key, or the admin key)."""
    keys = _keys(request)
    if keys.kv_read_key is None:
        if keys.api_key is not None and not _presents(request, keys.api_key, keys.admin_key):
            raise _refuse("API key")
        return
    if not _presents(request, keys.kv_read_key, keys.admin_key):
        raise _refuse("KV read key (--kv-read-key)")


def check_metrics(request: Request) -> None:
    """``/metrics``: open without ``--metrics-key``; else that key or the admin key."""
    keys = _keys(request)
    if keys.metrics_key is not None and not _presents(request, keys.metrics_key, keys.admin_key):
        raise _refuse("metrics key (--metrics-key)")


def check_admin(request: Request) -> None:
    """``/admin/*``: 404 without ``--admin-key`` (the route does not exist), 401 without that key."""
    keys = _keys(request)
    if keys.admin_key is None:
        raise APIError(404, "Not Found", code="not_found")
    if not _presents(request, keys.admin_key):
        raise _refuse("admin key (--admin-key)")


# -------------------------------------------------------------------------------------- tenants
def tenant_salt(request: Request, body: GenerationRequest) -> str | None:
    """The request's ``cache_salt``; with ``--prefix-cache-scope user`` one derived from its tenant (the
    key it presented and its ``user`` field; neither: the anonymous tenant) and its own salt."""
    if request.app.state.settings.prefix_cache_scope != "user":
        return body.cache_salt
    _, _, key = request.headers.get("authorization", "").partition(" ")
    parts = (key.strip(), body.user or "", body.cache_salt or "")
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def tenant_of(request: Request, body: GenerationRequest) -> str:
    """The request's fair-share key: its API key and ``user`` field, hashed (neither: "")."""
    _, _, key = request.headers.get("authorization", "").partition(" ")
    if not key.strip() and not body.user:
        return ""
    return hashlib.sha256(json.dumps((key.strip(), body.user or "")).encode()).hexdigest()[:16]
