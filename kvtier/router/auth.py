"""Who may call what on the router: three keys, three roles, each off until its flag is given.

::

    role     flag (env)                          routes                           without the flag
    client   --api-key (KVTIER_API_KEY)          /v1/..., /tokenize, /detokenize  open
                                                 /router/state, /router/explain   open (admin key too)
    admin    --admin-key (KVTIER_ADMIN_KEY)      /admin/...                       404: no such routes
    metrics  --metrics-key (KVTIER_METRICS_KEY)  /metrics (the admin key too)     open (Prometheus)
    -        none                                /health, /dashboard (+ static)   always open

Every key is sent as ``Authorization: Bearer <key>`` and compared in constant time. A wrong or missing
key is a 401 (``invalid_api_key``, ``WWW-Authenticate: Bearer``). The admin routes never take the
client key: a client cannot add a replica (which would then receive other clients' prompts and
headers) or remove one. ``/dashboard`` holds no data: its script reads ``/router/state`` with the key
the user gives it.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from kvtier.router.errors import RouterError

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Keys:
    """The router's keys (None: that role is off; see the table above)."""

    api: str | None = None
    admin: str | None = None
    metrics: str | None = None


def bearer(request: Request) -> str | None:
    """The token of ``Authorization: Bearer <token>``, or None."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _matches(token: str | None, key: str | None) -> bool:
    return token is not None and key is not None and secrets.compare_digest(token.encode(), key.encode())


def _refuse(what: str) -> RouterError:
    return RouterError(
        401,
        f"Incorrect or missing {what} (send 'Authorization: Bearer <key>').",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _keys(request: Request) -> Keys:
    return request.app.state.router.keys


def check_client(request: Request) -> None:
    """401 unless the client key is off or given."""
    keys = _keys(request)
    if keys.api is not None and not _matches(bearer(request), keys.api):
        raise _refuse("API key")


def check_reader(request: Request) -> None:
    """``/router/state``, ``/router/explain``: the client key (when on) or the admin key."""
    keys = _keys(request)
    if keys.api is None:
        return
    token = bearer(request)
    if not (_matches(token, keys.api) or _matches(token, keys.admin)):
        raise _refuse("API key")


def check_admin(request: Request) -> None:
    """404 while the admin role is off (the routes do not exist); 401 for any other key than it."""
    keys = _keys(request)
    if keys.admin is None:
        raise RouterError(404, "Not Found", code="not_found")
    if not _matches(bearer(request), keys.admin):
        raise _refuse("admin key (--admin-key; the client key is not accepted here)")


def check_metrics(request: Request) -> None:
    """``/metrics``: open without ``--metrics-key``; with it, that key or the admin key."""
    keys = _keys(request)
    if keys.metrics is None:
        return
    token = bearer(request)
    if not (_matches(token, keys.metrics) or _matches(token, keys.admin)):
        raise _refuse("metrics key")


def guarded(check: Callable[[Request], None], handler: Handler) -> Handler:
    """``handler`` behind ``check`` (which raises the refusal)."""

    async def checked(request: Request) -> Response:
        check(request)
        return await handler(request)

    checked.__name__ = handler.__name__
    return checked
