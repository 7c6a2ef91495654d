"""``python -m benchmarks.kernels --against REV``: this checkout's gguf weight kernel against an older one.

Builds ``kvtier/models/qmatmul.c`` as it was at git revision REV (this repository's history) into a
temporary library, then times every gguf linear of the default model (one decode token's weight reads:
30 layers x qkv, o, gate_up, down, and the LM head) through both libraries, interleaved in one process
(robust to a busy machine: both see the same load), for 1, 2 and 4 activation rows. Each library gets
the rows in the layout its revision packed (``qpack.PACK_VERSION`` >= 2: regrouped by field, else the
GGUF file's block order), and the outputs must agree to fp32 rounding.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.runner import run

ROOT = Path(__file__).resolve().parents[1]  # the checkout whose git history holds REV


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--against", required=True, help="git revision whose qmatmul.c to compare with")
    p.add_argument("--rows", type=_rows, default="1,2,4", help="activation rows per call, comma-separated")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (median reported)")
    p.add_argument("--num-threads", type=int, default=2, help="kernel threads (default 2)")
    p.set_defaults(func=main)


def _rows(text: str) -> list[int]:
    """``--rows``: positive integers, comma-separated (argparse turns the error into one line)."""
    try:
        rows = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return rows


def _git_show(rev: str, path: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"benchmarks.kernels: cannot read {path} at {rev}: {done.stderr.strip()[:200]}")
    return done.stdout


def gguf_order(qtype: str, rows: torch.Tensor) -> torch.Tensor:
    """The inverse of ``qpack.by_field``: rows [N, nb * block bytes] back in the GGUF file's block order."""
    from kvtier.models.qkernels import BLOCK_BYTES

    n, block = rows.shape[0], BLOCK_BYTES[qtype]
    nb, head = rows.shape[1] // block, 4 if qtype == "Q4_1" else 2
    fields = [rows[:, i * nb : (i + 2) * nb].reshape(n, nb, 2) for i in range(0, head, 2)]
    fields.append(rows[:, head * nb :].reshape(n, nb, block - head))
    return torch.cat(fields, dim=2).reshape(n, -1).contiguous()


def _old_library(rev: str, work: Path, kernel: str, qpack: str) -> tuple[ctypes.CDLL, bool]:
    """(REV's kernel library, whether REV packs rows by field), from REV's qmatmul.c and qpack.py."""
    from kvtier.models import qkernels

    source = work / "qmatmul.c"
    source.write_text(kernel)
    version = re.search(r"^PACK_VERSION = (\d+)", qpack, re.M)
    target = qkernels.build(target=work / "qmatmul-old.so", source=source)
    return qkernels._bind(ctypes.CDLL(str(target)), qkernels.SOURCE), bool(version and int(version[1]) >= 2)


def main(ns: argparse.Namespace) -> int:
    from kvtier import LLM
    from kvtier.models import qkernels
    from kvtier.models.qlinear import QuantLinear

    # REV's files first: a revision that does not exist is one line, before the model loads
    kernel, qpack = (
        _git_show(ns.against, "kvtier/models/qmatmul.c"),
        _git_show(ns.against, "kvtier/models/qpack.py"),
    )
    rows_list = ns.rows if isinstance(ns.rows, list) else _rows(ns.rows)
    names = {v: k for k, v in qkernels.QTYPES.items()}
    llm = LLM(dtype="float32", num_threads=ns.num_threads, weight_dtype="gguf")
    model = llm.engine.model
    lins = [lin for layer in model.layers for lin in layer.linears] + [model.lm_head]
    lins = [lin for lin in lins if isinstance(lin, QuantLinear)]
    with tempfile.TemporaryDirectory() as tmp:
        old, by_field = _old_library(ns.against, Path(tmp), kernel, qpack)
        old_rows = [lin.data if by_field else gguf_order(names[lin.qid], lin.data) for lin in lins]
        variants = {
            "this checkout": (qkernels.kernels(), [lin.data for lin in lins]),
            ns.against: (old, old_rows),
        }
        print(f"benchmarks.kernels — {len(lins)} gguf linears (one decode token), {ns.num_threads} threads")
        print(
            f"  {'rows':>4} {'this checkout':>14} {ns.against[:14]:>14} {'speed-up':>9} {'max rel diff':>13}"
        )
        for rows in rows_list:
            ms, outs = _interleaved(lins, variants, rows, ns.rounds, ns.num_threads)
            new, ref = outs["this checkout"], outs[ns.against]
            diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(new, ref, strict=True))
            a, b = ms["this checkout"], ms[ns.against]
            print(f"  {rows:>4} {a:>11.2f} ms {b:>11.2f} ms {b / a:>8.2f}x {diff:>13.1e}")
            if diff > 1e-4:
                raise SystemExit(f"benchmarks.kernels: the two kernels disagree ({diff:.1e} relative)")
    return 0


def _interleaved(lins: list, variants: dict, rows: int, rounds: int, threads: int) -> tuple[dict, dict]:
    """Median ms per variant over ``rounds`` passes through every linear, the variants alternating, and
    each variant's outputs of the last pass."""
    xs = [torch.randn(rows, lin.K) for lin in lins]
    times: dict[str, list[float]] = {name: [] for name in variants}
    outs = {name: [torch.empty(rows, lin.N) for lin in lins] for name in variants}
    for _ in range(rounds):
        for name, (lib, datas) in variants.items():
            t = time.perf_counter()
            for lin, data, x, y in zip(lins, datas, xs, outs[name], strict=True):
                lib.kv_qmatmul(
                    lin.qid,
                    data.data_ptr(),
                    lin._scale_ptr,
                    x.data_ptr(),
                    y.data_ptr(),
                    rows,
                    lin.N,
                    lin.K,
                    0,
                    threads,
                )
            times[name].append(time.perf_counter() - t)
    return {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}, outs


if __name__ == "__main__":
    sys.exit(run("kernels", __doc__, add_args))
