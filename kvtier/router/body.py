"""A request's body: bounded, timed, parsed, or an OpenAI-shaped 4xx, never a 500.

::

    bytes arrive ─► RequestLimits (kvtier.server.limits, the ASGI middleware kvtier serve uses):
                    over --max-request-bytes: 413 (Content-Length at once, else as chunks come)
                    slower than --timeout-body: 408
                 ─► read_body: the bytes (the same size bound, for an app run without the middleware)
                 ─► parse_json: 400 invalid_json for bad UTF-8, bad JSON, or nesting too deep for
                    ``json.loads`` (a 100k-deep ``[[[...`` raises RecursionError: caught)

The request line and headers are timed before any of this, by uvicorn's protocol
(``TimedH11Protocol``, ``--timeout-header``; see :mod:`kvtier.router.cli`).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from kvtier.server.protocol import APIError, invalid_json


async def read_body(request: Request) -> bytes:
    """The body, at most ``--max-request-bytes`` (413 beyond, as the replicas answer)."""
    limit = request.app.state.router.settings.max_request_bytes
    too_large = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(body: bytes) -> Any:
    """The body's JSON value; a 400 (``invalid_json``) when it is not JSON or nests too deep."""
    try:
        return json.loads(body)
    except RecursionError:
        reason = "it nests too deeply"
    except UnicodeDecodeError:
        reason = "it is not UTF-8"
    except ValueError as exc:
        reason = str(exc)
    raise invalid_json(reason)


async def read_json(request: Request) -> Any:
    """:func:`read_body`, then :func:`parse_json`."""
    return parse_json(await read_body(request))
