"""The OpenAI wire format: request models, their ``SamplingParams``, and errors in OpenAI's JSON shape.

Request models are strict (a string is not a number, ``true`` is not an integer) and accept unknown
fields (clients send fields kvtier ignores, such as ``logit_bias`` set to its default). Ranges are checked
by :meth:`SamplingParams.validate`, so the server and the Python API reject the same values.

Every error body is ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from kvtier.config import ConfigError
from kvtier.sampling_params import SamplingParams


# ------------------------------------------------------------------------------------------ errors
class APIError(Exception):
    """An error answered as ``status`` with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_PARAM_NAMES = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop"}
_PARAM_NAMES |= {"stop_token_ids", "logprobs"}


def bad_request(exc: ConfigError | str, param: str | None = None) -> APIError:
    """A 400 for invalid input; ``param`` is guessed from a ``"name must ..."`` message when not given."""
    message = " ".join(str(exc).split())
    if param is None:
        first = message.split(" ", 1)[0]
        param = first if first in _PARAM_NAMES else None
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """FastAPI's 422 (a pydantic error list) as OpenAI's 400."""
    if not errors:
        return APIError(400, "invalid request")
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # Union members show up in the location ("prompt.str"); keep the request's own field path.
    path = ".".join(
        x for x in loc if not re.fullmatch(r"[a-z]+\[.*\]|str|int|float|bool|list|function-.*", x)
    )
    message = err.get("msg", "invalid value")
    if err.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {message}", code="invalid_json")
    text = f"{path}: {message}" if path else message
    return APIError(400, text, param=loc[0] if loc else None, code="invalid_type")


# ---------------------------------------------------------------------------------------- requests
class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"only text content parts are supported, got type {part.type!r}", "messages"
                )
        return "".join(part.text or "" for part in self.content)


class GenerationRequest(_Request):
    """Fields shared by chat and text completions (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # kvtier / vLLM extensions
    cache_salt: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported (only 0)", name)
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        kwargs: dict[str, Any] = dict(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )
        try:
            return SamplingParams(**kwargs)
        except ConfigError as exc:
            raise bad_request(exc) from None


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        param = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"{param} must be at least 1, got {max_tokens}", param)
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise bad_request(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", "top_logprobs")
        return self._params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(GenerationRequest):
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def sampling_params(self) -> SamplingParams:
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of not in (None, self.n):
            raise bad_request("best_of is not supported (only equal to n)", "best_of")
        return self._params(self.max_tokens, self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            items: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [list(p)]  # type: ignore[arg-type]
        else:
            items = list(p)  # type: ignore[arg-type]
        if not items:
            raise bad_request("prompt must not be empty", "prompt")
        return items
