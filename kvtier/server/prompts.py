"""Turning a request's input into token ids, off the event loop, refusing what can never fit cheaply first.

::

    on the event loop (microseconds)             on the tokenizer pool (a few threads)
    ────────────────────────────────             ─────────────────────────────────────
    loaded_tokenizer(): 503 while loading
    check_text_length(): characters /            render_chat(): the chat template, contents as text
      max_token_chars >= max_model_len: 400      encode_prompts(): each text prompt
    check_chat_length(): the same, plus one      check_context(): prompt + max_tokens <= max_model_len
      token per message, 400
    check_context(): token-id prompts, 400

A token stands for at most ``Tokenizer.max_token_chars`` characters, so a text of ``c`` characters has at
least ``c / max_token_chars`` tokens: a megabyte prompt for a 4k-token model is refused without
tokenizing it. A chat message costs at least one token whatever its content (the template marks each
turn), so a conversation of more messages than ``max_model_len`` is refused before it is rendered, however
empty its messages (:mod:`.bodies` has already refused more than 2048 of them). Tokenizing and rendering
run on a bounded pool, so a big (but allowed) prompt delays only its own request, never ``/health`` or the
other requests' streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvtier.chat_format import ChatFormatError, ChatTemplateArgs
from kvtier.config import ConfigError
from kvtier.prompt_input import PromptType
from kvtier.server.async_engine import AsyncEngine, EngineNotReady
from kvtier.server.protocol import APIError, bad_request
from kvtier.tokenizer import Tokenizer
from kvtier.tools import Tool, ToolError

T = TypeVar("T")
TOKENIZER_THREADS = 2


def tokenizer_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=TOKENIZER_THREADS, thread_name_prefix="kvtier-tokenize")


async def off_loop(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the tokenizer pool."""
    return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


def loaded_tokenizer(engine: AsyncEngine) -> tuple[Tokenizer, int]:
    """The served model's tokenizer and ``max_model_len``; EngineNotReady (503) while the model loads."""
    if not engine.ready or engine.tokenizer is None or engine.max_model_len is None:
        raise EngineNotReady(engine.not_ready_reason())
    return engine.tokenizer, engine.max_model_len


def context_error(num_prompt: int, max_tokens: int | None, max_model_len: int, param: str) -> APIError:
    """OpenAI's and vLLM's 400 for a prompt (plus its completion) longer than the context."""
    if max_tokens is None:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your {param} has "
            f"{num_prompt} tokens, which leaves no room for the completion."
        )
        return APIError(400, message, param=param, code="context_length_exceeded")
    message = (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{num_prompt + max_tokens} tokens ({num_prompt} in the {param}, {max_tokens} in the "
        "completion). Please reduce the length of the prompt or max_tokens."
    )
    return APIError(400, message, param="max_tokens", code="context_length_exceeded")


def check_context(num_prompt: int, max_tokens: int | None, max_model_len: int, param: str) -> None:
    if num_prompt >= max_model_len:
        raise context_error(num_prompt, None, max_model_len, param)
    if max_tokens is not None and num_prompt + max_tokens > max_model_len:
        raise context_error(num_prompt, max_tokens, max_model_len, param)


def check_text_length(tokenizer: Tokenizer, num_chars: int, max_model_len: int, param: str) -> None:
    """The cheap early check: 400 if ``num_chars`` characters are surely too many tokens."""
    at_least = num_chars // tokenizer.max_token_chars
    if at_least >= max_model_len:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your {param} has "
            f"{num_chars} characters, which is at least {at_least} tokens."
        )
        raise APIError(400, message, param=param, code="context_length_exceeded")


def check_chat_length(tokenizer: Tokenizer, num_messages: int, num_chars: int, max_model_len: int) -> None:
    """The cheap early check of a conversation: 400 (naming ``messages``) if its characters and its
    messages (one token each at least) are surely too many tokens."""
    at_least = num_chars // tokenizer.max_token_chars + num_messages
    if at_least >= max_model_len:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your messages have "
            f"{num_chars} characters in {num_messages} messages, which is at least {at_least} tokens."
        )
        raise APIError(400, message, param="messages", code="context_length_exceeded")


def truncated(
    token_ids: list[int], truncate: int | None, max_tokens: int | None, max_model_len: int
) -> list[int] | None:
    """vLLM's ``truncate_prompt_tokens``: the last ``truncate`` tokens (-1: as many as leave room for
    ``max_tokens``, or one token, in the context); None when nothing is cut."""
    if truncate is None:
        return None
    keep = truncate if truncate > 0 else max_model_len - (max_tokens if max_tokens is not None else 1)
    return token_ids[-keep:] if 0 < keep < len(token_ids) else None


def render_chat(
    tokenizer: Tokenizer,
    conversation: list[dict[str, Any]],
    max_tokens: int | None,
    max_model_len: int,
    tools: list[Tool] | None = None,
    template: ChatTemplateArgs | None = None,
    truncate: int | None = None,
) -> dict[str, Any]:
    """The conversation as a prompt (on the pool): the template rendered (with ``tools``: their format,
    :mod:`kvtier.tools`; ``template``: a continued last message, more variables), contents tokenized as
    text; ``truncate``: its last tokens only (:func:`truncated`)."""
    try:
        text, token_ids = tokenizer.encode_chat(conversation, tools=tools, **(template or {}))
    except (ToolError, ChatFormatError) as exc:
        raise bad_request(exc, exc.param) from None
    except ConfigError as exc:
        raise bad_request(exc, "messages") from None
    cut = truncated(token_ids, truncate, max_tokens, max_model_len)
    check_context(len(cut if cut is not None else token_ids), max_tokens, max_model_len, "messages")
    return {"prompt_token_ids": cut} if cut is not None else {"prompt": text, "prompt_token_ids": token_ids}


def encode_prompts(
    tokenizer: Tokenizer,
    given: list[str | list[int]],
    max_tokens: int | None,
    max_model_len: int,
    truncate: int | None = None,
) -> list[PromptType]:
    """Text prompts tokenized (on the pool), each cut to its last tokens with ``truncate``
    (:func:`truncated`); every prompt checked against the context."""
    prompts: list[PromptType] = []
    for p in given:
        token_ids = tokenizer.encode(p) if isinstance(p, str) else p
        cut = truncated(token_ids, truncate, max_tokens, max_model_len)
        if cut is not None:
            prompts.append({"prompt_token_ids": cut})
        elif isinstance(p, str):
            prompts.append({"prompt": p, "prompt_token_ids": token_ids})
        else:
            prompts.append(p)
        check_context(len(cut if cut is not None else token_ids), max_tokens, max_model_len, "prompt")
    return prompts
