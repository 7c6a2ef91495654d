"""KV groups past the device pool, on a tiny random Gemma 3 (``s s F s s F``, a 6-token window over
4-token blocks: groups full (2, 5) | sliding (0, 3) | sliding (1, 4), as in ``test_hybrid_engine.py``).

- KV events name each block's group, under that group's keys (``group_key(h, g)``);
- a disk block rewritten under another group's key is refused by its header: a counted miss, and the
  answer is still transformers' token for token;
- the router, fed this engine's real events and ``/v1/kv/info``, scores a prefix exactly as the engine
  looks it up, and prefers the replica holding the full *and* sliding blocks;
- the canary samples the sliding groups' blocks too, and catches a bad one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import torch

from kvtier import LLM
from kvtier.kv.hashing import BlockHash, group_key, hash_full_blocks, root_hash
from kvtier.kv_events import EventBatch, read_batches, stream_key
from kvtier.router import policy
from kvtier.router.core import _blocks
from kvtier.router.groups import layout_of
from kvtier.router.index import ReplicaIndex, prompt_blocks
from kvtier.router.prompt import Prompt
from kvtier.router.replicas import Replica
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.serve import serve_in_thread
from kvtier.stats import Medium
from kvtier.tiers.block_format import HEADER_NBYTES, decode_header, read_block_file, write_block_file
from kvtier.transfer.mover import byte_view
from tests.redis_server import RedisServer
from tests.test_hybrid_engine import (
    BLOCK,
    WINDOW,
    check_idle,
    hf_continuation,
    make,
    prompts_of,
    tiny_gemma,
)
from tests.test_qwen3 import GREEDY, token_ids

GROUPS = (0, 1, 2)
BLOCK_BYTES = 2 * BLOCK * 2 * 2 * 16 * 4  # 2 slots x 4 tokens x K,V x 2 kv heads x head_dim 16 x fp32


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gemma(tmp_path_factory.mktemp("gemma_groups"))


@pytest.fixture(scope="module")
def prompts(gemma: Path) -> list[list[int]]:
    return prompts_of(gemma)


def chain(llm: LLM, tokens: list[int]) -> list[BlockHash]:
    return hash_full_blocks(tokens, BLOCK, root_hash((llm.engine.cache_identity, "")))


def keys_of(llm: LLM, sequences: list[list[int]]) -> dict[int, set[str]]:
    """Every group's keys (hex) of every full block of ``sequences``."""
    return {g: {group_key(h, g).hex() for seq in sequences for h in chain(llm, seq)} for g in GROUPS}


def generate(llm: LLM, prompt: list[int]) -> list[int]:
    return token_ids(llm.generate({"prompt_token_ids": prompt}, GREEDY))[0]


def lookup(llm: LLM, tokens: list[int]) -> int:
    """The engine's own prefix hit for ``tokens`` now (a pure lookup of the device pool), in tokens."""
    e = llm.engine
    return e.kv.get_computed_blocks(tokens, (e.cache_identity, "")).num_computed_tokens


# ------------------------------------------------------------------------------------------ KV events
def test_story_the_events_of_a_gemma_engine_name_each_group(
    gemma: Path, prompts: list[list[int]], redis_server: RedisServer
) -> None:
    """Ten prompts through a 40-block pool over a host tier: every stored and removed event, on the
    device and in the host tier, names one group, and all its hashes are that group's keys of the
    sequences run; group 0's events carry no ``group`` field (a dense model's wire format). A consumer
    replaying the stream rebuilds exactly the engine's ``/v1/kv/blocks`` snapshot."""
    replica = "gemma-events:1"
    llm = make(
        gemma,
        kv_device_blocks=40,
        kv_host_gb=48 * BLOCK_BYTES / 2**30,
        kv_events_url=redis_server.url,
        kv_replica_id=replica,
    )
    sequences = [p + generate(llm, p) for p in prompts]
    expected = keys_of(llm, sequences)
    held, _ = llm.engine.kv_blocks()  # closes the last batch
    assert llm.engine.kv_events is not None and llm.engine.kv_events.publisher is not None
    assert llm.engine.kv_events.publisher.flush(10)
    client = redis.Redis.from_url(redis_server.url)
    seen: dict[tuple[str, str], set[int]] = {}
    for _, fields in client.xrange(stream_key(replica)):
        for event in json.loads(fields[b"events"]):
            if event["type"] == "cleared":
                continue
            group = event.get("group", 0)
            assert ("group" in event) == (group != 0), event
            assert set(event["hashes"]) <= expected[group], f"an event of group {group} names another's key"
            seen.setdefault((event["type"], event["medium"]), set()).add(group)
    assert seen[("stored", "device")] == seen[("removed", "device")] == set(GROUPS)
    assert seen[("stored", "host")] == set(GROUPS)

    index = ReplicaIndex()
    for entry_id, batch in read_batches(client, replica, count=100_000):
        assert index.apply(batch, entry_id)
    snapshot = {h for hashes in held.values() for h in hashes}
    assert set(index.held) == snapshot and len(snapshot) > 0
    assert {g for g in GROUPS for h in snapshot if h.hex() in expected[g]} == set(GROUPS)
    llm.close()


# ------------------------------------------------------------------------------------------ tiers
def test_story_a_disk_block_rewritten_for_another_group_is_a_miss_and_the_answer_exact(
    gemma: Path, prompts: list[list[int]], tmp_path: Path
) -> None:
    """Turn 1 on one engine; closing it flushes every group's blocks to disk, each file's header naming
    its group. Group 1's block 16 is then copied, bytes and header (valid checksums, group 1), over
    group 2's block 16. The restarted engine reads that file for group 2: refused (a counted miss, the
    file removed), so group 2's window before 17 blocks is incomplete and the hit is shorter than the
    68 tokens an intact disk gives (``test_hybrid_engine``; today none at all: the lookup asks the tiers
    for the window at the full groups' end only, ``group_lookup.py``); turn 2 is transformers' answer
    all the same."""
    first_turn = prompts[6]  # 60 tokens
    tiers = dict(kv_device_blocks=64, kv_host_gb=0.001, kv_disk_dir=str(tmp_path / "kv"))
    first = make(gemma, **tiers)
    try:
        answer = generate(first, first_turn)
        disk = first.engine.tiers.tier(Medium.DISK)
        keys = [[group_key(h, g) for h in chain(first, first_turn + answer)[:17]] for g in GROUPS]
    finally:
        first.close()
    for g in GROUPS:  # 71 tokens computed: 17 full blocks of every group on disk, each under its group
        for key in keys[g]:
            head = Path(disk.path_of(key)).read_bytes()[:HEADER_NBYTES]
            assert decode_header(head).group == g
    payload = torch.empty(disk.identity.block_shape)
    read_block_file(disk.path_of(keys[1][16]), keys[1][16], disk.identity, byte_view(payload), group=1)
    os.unlink(disk.path_of(keys[2][16]))
    write_block_file(disk.path_of(keys[2][16]), keys[2][16], disk.identity, byte_view(payload), group=1)

    second_turn = first_turn + answer + prompts[2]  # 60 + 12 + 15 tokens
    restarted = make(gemma, **tiers)
    try:
        out = restarted.generate({"prompt_token_ids": second_turn}, GREEDY)[0]
        again = restarted.engine.tiers.tier(Medium.DISK)
        assert again.counters.load_failures == 1 and not os.path.exists(again.path_of(keys[2][16]))
        assert out.num_cached_tokens < 68, out.num_cached_tokens
        check_idle(restarted)
    finally:
        restarted.close()
    assert out.outputs[0].token_ids == hf_continuation(gemma, second_turn)


# ------------------------------------------------------------------------------------------ the router
def kv_info(llm: LLM) -> dict[str, Any]:
    """The engine's ``GET /v1/kv/info``, over HTTP (the server is stopped before the engine is used
    again on this thread)."""
    server = serve_in_thread(create_app(lambda: llm.engine, ServerSettings(model_name="gemma")))
    try:
        server.wait_ready(60)
        r = httpx.get(server.url + "/v1/kv/info", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()
    finally:
        server.stop()


def test_story_the_router_scores_a_hybrid_prefix_as_the_engine_looks_it_up(
    gemma: Path, prompts: list[list[int]], redis_server: RedisServer
) -> None:
    """One engine, three moments of its event stream: (A) it holds a conversation's blocks in every
    group; (B) group 1's blocks of the last window before the hit are gone; (C) every sliding block is
    gone, only the full group's remain. Indexes rebuilt from the real events, scored with the layout of
    the real ``/v1/kv/info``, give exactly the engine's own hit each time; group 0's keys alone would
    score all three alike. Between A and C, the router sends the next turn to A."""
    replica = "gemma-router:1"
    llm = make(gemma, kv_events_url=redis_server.url, kv_replica_id=replica)
    e = llm.engine
    first_turn = prompts[6]
    turn = first_turn + generate(llm, first_turn) + prompts[2]
    hashes = chain(llm, turn)
    hits, seqs = [], []

    def moment() -> None:
        hits.append(lookup(llm, turn))
        e.kv_blocks()  # closes the batch: the index after it is this moment's
        assert e.kv_events is not None
        seqs.append(e.kv_events.last_seq)

    moment()
    n = hits[0] // BLOCK
    first = max(0, hits[0] - WINDOW + 1) // BLOCK
    assert n == 17 and [e.kv.forget_block(group_key(hashes[i], 1)) for i in range(first, n)] == [True] * 2
    moment()
    for i in range(len(hashes)):
        for g in (1, 2):
            e.kv.forget_block(group_key(hashes[i], g))
    moment()
    assert hits[0] > hits[1] > hits[2] == 0
    info = kv_info(llm)
    assert e.kv_events is not None and e.kv_events.publisher is not None and e.kv_events.publisher.flush(10)
    batches = read_batches(redis.Redis.from_url(redis_server.url), replica, count=100_000)
    llm.close()

    assert [(g["group"], g["kind"], g["window"], g["layers"]) for g in info["kv_groups"]] == [
        (0, "full", None, [2, 5]),
        (1, "sliding", WINDOW, [0, 3]),
        (2, "sliding", WINDOW, [1, 4]),
    ]
    layout = layout_of(info)
    assert layout is not None and layout == e.kv.layout
    chains = Prompt(turn, None).all_block_hashes(info["cache_identity"], info["block_size"])
    assert chains == [hashes]
    replicas = []
    for seq in seqs:
        index = ReplicaIndex()
        for entry_id, batch in batches:
            if batch.seq <= seq:
                index.apply(batch, entry_id)
        replicas.append(Replica(f"http://r{seq}", index, healthy=True, info=info, synced=True))
    indexes = [r.index for r in replicas]
    scores = [_blocks(r, indexes, chains, Prompt(turn, None)) for r in replicas]
    assert [(local * BLOCK, remote) for local, remote in scores] == [(hit, 0) for hit in hits]
    assert len({prompt_blocks(r.index, indexes, chains) for r in replicas}) == 1  # group 0 cannot tell

    a = policy.Candidate(replicas[0].url, 0, scores[0][0] * BLOCK)  # full and sliding blocks
    c = policy.Candidate(replicas[2].url, 0, scores[2][0] * BLOCK)  # full blocks only
    decision = policy.decide("cache_aware", [c, a], len(turn), policy.CostModel(), turn=0)
    assert decision.choice == 1 and decision.reason == "cache_hit" and decision.cached_tokens == hits[0]


def test_batches_of_the_stream_are_parsed_with_their_groups() -> None:
    fields = {
        "v": "1",
        "replica": "r",
        "instance": "i",
        "seq": "1",
        "ts": "1.0",
        "events": '[{"type":"stored","medium":"disk","hashes":["' + "ab" * 32 + '"],"group":3}]',
    }
    (event,) = EventBatch.from_fields(fields).events
    assert event.group == 3 and event.medium == Medium.DISK


# ------------------------------------------------------------------------------------------ the canary
def test_story_the_canary_samples_sliding_blocks_and_catches_a_bad_one(
    gemma: Path, prompts: list[list[int]]
) -> None:
    """A 60-token prompt hits 56 tokens: group 0's blocks 0..13 and each sliding group's window blocks
    12, 13, all sampled (up to four per group), each compared with its own layers' recomputed rows.
    Honest, they match in every group; then layer 0's slot of group 1's block 13 is shifted on the
    device: the next hit's check catches that block, of group 1, and the device is quarantined (the
    answer is exact again)."""
    prompt = prompts[6]
    llm = make(gemma, canary_rate=1.0)
    e = llm.engine
    reference = generate(llm, prompt)
    assert generate(llm, prompt) == reference  # a 56-token hit
    while e.run_idle_work():
        pass
    report = e.kv_canary()
    assert report["checks"]["mismatch"] == 0
    assert {g: c["match"] for g, c in report["by_group"].items()} == {"0": 4, "1": 2, "2": 2}

    key = group_key(chain(llm, prompt)[13], 1)
    block = e.kv.pool.get_cached_block(key, prompt[52:56])
    assert block is not None
    e.runner.kv_cache[block.block_id, 0] += 1.0  # group 1's slot 0: layer 0
    generate(llm, prompt)
    while e.run_idle_work():
        pass
    report = e.kv_canary()
    assert report["by_group"]["1"]["mismatch"] == 1 and report["checks"]["mismatch"] == 1
    last = report["last_mismatch"]
    assert last["tier"] == "device" and last["block_keys"] == [key.hex()] and last["groups"] == [1]
    assert report["quarantined"] == ["device"]
    assert generate(llm, prompt) == reference  # no prefix reuse while quarantined
    check_idle(llm)
