"""Sizing advice from the curves (sentences with sizes and TTFT estimates), the HTTP routes that serve
it and the canary's state, /metrics, and ``kvtier plan --from-server``."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kvtier.cli import main as cli_main
from kvtier.insight.advice import SIZE_FACTORS, Advisor, Costs, TierSize
from kvtier.insight.mrc import ReuseTracker
from kvtier.llm import LLM
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.serve import serve_in_thread

COSTS = Costs(block_size=16, block_bytes=2**20, prefill_tokens_per_s=1000.0, transfer_bytes_per_s=1e10)


def cyclic_snapshot(num_docs: int, rounds: int = 6) -> Any:
    """Documents of 4 blocks read in a cycle: an LRU holds them all or (almost) nothing."""
    tracker = ReuseTracker()
    for _ in range(rounds):
        for d in range(num_docs):
            tracker.lookup([hashlib.sha256(f"{d}/{b}".encode()).digest() for b in range(4)])
    return tracker.snapshot()


def tier(medium: str, capacity: int, snap: Any, asked: int, served: int, load_s: float = 0.0) -> TierSize:
    return TierSize(medium, capacity, load_s, snap, asked, served)


def test_an_undersized_host_tier_is_told_how_big_it_should_be() -> None:
    snap = cyclic_snapshot(40)  # 160 blocks in a cycle: a host tier of 60 serves none of them
    sizes = [tier("device", 40, None, 960, 0), tier("host", 60, snap, 960, 0, 0.002)]
    advisor = Advisor(sizes, COSTS, 960, 240)
    host = advisor.tiers_json()["host"]
    assert [p["size_factor"] for p in host["curve"]] == list(SIZE_FACTORS)
    assert host["capacity_bytes"] == 60 * 2**20 and host["current_hit_ratio"] == 0.0
    assert host["curve"][2]["hit_ratio"] == 0.0 and host["curve"][-1]["hit_ratio"] > 0.8
    (sentence,) = advisor.sentences()
    # 4x (240 blocks) holds the cycle: 5/6 of the lookups hit after the first round, 4 blocks a
    # request; each block saves 16 ms of prefill and costs 2 ms of loading.
    assert sentence.startswith("a host tier of 0.23 GiB (4× today's) would have served 83% of the prompt")
    assert sentence.endswith("(est. −47 ms mean TTFT)")


def test_an_oversized_disk_tier_is_called_out() -> None:
    snap = cyclic_snapshot(10)  # 40 blocks in a cycle; a disk tier of 400 holds ten times that
    sizes = [
        tier("device", 8, None, 240, 0),
        tier("host", 8, None, 240, 0),
        tier("disk", 400, snap, 240, 200),
    ]
    sentences = Advisor(sizes, COSTS, 240, 60).sentences()
    assert sentences == [
        "the disk tier is oversized 4.0× (0.10 GiB would have served as many prompt tokens, within 1% point)"
    ]


def test_without_a_host_tier_the_device_curve_suggests_one() -> None:
    snap = cyclic_snapshot(20)  # 80 blocks in a cycle, a device pool of 40
    (sentence,) = Advisor([tier("device", 40, snap, 480, 0)], COSTS, 480, 120).sentences()
    assert sentence.startswith("a host tier of 0.04 GiB would have served")


def test_no_data_no_advice() -> None:
    advisor = Advisor([tier("device", 40, ReuseTracker().snapshot(), 0, 0)], COSTS, 0, 0)
    assert advisor.sentences() == [] and advisor.to_json()["tiers"]["device"]["current_hit_ratio"] == 0.0


@pytest.mark.slow
def test_story_the_server_serves_advice_canary_state_and_lifts_a_quarantine(
    tiny_llama_dir: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = dict(
        model=str(tiny_llama_dir()), kv_device_blocks=16, kv_host_gb=64 * 8192 / 2**30, canary_rate=1.0
    )
    srv = serve_in_thread(
        create_app(
            lambda: LLM(**engine).engine, ServerSettings(model_name="m", api_key="k", admin_key="admin")
        )
    )
    auth = {"Authorization": "Bearer k"}
    try:
        srv.wait_ready()

        def ask(prompt: list[int]) -> dict:
            body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0}
            return httpx.post(srv.url + "/v1/completions", json=body, headers=auth, timeout=60).json()

        doc = [3 + (i * 7) % 400 for i in range(70)]
        ask(doc)
        for i in range(5):  # push it into the host tier
            ask([5 + (i * 131 + j * 17) % 490 for j in range(100)])

        def corrupt(e: Any) -> None:
            for key in e.tiers.host.held_keys():
                raw = e.mover.host.block(e.tiers.host.host_block_of(key)).view(-1).view(torch.uint8)
                raw[1024:1088].bitwise_xor_(0xFF)

        srv.app.state.engine.call_sync(corrupt)
        assert ask(doc)["usage"]["kvtier"]["cached_tokens_by_tier"]["host"] > 0
        for _ in range(600):  # the server runs the check once it is idle
            canary = httpx.get(srv.url + "/v1/kv/canary", headers=auth).json()
            if canary["checks"]["mismatch"]:
                break
            httpx.get(srv.url + "/health")
        assert canary["quarantined"] == ["host"] and canary["last_mismatch"]["tier"] == "host"
        assert httpx.get(srv.url + "/v1/kv/canary").status_code == 401  # the API key guards it
        metrics = httpx.get(srv.url + "/metrics").text
        found = re.search(r'kvtier:canary_checks_total\{result="mismatch",tier="host"\} ([0-9.]+)', metrics)
        assert found and float(found.group(1)) == canary["by_tier"]["host"]["mismatch"] >= 1
        advice = httpx.get(srv.url + "/v1/kv/advice", headers=auth).json()
        assert set(advice["tiers"]) == {"device", "host"} and advice["sampled_accesses"] > 0
        assert isinstance(advice["advice"], list) and advice["sampling_rate"] == 1.0
        assert 'kvtier:kv_mrc_hit_ratio{size_factor="2",tier="host"}' in httpx.get(srv.url + "/metrics").text

        admin = {"Authorization": "Bearer admin"}  # releasing a quarantine is the admin's, never a client's
        r = httpx.post(srv.url + "/admin/kv/quarantine", json={"release": ["tape"]}, headers=admin)
        assert r.status_code == 400 and r.json()["error"]["param"] == "medium"
        assert httpx.post(srv.url + "/admin/kv/quarantine", json={"release": ["host"]}).status_code == 401
        r = httpx.post(srv.url + "/admin/kv/quarantine", json={"release": ["host"]}, headers=auth)
        assert r.status_code == 401  # the client key
        r = httpx.post(srv.url + "/admin/kv/quarantine", json={"release": ["host"]}, headers=admin)
        assert r.json() == {"released": ["host"], "quarantined": []}

        assert cli_main(["plan", "--from-server", srv.url, "--api-key", "k"]) == 0
        out = capsys.readouterr().out
        assert "host" in out and "advice:" in out and "2x" in out
        assert cli_main(["plan", "--from-server", srv.url]) == 2  # no key: one error line
        assert "HTTP 401" in capsys.readouterr().err
    finally:
        srv.stop()


def test_plan_from_a_server_that_is_not_there(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli_main(["plan", "--from-server", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: ") and "cannot reach" in err and len(err.splitlines()) == 1
    assert cli_main(["plan", "--from-server", "ftp://x"]) == 2
