"""``kvtier bench cluster``: its sizing, its bad-input errors, one small real run; and the production
shape (deploy/compose.yaml, the README's "Several replicas" commands) checked against the real flags.

The smoke run starts a real redis-server, two real ``kvtier serve`` replicas and a real ``kvtier router``
on loopback and sends a tiny multi-round chat workload through the router: 2 users x 2 rounds.
"""

from __future__ import annotations

import json
import shlex
import socket
from pathlib import Path

import pytest

from kvtier.bench.cluster import make_plan
from kvtier.cli import build_parser, main
from tests.redis_server import RedisServer, redis_server_binary


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


# ------------------------------------------------------------------------------ the production shape
ROOT = Path(__file__).resolve().parent.parent


def _compose() -> dict:
    yaml = pytest.importorskip("yaml")  # PyYAML: installed with the dev tools (transformers needs it)
    return yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())


def test_compose_file_starts_redis_two_replicas_and_a_router_with_real_flags():
    services = _compose()["services"]
    assert set(services) == {"redis", "replica-1", "replica-2", "router"}
    for name in ("replica-1", "replica-2", "router"):
        command = services[name]["command"]
        ns = build_parser().parse_args(command)  # an unknown flag would exit here
        assert ns.func.__module__ in ("kvtier.server.serve", "kvtier.router.cli"), name
    router = build_parser().parse_args(services["router"]["command"])
    assert router.replica == ["http://replica-1:8000", "http://replica-2:8000"]
    assert router.policy == "cache_aware"
    for name in ("replica-1", "replica-2"):
        replica = build_parser().parse_args(services[name]["command"])
        assert replica.kv_remote_url == router.kv_remote_url == "redis://redis:6379/0"
        assert replica.kv_replica_id == name and replica.port == 8000
    assert list(services["router"]["ports"]) == ["8000:8000"]  # only the router is published


def test_compose_redis_flags_are_accepted_by_a_real_redis_server(tmp_path):
    command = _compose()["services"]["redis"]["command"]
    assert command[0] == "redis-server"
    server = RedisServer(tmp_path, None, *command[1:]).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"CONFIG GET maxmemory-policy\r\n")
            assert b"allkeys-lru" in s.recv(200)
    finally:
        server.kill()


def test_readme_several_replicas_commands_parse():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Several replicas", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    commands = [c for c in block.replace("\\\n", " ").splitlines() if c.strip().startswith("kvtier ")]
    assert [c.split()[1] for c in commands] == ["serve", "serve", "router"]
    for command in commands:
        build_parser().parse_args(shlex.split(command.split("&")[0])[1:])
