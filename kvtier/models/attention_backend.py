"""Which kernels run a model's attention: ``EngineArgs.attention_backend`` resolved for a device.

::

    name     on CUDA                                 on a CPU
    ──────   ─────────────────────────────────────   ─────────────────────────────────────────────────
    auto     triton when it imports, else torch      c
    torch    the reference path (gather + SDPA)      the reference path
    c        torch (the C kernels are CPU-only)      kvattn.c decode (and the C decode program) where
                                                     they cover the cache and step, else torch
    triton   triton_attention.py's kernels           the same kernels through Triton's interpreter, only
                                                     with TRITON_INTERPRET=1 (numpy: slow, for tests)

The resolved name travels to ``attention.paged_attention`` as its ``kernel`` argument (``True`` is
``c``, ``False`` is ``torch``). Nothing here imports triton: ``triton_attention`` is imported the first
time a step runs through it, so kvtier runs without triton installed.
"""

from __future__ import annotations

import importlib.util
import os

from kvtier.config import ConfigError

TORCH, C, TRITON = "torch", "c", "triton"
_TRUE = ("1", "true", "on", "yes")  # what Triton's own TRITON_INTERPRET switch accepts


def triton_installed() -> bool:
    """Whether ``import triton`` would find the package (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run through its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def resolve(name: str, device_type: str) -> str:
    """``torch``, ``c`` or ``triton``: what attention backend ``name`` runs on a ``device_type`` device
    (the table above); ConfigError when ``triton`` cannot run there."""
    if name == "auto":
        if device_type == "cpu":
            return C
        return TRITON if device_type == "cuda" and triton_installed() else TORCH
    if name != TRITON:
        return name
    if not triton_installed():
        raise ConfigError("attention_backend=triton needs the triton package (pip install 'kvtier[gpu]')")
    if device_type != "cuda" and not interpreting():
        raise ConfigError(
            f"attention_backend=triton runs on CUDA; on {device_type} only through Triton's interpreter "
            "(set TRITON_INTERPRET=1: slow, for tests)"
        )
    return TRITON
