"""The router's pieces without any network: the policies' decisions, the bounded block index fed with
real event batches, the salt and the hashes of a request. Fast: no replica, no torch."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from kvtier.kv.hashing import BlockHash, hash_full_blocks, root_hash
from kvtier.kv_events import EventBatch, KVEvent, KVEventRecorder
from kvtier.router.index import ReplicaIndex, prompt_blocks, remote_run
from kvtier.router.policy import Candidate, CostModel, cache_aware, decide, estimate
from kvtier.router.prompt import Prompt, parse_prompt
from kvtier.server.protocol import tenant_salt
from kvtier.stats import Medium

COST = CostModel(remote_cost=0.1, load_tokens=256.0, near_tie=0.05, min_slack=1.0)


# ------------------------------------------------------------------------------------------ policy
def test_story_a_returning_conversation_goes_where_its_prefix_is() -> None:
    """Act 1: a 1000-token conversation is held by b; a and b are idle: b wins on cache."""
    a, b = Candidate("a", load=0), Candidate("b", load=0, cached_tokens=960)
    d = cache_aware([a, b], 1000, COST, turn=0)
    assert d.choice == 1 and d.reason == "cache_hit" and d.cached_tokens == 960
    # Act 2: b has two requests queued: 40 + 2*256 = 552 tokens of work, still less than 1000.
    d = cache_aware([a, Candidate("b", load=2, cached_tokens=960)], 1000, COST, turn=0)
    assert d.choice == 1
    # Act 3: four queued on b: 40 + 1024 > 1000 on a: the queue decides, a wins, reason "load".
    d = cache_aware([a, Candidate("b", load=4, cached_tokens=960)], 1000, COST, turn=0)
    assert d.choice == 0 and d.reason == "load" and d.cached_tokens == 0
    assert d.ranking == (0, 1)  # the retry would go to b


def test_remote_blocks_are_cheap_everywhere_but_not_free() -> None:
    local = Candidate("a", load=0, cached_tokens=512)
    remote = Candidate("b", load=0, remote_tokens=512)
    assert estimate(local, 600, COST) == 88
    assert estimate(remote, 600, COST) == pytest.approx(88 + 51.2)
    d = cache_aware([remote, local], 600, COST, turn=0)
    assert d.choice == 1 and d.reason == "cache_hit"


def test_a_burst_of_one_new_prefix_spreads() -> None:
    """Eight requests of one prefix nobody holds, each decision seeing the previous ones queued."""
    loads = [0, 0, 0]
    picks = []
    for turn in range(8):
        candidates = [Candidate(name, load) for name, load in zip("abc", loads, strict=True)]
        d = cache_aware(candidates, 800, COST, turn)
        loads[d.choice] += 1
        picks.append(d.choice)
    assert sorted(loads) == [2, 3, 3]
    assert picks[:3] in ([0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 2, 1], [1, 0, 2], [2, 1, 0])


def test_long_new_prompts_in_flight_count_as_queued_prefill_work() -> None:
    """Two new users' 1,000-token prompts and one returning user arrive together (bench cluster (c)).
    The prefill work the router already sent (no first token yet) spreads the new prompts, and the
    returning user still goes where its history is."""
    a, b = Candidate("a", load=0), Candidate("b", load=0)
    first = cache_aware([a, b], 1000, COST, turn=0)  # new user 1: nobody holds it
    assert first.work == (1000, 1000)
    # new user 2: one request on each replica, but only the one user 1 went to is still prefilling
    # (the other is decoding): request counts tie, the queued prefill work does not, in any turn
    queue = [1000 if i == first.choice else 0 for i in range(2)]
    busy = [Candidate(c.name, 1, queued_tokens=q) for c, q in zip([a, b], queue, strict=True)]
    assert all(cache_aware(busy, 1000, COST, turn).choice != first.choice for turn in range(4))
    # both replicas now prefill 1,000 new tokens; b holds 896 tokens of the returning user's history
    a, b = Candidate("a", 1, queued_tokens=1000), Candidate("b", 1, cached_tokens=896, queued_tokens=1000)
    back = cache_aware([a, b], 1000, COST, turn=0)
    assert back.choice == 1 and back.reason == "cache_hit" and back.work == (1000, 104)
    assert estimate(b, 1000, COST) == 104 + 1000 + 256


def test_near_ties_go_to_the_least_loaded_then_in_turn() -> None:
    """Costs 1000 and 1030 (within 5%): a tie; the less loaded wins even though it costs a bit more."""
    a = Candidate("a", load=1, cached_tokens=256)  # 744 + 256 = 1000
    b = Candidate("b", load=0, cached_tokens=0)  # 1000... plus nothing
    c = Candidate("c", load=3)
    d = cache_aware([a, b, c], 1030, COST, turn=0)
    assert d.choice == 1
    same = [Candidate("a", 0), Candidate("b", 0)]
    assert {cache_aware(same, 100, COST, turn).choice for turn in range(4)} == {0, 1}


def test_the_other_policies() -> None:
    cands = [Candidate("a", 2, cached_tokens=900), Candidate("b", 1), Candidate("c", 1)]
    assert [decide("round_robin", cands, 1000, COST, t).choice for t in range(4)] == [0, 1, 2, 0]
    least = [decide("least_loaded", cands, 1000, COST, t) for t in range(2)]
    assert [d.choice for d in least] == [1, 2] and least[0].reason == "load"
    fallback = decide("cache_aware", cands, None, COST, 0)  # no hashes: by load
    assert fallback.reason == "fallback" and fallback.choice in (1, 2)
    with pytest.raises(ValueError):
        decide("cache_aware", [], 10, COST, 0)


# ------------------------------------------------------------------------------------------ index
def _hashes(n: int, salt: str = "") -> list[BlockHash]:
    return hash_full_blocks(list(range(4 * n)), 4, root_hash(("id:float32", salt)))


def test_story_index_follows_a_recorder_and_notices_gaps() -> None:
    """Real batches from the engine's recorder: stored, moved down a tier, removed, a gap, a restart."""
    h = _hashes(6)
    rec = KVEventRecorder("r:1")
    index = ReplicaIndex()
    rec.blocks_stored(Medium.DEVICE, h[:4])
    assert index.apply(rec.end_step())  # seq 1: cleared + stored
    assert index.local_prefix(h) == 4
    rec.blocks_stored(Medium.HOST, h[:2])
    rec.blocks_removed(Medium.DEVICE, h[:2])
    rec.blocks_stored(Medium.REMOTE, h[4:6])
    assert index.apply(rec.end_step())
    assert index.local_prefix(h) == 4  # blocks 0, 1 now on host: still this replica's
    assert index.counts() == {"device": 2, "host": 2, "disk": 0, "remote": 2}
    assert remote_run([ReplicaIndex(), index], h, 4) == 2
    rec.blocks_removed(Medium.HOST, h[:1])
    rec.end_step()  # seq 3 lost
    rec.blocks_stored(Medium.DISK, h[5:6])
    assert not index.apply(rec.end_step())  # seq 4 after 2: a gap
    assert index.num_gaps == 1
    restarted = KVEventRecorder("r:1")  # a new instance: cleared first
    assert index.apply(restarted.end_step())
    assert len(index) == 0 and index.local_prefix(h) == 0


def test_story_a_batched_completion_is_scored_on_every_prompt() -> None:
    """A /v1/completions request with two prompts: b holds the second one's blocks, a holds nothing, and
    the first prompt's blocks are in the remote tier. Every prompt counts, so b wins on cache."""
    first, second = Prompt(list(range(16)), None), Prompt(list(range(100, 120)), None)
    batch = Prompt(first.token_ids, None, (second.token_ids,))
    chains = batch.all_block_hashes("id:float32", 4)
    assert chains == [first.block_hashes("id:float32", 4), second.block_hashes("id:float32", 4)]
    a_rec, b_rec = KVEventRecorder("a:1"), KVEventRecorder("b:1")
    a, b = ReplicaIndex(), ReplicaIndex()
    a_rec.blocks_stored(Medium.REMOTE, chains[0][:2])
    b_rec.blocks_stored(Medium.DEVICE, chains[1])
    assert a.apply(a_rec.end_step()) and b.apply(b_rec.end_step())
    assert prompt_blocks(a, [a, b], chains) == (0, 2)  # the first prompt's remote run only
    assert prompt_blocks(b, [a, b], chains) == (5, 2)  # all 5 blocks of the second, then the remote 2
    candidates = [
        Candidate(name, 0, 4 * local, 4 * remote)
        for name, (local, remote) in (
            ("a", prompt_blocks(a, [a, b], chains)),
            ("b", prompt_blocks(b, [a, b], chains)),
        )
    ]
    d = cache_aware(candidates, batch.num_tokens, COST, turn=0)
    assert d.choice == 1 and d.reason == "cache_hit" and d.cached_tokens == 28
    assert d.work == (36 - 8 + round(0.1 * 8), round(36 - 28 + 0.1 * 8))
    # Scored on its first prompt alone (as before), the batch would have looked uncached everywhere:
    only_first = [prompt_blocks(x, [a, b], chains[:1]) for x in (a, b)]
    assert only_first == [(0, 2), (0, 2)]


def test_index_is_bounded_and_forgets_the_oldest() -> None:
    h = _hashes(10)
    index = ReplicaIndex(max_blocks=4)
    batch = EventBatch("r", "i", 1, 0.0, (KVEvent("stored", Medium.DEVICE, tuple(h[:6])),))
    index.apply(batch)
    assert len(index) == 4 and index.num_forgotten == 2
    assert index.local_prefix(h) == 0  # blocks 0 and 1 were forgotten: an underestimate, never wrong
    assert index.local_prefix(h[2:]) == 4


def test_seed_from_a_snapshot_keeps_remote_blocks_it_cannot_list() -> None:
    h = _hashes(3)
    index = ReplicaIndex()
    index.apply(EventBatch("r", "i", 1, 0.0, (KVEvent("stored", Medium.REMOTE, tuple(h)),)))
    index.seed({"instance": "i", "seq": 7, "blocks": {"device": [h[0].hex()], "host": []}}, last_id="5-0")
    assert index.counts()["remote"] == 3 and index.local_prefix(h) == 1
    assert (index.instance, index.seq, index.last_id) == ("i", 7, "5-0")
    index.apply(EventBatch("r", "i", 7, 0.0, (KVEvent("stored", Medium.DEVICE, tuple(h)),)))
    assert index.local_prefix(h) == 1  # seq 7 is in the snapshot already: skipped


def test_a_restarted_router_takes_remote_blocks_from_the_stream() -> None:
    """The snapshot lists device/host/disk only; the stream's remote announcements of the current
    instance (after its 'cleared') are replayed on top; an older instance's are not."""
    h = _hashes(4)
    old, new = KVEventRecorder("r:1"), KVEventRecorder("r:1")
    old.blocks_stored(Medium.REMOTE, h[:1])
    new.blocks_stored(Medium.REMOTE, h[:3])
    new.blocks_stored(Medium.DEVICE, h[:2])
    stream = [old.end_step(), new.end_step()]
    new.blocks_removed(Medium.REMOTE, h[2:3])
    stream.append(new.end_step())
    index = ReplicaIndex()
    index.seed({"instance": new.instance, "seq": 2, "blocks": {"device": [x.hex() for x in h[:2]]}})
    index.replay_remote(stream)
    assert index.counts() == {"device": 2, "host": 0, "disk": 0, "remote": 2}
    assert remote_run([index], h, 0) == 2


# ------------------------------------------------------------------------------------------ prompts
def test_tenant_salt_is_the_servers() -> None:
    """The derivation for --prefix-cache-scope user: one function (kvtier.server.protocol.tenant_salt)
    that the replicas and the router both call, pinned here by its known answer."""
    want = hashlib.sha256(json.dumps(("k1", "alice", "s")).encode()).hexdigest()
    assert tenant_salt("Bearer k1", "alice", "s", "user") == want
    assert tenant_salt("Bearer k1", "alice", "s", "shared") == "s"
    assert tenant_salt("", None, None, "shared") is None


def test_parse_prompt_renders_like_the_server(tiny_tokenizer_dir) -> None:  # noqa: ANN001
    from kvtier.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_tokenizer_dir)
    body = {"messages": [{"role": "user", "content": "Hello, world!"}], "cache_salt": "t1"}
    p = parse_prompt(tok, "/v1/chat/completions", body)
    assert p is not None and p.cache_salt == "t1"
    assert p.token_ids == tok.encode_chat([{"role": "user", "content": "Hello, world!"}], True)[1]
    ids = parse_prompt(tok, "/v1/completions", {"prompt": [[5, 6, 7], [1]]})
    assert ids == Prompt([5, 6, 7], None, ([1],)) and ids.num_tokens == 4  # every prompt of the batch
    texts = parse_prompt(tok, "/v1/completions", {"prompt": ["Hello", "world"], "cache_salt": "s"})
    assert texts == Prompt(tok.encode("Hello"), "s", (tok.encode("world"),))
    scored = parse_prompt(tok, "/v1/completions", {"prompt": "Hello", "echo": True, "logprobs": 1})
    assert scored is not None and scored.uncached  # prompt logprobs: the replica takes no cache hit
    assert not parse_prompt(tok, "/v1/completions", {"prompt": "Hello", "echo": True}).uncached
    prefill = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure,"}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    opened = parse_prompt(tok, "/v1/chat/completions", {"messages": prefill, **flags})
    assert opened is not None  # the open message, as the replica renders it
    assert opened.token_ids == tok.encode_chat(prefill, False, continue_final_message=True)[1]
    anthropic = parse_prompt(tok, "/v1/messages", {"model": "m", "max_tokens": 1, "messages": prefill})
    assert anthropic is not None and anthropic.token_ids == opened.token_ids  # a prefill there
    assert parse_prompt(tok, "/v1/chat/completions", {"messages": "nope"}) is None
    assert parse_prompt(tok, "/v1/chat/completions", None) is None
    b = Prompt(list(range(10)), None).block_hashes("x:float32", 4)
    assert b == hash_full_blocks(list(range(10)), 4, root_hash(("x:float32", "")))


def test_the_router_never_imports_torch() -> None:
    """Not at start-up (FastAPI neither: the router answers within well under a second), and not when
    it loads the tokenizer and the request models."""
    code = (
        "import sys, kvtier.router.app, kvtier.router.cli, uvicorn;"
        "assert 'torch' not in sys.modules and 'fastapi' not in sys.modules, 'heavy import at start';"
        "from kvtier.router.prompt import load_tokenizer;"
        "import kvtier.server.protocol, kvtier.models.loader;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_router_errors_have_the_servers_shape() -> None:
    """The router answers its own errors with the replicas' type (kvtier.server.protocol.APIError): the
    bytes on the wire pinned, as they were when the router had a copy of its own."""
    from kvtier.router.app import model_path
    from kvtier.server.protocol import APIError

    args = (503, "no replica")
    kwargs = dict(type="server_error", param="x", code="no_healthy_replica", headers={"Retry-After": "1"})
    mine = APIError(*args, **kwargs).response()
    want = b'{"error":{"message":"no replica","type":"server_error","param":"x","code":"no_healthy_replica"}}'
    assert mine.body == want and mine.status_code == 503
    assert mine.headers["retry-after"] == "1"
    with pytest.raises(APIError) as refused:
        model_path("..")
    assert refused.value.status == 404 and refused.value.code == "model_not_found"


# ------------------------------------------------------------------------------------------ identity
def test_a_replica_with_another_hash_spec_or_model_is_routed_by_load_only() -> None:
    from kvtier.kv.hashing import HASH_SPEC_VERSION
    from kvtier.router.replicas import ReplicaSet, normalize_url

    replicas = ReplicaSet(client=None, headers={}, fingerprint=lambda: "abc")  # type: ignore[arg-type]
    info = {"hash_spec_version": HASH_SPEC_VERSION, "enable_prefix_caching": True, "model_fingerprint": "abc"}
    assert replicas._problem(info) is None
    assert "hash spec version 2" in replicas._problem({**info, "hash_spec_version": 2})
    assert "fingerprint" in replicas._problem({**info, "model_fingerprint": "other"})
    assert "prefix caching is off" in replicas._problem({**info, "enable_prefix_caching": False})
    assert normalize_url(" http://h:1/ ") == "http://h:1"
    for bad in ("h:1", "ftp://h", "http://h:1/?q=1", "http://"):
        with pytest.raises(ValueError):
            normalize_url(bad)


def test_a_replicas_load_comes_with_its_health_answer() -> None:
    """``kvtier serve`` answers /health with its queue (tests/test_server.py pins that); the router takes
    the load from there, and only an answer without it sends the router to the replica's /metrics."""
    import httpx

    from kvtier.router.index import ReplicaIndex
    from kvtier.router.replicas import Replica, _load_from_health

    replica = Replica("http://r:1", ReplicaIndex())
    ok = {"status": "ok", "num_requests_running": 3, "num_requests_waiting": 2}
    assert _load_from_health(replica, httpx.Response(200, json=ok))
    assert (replica.running, replica.waiting, replica.load) == (3, 2, 5)
    assert not _load_from_health(replica, httpx.Response(200, json={"status": "ok"}))  # an older replica
    assert replica.load == 5


def test_the_default_models_tokenizer_is_the_engines(converted_default_model) -> None:  # noqa: ANN001
    """The router's torch-free tokenizer of the embedded GGUF (through the conversion cache) has the
    engine's fingerprint and renders and tokenizes a chat exactly as the engine's tokenizer does."""
    from kvtier.router.prompt import load_tokenizer

    tokenizer, fingerprint = load_tokenizer(None)
    assert fingerprint == converted_default_model.fingerprint
    conversation = [
        {"role": "system", "content": "You are terse. <|im_end|> stays text."},
        {"role": "user", "content": "Héllo 🙂, what is a KV block?"},
    ]
    want = converted_default_model.tokenizer.encode_chat(conversation, add_generation_prompt=True)
    assert tokenizer.encode_chat(conversation, add_generation_prompt=True) == want
    assert tokenizer.encode("plain text prompt") == converted_default_model.tokenizer.encode(
        "plain text prompt"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--replica", "ftp://x"], "--replica: a replica is an http(s)://host:port URL"),
        (["--port", "70000"], "--port must be in [0, 65535]"),
        (["--kv-remote-url", "http://x"], "--kv-remote-url must be a redis:// URL"),
        (["--load-tokens", "-1"], "--load-tokens must be a finite number >= 0"),
        (["--policy", "random"], "invalid choice: 'random'"),
    ],
)
def test_bad_router_flags_are_one_line(flags: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    from kvtier.cli import main

    try:
        status = main(["router", *flags])
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("kvtier: error: ") and message in err, err


def test_the_router_counts_a_chat_streams_first_token_after_its_role_event() -> None:
    """The replica's role event (compact JSON, sent before its prefill ends) does not release the
    prompt's pending prefill; the first token's event does."""
    import asyncio

    import httpx

    from kvtier.router.proxy import _relay
    from kvtier.server.responses import sse

    role = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}).encode()
    token = sse({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}).encode()

    class Chunks(httpx.AsyncByteStream):
        async def __aiter__(self):  # noqa: ANN204
            for chunk in (role, token):
                yield chunk

    upstream = httpx.Response(200, stream=Chunks(), headers={"content-type": "text/event-stream"})
    seen: list[bytes] = []
    released_after: list[int] = []

    async def relay() -> None:
        async for chunk in _relay(upstream, lambda: released_after.append(len(seen))):
            seen.append(chunk)

    asyncio.run(relay())
    assert seen == [role, token] and released_after == [1]  # at the token, not at the role event


def test_a_prompt_cache_key_stays_with_its_replica_while_it_is_not_much_busier() -> None:
    """Where the key went before wins over a slightly better replica (``affinity``); past two queued
    requests' worth of cost the policy's own choice stands."""
    from kvtier.router.policy import keep_affinity

    model = CostModel()
    a, b = Candidate("a", load=0), Candidate("b", load=1)
    decision = decide("cache_aware", [a, b], 500, model, turn=0)
    assert decision.choice == 0
    kept = keep_affinity(decision, [a, b], 1, 500, model)
    assert kept.ranking == (1, 0) and kept.reason == "affinity"
    busy = Candidate("b", load=3)
    decision = decide("cache_aware", [a, busy], 500, model, turn=0)
    assert keep_affinity(decision, [a, busy], 1, 500, model) is decision  # 3 queued: too busy
    assert keep_affinity(decision, [a, busy], None, 500, model) is decision  # no key seen before
    held = Candidate("b", load=1, cached_tokens=480)  # the key's replica also holds the prefix
    decision = decide("least_loaded", [a, held], None, model, turn=0)
    assert keep_affinity(decision, [a, held], 1, None, model).choice == 1


def test_the_affinity_table_is_scoped_bounded_and_forgets() -> None:
    from kvtier.router.affinity import Affinity, cache_key

    now = [0.0]
    table = Affinity(max_keys=2, ttl_s=60, clock=lambda: now[0])
    alice, bob = (
        cache_key({"prompt_cache_key": "k"}, "Bearer A"),
        cache_key({"prompt_cache_key": "k"}, "Bearer B"),
    )
    assert alice != bob and cache_key({"prompt_cache_key": ""}, "x") is None and cache_key([], "x") is None
    table.put(alice, "http://r1")
    table.put(bob, "http://r2")
    assert (table.get(alice), table.get(bob)) == ("http://r1", "http://r2")
    table.put(cache_key({"prompt_cache_key": "other"}, "Bearer A"), "http://r1")  # the oldest goes
    assert table.get(alice) is None and len(table) == 2
    now[0] = 61.0
    assert table.get(bob) is None  # unused for longer than its TTL
