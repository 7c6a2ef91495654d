"""Sampling parameters of one request (vLLM-compatible names)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import ConfigError

_MAX_LOGPROBS = 20
_MAX_LOGIT_BIAS = 300  # OpenAI's limit
_MAX_REPETITION_PENALTY = 10.0
_GREEDY_BELOW = 1e-5  # a temperature under this samples greedily (logits / 1e-300 would be inf)


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match (exactly one field): a JSON schema, any JSON object, a regex, one of
    some strings, or a Lark grammar (llguidance's dialect). Enforced token by token by masking the
    logits to what keeps the output valid (``kvtier.worker.structured``)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [self.json is not None, self.json_object, self.regex is not None]
        given += [self.choice is not None, self.grammar is not None]
        if sum(given) != 1:
            raise ConfigError(
                "structured output takes exactly one of json, json_object, regex, choice, grammar"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ConfigError("structured output choice must be a non-empty list of strings")

    @property
    def key(self) -> str:
        """A stable text of the constraint (grammars are compiled once per key)."""
        return json.dumps(
            [self.json, self.json_object, self.regex, self.choice, self.grammar], sort_keys=True, default=str
        )


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature == 0`` (or below 1e-5) is greedy. ``seed`` makes a random request reproducible regardless of
    what else shares its batch. ``stop`` strings end generation and are not part of the output.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs reported per generated token
    # logprobs of every prompt token after the first (and top-k alternatives), as vLLM's: the prompt
    # is then computed whole, without prefix-cache hits (a cached block has K/V but no logits)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias: -100 bans, 100 forces).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Penalties on tokens already there (OpenAI's and vLLM's meanings; 0 / 1 disable them):
    # logit -= frequency_penalty * (times generated) + presence_penalty * (generated at all), and
    # repetition_penalty (HF's, over prompt and output): a positive logit divided by it, a negative one
    # multiplied.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured_outputs: StructuredOutputs | None = None  # the output must match it (JSON, regex, ...)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def number(name: str, value: object) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ConfigError(f"{name} must be finite, got {value!r}")
            return float(value)

        def integer(name: str, value: object) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
            return value

        if integer("n", self.n) < 1:
            raise ConfigError(f"n must be at least 1, got {self.n}")
        if number("temperature", self.temperature) < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < number("top_p", self.top_p) <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if integer("top_k", self.top_k) < 0:
            raise ConfigError(f"top_k must be >= 0 (or -1 to disable), got {self.top_k}")
        if not 0.0 <= number("min_p", self.min_p) <= 1.0:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            integer("seed", self.seed)
        if self.max_tokens is not None and integer("max_tokens", self.max_tokens) < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if integer("min_tokens", self.min_tokens) < 0:
            raise ConfigError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ConfigError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ConfigError(f"stop must be a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ConfigError(f"stop_token_ids must be non-negative integers, got {t!r}")
        if self.logprobs is not None and not 0 <= integer("logprobs", self.logprobs) <= _MAX_LOGPROBS:
            raise ConfigError(f"logprobs must be in [0, {_MAX_LOGPROBS}], got {self.logprobs}")
        top = self.prompt_logprobs
        if top is not None and not 0 <= integer("prompt_logprobs", top) <= _MAX_LOGPROBS:
            raise ConfigError(f"prompt_logprobs must be in [0, {_MAX_LOGPROBS}], got {top}")
        self._validate_logit_bias(number, integer)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= number(name, getattr(self, name)) <= 2.0:
                raise ConfigError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        top = _MAX_REPETITION_PENALTY
        if not 0.0 < number("repetition_penalty", self.repetition_penalty) <= top:
            raise ConfigError(f"repetition_penalty must be in (0, {top:g}], got {self.repetition_penalty}")

    def _validate_logit_bias(self, number: Any, integer: Any) -> None:
        if len(self.logit_bias) > _MAX_LOGIT_BIAS:
            raise ConfigError(
                f"logit_bias holds at most {_MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}"
            )
        for token_id, bias in self.logit_bias.items():
            if integer("logit_bias", token_id) < 0:
                raise ConfigError(f"logit_bias keys must be token ids (>= 0), got {token_id}")
            if not -100.0 <= number("logit_bias", bias) <= 100.0:
                raise ConfigError(f"logit_bias values must be in [-100, 100], got {bias}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (they then depend on the tokens so far)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or so close to it that dividing the logits by it overflows (as vLLM does)."""
        return self.temperature < _GREEDY_BELOW
