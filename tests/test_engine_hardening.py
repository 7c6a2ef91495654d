"""The engine's hardening on a tiny random checkpoint: a bad row fails alone, and grammars compile off
the engine thread, bounded in size and time, once per spec.

- Sampling values are finite and in range (a ConfigError naming the parameter).
- A request whose row cannot be sampled (forged parameters that bypassed validation, NaN logits, or
  NaN K/V served from the host tier) ends with finish_reason "error" and its message; every other
  request in the same steps gets exactly the tokens it gets alone; NaN K/V quarantines the host tier.
- Over the async bridge that error reaches the failed request's stream only (``RequestFailed``).
- A spec over a size limit is a ConfigError naming the limit (a 100k-deep JSON too, not RecursionError);
  n = 16 compiles a spec once; a running stream keeps streaming while a slow grammar compiles.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.config import ConfigError, EngineArgs
from kvtier.engine import LLMEngine
from kvtier.kv.hashing import extend_block_hashes, root_hash
from kvtier.sampling_params import StructuredOutputs
from kvtier.server.async_engine import AsyncEngine, RequestFailed
from kvtier.stats import Medium
from kvtier.worker import structured

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
PROMPTS = [[3 + (i * 37 + j * 11) % 500 for j in range(5 + 9 * i)] for i in range(3)]
BLOCK_BYTES = 8192  # the tiny model: 2 layers x 16 tokens x K,V x 2 heads x 16 x float32


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Any) -> str:
    return str(tiny_llama_dir())


def forged(**values: Any) -> SamplingParams:
    """Parameters past validation, as a caller that skipped ``validate`` could hand them over."""
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    params.validate = lambda: None  # type: ignore[method-assign]
    for name, value in values.items():
        setattr(params, name, value)
    return params


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    """Add every request, step until all are done; the final output of each, by request id."""
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p, params in requests]
    finals: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return {rid: finals[rid] for rid in ids}


# ------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("temperature", 1e300),
        ("temperature", 1e5),
        ("temperature", float("inf")),
        ("top_p", float("nan")),
        ("min_p", -0.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -1e300),
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 0.001),
        ("repetition_penalty", 11.0),
        ("max_tokens", 2**70),
        ("top_k", 2**64),
    ],
)
def test_sampling_values_out_of_range_name_the_parameter(name: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"^{name} "):
        SamplingParams(**{name: value})
    with pytest.raises(ConfigError, match="^logit_bias "):
        SamplingParams(logit_bias={5: 1e300})


def test_tiny_temperatures_are_greedy_and_the_edges_are_accepted() -> None:
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-5).greedy
    SamplingParams(temperature=1e4, repetition_penalty=0.01, presence_penalty=-2, logit_bias={1: -100})


# ------------------------------------------------------------------------------- a bad row fails alone
@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=1e300, min_tokens=3, ignore_eos=False),
        dict(temperature=float("nan")),
        dict(repetition_penalty=1e-300),
        dict(logit_bias={7: 1e300}),
        dict(temperature=1.0, top_k=2.5),
    ],
)
def test_forged_parameters_fail_their_request_alone(tiny: str, bad: dict[str, Any]) -> None:
    llm = LLM(tiny, block_size=4)
    engine = llm.engine
    good = [(PROMPTS[0], GREEDY), (PROMPTS[1], SEEDED), (PROMPTS[2], GREEDY)]
    alone = [o.outputs[0].token_ids for o in run(engine, good).values()]
    mixed = list(run(engine, [*good[:2], (PROMPTS[0], forged(**bad)), good[2]]).values())
    assert [o.outputs[0].token_ids for o in mixed[:2] + mixed[3:]] == alone
    failed = mixed[2]
    assert failed.finished and failed.outputs[0].finish_reason == "error" and failed.error
    assert engine.quarantined() == []  # the parameters' fault, not the cache's
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks() == engine.config.cache.num_device_blocks


def test_nan_logits_from_the_model_fail_that_request_alone(
    tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row the model itself gave NaN (no cached block behind it): an error for that request, with
    n = 3 not forked; the others are exact, nothing is quarantined."""
    llm = LLM(tiny, block_size=4)
    engine = llm.engine
    good = [(PROMPTS[0], GREEDY), (PROMPTS[2], SEEDED)]
    alone = [o.outputs[0].token_ids for o in run(engine, good).values()]
    execute = engine.runner.execute
    victim = PROMPTS[1]

    def poisoned(out: Any) -> Any:
        result = execute(out)
        sampling = [s for s in out.scheduled if s.samples]
        for row, s in enumerate(sampling):
            if s.seq.token_ids[: len(victim)] == victim and s.seq.num_output_tokens == 2:
                with torch.inference_mode():
                    result.logits[row] = float("nan")
        return result

    monkeypatch.setattr(engine.runner, "execute", poisoned)
    n3 = SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True)
    mixed = list(run(engine, [good[0], (victim, n3), good[1]]).values())
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    assert {o.finish_reason for o in mixed[1].outputs} == {"error"} and "not finite" in (mixed[1].error or "")
    assert engine.quarantined() == []
    engine.kv.check_integrity()


def test_nan_kv_from_the_host_tier_fails_the_request_and_quarantines_the_tier(tiny: str) -> None:
    """NaN written into a host-tier block: the request served from it ends with an error, the host
    tier is quarantined, requests in the same steps are exact; the prompt then recomputes exactly."""
    llm = LLM(tiny, kv_device_blocks=16, kv_host_gb=64 * BLOCK_BYTES / 2**30, canary_rate=0.0)
    e = llm.engine
    prompt = [3 + (i * 7) % 400 for i in range(70)]
    fillers = [[5 + (i * 131 + j * 17) % 490 for j in range(100)] for i in range(5)]
    reference = run(e, [(prompt, GREEDY)])
    others = [(PROMPTS[0], GREEDY), (PROMPTS[2], SEEDED)]
    alone = [o.outputs[0].token_ids for o in run(e, others).values()]
    run(e, [(f, GREEDY) for f in fillers])  # push the prompt's blocks down to the host tier
    keys: list[bytes] = []
    extend_block_hashes(keys, prompt, e.kv.block_size, root_hash((e.cache_identity, "")))
    keys = [k for k in keys if e.tiers.host.contains(k)]
    assert keys
    for key in keys:  # the prompt's host blocks go bad
        block = e.mover.host.block(e.tiers.host.host_block_of(key))
        block.view(-1).view(torch.uint8).view(torch.float32).fill_(float("nan"))

    mixed = list(run(e, [others[0], (prompt, GREEDY), others[1]]).values())
    assert mixed[1].cached_tokens_by_tier.get(Medium.HOST, 0) > 0
    assert mixed[1].outputs[0].finish_reason == "error" and "not finite" in (mixed[1].error or "")
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    assert e.quarantined() == [Medium.HOST]
    e.kv.check_integrity()
    assert e.kv.num_free_blocks() == e.config.cache.num_device_blocks
    again = list(run(e, [(prompt, GREEDY)]).values())[0]  # recomputed: nothing loads from host now
    assert again.outputs[0].token_ids == list(reference.values())[0].outputs[0].token_ids
    assert again.cached_tokens_by_tier.get(Medium.HOST, 0) == 0
    llm.close()


# ------------------------------------------------------------------------------- grammars
def test_specs_over_a_limit_are_config_errors_naming_it(tiny: str) -> None:
    llm = LLM(tiny)
    for spec, limit in (
        (StructuredOutputs(json="[" * 100_000), "nests deeper"),
        (StructuredOutputs(json='{"type": "array", "items": ' * 200 + "{}" + "}" * 200), "nests deeper"),
        (StructuredOutputs(choice=[f"c{i}" for i in range(structured.MAX_CHOICES + 1)]), "entries"),
        (StructuredOutputs(choice=["x" * 70_000]), "bytes"),
        (StructuredOutputs(regex="a" * 70_000), "regex is 70000 bytes"),
        (StructuredOutputs(grammar="start: " + '"a" ' * 20_000), "grammar is"),
    ):
        with pytest.raises(ConfigError, match=f"^structured output: .*{limit}"):
            llm.engine.add_request("x", SamplingParams(structured_outputs=spec))
    deep: Any = {}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ConfigError, match="nests deeper"):
        llm.engine.add_request("x", SamplingParams(structured_outputs=StructuredOutputs(json=deep)))
    assert not llm.engine.has_unfinished_requests()


def test_n16_compiles_the_spec_once_and_forks_copy_it(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    compiles: list[str] = []
    text = structured._grammar_text
    monkeypatch.setattr(structured, "_grammar_text", lambda spec: compiles.append(spec.key) or text(spec))
    llm = LLM(tiny)
    choices = [f"option {i}" for i in range(500)]
    params = SamplingParams(
        n=16, temperature=1.0, seed=3, max_tokens=8, structured_outputs=StructuredOutputs(choice=choices)
    )
    out = llm.generate(["pick: "], params)[0]
    assert len(out.outputs) == 16 and all(o.text in choices for o in out.outputs)
    again = llm.generate(["pick again: "], dataclasses.replace(params, seed=4))[0]
    assert all(o.text in choices for o in again.outputs)
    assert len(compiles) == 1


# ------------------------------------------------------------------------------- the async bridge
def _async_engine(tiny: str) -> AsyncEngine:
    return AsyncEngine(lambda: LLMEngine(EngineArgs(model=tiny, max_model_len=256)))


async def _collect(stream: Any) -> tuple[list[float], Any]:
    """Arrival times of the stream's outputs, and its final output."""
    times, last = [], None
    async for out in stream:
        times.append(time.monotonic())
        last = out
    return times, last


def test_a_failed_request_errs_on_its_own_stream_only(tiny: str) -> None:
    async def scenario() -> None:
        engine = _async_engine(tiny)
        engine.start()
        assert await asyncio.to_thread(engine.wait_ready, 120)
        try:
            good = [await engine.add({"prompt_token_ids": p}, GREEDY) for p in PROMPTS]
            bad = await engine.add(
                {"prompt_token_ids": PROMPTS[0]}, forged(temperature=1e300, min_tokens=3, ignore_eos=False)
            )
            results = await asyncio.gather(*(_collect(s) for s in good), return_exceptions=True)
            with pytest.raises(RequestFailed, match="request failed"):
                await _collect(bad)
            assert all(r[1].outputs[0].finish_reason == "length" for r in results)  # type: ignore[index]
            again = await engine.add({"prompt_token_ids": PROMPTS[1]}, GREEDY)
            assert len((await _collect(again))[1].outputs[0].token_ids) == 10
        finally:
            engine.shutdown()

    asyncio.run(scenario())


@pytest.mark.parametrize("slow_s", [1.5, 0.0])
def test_a_stream_keeps_streaming_while_a_big_grammar_compiles(
    tiny: str, monkeypatch: pytest.MonkeyPatch, slow_s: float
) -> None:
    """guided_choice of thousands of entries with n = 16 (its compile slowed by ``slow_s``): the running
    stream's worst gap between outputs stays under 1 s; the grammar request is served too."""
    text = structured._grammar_text

    def slow(spec: StructuredOutputs) -> str:
        time.sleep(slow_s)
        return text(spec)

    monkeypatch.setattr(structured, "_grammar_text", slow)
    choices = [f"choice number {i} of many" for i in range(2500)]
    spec = StructuredOutputs(choice=choices)
    big = SamplingParams(n=16, temperature=1.0, seed=1, max_tokens=40, structured_outputs=spec)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def scenario() -> None:
        engine = _async_engine(tiny)
        engine.start()
        assert await asyncio.to_thread(engine.wait_ready, 120)
        try:
            stream = await engine.add({"prompt_token_ids": PROMPTS[0]}, long)
            await stream.__anext__()
            running = asyncio.ensure_future(_collect(stream))
            t0 = time.monotonic()
            grammar = await engine.add("pick one: ", big)
            times, last = await running
            _, answer = await _collect(grammar)
            assert time.monotonic() - t0 >= slow_s
            points = [t0, *times]
            gaps = [b - a for a, b in zip(points, points[1:], strict=False)]
            assert max(gaps) < 1.0, max(gaps)
            assert len(last.outputs[0].token_ids) == 200
            assert len(answer.outputs) == 16 and all(o.text in choices for o in answer.outputs)
        finally:
            engine.shutdown()

    asyncio.run(scenario())
