"""``diagnostics.cache_miss_reason``: why a request missed the cache relative to an earlier message, one
story per reason, from the records the server keeps (kvtier/server/diagnostics.py)."""

from __future__ import annotations

import time

from kvtier.server.diagnostics import PromptLog, miss_reason

BS = 16
PREV = list(range(100, 100 + 200))  # a 200-token prompt: 12 whole blocks


def record(ttl_s: float | None = None, salt: str | None = "alice", tokens: list[int] = PREV) -> PromptLog:
    log = PromptLog(max_records=2)
    log.record("msg_prev", tokens, salt, ttl_s)
    return log


def test_a_continued_conversation_that_hit_every_shared_block_missed_nothing() -> None:
    now = PREV + [7, 8, 9]
    reason = miss_reason(record().get("msg_prev"), now, "alice", cached=192, block_size=BS)
    assert reason["type"] == "none" and reason["reusable_tokens"] == 192 and reason["cached_tokens"] == 192


def test_a_changed_prompt_names_the_token_where_it_diverges() -> None:
    now = PREV[:50] + [1, 2, 3] + PREV[53:]
    reason = miss_reason(record().get("msg_prev"), now, "alice", cached=48, block_size=BS)
    assert reason["type"] == "prompt_changed" and reason["diverged_at_token"] == 50
    assert reason["reusable_tokens"] == 48 and "token 50" in reason["message"]


def test_evicted_blocks_and_an_expired_retention_are_told_apart() -> None:
    now = PREV + [7]
    evicted = miss_reason(record(ttl_s=300).get("msg_prev"), now, "alice", cached=64, block_size=BS)
    assert evicted["type"] == "evicted" and "128 of the 192" in evicted["message"]
    log = record(ttl_s=300)
    past = log.get("msg_prev")
    assert past is not None
    object.__setattr__(past, "retained_until", time.time() - 1)  # its 5 minutes are over
    assert miss_reason(past, now, "alice", cached=0, block_size=BS)["type"] == "retention_expired"


def test_another_tenant_and_a_forgotten_message() -> None:
    assert miss_reason(record().get("msg_prev"), PREV, "bob", 0, BS)["type"] == "different_tenant"
    log = record()
    log.record("msg_a", [1], None, None)
    log.record("msg_b", [2], None, None)  # the log keeps two: msg_prev is forgotten
    assert log.get("msg_prev") is None
    assert miss_reason(None, PREV, "alice", 0, BS)["type"] == "previous_message_unknown"


def test_the_log_keeps_at_most_its_token_budget() -> None:
    """Long prompts: the oldest records go once the prompts kept pass ``max_tokens`` (their memory is
    bounded whatever the prompts' lengths); a re-recorded id is counted once."""
    log = PromptLog(max_records=100, max_tokens=500)
    for i in range(4):
        log.record(f"msg_{i}", PREV, None, None)  # 200 tokens each
    assert [log.get(f"msg_{i}") is not None for i in range(4)] == [False, False, True, True]
    log.record("msg_3", PREV[:10], None, None)
    log.record("msg_4", PREV, None, None)  # 200 + 10 + 200: msg_2 stays
    assert all(log.get(f"msg_{i}") is not None for i in (2, 3, 4))
