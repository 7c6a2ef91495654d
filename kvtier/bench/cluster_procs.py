"""The processes of ``kvtier bench cluster``: a ``redis-server``, ``kvtier serve`` replicas and a
``kvtier router``, each a child process on a free loopback port, with logs in a temporary directory.

Every process started here is registered with one :class:`Cluster`; leaving its ``with`` block kills
what is still running (SIGTERM, then SIGKILL after a grace period), by pid, so a failed or interrupted
run leaves nothing behind. A process can be killed mid-run (``kill()``: SIGKILL, as a crash) and
started again on the same port (``start()``), which is how the scenarios stop Redis or a replica.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StartError(RuntimeError):
    """A child process exited or did not become ready; the message ends with its log's tail."""


@dataclass
class Child:
    """One child process: its command line, port and log file; started and killed by pid."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,  # a Ctrl-C in the terminal reaches the bench, not every child
            )
        finally:
            log.close()

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise StartError(
                f"{self.name} exited with status {self.proc.returncode}; log {self.log_path}:\n"
                + self.log_tail()
            )

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.running and self.proc is not None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        if self.running and self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_http(child: Child, path: str, timeout_s: float) -> None:
    """Until ``GET path`` answers 200 (the child is ready), or ``StartError``."""
    deadline = time.monotonic() + timeout_s
    while True:
        child.check_alive()
        try:
            if httpx.get(child.url + path, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise StartError(f"{child.name} not ready after {timeout_s:.0f} s; log:\n{child.log_tail()}")
        time.sleep(0.2)


def wait_redis(child: Child, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        child.check_alive()
        try:
            with socket.create_connection(("127.0.0.1", child.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise StartError(f"redis-server not answering on port {child.port}:\n{child.log_tail()}")
        time.sleep(0.05)


@dataclass(frozen=True)
class ReplicaSettings:
    """What every replica of one scenario is started with (``kvtier serve`` flags)."""

    device_blocks: int
    host_gb: float
    max_model_len: int
    threads: int = 1
    remote_url: str | None = None  # the shared Redis tier (and the KV events' stream)

    def flags(self) -> list[str]:
        out = ["--dtype", "float32", "--num-threads", str(self.threads)]
        out += ["--kv-device-blocks", str(self.device_blocks), "--max-model-len", str(self.max_model_len)]
        out += ["--kv-host-gb", f"{self.host_gb:.6f}", "--log-level", "warning"]
        if self.remote_url:
            out += ["--kv-remote-url", self.remote_url, "--kv-events-url", self.remote_url]
        return out


ADMIN_KEY = "kvtier-bench-admin"  # the router's admin key: loopback only, a benchmark's own cluster


class Cluster:
    """Redis, replicas and a router for one scenario; ``with Cluster(...) as c:`` tears all down."""

    def __init__(self, log_dir: Path, python: str = sys.executable) -> None:
        self.log_dir = log_dir
        self.python = python
        self.children: list[Child] = []
        self.redis: Child | None = None
        self.replicas: list[Child] = []
        self.router: Child | None = None
        self.replica_settings: ReplicaSettings | None = None  # the scenario's (set by its runner)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """The router first (so it logs no replica going down), then the rest, newest first."""
        order = [c for c in self.children if c is self.router]
        for child in order + [c for c in reversed(self.children) if c is not self.router]:
            try:
                child.stop(grace_s=3.0)
            except Exception as err:  # keep tearing the others down
                print(f"  (could not stop {child.name}: {err})", file=sys.stderr)

    def _child(self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None) -> Child:
        child = Child(name, argv, port, self.log_dir / f"{name}.log", env or {})
        self.children.append(child)
        return child

    # ------------------------------------------------------------------------------ redis
    def start_redis(self, maxmemory_mb: int = 2048) -> Child:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not os.path.exists(binary):
            raise StartError("redis-server is not installed (make setup installs it)")
        port = free_port()
        data = self.log_dir / "redis"
        data.mkdir(exist_ok=True)
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--maxmemory", f"{maxmemory_mb}mb", "--maxmemory-policy", "allkeys-lru", "--dir", str(data)]
        self.redis = self._child("redis", argv, port)
        self.restart(self.redis)
        return self.redis

    @property
    def redis_url(self) -> str | None:
        return f"redis://127.0.0.1:{self.redis.port}/0" if self.redis else None

    # ------------------------------------------------------------------------------ replicas
    def add_replica(self, settings: ReplicaSettings) -> Child:
        """A ``kvtier serve`` child (not started: ``start_all``/``restart`` it)."""
        index = len(self.replicas)
        port = free_port()
        argv = [self.python, "-m", "kvtier.cli", "serve", "--port", str(port), *settings.flags()]
        argv += ["--kv-replica-id", f"replica-{index}"]
        env = {"OMP_NUM_THREADS": str(settings.threads), "TOKENIZERS_PARALLELISM": "false"}
        child = self._child(f"replica-{index}", argv, port, env)
        self.replicas.append(child)
        return child

    def add_router(self, policy: str, remote_url: str | None, extra: Sequence[str] = ()) -> Child:
        """The router, with ``ADMIN_KEY`` (the benchmark admits a replica at run time)."""
        port = free_port()
        argv = [self.python, "-m", "kvtier.cli", "router", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--admin-key", ADMIN_KEY]
        for r in self.replicas:
            argv += ["--replica", r.url]
        argv += ["--policy", policy]
        if remote_url:
            argv += ["--kv-remote-url", remote_url]
        self.router = self._child("router", [*argv, *extra], port)
        return self.router

    def restart(self, child: Child, timeout_s: float = 180.0) -> None:
        """Start ``child`` (again, on its port) and wait until it is ready."""
        self.start_all([child], timeout_s)

    def start_all(self, children: Sequence[Child], timeout_s: float = 180.0) -> None:
        """Spawn ``children`` together (replicas load the model in parallel), then wait for each."""
        for child in children:
            if not child.running:
                child.spawn()
        for child in children:
            if child is self.redis:
                wait_redis(child)
            else:
                wait_http(child, "/health", timeout_s)
