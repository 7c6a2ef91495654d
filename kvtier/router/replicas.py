"""The replicas behind the router: health, load and identity, checked on a timer.

Every ``HEALTH_INTERVAL_S`` each replica gets ``GET /health`` (``HEALTH_TIMEOUT_S``). A refused or
reset connection, or an answer other than 200 (loading, draining), marks it down at once; so do a
request that fails on it to connect and a ``/v1/kv/info`` it cannot answer. A replica that still
accepts connections but does not answer in time (busy, hung) is marked down after ``MAX_TIMEOUTS``
checks in a row, so that one slow answer on a loaded machine does not empty the pool. A dead replica
stops receiving requests within ``HEALTH_INTERVAL_S`` (0.5 s) of dying; a hung one within ~3 s.

When it answers 200 again the router reads its ``GET /v1/kv/info`` (block size, cache identity, hash
spec version, model fingerprint, event stream, KV layout: ``kv_groups``, see ``groups.py``; its role in
disaggregated serving: ``role``, see ``disagg.py``). Its load
comes with every health check: ``kvtier serve`` puts ``num_requests_running``/``waiting`` in its
``/health`` answer (an older replica's are read from its ``GET /metrics``).

A replica's *load* is what is queued on it: ``max(in_flight, running + waiting)``, where ``in_flight``
counts the requests this router has open on it (exact and immediate) and ``running + waiting`` comes
from its last health check (includes other clients, up to one interval old).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvtier.kv.groups import KVLayout
from kvtier.kv.hashing import HASH_SPEC_VERSION
from kvtier.router.groups import layout_of
from kvtier.router.index import DEFAULT_MAX_BLOCKS, ReplicaIndex

logger = logging.getLogger("kvtier.router")

HEALTH_INTERVAL_S = 0.5
HEALTH_TIMEOUT_S = 1.0
MAX_TIMEOUTS = 2  # health checks timing out in a row before a replica that still accepts is marked down
# An admin's admission check is one request, not a tick: a busy replica (or router) gets more than a
# health check's second (a 1 s limit once refused a replica for ConnectTimeout in a loaded test run)
ADMIT_TIMEOUT_S = 5.0
_GAUGE_LINE = re.compile(rb"^kvtier:(num_requests_running|num_requests_waiting)(?:\{[^}]*\})? ([0-9.eE+-]+)$")


def normalize_url(url: str) -> str:
    """``http://host:port`` without a trailing slash; ValueError for anything else."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"a replica is an http(s)://host:port URL, got {url!r}")
    return url


@dataclass
class Replica:
    """One ``kvtier serve`` behind the router. Written only by the router's event loop."""

    url: str
    index: ReplicaIndex
    healthy: bool = False
    info: dict[str, Any] | None = None  # its GET /v1/kv/info
    problem: str | None = None  # why its blocks cannot be matched (hash spec, model); None: they can
    running: int = 0
    waiting: int = 0
    in_flight: int = 0  # requests this router has open on it
    pending_prefill: int = 0  # estimated prefill tokens of those still waiting for their first byte
    routed: Counter[str] = field(default_factory=Counter)  # by reason
    following: bool = False  # its index follows its event stream
    synced: bool = False  # its index reflects it (events or a recent snapshot)
    last_error: str | None = None
    timeouts: int = 0  # health checks timed out in a row
    checks: int = 0  # health checks answered 200: the load read is at most one round older than this count
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set while marked down
    identity: str | None = None  # admitted by an admin: the model fingerprint checked; None: by --replica

    @property
    def load(self) -> int:
        return max(self.in_flight, self.running + self.waiting)

    @property
    def role(self) -> str:
        """Its ``kvtier serve --role`` (``/v1/kv/info``'s ``role``): ``prefill`` computes prompts for a
        handoff (``kvtier.router.disagg``), ``decode`` and ``both`` answer clients; ``both`` when it says
        none (a replica from before the roles)."""
        role = (self.info or {}).get("role")
        return role if role in ("prefill", "decode") else "both"

    @property
    def stream(self) -> str | None:
        """Its KV event stream, when it publishes one."""
        events = (self.info or {}).get("events") or {}
        return events.get("stream") if events.get("enabled") else None

    @property
    def layout(self) -> KVLayout | None:
        """Its KV groups (``/v1/kv/info``'s ``kv_groups``); None: dense, or not known yet. An unreadable
        one is the replica's ``problem``, so a scorable replica's always reads."""
        try:
            return layout_of(self.info)
        except ValueError:
            return None

    @property
    def scorable(self) -> bool:
        """Its blocks can be matched against the router's hashes."""
        return self.healthy and self.info is not None and self.problem is None and self.synced

    def index_source(self) -> str | None:
        if not self.synced:
            return None
        return "events" if self.following else "polling"


class AdmissionRefused(Exception):
    """A replica an admin asked to add failed the check: ``status`` (a 4xx) and ``code`` for the answer."""

    def __init__(self, message: str, status: int = 400, code: str = "replica_check_failed") -> None:
        super().__init__(message)
        self.status, self.code = status, code


def _short(fingerprint: Any) -> str:
    return f"{str(fingerprint)[:12]}..." if fingerprint is not None else "none"


class ReplicaSet:
    """The replicas, by URL; their health loop. ``headers`` go with the router's own calls (the key)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        headers: dict[str, str],
        *,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        fingerprint: Any = None,
    ) -> None:
        self.client = client
        self.headers = headers
        self.max_blocks = max_blocks
        self.replicas: dict[str, Replica] = {}
        self.fingerprint = fingerprint  # () -> the router tokenizer's model fingerprint, or None
        self.changed = asyncio.Event()  # set when a replica comes up (the index sync wakes)

    def add(self, url: str) -> Replica:
        """A ``--replica`` replica (trusted as configured; health-checked before it gets requests)."""
        url = normalize_url(url)
        if url not in self.replicas:
            self.replicas[url] = Replica(url, ReplicaIndex(self.max_blocks))
            logger.info("router: replica %s added", url)
        return self.replicas[url]

    async def admit(self, url: str) -> Replica:
        """Add a replica an admin named, once it proves it serves the same model (module docstring);
        AdmissionRefused otherwise, ValueError for a URL that is not one. Already there: as it is."""
        url = normalize_url(url)
        if url in self.replicas:
            return self.replicas[url]
        expected = self.expected_fingerprint()
        if expected is None:
            raise AdmissionRefused(
                "the router cannot check the replica's model yet: no tokenizer loaded and no --replica "
                "replica has reported one model fingerprint; retry later",
                status=409,
                code="identity_unknown",
            )
        replica = Replica(url, ReplicaIndex(self.max_blocks), identity=expected)
        info = await self._probe(replica)
        replica.info, replica.problem = info, self._problem(info)
        refused = self._identity_problem(replica, info)
        if refused:
            raise AdmissionRefused(f"{url} refused: {refused}")
        if url not in self.replicas:  # another admission of it may have finished meanwhile
            self.replicas[url] = replica
            logger.warning("router: replica %s admitted (model %s)", url, _short(expected))
            await self.check(replica)  # up at once
        return self.replicas[url]

    async def _probe(self, replica: Replica) -> dict[str, Any]:
        """Its ``/health`` (200) and ``/v1/kv/info`` (a JSON object); AdmissionRefused naming the failure."""
        try:
            r = await self.client.get(replica.url + "/health", timeout=ADMIT_TIMEOUT_S)
            if r.status_code != 200:
                raise AdmissionRefused(f"{replica.url}/health answered {r.status_code}, not 200")
            info = await self.get_json(replica, "/v1/kv/info", timeout=ADMIT_TIMEOUT_S)
        except httpx.HTTPStatusError as exc:
            raise AdmissionRefused(f"{replica.url}/v1/kv/info answered {exc.response.status_code}") from None
        except (httpx.HTTPError, ValueError) as exc:
            raise AdmissionRefused(
                f"{replica.url} did not answer as a replica: {type(exc).__name__}: {exc}"
            ) from None
        if not isinstance(info, dict):
            raise AdmissionRefused(f"{replica.url}/v1/kv/info is not a JSON object")
        return info

    def expected_fingerprint(self) -> str | None:
        """The model a replica must serve: the router tokenizer's fingerprint, else the one every
        ``--replica`` replica that reported reports; None when neither is known (or they disagree)."""
        mine = self.fingerprint() if self.fingerprint is not None else None
        if mine is not None:
            return mine
        known = {
            r.info.get("model_fingerprint")
            for r in self.replicas.values()
            if r.identity is None and r.info is not None
        }
        known.discard(None)
        return known.pop() if len(known) == 1 else None

    def _identity_problem(self, replica: Replica, info: dict[str, Any]) -> str | None:
        """Why an admitted replica may not serve (None: it may; a ``--replica`` one always may)."""
        if replica.identity is None:
            return None
        mine = self.fingerprint() if self.fingerprint is not None else None
        expected = mine or replica.identity
        theirs = info.get("model_fingerprint")
        if theirs != expected:
            return f"its model fingerprint {_short(theirs)} is not the cluster's {_short(expected)}"
        return None

    def remove(self, url: str) -> bool:
        return self.replicas.pop(normalize_url(url), None) is not None

    def healthy(self) -> list[Replica]:
        return [r for r in sorted(self.replicas.values(), key=lambda r: r.url) if r.healthy]

    async def get_json(self, replica: Replica, path: str, timeout: float = 5.0) -> dict[str, Any]:
        r = await self.client.get(replica.url + path, headers=self.headers, timeout=timeout)
        r.raise_for_status()
        return r.json()

    # ------------------------------------------------------------------------------ health
    def mark_down(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            logger.warning("router: replica %s is down (%s); no more requests to it", replica.url, reason)
        replica.healthy = False
        replica.down.set()  # requests waiting for its answer go elsewhere (kvtier.router.proxy)
        replica.following = replica.synced = False
        replica.last_error = reason

    async def check(self, replica: Replica) -> None:
        """One health check: /health, then /v1/kv/info when it just came up, then its load.

        Refused or reset (a dead replica): down at once. Timed out (a busy or hung one): down after
        ``MAX_TIMEOUTS`` checks in a row. A failed ``/metrics`` read keeps the last load."""
        try:
            r = await self.client.get(replica.url + "/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.TimeoutException:
            replica.timeouts += 1
            if replica.timeouts >= MAX_TIMEOUTS:
                self.mark_down(replica, f"/health timed out {replica.timeouts} times in a row")
            return
        except httpx.HTTPError as exc:
            self.mark_down(replica, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            return
        replica.timeouts = 0
        if r.status_code != 200:
            self.mark_down(replica, f"/health answered {r.status_code}")
            return
        try:
            if not replica.healthy or replica.info is None:
                await self._identify(replica)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            self.mark_down(replica, f"/v1/kv/info: {type(exc).__name__}: {exc}")
            return
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if not _load_from_health(replica, r):  # an older replica: its /metrics
                await self._read_load(replica)
        replica.checks += 1
        if not replica.healthy:
            logger.warning("router: replica %s is up", replica.url)
            replica.healthy = True
            replica.down.clear()
            replica.last_error = None
            self.changed.set()

    async def _identify(self, replica: Replica) -> None:
        info = await self.get_json(replica, "/v1/kv/info", timeout=HEALTH_TIMEOUT_S)
        refused = self._identity_problem(replica, info)
        if refused:
            raise ValueError(refused)  # an admitted replica that now serves another model: stays down
        if replica.info is not None and info.get("events") != replica.info.get("events"):
            replica.following = replica.synced = False  # restarted: a new instance
        replica.info = info
        replica.problem = self._problem(info)
        if replica.problem:
            logger.warning("router: replica %s: %s; routed by load only", replica.url, replica.problem)

    def _problem(self, info: dict[str, Any]) -> str | None:
        version = info.get("hash_spec_version")
        if version != HASH_SPEC_VERSION:
            return f"block hash spec version {version}, the router implements {HASH_SPEC_VERSION}"
        if not info.get("enable_prefix_caching", True):
            return "prefix caching is off"
        try:
            layout_of(info)
        except ValueError as exc:
            return str(exc)
        mine = self.fingerprint() if self.fingerprint is not None else None
        if mine is not None and info.get("model_fingerprint") != mine:
            return (
                f"model fingerprint {str(info.get('model_fingerprint'))[:12]}... is not the router's --model"
            )
        return None

    async def _read_load(self, replica: Replica) -> None:
        r = await self.client.get(replica.url + "/metrics", timeout=HEALTH_TIMEOUT_S)
        values: dict[bytes, float] = {}
        for line in r.content.splitlines():
            m = _GAUGE_LINE.match(line)
            if m:
                values[m.group(1)] = float(m.group(2))
        replica.running = int(values.get(b"num_requests_running", 0))
        replica.waiting = int(values.get(b"num_requests_waiting", 0))

    def recheck_identity(self) -> None:
        """After the router's tokenizer loaded: judge every replica's model again (an admitted one
        serving another model than the tokenizer's goes down)."""
        for replica in self.replicas.values():
            if replica.info is not None:
                replica.problem = self._problem(replica.info)
                refused = self._identity_problem(replica, replica.info)
                if refused:
                    self.mark_down(replica, refused)

    async def run(self, interval: float = HEALTH_INTERVAL_S) -> None:
        """Check every replica, forever, every ``interval`` seconds."""
        while True:
            replicas = list(self.replicas.values())
            await asyncio.gather(*(self.check(r) for r in replicas))
            await asyncio.sleep(interval)


def _load_from_health(replica: Replica, answer: httpx.Response) -> bool:
    """Take the load from a ``/health`` answer that carries it (``kvtier serve`` does: one small JSON
    body instead of rendering its whole ``/metrics`` twice a second); False when it does not."""
    body = answer.json()
    running, waiting = body.get("num_requests_running"), body.get("num_requests_waiting")
    if not isinstance(running, int) or not isinstance(waiting, int):
        return False
    replica.running, replica.waiting = running, waiting
    return True
