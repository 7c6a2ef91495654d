"""A reasoning model's thinking apart from its answer (``--reasoning-parser``, vLLM's flag).

The split is checked on the text (both parsers, every way a stream can cut it) and end to end: the real
default model is held by a regex to write a ``<think>`` block before its answer, and the served chat
returns that block as ``reasoning_content``, streamed or not, with tool calls parsed from the answer
alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import torch

from kvtier import LLM
from kvtier.reasoning import ReasoningSplitter, split_reasoning
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.serve import BackgroundServer, serve_in_thread

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


# ------------------------------------------------------------------------------------- served
THINK_THEN_ANSWER = r"<think>[a-z ]{3,30}</think>\n\n[A-Za-z ]{3,30}\."


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    threads = torch.get_num_threads()
    settings = ServerSettings(model_name=MODEL, reasoning_parser="qwen3")
    engine = dict(kv_device_blocks=256, max_num_seqs=8, num_threads=1)
    srv = serve_in_thread(create_app(lambda: LLM(**engine).engine, settings))
    srv.wait_ready()
    yield srv
    srv.stop()
    torch.set_num_threads(threads)


def chat(server: BackgroundServer, **body: object) -> httpx.Response:
    messages = [{"role": "user", "content": "What colour is the sky? Think first."}]
    payload = {"messages": messages, "max_tokens": 48, "temperature": 0, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=120)


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
    """The model, held to write a think block then an answer, gets them back apart: the same pieces
    whole and streamed, and they join to the raw text the completion holds without a parser."""
    whole = chat(server, guided_regex=THINK_THEN_ANSWER).json()["choices"][0]
    reasoning, content = whole["message"]["reasoning_content"], whole["message"]["content"]
    assert reasoning and content and "<think>" not in reasoning + content
    assert f"<think>{reasoning}</think>\n\n{content}" == whole_raw(server)
    assert streamed(chat(server, guided_regex=THINK_THEN_ANSWER, stream=True)) == (
        reasoning,
        content,
        whole["finish_reason"],
    )
    plain = chat(server).json()["choices"][0]["message"]  # no think block written: all answer
    assert plain["reasoning_content"] is None and plain["content"]


def whole_raw(server: BackgroundServer) -> str:
    """The same request's raw text, through the completions route (no parser there)."""
    tokens = httpx.post(
        server.url + "/tokenize",
        json={"messages": [{"role": "user", "content": "What colour is the sky? Think first."}]},
    ).json()["tokens"]
    body = {"prompt": tokens, "max_tokens": 48, "temperature": 0, "guided_regex": THINK_THEN_ANSWER}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]


@pytest.mark.slow
def test_tool_calls_are_parsed_from_the_answer_alone(server: BackgroundServer) -> None:
    """A call written inside the thinking is reasoning, not a call; the answer's call is parsed."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    inside = r'<think><tool_call>\{"name": "get_weather", "arguments": \{\}\}</tool_call></think>\n\nNo\.'
    answer = chat(server, tools=tools, guided_regex=inside).json()["choices"][0]
    assert "tool_calls" not in answer["message"] and answer["message"]["content"] == "No."
    assert "<tool_call>" in answer["message"]["reasoning_content"]
    after = r'<think>ok</think>\n\n<tool_call>\{"name": "get_weather", "arguments": \{\}\}</tool_call>'
    called = chat(server, tools=tools, guided_regex=after).json()["choices"][0]
    assert called["message"]["reasoning_content"] == "ok"
    assert [c["function"]["name"] for c in called["message"]["tool_calls"]] == ["get_weather"]
    assert called["finish_reason"] == "tool_calls"
