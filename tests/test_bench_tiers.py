"""``kvtier demo offload``, ``kvtier bench multiturn`` and ``kvtier bench transfer``: smoke runs with tiny
settings through ``kvtier.cli.main``, plus the pure helpers. The slow tests load the real model; they run
with one torch thread (a shared CI machine makes two-thread runs erratic)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from kvtier.cli import build_parser, main


# ------------------------------------------------------------------------------ fast
@pytest.mark.parametrize(
    ("argv", "module"),
    [
        (["demo", "offload"], "kvtier.demo"),
        (["bench", "multiturn", "--quick"], "kvtier.bench.multiturn"),
        (["bench", "transfer", "--quick"], "kvtier.bench.transfer"),
        (["bench", "remote", "--quick"], "kvtier.bench.remote"),
    ],
)
def test_commands_are_registered(argv: list[str], module: str) -> None:
    ns = build_parser().parse_args(argv)
    assert ns.func.__module__ == module


def test_source_of() -> None:
    from kvtier.demo import source_of

    assert source_of(0, {"device": 0, "host": 0, "disk": 0}) == "miss"
    assert source_of(32, {"device": 32, "host": 0, "disk": 0}) == "device"
    assert source_of(48, {"device": 16, "host": 32, "disk": 0}) == "host"
    assert source_of(48, {"device": 16, "host": 16, "disk": 16}) == "disk"


def test_percentile() -> None:
    from kvtier.bench.quantiles import percentile

    xs = [float(x) for x in range(1, 11)]
    assert percentile(xs, 0.5) == pytest.approx(5.5)
    assert percentile(xs, 0.9) == pytest.approx(9.1)
    assert percentile([3.0], 0.9) == 3.0


class _CharTokenizer:
    """One token per character and a ChatML-like template: enough to build a workload."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def test_workload_turns_extend_the_previous_prompt_and_answer() -> None:
    from kvtier.bench.multiturn import build_workload

    ns = argparse.Namespace(
        seed=3, conversations=3, turns=3, system_tokens=40, doc_tokens=60, user_tokens=20, answer_tokens=5
    )
    work = build_workload(_CharTokenizer(), ns)
    assert (work.num_convs, work.num_turns) == (3, 3)
    assert len({tuple(p) for p in work.first_prompts}) == 3  # a document of its own each
    system = work.first_prompts[0][: work.system_tokens]
    assert all(p[: work.system_tokens] == system for p in work.first_prompts)  # shared system prompt
    for c in range(3):
        for t in range(3):
            work.answers[(c, t)] = [100 + c] * 5
    for c in range(3):
        for t in range(2):
            before = work.prompt(c, t) + work.answers[(c, t)]
            after = work.prompt(c, t + 1)
            assert after[: len(before)] == before
            assert len(after) == work.prompt_len(c, t + 1) > len(before)
            assert "".join(map(chr, after[len(before) :])).endswith("<assistant>")


def test_transfer_bandwidth_without_the_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json = tmp_path / "transfer.json"
    rc = main(
        ["bench", "transfer", "--quick", "--skip-decode", "--max-blocks", "16", "--json", str(out_json)]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "memcpy GB/s" in text and "scattered" in text and "contiguous" in text
    data = json.loads(out_json.read_text())
    rows = data["bandwidth"]
    assert sorted({r["blocks"] for r in rows}) == [1, 4, 16]
    assert all(r["store_gbs"] > 0 and r["load_gbs"] > 0 and r["memcpy_gbs"] > 0 for r in rows)
    assert data["decode"] is None


@pytest.mark.parametrize(
    ("ratio", "stored_during_decode", "verdict"),
    [(0.99, 12, "met"), (0.90, 12, "UNMET"), (0.99, 0, "n/a"), (0.90, 0, "n/a")],
)
def test_transfer_decode_verdict_needs_stores_during_decode(
    capsys: pytest.CaptureFixture[str], ratio: float, stored_during_decode: int, verdict: str
) -> None:
    """The decode row judges write-back stores only if some block was stored while decoding."""
    from kvtier.bench.transfer import DecodeResult, print_decode

    result = DecodeResult([100.0], [100.0 * ratio], [ratio], 40, stored_during_decode, 36, 0.1)
    print_decode(result, argparse.Namespace(decode_seqs=4, decode_tokens=32))
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith(f"target decode with write-back stores <= 5% slower: {verdict} ("), line


# ------------------------------------------------------------------------------ slow (real model)
@pytest.mark.slow
def test_demo_offload_shows_all_four_sources(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    rc = main(["demo", "offload", "--max-tokens", "2", "--threads", "1", "--kv-disk-dir", str(disk)])
    text = capsys.readouterr().out
    assert rc == 0, text
    sources = re.findall(r"^  \S.{27} (miss|device|host|disk) ", text, flags=re.MULTILINE)
    assert {"miss", "device", "host", "disk"} <= set(sources), text
    assert re.search(r"^  A again\s+host ", text, flags=re.MULTILINE), text
    assert re.search(r"^  A after restart\s+disk ", text, flags=re.MULTILINE), text
    assert "all four" in text
    assert any(disk.rglob("*.kvb"))  # the restart read the blocks the first engine flushed


@pytest.mark.slow
def test_multiturn_quick_reports_host_hits(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    chart, out_json = tmp_path / "chart.png", tmp_path / "multiturn.json"
    argv = ["bench", "multiturn", "--quick", "--conversations", "4", "--turns", "2", "--answer-tokens", "4"]
    argv += ["--system-tokens", "32", "--doc-tokens", "120", "--user-tokens", "16", "--threads", "1"]
    rc = main([*argv, "--chart", str(chart), "--json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "targets" in text and "mean TTFT by turn" in text
    assert chart.stat().st_size > 1000
    data = json.loads(out_json.read_text())
    rows = {r["name"]: r for r in data["results"]}

    def tokens(name: str, tier: str) -> int:
        return sum(rec["by_tier"].get(tier, 0) for rec in rows[name]["records"])

    assert len(rows["device+host"]["records"]) == 4 * 2
    assert tokens("device+host", "host") > 0
    assert tokens("device+host+disk", "disk") > 0  # the small host tier demoted blocks that came back
    assert tokens("restart on disk", "disk") > 0
    assert all(rec["cached_tokens"] == 0 for rec in rows["no prefix caching"]["records"])
    for name in ("device+host", "device+host+disk", "restart on disk"):  # the tiers never change an answer
        assert [rec["answer_ok"] for rec in rows[name]["records"]] == [True] * 4 * 2, name  # None: unchecked
    llama = rows["llama.cpp + LlamaRAMCache"]
    assert llama["skipped"] or llama["records"]


@pytest.mark.slow
def test_remote_quick_serves_returning_turns_from_redis(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from tests.redis_server import redis_server_binary

    redis_server_binary()  # skips (fails under CI) without redis-server
    out_json = tmp_path / "remote.json"
    rc = main(["bench", "remote", "--quick", "--turns", "2", "--json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "returning turns" in text and "targets:" in text
    rows = {r["name"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert rows["shared Redis"]["hits"]["remote"] > 0 and rows["no remote tier"]["hits"]["remote"] == 0
    assert rows["shared Redis"]["net_out"] > 0  # blocks were read out of Redis
    assert rows["Redis stopped"]["hits"]["remote"] == 0
    assert all(r["mismatches"] == 0 for r in rows.values())  # the remote tier never changes an answer


@pytest.mark.slow
def test_transfer_quick_decode_stores_blocks(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json = tmp_path / "transfer.json"
    rc = main(
        ["bench", "transfer", "--quick", "--max-blocks", "4", "--threads", "1", "--json", str(out_json)]
    )
    assert rc == 0
    assert "write-back stores <= 5% slower" in capsys.readouterr().out
    decode = json.loads(out_json.read_text())["decode"]
    assert decode["blocks_stored_during_decode"] > 0
    assert len(decode["ratios"]) == 1 and decode["ratios"][0] > 0
