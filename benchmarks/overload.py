"""Goodput under overload, measured by a third-party load generator (guidellm) against ``kvtier serve``.

::

    make bench-overload                      # guidellm in .venv-guidellm, then this script
    .venv/bin/python benchmarks/overload.py --guidellm .venv-guidellm/bin/guidellm \\
        [--serve-args "--max-queue-wait-s 10"] [--capacity REQ_PER_S] [--duration 40] \\
        [--factors 0.5,1,2] [--url URL]

1. Starts ``kvtier serve`` on a free port (the default model; ``--serve-args`` adds flags), or drives
   the one at ``--url``.
2. Capacity: unless given, the completed requests/s of a closed loop of ``--streams`` clients
   (guidellm's ``concurrent`` profile: a client sends its next request when the last one ends).
3. guidellm's ``constant`` profile at 0.5x, 1x and 2x that capacity for ``--duration`` s each: synthetic
   prompts of ``--prompt-tokens``, answers of exactly ``--output-tokens`` (guidellm sends ignore_eos).
4. A table per rate: sent, completed, refused (errors: the server's 503s), unfinished when the run
   ended, completed/s, TTFT p50/p90 of the completed; then the two ratios at 2x vs 1x (targets:
   completed/s >= 0.8x, TTFT p90 <= 3x).

The server runs in this process's machine; nothing but loopback is contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(serve_args: str, cwd: Path | None = None) -> tuple[subprocess.Popen[bytes], str, str]:
    """``kvtier serve`` on a free port, run from ``cwd`` (its ``kvtier`` package: another checkout's,
    when given); (process, URL, tokenizer directory) once it answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", "--port", str(port), *shlex.split(serve_args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"overload: kvtier serve exited with {proc.returncode}")
        time.sleep(1)
    return proc, url, tokenizer_dir()


def tokenizer_dir() -> str:
    """The default model's converted directory (tokenizer.json + config), for guidellm's tokenizer."""
    from kvtier.models.loader import converted_dir, default_model_path  # noqa: PLC0415 - only when run

    return str(converted_dir(default_model_path())[0])


def guidellm(exe: str, url: str, tokenizer: str, profile: str, args: argparse.Namespace) -> dict[str, Any]:
    """One guidellm run; its benchmark's ``metrics`` and request totals."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        data = f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}"
        cmd = [
            exe, "run",
            "--backend", f"kind=openai_http,target={url}",
            "--profile", profile,
            "--constraint", f"kind=max_duration,seconds={args.duration}",
            "--data", data,
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--output", f"kind=json,path={out}",
            "--disable-console",
        ]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        bench = json.loads(out.read_text())["benchmarks"][0]
    return {"metrics": bench["metrics"], "duration": bench["duration"]}


SERVER_MEANS = {"queue": "kvtier:request_queue_time_seconds", "ttft": "kvtier:time_to_first_token_seconds"}


def server_sums(url: str) -> dict[str, float]:
    """The server's own ``_sum`` and ``_count`` of its queue-time and TTFT histograms (``/metrics``)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    sums: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in SERVER_MEANS.values():
            sums[name] = float(value)
    return sums


def server_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean seconds per request between two ``server_sums``: arrival -> first scheduled step (queue) and
    arrival -> first token (ttft), as the server saw them (no HTTP, no client)."""
    means = {}
    for key, metric in SERVER_MEANS.items():
        n = after.get(metric + "_count", 0.0) - before.get(metric + "_count", 0.0)
        total = after.get(metric + "_sum", 0.0) - before.get(metric + "_sum", 0.0)
        means[f"server_{key}_mean_s"] = total / n if n else float("nan")
    return means


def row(label: str, rate: float | None, run: dict[str, Any]) -> dict[str, Any]:
    m = run["metrics"]
    totals = m["request_totals"]
    ttft = m["time_to_first_token_ms"]["successful"]["percentiles"]
    return {
        "load": label,
        "rate": rate,
        "sent": totals["total"],
        "completed": totals["successful"],
        "refused": totals["errored"],
        "unfinished": totals["incomplete"],
        "completed_per_s": totals["successful"] / run["duration"],
        "ttft_p50_s": ttft["p50"] / 1000 if totals["successful"] else float("nan"),
        "ttft_p90_s": ttft["p90"] / 1000 if totals["successful"] else float("nan"),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ("load", "rate req/s", "sent", "completed", "refused", "unfinished", "completed/s")
    means = ("server queue mean s", "server TTFT mean s")
    print("| " + " | ".join((*cols, "TTFT p50 s", "TTFT p90 s", *means)) + " |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rate = f"{r['rate']:.2f}" if r["rate"] is not None else "closed loop"
        print(
            f"| {r['load']} | {rate} | {r['sent']} | {r['completed']} | {r['refused']} | {r['unfinished']} "
            f"| {r['completed_per_s']:.3f} | {r['ttft_p50_s']:.2f} | {r['ttft_p90_s']:.2f} "
            f"| {r['server_queue_mean_s']:.2f} | {r['server_ttft_mean_s']:.2f} |"
        )
    by = {r["load"]: r for r in rows}
    if "1x" in by and "2x" in by and by["1x"]["completed"]:
        done = by["2x"]["completed_per_s"] / by["1x"]["completed_per_s"]
        ttft = by["2x"]["ttft_p90_s"] / by["1x"]["ttft_p90_s"]
        print(
            f"2x vs 1x: completed/s {done:.2f}x (target >= 0.8), completed TTFT p90 {ttft:.2f}x (target <= 3)"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--guidellm", default=str(ROOT / ".venv-guidellm/bin/guidellm"))
    p.add_argument("--serve-args", default="", help="extra kvtier serve flags")
    p.add_argument("--url", default=None, help="drive this running kvtier serve")
    p.add_argument("--capacity", type=float, default=None, help="req/s (default: measured)")
    p.add_argument("--streams", type=int, default=8, help="closed-loop clients measuring capacity")
    p.add_argument("--duration", type=float, default=40.0, help="seconds per run (default 40)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--factors", default="0.5,1,2", help="rates, as multiples of the capacity")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    if not Path(args.guidellm).exists():
        raise SystemExit(f"overload: no guidellm at {args.guidellm} (make bench-overload installs it)")
    if args.url:
        proc, url, tokenizer = None, args.url.rstrip("/"), tokenizer_dir()
    else:
        proc, url, tokenizer = start_server(args.serve_args)
    rows = []
    try:
        capacity = args.capacity
        if capacity is None:
            before = server_sums(url)
            run = guidellm(args.guidellm, url, tokenizer, f"kind=concurrent,streams={args.streams}", args)
            rows.append(
                row(f"capacity ({args.streams} streams)", None, run) | server_means(before, server_sums(url))
            )
            capacity = rows[-1]["completed_per_s"]
        for factor in (float(f) for f in args.factors.split(",")):
            rate = factor * capacity
            before = server_sums(url)
            run = guidellm(args.guidellm, url, tokenizer, f"kind=constant,rate={rate:.4f}", args)
            rows.append(row(f"{factor:g}x", rate, run) | server_means(before, server_sums(url)))
            time.sleep(5)  # the last run's unfinished requests drain
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
