"""The ``kvtier`` command line, run for real in subprocesses against a tiny random HF Llama directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ENGINE_FLAGS = (
    "--model",
    "--kv-device-blocks",
    "--block-size",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--max-model-len",
    "--dtype",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--seed",
)
SMALL = ("--kv-device-blocks", "64")  # a small KV pool: fast start-up
PROMPT = "The quick brown fox jumps over the lazy dog."
CACHE_LINE = re.compile(r"\[(\d+)/(\d+) prompt tokens from cache")


def run_cli(*args: str, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}
    env.pop("KVTIER_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=env,
        timeout=timeout,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], fragment: str = "") -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvtier: error: "), proc.stderr
    assert fragment.lower() in lines[0].lower(), proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stdout == ""
    return lines[0]


def cache_lines(stderr: str) -> list[tuple[int, int]]:
    return [(int(n), int(m)) for n, m in CACHE_LINE.findall(stderr)]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Callable[..., Path]) -> str:
    return str(tiny_llama_dir())


@pytest.fixture(scope="module")
def tiny_llm(tiny: str):  # noqa: ANN201 - kvtier.LLM
    from kvtier import LLM

    return LLM(tiny, kv_device_blocks=64)


def greedy(max_tokens: int):  # noqa: ANN201 - SamplingParams
    from kvtier import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


# ------------------------------------------------------------------------------------------ generate
def test_generate_prompt_argument_matches_llm(tiny: str, tiny_llm) -> None:  # noqa: ANN001
    expected = tiny_llm.generate(PROMPT, greedy(12))[0].outputs[0].text
    proc = run_cli("generate", PROMPT, "--model", tiny, *SMALL, "--max-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"
    assert "Traceback" not in proc.stderr
    assert re.search(r"\d+/\d+ prompt tokens from cache, \d+ tokens in", proc.stderr), proc.stderr


@pytest.mark.parametrize("dash", [False, True])
def test_generate_prompt_from_stdin(tiny: str, tiny_llm, dash: bool) -> None:  # noqa: ANN001
    expected = tiny_llm.generate(PROMPT, greedy(10))[0].outputs[0].text
    args = ["generate", *(["-"] if dash else []), "--model", tiny, *SMALL, "--max-tokens", "10"]
    proc = run_cli(*args, stdin=PROMPT + "\n")  # the newline `echo` adds is not part of the prompt
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"


def test_generate_chat_template(tiny: str, tiny_llm) -> None:  # noqa: ANN001
    expected = tiny_llm.chat([{"role": "user", "content": "Hello, world!"}], greedy(10))[0].outputs[0].text
    plain = tiny_llm.generate("Hello, world!", greedy(10))[0].outputs[0].text
    proc = run_cli("generate", "--chat", "Hello, world!", "--model", tiny, *SMALL, "--max-tokens", "10")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"
    assert expected != plain  # the template really was applied


# ------------------------------------------------------------------------------------------ bad input
BAD_SAMPLING = [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-k", "-3"], "top_k"),
    (["--min-p", "2"], "min_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--stop", ""], "stop"),
    (["--temperature", "hot"], "--temperature"),
]
BAD_ENGINE = [
    (["--block-size", "3"], "power of two"),
    (["--block-size", "0"], "power of two"),
    (["--block-size", "abc"], "--block-size"),
    (["--kv-device-blocks", "1"], "kv_device_blocks"),
    (["--kv-device-gb", "-1"], "kv_device_gb"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--max-num-batched-tokens", "0"], "max_num_batched_tokens"),
    (["--max-model-len", "0"], "max_model_len"),
    (["--dtype", "float64"], "--dtype"),
    (["--bogus-flag"], "unrecognized"),
    (["--kv-host-gb", "-1"], "kv_host_gb"),
    (["--kv-host-gb", "nan"], "kv_host_gb"),
    (["--kv-disk-gb", "inf", "--kv-host-gb", "1"], "kv_disk_gb"),
    (["--kv-disk-dir", "/tmp/kvtier-unused"], "kv_host_gb > 0"),
    (["--kv-store-policy", "sometimes"], "--kv-store-policy"),
    (["--preemption-mode", "later"], "--preemption-mode"),
]


@pytest.mark.parametrize(("flags", "fragment"), BAD_SAMPLING + BAD_ENGINE)
def test_generate_bad_flags(tiny: str, flags: list[str], fragment: str) -> None:
    assert_one_line_error(run_cli("generate", PROMPT, "--model", tiny, *flags), fragment)


@pytest.mark.parametrize(
    ("flags", "fragment"), [(["--top-p", "0"], "top_p"), (["--block-size", "6"], "power")]
)
def test_chat_bad_flags(tiny: str, flags: list[str], fragment: str) -> None:
    assert_one_line_error(run_cli("chat", "--model", tiny, *flags, stdin="Hi\n"), fragment)


def test_unknown_model_paths(tmp_path: Path) -> None:
    assert_one_line_error(run_cli("generate", PROMPT, "--model", str(tmp_path / "nope")), "not found")
    assert_one_line_error(run_cli("chat", "--model", str(tmp_path / "nope"), stdin="Hi\n"), "not found")
    assert_one_line_error(run_cli("generate", PROMPT, "--model", str(tmp_path)), "not a model directory")
    text = tmp_path / "notes.txt"
    text.write_text("not a model\n")
    assert_one_line_error(run_cli("generate", PROMPT, "--model", str(text)), "neither a GGUF")


def test_prompt_longer_than_max_model_len(tiny: str) -> None:
    long_prompt = " ".join([PROMPT] * 8)
    args = ("--model", tiny, *SMALL, "--max-model-len", "16")
    assert_one_line_error(run_cli("generate", long_prompt, *args), "max_model_len")
    assert_one_line_error(run_cli("chat", *args, stdin=long_prompt + "\n"), "max_model_len")


def test_max_model_len_larger_than_pool(tiny: str) -> None:
    proc = run_cli("generate", PROMPT, "--model", tiny, "--kv-device-blocks", "2", "--max-model-len", "200")
    assert_one_line_error(proc, "max_model_len")


def test_empty_prompt(tiny: str) -> None:
    assert_one_line_error(run_cli("generate", "--model", tiny, stdin="  \n"), "no prompt")


# ------------------------------------------------------------------------------------------ chat
def test_chat_second_turn_reuses_cached_prefix(tiny: str) -> None:
    stdin = "Hello, how are you?\nTell me about the cache.\n"
    proc = run_cli("chat", "--model", tiny, *SMALL, "--block-size", "4", "--max-tokens", "8", stdin=stdin)
    assert proc.returncode == 0, proc.stderr  # EOF ends the session cleanly
    assert "Traceback" not in proc.stderr and "error" not in proc.stderr
    (n1, m1), (n2, m2) = cache_lines(proc.stderr)
    assert n1 < m1 and m2 > m1  # the history grew
    assert n2 > 0 and n2 >= (m1 // 4) * 4  # at least the whole first prompt came from the cache


def test_chat_reset_clears_history(tiny: str) -> None:
    stdin = "Hello, how are you?\n/reset\n\nHello, how are you?\n"
    proc = run_cli("chat", "--model", tiny, *SMALL, "--block-size", "4", "--max-tokens", "8", stdin=stdin)
    assert proc.returncode == 0, proc.stderr
    assert "history cleared" in proc.stderr
    (n1, m1), (n2, m2) = cache_lines(proc.stderr)
    assert m2 == m1  # the same one-message conversation again
    assert n2 == ((m1 - 1) // 4) * 4  # all its full blocks hit (the last prompt token is always computed)
    half = len(proc.stdout) // 2  # stdout is "answer\nanswer\n": greedy, cached or not
    assert proc.stdout[:half] == proc.stdout[half:] and proc.stdout.endswith("\n")


def test_chat_eof_without_input(tiny: str) -> None:
    proc = run_cli("chat", "--model", tiny, *SMALL, stdin="")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------ help, bench
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_help_lists_engine_flags(command: str) -> None:
    proc = run_cli(command, "--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ENGINE_FLAGS:
        assert flag in proc.stdout, flag
    for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p", "--stop"):
        assert flag in proc.stdout, flag


def test_generate_works_when_bench_module_is_broken(monkeypatch, capsys) -> None:  # noqa: ANN001
    from kvtier import cli

    monkeypatch.setitem(sys.modules, "kvtier.bench.transfer", None)  # importing it raises ImportError
    ns = cli.build_parser().parse_args(["generate", "hi", "--block-size", "8"])
    assert ns.func is cli.cmd_generate and ns.block_size == 8
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "transfer", "--quick"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("kvtier: error: the benchmark is unavailable")


# ------------------------------------------------------------------------------------------ real model
@pytest.mark.slow
def test_generate_default_model(converted_default_model: Any, hf_default_model: Any) -> None:
    """``kvtier generate`` prints the default model's greedy continuation, the one transformers
    generates from the same GGUF, and its stats line on stderr."""
    import torch

    prompt = "The capital of France is"
    proc = run_cli("generate", prompt, "--max-tokens", "8", "--ignore-eos", "--dtype", "float32", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr

    tok = converted_default_model.tokenizer
    ids = tok.encode(prompt)
    with torch.no_grad():
        out = hf_default_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=2,
        )
    expected = tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)
    assert expected.strip()
    assert proc.stdout == expected + "\n"
    assert f"0/{len(ids)} prompt tokens from cache, 8 tokens in " in proc.stderr


def test_demo_phase_prints_tiers_before_the_table_header(capsys: pytest.CaptureFixture[str]) -> None:
    """Phase 4 prints its 'tiers:' line before the table header, never between the header and its rows."""
    from types import SimpleNamespace

    from kvtier.demo import _header

    device = SimpleNamespace(capacity_blocks=8, blocks_evicted=0)
    engine = SimpleNamespace(
        stats=lambda: SimpleNamespace(tiers={"device": device}),
        kv=SimpleNamespace(pool=SimpleNamespace(blocks=[])),
    )
    _header("Phase 4: restart", SimpleNamespace(engine=engine))
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["---", "tiers:", "request"]
