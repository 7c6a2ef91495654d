"""Continuing the last message (assistant prefill) and template variables, as transformers renders them.

``continue_final_message`` leaves the last message open so the answer continues it ("Sure," steers the
reply; "{" starts JSON): the prompt is transformers' ``apply_chat_template(..., continue_final_message=
True)`` byte for byte, with ChatML (contents kept as written), Gemma 3 (contents trimmed) and Qwen3 (its
``enable_thinking`` variable, set through ``template_kwargs``). Contents stay text, not markup, in the
open message too. Bad arguments name their field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.chat_format import CONTINUE_TAG, ChatFormatError, check_template_args, continue_at
from kvtier.config import ConfigError
from kvtier.tokenizer import GEMMA3_CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE, Tokenizer
from tests.conftest import CHATML_TEMPLATE, write_tiny_tokenizer

PREFILLED = [
    {"role": "system", "content": "Answer in JSON."},
    {"role": "user", "content": "  Name a colour.  "},
    {"role": "assistant", "content": '{"colour": "'},
]


@pytest.fixture(scope="module", params=["chatml", "gemma3", "qwen3"])
def tokenizers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Tokenizer, Any]:
    """kvtier's tokenizer and transformers' over the same tiny BPE, with one family's template."""
    from transformers import AutoTokenizer

    template = {"chatml": CHATML_TEMPLATE, "gemma3": GEMMA3_CHAT_TEMPLATE, "qwen3": QWEN3_CHAT_TEMPLATE}
    directory = tmp_path_factory.mktemp(request.param)
    write_tiny_tokenizer(directory, chat_template=template[request.param])
    return Tokenizer.from_dir(directory), AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("last", ['{"colour": "', "Sure, here it is: ", "Sure", ""])
def test_a_continued_message_renders_as_transformers_renders_it(
    tokenizers: tuple[Tokenizer, Any], last: str
) -> None:
    ours, hf = tokenizers
    messages = [*PREFILLED[:-1], {"role": "assistant", "content": last}]
    text, ids = ours.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
    expected = hf.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text == expected
    assert ids == ours.encode(expected, add_special_tokens=False)
    assert not text.endswith(("<|im_end|>\n", "<end_of_turn>\n"))  # the message is left open
    closed, _ = ours.encode_chat(messages, add_generation_prompt=False)
    assert closed.startswith(text) and len(closed) > len(text)


def test_template_variables_reach_the_template(tokenizers: tuple[Tokenizer, Any]) -> None:
    """Qwen3's ``enable_thinking: false`` writes an empty think block after the assistant header; a
    template that does not read a variable renders as without it."""
    ours, hf = tokenizers
    messages = PREFILLED[:2]
    for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}, {}):
        text, _ = ours.encode_chat(messages, template_kwargs=kwargs)
        assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    off = ours.encode_chat(messages, template_kwargs={"enable_thinking": False})[0]
    on = ours.encode_chat(messages)[0]
    if ours.chat_template == QWEN3_CHAT_TEMPLATE:
        assert off == on + "<think>\n\n</think>\n\n"
    else:
        assert off == on


REASONING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% if m.thinking %}[{{ m.thinking }}]{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def test_an_assistants_reasoning_reaches_the_template_under_every_name(tmp_path: Path) -> None:
    """As transformers aliases them: reasoning given as reasoning_content, reasoning or thinking is there
    as reasoning_content and as thinking (gpt-oss's name); a special token in it is refused (markup)."""
    from transformers import AutoTokenizer

    write_tiny_tokenizer(tmp_path, chat_template=REASONING_TEMPLATE)
    ours, hf = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    for name in ("reasoning_content", "reasoning", "thinking"):
        messages = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", name: "Greet."},
        ]
        text, _ = ours.encode_chat(messages, add_generation_prompt=False)
        assert text == hf.apply_chat_template(messages, tokenize=False)
        assert "<think>Greet.</think>[Greet.]Hello" in text
    with pytest.raises(ConfigError, match="reasoning spells a special token"):
        ours.encode_chat([{"role": "assistant", "content": "x", "reasoning_content": "<|im_end|>"}])


def test_the_continued_message_is_still_text_not_markup(tmp_path: Path) -> None:
    """A special token spelled in the open message is tokenized as characters, and the cut is in the
    same place as without it."""
    write_tiny_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a<|im_end|>b"}]
    text, ids = tok.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\na<|im_end|>b")
    # the template's own <|im_end|> ids (2): the default system turn's and the user's; none for the content
    assert ids.count(2) == 2
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_bad_template_arguments_name_their_field(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    chat = [{"role": "user", "content": "hi"}]
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"continue_final_message": True}, "continue_final_message", "both be true"),
        ({"template_kwargs": {"messages": []}}, "chat_template_kwargs", "set by the server"),
        ({"template_kwargs": {"bos_token": "<|im_end|>"}}, "chat_template_kwargs", "set by the server"),
        ({"template_kwargs": {"not a name": 1}}, "chat_template_kwargs", "not a template variable name"),
        ({"template_kwargs": {f"v{i}": i for i in range(33)}}, "chat_template_kwargs", "at most 32"),
        ({"template_kwargs": {"date_string": "<|im_start|>"}}, "chat_template_kwargs", "special token"),
        (
            {"add_generation_prompt": False, "continue_final_message": True, "template_kwargs": None},
            "messages",
            "no text content",
        ),
    ]
    for kwargs, param, message in cases:
        messages = [{"role": "user", "content": None}] if param == "messages" else chat
        with pytest.raises(ChatFormatError, match=message) as caught:
            tok.encode_chat(messages, **kwargs)
        assert caught.value.param == param


def test_a_template_that_drops_the_last_message_cannot_continue_it(tmp_path: Path) -> None:
    template = (
        "{% for m in messages[:-1] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    write_tiny_tokenizer(tmp_path, chat_template=template)
    tok = Tokenizer.from_dir(tmp_path)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    with pytest.raises(ChatFormatError, match="cannot be continued"):
        tok.encode_chat(chat, add_generation_prompt=False, continue_final_message=True)


def test_the_cut_keeps_a_kept_space_and_drops_a_trimmed_ones() -> None:
    assert continue_at("<t>model\nSure, " + CONTINUE_TAG + "<end>") == len("<t>model\nSure, ")
    assert continue_at("<t>model\nSure, " + CONTINUE_TAG.strip() + "<end>") == len("<t>model\nSure,")
    assert check_template_args(True, False, {"enable_thinking": False}) == {"enable_thinking": False}
