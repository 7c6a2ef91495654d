"""The stored side of ``kvtier serve``'s Responses API: ``previous_response_id``, keeping an answer,
and the stored-response routes.

::

    previous(...)            the response a request continues (404 previous_response_not_found: none,
                             expired, deleted, or another key's; 400 when this server keeps none)
    resolve_references(...)  ``item_reference`` input items replaced by the stored items they name: the
                             continued response's, or those of the stored response an item id names
                             (400 naming ``input[i].id`` for one found nowhere)
    Keeper.keep(response)    stores an answer (store: true) with the input it ran on, before the client
                             sees it whole; false when the store failed (the answer says store: false)
    GET    /v1/responses/{id}                 the response object
    DELETE /v1/responses/{id}                 {"id", "object": "response", "deleted": true}
    POST   /v1/responses/{id}/cancel          a background response stopped (responses_background)
    GET    /v1/responses/{id}/input_items     {"object": "list", "data": [items], "first_id", "last_id",
                                               "has_more"}; ``order`` (desc, the default | asc), ``limit``
                                               (1-100, 20), ``after`` (an item id)

The store (:mod:`.response_store`) is ``app.state.responses``: None when the server keeps none
(``--response-store off``). Its calls run on the server's thread pool (Redis blocks).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvtier.server import prompts
from kvtier.server import responses_background as background
from kvtier.server.api_errors import APIError, bad_request, clip
from kvtier.server.error_handlers import unavailable
from kvtier.server.response_store import (
    ResponseStore,
    StoredResponse,
    StoreUnavailable,
    new_item_id,
    owner_of,
    response_of_item,
)
from kvtier.server.responses_api import ResponsesRequest

logger = logging.getLogger("kvtier.server.responses")
_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _not_found(response_id: str, param: str | None = None) -> APIError:
    code = "previous_response_not_found" if param else "not_found"
    message = f"{'Previous response' if param else 'Response'} with id '{clip(response_id)}' not found."
    return APIError(404, message, param=param, code=code)


def _store(request: Request) -> ResponseStore | None:
    return request.app.state.responses


def keeps(request: Request) -> bool:
    """Whether this server keeps responses (``--response-store`` is not off)."""
    return _store(request) is not None


async def _get(request: Request, response_id: str, param: str | None = None) -> StoredResponse:
    """The stored response ``response_id`` of this request's credentials (404 otherwise)."""
    store = _store(request)
    if store is None:
        raise _not_found(response_id, param)
    try:
        stored = await prompts.off_loop(request.app.state.pool, store.get, response_id)
    except StoreUnavailable as exc:
        raise unavailable(str(exc), "store_unavailable") from None
    if stored is None or stored.owner != owner_of(request.headers.get("authorization", "")):
        raise _not_found(response_id, param)
    return stored


async def previous(request: Request, body: ResponsesRequest) -> StoredResponse | None:
    """The response ``body`` continues (None: it continues none)."""
    if body.previous_response_id is None:
        return None
    if _store(request) is None:
        raise bad_request(
            "previous_response_id is not supported by this server (it keeps no responses: "
            "--response-store off); send the whole conversation in input",
            "previous_response_id",
        )
    return await _get(request, body.previous_response_id, "previous_response_id")


def with_ids(items: list[Any], response_id: str | None = None) -> list[dict[str, Any]]:
    """Input items as stored: each with an id (``msg_...``, ``fc_...``: its own when it has one; a new one
    names ``response_id``)."""
    out = []
    for item in items:
        kind = item.get("type", "message")
        new = new_item_id(_ITEM_PREFIX.get(kind, "item"), response_id)
        out.append(item if "id" in item else {"id": new, **item})
    return out


async def resolve_references(
    request: Request, body: ResponsesRequest, continued: StoredResponse | None
) -> ResponsesRequest:
    """``body`` with each ``item_reference`` input item replaced by the stored item it names: one of the
    continued response's items, or one of the stored response the id names (a kvtier item id names the
    response that made it: ``new_item_id``), this request's credentials'. A 400 naming ``input[i].id``
    for an id found nowhere."""
    raw = body.input_items()
    if not any(isinstance(item, dict) and item.get("type") == "item_reference" for item in raw):
        return body
    known = {item.get("id"): item for item in continued.conversation()} if continued else {}
    found: dict[str, StoredResponse | None] = {}
    resolved = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or item.get("type") != "item_reference":
            resolved.append(item)
            continue
        item_id = item.get("id")
        if not isinstance(item_id, str) or not item_id:
            raise bad_request(f"input[{i}].id must be a non-empty string (an item's id)", f"input[{i}].id")
        target = known.get(item_id) or await _item_of(request, item_id, found)
        if target is None:
            message = (
                f"input[{i}]: no stored item with id '{clip(item_id)}' (expired, deleted or never stored)"
            )
            raise bad_request(message, f"input[{i}].id")
        resolved.append(dict(target))
    return body.model_copy(update={"input": resolved})


async def _item_of(request: Request, item_id: str, found: dict[str, StoredResponse | None]) -> Any:
    """The item ``item_id`` of the stored response its id names, or None (``found``: those read)."""
    response_id = response_of_item(item_id)
    if response_id is None:
        return None
    if response_id not in found:
        try:
            found[response_id] = await _get(request, response_id)
        except APIError as exc:
            if exc.status != 404:
                raise
            found[response_id] = None
    stored = found[response_id]
    return next((x for x in stored.conversation() if x.get("id") == item_id), None) if stored else None


@dataclass
class Keeper:
    """Stores one request's answer (``store: true`` and a store to keep it in)."""

    request: Request
    input: list[dict[str, Any]]  # the items it ran on: the continued conversation's, then its own

    @property
    def enabled(self) -> bool:
        return keeps(self.request)

    async def keep(self, response_id: str, response: dict[str, Any]) -> bool:
        """Whether ``response`` is stored now (a store that failed is logged: the answer still goes)."""
        store = _store(self.request)
        if store is None:
            return False
        owner = owner_of(self.request.headers.get("authorization", ""))
        stored = StoredResponse(owner, self.input, {**response, "store": True})
        try:
            await prompts.off_loop(self.request.app.state.pool, store.put, response_id, stored)
        except StoreUnavailable as exc:
            logger.warning("response %s not stored: %s", response_id, exc)
            return False
        return True


async def retrieve(request: Request, response_id: str) -> Response:
    """The response as kept; ``stream=true``: a streamed background response's events, followed from
    after ``starting_after`` (400 for one with no events kept here)."""
    response = (await _get(request, response_id)).response
    state = request.app.state
    if request.query_params.get("stream") not in ("true", "1"):
        return JSONResponse(background.as_seen(response, state.background, state.engine.replica_id))
    log = state.background.log(response_id)
    if log is None:
        message = (
            "this response has no events to stream here: only a response created with background and "
            "stream has them, on the replica that made it, for a while (leave stream out to read it)"
        )
        raise bad_request(message, "stream")
    after = request.query_params.get("starting_after", "-1")
    if not after.lstrip("-").isdigit() or int(after) < -1:
        raise bad_request(
            f"starting_after must be an event's sequence number, got {clip(after)!r}", "starting_after"
        )
    return background.followed(log, int(after))


async def cancel(request: Request, response_id: str) -> JSONResponse:
    """``POST /v1/responses/{id}/cancel``: a background response running here stops, stored cancelled;
    one that ended is answered as stored (404: not kept, another key's; 400: not a background one)."""
    stored = await _get(request, response_id)
    background.check_cancellable(stored.response)
    state = request.app.state
    cancelled = await state.background.cancel(response_id)
    if cancelled is not None:
        return JSONResponse(cancelled)
    response = (await _get(request, response_id)).response  # ended meanwhile, or ran elsewhere
    return JSONResponse(background.as_seen(response, state.background, state.engine.replica_id))


async def delete(request: Request, response_id: str) -> JSONResponse:
    await _get(request, response_id)  # none kept, or someone else's: 404, never deleted
    store = _store(request)
    assert store is not None  # _get found it there
    try:
        await prompts.off_loop(request.app.state.pool, store.delete, response_id)
    except StoreUnavailable as exc:
        raise unavailable(str(exc), "store_unavailable") from None
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def input_items(request: Request, response_id: str) -> JSONResponse:
    """The input items a response ran on, newest first unless ``order=asc``, ``limit`` at a time after
    the item ``after``."""
    items = (await _get(request, response_id)).input
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be asc or desc, got {clip(order)!r}", "order")
    limit_text = query.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
        raise bad_request(f"limit must be an integer in [1, 100], got {clip(limit_text)!r}", "limit")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise bad_request(f"after: no input item '{clip(after)}' in this response", "after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[: int(limit_text)]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(ordered) > len(page),
        }
    )
