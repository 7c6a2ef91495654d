"""``kvtier serve`` end to end on the real default model: the official ``openai`` client and raw HTTP
against a server on a loopback port (uvicorn on a thread of this process, the model loaded once)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from kvtier import LLM, SamplingParams
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.serve import BackgroundServer, serve_in_thread

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# One torch thread: this machine's two cores are shared by the engine, the event loop and the test client.
ENGINE = dict(kv_device_blocks=256, max_num_seqs=16, num_threads=1)
LONG_SYSTEM = " ".join(
    f"Rule {i}: answer briefly, cite the cache tier, and never repeat the question." for i in range(12)
)


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    threads = torch.get_num_threads()
    srv = serve_in_thread(create_app(lambda: LLM(**ENGINE).engine, ServerSettings(model_name=MODEL)))
    srv.wait_ready()
    yield srv
    srv.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(server: BackgroundServer) -> LLM:
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def scrape(server: BackgroundServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(server.url + "/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def engine_idle_check(server: BackgroundServer) -> tuple[float, bool]:
    """Block-pool integrity (raises), device usage and whether requests remain, read on the engine thread."""

    def check(engine) -> tuple[float, bool]:  # noqa: ANN001
        engine.kv.check_integrity()
        return engine.kv.usage(), engine.has_unfinished_requests()

    return server.app.state.engine.call_sync(check)


def test_health_models_metrics(server: BackgroundServer, client: OpenAI) -> None:
    health = httpx.get(server.url + "/health").json()
    assert health == {"status": "ok", "num_requests_running": 0, "num_requests_waiting": 0}
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.model_extra["max_model_len"] == 4096
    assert ("kvtier:num_requests_running", ()) in scrape(server)


def test_chat_greedy_equals_offline_generate(client: OpenAI, reference: LLM) -> None:
    messages = [{"role": "user", "content": "Name three primary colors."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    ref = reference.chat(messages, SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref.outputs[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


PREFILL = [
    {"role": "user", "content": "Name a colour as JSON."},
    {"role": "assistant", "content": '{"colour": "'},
]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def test_a_prefill_continues_the_last_message(
    client: OpenAI, server: BackgroundServer, reference: LLM, hf_default_tokenizer: Any
) -> None:
    """vLLM's continue_final_message: the answer continues the open assistant message. The greedy
    tokens are those of the prompt transformers renders with continue_final_message, offline and served,
    whole and streamed; /tokenize counts that prompt; both flags true is a 400 naming the field."""
    text = hf_default_tokenizer.apply_chat_template(PREFILL, tokenize=False, continue_final_message=True)
    ids = hf_default_tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    want = reference.generate({"prompt_token_ids": ids}, params)[0].outputs[0].text
    offline = reference.chat(PREFILL, params, add_generation_prompt=False, continue_final_message=True)[0]
    assert offline.prompt_token_ids == ids and offline.outputs[0].text == want
    kw: dict[str, Any] = dict(model=MODEL, messages=PREFILL, max_tokens=12, temperature=0)
    r = client.chat.completions.create(**kw, extra_body=CONTINUE)
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(**kw, extra_body=CONTINUE, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    closed = client.chat.completions.create(**kw)  # the default closes the message and opens another
    assert closed.usage.prompt_tokens > len(ids)
    counted = httpx.post(server.url + "/tokenize", json={"messages": PREFILL, **CONTINUE}).json()
    assert counted["tokens"] == ids
    both = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": PREFILL, "max_tokens": 2, "continue_final_message": True},
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    bad = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": PREFILL, "max_tokens": 2, "chat_template_kwargs": {"eos_token": "x"}},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_completions_greedy_equals_offline_generate(client: OpenAI, reference: LLM) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    ref = reference.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10))
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0)
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in ref]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in ref)
    stream = client.completions.create(
        model=MODEL, prompt=prompts[0], max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == ref[0].outputs[0].text
    ids = reference.tokenizer.encode(prompts[1])
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert r.choices[0].text == ref[1].outputs[0].text


def test_penalties_reach_the_sampler(client: OpenAI, reference: LLM) -> None:
    """OpenAI's presence / frequency penalties and vLLM's repetition_penalty: the server's answer is
    the offline engine's with the same SamplingParams, and they change a greedy answer."""
    prompt = "List the days of the week: Monday, Tuesday, Monday, Tuesday,"
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.4}
    plain = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text
    ref = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, **penalties))
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        extra_body={"repetition_penalty": 1.4},
    )
    assert r.choices[0].text == ref[0].outputs[0].text != plain
    days = reference.tokenizer.encode(" Wednesday Thursday", add_special_tokens=False)
    vocabulary = {"bad_words": ["Monday"], "allowed_token_ids": [*days, *reference.tokenizer.encode(",")]}
    ref = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, **vocabulary))
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=vocabulary
    )
    assert r.choices[0].text == ref[0].outputs[0].text != plain and "Monday" not in r.choices[0].text


def test_echo_returns_the_prompt_and_its_logprobs(
    client: OpenAI, server: BackgroundServer, reference: LLM
) -> None:
    """``echo``: the text is prompt + completion; with ``logprobs`` every prompt token is listed, the
    first with null logprob and alternatives, the others with the offline engine's prompt logprobs;
    offsets run over the whole text. The loglikelihood request of lm-evaluation-harness's
    ``local-completions`` (context + continuation, max_tokens 1, logprobs 1, echo) then scores the
    continuation as the engine does."""
    context, continuation = "The capital of France is", " Paris"
    ids = reference.tokenizer.encode(context + continuation)
    ref = reference.generate(
        [context + continuation], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    )
    want = ref[0].prompt_logprobs
    r = client.completions.create(
        model=MODEL, prompt=context + continuation, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    choice = r.choices[0]
    assert choice.text == context + continuation + ref[0].outputs[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx([e.logprob for e in want[1:]], abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens[: len(ids)]) == context + continuation
    ctx_len = len(reference.tokenizer.encode(context))
    score = sum(lp.token_logprobs[ctx_len : len(ids)])  # lm-eval: token_logprobs[ctxlen:-1]
    assert score == pytest.approx(sum(e.logprob for e in want[ctx_len:]), abs=1e-3) and score < 0
    plain = client.completions.create(model=MODEL, prompt=context, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(context) and plain.choices[0].logprobs is None
    body = {"model": MODEL, "prompt": context, "max_tokens": 3, "temperature": 0, "echo": True}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts[0] == context and "".join(texts) == plain.choices[0].text  # the prompt, then the rest
    # lm-eval's tokenized batch: token-id prompts, one choice each, in prompt order
    other = reference.tokenizer.encode("Caches keep what was computed")
    batch = client.completions.create(
        model=MODEL, prompt=[ids, other], max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert [len(c.logprobs.tokens) for c in batch.choices] == [len(ids) + 1, len(other) + 1]
    assert batch.choices[0].logprobs.token_logprobs[:-1] == pytest.approx(lp.token_logprobs[:-1], abs=1e-4)
    # max_tokens 0 with echo: the prompt alone, scored (a prompt-scoring client's request)
    scored = client.completions.create(
        model=MODEL, prompt=context + continuation, max_tokens=0, logprobs=1, echo=True
    )
    assert scored.choices[0].text == context + continuation and scored.choices[0].finish_reason == "length"
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(ids)]
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    body = {**body, "max_tokens": 0, "logprobs": 1, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == context and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_tokenize_counts_what_a_completion_reports(client: OpenAI, server: BackgroundServer) -> None:
    """/tokenize of a prompt or of messages counts the usage.prompt_tokens the same request reports;
    /detokenize gives the text back; bad bodies are OpenAI-shaped 400s, another model a 404."""
    text = "Caches keep what was computed."
    done = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0)
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert r["count"] == len(r["tokens"]) == done.usage.prompt_tokens and r["max_model_len"] > 0
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    r = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    assert r["count"] == chat.usage.prompt_tokens
    for path, body, status, param in (
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": messages}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/detokenize", {"tokens": [1, -3]}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1] * (r["max_model_len"] + 1)}, 400, "tokens"),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
    ):
        bad = httpx.post(server.url + path, json=body)
        assert bad.status_code == status and bad.json()["error"]["param"] == param, (path, body, bad.text)


def test_structured_output_follows_the_schema(client: OpenAI, server: BackgroundServer) -> None:
    """response_format json_schema / json_object and vLLM's guided_choice / guided_regex: the answer
    parses and matches; streamed too; a grammar that does not compile is a 400 naming response_format."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "Describe a person named Ada, aged 36, as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, temperature=0, response_format=fmt
    )
    person = json.loads(r.choices[0].message.content)
    assert (
        set(person) == {"name", "age"} and isinstance(person["name"], str) and isinstance(person["age"], int)
    )
    short = [{"role": "user", "content": "Reply with a JSON object with one key, ok, set to true."}]
    stream = client.chat.completions.create(
        model=MODEL, messages=short, max_tokens=100, temperature=0,
        response_format={"type": "json_object"}, stream=True,
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    assert chunks[-1].choices[0].finish_reason == "stop"  # closed by the grammar, not cut by max_tokens
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), dict)
    r = client.completions.create(
        model=MODEL, prompt="Is water wet? Answer:", max_tokens=5, temperature=0,
        extra_body={"guided_choice": [" yes", " no"]},
    )  # fmt: skip
    assert r.choices[0].text in (" yes", " no")
    r = client.completions.create(
        model=MODEL, prompt="Call me at", max_tokens=12, temperature=1.0, seed=7,
        extra_body={"guided_regex": r" \d{3}-\d{4}"},
    )  # fmt: skip
    assert re.fullmatch(r" \d{3}-\d{4}", r.choices[0].text)
    bad = httpx.post(
        server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "guided_regex": "("}, timeout=30
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"


def test_raw_sse_stream(server: BackgroundServer, reference: LLM) -> None:
    """The wire format itself: each event is ``data: `` and one JSON chunk; the chunks carry the
    greedy text and one finish reason, then the usage chunk, then ``data: [DONE]`` once."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    ref = reference.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0]

    request_id = chunks[0]["id"]
    assert request_id.startswith("cmpl-")
    assert all((c["id"], c["object"], c["model"]) == (request_id, "text_completion", MODEL) for c in chunks)
    *content, last = chunks
    assert content and all([ch["index"] for ch in c["choices"]] == [0] for c in content)
    assert "".join(c["choices"][0]["text"] for c in content) == ref.text != ""
    finishes = [c["choices"][0]["finish_reason"] for c in content if c["choices"][0]["finish_reason"]]
    assert finishes == [ref.finish_reason] == ["length"]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == len(ref.token_ids) == 4


def test_n_and_seed_reproducible(client: OpenAI) -> None:
    kw = dict(model=MODEL, max_tokens=8, temperature=1.0, n=3, seed=1234)
    messages = [{"role": "user", "content": "Tell me a story."}]
    a = client.chat.completions.create(messages=messages, **kw)
    b = client.chat.completions.create(messages=messages, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert 3 <= a.usage.completion_tokens <= 3 * 8
    texts = ["", "", ""]
    for chunk in client.chat.completions.create(messages=messages, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in a.choices]
    other = client.chat.completions.create(messages=messages, **{**kw, "seed": 99})
    assert [c.message.content for c in other.choices] != [c.message.content for c in a.choices]


def test_stop_strings(client: OpenAI) -> None:
    prompt = "The capital of France is"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    words = base.split()
    assert len(words) >= 3, base
    stop = words[2]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == base[: base.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == base[: base.index(stop)]


def test_logprobs(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "Say yes."}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-5)
    r = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=5, temperature=0, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0


def test_logprobs_name_tokens_by_id_when_asked(client: OpenAI, reference: LLM) -> None:
    """vLLM's return_tokens_as_token_ids: every token (chosen and alternatives) as "token_id:N", N the
    id the offline engine samples, on chat and on completions."""
    prompt = "One, two,"
    ids = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].token_ids
    by_id = {"return_tokens_as_token_ids": True}
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, extra_body=by_id
    )
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)
    messages = [{"role": "user", "content": "Say yes."}]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        extra_body=by_id,
    )
    for entry in chat.choices[0].logprobs.content:
        assert entry.token.startswith("token_id:") and entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].token == entry.token  # greedy: the top alternative is the choice


def test_a_prompt_is_cut_to_its_last_tokens_when_asked(client: OpenAI, reference: LLM) -> None:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens run (usage counts k), and the answer is
    the offline engine's on those tokens; chat cuts the rendered conversation."""
    prompt = "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday,"
    tail = reference.tokenizer.encode(prompt)[-6:]
    ref = reference.generate([{"prompt_token_ids": tail}], SamplingParams(temperature=0.0, max_tokens=6))
    cut = {"truncate_prompt_tokens": 6}
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body=cut)
    assert r.usage.prompt_tokens == 6 and r.choices[0].text == ref[0].outputs[0].text
    messages = [{"role": "user", "content": "Name the days of the week, please, in order."}]
    rendered = reference.tokenizer.encode_chat(messages)[1]
    ref = reference.generate(
        [{"prompt_token_ids": rendered[-9:]}], SamplingParams(temperature=0.0, max_tokens=5)
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, extra_body={"truncate_prompt_tokens": 9}
    )
    assert chat.usage.prompt_tokens == 9 and chat.choices[0].message.content == ref[0].outputs[0].text
    for bad in (0, -2):
        refused = httpx.post(
            f"{client.base_url}completions",
            json={"model": MODEL, "prompt": prompt, "truncate_prompt_tokens": bad},
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncate_prompt_tokens"


def test_shared_prefix_reports_cached_tokens_and_salt_isolates(
    server: BackgroundServer, client: OpenAI
) -> None:
    before = scrape(server)

    def ask(question: str, **extra) -> object:  # noqa: ANN003
        messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}]
        return client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, temperature=0, extra_body=extra or None
        ).usage

    ask("What is a cache?")
    second = ask("What is a tier?")
    assert second.prompt_tokens > 150
    cached = second.prompt_tokens_details.cached_tokens
    assert cached >= 128, second
    by_tier = second.model_extra["kvtier"]["cached_tokens_by_tier"]
    assert set(by_tier) >= {"device", "host", "disk"} and sum(by_tier.values()) == cached
    assert ask("What is a tier?", cache_salt="tenant-b").prompt_tokens_details.cached_tokens == 0
    after = scrape(server)
    key = ("kvtier:prefix_cache_hits_total", ())
    assert after[key] - before[key] >= cached
    assert after[("kvtier:tier_hit_tokens_total", (("tier", "device"),))] >= cached


def test_metrics_move_with_traffic(server: BackgroundServer, client: OpenAI) -> None:
    before = scrape(server)
    r = client.completions.create(
        model=MODEL,
        prompt="Counting: one two three",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = scrape(server)

    def delta(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert delta("kvtier:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("kvtier:generation_tokens_total") == 6
    assert delta("kvtier:prefix_cache_queries_total") >= r.usage.prompt_tokens - 1
    for hist in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta(f"kvtier:{hist}_seconds_count") == 1
        assert delta(f"kvtier:{hist}_seconds_sum") > 0 or hist == "request_queue_time"
    assert delta("kvtier:inter_token_latency_seconds_count") == 5
    assert delta("kvtier:request_success_total", (("finished_reason", "length"),)) == 1
    assert after[("kvtier:num_requests_running", ())] == 0
    for tier in ("device", "host", "disk"):
        assert ("kvtier:tier_usage_perc", (("tier", tier),)) in after
        assert ("kvtier:tier_bytes_loaded_total", (("tier", tier),)) in after
    assert after[("kvtier:tier_capacity_blocks", (("tier", "device"),))] == 256


def test_bad_requests_are_400_and_do_not_disturb_others(server: BackgroundServer) -> None:
    url = server.url + "/v1/completions"
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60) as stream:
        too_long = httpx.post(url, json={"model": MODEL, "prompt": [300] * 5000, "max_tokens": 4})
        assert too_long.status_code == 400
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        out_of_vocab = httpx.post(url, json={"model": MODEL, "prompt": [10**9], "max_tokens": 4})
        assert out_of_vocab.status_code == 400 and out_of_vocab.json()["error"]["param"] == "prompt"
        empty = httpx.post(url, json={"model": MODEL, "prompt": "", "max_tokens": 4})
        assert empty.status_code == 400
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "thinking_token_budget": 8}
        unparsed = httpx.post(server.url + "/v1/chat/completions", json=chat)  # no --reasoning-parser here
        assert unparsed.status_code == 400 and unparsed.json()["error"]["param"] == "thinking_token_budget"
        lines = [line for line in stream.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    assert engine_idle_check(server) == (0.0, False)


IDLE_DEADLINE = 60.0  # seconds: an aborted request is gone within a step or two, even on a busy machine


def _wait_until_idle(server: BackgroundServer) -> None:
    t0 = time.monotonic()
    while scrape(server)[("kvtier:num_requests_running", ())] != 0:
        assert time.monotonic() - t0 < IDLE_DEADLINE, "the request is still running"
        time.sleep(0.02)


def _num_finished(server: BackgroundServer, reason: str) -> float:
    return scrape(server).get(("kvtier:request_success_total", (("finished_reason", reason),)), 0.0)


def test_client_disconnect_aborts_the_request(server: BackgroundServer) -> None:
    """A client that goes away mid-request gets its request aborted: it ends as "abort", not by running
    out its 3000 tokens, and its blocks are freed."""
    body = {
        "model": MODEL,
        "prompt": "Write a very long essay about memory hierarchies.",
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    aborted, ran_out = _num_finished(server, "abort"), _num_finished(server, "length")
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # keep a reference: a closed line iterator closes the connection
        got = 0
        for line in lines:
            got += line.startswith("data: {")
            if got >= 3:
                break
        running = scrape(server)
        assert running[("kvtier:num_requests_running", ())] == 1
        assert running[("kvtier:kv_cache_usage_perc", ())] > 0
    _wait_until_idle(server)
    assert engine_idle_check(server) == (0.0, False)
    assert (_num_finished(server, "abort"), _num_finished(server, "length")) == (aborted + 1, ran_out)

    # A non-streaming request whose client gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    _wait_until_idle(server)
    assert engine_idle_check(server) == (0.0, False)
    assert (_num_finished(server, "abort"), _num_finished(server, "length")) == (aborted + 2, ran_out)


def test_host_tier_hits_show_in_usage_and_metrics() -> None:
    """A small device pool over a host tier: a prefix evicted from the device comes back from host memory,
    and the usage and the per-tier series say so."""
    engine = dict(kv_device_blocks=24, kv_host_gb=0.05, max_num_seqs=4, num_threads=1)
    srv = serve_in_thread(create_app(lambda: LLM(**engine).engine, ServerSettings(model_name=MODEL)))
    try:
        srv.wait_ready()
        doc = " ".join(f"Fact {i}: blocks move between tiers." for i in range(25))

        def ask(prompt: str) -> dict:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
            return httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["usage"]

        ask(doc + " Q1")
        assert ask(doc + " Q2")["kvtier"]["cached_tokens_by_tier"]["device"] >= 240
        before = scrape(srv)
        for i in range(3):  # other documents push the first one out of the 24 device blocks
            ask(" ".join(f"Other {i} {j} words to evict." for j in range(25)))
        usage = ask(doc + " Q3")
        from_host = usage["kvtier"]["cached_tokens_by_tier"]["host"]
        assert from_host >= 240 and usage["prompt_tokens_details"]["cached_tokens"] >= from_host
        after = scrape(srv)
        host = (("tier", "host"),)
        assert (
            after[("kvtier:tier_hit_tokens_total", host)] - before[("kvtier:tier_hit_tokens_total", host)]
            >= 240
        )
        for name in ("tier_bytes_loaded_total", "tier_bytes_stored_total", "tier_blocks_evicted_total"):
            tier = host if "evicted" not in name else (("tier", "device"),)
            assert after[(f"kvtier:{name}", tier)] > before[(f"kvtier:{name}", tier)], name
        assert after[("kvtier:tier_usage_perc", host)] > 0
        assert engine_idle_check(srv) == (0.0, False)
    finally:
        srv.stop()
