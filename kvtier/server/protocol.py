"""The OpenAI wire contract of ``kvtier serve`` and ``kvtier router``: request models, their
``SamplingParams``, errors in OpenAI's JSON shape, how a key is presented and a tenant's cache salt.

One module for both processes: the router validates a body with the replica's own request models (to
hash its prompt as the replica will), answers its own errors with :class:`APIError` and derives the
salt with :func:`tenant_salt`, so what it computes and what it answers cannot drift from the replica's.
It imports pydantic and Starlette, never FastAPI or torch (the router starts on plain Starlette).

Request models are strict (a string is not a number, ``true`` is not an integer) and accept unknown
fields (clients send fields kvtier has no use for, such as ``metadata``), except the parameters that
would change the answer and that kvtier does not implement (``functions``, ``audio``, ...): those are
a 400 naming the parameter, never silently ignored. Chat takes ``tools``, ``tool_choice`` and
``parallel_tool_calls`` and messages with ``tool_calls`` and ``tool_call_id`` (:mod:`kvtier.tools` checks
them; a 400 names the field, e.g. ``tools[0].function.parameters``); ``/v1/completions`` refuses them.
Every string must be valid Unicode (a lone surrogate such as ``"\\ud800"`` is a 400). Ranges are checked by
:meth:`SamplingParams.validate`, so the server and the Python API reject the same values; the API's own
bounds come first, here, in one table (a 400 naming the field, before anything is queued), so every value
that reaches the float32 sampler stays finite there::

    field                          range                      why
    ─────────────────────────────  ─────────────────────────  ────────────────────────────────────────────
    temperature                    [0, 100]                   logits / temperature finite; < 1e-5 is greedy
    top_p                          (0, 1]
    top_k                          -1 (off), 0 (off) .. 2^31-1
    min_p                          [0, 1]
    presence_/frequency_penalty    [-2, 2]                    OpenAI's
    repetition_penalty             [0.01, 10]                 a logit divided by it stays finite
    logit_bias                     values [-100, 100],        OpenAI's; keys: token ids (the engine checks
                                   at most 300 entries        them against the vocabulary)
    seed                           [-2^63, 2^63 - 1]          int64
    max_tokens, max_completion_    >= 1 (completions: >= 0    the top is the context: prompt + max_tokens
      tokens                       with echo)                 over max_model_len is a 400 with the numbers
    min_tokens                     [0, 2^31 - 1]              and at most max_tokens
    logprobs (completions),        [0, 20]
      top_logprobs (chat)
    stop_token_ids                 each [0, 2^31 - 1], <= 256 the engine checks them against the vocabulary
    n                              [1, --max-n]

Every float field refuses NaN and infinities (``allow_inf_nan=False``; Python's ``json`` reads ``NaN``
and ``Infinity``).

Every error body is ``{"error": {"message", "type", "param", "code"}}`` (:mod:`.api_errors`, whose
names are re-exported here).

A key is sent as ``Authorization: Bearer <key>`` and compared in constant time (:func:`presents`, from
:mod:`.tenants` like :func:`tenant_salt`, re-exported here); a missing or wrong one is a 401
(:func:`unauthorized`). Which route takes which key is each app's own
table (``kvtier.server.auth``, ``kvtier.router.auth``). With ``--prefix-cache-scope user`` a request's
``cache_salt`` is derived from its tenant (:func:`tenant_salt`: the key it presented, its ``user`` field
and its own salt), so one tenant's prompts are never a prefix-cache hit for another.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from kvtier.chat_format import ChatTemplateArgs
from kvtier.config import ConfigError
from kvtier.kv.retention import MAX_TTL_S, WHOLE_PROMPT, RetentionSpan
from kvtier.sampling_params import SamplingParams, StructuredOutputs
from kvtier.server.api_errors import MAX_ECHO as MAX_ECHO
from kvtier.server.api_errors import MAX_MESSAGE as MAX_MESSAGE
from kvtier.server.api_errors import APIError as APIError
from kvtier.server.api_errors import bad_request as bad_request
from kvtier.server.api_errors import check_model as check_model
from kvtier.server.api_errors import clip as clip
from kvtier.server.api_errors import http_error as http_error
from kvtier.server.api_errors import invalid_json as invalid_json
from kvtier.server.api_errors import not_found as not_found
from kvtier.server.api_errors import unauthorized as unauthorized
from kvtier.server.api_errors import validation_error as validation_error
from kvtier.server.tenants import bearer as bearer
from kvtier.server.tenants import presents as presents
from kvtier.server.tenants import tenant_of as tenant_of
from kvtier.server.tenants import tenant_salt as tenant_salt
from kvtier.tools import (
    CLOSE,
    Tool,
    ToolChoice,
    ToolError,
    call_grammar,
    normalize_messages,
    parse_tool_choice,
    parse_tools,
)

MAX_STOP = 16  # stop strings are checked against every new token: a bounded list
MAX_STOP_TOKEN_IDS = 256
MAX_PROMPTS = 2048  # prompts in one /v1/completions request (OpenAI's limit)
PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # a request's priority (vLLM's field: lower runs first)
MAX_LOGIT_BIAS = 300  # logit_bias entries (OpenAI's limit)
MAX_INT32 = 2**31 - 1

# The sampling parameters' ranges at the API (the table above).
Temperature = Annotated[float, Field(ge=0.0, le=100.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=-1, le=MAX_INT32)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # presence_penalty, frequency_penalty
RepetitionPenalty = Annotated[float, Field(ge=0.01, le=10.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]  # a logit_bias value
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, Field(ge=0, le=MAX_INT32)]  # min_tokens, a stop token id
TopLogprobs = Annotated[int, Field(ge=0, le=20)]


# Parameters that change the answer and are not implemented: a 400 naming them, unless at their default
# (tools and tool_choice are chat's own fields: refused here on /v1/completions only).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "echo": (None, False),  # on chat (vLLM's: the last message before the answer): completions take it
    # vLLM's sampling extensions kvtier does not have: refused when they would change the answer
    "use_beam_search": (None, False),
    "chat_template": (None,),
    "spaces_between_special_tokens": (None, True),
}


# ---------------------------------------------------------------------------------------- requests
def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"not valid Unicode (a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start})"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


def _unicode_json(value: Any) -> Any:
    """Every string inside ``value`` (tools, tool calls) valid Unicode."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode (a lone surrogate)") from None
    except (TypeError, ValueError, RecursionError):
        pass  # not JSON: the tools' own checks say what is wrong
    return value


JSONValue = Annotated[Any, AfterValidator(_unicode_json)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class ContentPart(_Request):
    type: Text
    text: Text | None = None


class ChatMessage(_Request):
    role: Text
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[JSONValue] | None = None  # an assistant's calls (checked by kvtier.tools)
    tool_call_id: Text | None = None  # a tool message: the call it answers
    reasoning_content: Text | None = None  # an assistant's earlier thinking (vLLM's; "reasoning" too)
    reasoning: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"only text content parts are supported, got type '{clip(part.type)}'", "messages"
                )
        return "".join(part.text or "" for part in self.content)


class GenerationRequest(_Request):
    """Fields shared by chat and text completions (OpenAI's, then vLLM's extensions)."""

    model: Text | None = None
    n: int = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # OpenAI's prompt caching: "24h" keeps the prompt's blocks cached that long (kvtier/kv/retention.py;
    # "in_memory", the default, is ordinary prefix caching); the key is the router's affinity hint
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_key: Text | None = None
    # kvtier / vLLM extensions
    cache_salt: Text | None = None
    diagnostics: JSONValue = None  # {"previous_response_id": ...}: why it missed (server/diagnostics.py)
    ignore_eos: bool = False
    min_tokens: Count = 0
    stop_token_ids: list[Count] | None = None
    logit_bias: dict[str, Bias] | None = None
    allowed_token_ids: list[Count] | None = None  # vLLM's: only these may be sampled
    bad_words: list[Text] | None = None  # vLLM's: words never generated
    repetition_penalty: RepetitionPenalty | None = None  # HF's / vLLM's: over prompt and output tokens
    # structured output: OpenAI's response_format, or one of vLLM's guided_* fields
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    priority: int = 0  # lower runs first (vLLM's meaning)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N"
    # vLLM's: the prompt's last k tokens only (-1: as many as leave room for max_tokens)
    truncate_prompt_tokens: int | None = None

    def truncation(self) -> int | None:
        """``truncate_prompt_tokens``, checked (400 for 0 or below -1)."""
        k = self.truncate_prompt_tokens
        if k is not None and (k == 0 or k < -1):
            raise bad_request(
                f"truncate_prompt_tokens must be -1 or at least 1, got {clip(k)}", "truncate_prompt_tokens"
            )
        return k

    @property
    def retention(self) -> tuple[RetentionSpan, ...]:
        """The prompt's retention: the whole prompt for 24 hours with ``prompt_cache_retention: 24h``."""
        if self.prompt_cache_retention == "24h":
            return (RetentionSpan(WHOLE_PROMPT, MAX_TTL_S),)
        return ()

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        api_names: dict[str, str] | None = None,
    ) -> SamplingParams:
        """The request's ``SamplingParams``; a value they refuse is a 400 naming its field (``api_names``:
        ``SamplingParams`` names that are another field in this request's API)."""
        for name, value in (self.model_extra or {}).items():
            if name in _UNSUPPORTED and value not in _UNSUPPORTED[name]:
                raise bad_request(f"{name} is not supported by this server", name)
        lo, hi = PRIORITY_RANGE
        if not lo <= self.priority <= hi:
            raise bad_request(
                f"priority must be an integer in [{lo}, {hi}], got {clip(self.priority)}", "priority"
            )
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for name, values, limit in (
            ("stop", stop, MAX_STOP),
            ("stop_token_ids", self.stop_token_ids or [], MAX_STOP_TOKEN_IDS),
        ):
            if len(values) > limit:
                raise bad_request(f"{name} holds at most {limit} entries, got {len(values)}", name)
        kwargs: dict[str, Any] = dict(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=list(self.bad_words or []),
            structured_outputs=self._structured(),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
        try:
            return SamplingParams(**kwargs)
        except ConfigError as exc:
            err = bad_request(exc)
            err.param = (api_names or {}).get(err.param or "", err.param)
            raise err from None

    def _structured(self) -> StructuredOutputs | None:
        """``response_format`` (text, json_object, json_schema) or a ``guided_*`` field, at most one."""
        given: dict[str, Any] = {}
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type")
            schema = fmt.get("json_schema")
            if kind == "json_object":
                given["json_object"] = True
            elif kind == "json_schema":
                if not isinstance(schema, dict) or not isinstance(schema.get("schema", {}), dict):
                    raise bad_request(
                        'response_format json_schema takes {"json_schema": {"name": ..., "schema": {...}}}',
                        "response_format",
                    )
                given["json"] = schema.get("schema", {})
            elif kind != "text":
                raise bad_request(
                    f"response_format type must be text, json_object or json_schema, got {clip(kind)}",
                    "response_format",
                )
        guided = {k: getattr(self, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")}
        guided = {k: v for k, v in guided.items() if v is not None}
        if len(given) + len(guided) > 1:  # counted apart: response_format json + guided_json is two
            raise bad_request(
                "use one of response_format, guided_json, guided_regex, guided_choice, guided_grammar",
                "response_format",
            )
        given.update(guided)
        try:
            return StructuredOutputs(**given) if given else None
        except ConfigError as exc:
            raise bad_request(exc, "response_format") from None

    def _logit_bias(self) -> dict[int, float]:
        """OpenAI's ``{"token id": bias}`` (keys are strings in JSON) as ``{id: bias}``."""
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or len(key) > 12:
                raise bad_request(f"logit_bias keys must be token ids, got '{clip(key)}'", "logit_bias")
            bias[int(key)] = float(value)
        return bias


class ChatTemplateFields(_Request):
    """vLLM's chat-template fields (:mod:`kvtier.chat_format`): a new assistant message (the default), or
    ``continue_final_message`` with ``add_generation_prompt: false`` to continue the last one; and more
    template variables (``{"enable_thinking": false}`` for Qwen3)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, JSONValue] | None = None

    def template_args(self) -> ChatTemplateArgs:
        """``Tokenizer.encode_chat``'s keyword arguments (checked there: ChatFormatError names the field)."""
        return ChatTemplateArgs(
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            template_kwargs=dict(self.chat_template_kwargs or {}),
        )


class ChatCompletionRequest(GenerationRequest, ChatTemplateFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: JSONValue = None  # OpenAI's function tools (kvtier.tools.parse_tools checks them)
    tool_choice: JSONValue = None  # "none" | "auto" | "required" | {"type": "function", "function": {...}}
    parallel_tool_calls: bool = True
    thinking_token_budget: int | None = None  # vLLM's: the thought's most tokens (--reasoning-parser)

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
        top_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self._params(
            max_tokens, top_logprobs, api_names={"logprobs": "top_logprobs", "max_tokens": param}
        )
        _, choice = self.tool_request()
        if choice.mode == "auto" and not choice.parallel:  # one call at most: the output ends with it
            params.stop = [*params.stop, CLOSE]
        budget = self.thinking_token_budget
        if budget is not None and budget < 0:
            raise bad_request(
                f"thinking_token_budget must be >= 0, got {clip(budget)}", "thinking_token_budget"
            )
        params.thinking_token_budget = budget
        return params

    def conversation(self) -> list[dict[str, Any]]:
        return conversation_of(self.messages)

    def tool_request(self) -> tuple[list[Tool], ToolChoice]:
        """The request's tools and tool_choice, checked (400 naming the field)."""
        try:
            tools = parse_tools(self.tools)
            return tools, parse_tool_choice(self.tool_choice, tools, self.parallel_tool_calls)
        except ToolError as exc:
            raise bad_request(exc, exc.param) from None

    def _structured(self) -> StructuredOutputs | None:
        """``tool_choice`` required or a named function: the calls' grammar (no other constraint then)."""
        given = super()._structured()
        tools, choice = self.tool_request()
        if not choice.constrained:
            return given
        if given is not None:
            raise bad_request(
                "response_format and guided_* cannot be combined with tool_choice 'required' or a named "
                "function: the answer is the tool calls",
                "tool_choice",
            )
        return StructuredOutputs(grammar=call_grammar(tools, choice))


def conversation_of(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (OpenAI's ``developer`` role is ``system``), their tool
    parts checked (:func:`kvtier.tools.normalize_messages`: a 400 naming ``messages``, as every message
    error does, its text the field, e.g. ``messages[2].tool_call_id``)."""
    chat: list[dict[str, Any]] = []
    for m in messages:
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls is not None:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:  # the template decides whether to write it (Qwen3's: in the current turn)
            message["reasoning_content"] = reasoning
        chat.append(message)
    try:
        return normalize_messages(chat)
    except ToolError as exc:
        raise bad_request(exc, "messages") from None


PromptInput = Text | list[Text] | list[int] | list[list[int]]


class CompletionRequest(GenerationRequest):
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: TopLogprobs | None = None
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = None

    def sampling_params(self) -> SamplingParams:
        """``echo``: the prompt comes back before the completion, with its tokens' logprobs when
        ``logprobs`` is set (the first token's is null), as OpenAI's legacy completions do; with
        ``max_tokens`` 0, the prompt alone (a prompt-scoring request)."""
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of not in (None, self.n):
            raise bad_request("best_of is not supported (only equal to n)", "best_of")
        prompt_logprobs = self.logprobs if self.echo else None
        names = {"prompt_logprobs": "logprobs"}
        if self.prompt_only:  # one token is sampled (from the prefill's own logits) and not returned
            return self._params(1, self.logprobs, prompt_logprobs, names)
        return self._params(self.max_tokens, self.logprobs, prompt_logprobs, names)

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the prompt (and its logprobs) alone, no completion."""
        return self.echo and self.max_tokens == 0

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
        if len(items) > MAX_PROMPTS:
            raise bad_request(f"prompt holds at most {MAX_PROMPTS} prompts, got {len(items)}", "prompt")
        return items


class TokenizeRequest(ChatTemplateFields):
    """``POST /tokenize``: a ``prompt``, or ``messages`` rendered with the chat template."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    tools: JSONValue = None  # rendered with ``messages`` as the chat route renders them

    def tool_list(self) -> list[Tool]:
        """The request's tools, checked (400 naming the field)."""
        try:
            return parse_tools(self.tools)
        except ToolError as exc:
            raise bad_request(exc, exc.param) from None


class DetokenizeRequest(_Request):
    """``POST /detokenize``."""

    model: Text | None = None
    tokens: list[int]
