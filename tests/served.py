"""A real ``kvtier serve`` app over the embedded model, for the tests that talk to it over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvtier import LLM
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.serve import BackgroundServer, serve_in_thread

SMALL_ENGINE = dict(kv_device_blocks=256, max_num_seqs=8, num_threads=1)


@contextmanager
def served_llm(settings: ServerSettings, **engine: Any) -> Iterator[BackgroundServer]:
    """The app over ``LLM(**engine)`` (``SMALL_ENGINE`` by default) on a free loopback port, its model
    loaded; stopped after, and torch's thread count (the engine sets its own) put back."""
    threads = torch.get_num_threads()
    srv = serve_in_thread(create_app(lambda: LLM(**(engine or SMALL_ENGINE)).engine, settings))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
        torch.set_num_threads(threads)
