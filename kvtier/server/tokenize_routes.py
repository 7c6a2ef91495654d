"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's): the served model's own tokenizer, no forward pass.

::

    POST /tokenize    {"model"?, "prompt": "text"}
                      {"model"?, "messages": [...], "tools"?: [...], "add_generation_prompt"?,
                       "continue_final_message"?, "chat_template_kwargs"?}
                      -> {"count": 5, "max_model_len": 8192, "tokens": [id, ...]}
    POST /detokenize  {"model"?, "tokens": [id, ...]} -> {"prompt": "text"}

A ``prompt`` is tokenized as ``/v1/completions`` tokenizes it, ``messages`` (with their ``tools``)
rendered and tokenized as ``/v1/chat/completions`` does, so ``count`` is the ``usage.prompt_tokens``
such a request reports.
Both need the API key when the server has one (like ``/v1``); their bodies are parsed and counted as the
completion routes' are (:mod:`.bodies`: at most 2048 messages); their request models and errors are the
wire contract's (:mod:`.protocol`: 400 for a body that has neither or both inputs, a token id the
tokenizer does not know, or more ids than the model's context; 404 for another model's name; 503 while
the model loads).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from kvtier.chat_format import ChatFormatError
from kvtier.config import ConfigError
from kvtier.server import bodies, prompts
from kvtier.server.auth import check_key
from kvtier.server.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    check_model,
    conversation_of,
)
from kvtier.tokenizer import Tokenizer


def _tokenizer(request: Request, model: str | None) -> tuple[Tokenizer, int]:
    """The served model's tokenizer and ``max_model_len``: 404 for another model, 503 while loading."""
    check_model(request.app.state.settings.model_name, model)
    return prompts.loaded_tokenizer(request.app.state.engine)


def _tokenize(tokenizer: Tokenizer, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send either prompt or messages", "prompt")
    if body.prompt is not None:
        return tokenizer.encode(body.prompt)
    assert body.messages is not None
    chat, tools = conversation_of(body.messages), body.tool_list()
    try:
        return tokenizer.encode_chat(chat, tools=tools, **body.template_args())[1]
    except ChatFormatError as exc:
        raise bad_request(exc, exc.param) from None
    except ConfigError as exc:
        raise bad_request(exc, "messages") from None


def _detokenize(tokenizer: Tokenizer, tokens: list[int]) -> str:
    unknown = [t for t in tokens if not 0 <= t < tokenizer.vocab_size]
    if unknown:
        raise bad_request(f"tokens holds ids the tokenizer does not know: {unknown[:5]}", "tokens")
    return tokenizer.decode(tokens)


def tokenize_router() -> APIRouter:
    """``/tokenize`` and ``/detokenize``, behind the client key (as ``/v1``)."""
    router = APIRouter(dependencies=[Depends(check_key)])

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await bodies.parse(request, TokenizeRequest)  # messages counted before validation
        tokenizer, max_model_len = _tokenizer(request, body.model)
        tokens = await prompts.off_loop(request.app.state.pool, _tokenize, tokenizer, body)
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await bodies.parse(request, DetokenizeRequest)
        tokenizer, max_model_len = _tokenizer(request, body.model)
        if len(body.tokens) > max_model_len:  # a body's worth of ids would hold a pool thread seconds
            raise bad_request(
                f"tokens holds at most {max_model_len} ids (the model's context), got {len(body.tokens)}",
                "tokens",
            )
        text = await prompts.off_loop(request.app.state.pool, _detokenize, tokenizer, body.tokens)
        return {"prompt": text}

    return router
