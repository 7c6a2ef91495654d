"""A request's prompt: the forms ``add_request`` accepts, turned into token ids and checked.

    "text"                                   tokenized
    [id, id, ...]                            as given
    {"prompt_token_ids": [...], "prompt"?}   as given (the text, if any, kept for the output)
    {"prompt": "text"}                       tokenized

Torch-free; every refusal is a ``ConfigError`` naming what is wrong (the server turns it into a 400).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

from kvtier.config import ConfigError
from kvtier.tokenizer import Tokenizer

PromptType = str | list[int] | Mapping[str, Any]


def prompt_token_ids(prompt: PromptType, tokenizer: Tokenizer) -> tuple[str | None, list[int]]:
    """The prompt's text (None when given as ids) and its token ids."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt and isinstance(prompt["prompt"], str):
            return prompt["prompt"], tokenizer.encode(prompt["prompt"])
        raise ConfigError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
    if isinstance(prompt, Seq) and not isinstance(prompt, bytes | bytearray):
        return None, list(prompt)
    kind = type(prompt).__name__
    raise ConfigError(f"a prompt must be a string, a list of token ids or a dict, got {kind}")


def check_prompt(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Not empty, every id in the vocabulary (the first bad one named), room left for output."""
    if not token_ids:
        raise ConfigError("the prompt is empty")
    if not set(map(type, token_ids)) <= {int} or min(token_ids) < 0 or max(token_ids) >= vocab_size:
        # the fast test above runs in C; the slow one names the first bad token
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ConfigError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ConfigError(
            f"the prompt has {len(token_ids)} tokens; max_model_len is {max_model_len}, "
            "which leaves no room for output"
        )
