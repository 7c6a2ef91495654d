"""A reasoning model's thinking apart from its answer (``--reasoning-parser``, vLLM's flag).

The split is checked on the text (both parsers, every way a stream can cut it) and end to end: the real
default model is held by a regex to write a ``<think>`` block before its answer, and the served chat
returns that block as ``reasoning_content``, streamed or not, with tool calls parsed from the answer
alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier import LLM, SamplingParams
from kvtier.config import ConfigError
from kvtier.reasoning import AnswerStream, ReasoningSplitter, split_reasoning
from kvtier.sampling_params import FREE_ANSWER, StructuredOutputs
from kvtier.server.app import ServerSettings
from kvtier.server.serve import BackgroundServer
from kvtier.tokenizer import Tokenizer
from kvtier.tools import call_grammar, parse_tool_choice, parse_tools
from kvtier.worker.structured import Grammars
from tests.served import served_llm

MODEL = "SmolLM2-135M-Instruct"
CASES = [
    # parser, output, reasoning, content
    ("qwen3", "<think>\nWhy blue?\n</think>\n\nBlue.", "\nWhy blue?\n", "Blue."),
    ("qwen3", "Blue.", None, "Blue."),
    ("qwen3", "  <think></think>Blue.", "", "Blue."),
    ("qwen3", "<think>\nWhy", "\nWhy", ""),  # cut by max_tokens while thinking
    ("qwen3", "<thin", None, "<thin"),  # looked like a tag, was not
    ("qwen3", "<b>Blue</b> </think>", None, "<b>Blue</b> </think>"),  # no opening: all answer
    ("qwen3", "   ", None, "   "),
    ("deepseek_r1", "Why blue?\n</think>\n\nBlue.", "Why blue?\n", "Blue."),
    ("deepseek_r1", "<think>Why</think>Blue.", "Why", "Blue."),
    ("deepseek_r1", "Why blue", "Why blue", ""),
    ("deepseek_r1", "Why </thin", "Why </thin", ""),  # a partial closing tag at the end is reasoning
    ("deepseek_r1", "Why</think>\n\n", "Why", ""),
]


@pytest.mark.parametrize(("parser", "output", "reasoning", "content"), CASES)
def test_the_split_of_a_whole_output(parser: str, output: str, reasoning: str | None, content: str) -> None:
    assert split_reasoning(parser, output) == (reasoning, content)


@pytest.mark.parametrize(("parser", "output", "reasoning", "content"), CASES)
def test_every_way_a_stream_cuts_the_text_joins_to_the_same_split(
    parser: str, output: str, reasoning: str | None, content: str
) -> None:
    """Cut once anywhere, twice anywhere, and one character at a time: the deltas join to the whole
    split (a tag cut between deltas is held until it is whole, never sent in halves)."""
    cuts = [[i] for i in range(len(output) + 1)]
    cuts += [[i, j] for i in range(len(output) + 1) for j in range(i, len(output) + 1)]
    cuts.append(list(range(len(output) + 1)))
    for points in cuts:
        bounds = [0, *points, len(output)]
        splitter = ReasoningSplitter(parser)
        got_reasoning, got_content = "", ""
        for a, b in zip(bounds, bounds[1:], strict=False):
            part = splitter.feed(output[a:b])
            got_reasoning, got_content = got_reasoning + part.reasoning, got_content + part.content
            if reasoning is not None:  # the closing tag is taken out, never sent as text
                assert "</think>" not in part.reasoning + part.content
        rest = splitter.finish()
        got_reasoning, got_content = got_reasoning + rest.reasoning, got_content + rest.content
        assert (splitter.reasoning, got_content) == (reasoning, content), points
        assert got_reasoning == (reasoning or ""), points


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        ReasoningSplitter("granite")


def test_a_call_inside_the_thought_is_reasoning_and_the_answers_call_is_parsed() -> None:
    """Every API's answer splits the reasoning off before it looks for calls."""
    call = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    stream = AnswerStream(frozenset({"get_weather"}), "qwen3")
    events = stream.feed(f"<think>{call}</think>\n\n{call}") + stream.finish()
    assert [e.kind for e in events if e.kind != "arguments"] == ["reasoning", "call"]
    assert events[0].text == call and events[1].name == "get_weather"


# ----------------------------------------------------------------------- a constraint after the thought
JSON_A = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
KINDS = {  # a constraint and an answer it takes
    "json": ({"json": JSON_A}, '{"a": 3}'),
    "regex": ({"regex": r"[A-Z][a-z]+\."}, "Blue."),
    "choice": ({"choice": ["yes", "no"]}, "yes"),
    "forced call": (
        {"grammar": "CALL"},
        '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
    ),
}
THOUGHTS = [  # a text before the answer, and whether qwen3 / deepseek_r1 take it
    ("", True, False),  # deepseek_r1's prompt opened a thought: the output must close it
    ("<think>\nhm </thin {}\n</think>\n\n", True, True),
    ("  <think>x</think> ", True, True),
    ("why</think>", False, True),
    ("<think>why", False, False),  # never closed: no answer yet
]


@pytest.fixture(scope="module")
def grammars(tiny_tokenizer_dir: Path) -> tuple[Grammars, Tokenizer]:
    tok = Tokenizer.from_dir(tiny_tokenizer_dir)
    return Grammars(tok.backend, tok.vocab_size, tok.eos_token_ids), tok


def spec_of(kind: str, reasoning: str | None = None) -> StructuredOutputs:
    fields = dict(KINDS[kind][0])
    if fields.get("grammar") == "CALL":
        tools = parse_tools([WEATHER])
        fields["grammar"] = call_grammar(tools, parse_tool_choice("required", tools, True))
    return StructuredOutputs(**fields, reasoning=reasoning)


@pytest.mark.parametrize("kind", KINDS)
def test_the_constraint_holds_the_answer_after_the_thought(
    grammars: tuple[Grammars, Tokenizer], kind: str
) -> None:
    """With a parser the grammar lets the model's think block come first, as the parser reads it (qwen3:
    if the model opens one; deepseek_r1: the prompt opened it), then holds the answer; without one, the
    output is the answer alone."""
    g, tok = grammars
    answer = KINDS[kind][1]

    def takes(spec: StructuredOutputs, text: str) -> bool:
        matcher = g.compile(spec).matcher.deep_copy()
        ids = tok.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    for thought, qwen3, deepseek_r1 in THOUGHTS:
        assert takes(spec_of(kind, "qwen3"), thought + answer) is qwen3, thought
        assert takes(spec_of(kind, "deepseek_r1"), thought + answer) is deepseek_r1, thought
    assert takes(spec_of(kind), answer) and not takes(spec_of(kind), "<think>x</think>" + answer)


@pytest.mark.parametrize(("parser", "opening"), [("qwen3", "<think>"), ("deepseek_r1", "")])
@pytest.mark.parametrize("budget", [0, 1, 5])
def test_a_spent_thinking_budget_forces_the_closing_tag(
    grammars: tuple[Grammars, Tokenizer], parser: str, opening: str, budget: int
) -> None:
    """A model that would think forever (it always picks "a" when it may) writes its budget's tokens of
    thought; then the mask holds only the closing tag's tokens, and after it the answer's grammar."""
    g, tok = grammars
    a = tok.encode("a", add_special_tokens=False)[0]
    params = SamplingParams(structured_outputs=StructuredOutputs(json=JSON_A), thinking_token_budget=budget)
    params.reason_first(parser)
    seq = f"think-{parser}-{budget}"
    output: list[int] = []
    for token in tok.encode(opening, add_special_tokens=False):  # the model opens its thought
        assert g.allowed(seq, params, tok.vocab_size)[token]
        g.consume(seq, token)
        output.append(token)
    while "</think>" not in tok.decode(output):
        allowed = g.allowed(seq, params, tok.vocab_size)
        token = a if allowed[a] else int(allowed.nonzero()[0])
        assert allowed[a] or int(allowed.sum()) == 1  # free, or the tag forced
        g.consume(seq, token)
        output.append(token)
    assert tok.decode(output) == f"{opening}{'a' * budget}</think>"
    assert not g.allowed(seq, params, tok.vocab_size)[a]  # the answer: JSON, no more thought
    g.release(seq)


def test_reason_first_puts_the_parser_on_the_constraint() -> None:
    held = SamplingParams(structured_outputs=StructuredOutputs(regex="x"))
    held.reason_first("qwen3")
    assert held.structured_outputs == StructuredOutputs(regex="x", reasoning="qwen3")
    assert held.structured_outputs.key != StructuredOutputs(regex="x").key  # compiled apart
    held.reason_first("deepseek_r1")  # said once: kept
    assert held.structured_outputs.reasoning == "qwen3"
    free = SamplingParams(thinking_token_budget=8)
    free.reason_first("deepseek_r1")  # a budget alone: any answer, the thought counted
    assert free.structured_outputs == StructuredOutputs(grammar=FREE_ANSWER, reasoning="deepseek_r1")
    plain = SamplingParams()
    plain.reason_first("qwen3")
    assert plain.structured_outputs is None  # nothing to hold: no grammar at all
    with pytest.raises(ConfigError, match="thinking_token_budget needs a reasoning parser"):
        SamplingParams(thinking_token_budget=8).reason_first(None)
    with pytest.raises(ConfigError, match="thinking_token_budget must be >= 0"):
        SamplingParams(thinking_token_budget=-1)
    with pytest.raises(ConfigError, match="qwen3, deepseek_r1"):
        StructuredOutputs(regex="x", reasoning="granite")


@pytest.mark.slow
def test_story_a_reasoning_model_thinks_within_its_budget_then_answers_in_json() -> None:
    """The real model, its thought opened by the prompt (DeepSeek-R1's way), thinks in its own words
    for the budget, then answers with the object the schema asks for; the engine refuses a budget that
    no parser can count."""
    llm = LLM(kv_device_blocks=128, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=64, thinking_token_budget=12)
    params.structured_outputs = StructuredOutputs(json=JSON_A)
    params.reason_first("deepseek_r1")
    out = llm.chat([{"role": "user", "content": "Pick a number a. Think first."}], params)[0].outputs[0]
    reasoning, content = split_reasoning("deepseek_r1", out.text)
    assert reasoning is not None and 8 <= len(llm.tokenizer.encode(reasoning, add_special_tokens=False)) <= 14
    assert out.finish_reason == "stop" and isinstance(json.loads(content)["a"], int)
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=64, thinking_token_budget=4)
    sampled.structured_outputs = StructuredOutputs(json=JSON_A)
    sampled.reason_first("deepseek_r1")  # each fork counts its own thought
    for fork in llm.chat([{"role": "user", "content": "Pick a number a."}], sampled)[0].outputs:
        thought, answer = split_reasoning("deepseek_r1", fork.text)
        assert thought is not None and len(llm.tokenizer.encode(thought, add_special_tokens=False)) <= 6
        assert fork.finish_reason == "stop" and isinstance(json.loads(answer)["a"], int)
    unparsed = SamplingParams(max_tokens=8, thinking_token_budget=12)
    with pytest.raises(ConfigError, match="reasoning parser"):
        llm.generate("Hi", unparsed)


# ------------------------------------------------------------------------------------- served
ANSWER = r"[A-Z][a-z ]{2,40}\."
BUDGET = 6


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    with served_llm(ServerSettings(model_name=MODEL, reasoning_parser="qwen3")) as srv:
        yield srv


def chat(server: BackgroundServer, **body: object) -> httpx.Response:
    messages = [{"role": "user", "content": "What colour is the sky? Think first."}]
    payload = {"messages": messages, "max_tokens": 48, "temperature": 0, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=120)


def thinking(server: BackgroundServer) -> dict[str, object]:
    """The fields that make the small model think: it is pushed to write ``<`` then ``think`` (the tag's
    tokens; a thought of ``<`` follows), and its budget closes the thought."""
    lt, think = (
        httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
        for text in ("<", "think")
    )
    return {
        "logit_bias": {str(lt["tokens"][0]): 100, str(think["tokens"][0]): 50},
        "thinking_token_budget": BUDGET,
    }


def streamed(response: httpx.Response) -> tuple[str, str, str]:
    """The reasoning, content and finish reason a chat stream's chunks join to."""
    reasoning, content, finish = "", "", ""
    for line in response.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:])["choices"]:
            reasoning += choice["delta"].get("reasoning_content") or ""
            content += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
    return reasoning, content, finish


@pytest.mark.slow
def test_a_served_think_block_comes_back_as_reasoning(server: BackgroundServer) -> None:
    """The model writes a think block, spends its budget in it, and answers held to the regex: the two
    come back apart, the same pieces whole and streamed."""
    whole = chat(server, guided_regex=ANSWER, **thinking(server)).json()["choices"][0]
    reasoning, content = whole["message"]["reasoning_content"], whole["message"]["content"]
    assert reasoning == "<" * BUDGET  # the budget's tokens, then the closing tag was forced
    assert re.fullmatch(ANSWER, content) and whole["finish_reason"] == "stop"
    stream = chat(server, guided_regex=ANSWER, stream=True, **thinking(server))
    assert streamed(stream) == (reasoning, content, "stop")
    plain = chat(server).json()["choices"][0]["message"]  # no think block written: all answer
    assert plain["reasoning_content"] is None and plain["content"]


@pytest.mark.slow
def test_a_forced_call_comes_after_the_thought(server: BackgroundServer) -> None:
    """tool_choice required holds the answer to a call, not the thought before it."""
    no_args = {"type": "object", "additionalProperties": False}  # "{}": no string for the push to fill
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": no_args}}]
    body = dict(tools=tools, tool_choice="required", parallel_tool_calls=False, **thinking(server))
    called = chat(server, **body).json()["choices"][0]
    assert called["message"]["reasoning_content"] == "<" * BUDGET
    assert [c["function"]["name"] for c in called["message"]["tool_calls"]] == ["get_weather"]
    assert called["finish_reason"] == "tool_calls"
