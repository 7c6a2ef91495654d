"""The router tokenizes a returning chat from cached pieces (kvtier/router/tokens.py): the ids must be
exactly the tokenizer's own, turn after turn, and only the new messages may be tokenized again."""

from __future__ import annotations

import json
import random

from tokenizers import Tokenizer as Backend

from kvtier.router.prompt import load_tokenizer, parse_prompt
from kvtier.router.tokens import PieceEncoder
from kvtier.tokenizer import Tokenizer

CHAT = "/v1/chat/completions"


def test_story_a_growing_conversation_is_tokenized_exactly_and_only_its_new_messages(
    converted_default_model,  # noqa: ANN001 (the conversion cache the router's tokenizer comes from)
) -> None:
    tokenizer, _ = load_tokenizer(None)
    encoder = PieceEncoder(tokenizer)
    assert encoder.enabled  # SmolLM2: byte-level BPE, added tokens that strip nothing
    messages = [{"role": "system", "content": "You answer in one line.\n\nBe  kind. 12345"}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question {turn}: what is block {turn * 7}? 🙂 é"})
        body = {"messages": messages}
        misses = encoder.misses
        fast = parse_prompt(tokenizer, CHAT, body, encoder=encoder)
        whole = parse_prompt(tokenizer, CHAT, body)
        assert fast is not None and whole is not None and fast.token_ids == whole.token_ids
        if turn:  # the new user message and the assistant header: the rest came from the cache
            assert encoder.misses - misses <= 2, encoder.misses - misses
        messages.append({"role": "assistant", "content": f"Block {turn * 7} holds 16 tokens.  "})


def test_any_text_with_added_tokens_anywhere_is_the_tokenizers_own(converted_default_model) -> None:  # noqa: ANN001
    tokenizer, _ = load_tokenizer(None)
    encoder = PieceEncoder(tokenizer, max_cached_tokens=64)  # a tiny cache: evictions happen too
    rng = random.Random(0)
    alphabet = [*"ab c\n\t 12345 é中🙂<|>_imstartend", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "  "]
    for _ in range(1500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 50)))
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False), repr(text)
    assert encoder.cached_tokens <= 64


def test_a_tokenizer_whose_pieces_are_not_independent_is_encoded_whole(tiny_tokenizer_dir) -> None:  # noqa: ANN001
    """A normalizer, a Metaspace pre-tokenizer or an added token that strips its neighbours' spaces can
    reach across an added token: such a tokenizer is never split into pieces."""
    spec = json.loads((tiny_tokenizer_dir / "tokenizer.json").read_text())
    assert PieceEncoder(Tokenizer(Backend.from_str(json.dumps(spec)))).enabled
    stripping = {**spec, "added_tokens": [{**t, "lstrip": True} for t in spec["added_tokens"]]}
    metaspace = {
        **spec,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"},
    }
    normalized = {**spec, "normalizer": {"type": "NFC"}}
    for variant in (stripping, metaspace, normalized):
        tokenizer = Tokenizer(Backend.from_str(json.dumps(variant)))
        encoder = PieceEncoder(tokenizer)
        assert not encoder.enabled
        text = "<|im_start|>user\n  hi there<|im_end|>\n"
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False)


def test_a_chat_with_tools_is_tokenized_as_the_replica_renders_it(converted_default_model) -> None:  # noqa: ANN001
    """The router hashes what the replica computes: the tools block and the calls included."""
    from kvtier.tools import parse_tools

    tokenizer, _ = load_tokenizer(None)
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    routed = parse_prompt(tokenizer, CHAT, {"messages": messages, "tools": tools})
    plain = parse_prompt(tokenizer, CHAT, {"messages": messages})
    _, replica = tokenizer.encode_chat(messages, add_generation_prompt=True, tools=parse_tools(tools))
    assert routed is not None and plain is not None
    assert routed.token_ids == replica and len(plain.token_ids) < len(replica)
