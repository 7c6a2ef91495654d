"""The router as a hostile user and a careless operator would try it.

The router runs for real (uvicorn on loopback, with the flags' uvicorn settings: the header timeout is
the protocol's); the replicas are fakes made here, which record every request and its headers, so a
test can say what reached them and what did not. Fast: no model, no torch (the router's tokenizer is
the embedded SmolLM2's, torch-free, ~0.2 s).

    the hijack       no admin key: /admin is 404; the client key never opens it; a replica reporting
                     another model is refused and sees no client request, no client header
    the path tricks  /v1/models/..%2F..%2Fv1%2Fkv%2Fblocks & co: 404, nothing reaches a replica
    the slowloris    200 connections that never finish their headers: closed within the header
                     timeout; /health answers meanwhile
    the bodies       bad, non-UTF-8 and 100k-deep JSON: OpenAI's 400; a body that stalls: 408
    the roles        /metrics with --metrics-key, /router/state with the client or admin key
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from kvtier.config import ConfigError
from kvtier.kv.hashing import HASH_SPEC_VERSION

CLIENT, ADMIN, METRICS, READER = "client-key", "admin-key", "metrics-key", "kv-read-key"
VICTIM = {"Authorization": "Bearer victim-token"}  # a client's own header, passed on by a keyless router
OTHER_MODEL = "0" * 32


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def fingerprint() -> str:
    """The embedded model's fingerprint: what the router's tokenizer computes (``--model`` unset)."""
    from kvtier.router.prompt import load_tokenizer

    return load_tokenizer(None)[1]


# ------------------------------------------------------------------------------------ a fake replica
@dataclass
class Seen:
    method: str
    path: str  # the request target as sent (not decoded)
    headers: dict[str, str]


@dataclass
class FakeReplica:
    """A ``kvtier serve`` look-alike on loopback: /health, /v1/kv/info (``model_fingerprint``), empty
    /v1/kv/blocks, and a canned answer to anything else; ``seen`` records every request."""

    model_fingerprint: str
    health_status: int = 200
    seen: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                fake.answer(self)

            do_POST = do_DELETE = do_GET  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("content-length") or 0)
        h.rfile.read(length)
        self.seen.append(Seen(h.command, h.path, {k.lower(): v for k, v in h.headers.items()}))
        status, body = 200, self.body(h.path)
        if h.path == "/health":
            status = self.health_status
        data = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("content-type", "application/json")
        h.send_header("content-length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def body(self, path: str) -> dict[str, Any]:
        if path == "/health":
            return {"status": "ok", "num_requests_running": 0, "num_requests_waiting": 0}
        if path == "/v1/kv/info":
            return {
                "object": "kv.info", "replica_id": self.url, "hash_spec_version": HASH_SPEC_VERSION,
                "enable_prefix_caching": True, "model_fingerprint": self.model_fingerprint,
                "cache_identity": "fake:float32", "block_size": 16, "events": {"enabled": False},
            }  # fmt: skip
        if path.startswith("/v1/kv/blocks"):
            return {"object": "kv.blocks", "instance": None, "seq": None, "blocks": {"device": []}}
        return {"object": "fake.answer", "path": path, "choices": []}  # what a leak would return

    def client_requests(self) -> list[Seen]:
        """What came from a client (the router's own calls: /health, /v1/kv/..., /metrics)."""
        own = ("/health", "/v1/kv/info", "/v1/kv/blocks", "/metrics")
        return [s for s in self.seen if not s.path.startswith(own)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes(fingerprint: str) -> Iterator[Callable[..., FakeReplica]]:
    made: list[FakeReplica] = []

    def make(model_fingerprint: str = fingerprint, **kw: Any) -> FakeReplica:
        made.append(FakeReplica(model_fingerprint, **kw))
        return made[-1]

    yield make
    for f in made:
        f.close()


# ------------------------------------------------------------------------------------ the router
@dataclass
class RunningRouter:
    url: str
    port: int
    app: Any

    def state(self) -> dict[str, Any]:
        return httpx.get(self.url + "/router/state", headers=bearer(ADMIN), timeout=5).json()


@contextlib.contextmanager
def router(replicas: list[FakeReplica], **settings: Any) -> Iterator[RunningRouter]:
    """``kvtier router`` in front of ``replicas``, on a thread, with the CLI's uvicorn settings;
    returns once every replica is healthy there."""
    import uvicorn

    from kvtier.router.app import create_app
    from kvtier.router.cli import uvicorn_config
    from kvtier.router.core import RouterSettings
    from kvtier.server.serve import bind

    config = RouterSettings(replicas=[r.url for r in replicas], **{"policy": "round_robin", **settings})
    app = create_app(config)
    server = uvicorn.Server(uvicorn_config(app, config, loop="asyncio"))
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    running = RunningRouter(f"http://127.0.0.1:{port}", port, app)
    try:
        wait_for(lambda: server.started, 30)
        want = len(replicas)
        wait_for(lambda: len(app.state.router.replicas.healthy()) == want, 10)
        yield running
    finally:
        server.should_exit = True
        thread.join(10)


def wait_for(check: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"not true within {timeout} s"
        time.sleep(0.02)
    return value


def chat(text: str = "Hello") -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 2}


def error_of(r: httpx.Response) -> dict[str, Any]:
    assert r.headers["content-type"].startswith("application/json"), r.text
    return r.json()["error"]


# ============================================================================== 1. the hijack
def test_without_an_admin_key_the_admin_routes_do_not_exist(fakes: Callable[..., FakeReplica]) -> None:
    """The published compose file had no key: anyone could add a replica. Now /admin/* is a 404 for
    every method and every key; the would-be replica is never even asked, the real one stays."""
    real, evil = fakes(), fakes()
    with router([real]) as r:
        for method in ("POST", "DELETE", "GET", "PUT"):
            for headers in ({}, bearer("anything")):
                answer = httpx.request(
                    method, r.url + "/admin/replicas", json={"url": evil.url}, headers=headers
                )
                assert answer.status_code == 404 and error_of(answer)["code"] == "not_found", method
        answer = httpx.request("DELETE", r.url + "/admin/replicas", json={"url": real.url})
        assert answer.status_code == 404
        for i in range(4):
            assert httpx.post(r.url + "/v1/chat/completions", json=chat(f"{i}")).status_code == 200
        assert [rep["url"] for rep in r.state()["replicas"]] == [real.url]
    assert evil.seen == []
    assert len(real.client_requests()) == 4


def test_the_client_key_never_opens_the_admin_routes(fakes: Callable[..., FakeReplica]) -> None:
    """With --api-key and --admin-key: the key every client holds is a 401 at /admin (it used to add
    a replica that then received that very key); the admin key admits a replica serving the model."""
    real, evil, new = fakes(), fakes(), fakes()
    with router([real], api_key=CLIENT, admin_key=ADMIN) as r:
        for headers in ({}, bearer(CLIENT), bearer(METRICS)):
            for method in ("POST", "DELETE"):
                url = evil.url if method == "POST" else real.url
                answer = httpx.request(method, r.url + "/admin/replicas", json={"url": url}, headers=headers)
                assert answer.status_code == 401 and error_of(answer)["code"] == "invalid_api_key"
                assert answer.headers["www-authenticate"] == "Bearer"
        assert evil.seen == [] and len(r.state()["replicas"]) == 1
        answer = httpx.post(r.url + "/admin/replicas", json={"url": new.url + "/"}, headers=bearer(ADMIN))
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"object": "router.replica", "url": new.url, "healthy": True}
        assert {rep["url"] for rep in r.state()["replicas"]} == {real.url, new.url}
        for i in range(4):  # round robin: the admitted replica serves too, the client's header with it
            sent = httpx.post(r.url + "/v1/chat/completions", json=chat(f"{i}"), headers=bearer(CLIENT))
            assert sent.status_code == 200
        assert [s.headers["authorization"] for s in new.client_requests()] == [f"Bearer {CLIENT}"] * 2
        gone = httpx.request(
            "DELETE", r.url + "/admin/replicas", json={"url": new.url}, headers=bearer(ADMIN)
        )
        assert gone.status_code == 200 and len(r.state()["replicas"]) == 1


def test_a_replica_serving_another_model_is_refused_and_sees_nothing(
    fakes: Callable[..., FakeReplica],
) -> None:
    """The hijack with the admin key in hand (or a typo): a fake that answers /health, reporting zero
    load, but another model's fingerprint. The POST is a 400 naming why; it is never added; ten
    victims' requests, their Authorization headers with them, all go to the real replica."""
    real, evil = fakes(), fakes(OTHER_MODEL)
    with router([real], admin_key=ADMIN) as r:
        answer = httpx.post(r.url + "/admin/replicas", json={"url": evil.url}, headers=bearer(ADMIN))
        error = error_of(answer)
        assert answer.status_code == 400 and error["code"] == "replica_check_failed"
        assert "model fingerprint 000000000000" in error["message"] and error["param"] == "url"
        for i in range(10):
            sent = httpx.post(r.url + "/v1/chat/completions", json=chat(f"victim {i}"), headers=VICTIM)
            assert sent.status_code == 200 and sent.headers["x-kvtier-replica"] == real.url
        assert [rep["url"] for rep in r.state()["replicas"]] == [real.url]
    assert [s.path for s in evil.seen] == ["/health", "/v1/kv/info"]
    assert not [s for s in evil.seen if "authorization" in s.headers]
    assert len(real.client_requests()) == 10


def test_with_a_kv_read_key_a_checked_replica_never_sees_the_client_key(
    fakes: Callable[..., FakeReplica],
) -> None:
    """The check itself carries the router's own key (a keyed replica shows /v1/kv/info only with
    one): with --kv-read-key that is the replicas' KV read key, never the client key; client requests
    still carry their own."""
    real, evil = fakes(), fakes(OTHER_MODEL)
    with router([real], api_key=CLIENT, kv_read_key=READER, admin_key=ADMIN) as r:
        answer = httpx.post(r.url + "/admin/replicas", json={"url": evil.url}, headers=bearer(ADMIN))
        assert answer.status_code == 400
        sent = httpx.post(r.url + "/v1/chat/completions", json=chat(), headers=bearer(CLIENT))
        assert sent.status_code == 200
    assert {s.headers.get("authorization") for s in evil.seen} <= {None, f"Bearer {READER}"}
    own = [s for s in real.seen if s.path.startswith("/v1/kv/")]
    assert own and {s.headers["authorization"] for s in own} == {f"Bearer {READER}"}
    assert [s.headers["authorization"] for s in real.client_requests()] == [f"Bearer {CLIENT}"]


def test_a_replica_that_fails_the_check_is_refused_with_the_reason(
    fakes: Callable[..., FakeReplica],
) -> None:
    """Not answering, not healthy (loading), not a URL: each a 4xx naming why; none added."""
    real, loading = fakes(), fakes(health_status=503)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"  # nobody listens (no listen())
    with router([real], admin_key=ADMIN) as r:

        def admit(url: str) -> tuple[int, str]:
            answer = httpx.post(r.url + "/admin/replicas", json={"url": url}, headers=bearer(ADMIN))
            return answer.status_code, error_of(answer)["message"]

        assert admit(loading.url) == (400, f"{loading.url}/health answered 503, not 200")
        status, message = admit(closed)
        assert status == 400 and "did not answer as a replica: ConnectError" in message
        assert admit("ftp://x")[0] == 400
        answer = httpx.post(r.url + "/admin/replicas", content=b"[" * 100_000, headers=bearer(ADMIN))
        assert answer.status_code == 400 and error_of(answer)["code"] == "invalid_json"
        assert [rep["url"] for rep in r.state()["replicas"]] == [real.url]


def test_before_the_tokenizer_the_configured_replicas_model_is_the_measure(
    fakes: Callable[..., FakeReplica],
) -> None:
    """A router whose --model cannot load: the replicas given by --replica say which model the cluster
    serves. Without any of them the router cannot tell, and says so (409) instead of guessing."""
    real, same, evil = fakes(), fakes(), fakes(OTHER_MODEL)
    with router([real], admin_key=ADMIN, model="/no/such/model") as r:
        wait_for(lambda: r.state()["tokenizer"]["error"], 10)
        refused = httpx.post(r.url + "/admin/replicas", json={"url": evil.url}, headers=bearer(ADMIN))
        assert refused.status_code == 400
        admitted = httpx.post(r.url + "/admin/replicas", json={"url": same.url}, headers=bearer(ADMIN))
        assert admitted.status_code == 200 and admitted.json()["healthy"] is True
    with router([], admin_key=ADMIN, model="/no/such/model") as r:
        wait_for(lambda: r.state()["tokenizer"]["error"], 10)
        unknown = httpx.post(r.url + "/admin/replicas", json={"url": same.url}, headers=bearer(ADMIN))
        assert unknown.status_code == 409 and error_of(unknown)["code"] == "identity_unknown"


def test_an_admitted_replica_that_comes_back_with_another_model_stays_down(
    fakes: Callable[..., FakeReplica], fingerprint: str
) -> None:
    """Admitted, then restarted (down, up) serving another model: its identity is read again as it
    comes back, and it stays out, with the reason in /router/state."""
    real, new = fakes(), fakes()
    with router([real], admin_key=ADMIN) as r:
        assert httpx.post(r.url + "/admin/replicas", json={"url": new.url}, headers=bearer(ADMIN)).json()[
            "healthy"
        ]
        new.health_status = 503
        mine = lambda: next(rep for rep in r.state()["replicas"] if rep["url"] == new.url)  # noqa: E731
        wait_for(lambda: not mine()["healthy"], 5)
        new.model_fingerprint, new.health_status = OTHER_MODEL, 200
        wait_for(lambda: "model fingerprint" in (mine()["last_error"] or ""), 5)
        time.sleep(0.6)  # another health round
        assert not mine()["healthy"]
        for i in range(4):
            sent = httpx.post(r.url + "/v1/chat/completions", json=chat(f"{i}"))
            assert sent.headers["x-kvtier-replica"] == real.url


# ============================================================================== 4. the path tricks
TRICKS = [
    "/v1/models/..%2F..%2Fv1%2Fkv%2Fblocks",
    "/v1/models/..%2Fkv%2Fdashboard",
    "/v1/models/..%2F..%2Fmetrics",
    "/v1/models/..%2F..%2Fv1%2Fkv%2Fcanary",
    "/v1/models/%2e%2e/%2e%2e/v1/kv/info",
    "/v1/models/%2E%2E%2F%2E%2E%2Fhealth",
    "/v1/models/..",
    "/v1/models/%2e%2e",
    "/v1/models/.",
    "/v1/models/..%5C..%5Cmetrics",
    "/v1/models/a%5Cb",
    "/v1/models/a%2Fb",
    "/v1/models/a/b",
    "/v1/models/%00",
    "/v1/models/..%252F..%252Fmetrics",
]


def raw_get(port: int, target: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """``GET target`` sent byte for byte (an HTTP client would normalise it): the status and body."""
    lines = [f"GET {target} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_path_tricks_are_404_and_reach_no_replica(fakes: Callable[..., FakeReplica]) -> None:
    """``GET /v1/models/..%2F..%2Fv1%2Fkv%2Fblocks`` used to return a replica's block hashes (the path
    parameter was appended to the upstream URL and httpx resolved the ``..``). Every such trick is
    now a 404 in OpenAI's shape, and the replica sees none of them; a real model id still passes,
    to exactly ``/v1/models/<id>``."""
    real = fakes()
    with router([real]) as r:
        for target in TRICKS:
            status, body = raw_get(r.port, target, VICTIM)
            assert status == 404, (target, body)
            assert json.loads(body)["error"]["code"] in ("model_not_found", "not_found"), target
        status, body = raw_get(r.port, "/v1/models/SmolLM2-135M-Instruct", VICTIM)
        assert status == 200 and json.loads(body)["path"] == "/v1/models/SmolLM2-135M-Instruct"
    assert [(s.method, s.path) for s in real.client_requests()] == [
        ("GET", "/v1/models/SmolLM2-135M-Instruct")
    ]
    assert [s for s in real.seen if "authorization" in s.headers] == real.client_requests()


def test_the_upstream_path_is_a_fixed_route_plus_a_checked_id() -> None:
    """Why the id is checked: httpx resolves ``..`` in a URL's path, so client text appended to a
    route could name any route. A checked id has no dot segment, slash or escape: quoting it again
    changes nothing, and httpx sends exactly that path."""
    from kvtier.router.app import model_path
    from kvtier.server.protocol import APIError

    assert httpx.URL("http://replica/v1/models/../../v1/kv/blocks").raw_path == b"/v1/kv/blocks"
    for good, path in [
        ("SmolLM2-135M-Instruct", "/v1/models/SmolLM2-135M-Instruct"),
        ("tiny.gguf", "/v1/models/tiny.gguf"),
        ("llama3:8b", "/v1/models/llama3%3A8b"),  # quoted: the replica decodes it back
        ("m_1+x@2", "/v1/models/m_1%2Bx%402"),
    ]:
        assert model_path(good) == path
        assert httpx.URL("http://replica" + path).raw_path == path.encode()
    for bad in ("..", ".", "../metrics", "a/b", "a\\b", "%2e%2e", ".hidden", "", "a b", "a\x00", "é"):
        with pytest.raises(APIError) as refused:
            model_path(bad)
        assert refused.value.status == 404


# ============================================================================== 5. slowloris, bodies
def test_connections_that_never_finish_their_headers_are_closed(fakes: Callable[..., FakeReplica]) -> None:
    """200 connections (half send a partial request line and headers, half nothing) against a router
    with --timeout-header 1: /health answers at once meanwhile, and every one of them is closed by
    the router within the timeout (plus scheduling slack), freeing its descriptor."""
    real = fakes()
    with router([real], timeout_header=1.0) as r:
        opened = time.monotonic()
        socks = []
        for i in range(200):
            s = socket.create_connection(("127.0.0.1", r.port), timeout=10)
            if i % 2:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            socks.append(s)
        try:
            took = []
            for _ in range(3):  # the first may queue behind the 200 accepts on a loaded 2-core machine
                start = time.monotonic()
                assert httpx.get(r.url + "/health", timeout=5).status_code == 200
                took.append(time.monotonic() - start)
            assert sorted(took)[1] < 0.5 and max(took) < 2.0, took
            for s in socks:
                s.settimeout(max(opened + 4.0 - time.monotonic(), 0.01))
                assert s.recv(100) == b""  # closed by the router (a timeout here raises)
            closed = time.monotonic() - opened
            assert closed < 4.0, closed
        finally:
            for s in socks:
                s.close()
        assert httpx.get(r.url + "/health", timeout=5).status_code == 200


def test_a_body_that_stalls_is_a_408(fakes: Callable[..., FakeReplica]) -> None:
    real = fakes()
    with router([real], timeout_body=1.0) as r, socket.create_connection(("127.0.0.1", r.port)) as s:
        s.settimeout(5)
        start = time.monotonic()
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"messages"'
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        assert data.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in data
        assert time.monotonic() - start < 3
    assert real.client_requests() == []


BAD_BODIES = {
    "deep": b"[" * 100_000,
    "deep object": b'{"a":' * 50_000,
    "truncated": b"{oops",
    "not utf-8": b'{"messages": "\xff\xfe"}',
    "empty": b"",
}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/router/explain"])
def test_bad_and_deeply_nested_json_is_a_400(fakes: Callable[..., FakeReplica], path: str) -> None:
    """A 100k-deep ``[[[...`` body was a plain-text 500 (json.loads raises RecursionError): now, as
    every bad body, OpenAI's 400 ``invalid_json``, answered by the router; no replica sees it."""
    real = fakes()
    with router([real], api_key=CLIENT) as r:
        for name, body in BAD_BODIES.items():
            headers = {**bearer(CLIENT), "content-type": "application/json"}
            answer = httpx.post(r.url + path, content=body, headers=headers, timeout=10)
            assert answer.status_code == 400, (name, answer.text)
            assert error_of(answer)["code"] == "invalid_json", name
        assert httpx.get(r.url + "/health").status_code == 200
    assert real.client_requests() == []


# ============================================================================== 10. the read-only routes
def test_who_may_read_what(fakes: Callable[..., FakeReplica]) -> None:
    """/metrics: the metrics or admin key when --metrics-key is set; /router/state and /router/explain:
    the client or admin key; /health and the dashboard page: open, and the page holds no replica
    URL (its data comes from /router/state, keyed)."""
    real = fakes()
    explain = {"endpoint": "chat", "request": chat()}
    with router([real], api_key=CLIENT, admin_key=ADMIN, metrics_key=METRICS) as r:
        for key, metrics, state in [
            (None, 401, 401), (CLIENT, 401, 200), (ADMIN, 200, 200), (METRICS, 200, 401), ("x", 401, 401),
        ]:  # fmt: skip
            headers = bearer(key) if key else {}
            assert httpx.get(r.url + "/metrics", headers=headers).status_code == metrics, key
            assert httpx.get(r.url + "/router/state", headers=headers).status_code == state, key
            answer = httpx.post(r.url + "/router/explain", json=explain, headers=headers)
            assert answer.status_code == state, key
        assert httpx.get(r.url + "/health").status_code == 200
        for page in ("/dashboard", "/dashboard/static/dashboard.js", "/dashboard/static/dashboard.css"):
            answer = httpx.get(r.url + page)
            assert answer.status_code == 200 and real.url not in answer.text, page
        assert httpx.get(r.url + "/dashboard/static/..%2F..%2Fapp.py").status_code == 404
    with router([real]) as r:  # no keys at all: /metrics stays open for Prometheus
        assert httpx.get(r.url + "/metrics").status_code == 200
        assert httpx.get(r.url + "/router/state").status_code == 200


def test_key_flags_default_to_the_environment_and_admin_is_its_own_role(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtier.cli import build_parser
    from kvtier.router.cli import settings_from

    monkeypatch.setenv("KVTIER_ADMIN_KEY", ADMIN)
    monkeypatch.setenv("KVTIER_METRICS_KEY", METRICS)
    monkeypatch.setenv("KVTIER_API_KEY", CLIENT)
    monkeypatch.setenv("KVTIER_KV_READ_KEY", READER)
    settings = settings_from(build_parser().parse_args(["router", "--timeout-header", "2"]))
    keys = (settings.api_key, settings.admin_key, settings.metrics_key, settings.kv_read_key)
    assert keys == (CLIENT, ADMIN, METRICS, READER)
    assert (settings.timeout_header, settings.timeout_body) == (2.0, 30.0)
    monkeypatch.setenv("KVTIER_ADMIN_KEY", "")  # compose's ${KVTIER_ADMIN_KEY:-}: off
    assert settings_from(build_parser().parse_args(["router"])).admin_key is None
    for same in (CLIENT, METRICS, READER):
        with pytest.raises(ConfigError, match="--admin-key must differ"):
            settings_from(build_parser().parse_args(["router", "--admin-key", same]))
    with pytest.raises(ConfigError, match="--timeout-header"):
        settings_from(build_parser().parse_args(["router", "--timeout-header", "-1"]))


def test_the_compose_file_sets_a_client_key_and_no_key_in_clear() -> None:
    """The published router had no key. The compose file now requires the client key from the
    environment (on the router and the replicas alike) and hands the optional admin, metrics and KV read
    keys through; no key is written in it, and no --api-key/--admin-key flag shows in ``ps``."""
    from pathlib import Path

    yaml = pytest.importorskip("yaml")
    text = (Path(__file__).resolve().parent.parent / "deploy" / "compose.yaml").read_text()
    services = yaml.safe_load(text)["services"]
    for name in ("replica-1", "replica-2", "router"):
        env = services[name]["environment"]
        assert env["KVTIER_API_KEY"].startswith("${KVTIER_API_KEY:?"), name
        assert env["KVTIER_ADMIN_KEY"] == "${KVTIER_ADMIN_KEY:-}", name
        assert not any(flag.endswith("-key") for flag in services[name]["command"]), name
    assert services["router"]["environment"]["KVTIER_METRICS_KEY"] == "${KVTIER_METRICS_KEY:-}"
