"""What a chat template is asked besides the messages and tools: transformers' ``apply_chat_template``
arguments, under vLLM's chat-completion field names.

    add_generation_prompt    True (default): the template opens the assistant's turn, the answer is a
                             new message
    continue_final_message   True: the last message (an assistant's, usually) is left open and the
                             answer continues it: "prefill" (Anthropic's word), the model's reply is
                             steered by its first words ("{" for JSON, "Sure," ...). Both True is an error
    template_kwargs          more variables for the template (vLLM's ``chat_template_kwargs``): Qwen3's
                             ``enable_thinking``, Llama 3's ``date_string``, ...

The final message is left open the way transformers does it, so the prompt is byte for byte
``apply_chat_template(..., continue_final_message=True)``: the message's content gets a tag
(``CONTINUE_TAG``) appended, the conversation is rendered whole, and the text is cut where the tag
starts (and right-stripped if the template trimmed the space the tag ends with, i.e. trims contents)::

    <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nSure, CONTINUE_FINAL_MESSAGE_TAG <|im_end|>\\n
                                                          ^ cut here: "...assistant\\nSure, "

A template variable is a name and a JSON value; the names the template gets from kvtier itself
(``RESERVED_NAMES``: the messages, tools, the two flags, the special tokens) cannot be set this way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypedDict

from kvtier.config import ConfigError

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' own, so the cut is where transformers cuts
MAX_TEMPLATE_KWARGS = 32
RESERVED_NAMES = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "raise_exception",
        "strftime_now",
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
    }
)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


class ChatFormatError(ConfigError):
    """A bad template argument; ``param`` names the request field (``continue_final_message``,
    ``chat_template_kwargs``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class ChatTemplateArgs(TypedDict, total=False):
    """``Tokenizer.encode_chat``'s template arguments, as a request maps them (``**args``)."""

    add_generation_prompt: bool
    continue_final_message: bool
    template_kwargs: dict[str, Any]


def check_template_args(
    add_generation_prompt: bool, continue_final_message: bool, template_kwargs: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The template variables to render with, checked: ChatFormatError for both flags set, a name that
    is not an identifier or is one kvtier sets itself, or too many."""
    if add_generation_prompt and continue_final_message:
        raise ChatFormatError(
            "continue_final_message and add_generation_prompt cannot both be true: continue_final_message "
            "continues the last message, add_generation_prompt opens a new assistant message (set it false)",
            "continue_final_message",
        )
    if template_kwargs is None:
        return {}
    if not isinstance(template_kwargs, Mapping):
        raise ChatFormatError("chat_template_kwargs must be an object", "chat_template_kwargs")
    if len(template_kwargs) > MAX_TEMPLATE_KWARGS:
        raise ChatFormatError(
            f"chat_template_kwargs holds at most {MAX_TEMPLATE_KWARGS} names, got {len(template_kwargs)}",
            "chat_template_kwargs",
        )
    for name in template_kwargs:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            shown = repr(name)[:40]
            raise ChatFormatError(
                f"chat_template_kwargs: {shown} is not a template variable name", "chat_template_kwargs"
            )
        if name in RESERVED_NAMES:
            raise ChatFormatError(
                f"chat_template_kwargs: {name!r} is set by the server, not by a request "
                f"(use the request's own field where there is one)",
                "chat_template_kwargs",
            )
    return dict(template_kwargs)


def tag_final_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with ``CONTINUE_TAG`` appended to the last one's text content (a copy);
    ChatFormatError when there is no text to continue."""
    if not messages:
        raise ChatFormatError("continue_final_message needs a message to continue", "messages")
    last = messages[-1]
    content = last.get("content") if isinstance(last, dict) else None
    if not isinstance(content, str):
        raise ChatFormatError(
            "continue_final_message: the last message has no text content to continue", "messages"
        )
    return [*messages[:-1], {**last, "content": content + CONTINUE_TAG}]


def continue_at(rendered: str) -> int:
    """Where a conversation rendered with its last content tagged is cut: before the tag, and before the
    whitespace in front of it when the template trimmed the tag's trailing space; ChatFormatError when
    the template dropped the tag (it rewrites the last message, which then cannot be continued)."""
    at = rendered.rfind(CONTINUE_TAG.strip())
    if at < 0:
        raise ChatFormatError(
            "continue_final_message: this model's chat template does not write the last message's "
            "content, so it cannot be continued",
            "messages",
        )
    if rendered.startswith(CONTINUE_TAG, at):
        return at
    return len(rendered[:at].rstrip())
