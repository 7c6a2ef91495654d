"""``kvtier serve``: the OpenAI-compatible server (uvicorn), plus running it in a background thread.

Importing this module is cheap (``kvtier --help`` imports it); FastAPI, uvicorn and torch are imported
when the server starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
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
from kvtier.reasoning import REASONING_PARSERS
from kvtier.server.response_store import MAX_ENTRIES as MAX_STORED
from kvtier.server.response_store import RESPONSE_STORES

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvtier.engine import LLMEngine
    from kvtier.server.shutdown import DrainingServer


# Engine defaults of a server that differ from the engine's own (an offline batch wants the biggest
# batch; a server keeps finishing requests past its capacity, kvtier/scheduler/goodput.py, and one
# request's many rows do not stretch everyone's steps, kvtier/scheduler/fairness.py). The ITL target is
# 10 lone steps, not 6: on a 2-core CPU a stream of hostile requests' parsing and rows kept the steps
# just over 6 and the cap queued everyone's requests (BENCHMARKS.md, --hostile and bench-overload).
SCHEDULING_FLAGS = ("scheduling_policy", "step_time_factor", "step_time_max_factor")
SERVE_ENGINE_DEFAULTS = {
    "itl_factor": 10.0,
    "max_queue_wait_s": 10.0,
    "row_share_span": 8,
    **dict.fromkeys(SCHEDULING_FLAGS),
}
# A decode replica exists to keep streams smooth: its prompts are handed-off tails and short chats,
# and under legacy's fixed token budget a few of those in one step stretched every stream's gap 3-4x
# (kvtier bench disagg); stall_free with steps of at most 1.5 decode-only steps, never widened.
ROLE_SCHEDULING: dict[str, dict[str, Any]] = {
    "both": {"scheduling_policy": "legacy", "step_time_factor": 2.5, "step_time_max_factor": 0.0},
    "prefill": {"scheduling_policy": "legacy", "step_time_factor": 2.5, "step_time_max_factor": 0.0},
    "decode": {"scheduling_policy": "stall_free", "step_time_factor": 1.5, "step_time_max_factor": 1.5},
}

# A replica's part in disaggregated serving (docs/disaggregation.md): ``both`` computes prompts and
# streams answers (the default); ``prefill`` computes prompts for a router and publishes their blocks to
# the shared remote tier; ``decode`` takes prompts whose blocks are there and streams the answers.
ROLES = ("both", "prefill", "decode")


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    _add_key_args(g)
    g.add_argument(
        "--role",
        choices=ROLES,
        default="both",
        help="the replica's part behind 'kvtier router': both (default: prompts and answers), prefill "
        "(computes prompts, publishes their KV blocks to --kv-remote-url write-through) or decode (loads "
        "prompts' blocks from --kv-remote-url, streams answers; unless given: --scheduling-policy "
        "stall_free --step-time-factor 1.5 --step-time-max-factor 1.5); shown in /v1/kv/info and /metrics",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="answer 503 (Retry-After) when more requests than this are waiting (default: no limit)",
    )
    _add_limit_args(g)
    g.add_argument(
        "--served-model-name", default=None, help="the model id clients send (default: from --model)"
    )
    g.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="return a reasoning model's <think>...</think> apart, as message.reasoning_content (qwen3: "
        "the model opens the block; deepseek_r1: the prompt opened it) (default: the text as written)",
    )
    g.add_argument(
        "--response-store",
        choices=("auto", *RESPONSE_STORES),
        default="auto",
        help="where Responses API answers are kept for previous_response_id: memory (this replica's), "
        "redis (--kv-remote-url's, shared by the replicas), off (default auto: redis with "
        "--kv-remote-url, else memory)",
    )
    g.add_argument(
        "--max-stored-responses",
        type=int,
        default=MAX_STORED,
        help="with --response-store memory: the most recently stored kept (default %(default)s)",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn",
    )
    add_engine_args(p)
    p.set_defaults(func=main, **SERVE_ENGINE_DEFAULTS)


def _add_key_args(g: argparse._ArgumentGroup) -> None:
    """The roles' keys (kvtier/server/auth.py has the table); an empty value is no key."""
    g.add_argument(
        "--api-key",
        default=os.environ.get("KVTIER_API_KEY") or None,
        help="the client key: require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize and "
        "/openapi.json (default: $KVTIER_API_KEY, else none)",
    )
    g.add_argument(
        "--admin-key",
        default=os.environ.get("KVTIER_ADMIN_KEY") or None,
        help="the only key the /admin routes accept (POST /admin/kv/quarantine); without it they answer "
        "404 (default: $KVTIER_ADMIN_KEY, else none)",
    )
    g.add_argument(
        "--kv-read-key",
        default=os.environ.get("KVTIER_KV_READ_KEY") or None,
        help="the key of /v1/kv/blocks, /v1/kv/canary, /v1/kv/advice and /v1/kv/dashboard (block hashes "
        "let a reader test guesses of other users' prompts); the admin key is accepted too; without it "
        "they take --api-key, as the router expects (default: $KVTIER_KV_READ_KEY, else none)",
    )
    g.add_argument(
        "--metrics-key",
        default=os.environ.get("KVTIER_METRICS_KEY") or None,
        help="require 'Authorization: Bearer KEY' (or the admin key) on /metrics; without it /metrics is "
        "open for Prometheus (default: $KVTIER_METRICS_KEY, else none)",
    )


def _add_limit_args(g: argparse._ArgumentGroup) -> None:
    """What one request or connection may cost (the README's Security section), and the drain on SIGTERM."""
    g.add_argument(
        "--max-n",
        type=int,
        default=16,
        help="most completions per prompt (n); prompts x n count against --max-queue (default 16)",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=4 * 2**20,
        help="largest request body; a larger one is a 413 before it is read (default 4 MiB)",
    )
    g.add_argument(
        "--prefix-cache-scope",
        choices=["shared", "user"],
        default="shared",
        help="shared: every client's prompts can be prefix-cache hits for every other (fastest); user: "
        "the cache is salted per API key and 'user' field, so tenants cannot probe each other's prompts "
        "(default shared; see the README's Security section)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let running requests finish before ending them (default 30)",
    )
    g.add_argument(
        "--timeout-keep-alive", type=float, default=5.0, help="close an idle connection after (default 5 s)"
    )
    g.add_argument(
        "--timeout-header",
        type=float,
        default=10.0,
        help="close a connection whose request headers take longer (default 10 s; 0: never)",
    )
    g.add_argument(
        "--timeout-body",
        type=float,
        default=30.0,
        help="answer 408 to a request whose body takes longer to arrive (default 30 s; 0: never)",
    )


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
        from kvtier.models.prefault import prefault_in_background

        engine = LLMEngine(args, progress=progress)
        prefault_in_background(engine.runner.cache.raw)  # no page faults inside the first steps
        return engine

    return build


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket (``port`` 0: a free one); a ``ConfigError`` naming the address when the
    port is taken (or the host is not this machine's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = " (another server is listening there: pick another --port, or --port 0 for a free one)"
        taken = exc.errno == errno.EADDRINUSE
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint if taken else ''}"
        ) from exc
    sock.set_inheritable(True)
    return sock


@dataclass
class BackgroundServer:
    """A server running on a thread of this process (tests and ``kvtier bench serve``)."""

    app: FastAPI
    server: DrainingServer
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

    def drain(self) -> None:
        """What SIGTERM does to ``kvtier serve``: drain, then stop (see :mod:`kvtier.server.shutdown`)."""
        self.server.request_drain()


def serve_in_thread(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    *,
    shutdown_timeout: float = 30.0,
    **timeouts: float,
) -> BackgroundServer:
    """Start uvicorn for ``app`` on a daemon thread; returns once it accepts connections.
    ``timeouts``: ``timeout_keep_alive``, ``timeout_header`` (as :func:`uvicorn_config` takes them)."""
    from kvtier.server.shutdown import DrainingServer, uvicorn_config

    sock = bind(host, port)
    port = sock.getsockname()[1]
    server = DrainingServer(uvicorn_config(app, log_level=log_level, **timeouts), shutdown_timeout)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="kvtier-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.01)
    return BackgroundServer(app, server, thread, f"http://{host}:{port}")


def _check_flags(ns: argparse.Namespace) -> None:
    from kvtier.server.auth import check_distinct

    check_distinct(ns)
    if ns.max_queue is not None and ns.max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {ns.max_queue}")
    if not 0 <= ns.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {ns.port}")
    for flag in ("max_n", "max_request_bytes"):
        if getattr(ns, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(ns, flag)}")
    for flag in ("shutdown_timeout", "timeout_keep_alive", "timeout_header", "timeout_body"):
        value = getattr(ns, flag)
        if not 0 <= value < float("inf"):
            raise ConfigError(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {value}")


def check_role(role: str, args: EngineArgs) -> None:
    """A ``prefill`` or ``decode`` replica hands prompts over through the shared remote tier: it needs one
    (``--kv-remote-url``), and a prefill replica must write each full block through to it (a write-back
    remote tier would get a block only when the host tier evicts it). ConfigError naming the flag."""
    if role == "both":
        return
    if args.kv_remote_url is None:
        raise ConfigError(
            f"--role {role} needs --kv-remote-url: prefill and decode replicas hand prompts over "
            "through the shared remote tier (docs/disaggregation.md)"
        )
    if role == "prefill" and args.kv_remote_policy != "write_through":
        raise ConfigError(
            "--role prefill needs --kv-remote-policy write_through: each full block must reach the "
            "remote tier as soon as it is computed"
        )


def set_role(app: FastAPI, role: str) -> None:
    """Give ``app`` (``create_app``'s) its ``--role``: reported by ``GET /v1/kv/info`` and as
    ``kvtier:role{role=...}`` on ``/metrics``."""
    app.state.role = role
    app.state.metrics.set_role(role)


def describe_tiers(engine: LLMEngine) -> str:
    """``device 256 blocks (1.0 GiB), host 512 blocks (2.0 GiB), disk 10 GiB at DIR``."""
    config = engine.config
    gib = config.cache.block_bytes / 2**30
    parts = [
        f"device {config.cache.num_device_blocks} blocks ({config.cache.num_device_blocks * gib:.2g} GiB)"
    ]
    if config.tiers.num_host_blocks:
        parts.append(
            f"host {config.tiers.num_host_blocks} blocks ({config.tiers.num_host_blocks * gib:.2g} GiB)"
        )
    if config.tiers.disk_dir:
        parts.append(f"disk {config.tiers.disk_bytes / 2**30:g} GiB at {config.tiers.disk_dir}")
    return ", ".join(parts)


def _settings(ns: argparse.Namespace, name: str):  # noqa: ANN202 (ServerSettings, imported lazily)
    from kvtier.server.app import ServerSettings

    store = ns.response_store
    if store == "auto":
        store = "redis" if ns.kv_remote_url else "memory"
    return ServerSettings(
        model_name=name,
        api_key=ns.api_key,
        admin_key=ns.admin_key,
        kv_read_key=ns.kv_read_key,
        metrics_key=ns.metrics_key,
        max_queue=ns.max_queue,
        max_n=ns.max_n,
        max_request_bytes=ns.max_request_bytes,
        timeout_body=ns.timeout_body or None,
        prefix_cache_scope=ns.prefix_cache_scope,
        reasoning_parser=ns.reasoning_parser,
        response_store=store,
        response_store_url=ns.kv_remote_url,
        response_store_secret=ns.kv_remote_secret or os.environ.get("KVTIER_REMOTE_SECRET"),
        max_stored_responses=ns.max_stored_responses,
    )


def serve_engine_args(ns: argparse.Namespace) -> EngineArgs:
    """``kvtier serve``'s engine flags: a scheduling flag not given is its ``--role``'s (ROLE_SCHEDULING)."""
    for flag in SCHEDULING_FLAGS:
        if getattr(ns, flag) is None:
            setattr(ns, flag, ROLE_SCHEDULING[ns.role][flag])
    return engine_args_from(ns)


def main(ns: argparse.Namespace) -> int:
    args = serve_engine_args(ns)
    _check_flags(ns)
    check_role(ns.role, args)
    name = ns.served_model_name or default_model_name(args.model)  # an unknown model path fails here
    sock = bind(ns.host, ns.port)
    if args.kv_replica_id is None:  # KV events and /v1/kv/info name this replica hostname:port
        args = dataclasses.replace(args, kv_replica_id=default_replica_id(sock.getsockname()[1]))
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}"

    from kvtier.server.app import create_app
    from kvtier.server.shutdown import DrainingServer, uvicorn_config

    failures: list[BaseException] = []
    holder: dict[str, Any] = {}

    def on_load_error(exc: BaseException) -> None:
        failures.append(exc)
        if "server" in holder:
            holder["server"].should_exit = True

    def on_ready(engine: LLMEngine) -> None:
        print(f"kvtier: ready: {name} on {url}/v1 (KV {describe_tiers(engine)})", file=sys.stderr, flush=True)

    app = create_app(
        engine_factory(args, progress=sys.stderr.isatty()),
        _settings(ns, name),
        on_load_error=on_load_error,
        on_ready=on_ready,
    )
    set_role(app, ns.role)
    role = f" as a {ns.role} replica" if ns.role != "both" else ""
    print(
        f"kvtier: serving {name}{role} on {url} (OpenAI API under /v1; /health, /metrics); "
        "the model is loading (/health answers 503 until 'ready')",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn_config(
        app,
        log_level=ns.log_level,
        timeout_keep_alive=ns.timeout_keep_alive,
        timeout_header=ns.timeout_header,
    )
    server = holder["server"] = DrainingServer(config, ns.shutdown_timeout)
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
    "ROLES",
    "bind",
    "check_role",
    "default_model_name",
    "describe_tiers",
    "engine_factory",
    "main",
    "serve_in_thread",
    "serve_engine_args",
    "set_role",
]
