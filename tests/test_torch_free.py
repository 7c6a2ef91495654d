"""The bookkeeping packages never import torch: ``kvtier/kv/`` (blocks, hashes, the manager),
``kvtier/scheduler/`` (the step plan) and ``kvtier/tiers/`` (the tier contract and its lower tiers) run,
and are tested, on a machine without it; only ``kvtier/transfer/``, ``worker/`` and ``models/`` touch
tensors. Every module of the three packages is imported in a fresh interpreter (so a module added later
is covered too), and ``sys.modules`` is checked after each one, naming the first that pulled torch in.
The router has the same check of its own (``tests/test_router_policy.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvtier"
TORCH_FREE = ("kv", "scheduler", "tiers")


def _modules() -> list[str]:
    names = []
    for package in TORCH_FREE:
        for path in sorted((PACKAGE / package).glob("*.py")):
            stem = "" if path.stem == "__init__" else f".{path.stem}"
            names.append(f"kvtier.{package}{stem}")
    return names


def test_kv_scheduler_and_tiers_never_import_torch() -> None:
    modules = _modules()
    assert "kvtier.kv.block_pool" in modules and "kvtier.tiers.host" in modules  # the walk found them
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    assert 'torch' not in sys.modules, f'{name} imports torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
