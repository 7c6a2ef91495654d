"""Structured output: each constrained sequence's grammar, and the tokens it allows at every step.

::

    StructuredOutputs (json schema | json_object | regex | choice | Lark grammar)
        └─ Grammars.compile(spec): llguidance's grammar text, validated once per spec (ConfigError)
    per sequence: an LLMatcher (llguidance), made at its first sample
        allowed(seq, spec, V) ─► bool [V]: the tokens that keep the output on the grammar (EOS once it
                                is complete)
        consume(seq, token)      the sampled token moves the matcher on
        release(seq)             a finished or aborted sequence's matcher goes

The sampler masks the row to ``allowed`` after penalties, bias and bans, so the model's own choice
among the valid tokens decides (greedy stays greedy). A sequence forked from a prompt (n > 1) starts
its own matcher at the same state, since forks happen before any output. llguidance (a Rust library;
its first token mask took 1.6 ms on this vocabulary here) is imported only when a request asks for it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from kvtier.config import ConfigError
from kvtier.sampling_params import StructuredOutputs

MAX_GRAMMARS = 256  # compiled grammar texts kept (a schema used again skips its compile)


class Grammars:
    """Compiles constraints for one tokenizer (``tokenizer``: a ``tokenizers.Tokenizer``, serialized
    for llguidance at the first constrained request)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        self._source = (tokenizer, vocab_size, list(eos_token_ids))
        self._tokenizer = None
        self._grammars: OrderedDict[str, str] = OrderedDict()  # the last MAX_GRAMMARS compiled, by key
        self._matchers: dict[str, object] = {}

    def _llg_tokenizer(self):  # noqa: ANN202 - llguidance.LLTokenizer, built once (~0.3 s)
        if self._tokenizer is None:
            try:
                from llguidance import LLTokenizer
            except ImportError as exc:
                raise ConfigError(f"structured output needs the llguidance package ({exc})") from None
            backend, vocab, eos = self._source
            self._tokenizer = LLTokenizer(backend.to_str(), n_vocab=vocab, eos_token=eos)
        return self._tokenizer

    def compile(self, spec: StructuredOutputs) -> str:
        """llguidance's grammar for ``spec``; ConfigError (one line) when it is not a valid one."""
        key = spec.key
        if key in self._grammars:
            self._grammars.move_to_end(key)
            return self._grammars[key]
        tokenizer = self._llg_tokenizer()
        from llguidance import LLMatcher

        try:
            if spec.json is not None or spec.json_object:
                schema = (
                    json.loads(spec.json) if isinstance(spec.json, str) else (spec.json or {"type": "object"})
                )
                grammar = LLMatcher.grammar_from_json_schema(schema)
            elif spec.regex is not None:
                grammar = LLMatcher.grammar_from_regex(spec.regex)
            elif spec.choice is not None:
                grammar = LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in spec.choice)
                )
            else:
                grammar = LLMatcher.grammar_from_lark(spec.grammar or "")
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"structured output: {exc}") from None
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        if error and not error.startswith("WARNING"):
            raise ConfigError(f"structured output: {' '.join(error.split())[:300]}")
        self._grammars[key] = grammar
        if len(self._grammars) > MAX_GRAMMARS:  # a server sees many schemas: keep the recent ones
            self._grammars.popitem(last=False)
        return grammar

    # ------------------------------------------------------------------------- per sequence
    def _matcher(self, seq_id: str, spec: StructuredOutputs):  # noqa: ANN202 - llguidance.LLMatcher
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            from llguidance import LLMatcher

            matcher = self._matchers[seq_id] = LLMatcher(self._llg_tokenizer(), self.compile(spec))
        return matcher

    def allowed(self, seq_id: str, spec: StructuredOutputs, vocab: int) -> torch.Tensor:  # bool [vocab]
        """The tokens the sequence's grammar allows next (bit i of the mask is token i)."""
        mask = torch.frombuffer(bytearray(self._matcher(seq_id, spec).compute_bitmask()), dtype=torch.uint8)
        bits = ((mask[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten().bool()  # [8 * bytes]
        if bits.numel() < vocab:  # logits past the tokenizer's ids: never allowed
            bits = torch.cat([bits, bits.new_zeros(vocab - bits.numel())])
        return bits[:vocab]

    def consume(self, seq_id: str, token: int) -> None:
        matcher = self._matchers.get(seq_id)
        if matcher is not None:
            matcher.consume_token(token)

    def release(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)
