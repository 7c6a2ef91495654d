"""``kvtier plan --from-server URL``: a running server's miss-ratio curves and sizing advice, as text.

::

    $ kvtier plan --from-server http://127.0.0.1:8000
    tier    size         0.25x   0.5x     1x     2x     4x     8x   (prompt blocks served from cache)
    device  0.06 GiB     41.0%  52.3%  60.1%  71.9%  80.2%  80.2%
    host    0.12 GiB     60.1%  64.0%  71.9%  80.2%  80.2%  80.2%
    advice:
      - a host tier of 0.25 GiB (2× today's) would have served 12% more prompt tokens from cache (...)
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def fetch_advice(url: str, api_key: str | None = None, timeout: float = 30.0) -> dict[str, Any]:
    """``GET {url}/v1/kv/advice``; ``OSError``/``ValueError`` with one line on failure."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--from-server needs an http:// or https:// URL, got {url!r}")
    request = urllib.request.Request(url.rstrip("/") + "/v1/kv/advice")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - http(s) only
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise OSError(f"{url}: HTTP {exc.code} from /v1/kv/advice (is --api-key right?)") from None
    except urllib.error.URLError as exc:
        raise OSError(f"{url}: cannot reach the server ({exc.reason})") from None
    except json.JSONDecodeError:
        raise ValueError(f"{url}: /v1/kv/advice did not answer JSON (is it a kvtier server?)") from None
    if not isinstance(body, dict) or "tiers" not in body:
        raise ValueError(f"{url}: /v1/kv/advice answered without 'tiers' (is it a kvtier server?)")
    return body


def render_advice(advice: dict[str, Any], source: str) -> str:
    """The curves as a table, then the sentences."""
    factors = [p["size_factor"] for p in next(iter(advice["tiers"].values()), {"curve": []})["curve"]]
    head = f"{'tier':<8}{'size':>11}  " + "".join(f"{f:>7g}x" for f in factors)
    lines = [
        f"kvtier plan --from-server {source}: {advice.get('lookups', 0)} prompt blocks looked up, "
        f"{advice.get('sampled_accesses', 0)} sampled (rate {advice.get('sampling_rate', 0):.3g})",
        head + "   (estimated share of prompt blocks served from cache)",
    ]
    for tier, t in advice["tiers"].items():
        cells = "".join(f"{p['hit_ratio']:>8.1%}" for p in t["curve"])
        lines.append(f"{tier:<8}{t['capacity_bytes'] / 2**30:>7.2f} GiB  {cells}")
    lines.append("advice:")
    lines += [f"  - {s}" for s in advice.get("advice", [])] or ["  (no change suggested)"]
    return "\n".join(lines)
