"""Tool calls parsed out of a model's output, streamed: text and call events as the text arrives, the same
result fed at once or piece by piece."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from kvtier.tools.spec import CLOSE, OPEN


# ----------------------------------------------------------------------------------------- parsing
@dataclass
class ToolCall:
    """A parsed call: ``arguments`` is JSON text (OpenAI's ``function.arguments``)."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ToolEvent:
    """One step of a parse: ``text`` outside the calls, a call's start (``index``, ``call_id``, ``name``)
    or more of its arguments (``text``); ``reasoning`` text comes from :class:`kvtier.reasoning.AnswerStream`
    (the parser itself never emits it)."""

    kind: Literal["text", "call", "arguments", "reasoning"]
    text: str = ""
    index: int = 0
    call_id: str = ""
    name: str = ""


_HEAD = ("{", '"name"', ":", None, ",", '"arguments"', ":")  # None: the name, a JSON string


def _match_head(body: str) -> tuple[str, str | None, int]:
    """Whether ``body`` starts with ``{"name": "<name>", "arguments":`` (any whitespace between):
    ``("match", name, end)``, ``("partial", None, 0)`` while it still could, else ``("fail", None, 0)``."""
    pos, name = 0, None
    for token in _HEAD:
        while pos < len(body) and body[pos].isspace():
            pos += 1
        rest = body[pos:]
        if token is None:
            m = re.match(r'"([A-Za-z0-9_-]{0,64})("?)', rest)
            if m is None or (not m.group(2) and len(m.group(0)) < len(rest)):
                return ("fail", None, 0) if rest else ("partial", None, 0)
            if not m.group(2):
                return "partial", None, 0
            name, pos = m.group(1), pos + m.end()
        elif rest.startswith(token):
            pos += len(token)
        else:
            return ("partial", None, 0) if token.startswith(rest) else ("fail", None, 0)
    return "match", name, pos


@dataclass
class _ValueEnd:
    """Finds where a JSON object that starts a text ends, fed piece by piece (strings skipped)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    done: bool = False

    def feed(self, text: str) -> int:
        """How many characters of ``text`` belong to the value (all of them until it closes)."""
        for i, ch in enumerate(text):
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


def _as_calls(value: Any, names: Collection[str], bare: bool) -> list[tuple[str, str]] | None:
    """``[(name, arguments JSON)]`` of a parsed call (a list of them when ``bare``), or None."""
    items = value if bare and isinstance(value, list) and value else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        arguments = item.get("arguments", item.get("parameters") if bare else None)
        if isinstance(arguments, str):  # arguments written as a JSON string of the object
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append((item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


class ToolCallParser:
    """Splits one output into text and tool calls as it streams: ``feed(delta)`` and ``finish()`` return
    the :class:`ToolEvent` s decided so far; ``content`` and ``calls`` hold the result. Fed at once or piece
    by piece, the same text gives the same content and calls (only the ids differ)."""

    def __init__(self, names: Collection[str], *, bare: bool = True):
        self.names = frozenset(names)
        self.calls: list[ToolCall] = []
        self._texts: list[str] = []
        self._bare = bare  # a bare JSON call may still start the output
        self._state: Literal["start", "text", "body", "bare"] = "start"
        self._buf = ""  # text not decided yet
        self._skip_space = False  # after a call: drop the whitespace that follows it
        self._body = ""  # inside <tool_call>: what came so far
        self._gap = ""  # the whitespace before the block's tag
        self._searched = 0  # the body holds no closing tag before this
        self._head: Literal["partial", "fail", "streaming"] = "partial"
        self._args_start = self._args_end = 0
        self._value = _ValueEnd()

    @property
    def content(self) -> str | None:
        """The text outside the calls; None when there were calls and no text."""
        text = "".join(self._texts)
        return None if self.calls and not text else text

    def feed(self, delta: str) -> list[ToolEvent]:
        self._buf += delta
        events: list[ToolEvent] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[ToolEvent]:
        """The end of the output: what was held back is decided."""
        events: list[ToolEvent] = []
        if self._state == "bare":
            held, self._buf = self._buf, ""
            try:
                calls = _as_calls(json.loads(held), self.names, bare=True)
            except ValueError:
                calls = None
            if calls is not None:
                for name, arguments in calls:
                    self._add_call(events, name, arguments)
                return events
            self._state, self._bare = "text", False
            events += self.feed(held)
        if self._state == "body":
            self._close_body(events, self._body, closed=False)
        self._text(events, self._buf.lstrip() if self._skip_space else self._buf)
        self._buf = ""
        return events

    # ------------------------------------------------------------------------------- the states
    def _step(self, events: list[ToolEvent]) -> bool:
        """Move on as far as the text allows; True when another step may move further."""
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith("["):  # a list of calls starts "[{"
                head = head[1:].lstrip() or ("" if self._bare else "[")
            if not head:
                return False
            self._state = "bare" if self._bare and head.startswith("{") else "text"
            return self._state == "text"
        if self._state == "text":
            return self._step_text(events)
        if self._state == "body":
            self._body += self._buf
            self._buf = ""
            return self._step_body(events)
        return False  # bare: held to the end

    def _step_text(self, events: list[ToolEvent]) -> bool:
        if self._skip_space:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._skip_space = False
        at = self._buf.find(OPEN)
        if at >= 0:
            before = self._buf[:at]
            self._text(events, before.rstrip())
            self._gap = before[len(before.rstrip()) :]  # back in the text if the block is no call
            self._buf, self._body, self._state = self._buf[at + len(OPEN) :], "", "body"
            self._head, self._value, self._searched = "partial", _ValueEnd(), 0
            return True
        keep = next((k for k in range(len(OPEN) - 1, 0, -1) if self._buf.endswith(OPEN[:k])), 0)
        sure = self._buf[: len(self._buf) - keep].rstrip()  # trailing whitespace waits too
        self._text(events, sure)
        self._buf = self._buf[len(sure) :]
        return False

    def _step_body(self, events: list[ToolEvent]) -> bool:
        body = self._body
        if self._head == "partial":
            status, name, end = _match_head(body)
            rest = body[end:].lstrip()
            if status == "match" and name in self.names and rest[:1] == "{":
                self._head, self._args_start = "streaming", len(body) - len(rest)
                self._args_end = self._args_start
                self.calls.append(ToolCall(new_call_id(), name, ""))
                call = self.calls[-1]
                events.append(ToolEvent("call", index=len(self.calls) - 1, call_id=call.id, name=call.name))
            elif status == "fail" or (status == "match" and (name not in self.names or rest)):
                self._head = "fail"
        if self._head == "streaming" and not self._value.done:
            taken = self._value.feed(body[self._args_end :])
            piece = body[self._args_end : self._args_end + taken]
            self._args_end += taken
            if piece:
                self.calls[-1].arguments += piece
                events.append(ToolEvent("arguments", piece, index=len(self.calls) - 1))
        if self._head == "streaming" and not self._value.done:
            return False
        at = body.find(CLOSE, self._args_end if self._head == "streaming" else self._searched)
        if at < 0:
            self._searched = max(0, len(body) - len(CLOSE) + 1)  # no tag before there: not searched again
            return False
        self._close_body(events, body[:at], closed=True)
        self._buf = body[at + len(CLOSE) :] + self._buf
        self._state = "text"
        return True

    def _close_body(self, events: list[ToolEvent], body: str, closed: bool) -> None:
        """The end of a ``<tool_call>`` block (its tag seen: ``closed``, or the output over): a call, or
        text (the block as it was written)."""
        self._state = "text"
        if self._head == "streaming":
            self._skip_space = True
            return  # the call and its arguments went out already
        if not closed and self._head == "partial":  # the output ended (max_tokens) in a call's head:
            status, name, _ = _match_head(body)  # the call, its arguments not begun, or nothing of it
            if status == "match" and name in self.names:
                self._add_call(events, name, "")
            return  # never its markup as text (finish_reason "length" tells the client it was cut)
        try:
            calls = _as_calls(json.loads(body), self.names, bare=False)
        except ValueError:
            calls = None
        if calls is None:
            self._text(events, self._gap + OPEN + body + (CLOSE if closed else ""))
            return
        self._add_call(events, *calls[0])

    def _add_call(self, events: list[ToolEvent], name: str, arguments: str) -> None:
        self.calls.append(ToolCall(new_call_id(), name, arguments))
        call, index = self.calls[-1], len(self.calls) - 1
        events.append(ToolEvent("call", index=index, call_id=call.id, name=name))
        events.append(ToolEvent("arguments", arguments, index=index))
        self._skip_space = True

    def _text(self, events: list[ToolEvent], text: str) -> None:
        if text:
            self._texts.append(text)
            events.append(ToolEvent("text", text))


def parse_tool_calls(text: str, names: Collection[str]) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a whole output (:class:`ToolCallParser` fed at once)."""
    parser = ToolCallParser(names)
    parser.feed(text)
    parser.finish()
    return parser.content, parser.calls
