"""The sampler draws from exactly the distribution top-k / top-p / min-p define, reproducibly per seed."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest
import torch

from kvtier.sampling_params import SamplingParams
from kvtier.worker.sampler import Sampler, SampleRequest, _penalize

VOCAB = 1000


def logits_row() -> torch.Tensor:
    # token i has logit -0.01 * i: a smooth distribution whose top 256 hold far less than 95% mass
    return (-0.01 * torch.arange(VOCAB, dtype=torch.float32))[None, :]


def draws(
    params: SamplingParams, n: int = 3000, logits: torch.Tensor | None = None, seed: int = 1234
) -> Counter[int]:
    """``n`` draws by one sequence seeded with ``seed`` (its generator carries on from draw to draw),
    so every statistical test sees the same numbers on every run."""
    sampler = Sampler()
    row = logits_row() if logits is None else logits
    req = SampleRequest(0, "s", 0, replace(params, seed=seed))
    out: Counter[int] = Counter()
    for _ in range(n):
        out[sampler.sample(row, [req])[0][0]] += 1
    return out


def test_top_k_keeps_exactly_k_most_likely() -> None:
    seen = draws(SamplingParams(temperature=1.0, top_k=5))
    assert set(seen) == {0, 1, 2, 3, 4}


def test_top_p_falls_back_to_a_full_sort_when_candidates_hold_too_little_mass() -> None:
    probs = torch.softmax(logits_row()[0], -1)
    cum = probs.cumsum(0)
    nucleus = int((cum - probs < 0.95).sum())  # tokens the nucleus must contain
    assert nucleus > 256  # the candidate shortcut is not enough here
    seen = draws(SamplingParams(temperature=1.0, top_p=0.95), n=4000)
    assert max(seen) < nucleus
    assert max(seen) > 256  # tokens beyond the first 256 candidates are reachable


def test_a_top_p_below_float32_range_keeps_the_most_likely_token() -> None:
    """top_p=6e-295 (found by the hostile fuzzer) rounds to 0 in float32: the nucleus is still the
    most likely token, never empty."""
    assert set(draws(SamplingParams(temperature=1.0, top_p=6.030219558406741e-295), n=50)) == {0}


def test_top_p_on_a_peaked_distribution_uses_candidates() -> None:
    logits = torch.full((1, VOCAB), -20.0)
    logits[0, :3] = torch.tensor([2.0, 1.0, 0.0])
    seen = draws(SamplingParams(temperature=1.0, top_p=0.7), n=2000, logits=logits)
    # p = softmax(2, 1, 0) = 0.665, 0.245, 0.090: the nucleus for 0.7 is {0, 1}
    assert set(seen) == {0, 1}
    assert seen[0] / 2000 == pytest.approx(0.665 / 0.910, abs=0.04)


def test_min_p_drops_unlikely_tokens() -> None:
    seen = draws(SamplingParams(temperature=1.0, min_p=math.exp(-0.05)))  # keeps logits within 0.05 of max
    # Tokens 0..4 are kept (5 sits on the boundary), nothing else; the kept ones are about equally
    # likely (1/6 to 1/5 each), so each is drawn often.
    assert {0, 1, 2, 3, 4} <= set(seen) <= {0, 1, 2, 3, 4, 5}
    assert all(seen[t] > 3000 / 8 for t in range(5)), seen


def test_frequencies_follow_temperature() -> None:
    logits = torch.full((1, VOCAB), -50.0)
    logits[0, :2] = torch.tensor([1.0, 0.0])
    seen = draws(SamplingParams(temperature=0.5), n=3000, logits=logits)
    expected = 1 / (1 + math.exp(-2.0))  # softmax([2, 0])[0]
    assert seen[0] / 3000 == pytest.approx(expected, abs=0.03)


def test_same_seed_same_draws_and_greedy_is_argmax() -> None:
    sampler = Sampler()
    row = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(temperature=1.0, seed=42)
    a = [sampler.sample(row, [SampleRequest(0, "a", 0, seeded)])[0][0] for _ in range(20)]
    b = [sampler.sample(row, [SampleRequest(0, "b", 0, seeded)])[0][0] for _ in range(20)]
    assert a == b and len(set(a)) > 1
    greedy = sampler.sample(row, [SampleRequest(0, "g", 0, SamplingParams(temperature=0.0))])[0][0]
    assert greedy == int(row.argmax())


def test_banned_tokens_are_never_drawn() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 100.0
    out = Sampler().sample(logits, [SampleRequest(0, "x", 0, SamplingParams(temperature=0.0), (7,))])
    assert out[0][0] != 7


def test_a_vanishing_temperature_is_greedy_not_nan() -> None:
    """Found by the hostile-input suite: temperature 2e-246 made logits / T infinite, softmax NaN, and the
    engine step (everyone's requests) fail. Below 1e-5 sampling is greedy, as in vLLM."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    params = SamplingParams(temperature=2.171794097621335e-246, seed=0)
    assert params.greedy
    assert Sampler().sample(logits, [SampleRequest(0, "s", 0, params)])[0][0] == 1


def test_logit_bias_moves_the_choice() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    params = SamplingParams(temperature=0.0, logit_bias={3: 100.0, 1: -100.0})
    assert Sampler().sample(logits, [SampleRequest(0, "s", 0, params)])[0][0] == 3


def test_allowed_token_ids_hold_the_choice_greedy_and_sampled() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=[0, 3])
    assert Sampler().sample(logits, [SampleRequest(0, "s", 0, greedy)])[0][0] == 0
    sampled, sampler = SamplingParams(temperature=5.0, allowed_token_ids=[2, 3]), Sampler()
    draws = {sampler.sample(logits, [SampleRequest(0, f"s{i}", 0, sampled)])[0][0] for i in range(40)}
    assert draws == {2, 3}  # a hot draw over the two, never the others


def test_bias_and_bans_edit_a_copy_and_plain_rows_are_read_in_place() -> None:
    """A decode step's rows are read in place; a bias or a ban edits a copy, so the logits (the model's
    distribution, which logprobs report) and the other rows are never changed."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 5.0, 0.0]])
    before = logits.clone()
    biased = SamplingParams(temperature=0.0, logit_bias={3: 100.0}, logprobs=1)
    plain = SamplingParams(temperature=0.0, logprobs=1)
    out = Sampler().sample(logits, [SampleRequest(0, "a", 0, biased), SampleRequest(1, "b", 0, plain, (2,))])
    assert [token for token, _ in out] == [3, 0]
    assert torch.equal(logits, before)
    assert out[0][1].top == {1: pytest.approx(float(torch.log_softmax(before[0], -1)[1]))}
    out = Sampler().sample(logits, [SampleRequest(0, "a", 0, plain), SampleRequest(1, "b", 0, plain)])
    assert [token for token, _ in out] == [1, 2] and torch.equal(logits, before)


def test_penalties_follow_their_definitions_in_order() -> None:
    """Prompt [3], output [0, 0, 2]: repetition (HF's: prompt and output, positive logits divided,
    negative multiplied), then frequency (per repeat) and presence (once), on a copy of the row."""
    logits = torch.tensor([[5.0, 4.5, 1.0, -2.0, 0.5]])
    before = logits.clone()
    tokens, prompt_len = [3, 0, 0, 2], 1

    def edited(**penalties: float) -> tuple[int, list[float]]:
        params = SamplingParams(temperature=0.0, logprobs=1, **penalties)
        req = SampleRequest(0, "s", 0, params, (), tokens, prompt_len)
        rows = logits.clone()
        _penalize(rows[0], req)
        token, lp = Sampler().sample(logits, [req])[0]
        assert torch.equal(logits, before)  # the model's logits are not edited ...
        assert lp.top == {
            0: pytest.approx(float(torch.log_softmax(before[0], -1)[0]))
        }  # ... logprobs are theirs
        return token, rows[0].tolist()

    assert edited(frequency_penalty=0.3) == (1, pytest.approx([4.4, 4.5, 0.7, -2.0, 0.5]))
    assert edited(presence_penalty=0.7) == (1, pytest.approx([4.3, 4.5, 0.3, -2.0, 0.5]))
    assert edited(repetition_penalty=2.0) == (1, pytest.approx([2.5, 4.5, 0.5, -4.0, 0.5]))
    assert edited(presence_penalty=-1.0) == (0, pytest.approx([6.0, 4.5, 2.0, -2.0, 0.5]))  # encourages
    both = edited(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)
    assert both == (1, pytest.approx([2.5 - 2.0 - 0.5, 4.5, 0.5 - 1.0 - 0.5, -4.0, 0.5]))
    assert edited() == (0, pytest.approx(before[0].tolist()))  # no penalty: nothing changes


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 11),
    ],
)
def test_penalties_out_of_range_are_refused(name: str, value: float) -> None:
    from kvtier.config import ConfigError

    with pytest.raises(ConfigError, match=name):
        SamplingParams(**{name: value})
