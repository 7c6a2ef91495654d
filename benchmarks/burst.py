"""``python -m benchmarks.burst``: does one long prompt in a quiet hour shut a server's door on the burst
after it?

::

    python -m benchmarks.burst [--checkouts .,/tmp/old] [--rounds 2] [--long-tokens 3000] [--burst 12]

For each checkout (a directory holding a ``kvtier`` package: this one, or an older revision's worktree),
one after the other, ``--rounds`` times: ``kvtier serve`` with its defaults starts from that directory,
answers ``--quiet`` short requests one at a time (a quiet hour: the running cap's step times are
measured, nobody queues), then a long prompt of ``--long-tokens`` beside one stream, then a burst of
``--burst`` short requests sent at once. A row per run: the running cap (``/metrics``) before and
after the long prompt, and the burst's refused (503) and served requests with the time they took.
Nothing but loopback is contacted; prompts are random token ids.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.overload import start_server
from kvtier.bench.cluster import scrape

SHORT_PROMPT, SHORT_ANSWER, STREAM_ANSWER = 64, 32, 200


def _body(model: str, rng: random.Random, prompt_tokens: int, max_tokens: int) -> dict[str, Any]:
    prompt = [rng.randrange(100, 30000) for _ in range(prompt_tokens)]
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}


def _cap(url: str) -> float:
    """``kvtier:running_cap`` on the server's ``/metrics``."""
    caps = [v for name, v in scrape(url).items() if name.partition("{")[0] == "kvtier:running_cap"]
    return caps[0] if caps else float("nan")


async def one_run(url: str, ns: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The quiet requests, the long prompt beside a stream, the burst: this run's row."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]

        def send(prompt_tokens: int, max_tokens: int) -> Any:
            return client.post(url + "/v1/completions", json=_body(model, rng, prompt_tokens, max_tokens))

        for _ in range(ns.quiet):
            (await send(SHORT_PROMPT, SHORT_ANSWER // 2)).raise_for_status()
        before = _cap(url)
        stream = asyncio.create_task(send(SHORT_PROMPT, STREAM_ANSWER))
        await asyncio.sleep(0.5)
        (await send(ns.long_tokens, 1)).raise_for_status()
        after = _cap(url)
        start = time.perf_counter()
        answers = await asyncio.gather(*(send(SHORT_PROMPT, SHORT_ANSWER) for _ in range(ns.burst)))
        seconds = time.perf_counter() - start
        (await stream).raise_for_status()
    codes = [a.status_code for a in answers]
    unexpected = sorted({c for c in codes if c not in (200, 503)})
    if unexpected:
        raise SystemExit(f"burst: the burst got HTTP {unexpected}")
    return {
        "cap_before": before, "cap_after_long": after,
        "refused": codes.count(503), "served": codes.count(200), "burst_s": seconds,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkouts", default=".", help="comma-separated directories to serve from (default: .)")
    p.add_argument("--rounds", type=int, default=1, help="runs per checkout, alternating (default 1)")
    p.add_argument("--quiet", type=int, default=12, help="short requests one at a time first (12)")
    p.add_argument("--long-tokens", type=int, default=3000, help="the long prompt's tokens (3000)")
    p.add_argument("--burst", type=int, default=12, help="short requests sent at once after it (12)")
    p.add_argument("--serve-args", default="", help="extra kvtier serve flags")
    ns = p.parse_args(argv)
    checkouts = [Path(c).resolve() for c in ns.checkouts.split(",")]
    for c in checkouts:
        if not (c / "kvtier" / "__init__.py").is_file():
            p.error(f"--checkouts: no kvtier package in {c}")
    if min(ns.rounds, ns.quiet, ns.long_tokens, ns.burst) < 1:
        p.error("--rounds, --quiet, --long-tokens and --burst must be >= 1")
    header = ("checkout", "round", "cap before", "after long", "refused", "served", "burst s")
    print(f"{header[0]:<28} " + " ".join(f"{h:>10}" for h in header[1:]))
    for r in range(ns.rounds):
        for c in checkouts:
            proc, url, _ = start_server(ns.serve_args, cwd=c)
            try:
                row = asyncio.run(one_run(url, ns, seed=r))
            finally:
                proc.terminate()
                proc.wait(60)
            print(
                f"{str(c)[-28:]:<28} {r + 1:>10} {row['cap_before']:>10g} {row['cap_after_long']:>10g} "
                f"{row['refused']:>10} {row['served']:>10} {row['burst_s']:>10.1f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
