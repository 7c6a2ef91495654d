"""Structured output: the engine's answer matches a JSON schema, a regex or a choice, token by token
(llguidance masks each step's logits), greedy and sampled, with n > 1 forks; bad specs are one line."""

from __future__ import annotations

import json
import re

import pytest

from kvtier import LLM, SamplingParams
from kvtier.config import ConfigError
from kvtier.sampling_params import StructuredOutputs

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_threads=1)


def test_story_a_schema_turns_prose_into_the_json_asked_for(llm: LLM) -> None:
    """Unconstrained, the model answers in prose; with the schema, greedily, it answers the object."""
    prompt = llm.render_chat([{"role": "user", "content": "Tell me about a person named Ada, aged 36."}])
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    with pytest.raises(ValueError):
        json.loads(plain.text)
    spec = StructuredOutputs(json=PERSON)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec))[0]
    person = json.loads(out.outputs[0].text)
    assert out.outputs[0].finish_reason == "stop" and set(person) == {"name", "age"}
    assert isinstance(person["age"], int)


def test_choices_and_regexes_hold_when_sampling_with_forks(llm: LLM) -> None:
    choice = StructuredOutputs(choice=["red", "green", "blue"])
    params = SamplingParams(temperature=1.5, n=4, seed=11, max_tokens=6, structured_outputs=choice)
    outs = llm.generate(["My favourite colour is "], params)[0].outputs
    assert len(outs) == 4 and all(o.text in ("red", "green", "blue") for o in outs)
    phone = StructuredOutputs(regex=r"\d{3}-\d{4}")
    params = SamplingParams(temperature=1.2, n=3, seed=5, max_tokens=12, structured_outputs=phone)
    assert all(re.fullmatch(r"\d{3}-\d{4}", o.text) for o in llm.generate(["Phone: "], params)[0].outputs)


def test_bad_specs_are_one_line_and_queue_nothing(llm: LLM) -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ConfigError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    for spec in (
        StructuredOutputs(regex="("),
        StructuredOutputs(json='{"type": "object"'),
        StructuredOutputs(grammar="start: x y"),
    ):
        with pytest.raises(ConfigError, match="structured output"):
            llm.engine.add_request("x", SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished_requests()


def test_compiled_grammars_are_kept_for_the_recent_specs_only(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.worker import structured

    grammars = llm.engine.sampler.grammars
    monkeypatch.setattr(structured, "MAX_GRAMMARS", 3)
    specs = [StructuredOutputs(regex=f"a{{{i}}}") for i in range(1, 6)]
    for spec in specs:
        grammars.compile(spec)
    assert list(grammars._grammars) == [s.key for s in specs[-3:]]


def test_bad_words_are_never_written_and_allowed_ids_are_all_there_is(llm: LLM) -> None:
    """vLLM's two vocabulary controls on the real model: a word the greedy answer writes is avoided (as
    written and after a space), the answer unchanged before it; allowed_token_ids makes a classifier."""
    prompt = llm.render_chat([{"role": "user", "content": "What colour is the sky?"}])
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert " blue" in plain.text
    avoided = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, bad_words=["blue"]))[
        0
    ].outputs[0]
    assert "blue" not in avoided.text.lower().replace("blueprint", "")
    before = plain.text[: plain.text.index(" blue")]
    assert avoided.text.startswith(before)  # the same greedy answer up to the word
    yes, no = (llm.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("Yes", "No"))
    classify = SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=[yes, no])
    assert plain.token_ids[0] not in (yes, no)  # left alone, the model starts otherwise
    assert llm.generate([prompt], classify)[0].outputs[0].token_ids[0] in (yes, no)
    with pytest.raises(ConfigError, match="allowed_token_ids: token id"):
        llm.engine.add_request("x", SamplingParams(allowed_token_ids=[10**7]))
