"""A request's block hashes, computed by the router exactly as the replica's engine computes them.

::

    body ──► the replica's own request models (kvtier.server.protocol; Anthropic's /v1/messages:
             kvtier.server.anthropic, mapped onto the same conversation and tools): conversation /
             prompts, salt
         ──► token ids: chat template + tokenizer (``Tokenizer.encode_chat``), or ``encode``, or the ids
         ──► root_hash((cache_identity, cache_salt or "")) ──► hash_full_blocks(ids, block_size)

The tokenizer is the model's own, found the way the replica finds it: ``--model`` (default: the
embedded SmolLM2, like ``kvtier serve``), an HF directory read directly, a GGUF through the shared
conversion cache (``$KVTIER_CACHE_DIR``; converted with numpy when missing, as the replica does). The
model fingerprint the router computes is compared with every replica's ``GET /v1/kv/info``: a replica
serving another model is routed by load only. ``cache_identity``, ``block_size`` and the hash spec
version come from each replica's ``/v1/kv/info`` (``docs/block-hashes.md``).

With ``--prefix-cache-scope user`` (set it like the replicas) the salt is derived from the tenant by the
replicas' own derivation (``kvtier.server.protocol.tenant_salt``).

Nothing here imports torch: the router starts in well under a second and loads the tokenizer on a
thread meanwhile (requests arriving before it is loaded are routed by load, reason ``fallback``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvtier.config import ConfigError
from kvtier.kv.hashing import BlockHash, hash_full_blocks, root_hash
from kvtier.router.tokens import PieceEncoder
from kvtier.server.anthropic import MessagesRequest
from kvtier.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, tenant_salt
from kvtier.server.responses_api import ResponsesRequest
from kvtier.tokenizer import Tokenizer

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MESSAGES_PATH = "/v1/messages"  # Anthropic's Messages API
RESPONSES_PATH = "/v1/responses"  # OpenAI's Responses API (run as a chat completion)


def load_tokenizer(model: str | None) -> tuple[Tokenizer, str]:
    """``(tokenizer, model fingerprint)`` of ``model`` (None: the embedded default), without torch."""
    from kvtier.models.loader import converted_dir, fingerprint_hf_dir, resolve_model_path

    path = resolve_model_path(model)
    if path.is_dir() and (path / "config.json").is_file():
        return Tokenizer.from_dir(path), fingerprint_hf_dir(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ConfigError(f"{path} holds {len(ggufs)} GGUF files; name the one the replicas serve")
        path = ggufs[0]
    target, fingerprint = converted_dir(Path(path))
    return Tokenizer.from_dir(target), fingerprint


@dataclass(frozen=True)
class Prompt:
    """What the router needs of a request: its token ids and its salt. A completion may batch several
    prompts: ``token_ids`` is the first, ``more`` the rest (the replica runs them all, so all count)."""

    token_ids: list[int]
    cache_salt: str | None
    more: tuple[list[int], ...] = ()
    # the replica computes it whole, taking no cache hit (prompt logprobs: ``echo`` with ``logprobs``)
    uncached: bool = False

    @property
    def num_tokens(self) -> int:
        """Prompt tokens the replica will have to hold, every prompt of the request together."""
        return len(self.token_ids) + sum(len(ids) for ids in self.more)

    def block_hashes(self, cache_identity: str, block_size: int) -> list[BlockHash]:
        """The first prompt's full-block hashes."""
        return self.all_block_hashes(cache_identity, block_size)[0]

    def all_block_hashes(self, cache_identity: str, block_size: int) -> list[list[BlockHash]]:
        """Every prompt's full-block hashes, in the request's order."""
        root = root_hash((cache_identity, self.cache_salt or ""))
        return [hash_full_blocks(ids, block_size, root) for ids in (self.token_ids, *self.more)]


def parse_prompt(
    tokenizer: Tokenizer,
    path: str,
    body: Any,
    authorization: str = "",
    scope: str = "shared",
    encoder: PieceEncoder | None = None,
) -> Prompt | None:
    """The request's prompts as token ids, or None when the body is not one the replica would
    run (the replica then answers its own 400; the router routes such a request by load). ``encoder``
    tokenizes a rendered chat from cached pieces (:mod:`kvtier.router.tokens`), with the same ids."""
    encode = encoder.encode if encoder is not None else None
    if path == RESPONSES_PATH and isinstance(body, dict) and body.get("previous_response_id") is not None:
        return None  # the conversation before it is stored on a replica: routed to that one, by load
    try:
        if path in (CHAT_PATH, RESPONSES_PATH):
            chat = (
                ChatCompletionRequest.model_validate(body)
                if path == CHAT_PATH
                else ResponsesRequest.model_validate(body).chat()
            )
            conversation, tools = chat.conversation(), chat.tool_request()[0]
            _, token_ids = tokenizer.encode_chat(
                conversation, encode=encode, tools=tools, **chat.template_args()
            )
            token_ids = _truncated(token_ids, chat)
            request: Any = chat
        elif path == MESSAGES_PATH:
            message = MessagesRequest.model_validate(body)
            mapped = message.chat()
            _, token_ids = tokenizer.encode_chat(
                mapped.conversation, encode=encode, tools=mapped.tools, **mapped.template_args()
            )
            return Prompt(token_ids, tenant_salt(authorization, message.user_id, None, scope))
        elif path == COMPLETIONS_PATH:
            request = CompletionRequest.model_validate(body)
            given = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in request.prompts()]
            first, *rest = [_truncated(ids, request) for ids in given]
            salt = tenant_salt(authorization, request.user, request.cache_salt, scope)
            uncached = request.echo and request.logprobs is not None
            return Prompt(first, salt, tuple(rest), uncached)
        else:
            return None
    except (ValidationError, APIError, ConfigError, ValueError, TypeError):
        return None
    return Prompt(token_ids, tenant_salt(authorization, request.user, request.cache_salt, scope))


def _truncated(token_ids: list[int], request: Any) -> list[int]:
    """The prompt the replica runs under ``truncate_prompt_tokens`` k > 0: its last k tokens (-1 depends
    on the replica's context: ValueError, so the request is routed by load)."""
    k = request.truncate_prompt_tokens
    if k is None:
        return token_ids
    if k < 1:
        raise ValueError("truncate_prompt_tokens -1: the replica's context decides the cut")
    return token_ids[-k:]
