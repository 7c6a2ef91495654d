"""The CPU KV pool's pages are mapped in the background, its bytes unchanged (kvtier/models/prefault.py)."""

from __future__ import annotations

import mmap
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.models.prefault import populate_write, prefault_in_background

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
MB = 2**20


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_calloc_pool_is_mapped_without_changing_a_byte() -> None:
    # As kv_quant._zeros: zero pages, never touched. A fresh anonymous mapping guarantees that here: a
    # long test process's calloc may reuse heap pages it zeroes, already resident (CI on one machine).
    area = mmap.mmap(-1, 128 * MB)
    pool = torch.frombuffer(area, dtype=torch.uint8)
    pool[5 * MB : 5 * MB + 3] = torch.tensor([7, 8, 9], dtype=torch.uint8)  # a block the engine wrote
    before = resident_bytes()
    if not populate_write(pool):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    assert resident_bytes() - before > 100 * MB  # the pages are mapped now, not at the first write
    assert pool[5 * MB : 5 * MB + 3].tolist() == [7, 8, 9] and int(pool.sum()) == 24


def test_in_the_background_while_the_pool_is_written() -> None:
    pool = torch.from_numpy(np.zeros(256 * MB, dtype=np.uint8))
    thread = prefault_in_background(pool)
    assert thread is not None and thread.daemon
    deadline = time.monotonic() + 30
    rows = pool.view(256, MB)
    for i in range(0, 256, 8):  # the engine writes blocks meanwhile: nothing it wrote is lost
        rows[i].fill_(1)
    thread.join(max(0.0, deadline - time.monotonic()))
    assert not thread.is_alive()
    assert int(rows.sum(dim=1).count_nonzero()) == 32 and int(rows[8].sum()) == MB


def test_a_pool_not_in_cpu_memory_is_left_alone() -> None:
    assert prefault_in_background(torch.zeros(4, device="meta")) is None
    assert not populate_write(torch.zeros(8, 8).t())  # not contiguous: not a pool


def test_kvtier_serve_maps_its_engine_pool(
    tiny_llama_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.config import EngineArgs
    from kvtier.models import prefault
    from kvtier.server.serve import engine_factory

    seen: list[torch.Tensor] = []
    monkeypatch.setattr(prefault, "prefault_in_background", seen.append)
    engine = engine_factory(EngineArgs(model=str(tiny_llama_dir()), dtype="float32", kv_device_blocks=32))()
    assert len(seen) == 1 and seen[0] is engine.runner.cache.raw
