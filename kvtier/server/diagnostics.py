"""Why a request missed the cache, relative to an earlier one (Anthropic's ``diagnostics``).

A client sends ``diagnostics: {"previous_message_id": "msg_..."}`` on ``/v1/messages`` to ask how this
request's cache use compares with an earlier message's; the answer carries
``diagnostics.cache_miss_reason``, from what kvtier knows::

    type                        when
    none                        the prompt continues the previous one and every whole block of what they
                                share came from the cache
    prompt_changed              the prompts differ at token N (``diverged_at_token``): only the whole
                                blocks before it could be reused, and they were
    retention_expired           blocks of the shared prefix were evicted after the previous message's
                                retention (its cache_control TTL) ran out
    evicted                     blocks of the shared prefix were evicted from every tier (no retention
                                asked for, or still retained but past a tier's cap)
    different_tenant            another API key or user: a tenant's prefixes are never another's hits
    previous_message_unknown    this server did not answer that message, or forgot it (it keeps the last
                                ``MAX_RECORDS``, at most ``MAX_TOKENS`` prompt tokens in all)

with ``cached_tokens`` (what this request read from the cache), ``reusable_tokens`` (the whole blocks it
shares with the previous prompt, at most all but its last token) and a one-line ``message``.
:class:`PromptLog` remembers each answered message's prompt (token ids), tenant salt, time and retention.

The OpenAI routes offer the same as a kvtier extension: ``/v1/chat/completions`` and ``/v1/completions``
take ``diagnostics: {"previous_response_id": "chatcmpl-..." | "cmpl-..." | "msg_..."}`` and answer in
``usage.kvtier.cache_miss_reason`` (a stream sends its usage chunk when diagnostics are asked). Both APIs
record into one :class:`PromptLog` (:func:`prompt_log`), so either may name the other's answers; a
``/v1/completions`` call of several prompts is neither recorded nor explained (400 when asked). Torch-free.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.server.protocol import bad_request

MAX_RECORDS = 2048
MAX_TOKENS = 16 * 2**20  # prompt tokens kept in all


@dataclass(frozen=True)
class PromptRecord:
    token_ids: array  # int32 token ids of the message's prompt
    salt: str | None  # its tenant's prefix-cache salt
    at: float  # wall-clock seconds when it was admitted
    retained_until: float | None  # when the longest retention it asked for ends (None: none)


class PromptLog:
    """The last ``max_records`` answers' prompts by id, at most ``max_tokens`` tokens of them in all (4
    bytes each: 64 MiB by default, whatever the prompts' lengths)."""

    def __init__(self, max_records: int = MAX_RECORDS, max_tokens: int = MAX_TOKENS) -> None:
        self.max_records = max_records
        self.max_tokens = max_tokens
        self._records: OrderedDict[str, PromptRecord] = OrderedDict()
        self._num_tokens = 0

    def record(self, message_id: str, token_ids: list[int], salt: str | None, ttl_s: float | None) -> None:
        now = time.time()
        until = None if ttl_s is None else now + ttl_s
        old = self._records.pop(message_id, None)
        self._num_tokens += len(token_ids) - (0 if old is None else len(old.token_ids))
        self._records[message_id] = PromptRecord(array("i", token_ids), salt, now, until)
        while len(self._records) > self.max_records or self._num_tokens > self.max_tokens:
            _, gone = self._records.popitem(last=False)
            self._num_tokens -= len(gone.token_ids)

    def get(self, message_id: str) -> PromptRecord | None:
        return self._records.get(message_id)


def prompt_log(state: Any) -> PromptLog:
    """The app's record of recent answers' prompts (``app.state.prompt_log``, made at the first one),
    shared by the Messages and the OpenAI routes."""
    if getattr(state, "prompt_log", None) is None:
        state.prompt_log = PromptLog()
    return state.prompt_log


def previous_response_id(diagnostics: Any) -> str | None:
    """The OpenAI routes' ``diagnostics.previous_response_id`` (None: not asked); a 400 naming
    ``diagnostics`` when it is malformed."""
    if diagnostics is None:
        return None
    if (
        not isinstance(diagnostics, dict)
        or set(diagnostics) != {"previous_response_id"}
        or not isinstance(diagnostics["previous_response_id"], str)
    ):
        raise bad_request('diagnostics must be {"previous_response_id": "chatcmpl-..."}', "diagnostics")
    return diagnostics["previous_response_id"]


def token_ids_of(prompt: Any) -> list[int]:
    """A rendered prompt's token ids (a list of ids, or ``{"prompt_token_ids": [...]}``)."""
    return list(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt)


def explain(
    log: PromptLog,
    previous_id: str | None,
    prompts: Sequence[Any],
    salt: str | None,
    block_size: int,
) -> Callable[[Any], dict[str, Any]] | None:
    """An OpenAI call's ``cache_miss_reason`` of its final output against ``previous_id``'s record, as a
    function of that output (None: not asked); a 400 naming ``diagnostics`` for a call of several
    prompts. Looked up now: before this call's own answer is recorded."""
    if previous_id is None:
        return None
    if len(prompts) != 1:
        raise bad_request(f"diagnostics explains one prompt; this request has {len(prompts)}", "diagnostics")
    before, token_ids = log.get(previous_id), token_ids_of(prompts[0])
    return lambda out: miss_reason(before, token_ids, salt, out.num_cached_tokens, block_size)


def record_answer(
    log: PromptLog, response_id: str, prompts: Sequence[Any], salt: str | None, ttl_s: float | None
) -> None:
    """Remember an OpenAI call's prompt under its response id (a call of one prompt only)."""
    if len(prompts) == 1:
        log.record(response_id, token_ids_of(prompts[0]), salt, ttl_s)


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def miss_reason(
    prev: PromptRecord | None, token_ids: list[int], salt: str | None, cached: int, block_size: int
) -> dict[str, Any]:
    """``cache_miss_reason`` of a request whose prompt is ``token_ids`` (read ``cached`` tokens from the
    cache) against the previous message's record (table above)."""
    if prev is None:
        return {"type": "previous_message_unknown", "message": "this server has no record of that message"}
    if prev.salt != salt:
        message = "the previous message was another tenant's (API key or user): its prefixes are not shared"
        return {"type": "different_tenant", "message": message}
    shared = shared_prefix(prev.token_ids, token_ids)
    reusable = min(shared, len(token_ids) - 1) // block_size * block_size
    out: dict[str, Any] = {"cached_tokens": cached, "reusable_tokens": reusable}
    if cached >= reusable:
        if shared < len(prev.token_ids):
            where = f"the prompt differs from the previous message's at token {shared}"
            return {"type": "prompt_changed", "diverged_at_token": shared, **out, "message": where}
        return {"type": "none", **out, "message": "every shared whole block came from the cache"}
    lost = f"{reusable - cached} of the {reusable} shared tokens were evicted"
    if prev.retained_until is not None and time.time() > prev.retained_until:
        ended = time.strftime("%H:%M:%S", time.gmtime(prev.retained_until))
        return {
            "type": "retention_expired",
            **out,
            "message": f"{lost} after its retention ended ({ended} UTC)",
        }
    return {"type": "evicted", **out, "message": f"{lost} from every tier"}
