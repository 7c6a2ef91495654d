"""What a Messages request asks of its answer, beyond the conversation (torch-free, no FastAPI)::

output_config.format   {"type": "json_schema", "schema"}: the answer held to the schema
                       (llguidance, as chat's ``response_format``)
output_config.effort   low .. max: the template's ``reasoning_effort`` (templates that read it)
thinking               enabled (budget_tokens >= 1024: with --reasoning-parser, the thought's bound) |
                       adaptive | disabled: the template's ``enable_thinking`` (Qwen3's)
a final assistant      a prefill: text only, not ending in whitespace (Anthropic's rules)
  message
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.server.anthropic_errors import invalid

_EFFORTS = ("low", "medium", "high", "xhigh", "max")


@dataclass(frozen=True)
class OutputConfig:
    """``output_config``: ``format`` ``{"type": "json_schema", "schema"}`` holds the answer to the schema
    (llguidance, as chat's ``response_format``); ``effort`` is the template's ``reasoning_effort``
    (templates that read it, as the Responses API's ``reasoning.effort``)."""

    schema: dict[str, Any] | None = None
    effort: str | None = None


def output_config_of(raw: Any) -> OutputConfig:
    if raw is None:
        return OutputConfig()
    if not isinstance(raw, dict) or not set(raw) <= {"format", "effort"}:
        raise invalid(
            'output_config must be {"format"?: {"type": "json_schema", "schema"}, "effort"?}', "output_config"
        )
    effort, fmt = raw.get("effort"), raw.get("format")
    if effort is not None and effort not in _EFFORTS:
        raise invalid(f"output_config.effort must be one of {', '.join(_EFFORTS)}", "output_config.effort")
    if fmt is None:
        return OutputConfig(effort=effort)
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise invalid(
            'output_config.format must be {"type": "json_schema", "schema": {...}}', "output_config.format"
        )
    return OutputConfig(fmt["schema"], effort)


@dataclass(frozen=True)
class Thinking:
    """``thinking``: enabled or disabled (None: not said; the template's ``enable_thinking``), and its
    ``budget_tokens`` (with ``--reasoning-parser``: the thought's most tokens, then it is closed)."""

    enabled: bool | None = None
    budget_tokens: int | None = None


def thinking_of(raw: Any) -> Thinking:
    """``thinking``: ``{"type": "enabled", "budget_tokens": n}`` (n >= 1024, as Anthropic's),
    ``{"type": "adaptive"}`` or ``{"type": "disabled"}``."""
    if raw is None:
        return Thinking()
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "enabled":
        budget = raw.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
            raise invalid(
                "thinking.budget_tokens must be an integer of at least 1024", "thinking.budget_tokens"
            )
        return Thinking(True, budget)
    if kind not in ("adaptive", "disabled"):
        raise invalid(
            'thinking must be {"type": "enabled", "budget_tokens": n} | {"type": "adaptive" | "disabled"}',
            "thinking",
        )
    return Thinking(kind != "disabled")


def check_prefill(message: dict[str, Any], at: str) -> None:
    """A final assistant message is a prefill the answer continues: text only, and (as Anthropic's API
    says) not ending in whitespace."""
    if message.get("tool_calls"):
        raise invalid(
            "the last message is the assistant's and holds tool_use blocks: a prefill continues text; "
            "send the tool results in a user message",
            at,
        )
    if message["content"] != message["content"].rstrip():
        raise invalid("messages: final assistant content cannot end with trailing whitespace", at)
