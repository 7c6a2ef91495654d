"""``python -m benchmarks.insight_replay``: what the sizing trackers' replay costs a decode step under
steady load (no idle moment to replay in).

::

    python -m benchmarks.insight_replay [--checkouts .,/tmp/old] [--rounds 2]

The trackers of ``kvtier/insight`` (a reuse-distance tracker, thirteen simulated sizes per lower tier)
are fed every lookup, computed, freed and offered block; their events are queued and replayed when the
engine idles, and under steady load a slice before each step (``CacheInsight.catch_up``). Here a
2-layer random model (the compute is small, as on a GPU, so the engine's own work shows) over a host
tier serves 16 streams decoding throughout while, every 2 steps, a prompt arrives: one of 4 documents of
4,096 tokens (a prefix hit after its first time) and a question of its own. Each step is timed, and the
replay inside it (``CacheInsight.drain``); ``replay_share``: of the steps' time.

For each checkout (a directory holding a ``kvtier`` package: this one, or an older revision's worktree),
one after the other, ``--rounds`` times, a fresh process: one row per run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCH, SHORT_TOKENS = 16, 256  # streams decoding throughout
# every EVERY steps a prompt arrives: one of DOCS documents (a prefix hit after its first time) and a
# question of its own (RAG, agents: the lookups are long, the compute short)
DOCS, LONG_TOKENS, QUESTION_TOKENS, EVERY, STEPS = 4, 4096, 32, 2, 240


def measure() -> dict[str, float]:
    """One run in this process (the ``kvtier`` on ``sys.path``)."""
    from kvtier import LLM, SamplingParams
    from kvtier.bench.gpu_models import Shape, random_prompts, write_checkpoint

    shape = Shape("probe-2-layers", "llama", 2, 64, 128, 4, 2, 16, 512, 10_000.0, 40_960)
    directory = write_checkpoint(shape, Path(tempfile.mkdtemp()) / "model")
    llm = LLM(str(directory), dtype="float32", kv_device_blocks=1024, kv_host_gb=0.25, max_model_len=8192,
              max_num_batched_tokens=4096)  # fmt: skip
    engine, insight = llm.engine, llm.engine.insight
    spent: list[float] = []
    real = insight.drain

    def timed(*args: object, **kwargs: object) -> object:
        t = time.perf_counter()
        result = real(*args, **kwargs)  # type: ignore[arg-type]
        spent.append(time.perf_counter() - t)
        return result

    insight.drain = timed  # type: ignore[method-assign]
    streams = SamplingParams(temperature=0.0, max_tokens=STEPS + 8, ignore_eos=True)
    for prompt in random_prompts(BATCH, SHORT_TOKENS, 2, shape.vocab):
        engine.add_request({"prompt_token_ids": prompt}, streams)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    docs = random_prompts(DOCS, LONG_TOKENS, 1, shape.vocab)
    questions = random_prompts(STEPS // EVERY + 1, QUESTION_TOKENS, 3, shape.vocab)
    longs = iter(docs[i % DOCS] + q for i, q in enumerate(questions))  # a document hit, a new question
    steps, replays, most = [], [], 0
    for i in range(STEPS):
        if i % EVERY == 0:  # its lookup (256 blocks), its blocks cached, freed, offered below
            engine.add_request({"prompt_token_ids": next(longs)}, one)
        spent.clear()
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
        replays.append(sum(spent))
        most = max(most, insight._backlog_keys)
    llm.close()
    import kvtier

    return {
        "kvtier": str(Path(kvtier.__file__).parent.parent),
        "steps": len(steps),
        "step_ms": 1000 * statistics.median(steps),
        "step_p90_ms": 1000 * sorted(steps)[int(0.9 * len(steps))],
        "replay_share": sum(replays) / sum(steps),
        "replay_max_ms": 1000 * max(replays),
        "backlog_max": most,
        "backlog_end": insight._backlog_keys,
        "sheds": getattr(insight, "num_sheds", 0),
        "host_rate": insight.trackers[next(m for m in insight.trackers if m.value == "host")].rate,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkouts", default=".", help="comma-separated directories holding a kvtier package")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.child:
        print(json.dumps(measure()))
        return
    rows = []
    for r in range(ns.rounds):
        for checkout in ns.checkouts.split(","):
            env = {**os.environ, "PYTHONPATH": str(Path(checkout).resolve())}  # its kvtier, not this one's
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child"]
            run = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if run.returncode != 0:
                sys.exit(f"{checkout}: the run failed:\n{run.stderr[-2000:]}")
            out = run.stdout
            rows.append({"checkout": checkout, "round": r + 1, **json.loads(out.strip().splitlines()[-1])})
    from kvtier.bench.gpu_report import table

    names = list(rows[0])
    print(table(names, [[row[n] for n in names] for row in rows]))


if __name__ == "__main__":
    main()
