"""Who may call what on the router: three keys, three roles, each off until its flag is given.

::

    role     flag (env)                          routes                           without the flag
    client   --api-key (KVTIER_API_KEY)          /v1/..., /tokenize, /detokenize  open
                                                 /router/state, /router/explain   open (admin key too)
    admin    --admin-key (KVTIER_ADMIN_KEY)      /admin/...                       404: no such routes
    metrics  --metrics-key (KVTIER_METRICS_KEY)  /metrics (the admin key too)     open (Prometheus)
    -        none                                /health, /dashboard (+ static)   always open

Every key is sent as ``Authorization: Bearer <key>`` and compared in constant time. A wrong or missing
key is a 401 (``invalid_api_key``, ``WWW-Authenticate: Bearer``): the replicas' wire contract
(:mod:`kvtier.server.protocol`), so a client sees the same refusal from the router as from a replica.
The admin routes never take the client key: a client cannot add a replica (which would then receive
other clients' prompts and headers) or remove one. ``/dashboard`` holds no data: its script reads
``/router/state`` with the key the user gives it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from kvtier.server.protocol import not_found, presents, unauthorized

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Keys:
    """The router's keys (None: that role is off; see the table above)."""

    api: str | None = None
    admin: str | None = None
    metrics: str | None = None


def _presents(request: Request, *keys: str | None) -> bool:
    """Whether the request carries one of ``keys`` (the Nones skipped)."""
    return presents(request.headers.get("authorization", ""), *keys)


def _keys(request: Request) -> Keys:
    return request.app.state.router.keys


def check_client(request: Request) -> None:
    """401 unless the client key is off or given."""
    keys = _keys(request)
    if keys.api is not None and not _presents(request, keys.api):
        raise unauthorized("API key")


def check_reader(request: Request) -> None:
    """``/router/state``, ``/router/explain``: the client key (when on) or the admin key."""
    keys = _keys(request)
    if keys.api is None:
        return
    if not _presents(request, keys.api, keys.admin):
        raise unauthorized("API key")


def check_admin(request: Request) -> None:
    """404 while the admin role is off (the routes do not exist); 401 for any other key than it."""
    keys = _keys(request)
    if keys.admin is None:
        raise not_found()
    if not _presents(request, keys.admin):
        raise unauthorized("admin key (--admin-key; the client key is not accepted here)")


def check_metrics(request: Request) -> None:
    """``/metrics``: open without ``--metrics-key``; with it, that key or the admin key."""
    keys = _keys(request)
    if keys.metrics is None:
        return
    if not _presents(request, keys.metrics, keys.admin):
        raise unauthorized("metrics key")


def guarded(check: Callable[[Request], None], handler: Handler) -> Handler:
    """``handler`` behind ``check`` (which raises the refusal)."""

    async def checked(request: Request) -> Response:
        check(request)
        return await handler(request)

    checked.__name__ = handler.__name__
    return checked
