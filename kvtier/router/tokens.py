"""Token ids of a rendered chat, exactly as the tokenizer gives them, without tokenizing what it saw.

A returning conversation is the previous one plus a few messages, and tokenizing its whole rendered
text again on every turn is most of the router's decision time (a 1k-token chat: ~5 ms here). A fast
tokenizer splits its input at the added tokens (``<|im_start|>``, ``<|im_end|>``, ...) *before* it
normalizes, pre-tokenizes and runs the model on each piece between them, so::

    ids(text) == ids(piece_0) + [added_0] + ids(piece_1) + [added_1] + ...

when nothing reaches across those cuts: no normalizer, pre-tokenizers that work on each piece alone
(ByteLevel, Digits, Split, ...; not Metaspace, whose ``prepend_scheme: first`` treats the first piece
differently), and added tokens that strip nothing around them and match anywhere (no ``lstrip``,
``rstrip``, ``single_word``, ``normalized``). :class:`PieceEncoder` checks that once, from the
tokenizer's own JSON; a tokenizer that does not qualify is encoded whole, as before.

The pieces (a chat's message bodies, with their role headers) are kept in a bounded LRU cache of
token ids, so a turn tokenizes only its new messages. Tests pin ``encode == Tokenizer.encode``.
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

from kvtier.tokenizer import Tokenizer

# Pre-tokenizers that split each piece on its own, whatever came before it in the text.
_PIECEWISE_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Digits", "Split", "Whitespace", "WhitespaceSplit", "Punctuation", "BertPreTokenizer"}
)
DEFAULT_MAX_CACHED_TOKENS = 2_000_000  # ~8 MB of ids


def _piecewise(tokenizer_json: dict[str, Any]) -> bool:
    """Whether encoding the pieces between added tokens one by one equals encoding the whole text."""
    if tokenizer_json.get("normalizer") is not None:
        return False
    pre = tokenizer_json.get("pre_tokenizer")
    if pre is not None:
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        if not all(p.get("type") in _PIECEWISE_PRE_TOKENIZERS for p in parts):
            return False
    for added in tokenizer_json.get("added_tokens", []):
        if any(added.get(flag) for flag in ("lstrip", "rstrip", "single_word", "normalized")):
            return False
    return True


class PieceEncoder:
    """``encode(text)``: ``tokenizer.encode(text, add_special_tokens=False)``, from cached pieces."""

    def __init__(self, tokenizer: Tokenizer, max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS) -> None:
        self.tokenizer = tokenizer
        self.max_cached_tokens = max_cached_tokens
        spec = json.loads(tokenizer.backend.to_str())
        added = {t["content"]: int(t["id"]) for t in spec.get("added_tokens", []) if t.get("content")}
        self.enabled = bool(added) and _piecewise(spec)
        self._added = added
        # longest first: at one position the longest added token wins, as in the tokenizer's own split
        alternatives = sorted(added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if added else None
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._cached_tokens = 0
        self._lock = threading.Lock()  # the router tokenizes on a small thread pool
        self.hits = self.misses = 0

    def encode(self, text: str) -> list[int]:
        if not self.enabled or self._split is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        parts = self._split.split(text)  # [piece, added, piece, added, ..., piece]
        pieces = {p for p in parts[0::2] if p}
        known = self._lookup(pieces)
        missing = [p for p in pieces if p not in known]
        if missing:
            batch = self.tokenizer.backend.encode_batch(missing, add_special_tokens=False)
            fresh = {p: array("l", e.ids) for p, e in zip(missing, batch, strict=True)}
            known.update(fresh)
            self._remember(fresh)
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self._added[part])
            elif part:
                ids.extend(known[part])
        return ids

    def _lookup(self, pieces: set[str]) -> dict[str, array]:
        with self._lock:
            found = {p: ids for p in pieces if (ids := self._cache.get(p)) is not None}
            for p in found:
                self._cache.move_to_end(p)
            self.hits += len(found)
            self.misses += len(pieces) - len(found)
        return found

    def _remember(self, fresh: dict[str, array]) -> None:
        with self._lock:
            for piece, ids in fresh.items():
                if len(ids) > self.max_cached_tokens // 4 or piece in self._cache:
                    continue
                self._cache[piece] = ids
                self._cached_tokens += len(ids)
            while self._cached_tokens > self.max_cached_tokens and self._cache:
                _, old = self._cache.popitem(last=False)
                self._cached_tokens -= len(old)

    @property
    def cached_tokens(self) -> int:
        return self._cached_tokens
