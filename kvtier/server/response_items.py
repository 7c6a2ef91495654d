"""A Responses API answer's output items, built as the text arrives (torch-free, no FastAPI).

The completion's text goes through the reasoning splitter (with ``--reasoning-parser``) and the tool
call parser (with tools), and each piece opens, grows or closes one output item, with its stream events::

    piece                  item                                              events
    reasoning text         {"type": "reasoning", "id": "rs_...", "summary":  output_item.added,
                            [], "content": [{"type": "reasoning_text",        reasoning_text.delta ...,
                            "text"}]}                                          reasoning_text.done,
                                                                               output_item.done
    answer text            {"type": "message", "id": "msg_...", "role":      output_item.added,
                            "assistant", "status", "content": [{"type":        content_part.added,
                            "output_text", "text", "annotations": []}]}        output_text.delta ...,
                                                                               output_text.done,
                                                                               content_part.done,
                                                                               output_item.done
    a tool call            {"type": "function_call", "id": "fc_...",         output_item.added,
                            "call_id", "name", "arguments", "status"}          function_call_arguments
                                                                               .delta ..., .done,
                                                                               output_item.done

Every event names its item (``item_id``) and place (``output_index``, ``content_index``); the
``sequence_number`` is the formatter's. Fed at once or piece by piece, the same items.
"""

from __future__ import annotations

from typing import Any

from kvtier.reasoning import AnswerStream
from kvtier.server.response_store import new_item_id
from kvtier.tools import ToolEvent


class OutputItems:
    """One completion's output items: ``feed(delta)`` and ``finish()`` return the stream's events (dicts
    without ``sequence_number``), ``items`` holds the items (each ``completed`` once closed)."""

    def __init__(
        self, tool_names: frozenset[str] | None, reasoning_parser: str | None, response_id: str | None = None
    ):
        self._answer = AnswerStream(tool_names, reasoning_parser)
        self.response_id = response_id  # the items' ids name it (an item_reference finds them)
        self.items: list[dict[str, Any]] = []
        self._open: str | None = None  # the type of the item still open

    def _id(self, prefix: str) -> str:
        return new_item_id(prefix, self.response_id)

    @property
    def called(self) -> bool:
        return any(item["type"] == "function_call" for item in self.items)

    @property
    def reasoning_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")

    def feed(self, delta: str) -> list[dict[str, Any]]:
        return self._apply(self._answer.feed(delta))

    def finish(self, cut: bool = False) -> list[dict[str, Any]]:
        """The end of the text: what the stream held back, then the open item closed (``cut``: by
        ``max_output_tokens``, the item is ``incomplete``)."""
        return [*self._apply(self._answer.finish()), *self._close(cut)]

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open != "reasoning":
            item = {
                "type": "reasoning",
                "id": self._id("rs"),
                "summary": [],
                "content": [],
            }
            events += [*self._close(), self._start(item)]
            item["content"].append({"type": "reasoning_text", "text": ""})
        self.items[-1]["content"][0]["text"] += text
        events.append({"type": "response.reasoning_text.delta", **self._place(), "delta": text})
        return events

    def _apply(self, parsed: list[ToolEvent]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for e in parsed:
            if e.kind == "reasoning":
                events += self._reasoning(e.text)
            elif e.kind == "text":
                if self._open != "message":
                    events += self._open_message()
                self.items[-1]["content"][0]["text"] += e.text
                events.append(
                    {"type": "response.output_text.delta", **self._place(), "delta": e.text, "logprobs": []}
                )
            elif e.kind == "call":
                item = {
                    "type": "function_call",
                    "id": self._id("fc"),
                    "call_id": e.call_id,
                    "name": e.name,
                }
                events += [*self._close(), self._start({**item, "arguments": "", "status": "in_progress"})]
            else:
                self.items[-1]["arguments"] += e.text
                delta = {"type": "response.function_call_arguments.delta", "delta": e.text}
                events.append({**delta, "item_id": self.items[-1]["id"], "output_index": len(self.items) - 1})
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        item = {
            "type": "message",
            "id": self._id("msg"),
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        events = [*self._close(), self._start(item)]
        part = {"type": "output_text", "text": "", "annotations": []}
        item["content"].append(part)
        events.append({"type": "response.content_part.added", **self._place(), "part": dict(part)})
        return events

    def _start(self, item: dict[str, Any]) -> dict[str, Any]:
        self.items.append(item)
        self._open = item["type"]
        return {
            "type": "response.output_item.added",
            "output_index": len(self.items) - 1,
            "item": _copy(item),
        }

    def _place(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _close(self, cut: bool = False) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        item, kind, self._open = self.items[-1], self._open, None
        events: list[dict[str, Any]] = []
        if kind == "message":
            part = item["content"][0]
            events.append(
                {"type": "response.output_text.done", **self._place(), "text": part["text"], "logprobs": []}
            )
            events.append({"type": "response.content_part.done", **self._place(), "part": dict(part)})
        elif kind == "reasoning":
            text = item["content"][0]["text"]
            events.append({"type": "response.reasoning_text.done", **self._place(), "text": text})
        else:
            done = {"item_id": item["id"], "output_index": len(self.items) - 1, "name": item["name"]}
            events.append(
                {"type": "response.function_call_arguments.done", **done, "arguments": item["arguments"]}
            )
        if kind != "reasoning":
            item["status"] = "incomplete" if cut else "completed"
        events.append(
            {"type": "response.output_item.done", "output_index": len(self.items) - 1, "item": _copy(item)}
        )
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item for an event (its content parts copied: they grow after)."""
    copied = dict(item)
    if "content" in copied:
        copied["content"] = [dict(part) for part in copied["content"]]
    return copied
