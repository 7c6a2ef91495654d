"""Structured output: each constrained sequence's grammar, and the tokens it allows at every step.

::

    StructuredOutputs (json schema | json_object | regex | choice | Lark grammar)
        └─ check_spec(spec)          size limits, before anything is parsed (ConfigError naming the limit)
        └─ schema_error(schema)      a JSON schema checked alone, no tokenizer (check_tool_schemas: each
                                     tool's parameters, so the 400 names the tool)
        └─ Grammars.compile(spec)    llguidance compiles it once into a template matcher (LRU by spec key)
           Grammars.submit(spec)     the same on a compile thread (the server: never on the engine thread)
    per sequence: a deep copy of the template, made at its first sample (n > 1 forks copy it too)
        allowed(seq, params, V) ─► bool [V]: the tokens that keep the output on the grammar (EOS once it
                                   is complete); GrammarError when the matcher has failed
        consume(seq, token)        the sampled token moves the matcher on
        release(seq)               a finished or aborted sequence's matcher goes

With ``spec.reasoning`` (the server's ``--reasoning-parser``) the grammar is the answer's after the think
block: a top-level Lark grammar lets the thought come first, one lazy lexeme up to ``</think>``, then
names the answer's as ``@answer``. A ``thinking_token_budget`` counts the thought's tokens (reading the
output's text as :mod:`kvtier.reasoning` does) and, once it is spent, ``allowed`` holds only the closing
tag's next token.

The sampler masks the row to ``allowed`` after penalties, bias and bans, so the model's own choice
among the valid tokens decides (greedy stays greedy). llguidance (a Rust library; its first token mask
took 1.6 ms on this vocabulary here) is imported only when a request asks for it.

Bounds: a spec's text (schema, regex, grammar, or a choice list's entries together) is at most
``MAX_SPEC_BYTES``, a choice list at most ``MAX_CHOICES`` entries, a JSON schema at most
``MAX_JSON_DEPTH`` deep; llguidance's own fuel limits (``_LIMITS``) bound the compile's work, and the
server waits at most ``COMPILE_TIMEOUT_S`` for it. A compiled template is pinned to the request's
``SamplingParams`` (``compiled_grammar``), so the engine thread never compiles a spec the server
compiled, even if the cache evicted it meanwhile.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.config import ConfigError
from kvtier.reasoning import CLOSE, OPEN, OPENED_BY_PROMPT
from kvtier.sampling_params import SamplingParams, StructuredOutputs
from kvtier.tools import Tool, ToolError

MAX_GRAMMARS = 128  # compiled templates kept (a schema used again skips its compile)
MAX_SPEC_BYTES = 64 * 1024  # a schema's, regex's or grammar's text; a choice list's entries together
MAX_CHOICES = 8192  # entries of a choice list
MAX_JSON_DEPTH = 64  # nesting of a JSON schema ([ and { levels)
COMPILE_TIMEOUT_S = 10.0  # how long the server waits for a compile (then a 400)
COMPILE_THREADS = 2  # compiles at once, off the engine thread; more wait their turn
# llguidance's fuel limits (its defaults: 2000, 1M, 200k, 50k, 250k, 500k): the grammar size and the
# lexer's construction bound the compile's work; per-step fuel bounds a mask's.
_LIMITS = dict(
    max_items_in_row=2000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=250_000,
    max_grammar_size=200_000,
)


class GrammarError(RuntimeError):
    """A sequence's matcher failed mid-generation (its request ends with an error, no other)."""


@dataclass
class _Thinking:
    """A sequence's thinking budget (``SamplingParams.thinking_token_budget``): its output's text while
    the thought may still open or run (read as :mod:`kvtier.reasoning` reads it), the tokens the thought
    has taken, and the closing tag's tokens still to force once the budget is spent."""

    budget: int
    opened_by_prompt: bool  # deepseek_r1: the output starts inside the thought
    text: bytearray = field(default_factory=bytearray)
    spent: int = 0
    forcing: list[int] = field(default_factory=list)
    over: bool = False  # closed, or never opened: nothing more to count

    def where(self) -> str:
        """ "before" the thought (it may still open), in the "thought", or "over"."""
        if self.over:
            return "over"
        body = bytes(self.text).lstrip()
        if body.startswith(_OPEN_BYTES):
            start = len(_OPEN_BYTES)
        elif self.opened_by_prompt:
            start = 0
        elif not _OPEN_BYTES.startswith(body):
            self.over = True  # an answer without a thought
            return "over"
        else:
            return "before"
        self.over = _CLOSE_BYTES in body[start:]
        return "over" if self.over else "thought"


@dataclass(frozen=True)
class CompiledGrammar:
    """A spec compiled once: ``matcher`` is a template never advanced (sequences get deep copies)."""

    key: str
    matcher: Any  # llguidance.LLMatcher


# ----------------------------------------------------------------------------------- size limits
def _json_depth_of_text(text: str) -> int:
    """The deepest nesting of ``[``/``{`` in JSON text (strings skipped), without parsing it."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _json_depth_of_value(value: Any) -> int:
    """The nesting depth of a parsed JSON value (iterative: a deep one cannot exhaust the stack)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                return deepest
            stack.extend((v, depth) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _too_big(what: str, size: int, limit: int, unit: str) -> ConfigError:
    return ConfigError(f"structured output: the {what} is {size} {unit}; the limit is {limit} {unit}")


def check_spec(spec: StructuredOutputs) -> None:
    """ConfigError (starting "structured output") when ``spec`` is over a size limit; cheap, no parse."""
    if spec.choice is not None:
        if len(spec.choice) > MAX_CHOICES:
            raise _too_big("choice list", len(spec.choice), MAX_CHOICES, "entries")
        size = sum(len(c.encode("utf-8", "surrogatepass")) for c in spec.choice)
        if size > MAX_SPEC_BYTES:
            raise _too_big("choice list", size, MAX_SPEC_BYTES, "bytes")
        return
    if spec.json is not None:
        text = spec.json if isinstance(spec.json, str) else None
        depth = _json_depth_of_text(text) if text is not None else _json_depth_of_value(spec.json)
        if depth > MAX_JSON_DEPTH:
            raise ConfigError(
                f"structured output: the JSON schema nests deeper than the limit of {MAX_JSON_DEPTH} levels"
            )
        if text is None:
            text = json.dumps(spec.json, default=str)
    else:
        text = spec.regex if spec.regex is not None else spec.grammar
    size = len((text or "").encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        kind = "JSON schema" if spec.json is not None else "regex" if spec.regex is not None else "grammar"
        raise _too_big(kind, size, MAX_SPEC_BYTES, "bytes")


def _answer_grammar(spec: StructuredOutputs) -> str:
    """llguidance's grammar for ``spec``'s answer (ValueError/TypeError when it is not valid)."""
    from llguidance import LLMatcher

    if spec.json is not None or spec.json_object:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else (spec.json or {"type": "object"})
        return LLMatcher.grammar_from_json_schema(schema)
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:  # one lexeme (a terminal): thousands of choices stay one parser item
        return LLMatcher.grammar_from_lark(
            "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in spec.choice)
        )
    return LLMatcher.grammar_from_lark(spec.grammar or "")


# The think block before the answer, per reasoning parser (kvtier.reasoning splits the text the same way).
# The thought is one lazy lexeme that ends at the first closing tag: a greedy one would swallow the tag.
_CLOSE_RE = re.escape(CLOSE).replace("/", "\\/")  # inside a Lark /regex/, a slash is escaped
_THOUGHT = "thought[lazy]: /(.|\\n)*" + _CLOSE_RE + "/\nWS: /[ \\t\\n]*/\n"
_THINK_FIRST = {
    "qwen3": f'start: think? @answer\nthink: WS "{OPEN}" thought WS\n' + _THOUGHT,  # if it writes one
    "deepseek_r1": f'start: open? thought WS @answer\nopen: WS "{OPEN}"\n' + _THOUGHT,  # opened already
}
_OPEN_BYTES, _CLOSE_BYTES = OPEN.encode(), CLOSE.encode()


def _grammar_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar for ``spec``: its answer's, after the think block when ``spec.reasoning``
    (a top-level Lark grammar naming the answer's as ``@answer``)."""
    answer = _answer_grammar(spec)
    if spec.reasoning is None:
        return answer
    # llguidance's builders return a top-level grammar's JSON, except grammar_from_lark: the Lark text
    top = json.loads(answer) if answer.lstrip().startswith("{") else {"grammars": [{"lark_grammar": answer}]}
    grammars = top["grammars"]
    grammars[0] = {**grammars[0], "name": "answer"}
    return json.dumps({**top, "grammars": [{"lark_grammar": _THINK_FIRST[spec.reasoning]}, *grammars]})


def schema_error(schema: dict[str, Any]) -> str | None:
    """Why ``schema`` (a JSON schema) cannot be compiled, or None: the size limits, then llguidance's own
    check of the grammar (no tokenizer needed, so it runs before a model has loaded). A tool's parameters
    are checked with it one by one, so the error names the tool."""
    try:
        check_spec(StructuredOutputs(json=schema))
        from llguidance import LLMatcher, LLParserLimits

        grammar = LLMatcher.grammar_from_json_schema(schema)
        error = LLMatcher.validate_grammar(grammar, limits=LLParserLimits(**_LIMITS))
    except ConfigError as exc:
        return str(exc).removeprefix("structured output: ")
    except ImportError as exc:
        return f"structured output needs the llguidance package ({exc})"
    except (ValueError, TypeError, RecursionError) as exc:
        error = str(exc) or type(exc).__name__
    if not error or error.startswith("WARNING"):
        return None
    return " ".join(error.split())[:300]


def check_tool_schemas(tools: Sequence[Tool]) -> None:
    """ToolError naming ``tools[i].function.parameters`` when a tool's schema cannot be compiled (a few
    ms a tool); a forced call's grammar holds every tool's schema."""
    for i, tool in enumerate(tools):
        error = schema_error({"type": "object", **tool.parameters})
        if error is not None:
            param = f"tools[{i}].function.parameters"
            raise ToolError(f"{param} is not a JSON schema kvtier can enforce: {error}", param)


class Grammars:
    """Compiles constraints for one tokenizer (``tokenizer``: a ``tokenizers.Tokenizer``, serialized
    for llguidance at the first constrained request). ``compile``/``submit`` are thread-safe; the
    per-sequence methods belong to the engine thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        self._source = (tokenizer, vocab_size, list(eos_token_ids))
        self._tokenizer = None
        self._lock = threading.Lock()  # the tokenizer's creation, the cache, the in-flight compiles
        self._grammars: OrderedDict[str, CompiledGrammar] = OrderedDict()  # the last MAX_GRAMMARS
        self._inflight: dict[str, Future[CompiledGrammar]] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._matchers: dict[str, Any] = {}  # seq id -> its LLMatcher (engine thread)
        self._thinking: dict[str, _Thinking] = {}  # seq id -> its thinking budget (engine thread)
        self._close_ids: list[int] | None = None  # the closing tag's tokens (forced at a spent budget)

    def _llg_tokenizer(self):  # noqa: ANN202 - llguidance.LLTokenizer, built once (~0.3 s)
        with self._lock:
            if self._tokenizer is None:
                try:
                    from llguidance import LLTokenizer
                except ImportError as exc:
                    raise ConfigError(f"structured output needs the llguidance package ({exc})") from None
                backend, vocab, eos = self._source
                self._tokenizer = LLTokenizer(backend.to_str(), n_vocab=vocab, eos_token=eos)
            return self._tokenizer

    def cached(self, spec: StructuredOutputs) -> CompiledGrammar | None:
        with self._lock:
            compiled = self._grammars.get(spec.key)
            if compiled is not None:
                self._grammars.move_to_end(spec.key)
            return compiled

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """``spec`` compiled (from the cache when it was before); ConfigError (one line, starting
        "structured output") when it is over a limit or not a valid grammar."""
        check_spec(spec)  # before ``spec.key``, which serializes the whole spec
        compiled = self.cached(spec)
        if compiled is not None:
            return compiled
        tokenizer = self._llg_tokenizer()
        from llguidance import LLMatcher, LLParserLimits

        try:
            grammar = _grammar_text(spec)
        except (ValueError, TypeError, RecursionError) as exc:
            raise ConfigError(f"structured output: {' '.join(str(exc).split())[:300]}") from None
        matcher = LLMatcher(tokenizer, grammar, limits=LLParserLimits(**_LIMITS))
        if matcher.is_error():
            raise ConfigError(f"structured output: {' '.join(matcher.get_error().split())[:300]}")
        compiled = CompiledGrammar(spec.key, matcher)
        with self._lock:
            self._grammars[compiled.key] = compiled
            while len(self._grammars) > MAX_GRAMMARS:  # a server sees many schemas: keep the recent ones
                self._grammars.popitem(last=False)
        return compiled

    def submit(self, spec: StructuredOutputs) -> Future[CompiledGrammar]:
        """``compile(spec)`` on a compile thread (the same spec compiling already: that one's future)."""
        check_spec(spec)
        key = spec.key
        with self._lock:
            future = self._inflight.get(key)
            if future is not None:
                return future
            if self._executor is None:
                self._executor = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="kvtier-grammar")
            future = self._inflight[key] = self._executor.submit(self.compile, spec)
        future.add_done_callback(lambda _: self._done(key))
        return future

    def _done(self, key: str) -> None:
        with self._lock:
            self._inflight.pop(key, None)

    def prepare(self, params: SamplingParams) -> None:
        """Pin ``params``' compiled grammar to it (compiling now unless the server did already)."""
        spec = params.structured_outputs
        pinned = params.compiled_grammar
        if spec is None or (pinned is not None and pinned.key == spec.key):
            return
        params.compiled_grammar = self.compile(spec)

    # ------------------------------------------------------------------------- per sequence
    def _matcher(self, seq_id: str, params: SamplingParams):  # noqa: ANN202 - llguidance.LLMatcher
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            self.prepare(params)  # a no-op when add_request pinned it (always, through the engine)
            matcher = self._matchers[seq_id] = params.compiled_grammar.matcher.deep_copy()
        return matcher

    def allowed(self, seq_id: str, params: SamplingParams, vocab: int) -> torch.Tensor:  # bool [vocab]
        """The tokens the sequence's grammar allows next (bit i of the mask is token i); only the closing
        tag's next token once its thinking budget is spent."""
        matcher = self._matcher(seq_id, params)
        mask = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
        if matcher.is_error():
            raise GrammarError(f"structured output failed: {' '.join(matcher.get_error().split())[:300]}")
        bits = ((mask[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten().bool()  # [8 * bytes]
        if bits.numel() < vocab:  # logits past the tokenizer's ids: never allowed
            bits = torch.cat([bits, bits.new_zeros(vocab - bits.numel())])
        bits = bits[:vocab]
        forced = self._forced(seq_id, params)
        if forced is not None and bool(bits[forced]):
            bits = torch.zeros_like(bits)
            bits[forced] = True
        if not bool(bits.any()):
            raise GrammarError("structured output failed: the grammar allows no next token")
        return bits

    def _forced(self, seq_id: str, params: SamplingParams) -> int | None:
        """The closing tag's next token when the sequence's thought has spent its budget, else None."""
        thinking = self._thinking.get(seq_id)
        if thinking is None:
            spec = params.structured_outputs
            if params.thinking_token_budget is None or spec is None or spec.reasoning is None:
                return None
            opened = OPENED_BY_PROMPT[spec.reasoning]
            thinking = self._thinking[seq_id] = _Thinking(params.thinking_token_budget, opened)
        if not thinking.forcing and thinking.spent >= thinking.budget and thinking.where() == "thought":
            if self._close_ids is None:
                self._close_ids = list(self._source[0].encode(CLOSE, add_special_tokens=False).ids)
            thinking.forcing = list(self._close_ids)
        return thinking.forcing[0] if thinking.forcing else None

    def consume(self, seq_id: str, token: int) -> None:
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return
        thinking = self._thinking.get(seq_id)
        if thinking is not None:
            if thinking.forcing and thinking.forcing[0] == token:
                thinking.forcing.pop(0)  # the tag closing a spent budget: not the thought's
            elif thinking.where() == "thought":
                thinking.spent += 1
            if not thinking.over:
                thinking.text += self._llg_tokenizer().decode_bytes([token])
        if not matcher.consume_token(token):
            raise GrammarError(f"structured output failed: {' '.join(matcher.get_error().split())[:300]}")

    def release(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)
        self._thinking.pop(seq_id, None)
