"""A fast tokenizer: the ``tokenizers`` library directly, never ``transformers`` (its import costs seconds).

``Tokenizer.from_dir`` reads an HF-style directory (``tokenizer.json`` + ``tokenizer_config.json``, optionally
``chat_template.jinja``). Chat templates render in a sandboxed jinja2 environment set up the way
``transformers`` sets up its own, so prompts match ``apply_chat_template(..., tokenize=False)`` byte for byte.
The template is, first found: the one given (``--chat-template FILE``, vLLM's flag), the model's own, the
documented default of its family (``DEFAULT_CHAT_TEMPLATES``: Gemma 3's turns, Qwen3's ChatML; none for
llama, whose checkpoints carry their own), else none: chat is then an error naming the flag.
``IncrementalDetokenizer`` turns streamed token ids into text deltas without ever cutting a UTF-8 character.

Chat messages are data, not markup: ``encode_chat`` tokenizes what the template itself wrote with its
special tokens parsed, and each message's content as plain text, so ``<|im_end|>`` written by a user stays
the characters ``<``, ``|``, ``im``... (as llama.cpp treats user text); a role must be one the template
knows (``chat_roles``: system, user, assistant, and tool when the template mentions it).

Tools (``encode_chat(..., tools=)``, :mod:`kvtier.tools`): a template that renders tools itself gets them as
``tools=`` and the messages' ``tool_calls`` and ``tool`` turns as transformers passes them (``tool_support``
says which parts it renders, found by probe renderings); every other part is written in the generic
format. A tool's or a call's field that spells a special token is refused when the template renders it.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from functools import cached_property, lru_cache, partial
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Backend

from kvtier.chat_format import ChatFormatError, check_template_args, continue_at, tag_final_message
from kvtier.config import ConfigError
from kvtier.hf_config import read_json
from kvtier.tools import (
    Tool,
    ToolError,
    ToolSupport,
    normalize_messages,
    prepare_chat,
    probe_tool_support,
    uses_tools,
)

_REPLACEMENT_CHAR = "\ufffd"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
CHAT_ROLES = ("system", "user", "assistant")
CHAT_TEMPLATE_FLAG = "--chat-template"
NO_TEMPLATE_MESSAGE = (
    f"this model has no chat template: give one with {CHAT_TEMPLATE_FLAG} FILE (LLM(chat_template=...)), "
    "or send a plain prompt instead of chat messages"
)

# Gemma 3's turns (its instruction-tuned checkpoints' template): a system message is folded into the
# first user turn, the assistant is "model", roles must alternate, contents are trimmed; a content may
# be a list of parts ({"type": "text", "text": ...}; an image part writes <start_of_image>).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{{ raise_exception('Invalid content type') }}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
# Qwen3's ChatML (its template without tools and reasoning traces); enable_thinking=False writes the
# empty thought block Qwen3's own template writes then.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{ '<think>\n\n</think>\n\n' }}"
    "{%- endif -%}"
    "{%- endif -%}"
)
# By config.json's model_type (the GGUF converter writes Gemma 3's as transformers does, gemma3_text).
DEFAULT_CHAT_TEMPLATES = {
    "gemma3_text": GEMMA3_CHAT_TEMPLATE,
    "gemma3": GEMMA3_CHAT_TEMPLATE,
    "qwen3": QWEN3_CHAT_TEMPLATE,
}


def _token_content(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` spells it: a string, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _find_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """The default chat template: ``tokenizer_config.json``, else ``chat_template.jinja`` / ``.json``."""
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if isinstance(template, str) and template:
        return template
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = path / "chat_template.json"
    if json_file.is_file():
        value = read_json(json_file).get("chat_template")
        return value if isinstance(value, str) else None
    return None


def _family_template(path: Path) -> str | None:
    """The documented chat template of the model ``path/config.json`` describes (by its ``model_type``)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        return None
    try:
        model_type = read_json(config_file).get("model_type")
    except ConfigError:  # a broken config.json: the model loader says so
        return None
    return DEFAULT_CHAT_TEMPLATES.get(model_type) if isinstance(model_type, str) else None


_RELEASE_GIL_CHARS = 2048


def _encode(backend: _Backend, text: str, add_special_tokens: bool) -> list[int]:
    """``backend.encode(...).ids``; a long text through ``encode_batch``, which lets go of the GIL while it
    works (``encode`` does not: tokenizing a long prompt on a worker thread would stall the event loop)."""
    if len(text) < _RELEASE_GIL_CHARS:
        return backend.encode(text, add_special_tokens=add_special_tokens).ids
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


class Tokenizer:
    """Encode / decode / chat-template rendering for one model.

    Attributes: ``vocab_size`` (ids the tokenizer knows, added tokens included), ``bos_token_id``,
    ``eos_token_ids`` (every id that ends a generation), ``add_bos`` (``encode`` prepends BOS), and
    ``chat_template`` (jinja source, or None).
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        special_tokens: dict[str, str] | None = None,
        add_bos: bool | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = backend.token_to_id(bos) if bos is not None else None
        eos = self.special_tokens.get("eos_token")
        eos_ids = [backend.token_to_id(eos)] if eos is not None else []
        eos_ids += list(extra_eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos_ids if i is not None))
        self._post_processor_adds_bos = self._detect_post_processor_bos()
        self.add_bos: bool = self._post_processor_adds_bos if add_bos is None else bool(add_bos)

    @classmethod
    def from_dir(
        cls,
        path: Path,
        *,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> Tokenizer:
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``chat_template.jinja``) from ``path``.

        ``chat_template`` (the source given by the user) replaces the model's own; without either, the
        default of the family ``path/config.json`` names applies (``DEFAULT_CHAT_TEMPLATES``)."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ConfigError(f"no tokenizer.json in {path} (kvtier needs a fast tokenizer file)")
        try:
            backend = _Backend.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a bare Exception on malformed files
            raise ConfigError(f"cannot read {tokenizer_file}: {exc}") from exc
        config_file = path / "tokenizer_config.json"
        config = read_json(config_file) if config_file.is_file() else {}
        specials = {key: tok for key in _SPECIAL_TOKEN_KEYS if (tok := _token_content(config.get(key)))}
        add_bos = config.get("add_bos_token")
        return cls(
            backend,
            special_tokens=specials,
            add_bos=add_bos if isinstance(add_bos, bool) else None,
            chat_template=chat_template or _find_chat_template(path, config) or _family_template(path),
            extra_eos_token_ids=extra_eos_token_ids,
        )

    @property
    def backend(self) -> _Backend:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    def _detect_post_processor_bos(self) -> bool:
        """Whether ``tokenizer.json``'s post-processor already prepends BOS."""
        if self.bos_token_id is None:
            return False
        with_special = self._backend.encode("a", add_special_tokens=True).ids
        without = self._backend.encode("a", add_special_tokens=False).ids
        return with_special[:1] == [self.bos_token_id] and without[:1] != [self.bos_token_id]

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary token, or None."""
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` BOS is prepended when the model wants it."""
        ids = _encode(self._backend, text, add_special_tokens)
        if not add_special_tokens or self.bos_token_id is None:
            return ids
        if self.add_bos and not self._post_processor_adds_bos:
            return [self.bos_token_id, *ids]
        if not self.add_bos and self._post_processor_adds_bos and ids[:1] == [self.bos_token_id]:
            return ids[1:]
        return ids

    # -------------------------------------------------------------------------- text, not markup
    @cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token stands for: a text of ``c`` characters has at least
        ``c / max_token_chars`` tokens (the cheap length check before tokenizing a huge prompt)."""
        return max((len(k) for k in self._backend.get_vocab(with_added_tokens=True)), default=1)

    @cached_property
    def _special_texts(self) -> tuple[str, ...]:
        added = self._backend.get_added_tokens_decoder().values()
        return tuple(t.content for t in added if t.special and t.content)

    @cached_property
    def _text_backend(self) -> _Backend:
        """A copy of the backend that never parses special tokens out of its input."""
        clone = _Backend.from_str(self._backend.to_str())
        clone.encode_special_tokens = True
        return clone

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special token recognized in it (and none added)."""
        return _encode(self._text_backend, text, False)

    def has_special_text(self, text: str) -> bool:
        """Whether ``text`` spells out one of the tokenizer's special tokens."""
        return any(special in text for special in self._special_texts)

    @cached_property
    def chat_roles(self) -> frozenset[str]:
        """The roles a chat message may have: system, user, assistant, and tool if the template has it."""
        roles = set(CHAT_ROLES)
        if self.chat_template is not None and re.search(r"""['"]tool['"]""", self.chat_template):
            roles.add("tool")
        return frozenset(roles)

    @cached_property
    def tool_support(self) -> ToolSupport:
        """Which tool parts the chat template renders itself (the rest take the generic format)."""
        if self.chat_template is None:
            return ToolSupport()
        template = _compile_template(self.chat_template)

        def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
            return template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=False,
                **self.special_tokens,
            )

        support = probe_tool_support(render)
        return replace(support, results=support.results and "tool" in self.chat_roles)

    def _tool_chat(
        self, messages: list[dict[str, Any]], tools: list[Tool] | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and template tools of a conversation with tools (:func:`kvtier.tools.prepare_chat`);
        ConfigError when a part the template renders itself spells a special token."""
        if not isinstance(messages, list | tuple) or not uses_tools(list(messages), tools):
            return messages, None
        chat, template_tools = prepare_chat(normalize_messages(list(messages)), tools, self.tool_support)
        extras = [{k: v for k, v in m.items() if k not in ("role", "content")} for m in chat]
        for param, parts in (("tools", template_tools), ("messages", extras)):
            if self.has_special_text(json.dumps(parts, ensure_ascii=False, default=str)):
                raise ToolError(
                    f"{param}: a tool or a tool call spells a special token, and this model's chat template "
                    "writes it as markup: remove the special token",
                    param,
                )
        return chat, template_tools

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        encode: Callable[[str], list[int]] | None = None,
        *,
        tools: list[Tool] | None = None,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """The rendered conversation and its token ids, message contents tokenized as plain text.

        No BOS is added (the template writes the special tokens it wants); ``encode`` may stand in for
        ``encode(text, add_special_tokens=False)`` (the router's cached pieces). When a content spells a
        special token, the contents' exact places in the text are found by rendering the conversation
        again with a marker for each content; a template that changes contents (so they cannot be found)
        is refused then (``ConfigError``) rather than let the text through as markup. ``tools`` and the
        messages' tool parts are rendered as the module's docstring says; ``continue_final_message``
        leaves the last message open and ``template_kwargs`` are more template variables
        (:mod:`kvtier.chat_format`; ``ChatFormatError`` names the bad one)."""
        variables = check_template_args(add_generation_prompt, continue_final_message, template_kwargs)
        if self.has_special_text(json.dumps(variables, ensure_ascii=False, default=str)):
            raise ChatFormatError(
                "chat_template_kwargs: a value spells a special token, and the chat template writes it as "
                "markup: remove the special token",
                "chat_template_kwargs",
            )
        self._check_reasoning(messages)
        messages, template_tools = self._tool_chat(messages, tools)
        if continue_final_message:
            messages = tag_final_message(list(messages))
        render = partial(
            self.apply_chat_template,
            add_generation_prompt=add_generation_prompt,
            tools=template_tools,
            **variables,
        )
        text = render(messages)
        end = continue_at(text) if continue_final_message else len(text)
        contents = [m.get("content") for m in messages if isinstance(m, dict)]
        if not any(isinstance(c, str) and self.has_special_text(c) for c in contents):
            text = text[:end]
            return text, encode(text) if encode is not None else self.encode(text, add_special_tokens=False)
        spans = self._content_spans(messages, render, text)
        if spans is None:
            raise ConfigError(
                "a message content spells a special token, and this model's chat template rewrites "
                "contents, so it cannot be kept as plain text: remove the special token"
            )
        ids: list[int] = []
        pos = 0
        for start, stop in spans:
            start, stop = min(start, end), min(stop, end)
            ids += self.encode(text[pos:start], add_special_tokens=False)
            ids += self.encode_text(text[start:stop])
            pos = stop
        ids += self.encode(text[pos:end], add_special_tokens=False)
        return text[:end], ids

    def _check_reasoning(self, messages: Any) -> None:
        """ConfigError when a message's reasoning spells a special token (a template writes it as markup)."""
        for m in messages if isinstance(messages, list | tuple) else ():
            reasoning = [str(m.get(k) or "") for k in REASONING_FIELDS] if isinstance(m, dict) else []
            if any(self.has_special_text(text) for text in reasoning):
                raise ConfigError("a message's reasoning spells a special token: remove the special token")

    def _content_spans(
        self, messages: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], str], text: str
    ) -> list[tuple[int, int]] | None:
        """``(start, end)`` of every content's text in ``text`` (``render(messages)``), or None if the
        template changed one."""
        tag = secrets.token_hex(8)
        marked = [
            {**m, "content": f"\x00{tag}:{i}\x00"} if isinstance(m.get("content"), str) else m
            for i, m in enumerate(messages)
        ]
        rendered = render(marked)
        pieces = re.split(f"\x00{tag}:(\\d+)\x00", rendered)  # template text, index, template text, ...
        spans, out, pos = [], [], 0
        for k, piece in enumerate(pieces):
            if k % 2:
                piece = messages[int(piece)]["content"]
                spans.append((pos, pos + len(piece)))
            out.append(piece)
            pos += len(piece)
        return spans if "".join(out) == text else None

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids`` (special tokens dropped unless ``skip_special_tokens`` is False)."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's chat template, exactly as ``transformers`` renders it."""
        if self.chat_template is None:
            raise ConfigError(NO_TEMPLATE_MESSAGE)
        chat = _plain_messages(messages, self.chat_roles)
        import jinja2  # deferred: only chat requests pay for jinja2

        template = _compile_template(self.chat_template)
        try:
            return template.render(
                messages=chat,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **template_kwargs},
            )
        except jinja2.TemplateError as exc:
            raise ConfigError(f"chat template error: {exc}") from exc

    def detokenizer(
        self, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A streaming detokenizer for one sequence's output (``prompt_token_ids`` is kept for reference;
        ``skip_special_tokens`` False writes the special tokens' text too)."""
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)


def _plain_messages(messages: Any, roles: frozenset[str]) -> list[dict[str, Any]]:
    """Copy chat messages into plain dicts, checking each has one of ``roles``."""
    if not isinstance(messages, list | tuple):
        raise ConfigError("chat messages must be a list of {'role': ..., 'content': ...} objects")
    chat: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ConfigError(f"chat message {i} must be an object with a string 'role'")
        if message["role"] not in roles:
            role = message["role"] if len(message["role"]) <= 32 else message["role"][:32] + "..."
            raise ConfigError(
                f"chat message {i} has role {role!r}; this model's chat template takes "
                + ", ".join(sorted(roles))
            )
        chat.append(_aliased_reasoning(dict(message)))
    return chat


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names for it


def _aliased_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning under every name a template reads (``reasoning_content``, and ``thinking`` for
    gpt-oss's), as transformers fills them."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def check_chat_template(source: str) -> None:
    """ConfigError (naming ``--chat-template``) when a user's chat template does not compile."""
    try:
        _compile_template(source)
    except ConfigError as exc:
        raise ConfigError(f"{CHAT_TEMPLATE_FLAG}: {exc}") from None


@lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    """Compile a chat template in the sandboxed environment ``transformers`` uses (same globals/filters)."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (HF tracks assistant spans with it)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ConfigError(f"the model's chat template does not compile: {exc}") from exc


class IncrementalDetokenizer:
    """Streams one sequence's output text.

    Each ``step`` returns only new text. A delta never ends in a half-decoded multi-byte character: while the
    tail decodes to U+FFFD it is held back. ``"".join(deltas) + flush()`` equals ``decode(all output ids)``.
    Only a short window of ids is decoded per step (``prefix_offset``..end): a step's cost does not grow
    with the output's length.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] were decoded and emitted already
        self._read_offset = 0
        self.text = ""  # everything emitted so far

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add ``new_token_ids``; return the text they complete (may be "" while a character is partial)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a sequence: the held-back tail (e.g. a character the model never finished)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset)
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self.text += delta
        return delta
