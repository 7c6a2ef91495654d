"""Decode-shaped steps through static, padded inputs (``kvtier/worker/graphs.py``).

On CUDA those steps replay a captured graph; everything but the capture runs here on a CPU with
``capture=False`` (the same static tensors, padding and row layout, run eagerly) through Triton's
interpreter: the rows a step becomes, the padding that writes only the spare block, and an engine whose
answers and logprobs equal the eager engine's, prefix hits (a chunk after cached tokens, as rows)
included.
"""

from __future__ import annotations

import os
from array import array
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: its kernels run on numpy
pytest.importorskip("triton")

from kvtier.llm import LLM  # noqa: E402
from kvtier.sampling_params import SamplingParams  # noqa: E402
from kvtier.worker.graphs import MAX_CHUNK_ROWS, StepGraphs, graph_rows, table_rows  # noqa: E402
from kvtier.worker.staging import StepStaging  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET is off and there is no CUDA device", allow_module_level=True)

BS = 4


def scheduled(tokens: list[int], computed: int, new: int, table: list[int], samples: bool = True) -> Any:
    seq = SimpleNamespace(token_ids=tokens)
    return SimpleNamespace(seq=seq, num_computed_tokens=computed, num_new_tokens=new,
                           block_tables=[table], samples=samples)  # fmt: skip


def step(decodes: list[Any], prefills: list[Any]) -> Any:
    return SimpleNamespace(decodes=decodes, prefills=prefills)


# ------------------------------------------------------------------------------ a step as rows
def test_decodes_then_a_chunk_after_cached_tokens_become_rows() -> None:
    """Two decodes, then a prefix hit's last 3 tokens: each token a row whose context ends at itself."""
    a = scheduled(list(range(10, 20)), 9, 1, [7, 3, 5])  # its 10th token, position 9
    b = scheduled(list(range(30, 35)), 4, 1, [8, 2])
    chunk = scheduled(list(range(50, 62)), 9, 3, [1, 4, 6], samples=True)
    rows = graph_rows(step([a, b], [chunk]), BS, 64)
    assert rows is not None
    assert rows.ids == [19, 34, 59, 60, 61]
    assert rows.positions == [9, 4, 9, 10, 11]
    assert rows.lens == [10, 5, 10, 11, 12]
    assert rows.slot_blocks == [[5, 2, 6, 6, 6]]  # table[p // 4], one KV group
    assert rows.logits_rows == [0, 1, 4]  # the chunk samples from its last row only


def test_a_fresh_prompt_a_long_chunk_or_too_many_rows_run_eagerly() -> None:
    fresh = scheduled(list(range(8)), 0, 8, [0, 1])
    long = scheduled(list(range(100)), 40, MAX_CHUNK_ROWS + 1, list(range(25)))
    decode = scheduled(list(range(10)), 9, 1, [0, 1, 2])
    assert graph_rows(step([], [fresh]), BS, 64) is None
    assert graph_rows(step([], [long]), BS, 64) is None
    assert graph_rows(step([decode] * 3, []), BS, 2) is None
    assert graph_rows(step([decode] * 2, []), BS, 2) is not None


def test_tables_are_cut_to_the_blocks_read_and_padding_rows_read_the_spare_block() -> None:
    stage = StepStaging()  # a manager's int64 row and a tuple row, to a width of 2, and one padding row
    handle = stage.add_table(table_rows([array("q", [7, 3, 5]), (8,)], 1, 99), 2)
    stage.upload("cpu")
    assert stage.get(handle).tolist() == [7, 3, 8, 8, 99, 99]


@pytest.mark.parametrize(
    "max_rows,buckets",
    [
        (16, (1, 2, 4, 8, 16)),
        (100, (1, 2, 4, 8, 16, 32, 64, 100)),
        (2048, (1, 2, 4, 8, 16, 32, 64, 128, 256)),
    ],
)
def test_buckets_end_at_the_step_budget_or_256_rows(
    tiny_llama_dir: Any, max_rows: int, buckets: tuple
) -> None:
    runner = LLM(str(tiny_llama_dir()), kv_device_blocks=8).engine.runner
    graphs = StepGraphs(runner.model, runner.cache, runner.spare_block, max_rows, 64, capture=False)
    assert graphs.buckets == buckets and graphs.max_rows == buckets[-1]


# ------------------------------------------------------------------------------ the engine
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 500, (16,), generator=gen).tolist()  # four full blocks: a prefix hit
    return [shared + [7, 8], torch.randint(3, 500, (9,), generator=gen).tolist(), shared + [11, 12, 13]]


def answers(model: str, graphs: bool) -> tuple[list[list[int]], list[Any], int]:
    """The first prompt alone, then all three (the third a prefix hit); tokens, logprobs, graph steps."""
    llm = LLM(model, attention_backend="triton", block_size=BS, kv_device_blocks=64, max_num_seqs=4)
    runs = [0]
    if graphs:
        runner = llm.engine.runner
        assert runner.use_graphs(16, llm.engine.max_model_len, capture=False)
        assert runner.graphs is not None and runner.graphs.buckets == (1, 2, 4, 8, 16)
        real = runner.graphs.run
        runner.graphs.run = lambda rows: (runs.__setitem__(0, runs[0] + 1), real(rows))[1]  # type: ignore
    outs = llm.generate(prompts()[:1], GREEDY) + llm.generate(prompts(), GREEDY)
    assert outs[3].num_cached_tokens == 16
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].logprobs for o in outs], runs[0]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Any) -> str:
    return str(tiny_llama_dir())


@pytest.fixture(scope="module")
def gemma(tiny_gemma3_sliding_dir: Path) -> str:
    return str(tiny_gemma3_sliding_dir)


@pytest.mark.parametrize("model", ["tiny", "gemma"])
def test_an_engine_through_static_padded_steps_answers_as_the_eager_one(
    model: str, request: pytest.FixtureRequest
) -> None:
    """Llama (one KV group) and Gemma 3 (a full and a sliding group, the window cutting the contexts)."""
    directory = request.getfixturevalue(model)
    want_tokens, want_logprobs, _ = answers(directory, graphs=False)
    tokens, logprobs, graph_steps = answers(directory, graphs=True)
    assert tokens == want_tokens
    assert graph_steps >= 5 * 2  # every decode step of both calls, and the prefix hit's last block
    for got, want in zip(logprobs, want_logprobs, strict=True):
        for g, w in zip(got, want, strict=True):
            assert g.token_id == w.token_id and g.top.keys() == w.top.keys()
            assert abs(g.logprob - w.logprob) < 1e-4
            assert all(abs(g.top[t] - w.top[t]) < 1e-4 for t in g.top)


def test_padding_rows_write_only_the_spare_block(tiny_llama_dir: Any) -> None:
    """A 3-row step in a 4-row bucket: the pool's real blocks hold what the eager step writes."""
    llm = LLM(str(tiny_llama_dir()), attention_backend="triton", block_size=BS, kv_device_blocks=32)
    runner = llm.engine.runner
    graphs = StepGraphs(runner.model, runner.cache, runner.spare_block, 8, 64, capture=False)
    graphs.capture_all()
    before = runner.kv_cache.clone()
    rows = graph_rows(step([scheduled([5, 6, 7], 2, 1, [3])] * 3, []), BS, 8)
    assert rows is not None
    graphs.run(rows)
    changed = (runner.cache.raw != torch.cat([before, runner.cache.raw[-1:]])).flatten(1).any(1)
    assert changed.nonzero().flatten().tolist() == [3]  # block 3, slot 2 of each layer
    assert bool(runner.cache.raw[-1].any())  # the padding row went to the spare block
    assert graphs.bucket(3) == 4 and runner.cache.raw.shape[0] == 33


def test_a_layered_host_load_through_graph_rows_waits_for_each_slot(tiny: str) -> None:
    """``--layered-loads``: a prompt pushed down to the host tier comes back, and its last block runs as
    a graph's rows; each layer of that static step waited for its slot of the loaded blocks (on CUDA an
    event-wait node in the graph), and the answers are the whole load's."""
    from kvtier.bench.gpu_speed import settle
    from kvtier.stats import Medium

    prompt = [3 + (i * 7) % 400 for i in range(30)]
    got = {}
    for layered in (False, True):
        llm = LLM(tiny, attention_backend="triton", block_size=BS, kv_device_blocks=20, max_num_seqs=4,
                  kv_host_gb=1 / 1024, layered_loads=layered)  # fmt: skip
        runner = llm.engine.runner
        assert runner.use_graphs(16, llm.engine.max_model_len, capture=False) and runner.graphs is not None
        first = llm.generate([prompt], GREEDY)[0]
        llm.generate([[5 + (i * 131) % 490 for i in range(60)]], GREEDY)  # evicts the prompt's blocks
        settle(llm.engine)
        real, rows = runner.graphs.run, []
        runner.graphs.run = lambda r, real=real, rows=rows: (rows.append(len(r.ids)), real(r))[1]  # type: ignore
        again = llm.generate([prompt], GREEDY)[0]
        assert again.cached_tokens_by_tier.get(Medium.HOST, 0) > 0 and rows[0] == 2  # the last 2 tokens
        got[layered] = [first.outputs[0].token_ids, again.outputs[0].token_ids]
        gate = runner.cache.gate
        assert (gate is not None) == layered
        if gate is not None:
            assert gate.waited == [0, 1] and not gate.armed
        llm.close()
    assert got[True] == got[False] and got[True][0] == got[True][1]
