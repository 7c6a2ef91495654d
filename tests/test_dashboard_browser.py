"""``/dashboard`` in a real headless Chromium (Debian's package): a ``kvtier serve`` app with a device
pool, a host tier and an API key is given traffic that evicts, reloads from the host tier and preempts;
the page, opened with ``?key=``, shows live data whose every number equals ``/metrics``, keeps updating,
draws its charts and block map, asks for a key when it has none, and logs no console error.

The test keeps its screenshot in its tmp_path. The README's docs/dashboard.png is the second test's, taken
while requests run: ``KVTIER_DASHBOARD_MODEL=default KVTIER_DASHBOARD_SCREENSHOT=docs/dashboard.png
.venv/bin/python -m pytest -q tests/test_dashboard_browser.py -k readme`` (the real SmolLM2).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier import LLM
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.serve import BackgroundServer, serve_in_thread
from tests.chromium import Chromium, Page

pytestmark = pytest.mark.slow

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # tiny llama: layers x (K, V) x kv heads x head dim x fp32 x 16 slots
DEVICE_BLOCKS = 24
# Every element the page marks with data-metric, as {metric, labels, value, text}.
SHOWN = """[...document.querySelectorAll('[data-metric]')].map(e => ({metric: e.dataset.metric,
  labels: e.dataset.labels || '', value: Number(e.dataset.value), text: e.textContent}))"""


def tokens(i: int, n: int) -> list[int]:
    return [10 + (7 * i + j) % 490 for j in range(n)]


@pytest.fixture
def server(tiny_llama_dir: Callable[..., Path]) -> Iterator[BackgroundServer]:
    model = os.environ.get("KVTIER_DASHBOARD_MODEL") or str(tiny_llama_dir())
    # canary_rate 1: every request served from cache is rechecked (when idle), so the page has checks to show
    engine: dict[str, Any] = dict(
        kv_device_blocks=DEVICE_BLOCKS, max_num_seqs=4, num_threads=1, canary_rate=1.0
    )
    engine["kv_host_gb"] = 64 * BLOCK_BYTES / 2**30
    if model == "default":  # the README's screenshot: SmolLM2, a bigger pool
        model, engine["kv_device_blocks"], engine["kv_host_gb"] = None, 24, 0.25
    settings = ServerSettings(model_name="dashboard-test", api_key=KEY)
    srv = serve_in_thread(create_app(lambda: LLM(model, **engine).engine, settings))
    srv.wait_ready()
    yield srv
    srv.stop()


def complete(
    server: BackgroundServer, prompt: list[int] | list[list[int]], max_tokens: int, **extra: Any
) -> None:
    body = {"model": "dashboard-test", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    answer = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert answer.status_code == 200, answer.text


def traffic(server: BackgroundServer) -> None:
    """Preemptions (four sequences that outgrow the device pool together), evictions into the host tier,
    then prompts served from the host tier (their blocks end up on the device, loaded from there)."""
    complete(server, [tokens(i, 64) for i in range(4)], 60)
    for i in range(10, 15):
        complete(server, tokens(i, 80), 4)
    for i in (10, 11):
        complete(server, tokens(i, 80), 4)


def settle(server: BackgroundServer, timeout: float = 30.0) -> None:
    """Until the engine has nothing left to do: no request, no canary check pending (it runs when idle)."""
    deadline = time.monotonic() + timeout
    while True:
        canary = httpx.get(server.url + "/v1/kv/canary", headers=AUTH)
        idle = canary.status_code == 404 or canary.json()["pending"] == 0
        if idle and server.app.state.engine.queue_depth() == 0:
            time.sleep(0.2)  # the snapshot after the last check
            return
        assert time.monotonic() < deadline, "the engine did not settle"
        time.sleep(0.1)


def scrape(server: BackgroundServer) -> dict[tuple[str, str], float]:
    text = httpx.get(server.url + "/metrics").text
    return {
        (s.name, ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def check_against_metrics(page: Page, server: BackgroundServer) -> list[dict[str, Any]]:
    """Every number the page shows that /metrics has too is equal to it (the engine is idle)."""
    shown = page.evaluate(SHOWN)
    scraped = scrape(server)
    for item in shown:
        key = (item["metric"], item["labels"])
        assert key in scraped, f"the page shows {key}, which /metrics does not have"
        assert math.isclose(item["value"], scraped[key], rel_tol=1e-9, abs_tol=1e-12), (item, scraped[key])
        if item["metric"].endswith("_perc"):
            shown_pct = float(item["text"].removesuffix("%"))  # rounded to 0.1 by the page
            assert item["text"].endswith("%") and abs(shown_pct - 100 * scraped[key]) <= 0.05001, item
        else:
            assert item["text"] == str(int(scraped[key])), item
    return shown


def check_curves(page: Page, server: BackgroundServer) -> None:
    advice = httpx.get(server.url + "/v1/kv/advice", headers=AUTH).json()
    drawn = page.evaluate(
        """[...document.querySelectorAll('#advice .curve')].map(c => [c.dataset.tier,
        [...c.querySelectorAll('circle[data-hit-ratio]')].map(p => [Number(p.dataset.sizeFactor),
         Number(p.dataset.hitRatio)]), c.textContent])"""
    )
    assert [tier for tier, _, _ in drawn] == list(advice["tiers"]) and "device" in advice["tiers"]
    for tier, points, text in drawn:
        curve = advice["tiers"][tier]["curve"]
        assert points == [[p["size_factor"], p["hit_ratio"]] for p in curve]
        assert f"now: {advice['tiers'][tier]['capacity_blocks']} blocks" in text


def wait_for_update(page: Page) -> None:
    """Until the page has rendered a poll that began after this call."""
    seen = page.evaluate("Number(document.body.dataset.updates)")
    page.wait_for(f"Number(document.body.dataset.updates) >= {seen + 2}")


def test_the_live_page_shows_what_metrics_says_and_keeps_up(server: BackgroundServer, tmp_path: Path) -> None:
    traffic(server)
    settle(server)
    scraped = scrape(server)
    assert scraped["kvtier:tier_hit_blocks_total", "tier=host"] > 0  # the traffic did reach the host tier
    assert sum(scraped["kvtier:num_preemptions_total", f"mode={m}"] for m in ("swap", "recompute")) > 0
    with Chromium(tmp_path) as browser:
        page = browser.open(server.url + "/dashboard?key=" + KEY)
        page.wait_for("Number(document.body.dataset.updates) >= 2")
        assert page.evaluate("location.search") == ""  # the key left the address bar for sessionStorage
        assert page.evaluate("document.getElementById('status').textContent") == "live"

        # Act 1: every number on the page is the one /metrics has.
        shown = check_against_metrics(page, server)
        metrics = {(s["metric"], s["labels"]) for s in shown}
        assert ("kvtier:tier_hit_blocks_total", "tier=host") in metrics and len(shown) >= 25
        assert ("kvtier:num_preemptions_total", "mode=recompute") in metrics
        cards = page.evaluate("[...document.querySelectorAll('#tiers [data-tier]')].map(e => e.dataset.tier)")
        assert cards == ["device", "host"]

        # Act 2: the block map accounts for every device block, some loaded from the host tier.
        counts = page.evaluate(
            "['bm-free','bm-cached','bm-in-use'].map(id => Number(document.getElementById(id).textContent))"
        )
        assert sum(counts) == DEVICE_BLOCKS and counts[1] > 0
        assert "from host" in page.evaluate("document.getElementById('bm-legend').textContent")
        assert page.evaluate("document.getElementById('blockmap').height") > 0

        # Act 3: the charts have lines, the panels without a server endpoint say so.
        assert page.evaluate("document.querySelectorAll('#chart-usage path').length") == 2
        assert "idle" in page.evaluate("document.getElementById('requests').textContent")
        features = httpx.get(server.url + "/v1/kv/dashboard", headers=AUTH).json()["features"]
        for panel in ("advice", "canary"):
            text = page.evaluate(f"document.getElementById('{panel}').textContent")
            assert ("not available" in text) != features[panel], text
        if features["advice"]:  # the miss-ratio curves drawn are the server's, the current size marked
            check_curves(page, server)
        if features["canary"]:  # its checks by tier were among the numbers compared with /metrics
            assert ("kvtier:canary_checks_total", "result=match,tier=device") in metrics
            assert "cache agrees with recomputation" in page.evaluate(
                "document.getElementById('canary').textContent"
            )

        # Act 4: more traffic, retained for 24 hours and sent twice; the page follows within a couple of
        # polls, still matches /metrics, and shows the retained keys and the hits on them.
        for _ in range(2):
            complete(server, tokens(20, 40), 3, prompt_cache_retention="24h")
        settle(server)
        wait_for_update(page)
        shown = check_against_metrics(page, server)
        retained = {s["metric"]: s["value"] for s in shown if s["metric"].startswith("kvtier:retained")}
        assert retained == {"kvtier:retained_keys": 2, "kvtier:retained_hit_tokens_total": 32}, retained
        assert (
            page.evaluate(
                "Number(document.querySelector('[data-metric=\"kvtier:prompt_tokens_total\"]').dataset.value)"
            )
            == scrape(server)["kvtier:prompt_tokens_total", ""]
        )
        shot = page.screenshot(tmp_path / "dashboard.png")
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
        assert page.errors() == []

        # Act 5: a tab without the key asks for one, and shows the data once it is given.
        other = browser.open(server.url + "/dashboard")
        other.wait_for("!document.getElementById('keyform').hidden")
        assert other.evaluate("document.getElementById('status').textContent") == "API key needed"
        other.evaluate(f"document.getElementById('keyinput').value = '{KEY}'")
        other.evaluate("document.getElementById('keyform').requestSubmit()")
        other.wait_for("Number(document.body.dataset.updates) >= 1")
        errors = other.errors()
        assert all("401" in e for e in errors), errors  # the refused fetch, and nothing else


def readme_traffic(server: BackgroundServer) -> None:
    """Chat-like prompts sharing a prefix (device hits, evictions into the host tier), some of them again
    (host hits), then more at once than the device pool holds (preemptions, a queue)."""
    shared = tokens(50, 64)
    for i in range(8):
        complete(server, shared + tokens(60 + i, 48), 16)
    for i in range(3):
        complete(server, shared + tokens(60 + i, 48), 16)
    complete(server, [shared + tokens(80 + i, 16 + 8 * i) for i in range(6)], 120)


def test_readme_screenshot_with_requests_running(server: BackgroundServer, tmp_path: Path) -> None:
    """Only with KVTIER_DASHBOARD_SCREENSHOT: the page while requests run (what the README shows)."""
    target = os.environ.get("KVTIER_DASHBOARD_SCREENSHOT")
    if not target:
        pytest.skip("set KVTIER_DASHBOARD_SCREENSHOT=path to make the README's screenshot")
    busy = threading.Thread(target=readme_traffic, args=(server,))
    with Chromium(tmp_path, width=1440, height=1000) as browser:
        page = browser.open(server.url + "/dashboard?key=" + KEY)
        busy.start()
        preempted = "[...document.querySelectorAll('[data-metric=\"kvtier:num_preemptions_total\"]')]"
        page.wait_for(f"{preempted}.some(e => e.dataset.value > 0)", timeout=400)
        page.wait_for("document.querySelectorAll('#requests tr').length > 3", timeout=60)
        time.sleep(3)
        page.screenshot(Path(target))
        assert page.errors() == []
    busy.join()


def test_the_router_serves_the_cluster_page(
    server: BackgroundServer, tiny_llama_dir: Callable[..., Path], tmp_path: Path
) -> None:
    """``kvtier router`` in front of the replica: its /dashboard lists the replica, healthy, linking the
    replica's own page, and counts what it routed there."""
    from kvtier.router.app import create_app as create_router_app
    from kvtier.router.core import RouterSettings

    settings = RouterSettings(
        replicas=[server.url], policy="round_robin", api_key=KEY, model=str(tiny_llama_dir())
    )
    router = serve_in_thread(create_router_app(settings))
    try:
        deadline = time.monotonic() + 30
        while httpx.get(router.url + "/health").status_code != 200:  # its first health check of the replica
            assert time.monotonic() < deadline, "the router never found the replica healthy"
            time.sleep(0.1)
        body = {"model": "dashboard-test", "prompt": tokens(1, 40), "max_tokens": 2}
        answer = httpx.post(router.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
        assert answer.status_code == 200, answer.text
        with Chromium(tmp_path) as browser:
            page = browser.open(router.url + "/dashboard?key=" + KEY)  # /router/state needs the key
            page.wait_for("document.querySelectorAll('#replicas tbody tr').length == 1")
            assert page.evaluate("document.getElementById('replica-view').hidden") is True
            row = "document.querySelector('#replicas tbody tr')"
            assert page.evaluate(f"{row}.querySelector('a').href") == server.url + "/dashboard"
            page.wait_for(f"{row}.textContent.includes('healthy')")
            assert "round_robin" in page.evaluate("document.getElementById('replica').textContent")
            routed = httpx.get(router.url + "/router/state", headers=AUTH).json()["replicas"][0]["routed"]
            assert sum(routed.values()) == 1
            reason, n = next(iter(routed.items()))
            page.wait_for(f"{row}.textContent.includes('{reason} {n}')")
            page.screenshot(tmp_path / "cluster.png")
            assert page.errors() == []
    finally:
        router.stop()
