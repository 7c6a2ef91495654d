"""The router's two-step route (``kvtier.router.disagg``), torch-free: the router runs for real (uvicorn
on loopback, the embedded tokenizer), the replicas are fakes over real HTTP that report a role in
``/v1/kv/info`` and log every request in one shared, ordered log.

    roles         read from /v1/kv/info; in /router/state
    the handoff   a long prompt: prefill (max_tokens 1, no stream) -> publish (its block hashes) -> the
                  client's own request, unchanged, to a decode replica; its answer comes back intact,
                  streamed or not, with the prefill replica named in a header
    the bypass    a short prompt, prompt logprobs, no decode replica: one replica, no prefill
    faults        a prefill answering 500 or resetting: retried on the other prefill replica; every
                  prefill failing, or refusing the body (4xx): the decode replica computes the prompt;
                  a failing decode replica: retried on the next before the first byte, else its error;
                  a decode replica breaking off mid-stream: an error event and [DONE]; a client that
                  leaves during the prefill: the decode replica never hears of it
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx
import pytest

from kvtier.kv.hashing import hash_full_blocks, root_hash
from kvtier.router.disagg import PREFILL_HEADER, prefill_body
from tests.test_router_hardening import FakeReplica, RunningRouter, router, wait_for
from tests.test_router_hardening import fingerprint as fingerprint  # the fixture

MIN_TOKENS = 100
BLOCK_SIZE = 16
CHUNKS = [f'data: {{"choices": [{{"index": 0, "delta": {{"content": "tok{i} "}}}}]}}\n\n' for i in range(5)]


@dataclass
class RoleReplica(FakeReplica):
    """A replica with a ``role`` whose completions answer from ``behave(fake, path, body)``: a status,
    or the strings ``"reset"`` (close without answering), ``"slow"`` (answer after 3 s) and
    ``"break"`` (stream two chunks, then break the chunked body off). ``log``: shared by the fakes."""

    role: str = "both"
    log: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    behave: Callable[..., Any] = lambda fake, path, body: 200
    published: int | None = None  # /v1/kv/publish's "published" (None: as many as asked)

    def answer(self, h: BaseHTTPRequestHandler) -> None:
        if h.path in ("/health", "/v1/kv/info") or h.path.startswith(("/v1/kv/blocks", "/metrics")):
            return super().answer(h)
        body = json.loads(h.rfile.read(int(h.headers.get("content-length") or 0)) or b"{}")
        self.log.append((self.role_name, h.path, body))
        if h.path == "/v1/kv/publish":
            n = len(body["block_hashes"]) if self.published is None else self.published
            return _send_json(h, 200, {"object": "kv.publish", "published": n, "shared_tier": True})
        outcome = self.behave(self, h.path, body)
        if outcome == "reset":
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            h.connection.close()
            return None
        if outcome == "slow":
            time.sleep(3)
            outcome = 200
        if body.get("stream"):
            return _stream(h, outcome == "break")
        answer = {"object": "fake.completion", "replica": self.url, "received": body}
        return _send_json(h, outcome, answer if outcome == 200 else {"error": {"message": "no"}})

    def body(self, path: str) -> dict[str, Any]:
        answer = super().body(path)
        if path == "/v1/kv/info":
            answer.update(role=self.role, media=["device", "host", "remote"], kv_block_bytes=1000)
        return answer

    @property
    def role_name(self) -> str:
        return f"{self.role}:{self.url.rsplit(':', 1)[1]}"


def _send_json(h: BaseHTTPRequestHandler, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    h.send_response(status)
    h.send_header("content-type", "application/json")
    h.send_header("content-length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


def _stream(h: BaseHTTPRequestHandler, break_off: bool) -> None:
    """The chunks as a chunked SSE body; ``break_off``: two chunks, then the connection closes mid-body."""
    h.protocol_version = "HTTP/1.1"
    h.send_response(200)
    h.send_header("content-type", "text/event-stream")
    h.send_header("transfer-encoding", "chunked")
    h.end_headers()
    for chunk in CHUNKS[:2] if break_off else [*CHUNKS, "data: [DONE]\n\n"]:
        data = chunk.encode()
        h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        h.wfile.flush()
        time.sleep(0.01)
    if break_off:
        h.wfile.write(b"40\r\npartial")  # a chunk that never ends
        h.wfile.flush()
        h.close_connection = True
        return
    h.wfile.write(b"0\r\n\r\n")
    h.close_connection = True


@pytest.fixture
def cluster(fingerprint: str) -> Iterator[Callable[..., tuple[RunningRouter, list[RoleReplica]]]]:
    """``make(*roles, **router_settings)``: fakes of those roles (one shared log) behind a router whose
    tokenizer has loaded (the prompt is counted)."""
    made: list[RoleReplica] = []
    contexts: list[Any] = []
    log: list[tuple[str, str, dict[str, Any]]] = []

    def make(*roles: str, **settings: Any) -> tuple[RunningRouter, list[RoleReplica]]:
        fakes = [RoleReplica(fingerprint, role=role, log=log) for role in roles]
        made.extend(fakes)
        settings = {"policy": "cache_aware", "disagg_min_prompt_tokens": MIN_TOKENS, **settings}
        context = router(fakes, **settings)
        running = context.__enter__()
        contexts.append(context)
        wait_for(lambda: running.app.state.router.tokenizer is not None, 30)
        return running, fakes

    yield make
    for context in contexts:
        context.__exit__(None, None, None)
    for fake in made:
        fake.close()


def long_chat(**extra: Any) -> dict[str, Any]:
    text = " ".join(f"fact {i} about the cache block" for i in range(60))  # ~400 tokens
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 20, **extra}


def short_chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20, **extra}


def post(r: RunningRouter, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(r.url + path, json=body, timeout=30)


def metric(r: RunningRouter, name: str, **labels: str) -> float:
    text = httpx.get(r.url + "/metrics", timeout=10).text
    selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # the exposition sorts them
    wanted = f"kvtier_router:{name}{{{selector}}}" if labels else f"kvtier_router:{name}"
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def steps(fakes: list[RoleReplica]) -> list[tuple[str, str]]:
    """The shared log as (role, path): who was asked what, in order."""
    return [(who.split(":")[0], path) for who, path, _ in fakes[0].log]


def hashes_of(r: RunningRouter, body: dict[str, Any]) -> list[str]:
    """The prompt's full-block hashes as the router computes them for the fakes' cache identity."""
    prompt = r.app.state.router
    ids = prompt.tokenizer.encode_chat(body["messages"], add_generation_prompt=True)[1]
    return [h.hex() for h in hash_full_blocks(ids, BLOCK_SIZE, root_hash(("fake:float32", "")))]


# ============================================================================== roles and the handoff
def test_roles_come_from_kv_info_and_show_in_the_state(cluster: Callable[..., Any]) -> None:
    r, _ = cluster("prefill", "decode", "both")
    roles = sorted(rep["role"] for rep in r.state()["replicas"])
    assert roles == ["both", "decode", "prefill"]


def test_story_a_long_prompt_is_prefilled_published_then_answered_by_a_decode_replica(
    cluster: Callable[..., Any],
) -> None:
    r, fakes = cluster("prefill", "decode")
    prefill, decode = fakes
    body = long_chat(n=2, stream=False, min_tokens=3, response_format={"type": "json_object"})
    answer = post(r, body)
    assert answer.status_code == 200, answer.text
    # Act 1: the prefill replica computed the prompt with one token, no stream, one sequence...
    assert steps(fakes) == [("prefill", "/v1/chat/completions"), ("prefill", "/v1/kv/publish"),
                            ("decode", "/v1/chat/completions")]  # fmt: skip
    _, _, sent = prefill.log[0]
    assert sent["max_tokens"] == 1 and sent["stream"] is False and sent["n"] == 1
    assert sent["messages"] == body["messages"] and "min_tokens" not in sent and "response_format" not in sent
    # Act 2: ...then published every full block of it, as the router hashes it...
    _, _, published = prefill.log[1]
    assert published["block_hashes"] == hashes_of(r, body) and len(published["block_hashes"]) >= 20
    assert published["timeout_s"] == 5.0
    # Act 3: ...and the decode replica received the client's request exactly as sent, and answered it.
    assert decode.log[2][2] == body
    assert answer.json() == {"object": "fake.completion", "replica": decode.url, "received": body}
    assert answer.headers["x-kvtier-replica"] == decode.url and answer.headers[PREFILL_HEADER] == prefill.url
    assert metric(r, "handoffs_total", outcome="handoff") == 1
    assert metric(r, "requests_routed_total", replica=prefill.url, reason="prefill") == 1
    assert metric(r, "requests_routed_total", replica=decode.url, reason="handoff") == 1
    assert metric(r, "handoff_blocks_total") == len(published["block_hashes"])
    assert metric(r, "handoff_bytes_total") == 1000 * len(published["block_hashes"])
    assert metric(r, "handoff_seconds_count") == 1
    assert metric(r, "handoff_overhead_seconds_count") == 1  # prefill answered -> the decode answer
    assert metric(r, "handoff_publish_seconds_count") == 1  # the part of it waiting for the publish
    assert metric(r, "handoff_publish_seconds_sum") <= metric(r, "handoff_overhead_seconds_sum")


def test_a_streamed_answer_comes_back_intact(cluster: Callable[..., Any]) -> None:
    r, fakes = cluster("prefill", "decode")
    body = long_chat(stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", r.url + "/v1/chat/completions", json=body, timeout=30) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        received = b"".join(answer.iter_raw()).decode()
    assert received == "".join(CHUNKS) + "data: [DONE]\n\n"
    prefilled = fakes[0].log[0][2]
    assert prefilled["stream"] is False and "stream_options" not in prefilled
    assert fakes[1].log[-1][2] == body
    assert metric(r, "handoff_overhead_seconds_count") == 1  # at the decode stream's first token


def test_completions_and_messages_are_handed_off_too(cluster: Callable[..., Any]) -> None:
    r, fakes = cluster("prefill", "decode")
    text = " ".join(f"word{i}" for i in range(200))
    done = post(r, {"model": "m", "prompt": text, "max_tokens": 5, "echo": False}, "/v1/completions")
    assert done.status_code == 200 and done.headers[PREFILL_HEADER] == fakes[0].url
    messages = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": text}]}
    sent = post(r, messages, "/v1/messages")
    assert sent.status_code == 200 and sent.headers[PREFILL_HEADER] == fakes[0].url
    assert steps(fakes)[3:] == [("prefill", "/v1/messages"), ("prefill", "/v1/kv/publish"),
                                ("decode", "/v1/messages")]  # fmt: skip
    assert fakes[0].log[3][2] == {**messages, "max_tokens": 1, "stream": False}
    assert fakes[0].log[5][2] == messages


# ============================================================================== the bypass
def test_a_short_prompt_goes_straight_to_a_decode_replica(cluster: Callable[..., Any]) -> None:
    r, fakes = cluster("prefill", "decode", "both")
    for _ in range(4):
        answer = post(r, short_chat())
        assert answer.status_code == 200 and PREFILL_HEADER not in answer.headers
        assert answer.headers["x-kvtier-replica"] in (fakes[1].url, fakes[2].url)
    assert fakes[0].log == [] or all(who.startswith(("decode", "both")) for who, _, _ in fakes[0].log)
    assert metric(r, "handoffs_total", outcome="short") == 4


def test_prompt_logprobs_are_computed_whole_on_a_decode_replica(cluster: Callable[..., Any]) -> None:
    r, fakes = cluster("prefill", "decode")
    text = " ".join(f"word{i}" for i in range(200))
    body = {"model": "m", "prompt": text, "max_tokens": 1, "echo": True, "logprobs": 1}
    answer = post(r, body, "/v1/completions")
    assert answer.status_code == 200 and answer.headers["x-kvtier-replica"] == fakes[1].url
    assert steps(fakes) == [("decode", "/v1/completions")]
    assert metric(r, "handoffs_total", outcome="unscored") == 1


def test_without_a_decode_replica_a_prefill_replica_serves_the_request_whole(
    cluster: Callable[..., Any],
) -> None:
    r, fakes = cluster("prefill")
    answer = post(r, long_chat(stream=True))
    assert answer.status_code == 200 and answer.text.endswith("data: [DONE]\n\n")
    assert steps(fakes) == [("prefill", "/v1/chat/completions")]
    assert metric(r, "handoffs_total", outcome="no_decode") == 1


def test_a_cluster_without_prefill_replicas_routes_as_before(cluster: Callable[..., Any]) -> None:
    r, fakes = cluster("decode", "both")
    assert post(r, long_chat()).status_code == 200
    assert [path for _, path in steps(fakes)] == ["/v1/chat/completions"]
    assert metric(r, "handoffs_total", outcome="handoff") == 0


# ============================================================================== faults
@pytest.mark.parametrize("failure", [500, 503, "reset"])
def test_a_failing_prefill_is_retried_on_another_prefill_replica(
    cluster: Callable[..., Any], failure: Any
) -> None:
    r, fakes = cluster("prefill", "prefill", "decode")
    first = r.app.state.router.rank(None, {}, "", among=lambda rep: rep.role == "prefill").replicas[0]
    bad = next(f for f in fakes if f.url == first.url)
    bad.behave = lambda fake, path, body: failure
    good = next(f for f in fakes[:2] if f is not bad)
    # round robin among equal prefill replicas: two requests, so one surely tries the bad one first
    for _ in range(2):
        answer = post(r, long_chat())
        assert answer.status_code == 200 and answer.headers["x-kvtier-replica"] == fakes[2].url
        assert answer.headers[PREFILL_HEADER] == good.url
    assert metric(r, "handoffs_total", outcome="handoff") == 2
    assert metric(r, "requests_routed_total", replica=good.url, reason="retry") >= 1
    assert not any(path == "/v1/kv/publish" for who, path, _ in bad.log if who == bad.role_name)


@pytest.mark.parametrize("failure", [500, "reset", 400])
def test_when_no_prefill_succeeds_the_decode_replica_computes_the_prompt(
    cluster: Callable[..., Any], failure: Any
) -> None:
    r, fakes = cluster("prefill", "prefill", "decode")
    for fake in fakes[:2]:
        fake.behave = lambda fake, path, body: failure
    body = long_chat(stream=True)
    answer = post(r, body)
    assert answer.status_code == 200 and answer.text == "".join(CHUNKS) + "data: [DONE]\n\n"
    assert PREFILL_HEADER not in answer.headers
    prefills = [path for role, path in steps(fakes) if role == "prefill"]
    assert prefills == ["/v1/chat/completions"] * (1 if failure == 400 else 2)  # a 4xx is not retried
    assert fakes[2].log[-1][2] == body
    assert metric(r, "handoffs_total", outcome="prefill_failed") == 1


def test_a_dead_prefill_replica_never_fails_a_request(cluster: Callable[..., Any]) -> None:
    r, fakes = cluster("prefill", "decode")
    fakes[0].close()  # refused from now on; the health check notices within half a second
    for _ in range(3):
        answer = post(r, long_chat())
        assert answer.status_code == 200 and answer.headers["x-kvtier-replica"] == fakes[1].url
    wait_for(lambda: [rep.role for rep in r.app.state.router.replicas.healthy()] == ["decode"], 5)


def test_a_publish_that_fails_or_finds_fewer_blocks_still_hands_off(cluster: Callable[..., Any]) -> None:
    r, fakes = cluster("prefill", "decode")
    fakes[0].published = 3  # fewer than asked: the decode replica computes the rest
    answer = post(r, long_chat())
    assert answer.status_code == 200 and answer.headers[PREFILL_HEADER] == fakes[0].url
    assert metric(r, "handoff_blocks_total") == 3


def test_a_failing_decode_replica_is_retried_before_the_first_byte_else_its_error_comes_back(
    cluster: Callable[..., Any],
) -> None:
    r, fakes = cluster("prefill", "decode", "decode")
    first = r.app.state.router.rank(None, {}, "", among=lambda rep: rep.role == "decode").replicas[0]
    bad = next(f for f in fakes if f.url == first.url)
    bad.behave = lambda fake, path, body: 503
    for _ in range(2):
        answer = post(r, long_chat())
        assert answer.status_code == 200 and answer.headers["x-kvtier-replica"] != bad.url
    other = next(f for f in fakes[1:] if f is not bad)
    other.behave = lambda fake, path, body: 503
    answer = post(r, long_chat())
    assert answer.status_code == 503 and answer.json()["error"]["message"] == "no"


def test_a_decode_replica_breaking_off_mid_stream_ends_it_with_an_error_event(
    cluster: Callable[..., Any],
) -> None:
    r, fakes = cluster("prefill", "decode")
    fakes[1].behave = lambda fake, path, body: "break"
    answer = post(r, long_chat(stream=True))
    assert answer.status_code == 200
    events = [e for e in answer.text.split("\n\n") if e]
    assert events[:2] == [c.strip() for c in CHUNKS[:2]]
    assert "the replica broke off the stream" in events[-2] and events[-1] == "data: [DONE]"


def test_a_client_that_leaves_during_the_prefill_never_reaches_a_decode_replica(
    cluster: Callable[..., Any],
) -> None:
    r, fakes = cluster("prefill", "decode")
    fakes[0].behave = lambda fake, path, body: "slow"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(r.url + "/v1/chat/completions", json=long_chat(), timeout=0.5)
    time.sleep(3.5)  # the prefill's slow answer came and went
    assert steps(fakes) == [("prefill", "/v1/chat/completions")]


# ============================================================================== the pieces
def test_the_prefill_body_keeps_the_prompt_and_asks_for_one_token() -> None:
    given = {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}], "n": 3,
             "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 9,
             "logprobs": True, "top_logprobs": 2, "seed": 4, "cache_salt": "s", "best_of": 3}  # fmt: skip
    assert prefill_body(given) == {
        "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}], "n": 1,
        "stream": False, "max_tokens": 1, "seed": 4, "cache_salt": "s",
    }  # fmt: skip
    assert "n" not in prefill_body({"messages": [], "max_tokens": 50})  # Anthropic's has none
    responses = {
        "input": "x",
        "max_output_tokens": 50,
        "stream": True,
        "text": {"format": {"type": "json_object"}},
    }
    assert prefill_body(responses, "/v1/responses") == {"input": "x", "max_output_tokens": 1, "stream": False}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--disagg-min-prompt-tokens", "-1"], "--disagg-min-prompt-tokens must be >= 0"),
        (["--disagg-publish-timeout", "31"], "--disagg-publish-timeout must be in [0, 30]"),
    ],
)
def test_bad_disagg_flags_are_one_line(flags: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    from kvtier.cli import main

    status = main(["router", *flags])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("kvtier: error: ") and message in err, err
