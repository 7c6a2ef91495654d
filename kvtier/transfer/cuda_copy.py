"""``cudaMemcpy2DAsync``, which torch does not expose: one slot of a run of blocks in one copy.

The pool and the host buffer are block-major (``[NB, S, ...]``), so one layer slot of ``n`` consecutive
blocks is ``n`` rows of ``slot_bytes`` at a pitch of ``block_bytes`` on both sides. torch's ``copy_`` of
such strided views between host and device makes both contiguous first (a synchronous host copy); the
runtime's 2-D copy moves them as they lie, asynchronously on a stream, from pinned memory.

CUDA-only and small on purpose: the runtime library is the one torch loaded (found in this process's
memory maps), called through ``ctypes``. ``available()`` is False where it cannot be found, and the
mover then keeps whole-block copies. Nothing here runs on a CPU.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

H2D = 1  # cudaMemcpyHostToDevice


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The CUDA runtime torch loaded, with ``cudaMemcpy2DAsync`` typed; None if not found."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    paths = [line.split()[-1] for line in maps.read_text().splitlines() if "libcudart.so" in line]
    if not paths:
        return None
    lib = ctypes.CDLL(paths[0])
    fn = lib.cudaMemcpy2DAsync
    size = ctypes.c_size_t
    fn.argtypes = [ctypes.c_void_p, size, ctypes.c_void_p, size, size, size, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the 2-D copy can be called here (after torch initialized CUDA)."""
    return _runtime() is not None


def copy_2d_h2d(
    dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int
) -> None:
    """``height`` rows of ``width`` bytes from pinned host address ``src`` to device address ``dst``
    (rows ``src_pitch`` / ``dst_pitch`` bytes apart), enqueued on the CUDA stream handle ``stream``."""
    lib = _runtime()
    assert lib is not None, "cuda_copy.available() is False"
    err = lib.cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, H2D, stream)
    if err != 0:
        raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err}")
