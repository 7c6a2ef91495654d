"""The C kernels — quantized weights (``qmatmul.c``) and the fused fp32 per-layer ops and decode GEMV
(``fused.c``): compiled with gcc at first use, loaded with ctypes.

The shared library is built into ``<kvtier cache>/kernels/qmatmul-<source hash>.so`` under a file lock
(``make setup`` builds it too), so every later process just loads it. Where there is no compiler, or
the CPU lacks AVX2/FMA/F16C, or the build fails, ``kernels()`` logs one line and returns None: callers
then keep the dequantized fp32 weights (``weight_dtype="auto"`` never needs the kernels).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qmatmul.c")
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "INT8": 100}  # kernel ids (GGML type numbers for GGUF ones)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "INT8": 32}  # bytes per 32 weights
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared")
_state: dict[str, ctypes.CDLL | None] = {}


def kernel_dir() -> Path:
    """Where built kernels live: ``$KVTIER_CACHE_DIR/kernels`` or ``~/.cache/kvtier/models/kernels``."""
    from kvtier.models.loader import default_cache_dir

    return default_cache_dir() / "kernels"


def library_path(source: Path = SOURCE) -> Path:
    """The shared library built from ``source`` (its name carries the digest of the source, the headers
    beside it that kernels include, and the flags)."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    text = source.read_bytes() + headers + " ".join(CFLAGS).encode()
    digest = hashlib.blake2b(text, digest_size=8).hexdigest()
    return kernel_dir() / f"{source.stem}-{digest}.so"


def cpu_ok() -> bool:
    """Whether the CPU has the instructions the kernels use (Linux: /proc/cpuinfo; else assume yes)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return all(f" {flag}" in flags for flag in ("avx2", "fma", "f16c"))


@contextlib.contextmanager
def _lock(path: Path):
    """An exclusive inter-process lock on ``path`` (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(target: Path | None = None, source: Path = SOURCE) -> Path:
    """Compile ``source`` (default ``qmatmul.c``; other kernel files share this builder) into ``target``
    (default ``library_path(source)``) unless it is there already."""
    target = target or library_path(source)
    if target.is_file():
        return target
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.parent / ".build.lock"):
        if target.is_file():  # another process built it meanwhile
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            cmd = [compiler, *CFLAGS, str(source), "-o", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip().splitlines()[-1:]}")
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return target


FUSED = Path(__file__).with_name("fused.c")
PROGRAM = Path(__file__).with_name("decode_program.c")  # kvtier/models/decode_program.py


def _bind(lib: ctypes.CDLL, source: Path) -> ctypes.CDLL:
    """Declare the argument types of the exported functions."""
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {
        "kv_qmatmul": [i32, p, p, p, p, i64, i64, i64, i32, i32],
        "kv_dequantize": [i32, p, p, p, i64, i64, i32],
        "kv_rmsnorm": [p, i64, p, p, i64, i64, i64, f32],
        "kv_rope": [p, i64, p, p, i64, i64, i64],
        "kv_rope_store": [p, i64, p, p, i64, i64, i64, i64, i64, p, p],
        "kv_silu_mul": [p, p, i64, i64],
        "kv_sgemv_t": [p, i64, p, p, p, i64, i64, i32, i32],
        "kv_decode_layers": [p, p, i64],
    }
    for name, args in signatures.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = None
    return lib


def load_library(source: Path) -> ctypes.CDLL:
    """Build (when needed) and load ``source``'s library; raises OSError, RuntimeError or
    SubprocessError when it is unavailable here (``KVTIER_NO_KERNELS``, no AVX2, no compiler)."""
    if os.environ.get("KVTIER_NO_KERNELS"):
        raise RuntimeError("disabled by KVTIER_NO_KERNELS")
    if not cpu_ok():
        raise RuntimeError("this CPU lacks AVX2/FMA/F16C")
    return ctypes.CDLL(str(build(source=source)))


def kernels(source: Path = SOURCE) -> ctypes.CDLL | None:
    """The loaded kernel library built from ``source`` (``qmatmul.c``, or ``FUSED``: the per-layer fused
    ops), building it first when needed; None (logged once) when unavailable."""
    if source.name in _state:
        return _state[source.name]
    lib = None
    try:
        lib = _bind(load_library(source), source)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        if not any(v is None for v in _state.values()):  # one line per process, whichever failed first
            logger.warning("kvtier: C kernels unavailable (%s); using torch ops and dense fp32 weights", exc)
    _state[source.name] = lib
    return lib


if __name__ == "__main__":  # `python -m kvtier.models.qkernels`: build now (make setup)
    for src in (SOURCE, FUSED, PROGRAM):
        print(f"kvtier: {src.stem} kernels {'ready' if kernels(src) else 'not built'}: {library_path(src)}")
