"""Sampling parameters of one request (vLLM-compatible names)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from kvtier.config import ConfigError
from kvtier.reasoning import REASONING_PARSERS

_MAX_LOGPROBS = 20
_MAX_LOGIT_BIAS = 300  # OpenAI's limit
_MAX_BAD_WORDS = 128
# Every float the sampler applies stays finite in float32 on logits of O(100): a bound on each.
_MAX_TEMPERATURE = 1e4  # logits / 1e4: a flat distribution already; more is no different
_REPETITION_PENALTY = (1e-2, 10.0)  # a logit of 100 divided by 1e-2 is 1e4; 1e-300 would be inf
_PENALTY = (-2.0, 2.0)  # presence/frequency (OpenAI's range)
_LOGIT_BIAS = (-100.0, 100.0)  # OpenAI's range
_MAX_INT = 2**63 - 1  # integer parameters (max_tokens, min_tokens, top_k, seed) fit 64 bits
_GREEDY_BELOW = 1e-5  # a temperature under this samples greedily (vLLM's _SAMPLING_EPS)


FREE_ANSWER = "start: /(.|\\n)*/"  # any text (a thinking budget's constraint when the answer has none)


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match (exactly one field): a JSON schema, any JSON object, a regex, one of
    some strings, or a Lark grammar (llguidance's dialect). Enforced token by token by masking the
    logits to what keeps the output valid (``kvtier.worker.structured``).

    ``reasoning`` (a :mod:`kvtier.reasoning` parser's name) holds the answer alone to it: the model's
    think block comes first, free (qwen3: if it writes one; deepseek_r1: the prompt opened it, so the
    output closes it before the answer), as vLLM does with a reasoning parser."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    reasoning: str | None = None

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
        if self.reasoning is not None and self.reasoning not in REASONING_PARSERS:
            raise ConfigError(
                f"structured output reasoning must be one of {', '.join(REASONING_PARSERS)}, "
                f"got {self.reasoning!r}"
            )

    @property
    def key(self) -> str:
        """A stable text of the constraint (grammars are compiled once per key)."""
        fields = [self.json, self.json_object, self.regex, self.choice, self.grammar, self.reasoning]
        return json.dumps(fields, sort_keys=True, default=str)


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
    skip_special_tokens: bool = True  # False: special tokens' text is in the output (vLLM's)
    include_stop_str_in_output: bool = False  # the stop string that ended the output stays in it (vLLM's)
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias: -100 bans, 100 forces).
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's; EOS too if listed)
    # Words never generated (vLLM's): each one's tokens, as written and after a space; the token that
    # would complete one is banned. The engine tokenizes them (``bad_words_token_ids``).
    bad_words: list[str] = field(default_factory=list)
    # Penalties on tokens already there (OpenAI's and vLLM's meanings; 0 / 1 disable them):
    # logit -= frequency_penalty * (times generated) + presence_penalty * (generated at all), and
    # repetition_penalty (HF's, over prompt and output): a positive logit divided by it, a negative one
    # multiplied.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured_outputs: StructuredOutputs | None = None  # the output must match it (JSON, regex, ...)
    # At most this many tokens of thought (with ``structured_outputs.reasoning``: ``reason_first``); then
    # the closing tag is forced and the answer follows (vLLM's; Anthropic's thinking.budget_tokens).
    thinking_token_budget: int | None = None
    # The compiled grammar of ``structured_outputs`` (kvtier.worker.structured.CompiledGrammar), pinned
    # here when it is compiled (off the engine thread when served), so the engine never compiles again.
    compiled_grammar: Any = field(default=None, init=False, repr=False, compare=False)
    bad_words_token_ids: list[tuple[int, ...]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    def reason_first(self, parser: str | None) -> None:
        """With a reasoning ``parser`` (the server's ``--reasoning-parser``), the constraint (if any) holds
        the answer alone: the think block before it is the model's own. A ``thinking_token_budget`` without a
        constraint gets a free answer's, which only counts the thought (ConfigError without a parser)."""
        if parser is None:
            if self.thinking_token_budget is not None:
                raise ConfigError(
                    "thinking_token_budget needs a reasoning parser (kvtier serve --reasoning-parser)"
                )
            return
        spec = self.structured_outputs
        if spec is None and self.thinking_token_budget is not None:
            spec = StructuredOutputs(grammar=FREE_ANSWER)
        if spec is not None and spec.reasoning is None:
            self.structured_outputs = replace(spec, reasoning=parser)
            self.compiled_grammar = None

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
        """ConfigError (its message starts with the parameter's name) for any value out of range."""
        self._validate_counts()
        self._validate_floats()
        if self.seed is not None:
            _integer("seed", self.seed)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ConfigError(f"stop must be a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ConfigError(f"stop_token_ids must be non-negative integers, got {t!r}")
        budget = self.thinking_token_budget
        if budget is not None and _integer("thinking_token_budget", budget) < 0:
            raise ConfigError(f"thinking_token_budget must be >= 0, got {budget}")
        if self.logprobs is not None and not 0 <= _integer("logprobs", self.logprobs) <= _MAX_LOGPROBS:
            raise ConfigError(f"logprobs must be in [0, {_MAX_LOGPROBS}], got {self.logprobs}")
        top = self.prompt_logprobs
        if top is not None and not 0 <= _integer("prompt_logprobs", top) <= _MAX_LOGPROBS:
            raise ConfigError(f"prompt_logprobs must be in [0, {_MAX_LOGPROBS}], got {top}")
        self._validate_logit_bias()
        self._validate_vocabulary()

    def _validate_vocabulary(self) -> None:
        """``allowed_token_ids`` and ``bad_words`` (their ids are checked against the vocabulary later)."""
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ConfigError("allowed_token_ids must not be empty (leave it out to allow every token)")
            for t in self.allowed_token_ids:
                if _integer("allowed_token_ids", t) < 0:
                    raise ConfigError(f"allowed_token_ids must be token ids (>= 0), got {t}")
        self.bad_words = list(self.bad_words or [])
        if len(self.bad_words) > _MAX_BAD_WORDS:
            raise ConfigError(f"bad_words holds at most {_MAX_BAD_WORDS} words, got {len(self.bad_words)}")
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ConfigError("bad_words must be a list of words (non-blank strings)")

    def _validate_counts(self) -> None:
        if _integer("n", self.n) < 1:
            raise ConfigError(f"n must be at least 1, got {self.n}")
        if _integer("top_k", self.top_k) < 0:
            raise ConfigError(f"top_k must be >= 0 (or -1 to disable), got {self.top_k}")
        if self.max_tokens is not None and _integer("max_tokens", self.max_tokens) < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if _integer("min_tokens", self.min_tokens) < 0:
            raise ConfigError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ConfigError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )

    def _validate_floats(self) -> None:
        _number("temperature", self.temperature, 0.0, _MAX_TEMPERATURE)
        _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _number("min_p", self.min_p, 0.0, 1.0)
        _number("presence_penalty", self.presence_penalty, *_PENALTY)
        _number("frequency_penalty", self.frequency_penalty, *_PENALTY)
        _number("repetition_penalty", self.repetition_penalty, *_REPETITION_PENALTY)

    def _validate_logit_bias(self) -> None:
        if len(self.logit_bias) > _MAX_LOGIT_BIAS:
            raise ConfigError(
                f"logit_bias holds at most {_MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}"
            )
        for token_id, bias in self.logit_bias.items():
            if _integer("logit_bias", token_id) < 0:
                raise ConfigError(f"logit_bias keys must be token ids (>= 0), got {token_id}")
            _number("logit_bias", bias, *_LOGIT_BIAS)

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (they then depend on the tokens so far)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or so close to it that dividing the logits by it overflows (as vLLM does)."""
        return self.temperature < _GREEDY_BELOW


def _integer(name: str, value: object) -> int:
    """``value`` when it is an int (not a bool) that fits 64 bits; ConfigError naming ``name`` else."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if abs(value) > _MAX_INT:
        raise ConfigError(f"{name} must fit in 64 bits, got {str(value)[:40]}")
    return value


def _number(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> float:
    """``value`` as a float when it is a finite number in [low, high] ((low, high] with ``low_open``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
    try:
        number = float(value)  # an int past float's range: OverflowError
    except OverflowError:
        number = math.nan
    inside = (low < number if low_open else low <= number) and number <= high
    if not inside:  # NaN compares false: caught here too
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ConfigError(f"{name} must be finite and in {span}, got {shown}")
    return number
