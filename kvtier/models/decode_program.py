"""Every layer of a decode step in one C call (``decode_program.c``).

The Python layer loop calls ~9 C functions a layer through ctypes (RMSNorm, the qkv GEMV, RoPE + cache
write, decode attention, o, RMSNorm, gate|up, silu*up, down); each call costs a few microseconds of
Python and ctypes around a few of C, ~1.5 ms of a ~10 ms ``gguf`` decode step of the default model.
``DecodeProgram.run`` hands the same functions (as pointers) and the same arguments to
``kv_decode_layers``, which calls them layer after layer: the result is bit for bit the loop's.

It runs a step when everything the loop would do is one of those C calls: fp32 ``FusedOps`` on CPU, a
step of decode rows only, a KV pool the decode kernel covers (plain float32, or compact fp8/int8 or
bfloat16 written by ``kv_store_quantized`` as the loop writes it), and every layer's linears
on a kernel (``QuantLinear`` below ``PREFILL_ROWS`` rows, ``DenseLinear`` with its GEMV chosen, up to
``GEMV_ROWS`` rows). Anything else (prefill chunks, torch ops, MKL linears)
returns False and the model runs its Python loop. It runs llama's layer only: a family whose layer
does more (``qwen3.py``'s q/k norm, ``gemma3.py``'s) sets ``runs_decode_program`` False and never
builds one (docs/models.md).
"""

from __future__ import annotations

import ctypes

import torch

from kvtier.models import kvkernels, qlinear
from kvtier.models.attention import AttentionMetadata
from kvtier.models.kv_quant import PagedKVCache, scale_steps
from kvtier.models.qkernels import PROGRAM, kernels
from kvtier.models.qlinear import GEMV_ROWS, PREFILL_ROWS, DenseLinear, QuantLinear

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Lin(ctypes.Structure):
    _fields_ = [("kind", _i64), ("qid", _i64), ("w", _p), ("scale", _p), ("bias", _p)]
    _fields_ += [("K", _i64), ("N", _i64), ("threads", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", _p), ("post_norm", _p), ("qkv", _Lin), ("o", _Lin), ("gate_up", _Lin)]
    _fields_ += [("down", _Lin)]


class _Step(ctypes.Structure):
    _fields_ = [(name, _p) for name in ("rmsnorm", "rope_store", "silu_mul", "sgemv", "qmatmul")]
    _fields_ += [("attention", _p)]
    _fields_ += [(name, _i64) for name in ("T", "hidden", "H", "KVH", "D", "inter")]
    _fields_ += [("eps", _f32), ("scale", _f32)]
    _fields_ += [(name, _p) for name in ("x", "h", "qkv", "gate_up", "act", "attn", "tmp", "table")]
    _fields_ += [("pos", _p)]
    _fields_ += [("slots", _p), ("pool", _p), ("pool_layer_bytes", _i64)]
    _fields_ += [("fmt", _i64), ("block_stride", _i64), ("data_bytes", _i64), ("tables", _p)]
    _fields_ += [("max_blocks", _i64), ("lens", _p), ("max_context", _i64), ("rot", _p)]
    _fields_ += [("block_size", _i64), ("parts", _i64), ("att_threads", _i64), ("scratch", _p)]
    _fields_ += [("rope", _p), ("store", _p), ("steps", _p), ("nsteps", _i64), ("factor", _f32)]
    _fields_ += [("ids", _p), ("offsets", _p)]


def _address(fn: ctypes._CFuncPtr) -> int:  # type: ignore[name-defined]
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def _linear_ok(lin: object, rows: int) -> bool:
    if isinstance(lin, QuantLinear):
        return rows < PREFILL_ROWS
    return isinstance(lin, DenseLinear) and lin.gemv is not None and rows <= GEMV_ROWS


class DecodeProgram:
    """One model's decode program: its layers' weights as C structs, built per row count on first use
    (a quantized kernel's thread count depends on the rows; a dense layer's GEMV choice is read then)."""

    def __init__(self, model) -> None:  # noqa: ANN001 - kvtier.models.llama.LlamaModel (no import cycle)
        self.model = model
        self.lib = kernels(PROGRAM)
        self._layers: dict[tuple[int, int], ctypes.Array[_Layer] | None] = {}
        self.steps = 0  # steps run by the program (the tests check it ran)
        self._ops: tuple[int, ...] | None = None  # the fused and attention functions' addresses
        self._store: tuple[int, int] = (0, 0)  # kv_rope, kv_store_quantized: a compact pool's write
        quant = [lin for layer in model.layers for lin in layer.linears if isinstance(lin, QuantLinear)]
        self.qmatmul = _address(quant[0].lib.kv_qmatmul) if quant else 0
        # a quantized o/down with a bias adds x + (a @ W + b) through a scratch row (QuantLinear.residual)
        residuals = [lin for layer in model.layers for lin in (layer.o, layer.down)]
        self.biased = any(isinstance(lin, QuantLinear) and lin.bias is not None for lin in residuals)

    def _lin(self, lin: QuantLinear | DenseLinear, rows: int) -> _Lin:
        if isinstance(lin, QuantLinear):
            bias = None if lin.bias is None else lin.bias.data_ptr()
            threads = qlinear._threads(rows * lin.N * lin.K, lin.parallel_min)
            return _Lin(0, lin.qid, lin.data.data_ptr(), lin._scale_ptr, bias, lin.K, lin.N, threads)
        assert lin.gemv is not None
        bias = None if lin.b is None else lin.b.data_ptr()
        return _Lin(1, 0, lin.w_t.data_ptr(), None, bias, lin.K, lin.N, lin.gemv[1])

    def _layers_for(self, rows: int) -> ctypes.Array[_Layer] | None:
        key = (rows, self.model.parallel_min)
        if key not in self._layers:
            layers = self.model.layers
            ok = all(_linear_ok(lin, rows) for layer in layers for lin in layer.linears)
            if ok and all(w.dtype == torch.float32 for la in layers for w in (la.input_norm, la.post_norm)):
                built = (_Layer * len(layers))()
                for out, layer in zip(built, layers, strict=True):
                    out.in_norm, out.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
                    out.qkv, out.o = self._lin(layer.qkv, rows), self._lin(layer.o, rows)
                    out.gate_up, out.down = self._lin(layer.gate_up, rows), self._lin(layer.down, rows)
                self._layers[key] = built
            else:
                self._layers[key] = None
        return self._layers[key]

    def run(
        self,
        x: torch.Tensor,  # [T, hidden] float32: the embeddings, the residual stream on return
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> bool:
        """Every layer over ``x`` in place; False (nothing done) when this step is not one it covers."""
        from kvtier.models.fused_ops import FusedOps

        model, ops, d = self.model, self.model.ops, meta.decode
        T = x.shape[0]
        if self.lib is None or not isinstance(ops, FusedOps) or not x.is_cpu or x.dtype != torch.float32:
            return False
        compact = kvkernels.stores(kv_cache)  # fp8/int8/bf16: kv_store_quantized writes, as write_kv
        if d is None or meta.prefills or d.num_seqs != T or not (kv_cache.writes_float32_rows or compact):
            return False
        c = model.config
        att_lib = kvkernels.kernels()
        if att_lib is None or not kvkernels.supports(kv_cache, c.num_heads):
            return False
        layers = self._layers_for(T)
        if layers is None:
            return False
        H, KVH, D, inter = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        qkv, gate_up = x.new_empty(T, (H + 2 * KVH) * D), x.new_empty(T, 2 * inter)
        h, act, attn = torch.empty_like(x), x.new_empty(T, inter), x.new_empty(T, H * D)
        tmp = torch.empty_like(x) if self.biased else None
        call = d.kernel_call(att_lib, kv_cache, H, model.scale)
        raw = kv_cache.raw
        if self._ops is None:  # the libraries are loaded once per process: their addresses stay
            fused = (ops.lib.kv_rmsnorm, ops.lib.kv_rope_store, ops.lib.kv_silu_mul, ops.lib.kv_sgemv_t)
            self._ops = (*map(_address, fused), self.qmatmul, _address(att_lib.kv_decode_attention))
            self._store = (_address(ops.lib.kv_rope), _address(att_lib.kv_store_quantized))
        store: tuple = (None, None, None, 0, 0.0, None, None)
        if compact:
            steps = scale_steps(x.device)
            ids = meta.slot_block_ids.to(torch.long).contiguous()
            offsets = meta.slot_offsets.to(torch.long).contiguous()
            store = (*self._store, steps.data_ptr(), steps.numel(), kv_cache.scale_factor, ids.data_ptr())
            store += (offsets.data_ptr(),)
        step = _Step(
            *self._ops,
            T, x.shape[1], H, KVH, D, inter, c.rms_norm_eps, model.scale,
            x.data_ptr(), h.data_ptr(), qkv.data_ptr(), gate_up.data_ptr(), act.data_ptr(), attn.data_ptr(),
            None if tmp is None else tmp.data_ptr(), ops.table_ptr, ops.positions.data_ptr(),
            None if compact else meta.slot_bytes(kv_cache).data_ptr(), raw.data_ptr(),
            raw.stride(1) * raw.element_size(),
            call.format_id, *call.pool_args, call.rot_ptr, kv_cache.block_size, call.shape_args[-1],
            call.threads, call.scratch.data_ptr(), *store,
        )  # fmt: skip
        self.lib.kv_decode_layers(ctypes.addressof(step), ctypes.addressof(layers), len(model.layers))
        self.steps += 1
        return True
