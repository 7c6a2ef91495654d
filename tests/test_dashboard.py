"""The data behind ``/dashboard``: the device block map coloured by the tier each block's KV came from,
the history of tier occupancy and hit rates, the running and waiting sequences, and the routes (the
page without a key, its data behind the key). The page itself in a real browser: test_dashboard_browser.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvtier import LLM, SamplingParams
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.dashboard import History, block_map, engine_view, page_routes
from kvtier.server.serve import serve_in_thread
from kvtier.stats import EngineStats, Medium, TierSnapshot

BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # tiny llama: layers x (K, V) x kv heads x head dim x fp32 x 16 slots
GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def prompt(i: int, num_tokens: int = 65) -> list[int]:
    """Token ids no other ``i`` shares (4 full blocks and one more token with the default 65)."""
    return [10 + (7 * i + j) % 490 for j in range(num_tokens)]


def origins(llm: LLM) -> dict[tuple[str, Medium], int]:
    """How many device blocks are in each (state, origin)."""
    states, loaded = llm.engine.kv.block_map()
    counted: dict[tuple[str, Medium], int] = {}
    for block_id, state in enumerate(states):
        origin = loaded.get(block_id, Medium.DEVICE) if state != "free" else Medium.DEVICE
        counted[state, origin] = counted.get((state, origin), 0) + 1
    return counted


def test_story_block_map_says_which_tier_each_blocks_kv_came_from(
    tiny_llama_dir: Callable[..., Path], tmp_path: Path
) -> None:
    host_gb = 10 * BLOCK_BYTES / 2**30  # a host tier of 10 blocks, then the disk
    with LLM(
        str(tiny_llama_dir()), kv_device_blocks=12, kv_host_gb=host_gb, kv_disk_dir=str(tmp_path / "kv")
    ) as llm:
        # Act 1: a prompt computed here: its 4 full blocks are cached idle, computed on the device.
        llm.generate([prompt(0)], GREEDY)
        assert origins(llm) == {("cached", Medium.DEVICE): 4, ("free", Medium.DEVICE): 8}

        # Act 2: three other prompts push it out of the device pool into the host tier; asked again,
        # its 4 blocks are loaded from there, and the map says so.
        for i in (1, 2, 3):
            llm.generate([prompt(i)], GREEDY)
        assert ("cached", Medium.HOST) not in origins(llm)
        llm.generate([prompt(0)], GREEDY)
        assert llm.engine.stats().tiers[Medium.HOST].hit_blocks == 4
        assert origins(llm) == {
            ("cached", Medium.DEVICE): 7,
            ("cached", Medium.HOST): 4,
            ("free", Medium.DEVICE): 1,
        }
        llm.engine.kv.check_integrity()

        # Act 3: six more push it through the host tier onto the disk; asked again, its blocks come up
        # from the disk (through the host tier), and the map says disk.
        for i in range(4, 10):
            llm.generate([prompt(i)], GREEDY)
        llm.generate([prompt(0)], GREEDY)
        assert llm.engine.stats().tiers[Medium.DISK].hit_blocks == 4
        assert origins(llm) == {
            ("cached", Medium.DEVICE): 7,
            ("cached", Medium.DISK): 4,
            ("free", Medium.DEVICE): 1,
        }

        # Act 4: new prompts evict those blocks from the device: no block keeps a stale origin.
        for i in range(10, 14):
            llm.generate([prompt(i)], GREEDY)
        assert origins(llm) == {("cached", Medium.DEVICE): 11, ("free", Medium.DEVICE): 1}
        llm.engine.kv.check_integrity()


def test_block_map_cells_and_counts() -> None:
    states = ["free", "cached", "in_use", "in_use", "cached", "cached"]
    loaded = {1: Medium.HOST, 3: Medium.DISK, 4: Medium.REMOTE, 0: Medium.HOST}  # 0: free, so no origin
    m = block_map(states, loaded)
    assert m["cells"] == ".hDKrd" and m["blocks_per_cell"] == 1 and m["num_blocks"] == 6
    assert m["counts"] == {"free": 1, "cached": 3, "in_use": 2}
    assert m["by_origin"]["device"] == {"cached": 1, "in_use": 1}
    assert m["by_origin"]["host"] == {"cached": 1, "in_use": 0}
    # A pool larger than the map: each cell shows the busiest of its blocks.
    big = block_map(states * 3, {i + 6 * k: o for k in range(3) for i, o in loaded.items()}, max_cells=6)
    assert big["blocks_per_cell"] == 3 and big["cells"] == "DKDKDK" and big["counts"]["in_use"] == 6
    assert block_map(["free"] * 5 + ["cached"], {5: Medium.HOST}, max_cells=2)["cells"] == ".h"


def _stats(t: int, lookups: int, hits: int, used: int, preemptions: int) -> EngineStats:
    host = TierSnapshot(medium=Medium.HOST, capacity_blocks=100, used_blocks=used, block_size=16)
    host.lookups, host.hit_blocks = lookups, hits
    return EngineStats(
        num_requests_running=t % 3,
        num_requests_waiting=0,
        kv_cache_usage=0.0,
        prefix_cache_queries=lookups * 16,
        prefix_cache_hits=hits * 16,
        num_preemptions={"swap": preemptions, "recompute": 0},
        prompt_tokens=0,
        generation_tokens=0,
        tiers={Medium.HOST: host},
    )


def test_history_keeps_one_sample_a_second_and_rates_per_interval() -> None:
    history = History(seconds=10, every=1.0)
    history.sample(_stats(0, 0, 0, 0, 0), now=100.0)
    history.sample(_stats(0, 99, 99, 99, 9), now=100.5)  # too soon after the last one: dropped
    history.sample(_stats(1, 10, 5, 20, 1), now=101.0)
    history.sample(_stats(2, 10, 5, 30, 1), now=102.0)  # no lookups in this interval
    history.sample(_stats(3, 30, 20, 40, 4), now=103.0)
    points = history.points()
    assert [p["t"] for p in points] == [101.0, 102.0, 103.0]
    assert [p["hit_rate"]["host"] for p in points] == [0.5, None, 0.75]
    assert [p["usage"]["host"] for p in points] == [0.2, 0.3, 0.4]
    assert [p["preemptions"] for p in points] == [1, 0, 3]
    assert [p["prefix_hit_rate"] for p in points] == [0.5, None, 0.75]
    assert history.recent_hit_rate(Medium.HOST) == 20 / 30
    assert history.recent_hit_rate(Medium.DISK) is None
    for t in range(104, 130):  # only the last 10 seconds are kept
        history.sample(_stats(t, 30, 20, 40, 4), now=float(t))
    assert len(history.points()) == 10


def test_engine_view_lists_sequences_with_their_cached_tokens_by_tier(
    tiny_llama_dir: Callable[..., Path],
) -> None:
    with LLM(str(tiny_llama_dir()), kv_device_blocks=64, max_num_seqs=2) as llm:
        engine = llm.engine
        llm.generate([prompt(0)], GREEDY)
        for i in (0, 1, 2):  # prompt 0 again (a device hit), two new ones; two fit in the batch
            engine.add_request(prompt(i), SamplingParams(max_tokens=5, temperature=0.0))
        engine.step()
        view = engine_view(engine)
        running, waiting = view["requests"]["running"], view["requests"]["waiting"]
        assert view["requests"]["num_running"] == 2 and view["requests"]["num_waiting"] == 1
        assert [r["status"] for r in running] == ["running", "running"] and waiting[0]["status"] == "waiting"
        assert running[0]["cached_tokens"] == 64 and running[0]["cached_tokens_by_tier"] == {"device": 64}
        assert running[1]["cached_tokens"] == 0 and waiting[0]["cached_tokens"] is None
        cells = block_map(*view["block_states"])
        assert cells["counts"]["in_use"] == engine.kv.snapshot().used_blocks > 0
        assert view["block_size"] == 16 and len(cells["cells"]) == 64


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Callable[..., Path]):  # noqa: ANN201
    model = str(tiny_llama_dir())
    settings = ServerSettings(model_name="tiny", api_key="sesame")
    server = serve_in_thread(create_app(lambda: LLM(model, kv_device_blocks=32).engine, settings))
    server.wait_ready()
    yield server
    server.stop()


def test_the_page_is_served_without_a_key_and_its_data_only_with_it(served) -> None:  # noqa: ANN001
    page = httpx.get(served.url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'data-mode="replica"' in page.text and "http" not in page.text.replace("http-equiv", "")
    for name, kind in (("dashboard.js", "javascript"), ("dashboard.css", "css")):
        asset = httpx.get(f"{served.url}/dashboard/static/{name}")
        assert asset.status_code == 200 and kind in asset.headers["content-type"]
        assert "//cdn" not in asset.text and "https://" not in asset.text  # works offline
    missing = httpx.get(served.url + "/dashboard/static/passwd")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"

    refused = httpx.get(served.url + "/v1/kv/dashboard")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    data = httpx.get(served.url + "/v1/kv/dashboard", headers={"Authorization": "Bearer sesame"}).json()
    assert data["object"] == "kv.dashboard" and data["model"] == "tiny"
    assert data["block_map"]["num_blocks"] == 32 and set(data["tiers"]) == {"device"}
    assert data["tiers"]["device"]["capacity_blocks"] == 32
    assert data["history"]["interval_s"] == 1.0 and data["totals"]["num_requests_running"] == 0
    assert data["features"] == {"advice": True, "canary": True}  # GET /v1/kv/advice and /v1/kv/canary


def test_the_cluster_page_is_the_same_page_in_cluster_mode() -> None:
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    page = TestClient(Starlette(routes=page_routes(cluster=True))).get("/dashboard")
    assert page.status_code == 200 and 'data-mode="cluster"' in page.text


def test_history_is_sampled_in_the_background(served) -> None:  # noqa: ANN001
    """Nobody asks for the page: the history still gets a sample a second (the app's lifespan task)."""
    history: History = served.app.state.dashboard_history
    newest = history._samples[-1].t if history._samples else 0.0
    deadline = time.monotonic() + 20  # a loaded machine delays the loop, never stops it
    while sum(1 for s in history._samples if s.t > newest) < 2:
        assert time.monotonic() < deadline, "no new sample in the background"
        time.sleep(0.1)
    times = [s.t for s in history._samples]
    assert all(b - a >= 0.9 for a, b in zip(times, times[1:], strict=False))  # at most one a second


def test_the_data_shows_retained_blocks_and_bytes_per_tier_and_hits_on_them(served) -> None:  # noqa: ANN001
    """A prompt retained for 24 hours (``prompt_cache_retention``), sent twice: the data says how many keys
    are retained, how many blocks the device pool keeps for them (and their bytes), and how many prompt
    tokens of retaining requests were hits, the numbers /metrics has."""
    from tests.test_metrics import scrape

    auth = {"Authorization": "Bearer sesame"}
    body = {"model": "tiny", "prompt": prompt(40, 64), "max_tokens": 1, "temperature": 0.0}
    for _ in range(2):
        answer = httpx.post(served.url + "/v1/completions", json={**body, "prompt_cache_retention": "24h"})
        assert answer.status_code == 401  # the key first
        answer = httpx.post(
            served.url + "/v1/completions", json={**body, "prompt_cache_retention": "24h"}, headers=auth
        )
        assert answer.status_code == 200 and answer.json()["usage"]["kvtier"]["retained_tokens"] == 64
    deadline = time.monotonic() + 20
    while True:  # a tier's retained blocks are recounted at most once a second, at an engine step
        data = httpx.get(served.url + "/v1/kv/dashboard", headers=auth).json()
        if data["tiers"]["device"]["retained_blocks"] == 4:
            break
        assert time.monotonic() < deadline, data["tiers"]["device"]
        time.sleep(1.1)
        httpx.post(served.url + "/v1/completions", json={**body, "prompt": [7]}, headers=auth)
    totals, device = data["totals"], data["tiers"]["device"]
    assert totals["retained_keys"] == 4 and totals["retained_hit_tokens"] == 48  # the second: 3 blocks hit
    assert totals["kv_block_bytes"] == BLOCK_BYTES and device["retained_bytes"] == 4 * BLOCK_BYTES
    scraped = scrape(served.app.state.metrics)  # what GET /metrics renders
    assert scraped["kvtier:retained_keys"][()] == totals["retained_keys"]
    assert scraped["kvtier:retained_hit_tokens_total"][()] == totals["retained_hit_tokens"]
    assert scraped["kvtier:tier_retained_blocks"][(("tier", "device"),)] == device["retained_blocks"]
