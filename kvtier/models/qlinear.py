"""Linear layers over quantized weights, run by the C kernels of ``qmatmul.c``.

A ``QuantLinear`` holds one (possibly fused) weight ``W [N, K]`` as rows of quantized blocks — GGUF's own
Q8_0 / Q4_0 / Q4_1 blocks (``weight_dtype="gguf"``) or per-channel int8 with one fp32 scale per output row
(``weight_dtype="int8"``) — and computes ``x @ W^T`` without ever holding ``W`` in fp32:

* few rows (decode, small batches): the GEMV/small-M kernel decodes each block in registers to the exact
  fp32 weights of the dequantized model and multiplies by FMA, so the output equals the fp32 path up to
  fp32 summation order;
* many rows (prefill): the weight is dequantized into a reused fp32 scratch matrix and multiplied by
  ``torch.matmul`` (the work is compute-bound there, and MKL is faster than the kernel).

``DenseLinear`` is the same interface over a transposed fp32/bf16 matrix (``weight_dtype="auto"``), with
exactly the ops the model always used, so the default path stays bit for bit what it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvtier.models.qkernels import BLOCK_BYTES, QTYPES

PREFILL_ROWS = 32  # from this many rows on, dequantize-then-matmul beats the kernel (measured)
# Weights x rows from which a kernel call forks OpenMP threads: on a busy machine a fork/join costs more
# than it saves (a layer's GEMV measured ~35x slower), on a quiet one two threads halve it.
# ``calibrate`` picks one of the two for a model at load time (each QuantLinear carries it, so two
# engines in one process keep their own); $KVTIER_KERNEL_PARALLEL_MIN fixes it.
SERIAL, PARALLEL = 1 << 62, 1 << 18


def fixed_parallel_min() -> int | None:
    """The threshold ``$KVTIER_KERNEL_PARALLEL_MIN`` fixes, or None when it is not set."""
    value = os.environ.get("KVTIER_KERNEL_PARALLEL_MIN")
    return None if value is None else int(value)


def _threads(work: int, parallel_min: int) -> int:
    """OpenMP threads for a kernel call over ``work`` weight-rows: torch's thread count when big enough."""
    return torch.get_num_threads() if work >= parallel_min else 1


_scratch = threading.local()


def _scratch_matrix(n: int, k: int) -> torch.Tensor:
    """A reusable per-thread fp32 buffer viewed as ``[n, k]`` (grown on demand, never shrunk)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n * k:
        buf = _scratch.buf = torch.empty(n * k, dtype=torch.float32)
    return buf[: n * k].view(n, k)


# Parallel calls are chosen when their median is below this fraction of the serial median. It was 0.8:
# with the faster Q4 kernel (by-field rows) one gate_up call measured 0.53-0.83 (median ~0.72) of its
# serial time on the quiet machine, so 0.8 chose one thread in about one process of three, and those
# processes' gguf linears took 14-16 ms per token instead of ~9.5 (bench throughput, three runs). A
# busy machine's stalled fork/joins measure several times the serial call, far above 0.95.
PARALLEL_GAIN = 0.95


def calibrate(linear: QuantLinear, repeat: int = 21) -> int:
    """Time one row through ``linear`` ``repeat`` times on one thread and on torch's threads, call by
    call, alternating; return the ``parallel_min`` for its model: calls go parallel only when the median
    parallel call was clearly faster here. Medians, not totals: one preempted call among a handful (a
    total of 5 measured) flipped the choice between two runs on a quiet machine, halving int8 decode; a
    machine busy enough to stall most fork/joins still shows in the median."""
    fixed = fixed_parallel_min()
    if fixed is not None:
        return fixed
    if torch.get_num_threads() < 2:
        return SERIAL
    x = torch.randn(1, linear.K)
    y = torch.empty(1, linear.N)
    lin = linear

    def call(threads: int) -> None:
        args = (lin.qid, lin.data.data_ptr(), lin._scale_ptr, x.data_ptr(), y.data_ptr(), 1, lin.N, lin.K)
        lin.lib.kv_qmatmul(*args, 0, threads)

    return PARALLEL if _parallel_pays(call, repeat) else SERIAL


def _parallel_pays(call: Callable[[int], None], repeat: int) -> bool:
    """Whether ``call(threads)`` on torch's threads has a median below ``PARALLEL_GAIN`` of its median
    on one thread, over ``repeat`` calls each, alternating (after a warm-up that starts the OpenMP pool)."""
    many = torch.get_num_threads()
    times: dict[int, list[float]] = {1: [], many: []}
    for _ in range(3):
        for threads in times:
            call(threads)
    for _ in range(repeat):  # ~0.1-1 ms per call
        for threads, seen in times.items():
            t = time.perf_counter()
            call(threads)
            seen.append(time.perf_counter() - t)
    median = {threads: sorted(seen)[len(seen) // 2] for threads, seen in times.items()}
    return median[many] < PARALLEL_GAIN * median[1]


GEMV_ROWS = 4  # the fp32 GEMV of fused.c runs calls of at most this many rows (decode, small batches)


class DenseLinear:
    """``x @ w_t (+ b)`` over a transposed weight ``w_t [K, N]``: torch's matmul (MKL), or for 1-4 fp32
    rows on CPU the AVX2 GEMV of ``fused.c`` once ``calibrate_dense`` measured it faster here."""

    def __init__(self, w_t: torch.Tensor, b: torch.Tensor | None):
        self.w_t, self.b = w_t, b  # [K, N], [N] or None
        self.nbytes = w_t.numel() * w_t.element_size()
        self.K, self.N = w_t.shape
        self.gemv: tuple[ctypes.CDLL, int] | None = None  # (fused library, threads) once chosen

    def _gemv(self, x: torch.Tensor, y: torch.Tensor, accumulate: int) -> torch.Tensor:
        lib, threads = self.gemv  # type: ignore[misc]
        bias = None if self.b is None else self.b.data_ptr()
        args = (x.data_ptr(), x.shape[0], self.w_t.data_ptr(), bias, y.data_ptr(), self.K, self.N)
        lib.kv_sgemv_t(*args, accumulate, threads)
        return y

    def _use_gemv(self, x: torch.Tensor) -> bool:
        return self.gemv is not None and 0 < x.shape[0] <= GEMV_ROWS and x.is_contiguous() and x.is_cpu

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:  # [T, K] -> [T, N]
        """``out``: an optional [T, N] buffer to write into (a decode step reuses one per layer)."""
        if self._use_gemv(x):
            return self._gemv(x, x.new_empty(x.shape[0], self.N) if out is None else out, 0)
        if out is None:
            return torch.matmul(x, self.w_t) if self.b is None else torch.addmm(self.b, x, self.w_t)
        return (
            torch.matmul(x, self.w_t, out=out)
            if self.b is None
            else torch.addmm(self.b, x, self.w_t, out=out)
        )

    def residual(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:  # x [T, N] + a [T, K] @ w_t
        if self._use_gemv(a) and x.is_contiguous():
            return self._gemv(a, x, 1)  # in place: x += a @ w_t (+ b)
        return torch.addmm(x, a, self.w_t) if self.b is None else x + torch.addmm(self.b, a, self.w_t)


def _time_group(
    group: list[DenseLinear], choice: tuple[ctypes.CDLL, int] | None, repeat: int, give_up: float
) -> float:
    """Best-of-``repeat`` seconds for one fp32 row through every linear of ``group`` with ``choice``
    (after a warm-up pass); stops early once a pass is slower than ``give_up`` (a stalled thread)."""
    x, y = torch.randn(1, group[0].K), torch.empty(1, group[0].N)
    for lin in group:
        lin.gemv = choice
    best = float("inf")
    for _ in range(repeat + 1):
        t = time.perf_counter()
        for lin in group:
            lin(x, y)
        best = min(best, time.perf_counter() - t)
        if best > give_up:
            break
    return best


def _measure_choice(group: list[DenseLinear], lib: ctypes.CDLL, repeat: int, times: dict[str, float]) -> int:
    """0 (torch's matmul) or 1 (the GEMV) for ``group``: the GEMV when its faster thread count (one, or
    torch's) was > 10% faster than torch's matmul."""
    mkl = _time_group(group, None, repeat, float("inf"))
    key = f"{group[0].K}x{group[0].N}"
    times[f"{key}:mkl"] = mkl * 1e3
    best = float("inf")
    for threads in sorted({1, torch.get_num_threads()}):
        gemv = _time_group(group, (lib, threads), repeat, 3 * mkl)  # a stalled fork/join gives up early
        times[f"{key}:{threads}"] = gemv * 1e3
        best = min(best, gemv)
    return 1 if best < 0.9 * mkl else 0


def dense_threads(linear: DenseLinear, lib: ctypes.CDLL, repeat: int = 21) -> int:
    """The GEMV's thread count in this process: torch's when the median of ``repeat`` alternating
    one-row calls through ``linear`` was below ``PARALLEL_GAIN`` of the serial median, else 1 (the
    rule of ``calibrate``; a machine busy enough to stall fork/joins keeps one thread). Not stored: the
    GEMV's result does not depend on it. ``$KVTIER_KERNEL_PARALLEL_MIN`` fixes it like the kernels'."""
    many = torch.get_num_threads()
    if many < 2:
        return 1
    fixed = fixed_parallel_min()
    if fixed is not None:
        return many if fixed < SERIAL else 1
    x, y = torch.randn(1, linear.K), torch.empty(1, linear.N)
    args = (x.data_ptr(), 1, linear.w_t.data_ptr(), None, y.data_ptr(), linear.K, linear.N, 0)
    return many if _parallel_pays(lambda threads: lib.kv_sgemv_t(*args, threads), repeat) else 1


def _stored_choice(path: Path, num_groups: int) -> list[int] | None:
    """The threads per group a choice file holds; None when it is missing or not a valid choice for
    ``num_groups`` groups (a corrupt file is removed: it is measured and written again)."""
    try:
        threads = json.loads(path.read_text())["threads"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        threads = None
    valid = isinstance(threads, list) and len(threads) == num_groups
    if valid and all(isinstance(n, int) and n >= 0 for n in threads):
        return threads
    with contextlib.suppress(OSError):
        path.unlink()
    return None


THREAD_PROBE_BYTES = 16 << 20
_GEMV_CHOICES: dict[str, list[int]] = {}  # digest -> threads per group (0: MKL), once per process


def calibrate_dense(groups: list[list[DenseLinear]], lib: ctypes.CDLL, repeat: int = 3) -> dict[str, float]:
    """For each group (one fused weight across layers, e.g. every layer's ``qkv``), time one fp32 row
    through all of it with torch's matmul and with the GEMV on one thread and on torch's threads (a
    streaming read like a decode step's); the GEMV is kept where it was > 10% faster than torch. Its
    thread count is then chosen in this process by ``dense_threads`` (quiet or busy machine).

    The choice is measured once per machine, shapes and thread count and kept in the kernel cache
    (``gemv-choice-<digest>.json``): every later process, and every engine of this one, makes the same
    choice, so their outputs agree bit for bit (the GEMV's result does not depend on its thread count,
    but differs from MKL's in summation order). ``$KVTIER_DENSE_GEMV``: ``0`` never, ``1`` always (not
    stored). Returns the times (ms) measured now (empty when read back or forced)."""
    from kvtier.models.qkernels import kernel_dir

    forced = os.environ.get("KVTIER_DENSE_GEMV")
    many = torch.get_num_threads()  # MKL's speed depends on it
    shapes = [f"{g[0].K}x{g[0].N}x{len(g)}" for g in groups]
    key = ("gemv-or-mkl", getattr(lib, "_name", ""), many, shapes)  # v2: 1 = GEMV, threads per process
    tag = hashlib.blake2b(repr(key).encode(), digest_size=8).hexdigest()
    path = kernel_dir() / f"gemv-choice-{tag}.json"
    times: dict[str, float] = {}
    if forced is not None:
        threads = [1 if forced == "1" else 0] * len(groups)
    elif tag in _GEMV_CHOICES:  # this process chose already (even if the file went away since)
        threads = _GEMV_CHOICES[tag]
    elif (stored := _stored_choice(path, len(groups))) is not None:
        threads = _GEMV_CHOICES[tag] = stored
    else:
        _GEMV_CHOICES[tag] = threads = [_measure_choice(g, lib, repeat, times) for g in groups]
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"shapes": shapes, "threads": threads, "ms": times}))
            os.replace(tmp, path)
    # the GEMV's threads: measured in every process (not stored), on the largest weight that uses it
    # up to THREAD_PROBE_BYTES (a 113 MB LM head would cost ~0.2 s of start-up to time 42 times)
    probes = sorted((g[0] for g, n in zip(groups, threads, strict=True) if n), key=lambda lin: lin.nbytes)
    small = [lin for lin in probes if lin.nbytes <= THREAD_PROBE_BYTES] or probes[:1]
    n_threads = dense_threads(small[-1], lib) if small else 1
    for group, n in zip(groups, threads, strict=True):
        for lin in group:
            lin.gemv = (lib, n_threads) if n else None
    return times


class QuantLinear:
    """``x @ W^T (+ b)`` with ``W [N, K]`` stored as quantized blocks (``qtype``: a key of ``QTYPES``)."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        qtype: str,
        data: torch.Tensor,  # [N, K / 32 * BLOCK_BYTES[qtype]] uint8
        scale: torch.Tensor | None,  # [N] float32 (INT8 only)
        bias: torch.Tensor | None,  # [N] float32
    ):
        if qtype not in QTYPES:
            raise ValueError(f"no kernel for weight type {qtype}")
        self.lib, self.qtype, self.qid = lib, qtype, QTYPES[qtype]
        self.data = data.contiguous()
        self.scale = None if scale is None else scale.float().contiguous()
        self.bias = bias
        self.N = data.shape[0]
        self.K = data.shape[1] // BLOCK_BYTES[qtype] * 32
        self._scale_ptr = None if self.scale is None else self.scale.data_ptr()
        self.nbytes = data.numel() + (0 if scale is None else 4 * self.N)
        # weights x rows from which a call forks threads: the model's ``calibrate`` sets it
        fixed = fixed_parallel_min()
        self.parallel_min = SERIAL if fixed is None else fixed

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:  # [N, K] float32
        out = torch.empty(self.N, self.K, dtype=torch.float32) if out is None else out
        self.lib.kv_dequantize(
            self.qid,
            self.data.data_ptr(),
            self._scale_ptr,
            out.data_ptr(),
            self.N,
            self.K,
            torch.get_num_threads(),
        )
        return out

    def _run(self, x: torch.Tensor, y: torch.Tensor, accumulate: int) -> None:
        """y [T, N] (+)= x [T, K] @ W^T: the kernel for few rows, dequantize + matmul for many."""
        T = x.shape[0]
        if T >= PREFILL_ROWS:
            w = self.dequantize(_scratch_matrix(self.N, self.K))
            if accumulate:
                y.addmm_(x, w.t())
            else:
                torch.matmul(x, w.t(), out=y)
            return
        self.lib.kv_qmatmul(
            self.qid,
            self.data.data_ptr(),
            self._scale_ptr,
            x.data_ptr(),
            y.data_ptr(),
            T,
            self.N,
            self.K,
            accumulate,
            _threads(T * self.N * self.K, self.parallel_min),
        )

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:  # [T, K] -> [T, N]
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.N, dtype=torch.float32) if out is None else out
        self._run(x, y, 0)
        return y if self.bias is None else y.add_(self.bias)

    def residual(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:  # x [T, N] += a [T, K] @ W^T
        if self.bias is not None or not x.is_contiguous():
            return x + self(a)
        self._run(a.contiguous(), x, 1)
        return x
