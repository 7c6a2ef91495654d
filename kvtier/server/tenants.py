"""How a key is presented and a tenant's prefix-cache salt: one home for what ``kvtier serve`` and
``kvtier router`` both derive (:mod:`kvtier.server.protocol` re-exports these, its callers' import path).

A key is sent as ``Authorization: Bearer <key>`` and compared in constant time (:func:`presents`). With
``--prefix-cache-scope user`` a request's ``cache_salt`` is derived from its tenant (:func:`tenant_salt`:
the key it presented, its ``user`` field and its own salt), so one tenant's prompts are never a
prefix-cache hit for another. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import secrets


def bearer(authorization: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header's value, or None."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def presents(authorization: str, *keys: str | None) -> bool:
    """Whether the ``Authorization`` header carries one of ``keys`` (the Nones skipped); every key is
    compared, each in constant time."""
    token = bearer(authorization)
    if token is None:
        return False
    given = token.encode()
    matches = [secrets.compare_digest(given, key.encode()) for key in keys if key is not None]
    return any(matches)


def tenant_salt(authorization: str, user: str | None, cache_salt: str | None, scope: str) -> str | None:
    """A request's prefix-cache salt: its own ``cache_salt``; with ``scope`` ``"user"``
    (``--prefix-cache-scope user``) one derived from its tenant (the ``Authorization`` header's key and the
    ``user`` field; neither: the anonymous tenant) and its own salt."""
    if scope != "user":
        return cache_salt
    _, _, key = authorization.partition(" ")
    parts = (key.strip(), user or "", cache_salt or "")
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def tenant_of(authorization: str, user: str | None) -> str:
    """A request's fair-share key: the ``Authorization`` header's key and the ``user`` field, hashed
    (neither: "")."""
    _, _, key = authorization.partition(" ")
    if not key.strip() and not user:
        return ""
    return hashlib.sha256(json.dumps((key.strip(), user or "")).encode()).hexdigest()[:16]
