"""The fixed text the KV dtype benchmarks score, and how they feed it through a paged cache.

The text is five verbatim licence texts shipped in ``benchmarks/data/`` (GPL-3, GPL-2, LGPL-2.1,
MPL-2.0, Apache-2.0; 23,427 SmolLM2 tokens; sources in ``benchmarks/data/README.md``), joined by blank
lines in that order and cut to the token count a run asks for. ``teacher_force`` feeds one window of it
in chunks from slot 0: every chunk after the first attends to the earlier chunks' stored K/V (as the
cache stores them: quantized, for a compact dtype) and to its own.
"""

from __future__ import annotations

import os
from typing import Any

TEXT_FILES = ("GPL-3.txt", "GPL-2.txt", "LGPL-2.1.txt", "MPL-2.0.txt", "Apache-2.0.txt")
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def fixed_text(tokenizer: Any, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` token ids of the fixed text (``TEXT_FILES`` in order, blank-line joined)."""
    parts = []
    for name in TEXT_FILES:
        with open(os.path.join(DATA_DIR, name), encoding="utf-8") as f:
            parts.append(f.read())
    ids: list[int] = tokenizer.encode("\n\n".join(parts), add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"the fixed text has only {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


def teacher_force(model: Any, cache: Any, ids: Any, chunk: int) -> tuple[float, Any]:
    """Feed ``ids`` (a window, [n] long) in chunks through ``cache`` from slot 0; (nll sum, top-1 [n-1])."""
    import torch

    from kvtier.models.attention import teacher_forced_chunk

    bs, n = cache.block_size, ids.shape[0]
    nll, top1 = 0.0, []
    for start in range(0, n - 1, chunk):
        end = min(start + chunk, n - 1)
        pos, meta = teacher_forced_chunk(start, end, bs)
        with torch.inference_mode():
            logits = model.compute_logits(model.forward(ids[start:end], pos, cache, meta))  # [chunk, V]
        logp = torch.log_softmax(logits, -1)
        nll += -logp.gather(1, ids[start + 1 : end + 1, None]).sum().item()
        top1.append(logits.argmax(-1))
    return nll, torch.cat(top1)
