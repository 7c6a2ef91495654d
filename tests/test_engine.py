"""The engine end to end on a tiny random checkpoint: batching, chunked prefill, preemption, prefix
caching, n > 1, sampling options, stop conditions, abort and bad input.

The rule under test everywhere: caching, batching and preemption never change a greedy answer.
"""

from __future__ import annotations

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.config import ConfigError
from kvtier.stats import Medium

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(3, vocab, (21,), generator=gen).tolist()
    out = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 3, 15, 16, 17, 33, 60)]
    out += [shared + torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (2, 9, 30)]
    return out


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_dir):
    return str(tiny_llama_dir(num_heads=4, num_kv_heads=2, hidden_size=64))


def make(tiny_dir: str, **kwargs) -> LLM:
    kwargs.setdefault("block_size", 4)
    return LLM(tiny_dir, **kwargs)


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def check_pool_idle(llm: LLM) -> None:
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks() == llm.engine.config.cache.num_device_blocks
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def reference(tiny_dir) -> list[list[int]]:
    """Greedy outputs of HF transformers, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos
    vocab = hf.config.vocab_size
    refs = []
    for p in prompts(vocab):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=12,
                do_sample=False,
                pad_token_id=0,
            )
        refs.append(out[0, len(p) :].tolist())
    return refs


def test_one_at_a_time_matches_transformers(tiny_dir, reference) -> None:
    llm = make(tiny_dir, enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    got = [token_ids(llm.generate([p], GREEDY))[0] for p in prompts(vocab)]
    assert got == reference
    check_pool_idle(llm)


def test_batched_with_small_chunks_matches(tiny_dir, reference) -> None:
    llm = make(tiny_dir, max_num_batched_tokens=7, enable_prefix_caching=False)
    outs = llm.generate(prompts(llm.engine.model_config.vocab_size), GREEDY)
    assert token_ids(outs) == reference
    check_pool_idle(llm)


def test_token_budget_of_two_splits_prompts_into_single_token_chunks(tiny_dir, reference) -> None:
    # a decode plus a 1-token chunk from the middle of a prompt: only the decode yields logits
    llm = make(tiny_dir, max_num_batched_tokens=2, enable_prefix_caching=False)
    outs = llm.generate(prompts(llm.engine.model_config.vocab_size), GREEDY)
    assert token_ids(outs) == reference
    check_pool_idle(llm)


def test_tiny_pool_preempts_and_still_matches(tiny_dir, reference) -> None:
    # 28 blocks of 4 tokens: the longest sequence (60 + 12) fits alone, the batch does not.
    llm = make(tiny_dir, kv_device_blocks=28, max_model_len=100, enable_prefix_caching=False)
    outs = llm.generate(prompts(llm.engine.model_config.vocab_size), GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert token_ids(outs) == reference
    check_pool_idle(llm)


def test_prefix_cache_hits_and_matches(tiny_dir, reference) -> None:
    llm = make(tiny_dir, max_num_batched_tokens=16)
    ps = prompts(llm.engine.model_config.vocab_size)
    first = llm.generate(ps, GREEDY)
    again = llm.generate(ps, GREEDY)
    assert token_ids(first) == reference
    assert token_ids(again) == reference
    # a second pass finds every full block of each prompt except the one holding its last token
    assert [o.num_cached_tokens for o in again] == [((len(p) - 1) // 4) * 4 for p in ps]
    # ... yet the cache held every full block, that one too: a prompt of whole blocks is all held
    held = [len(p) if len(p) % 4 == 0 else ((len(p) - 1) // 4) * 4 for p in ps]
    assert [o.num_prompt_tokens_in_cache for o in again] == held and any(len(p) % 4 == 0 for p in ps)
    assert [o.num_prompt_tokens_in_cache for o in first] == [o.num_cached_tokens for o in first]
    assert sum(o.num_cached_tokens for o in first) > 0  # the shared 21-token prefix
    assert llm.engine.kv.stats.prefix_cache_hits > 0
    check_pool_idle(llm)


def test_a_prompt_of_whole_blocks_back_from_the_host_tier_was_all_in_the_cache(tiny_dir) -> None:
    """Pushed down to the host tier and sent again, a 64-token prompt (16 blocks of 4) loads 15 blocks
    and computes the last again for the logits: the cache held all 64 tokens."""
    llm = make(tiny_dir, kv_device_blocks=24, kv_host_gb=64 * 2048 / 2**30)
    prompt = [3 + (i * 7) % 400 for i in range(64)]
    first = llm.generate([prompt], GREEDY)[0]
    llm.generate([[5 + (i * 131) % 490 for i in range(80)]], GREEDY)  # evicts the prompt's blocks
    again = llm.generate([prompt], GREEDY)[0]
    assert again.cached_tokens_by_tier.get(Medium.HOST, 0) > 0
    assert (again.num_cached_tokens, again.num_prompt_tokens_in_cache) == (60, 64)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.close()


def test_cache_salt_isolates_tenants(tiny_dir) -> None:
    llm = make(tiny_dir)
    p = prompts(llm.engine.model_config.vocab_size)[5]
    llm.generate([p], GREEDY, cache_salt="alice")
    assert llm.generate([p], GREEDY, cache_salt="bob")[0].num_cached_tokens == 0
    assert llm.generate([p], GREEDY, cache_salt="alice")[0].num_cached_tokens == 32


def test_seeded_sampling_ignores_batch_composition(tiny_dir) -> None:
    llm = make(tiny_dir)
    ps = prompts(llm.engine.model_config.vocab_size)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    alone = token_ids(llm.generate([ps[4]], seeded))[0]
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batch = llm.generate([ps[0], ps[4], ps[6]], [others, seeded, others])
    assert token_ids(batch)[1] == alone
    assert (
        token_ids(
            llm.generate([ps[4]], SamplingParams(temperature=0.9, seed=99, max_tokens=10, ignore_eos=True))
        )[0]
        != alone
    )


def test_n_shares_prompt_blocks_with_copy_on_write(tiny_dir) -> None:
    llm = make(tiny_dir, enable_prefix_caching=False)
    p = prompts(llm.engine.model_config.vocab_size)[5]  # 33 tokens: the last block is partial
    single = llm.generate([p], GREEDY)[0]
    many = llm.generate([p], SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert [o.index for o in many.outputs] == [0, 1, 2]
    assert [o.token_ids for o in many.outputs] == [single.outputs[0].token_ids] * 3
    check_pool_idle(llm)
    seeded = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    outs = llm.generate([p], seeded)[0].outputs
    assert (
        outs[0].token_ids
        == llm.generate([p], SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_copy_on_write_copies_the_shared_partial_block(tiny_dir) -> None:
    """33 prompt tokens: block 8 holds token 32 in slot 0 and is shared by parent and child after the
    fork. Both decode the same (greedy) token into slot 1 of that block: the second writer must get a
    copy *before* the forward, or its attention reads an empty slot 0."""
    llm = make(tiny_dir, enable_prefix_caching=False)
    p = prompts(llm.engine.model_config.vocab_size)[5]
    engine = llm.engine
    kv_cache = engine.runner.kv_cache
    engine.add_request(p, SamplingParams(n=2, temperature=0.0, max_tokens=3, ignore_eos=True))
    engine.step()  # prefill + fork
    out = engine.scheduler.schedule()
    assert len(out.block_copies) == 1  # the second writer of the partial block got its own copy
    src, dst = out.block_copies[0]
    assert [s.block_tables[0][8] for s in out.decodes] in ([src, dst], [dst, src])
    assert not torch.equal(kv_cache[dst, :, :1], kv_cache[src, :, :1])  # nothing copied yet
    logits = engine.runner.execute(out).logits
    # Slot 0 (the shared token 32) was copied; slot 1 (the new token 33) each wrote the same KV.
    assert torch.equal(kv_cache[dst, :, :2], kv_cache[src, :, :2])
    # Both rows attended to the same context, so both saw the same logits.
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)
    engine.scheduler.advance(out)
    while engine.has_unfinished_requests():
        engine.abort_request(next(iter(engine.requests)))
    check_pool_idle(llm)


def test_seeded_n2_children_each_match_an_unforked_run_of_their_tokens(tiny_dir) -> None:
    """Two seeded children sample different continuations from one forked prompt (33 tokens, the
    last block shared and then copied on write). Each child's distributions must be the ones an
    un-forked run sees for the same tokens: prompt + the child's first j tokens, for every j."""
    llm = make(tiny_dir, enable_prefix_caching=False)
    p = prompts(llm.engine.model_config.vocab_size)[5]
    seeded = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=8, logprobs=5, ignore_eos=True)
    children = llm.generate([p], seeded)[0].outputs
    assert children[0].token_ids[1:] != children[1].token_ids[1:]  # they diverge after the fork
    check_pool_idle(llm)
    for child in children:
        assert child.logprobs is not None
        unforked = llm.generate(
            [p + child.token_ids[:j] for j in range(len(child.token_ids))],
            SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True),
        )
        for j, (got, run) in enumerate(zip(child.logprobs, unforked, strict=True)):
            want = run.outputs[0].logprobs
            assert want is not None
            assert got.top.keys() == want[0].top.keys(), f"child {child.index}, token {j}"
            assert list(got.top.values()) == pytest.approx(list(want[0].top.values()), abs=1e-4)
    check_pool_idle(llm)


def test_stop_strings_tokens_and_lengths(tiny_dir) -> None:
    llm = make(tiny_dir)
    p = prompts(llm.engine.model_config.vocab_size)[6]
    full = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    assert stop
    cut = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop], ignore_eos=True))[0]
    o = cut.outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == full.text[: full.text.find(stop)]
    stop_id = full.token_ids[4]
    o = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id]))[
        0
    ].outputs[0]
    assert o.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    assert o.stop_reason == stop_id


def test_a_kept_stop_string_and_written_special_tokens(tiny_dir) -> None:
    """vLLM's include_stop_str_in_output keeps the stop string that ended the text; skip_special_tokens
    False writes special tokens' text (the tiny tokenizer's <|im_end|>, id 2, forced by a logit bias)."""
    llm = make(tiny_dir)
    p = prompts(llm.engine.model_config.vocab_size)[6]
    full = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    kept = SamplingParams(
        temperature=0.0, max_tokens=12, stop=[stop], ignore_eos=True, include_stop_str_in_output=True
    )
    o = llm.generate([p], kept)[0].outputs[0]
    assert o.stop_reason == stop and o.text == full.text[: full.text.find(stop) + len(stop)]
    forced = dict(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={2: 100.0})
    skipped = llm.generate([p], SamplingParams(**forced))[0].outputs[0]
    written = llm.generate([p], SamplingParams(**forced, skip_special_tokens=False))[0].outputs[0]
    assert skipped.token_ids == written.token_ids == [2, 2, 2]
    assert (skipped.text, written.text) == ("", "<|im_end|>" * 3)


def test_min_tokens_bans_eos_until_reached(tiny_dir) -> None:
    llm = make(tiny_dir)
    p = prompts(llm.engine.model_config.vocab_size)[6]
    first = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=1))[0].outputs[0].token_ids[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4, stop_token_ids=[first])
    o = llm.generate([p], params)[0].outputs[0]
    assert first not in o.token_ids[:4]
    assert len(o.token_ids) >= 4


def test_logprobs(tiny_dir) -> None:
    llm = make(tiny_dir)
    p = prompts(llm.engine.model_config.vocab_size)[3]
    o = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True))[
        0
    ].outputs[0]
    assert o.logprobs is not None and len(o.logprobs) == 5
    for token, lp in zip(o.token_ids, o.logprobs, strict=True):
        assert lp.token_id == token and lp.logprob <= 0
        assert len(lp.top) == 3 and max(lp.top, key=lp.top.get) == token  # greedy picks the top one
        assert lp.logprob == pytest.approx(max(lp.top.values()))


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(min_p=2),
        dict(max_tokens=0),
        dict(n=0),
        dict(logprobs=99),
        dict(temperature=float("nan")),
        dict(stop=[""]),
        dict(seed="x"),
        dict(max_tokens=2.5),
        dict(min_tokens=5, max_tokens=2),
    ],
)
def test_invalid_sampling_values_are_clear_errors(bad) -> None:
    with pytest.raises(ConfigError):
        SamplingParams(**bad)


def test_bad_prompts_are_rejected_and_engine_keeps_serving(tiny_dir) -> None:
    llm = make(tiny_dir, max_model_len=64, kv_device_blocks=64)
    vocab = llm.engine.model_config.vocab_size
    good = prompts(vocab)[3]
    with pytest.raises(ConfigError, match="max_model_len"):
        llm.generate([good, list(range(3, 70))], GREEDY)
    with pytest.raises(ConfigError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ConfigError, match="vocabulary"):
        llm.generate([[1, vocab + 5]], GREEDY)
    with pytest.raises(ConfigError, match="SamplingParams"):
        llm.generate([good, good], [GREEDY])
    assert not llm.engine.has_unfinished_requests()  # nothing half-queued
    assert len(llm.generate([good], GREEDY)[0].outputs[0].token_ids) == 12
    check_pool_idle(llm)


def test_abort_frees_blocks_at_once(tiny_dir) -> None:
    llm = make(tiny_dir)
    engine = llm.engine
    p = prompts(engine.model_config.vocab_size)[6]
    rid = engine.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv.num_free_blocks() < engine.config.cache.num_device_blocks
    assert engine.abort_request(rid)
    check_pool_idle(llm)


def test_a_final_only_request_is_output_once_finished_and_equal(tiny_dir) -> None:
    """``LLM.generate``'s requests: no output per step (no copy of the answer each step), and the one at
    the end equals a step-by-step request's last, logprobs and n > 1 included."""
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=10, logprobs=2, ignore_eos=True)
    with make(tiny_dir) as llm:
        engine, prompt = llm.engine, prompts(200)[6]
        each = engine.add_request({"prompt_token_ids": prompt}, params)
        once = engine.add_request({"prompt_token_ids": prompt}, params, final_only=True)
        seen: dict[str, list] = {each: [], once: []}
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id].append(out)
        check_pool_idle(llm)
    assert len(seen[each]) > 1 and [o.finished for o in seen[once]] == [True]
    last, final = seen[each][-1], seen[once][0]
    for a, b in zip(last.outputs, final.outputs, strict=True):
        fields = ("token_ids", "text", "finish_reason", "logprobs")
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
    assert final.outputs[0].num_new_tokens == 10 and final.outputs[0].text_delta == final.outputs[0].text


def test_a_streams_outputs_are_windows_that_later_steps_leave_alone(tiny_dir) -> None:
    """A running request's output carries its tokens and logprobs (and prompt logprobs) as windows on the
    sequence's growing lists, not copies: a step of a long stream costs the same at its last token as at
    its first. Each window keeps showing what its step had, while later steps append; the final output
    holds plain lists equal to the last windows grown by the last step."""
    from kvtier.outputs import Grown

    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    with make(tiny_dir) as llm:
        engine = llm.engine
        rid = engine.add_request({"prompt_token_ids": prompts(200)[6]}, params)
        seen = []
        while engine.has_unfinished_requests():
            seen += [(out, list(out.outputs[0].token_ids)) for out in engine.step() if out.request_id == rid]
    final = seen[-1][0]
    running = [out for out, _ in seen[:-1]]
    assert len(running) == 7 and all(type(o.outputs[0].token_ids) is Grown for o in running)
    assert [len(o.outputs[0].token_ids) for o in running] == list(range(1, 8))  # as at their steps
    assert all(o.outputs[0].token_ids == copy for o, copy in seen)  # nothing appended shows
    assert all(len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids) for o in running)
    out = final.outputs[0]
    assert type(out.token_ids) is list and type(out.logprobs) is list and type(final.prompt_logprobs) is list
    assert (
        out.token_ids[:7] == running[-1].outputs[0].token_ids
        and out.logprobs[:7] == running[-1].outputs[0].logprobs
    )
    assert final.prompt_logprobs == running[0].prompt_logprobs and len(final.prompt_logprobs) == 60


def test_prompt_forms_and_streaming(tiny_dir) -> None:
    llm = make(tiny_dir)
    text = "The quick brown fox"
    ids = llm.tokenizer.encode(text)
    a = llm.generate(text, GREEDY)[0]
    b = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]
    c = llm.generate(ids, GREEDY)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    deltas = [o.outputs[0].text_delta for o in llm.stream(text, GREEDY)]
    assert "".join(deltas) == a.outputs[0].text
    chat = llm.chat([{"role": "user", "content": "Hi"}], GREEDY)[0]
    assert chat.prompt_token_ids[0] == 1  # <|im_start|> from the template, no BOS added twice
