"""Map the CPU KV pool's pages before a step needs them.

On CPU the device pool comes from ``calloc`` (``kv_quant._zeros``): zero pages that the OS maps when
they are first written, so start-up does not write every byte. The step that first writes a block then
takes the page faults itself: loading 128 MB of handed-off KV into a decode replica's fresh blocks took
0.15-0.2 s of its step, against 0.04 s into mapped ones (``kvtier bench disagg``), and every stream in
that step waited for it. ``prefault_in_background`` asks Linux to map the pool's pages writable
(``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+) from a daemon thread, a chunk at a time, without
touching their contents, so it is safe while the engine already writes blocks. Elsewhere (another OS,
an older kernel, a GPU pool) it does nothing. ``kvtier serve`` calls it once its engine is built.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading

import torch

MADV_POPULATE_WRITE = 23  # linux/mman.h
CHUNK_BYTES = 64 * 2**20  # one madvise call

log = logging.getLogger(__name__)


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def populate_write(tensor: torch.Tensor) -> bool:
    """Map every whole page of a contiguous CPU ``tensor`` writable, its bytes unchanged; False where
    the OS cannot (nothing done). ctypes releases the GIL for each call: the engine runs meanwhile."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    page = os.sysconf("SC_PAGE_SIZE")
    addr = tensor.data_ptr()
    start = -(-addr // page) * page
    end = (addr + tensor.numel() * tensor.element_size()) // page * page
    while start < end:
        n = min(CHUNK_BYTES, end - start)
        if madvise(start, n, MADV_POPULATE_WRITE) != 0:
            log.debug("madvise(MADV_POPULATE_WRITE) failed: errno %d", ctypes.get_errno())
            return False
        start += n
    return True


def prefault_in_background(tensor: torch.Tensor) -> threading.Thread | None:
    """``populate_write(tensor)`` on a daemon thread (started); None for a pool not in CPU memory."""
    if tensor.device.type != "cpu":
        return None
    thread = threading.Thread(target=populate_write, args=(tensor,), name="kvtier-prefault", daemon=True)
    thread.start()
    return thread
