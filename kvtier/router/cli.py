"""``kvtier router``: the flags, and running the router with uvicorn.

::

    kvtier router --host 0.0.0.0 --port 8000 \\
                  --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 \\
                  [--kv-remote-url redis://127.0.0.1:6379/0] \\
                  [--policy cache_aware|round_robin|least_loaded] \\
                  [--api-key KEY] [--admin-key KEY] [--metrics-key KEY] [--kv-read-key KEY] \\
                  [--model PATH] [--prefix-cache-scope shared|user] \\
                  [--timeout-header 10] [--timeout-body 30] \\
                  [--disagg-min-prompt-tokens 512] [--disagg-publish-timeout 5]

The keys are roles (kvtier.router.auth): the client key for /v1 and /router, the admin key for /admin
(off, 404, without it; never the client key), the metrics key for /metrics (open without it); the KV
read key is the one the router presents to the replicas (their ``--kv-read-key``; default the client
key). Every key flag defaults to its environment variable (KVTIER_API_KEY, KVTIER_ADMIN_KEY,
KVTIER_METRICS_KEY, KVTIER_KV_READ_KEY), an empty one meaning none: a key in the environment stays
out of ``ps``. uvicorn runs with kvtier serve's h11 protocol that times
the request line and headers (``kvtier.server.limits.TimedH11Protocol``): a connection that has not sent
its headers within --timeout-header is closed, so a slowloris cannot hold the router's descriptors.

Importing this module is cheap (``kvtier --help`` may import it); FastAPI and uvicorn load in ``main``.
Nothing the router imports pulls in torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvtier.config import ConfigError
from kvtier.router.policy import POLICIES, CostModel


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("router")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    g.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="a 'kvtier serve' replica, http://host:port (repeatable; more: POST /admin/replicas)",
    )
    g.add_argument(
        "--kv-remote-url",
        default=None,
        help="the Redis the replicas publish KV events to (redis://host:port/db): the router follows "
        "their event streams; without it, it polls each replica's GET /v1/kv/blocks",
    )
    g.add_argument("--policy", choices=POLICIES, default="cache_aware", help="default cache_aware")
    g.add_argument(
        "--api-key",
        default=os.environ.get("KVTIER_API_KEY"),
        help="the client key: /v1, /tokenize, /router need 'Authorization: Bearer KEY' (default: "
        "$KVTIER_API_KEY, else none); the router passes the client's header on and, without "
        "--kv-read-key, uses the key for its own calls to the replicas",
    )
    g.add_argument(
        "--kv-read-key",
        default=os.environ.get("KVTIER_KV_READ_KEY"),
        help="the key the router sends on its own calls to the replicas (/v1/kv/info, /v1/kv/blocks): "
        "the replicas' --kv-read-key (default: $KVTIER_KV_READ_KEY, else --api-key)",
    )
    g.add_argument(
        "--admin-key",
        default=os.environ.get("KVTIER_ADMIN_KEY"),
        help="the admin key: /admin/replicas needs it and takes no other (default: $KVTIER_ADMIN_KEY, "
        "else none: the /admin routes answer 404)",
    )
    g.add_argument(
        "--metrics-key",
        default=os.environ.get("KVTIER_METRICS_KEY"),
        help="/metrics needs this key or the admin key (default: $KVTIER_METRICS_KEY, else none: "
        "/metrics is open for Prometheus)",
    )
    g.add_argument(
        "--model",
        default=None,
        help="where the tokenizer comes from: the model the replicas serve (default: the embedded "
        "SmolLM2, like kvtier serve); checked against each replica's model fingerprint",
    )
    g.add_argument(
        "--prefix-cache-scope",
        choices=["shared", "user"],
        default="shared",
        help="as the replicas were started with (default shared)",
    )
    _add_tuning_args(p)
    p.set_defaults(func=main)


def _add_tuning_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("router tuning")
    cost = CostModel()
    g.add_argument(
        "--load-tokens",
        type=float,
        default=cost.load_tokens,
        help="one queued request weighs like this many uncached prompt tokens "
        f"(default {cost.load_tokens:g})",
    )
    g.add_argument(
        "--remote-cost",
        type=float,
        default=cost.remote_cost,
        help="a block in the shared remote tier costs this fraction of computing it "
        f"(default {cost.remote_cost:g})",
    )
    g.add_argument(
        "--disagg-min-prompt-tokens",
        type=int,
        default=512,
        help="with prefill replicas (kvtier serve --role prefill): a prompt with fewer uncached tokens "
        "than this on the best decode replica goes straight to it, without a prefill handoff (default 512)",
    )
    g.add_argument(
        "--disagg-publish-timeout",
        type=float,
        default=5.0,
        help="seconds to wait after a prefill for its blocks to reach the remote tier before handing off "
        "anyway (the decode replica computes what is missing; default 5, at most 30)",
    )
    g.add_argument("--poll-interval", type=float, default=1.0, help="seconds between polls (default 1)")
    g.add_argument(
        "--max-index-blocks",
        type=int,
        default=262_144,
        help="blocks remembered per replica; the oldest are forgotten beyond (default 262144)",
    )
    g.add_argument(
        "--max-request-bytes", type=int, default=4 * 2**20, help="largest request body (default 4 MiB)"
    )
    g.add_argument(
        "--timeout-header",
        type=float,
        default=10.0,
        help="seconds for a request line and headers; the connection is closed after (default 10; 0: none)",
    )
    g.add_argument(
        "--timeout-body",
        type=float,
        default=30.0,
        help="seconds for a request body; 408 after (default 30; 0: none)",
    )
    g.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="default warning",
    )


def settings_from(ns: argparse.Namespace):  # noqa: ANN201 (RouterSettings, imported lazily)
    from kvtier.router.core import RouterSettings
    from kvtier.router.replicas import normalize_url

    if not 0 <= ns.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {ns.port}")
    for flag in ("load_tokens", "remote_cost", "poll_interval", "timeout_header", "timeout_body"):
        value = getattr(ns, flag)
        if not 0 <= value < float("inf"):
            raise ConfigError(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {value}")
    if not 0 <= ns.disagg_publish_timeout <= 30:
        raise ConfigError(f"--disagg-publish-timeout must be in [0, 30], got {ns.disagg_publish_timeout}")
    if ns.disagg_min_prompt_tokens < 0:
        raise ConfigError(f"--disagg-min-prompt-tokens must be >= 0, got {ns.disagg_min_prompt_tokens}")
    for flag in ("max_index_blocks", "max_request_bytes"):
        if getattr(ns, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(ns, flag)}")
    if ns.kv_remote_url is not None and not ns.kv_remote_url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"--kv-remote-url must be a redis:// URL, got {ns.kv_remote_url!r}")
    try:
        replicas = [normalize_url(u) for u in ns.replica]
    except ValueError as exc:
        raise ConfigError(f"--replica: {exc}") from None
    keys = {
        flag: getattr(ns, flag) or None for flag in ("api_key", "kv_read_key", "admin_key", "metrics_key")
    }
    others = (keys["api_key"], keys["kv_read_key"], keys["metrics_key"])
    if keys["admin_key"] is not None and keys["admin_key"] in others:
        raise ConfigError("--admin-key must differ from every other key (a role of its own)")
    cost = CostModel(remote_cost=ns.remote_cost, load_tokens=ns.load_tokens)
    return RouterSettings(
        replicas=replicas,
        policy=ns.policy,
        kv_remote_url=ns.kv_remote_url,
        **keys,
        model=ns.model,
        prefix_cache_scope=ns.prefix_cache_scope,
        cost=cost,
        max_index_blocks=ns.max_index_blocks,
        max_request_bytes=ns.max_request_bytes,
        poll_interval=ns.poll_interval,
        timeout_header=ns.timeout_header,
        timeout_body=ns.timeout_body or None,
        disagg_min_prompt_tokens=ns.disagg_min_prompt_tokens,
        disagg_publish_timeout=ns.disagg_publish_timeout,
    )


def main(ns: argparse.Namespace) -> int:
    settings = settings_from(ns)
    import logging

    import uvicorn

    from kvtier.router.app import create_app
    from kvtier.server.serve import bind

    logging.basicConfig(level=ns.log_level.upper(), format="%(message)s")
    sock = bind(ns.host, ns.port)
    host, port = sock.getsockname()[:2]
    app = create_app(settings)
    mode = f"KV events from {settings.kv_remote_url}" if settings.kv_remote_url else "polling /v1/kv/blocks"
    print(
        f"kvtier: router on http://{host}:{port} ({settings.policy}, {mode}) in front of "
        f"{len(settings.replicas)} replica(s): {', '.join(settings.replicas) or 'none yet'}",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.Server(uvicorn_config(app, settings, ns.log_level)).run(sockets=[sock])
    return 0


def uvicorn_config(app: Any, settings: Any, log_level: str = "warning", loop: str = "auto") -> Any:
    """uvicorn's settings for the router (a ``uvicorn.Config``): h11 with kvtier serve's header timeout
    (``settings.timeout_header``; 0: plain h11), uvloop when installed (``loop="auto"``: with asyncio's
    own loop a request through the router took ~50 ms longer here; ``kvtier bench cluster`` measures
    the overhead). The body timeout is the app's own middleware (``kvtier.router.app``)."""
    import uvicorn

    from kvtier.server.limits import timed_h11_protocol

    timeout = settings.timeout_header
    http = timed_h11_protocol(timeout) if timeout else "h11"
    return uvicorn.Config(app, log_level=log_level, timeout_keep_alive=5, loop=loop, http=http)
