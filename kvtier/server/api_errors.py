"""Errors in OpenAI's JSON shape, for ``kvtier serve`` and ``kvtier router`` (pydantic- and FastAPI-free):
every error body is ``{"error": {"message", "type", "param", "code"}}``; a message quotes at most
``MAX_ECHO`` characters of what the client sent (:func:`clip`) and is at most ``MAX_MESSAGE`` long.
:mod:`.protocol` re-exports every name, so importers keep one place for the wire contract.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse  # FastAPI's own; starlette keeps the router's import light

from kvtier.config import ConfigError

MAX_ECHO = 64  # characters of a client's value quoted back in an error message
MAX_MESSAGE = 2000  # characters of an error message


def clip(value: object, limit: int = MAX_ECHO) -> str:
    """``repr``-free text of a client's value for an error message: at most ``limit`` characters."""
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


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
        message = clip(message, MAX_MESSAGE).encode("utf-8", "replace").decode("utf-8")
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


def http_error(exc: HTTPException) -> APIError:
    """Starlette's own 404 (no such route) or 405 (another method) in OpenAI's shape."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers)


def not_found() -> APIError:
    """The 404 of a route that does not exist (an ``/admin`` route while the admin role is off)."""
    return APIError(404, "Not Found", code="not_found")


def unauthorized(what: str) -> APIError:
    """The 401 for a missing or wrong key; ``what`` names the key the route takes."""
    return APIError(
        401,
        f"Incorrect or missing {what} (send 'Authorization: Bearer <key>').",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def invalid_json(reason: str) -> APIError:
    """The 400 for a body that is not JSON (``reason``: why)."""
    return APIError(400, f"the request body is not valid JSON: {reason}", code="invalid_json")


def check_model(served: str, model: str | None) -> None:
    """404 when the request names another model than the ``served`` one (None: any)."""
    if model is not None and model != served:
        raise APIError(
            404, f"The model `{clip(model)}` does not exist.", param="model", code="model_not_found"
        )


_PARAM_NAMES = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop"}
_PARAM_NAMES |= {"stop_token_ids", "logprobs", "logit_bias", "presence_penalty", "frequency_penalty"}
_PARAM_NAMES |= {"repetition_penalty", "prompt_logprobs", "top_logprobs", "priority", "allowed_token_ids"}
_PARAM_NAMES |= {"bad_words", "thinking_token_budget"}


def bad_request(exc: ConfigError | str, param: str | None = None) -> APIError:
    """A 400 for invalid input; ``param`` is guessed from a ``"name must ..."`` message when not given."""
    message = " ".join(str(exc).split())
    if param is None:
        first = message.split(" ", 1)[0].rstrip(":")
        param = first if first in _PARAM_NAMES else None
    return APIError(400, message, param=param, code="invalid_value" if param else None)


_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """FastAPI's 422 (a pydantic error list) as OpenAI's 400."""
    if not errors:
        return APIError(400, "invalid request")
    # A union (prompt: str | list[...]) reports each member's error; our own check's is the useful one.
    err = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # Union members show up in the location ("prompt.str"); keep the request's own field path.
    path = ".".join(
        x for x in loc if not re.fullmatch(r"[a-z]+\[.*\]|str|int|float|bool|list|function-.*", x)
    )
    message = err.get("msg", "invalid value")
    if err.get("type") == "json_invalid":
        return invalid_json(message)
    text = f"{path}: {message}" if path else message
    code = "invalid_value" if err.get("type") in _RANGE_ERRORS else "invalid_type"
    return APIError(400, text, param=loc[0] if loc else None, code=code)
