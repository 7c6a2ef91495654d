"""``kvtier score``: a text's perplexity from its prompt logprobs, window by window, through the CLI."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from kvtier import LLM, SamplingParams
from kvtier.cli import main
from kvtier.score import windows

TEXT = (
    "The history of computing is a story of memory. Early machines stored a few hundred numbers in "
    "mercury delay lines and rotating drums; every program was written around what could be kept close."
)


def test_windows_cut_the_text_and_drop_a_lone_last_token() -> None:
    assert windows(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5]]  # [6] alone has nothing to score
    assert windows(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_story_score_is_the_engines_prompt_logprobs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The CLI's perplexity over windows of 16 tokens equals exp(-mean) of the prompt logprobs the
    engine gives each window; the most surprising token listed is the lowest of them."""
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    assert main(["score", "--file", str(path), "--window", "16", "--top", "1", "--num-threads", "1"]) == 0
    out = capsys.readouterr().out
    ppl = float(re.search(r"perplexity ([0-9.]+)", out)[1])

    llm = LLM(num_threads=1)
    parts = windows(llm.tokenizer.encode(TEXT), 16)
    outs = llm.generate(
        [{"prompt_token_ids": w} for w in parts],
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
    )
    lps = [e.logprob for o in outs for e in o.prompt_logprobs[1:]]
    assert f"{len(lps)} scored" in out and f"{len(parts)} window(s)" in out
    assert ppl == pytest.approx(math.exp(-sum(lps) / len(lps)), rel=1e-4)
    assert f"{min(lps):>9.3f}" in out.splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["score", ""], "no text to score"),
        (["score", "a b c", "--window", "1"], "--window must be"),
        (["score", "a b", "--file", "x.txt"], "either as an argument or with --file"),
        (["score", "--file", "/no/such/file.txt"], "cannot read /no/such/file.txt"),
        (["score", "a b", "--top", "-1"], "--top must be"),
    ],
)
def test_bad_input_is_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main([*argv, "--num-threads", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtier: error:") and message in err and len(err.splitlines()) == 1
