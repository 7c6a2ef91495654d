"""A real headless Chromium (Debian's ``chromium`` package) driven over the Chrome DevTools Protocol, for
the tests of the ``/dashboard`` page. Under ``CI=true`` a missing browser is a test failure, not a skip
(``make setup`` installs it, as it does ``redis-server``).

::

    with Chromium(tmp_path) as browser:
        page = browser.open(url)                       # a new tab, Runtime/Log/Page events recorded
        page.wait_for("document.body.dataset.updates >= 2")
        page.evaluate("document.title")                # a JSON-able value
        page.screenshot(path)                          # PNG of the whole page
        page.errors()                                  # console errors, uncaught exceptions, failed loads

The browser is started with ``--remote-debugging-port=0``; the port it picked is read from
``DevToolsActivePort`` in its profile directory, and each tab is one websocket (``websocket-client``).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

BINARIES = ("chromium", "chromium-browser", "google-chrome")


def chromium_binary() -> str:
    """The browser's path; skips the test when missing, fails it under CI."""
    for name in BINARIES:
        path = shutil.which(name)
        if path is not None:
            return path
    message = "Chromium is not installed (make setup installs it: apt-get install chromium)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


class Page:
    """One tab: send CDP commands, keep the events that say something went wrong."""

    def __init__(self, ws_url: str) -> None:
        import websocket  # websocket-client

        self._ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self._ids = 0
        self.events: list[dict[str, Any]] = []
        for domain in ("Runtime", "Log", "Page"):
            self.send(f"{domain}.enable")

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Run one command and return its result (events that arrive meanwhile are kept)."""
        self._ids += 1
        self._ws.send(json.dumps({"id": self._ids, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv())
            if message.get("id") == self._ids:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            if "method" in message:
                self.events.append(message)

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        # False, not an exception, while the page is still loading (no body yet)
        check = f"(() => {{ try {{ return Boolean({expression}); }} catch {{ return false; }} }})()"
        while not self.evaluate(check):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never had {expression} within {timeout} s: {self.errors()}")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> Path:
        shot = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and failed resource loads seen so far."""
        self.evaluate("0")  # collect the events that are already queued
        found = []
        for event in self.events:
            method, params = event["method"], event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(f"exception: {params['exceptionDetails']}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append(f"console.{params['type']}: {params.get('args')}")
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                entry = params["entry"]
                found.append(f"log: {entry.get('text')} {entry.get('url', '')}")
        return found

    def close(self) -> None:
        self._ws.close()


class Chromium:
    """A headless Chromium with its own profile in ``directory``; a context manager."""

    def __init__(self, directory: Path, width: int = 1440, height: int = 900) -> None:
        self.binary = chromium_binary()
        self.directory = directory
        self.size = (width, height)
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None

    def __enter__(self) -> Chromium:
        profile = self.directory / "profile"
        profile.mkdir(parents=True, exist_ok=True)
        args = [self.binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        args += ["--no-first-run", "--no-default-browser-check", "--disable-extensions", "--mute-audio"]
        args += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
        args += ["--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1"]
        args += [f"--user-data-dir={profile}", f"--window-size={self.size[0]},{self.size[1]}", "about:blank"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"Chromium did not start (exit code {self.proc.poll()})")
            time.sleep(0.05)
        self.port = int(port_file.read_text().split()[0])
        return self

    def open(self, url: str) -> Page:
        """A new tab showing ``url`` (its events recorded from before the navigation)."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(request, timeout=10) as answer:
            target = json.load(answer)
        page = Page(target["webSocketDebuggerUrl"])
        width, height = self.size
        metrics = dict(width=width, height=height, deviceScaleFactor=1, mobile=False)
        page.send("Emulation.setDeviceMetricsOverride", **metrics)
        page.send("Page.navigate", url=url)
        return page

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
