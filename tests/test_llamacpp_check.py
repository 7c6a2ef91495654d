"""``benchmarks/llamacpp_check.py``'s comparison of two models' logits (llama.cpp itself is a source build,
not installed by the project: the cross-check's numbers are in BENCHMARKS.md)."""

from __future__ import annotations

import numpy as np

from benchmarks.llamacpp_check import compare


def test_the_same_logits_agree_everywhere_and_a_changed_top_token_is_counted() -> None:
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(10, 50)).astype(np.float32)
    ids = [int(i) for i in rng.integers(0, 50, size=10)]
    same = compare(ref, ref.copy(), ids)
    assert same["top1_agree"] == 1.0 and same["max_dlogp_top"] == 0.0
    assert same["corr_min"] > 0.9999 and same["ppl_reference"] == same["ppl_llamacpp"]
    other = ref.copy()
    other[3, ref[3].argmax()] -= 100.0  # position 3's top token is no longer on top
    moved = compare(ref, other, ids)
    assert moved["top1_agree"] == 0.9 and moved["max_dlogp_top"] > 50 and moved["corr_min"] < 0.9
