"""``kvtier bench cluster``: its sizing, its bad-input errors, and one small real run.

The smoke run starts a real redis-server, two real ``kvtier serve`` replicas and a real ``kvtier router``
on loopback and sends a tiny multi-round chat workload through the router: 2 users x 2 rounds.
"""

from __future__ import annotations

import json

import pytest

from kvtier.bench.cluster import make_plan
from kvtier.cli import build_parser, main
from tests.redis_server import redis_server_binary


def _ns(*argv: str):
    return build_parser().parse_args(["bench", "cluster", *argv])


def test_the_default_plan_gives_each_replica_only_part_of_the_users_conversations():
    plan = make_plan(_ns())
    st = plan.settings
    assert plan.spec.users > plan.spec.concurrency  # more users than requests in flight
    assert st.device_blocks < plan.live_blocks / 2  # a replica's device pool holds a minority
    assert st.max_model_len >= plan.final_tokens  # yet every prompt fits
    assert st.device_blocks * 16 >= st.max_model_len
    flags = st.flags()
    assert flags[flags.index("--num-threads") + 1] == "1"
    assert "--kv-remote-url" not in flags  # the shared tier is added per scenario


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--scenarios", "ax"], "--scenarios takes letters among abcdef"),
        (["--rounds", "1"], "--rounds >= 2"),
        (["--scenarios", "f", "--replicas", "1"], "needs --replicas >= 2"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert main(["bench", "cluster", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_smoke_run_through_the_router_with_the_shared_tier(tmp_path, capsys):
    redis_server_binary()  # skips (fails under CI) without redis-server
    out_json = tmp_path / "cluster.json"
    argv = ["bench", "cluster", "--quick", "--scenarios", "c", "--overhead-requests", "3"]
    argv += ["--json", str(out_json), "--chart", str(tmp_path / "cluster.png")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| (c) cache-aware + Redis |" in printed
    assert "router overhead" in printed
    result = json.loads(out_json.read_text())["results"][0]
    assert result["error"] is None
    records = result["records"]
    assert len(records) == 2 * 2
    assert all(r["ok"] and r["error"] is None for r in records), records
    assert all(r["prompt_tokens"] > 0 and r["ttft"] > 0 for r in records)
    returning = [r for r in records if r["round"] == 1]
    # a returning user's history was computed before: most of its prompt is cached somewhere
    assert all(r["cached_tokens"] >= r["prompt_tokens"] // 2 for r in returning), returning
    assert result["extra"]["overhead"]["direct_p50_ms"] > 0
    assert (tmp_path / "cluster.png").stat().st_size > 0
