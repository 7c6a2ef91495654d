"""SIGTERM to a real ``kvtier serve`` process with a streaming and a non-streaming request in flight: both
finish cleanly within the grace period, ``/health`` turns 503 meanwhile, and the process exits 0 with no
traceback. Also its first contact: the ready line names the URL and the tier sizes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def test_sigterm_lets_running_requests_finish() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", "--port", "0", "--shutdown-timeout", "60"]
    cmd += ["--kv-device-blocks", "64", "--num-threads", "1", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = iter(proc.stderr.readline, "")
        url = next(
            re.search(r"serving .* on (http://\S+) ", line) for line in lines if "serving" in line
        ).group(1)
        ready = next(line for line in lines if line.startswith("kvtier: ready"))  # the model has loaded
        assert ready.startswith("kvtier: ready:") and url in ready and "device 64 blocks" in ready, ready
        assert httpx.get(url + "/health").status_code == 200
        body = {"model": MODEL, "prompt": "Count to a hundred:", "max_tokens": 40, "ignore_eos": True}
        answers: dict[str, httpx.Response] = {}
        thread = threading.Thread(
            target=lambda: answers.update(json=httpx.post(url + "/v1/completions", json=body, timeout=120))
        )
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # generating
            thread.start()
            time.sleep(0.3)
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            assert httpx.get(url + "/health").json() == {"status": "draining"}
            refused = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
            events = [line[6:] for line in lines if line.startswith("data: ")]
        thread.join(60)
        assert events[-1] == "[DONE]"
        finals = [json.loads(e)["choices"][0] for e in events[:-1] if json.loads(e)["choices"]]
        assert finals[-1]["finish_reason"] == "length"
        assert answers["json"].status_code == 200
        assert answers["json"].json()["usage"]["completion_tokens"] == 40
        assert proc.wait(60) == 0
        assert time.monotonic() - start < 60
        log = proc.stderr.read()
        assert "Traceback" not in log and "InvalidStateError" not in log and "draining" in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
