"""The fused fp32 per-layer ops (kvtier/models/fused.c) give what the torch ops give.

RoPE rounds exactly like torch's complex multiply; RMSNorm differs at most in its sum order and silu in
its exp polynomial (a few ulp). The decode GEMV over transposed dense weights equals ``x @ W (+ b)``
up to fp32 summation order, for 1-4 rows, odd shapes, with a bias and accumulating into a residual.
A tiny model's decode logits through the fused path match the torch path, and the tiny checkpoints'
logits still match transformers with the GEMV forced on (tests/test_model_parity.py, run here too).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kvtier.models import qkernels, qlinear
from kvtier.models.fused_ops import FusedOps, TorchOps, ops_for, rms_norm_fused, rms_norm_torch
from kvtier.models.llama import LlamaModel
from kvtier.models.loader import load_model
from kvtier.models.qlinear import DenseLinear, calibrate_dense
from tests.test_model_parity import paged_logits

LIB = qkernels.kernels(qkernels.FUSED)
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler / AVX2: fused kernels off")


def rope(positions: int = 50, half: int = 8) -> torch.Tensor:  # [P, D/2] complex64
    g = torch.Generator().manual_seed(1)
    angles = torch.arange(positions)[:, None] * torch.rand(half, generator=g)[None, :]
    return torch.polar(torch.ones_like(angles), angles)


def test_fp32_gets_the_fused_ops_and_bf16_the_torch_ones() -> None:
    assert isinstance(ops_for(torch.float32, rope()), FusedOps)
    assert isinstance(ops_for(torch.bfloat16, rope()), TorchOps)


def test_without_a_compiler_the_torch_ops_and_one_log_line(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(qkernels, "_state", {})
    monkeypatch.setattr(qkernels, "kernel_dir", lambda: tmp_path / "kernels")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-gcc"))
    monkeypatch.setattr(qkernels.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING):
        assert isinstance(ops_for(torch.float32, rope()), TorchOps)
        assert qkernels.kernels() is None  # the quantized kernels fail the same way: no second line
        assert isinstance(ops_for(torch.float32, rope()), TorchOps)
    lines = [r.getMessage() for r in caplog.records if "kernels unavailable" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]


def test_rms_norm_matches_hf_rounding_but_for_the_sum_order() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 100, generator=g) * 5  # 100: not a multiple of 16, exercises the tail
    w = torch.randn(100, generator=g)
    got = FusedOps(LIB, rope()).rms_norm(x, w, 1e-5, torch.empty_like(x))
    torch.testing.assert_close(got, rms_norm_torch(x, w, 1e-5), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_shape", [(100,), (3, 100)], ids=["one weight", "a weight per head"])
def test_the_cuda_rms_norm_call_is_the_same_norm(dtype: torch.dtype, weight_shape: tuple) -> None:
    """On CUDA ``rms_norm_torch`` hands a same-dtype weight to ``rms_norm_fused`` (torch's fused kernel):
    the same call on this device gives the torch path's values, within the dtype's rounding, for a [D]
    weight and for Qwen3's q/k norm, a weight row per head (the first GPU run of the Qwen3 shape failed
    there: ``F.rms_norm`` takes only a [D] weight)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 3, 100, generator=g) * 5).to(dtype)
    w = torch.randn(weight_shape, generator=g).to(dtype)
    fused = rms_norm_fused(x, w, 1e-5)
    tol = {"rtol": 2e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(fused, rms_norm_torch(x, w, 1e-5), **tol)
    if torch.cuda.is_available():
        on_cuda = rms_norm_torch(x.cuda(), w.cuda(), 1e-5).cpu()
        torch.testing.assert_close(on_cuda, rms_norm_torch(x, w, 1e-5), **tol)


def test_rope_is_torchs_complex_multiply_bit_for_bit() -> None:
    positions = torch.tensor([0, 3, 49, 7])
    qkv = torch.randn(4, 3 * 16 + 16)  # 3 heads of D=16 rotated (Q|K), then an untouched V head
    fused, plain = FusedOps(LIB, rope()), TorchOps(rope())
    a, b = qkv.clone(), qkv.clone()
    fused.begin(positions)
    plain.begin(positions)
    fused.rope_(a, positions, 3, 16)
    plain.rope_(b, positions, 3, 16)
    assert torch.equal(a, b)
    assert torch.equal(a[:, 48:], qkv[:, 48:])  # V is not rotated
    assert not torch.equal(a[1:, :48], qkv[1:, :48])  # position 0 is the identity, the rest rotate


def test_rope_store_writes_the_slots_torch_would_bit_for_bit() -> None:
    """RoPE + cache write in one call (float32 pool): the pool and the returned K/V equal RoPE then
    ``write_kv``; a compact pool, and a cache class that writes its own way, take the torch path."""
    from benchmarks.kvdtype_study import FakeQuantCache
    from kvtier.models.attention import AttentionMetadata
    from kvtier.models.kv_quant import KVFormat, PagedKVCache

    positions = torch.tensor([5, 6, 40])
    heads = (2, 1, 16)  # H, KVH, D: rows are Q (2 heads) | K | V
    qkv = torch.randn(3, 4 * 16)
    meta = AttentionMetadata(torch.tensor([3, 0, 2]), torch.tensor([15, 0, 7]), None, [])
    fused, plain = FusedOps(LIB, rope()), TorchOps(rope())
    fused.begin(positions)
    plain.begin(positions)
    for kd in ("float32", "int8"):
        pools = [
            PagedKVCache(KVFormat(kd, torch.float32), 4, (2, 16, 1, 16), torch.device("cpu")) for _ in "ab"
        ]
        a, b = qkv.clone(), qkv.clone()
        got = fused.rope_store(a, positions, heads, pools[0], 1, meta)
        want = plain.rope_store(b, positions, heads, pools[1], 1, meta)
        assert torch.equal(a, b) and torch.equal(got, want) and torch.equal(pools[0].raw, pools[1].raw)
        assert pools[0].raw.count_nonzero() > 0 and pools[0].raw[:, 0].count_nonzero() == 0  # layer 1 only
    seen = []
    study = FakeQuantCache(4, (2, 16, 1, 16), lambda layer, kv, pos: seen.append(layer) or kv)
    assert not study.writes_float32_rows
    fused.rope_store(qkv.clone(), positions, heads, study, 0, meta)
    assert seen == [0]  # its own write ran


def test_silu_times_up_matches_torch() -> None:
    gate_up = torch.randn(3, 2 * 44) * 6  # 44: a tail after five 8-wide vectors
    got = FusedOps(LIB, rope()).silu_mul(gate_up, torch.empty(3, 44))
    want = TorchOps(rope()).silu_mul(gate_up, torch.empty(0))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_equals_matmul_with_bias_and_residual(rows: int, threads: int) -> None:
    g = torch.Generator().manual_seed(rows)
    K, N = 37, 1100  # K not a multiple of 4 (two row ranges of 20 and 17), N not a multiple of 8
    w_t, b = torch.randn(K, N, generator=g), torch.randn(N, generator=g)
    x, resid = torch.randn(rows, K, generator=g), torch.randn(rows, N, generator=g)
    for bias in (None, b):
        lin = DenseLinear(w_t, bias)
        want, want_res = lin(x), lin.residual(resid.clone(), x)  # torch's matmul
        lin.gemv = (LIB, threads)
        torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lin.residual(resid.clone(), x), want_res, rtol=1e-5, atol=1e-5)
    assert not torch.equal(lin(x), lin(x + 1e-3))  # the kernel really reads x
    other = (LIB, 3 - threads)
    got, lin.gemv = lin(x), other
    assert torch.equal(lin(x), got)  # a column's sum does not depend on the thread count


def test_a_gemv_row_is_the_same_alone_or_batched_on_any_thread_count() -> None:
    """The rows of w are cut into fixed ranges (by K alone) and the columns into chunks of at most 16,384
    floats for 4 rows: a sequence's logits do not depend on its batch-mates, nor on the threads, nor on
    the chunking (here 17,000 columns: 2 chunks for 4 rows, 1 for one row; 3 threads: 2 per range)."""
    g = torch.Generator().manual_seed(7)
    K, N = 150, 17_000
    lin = DenseLinear(torch.randn(K, N, generator=g), torch.randn(N, generator=g))
    x = torch.randn(4, K, generator=g)
    want = torch.addmm(lin.b, x, lin.w_t)
    results = []
    for threads in (1, 2, 3):
        lin.gemv = (LIB, threads)
        batched = lin(x)
        torch.testing.assert_close(batched, want, rtol=1e-5, atol=1e-4)
        for m in range(4):
            assert torch.equal(lin(x[m : m + 1].clone()), batched[m : m + 1])
        assert torch.equal(lin(x[1:3].clone()), batched[1:3])
        results.append(batched)
    assert all(torch.equal(r, results[0]) for r in results)


def test_gemv_is_not_used_for_prefill_rows_nor_for_none() -> None:
    lin = DenseLinear(torch.randn(16, 24), None)
    lin.gemv = (None, 1)  # a library that would crash if it were called
    x = torch.randn(5, 16)
    torch.testing.assert_close(lin(x), x @ lin.w_t)
    assert lin(torch.randn(0, 16)).shape == (0, 24)  # a step that samples nothing
    args = (x.data_ptr(), 0, lin.w_t.data_ptr(), None, x.data_ptr(), 16, 24, 0, 1)
    LIB.kv_sgemv_t(*args)  # zero rows: returns at once (it divided by zero before)


def test_calibration_is_forced_or_measured_once_and_kept(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(qkernels, "kernel_dir", lambda: tmp_path)
    monkeypatch.setattr(qlinear, "_GEMV_CHOICES", {})
    group = [DenseLinear(torch.randn(64, 128), None) for _ in range(3)]
    monkeypatch.setenv("KVTIER_DENSE_GEMV", "1")
    calibrate_dense([group], LIB)
    assert all(lin.gemv is not None and lin.gemv[0] is LIB for lin in group)
    monkeypatch.setenv("KVTIER_DENSE_GEMV", "0")
    calibrate_dense([group], LIB)
    assert all(lin.gemv is None for lin in group)
    assert not list(tmp_path.glob("gemv-choice-*"))  # forced choices are not stored
    monkeypatch.delenv("KVTIER_DENSE_GEMV")
    times = calibrate_dense([group], LIB, repeat=1)
    many = torch.get_num_threads()
    assert {"64x128:mkl", "64x128:1", f"64x128:{many}"} <= set(times)  # measured, whichever won
    assert group[0].gemv is None or group[0].gemv[1] in (1, many)  # its threads: chosen in this process
    (stored,) = tmp_path.glob("gemv-choice-*.json")
    flipped = 1 if group[0].gemv is None else 0  # the opposite of what was measured
    data = json.loads(stored.read_text())
    stored.write_text(json.dumps({**data, "threads": [flipped]}))
    monkeypatch.setattr(qlinear, "_GEMV_CHOICES", {})  # as a new process would
    assert calibrate_dense([group], LIB) == {}  # read back, not measured again
    assert (group[0].gemv is not None) == (flipped == 1)  # the stored choice is the one used


def test_tiny_model_decode_through_fused_ops_matches_the_torch_path(
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = load_model(str(tiny_llama_dir(num_heads=4, num_kv_heads=2, attention_bias=True)))
    ids = torch.randint(0, loaded.config.vocab_size, (19,), generator=torch.Generator().manual_seed(3))
    monkeypatch.setenv("KVTIER_DENSE_GEMV", "1")
    fused = LlamaModel(loaded.config, loaded.weights, torch.float32, 64)
    assert isinstance(fused.ops, FusedOps) and fused.layers[0].qkv.gemv is not None
    plain = LlamaModel(loaded.config, loaded.weights, torch.float32, 64)
    plain.ops = plain.torch_ops
    for layer in plain.layers:
        for lin in layer.linears:
            lin.gemv = None
    plain.lm_head.gemv = None
    torch.testing.assert_close(paged_logits(fused, ids, 11), paged_logits(plain, ids, 11), rtol=0, atol=1e-5)


def test_the_gemv_threads_are_chosen_per_process_and_never_change_the_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One thread or torch's: measured in each process (a busy machine keeps one), or fixed by
    $KVTIER_KERNEL_PARALLEL_MIN like the quantized kernels; the GEMV's sums are the same either way."""
    lin = DenseLinear(torch.randn(256, 1024), None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert qlinear.dense_threads(lin, LIB, repeat=3) in (1, 2)
    monkeypatch.setenv("KVTIER_KERNEL_PARALLEL_MIN", str(qlinear.SERIAL))
    assert qlinear.dense_threads(lin, LIB) == 1
    monkeypatch.setenv("KVTIER_KERNEL_PARALLEL_MIN", str(qlinear.PARALLEL))
    assert qlinear.dense_threads(lin, LIB) == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert qlinear.dense_threads(lin, LIB) == 1
    x = torch.randn(1, 256)
    lin.gemv = (LIB, 1)
    one = lin(x)
    lin.gemv = (LIB, 2)
    assert torch.equal(lin(x), one)


@pytest.mark.parametrize("content", ["{not json", '{"threads": [1, 0]}', '{"threads": "1"}', '{"other": 1}'])
def test_a_corrupt_choice_file_is_a_miss_measured_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path, content: str
) -> None:
    monkeypatch.setattr(qkernels, "kernel_dir", lambda: tmp_path)
    monkeypatch.setattr(qlinear, "_GEMV_CHOICES", {})
    monkeypatch.delenv("KVTIER_DENSE_GEMV", raising=False)
    group = [DenseLinear(torch.randn(64, 128), None) for _ in range(2)]
    calibrate_dense([group], LIB, repeat=1)
    (stored,) = tmp_path.glob("gemv-choice-*.json")
    stored.write_text(content)  # torn, or the wrong number of groups, or the wrong type
    monkeypatch.setattr(qlinear, "_GEMV_CHOICES", {})  # as a new process would
    times = calibrate_dense([group], LIB, repeat=1)
    assert "64x128:mkl" in times  # measured again instead of failing at load
    assert len(json.loads(stored.read_text())["threads"]) == 1  # and written back whole
