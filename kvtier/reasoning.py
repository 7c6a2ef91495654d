"""A reasoning model's thinking, split from its answer (``kvtier serve --reasoning-parser``, vLLM's flag).

Qwen3, DeepSeek-R1 and their kin write their reasoning between ``<think>`` and ``</think>`` before the
answer. With a parser the chat route returns it apart: ``message.reasoning_content`` (streamed as
``delta.reasoning_content``), and ``content`` (and the tool calls parsed from it) is the answer alone::

    parser        the output                                  reasoning_content     content
    qwen3         "<think>\\nWhy...\\n</think>\\n\\nBlue."        "\\nWhy...\\n"         "Blue."
                  "Blue." (no think block: enable_thinking      null                  "Blue."
                  false writes an empty one into the prompt)
                  "<think>\\nWhy..." (cut by max_tokens)          "\\nWhy..."            ""
    deepseek_r1   "Why...\\n</think>\\n\\nBlue." (the template    "Why...\\n"            "Blue."
                  opened the block in the prompt)
                  "Why..." (cut)                               "Why..."              ""

The whitespace between ``</think>`` and the answer is dropped. The split is made as text streams
(``ReasoningSplitter.feed``): a tag cut between two deltas is held back until it is whole, so a streamed
answer's pieces join to the whole answer's fields. ``AnswerStream`` puts the splitter before the tool
call parser, the one order every API's answer uses. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvtier.tools import ToolCallParser, ToolEvent

REASONING_PARSERS = ("qwen3", "deepseek_r1")
OPENED_BY_PROMPT = {"qwen3": False, "deepseek_r1": True}  # the template opened the block: output starts in it
OPEN, CLOSE = "<think>", "</think>"
_State = Literal["start", "reasoning", "gap", "content"]


@dataclass
class Split:
    """New text of one choice, as reasoning and as answer (either may be empty)."""

    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """One choice's text, fed as it streams: ``feed(delta)`` returns what is sure to be reasoning or
    answer so far, ``finish()`` the rest; ``reasoning`` is None while no reasoning was seen."""

    def __init__(self, parser: str):
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; one of {', '.join(REASONING_PARSERS)}")
        # qwen3: the model opens the block itself (or writes none); deepseek_r1: the prompt opened it
        self._state: _State = "start"
        self._opened_by_prompt = OPENED_BY_PROMPT[parser]
        self._held = ""
        self.reasoning: str | None = None

    def feed(self, text: str) -> Split:
        out = Split()
        self._held += text
        while self._held:
            before = self._state
            self._step(out)
            if self._state == before and self._held:
                break  # waiting for more text to decide
        return out

    def finish(self) -> Split:
        """What is still held: a partial tag is text after all."""
        out, held, self._held = Split(), self._held, ""
        if self._state == "reasoning" or (self._state == "start" and self._opened_by_prompt):
            self._add_reasoning(out, held)
        elif self._state != "gap":
            out.content += held
        return out

    def _add_reasoning(self, out: Split, text: str) -> None:
        out.reasoning += text
        self.reasoning = (self.reasoning or "") + text

    def _step(self, out: Split) -> None:
        held = self._held
        if self._state == "start":
            body = held.lstrip()
            if body.startswith(OPEN):
                self._held = body[len(OPEN) :]
                self._state = "reasoning"
                self.reasoning = self.reasoning or ""
            elif (body and OPEN.startswith(body)) or (held.isspace() and not self._opened_by_prompt):
                return  # maybe the opening tag, still arriving
            else:
                self._state = "reasoning" if self._opened_by_prompt else "content"
                if self._opened_by_prompt:
                    self.reasoning = self.reasoning or ""
        elif self._state == "reasoning":
            at = held.find(CLOSE)
            if at >= 0:
                self._add_reasoning(out, held[:at])
                self._held, self._state = held[at + len(CLOSE) :], "gap"
                return
            keep = _partial_suffix(held, CLOSE)
            self._add_reasoning(out, held[: len(held) - keep])
            self._held = held[len(held) - keep :]
        elif self._state == "gap":
            self._held = held.lstrip()
            if self._held:
                self._state = "content"
        else:
            out.content += held
            self._held = ""


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back: the tag may be arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """A whole output's ``(reasoning, content)``: reasoning None when the model wrote none."""
    splitter = ReasoningSplitter(parser)
    first, rest = splitter.feed(text), splitter.finish()
    return splitter.reasoning, first.content + rest.content


class AnswerStream:
    """One choice's text as every API's answer takes it: its reasoning split off first (with a
    ``reasoning_parser``), then the answer's text parsed for calls (with ``tool_names``). ``feed`` and
    ``finish`` return :class:`~kvtier.tools.ToolEvent` s, reasoning as ``kind="reasoning"``; fed whole or in
    pieces, the same events joined."""

    def __init__(self, tool_names: frozenset[str] | None, reasoning_parser: str | None):
        self.parser = ToolCallParser(tool_names) if tool_names is not None else None
        self._splitter = ReasoningSplitter(reasoning_parser) if reasoning_parser is not None else None

    def feed(self, text: str) -> list[ToolEvent]:
        return self._events(self._splitter.feed(text) if self._splitter is not None else Split(content=text))

    def finish(self) -> list[ToolEvent]:
        """What the splitter and the parser held back."""
        events = self._events(self._splitter.finish()) if self._splitter is not None else []
        return events + (self.parser.finish() if self.parser is not None else [])

    def _events(self, split: Split) -> list[ToolEvent]:
        events = [ToolEvent("reasoning", split.reasoning)] if split.reasoning else []
        if not split.content:
            return events
        if self.parser is None:
            return [*events, ToolEvent("text", split.content)]
        return events + self.parser.feed(split.content)
