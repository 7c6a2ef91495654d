"""Who may call what on ``kvtier serve``: four keys, each a role, checked before a body is read.

::

    role      its key (flag, env)                          routes
    ────────  ───────────────────────────────────────────  ──────────────────────────────────────────────
    open      none                                         GET /health, GET /dashboard (+ /dashboard/static/*:
                                                           the page holds no data; its fetches carry a key)
    client    --api-key ($KVTIER_API_KEY)                  POST /v1/chat/completions, /v1/completions,
                                                           /tokenize, /detokenize; GET /v1/models[/...],
                                                           GET /openapi.json; POST /v1/messages[/count_tokens]
                                                           (Anthropic's: the key as x-api-key too)
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
never grants it. A key is sent as ``Authorization: Bearer <key>`` (on Anthropic's ``/v1/messages`` also as
``x-api-key: <key>``) and compared in constant time; a
wrong one is a 401 with ``WWW-Authenticate: Bearer`` and OpenAI's error body (both the wire contract's,
:mod:`kvtier.server.protocol`, which ``kvtier router`` shares).

Why ``/v1/kv/blocks`` has its own role: its block hashes let whoever reads them test guesses of other
users' prompts (hash a guess, look it up). ``kvtier router`` reads ``/v1/kv/info`` and ``/v1/kv/blocks``
with the one key it holds for its replicas (its ``--api-key``), so without ``--kv-read-key`` those
routes take the client key and the router keeps working; an operator whose clients must not read block
hashes sets ``--kv-read-key`` and gives the router that key for its own calls to the replicas.
"""

from __future__ import annotations

import secrets
from typing import Protocol

from fastapi import Request

from kvtier.config import ConfigError
from kvtier.server.anthropic_errors import presents_key
from kvtier.server.protocol import not_found, presents, unauthorized


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


def _presents(request: Request, *keys: str | None) -> bool:
    """Whether the request carries one of ``keys`` (the Nones skipped)."""
    return presents(request.headers.get("authorization", ""), *keys)


def _keys(request: Request) -> Keys:
    return request.app.state.settings


# -------------------------------------------------------------------------- the roles' dependencies
def check_key(request: Request) -> None:
    """The client role: 401 unless the request carries the ``--api-key`` (when one is set)."""
    keys = _keys(request)
    if keys.api_key is not None and not _presents(request, keys.api_key):
        raise unauthorized("API key")


def check_messages_key(request: Request) -> None:
    """The client role on Anthropic's Messages API: the ``--api-key`` as ``Authorization: Bearer`` or as
    ``x-api-key`` (Anthropic's header)."""
    keys = _keys(request)
    if keys.api_key is not None and not presents_key(request.headers, keys.api_key):
        raise unauthorized("API key")


def check_kv_info(request: Request) -> None:
    """``/v1/kv/info``: any of the client, kv reader and admin keys (open when no client key is set)."""
    keys = _keys(request)
    if keys.api_key is not None and not _presents(request, keys.api_key, keys.kv_read_key, keys.admin_key):
        raise unauthorized("API key")


def check_kv_reader(request: Request) -> None:
    """The cache's internals: ``--kv-read-key`` or the admin key; without ``--kv-read-key``, as the
    client role (the client key, or the admin key)."""
    keys = _keys(request)
    if keys.kv_read_key is None:
        if keys.api_key is not None and not _presents(request, keys.api_key, keys.admin_key):
            raise unauthorized("API key")
        return
    if not _presents(request, keys.kv_read_key, keys.admin_key):
        raise unauthorized("KV read key (--kv-read-key)")


def check_metrics(request: Request) -> None:
    """``/metrics``: open without ``--metrics-key``; else that key or the admin key."""
    keys = _keys(request)
    if keys.metrics_key is not None and not _presents(request, keys.metrics_key, keys.admin_key):
        raise unauthorized("metrics key (--metrics-key)")


def check_admin(request: Request) -> None:
    """``/admin/*``: 404 without ``--admin-key`` (the route does not exist), 401 without that key."""
    keys = _keys(request)
    if keys.admin_key is None:
        raise not_found()
    if not _presents(request, keys.admin_key):
        raise unauthorized("admin key (--admin-key)")
