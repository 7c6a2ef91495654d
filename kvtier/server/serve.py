"""``kvtier serve``: the OpenAI-compatible server (uvicorn), plus running it in a background thread.

Importing this module is cheap (``kvtier --help`` imports it); FastAPI, uvicorn and torch are imported
when the server starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.args import add_engine_args, engine_args_from
from kvtier.config import ConfigError, EngineArgs
from kvtier.kv_events import default_replica_id

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from kvtier.engine import LLMEngine


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("KVTIER_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $KVTIER_API_KEY, else none)",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="answer 503 (Retry-After) when more requests than this are waiting (default: no limit)",
    )
    g.add_argument(
        "--served-model-name", default=None, help="the model id clients send (default: from --model)"
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn",
    )
    add_engine_args(p)
    p.set_defaults(func=main)


def default_model_name(model: str | None) -> str:
    """``SmolLM2-135M-Instruct`` for the embedded model; else the file or directory name, minus
    ``.gguf`` and a quantization suffix."""
    from kvtier.models.loader import resolve_model_path

    name = resolve_model_path(model).name
    name = re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    return re.sub(r"[.-](q\d\w*|i?q\d_\w+|f16|f32|bf16)$", "", name, flags=re.IGNORECASE)


def engine_factory(args: EngineArgs, progress: bool = False) -> Callable[[], LLMEngine]:
    def build() -> LLMEngine:
        from kvtier.engine import LLMEngine

        return LLMEngine(args, progress=progress)

    return build


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket (``port`` 0: a free one); binding errors surface as ``OSError`` here."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


@dataclass
class BackgroundServer:
    """A server running on a thread of this process (tests and ``kvtier bench serve``)."""

    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread
    url: str  # http://host:port

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Block until the model has loaded; raise if it failed."""
        engine = self.app.state.engine
        if not engine.wait_ready(timeout):
            raise RuntimeError(engine.not_ready_reason())

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def serve_in_thread(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
) -> BackgroundServer:
    """Start uvicorn for ``app`` on a daemon thread; returns once it accepts connections."""
    import uvicorn

    sock = bind(host, port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="kvtier-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.01)
    return BackgroundServer(app, server, thread, f"http://{host}:{port}")


def main(ns: argparse.Namespace) -> int:
    args = engine_args_from(ns)
    if ns.max_queue is not None and ns.max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {ns.max_queue}")
    if not 0 <= ns.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {ns.port}")
    name = ns.served_model_name or default_model_name(args.model)  # an unknown model path fails here
    sock = bind(ns.host, ns.port)
    if args.kv_replica_id is None:  # KV events and /v1/kv/info name this replica hostname:port
        args = dataclasses.replace(args, kv_replica_id=default_replica_id(sock.getsockname()[1]))

    import uvicorn

    from kvtier.server.app import ServerSettings, create_app

    failures: list[BaseException] = []
    holder: dict[str, Any] = {}

    def on_load_error(exc: BaseException) -> None:
        failures.append(exc)
        if "server" in holder:
            holder["server"].should_exit = True

    settings = ServerSettings(model_name=name, api_key=ns.api_key, max_queue=ns.max_queue)
    app = create_app(
        engine_factory(args, progress=sys.stderr.isatty()), settings, on_load_error=on_load_error
    )
    host, port = sock.getsockname()[:2]
    print(
        f"kvtier: serving {name} on http://{host}:{port} (OpenAI API under /v1; /health, /metrics); "
        "the model loads in the background",
        file=sys.stderr,
        flush=True,
    )
    server = holder["server"] = uvicorn.Server(
        uvicorn.Config(app, log_level=ns.log_level, timeout_graceful_shutdown=5)
    )
    server.run(sockets=[sock])
    if failures:
        exc = failures[0]
        if isinstance(exc, ValueError | OSError):
            raise exc
        raise ConfigError(f"the model failed to load: {type(exc).__name__}: {exc}")
    return 0


__all__ = [
    "BackgroundServer",
    "add_args",
    "bind",
    "default_model_name",
    "engine_factory",
    "main",
    "serve_in_thread",
]
