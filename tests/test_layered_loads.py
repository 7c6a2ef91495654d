"""Layered loads (``--layered-loads``): a prefix loaded back from the host tier is copied layer slot by
layer slot, and each layer waits only for its own slot (``kvtier/models/slot_gate.py``).

On a CPU the copies are synchronous, so what these tests can check is everything but the overlap: the
per-slot copies put every byte where whole-block copies put it (consecutive and scattered device
blocks, runs across host chunks), the engine's answers are the same with and without them, and every
layer of every model family asks the gate for its slot, in layer order, before it reads the pool.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.config import ConfigError
from kvtier.kv.plan import SwapPlan
from kvtier.models.slot_gate import SlotGate
from kvtier.stats import Medium
from kvtier.transfer import cuda_copy
from kvtier.transfer import mover as mover_module
from kvtier.transfer.mover import TierMover

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def movers(num_blocks: int, num_host: int, block_shape: tuple[int, ...]) -> tuple[TierMover, TierMover]:
    """Two movers over pools of the same random bytes, host buffers alike: whole and layered."""
    torch.manual_seed(0)
    pool = torch.randn(num_blocks, *block_shape)
    whole = TierMover(pool.clone(), num_host)
    layered = TierMover(pool.clone(), num_host, gate=SlotGate(block_shape[0], pool.device))
    for h in range(num_host):
        noise = torch.randn(*block_shape)
        whole.host.block(h).copy_(noise)
        layered.host.block(h).copy_(noise)
    return whole, layered


def test_per_slot_copies_put_every_byte_where_whole_blocks_do(monkeypatch) -> None:
    """Random plans of loads: runs of consecutive host blocks into consecutive, reversed and scattered
    device blocks, some across a host chunk boundary (3 blocks a chunk here)."""
    block_shape = (4, 2, 2, 1, 3)  # S = 4 layer slots of 2 tokens
    block_bytes = 4 * 2 * 2 * 1 * 3 * 4
    monkeypatch.setattr(mover_module, "CHUNK_BYTES", 3 * block_bytes)
    rng = random.Random(3)
    for _ in range(40):
        whole, layered = movers(24, 12, block_shape)
        assert layered.host.blocks_per_chunk == 3
        hosts = sorted(rng.sample(range(12), rng.randint(1, 10)))
        devices = list(range(5, 5 + len(hosts)))
        order = rng.choice(["consecutive", "reversed", "scattered"])
        if order == "reversed":
            devices.reverse()
        elif order == "scattered":
            devices = rng.sample(range(24), len(hosts))
        plan = SwapPlan(loads=list(zip(hosts, devices, strict=True)))
        whole.execute(plan)
        layered.execute(plan)
        assert torch.equal(whole.device_kv, layered.device_kv), order
        assert layered.gate is not None and layered.gate.armed  # nothing waited yet: the forward will


def test_a_plan_with_stores_is_copied_whole_and_the_gate_stays_down() -> None:
    whole, layered = movers(8, 4, (2, 2, 2, 1, 3))
    plan = SwapPlan(stores=[(6, 3)], loads=[(0, 2), (1, 3)])
    whole.execute(plan)
    layered.execute(plan)
    assert torch.equal(whole.device_kv, layered.device_kv)
    assert torch.equal(whole.host.block(3), layered.host.block(3))
    assert layered.gate is not None and not layered.gate.armed


@pytest.fixture(scope="module")
def four_layers(tiny_llama_dir) -> str:
    return str(tiny_llama_dir(num_heads=4, num_kv_heads=2, hidden_size=64, num_hidden_layers=4))


def load_back(directory: str, layered: bool, **kwargs) -> tuple[list[list[int]], LLM]:
    """A 64-token prompt answered, pushed down to the host tier by another prompt, then (the engine
    idle: what it evicts was written back ahead) answered again from the host tier."""
    from kvtier.bench.gpu_speed import settle

    llm = LLM(directory, block_size=4, kv_device_blocks=24, kv_host_gb=1 / 1024, layered_loads=layered,
              **kwargs)  # fmt: skip
    prompt = [3 + (i * 7) % 400 for i in range(62)]
    answers = [llm.generate([prompt], GREEDY)[0]]
    llm.generate([[5 + (i * 131) % 490 for i in range(80)]], GREEDY)  # evicts the prompt's blocks
    settle(llm.engine)
    answers.append(llm.generate([prompt], GREEDY)[0])
    assert answers[1].cached_tokens_by_tier.get(Medium.HOST, 0) > 0
    return [a.outputs[0].token_ids for a in answers], llm


@pytest.mark.parametrize("backend", ["torch", "c"])
def test_a_layered_load_answers_as_a_whole_one_and_every_layer_waited_for_its_slot(
    four_layers, backend
) -> None:
    if backend == "c" and torch.cuda.is_available():
        pytest.skip("the C kernels run on a CPU")
    whole, plain = load_back(four_layers, False, attention_backend=backend)
    got, llm = load_back(four_layers, True, attention_backend=backend)
    assert got == whole and got[0] == got[1]
    gate = llm.engine.runner.cache.gate
    assert gate is not None and llm.engine.mover is not None and llm.engine.mover.gate is gate
    assert gate.waited == [0, 1, 2, 3]  # the load step's layers, in order, each before reading
    assert not gate.armed  # the runner settled it after the step
    assert plain.engine.runner.cache.gate is None
    plain.close()
    llm.close()


def test_a_hybrid_model_waits_for_the_slot_of_each_layer(tiny_gemma3_sliding_dir) -> None:
    """Gemma 3's two KV groups (a sliding and a full layer) each keep their layer in slot 0 of their
    own blocks: both layers wait for slot 0."""
    whole, plain = load_back(str(tiny_gemma3_sliding_dir), False)
    got, llm = load_back(str(tiny_gemma3_sliding_dir), True)
    assert got == whole
    gate = llm.engine.runner.cache.gate
    assert gate is not None and gate.num_slots == 1 and gate.waited == [0, 0]
    plain.close()
    llm.close()


def test_layered_loads_without_a_host_tier_are_a_clear_error(four_layers) -> None:
    with pytest.raises(ConfigError, match="layered_loads needs kv_host_gb"):
        LLM(four_layers, block_size=4, kv_device_blocks=24, layered_loads=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU torch: no CUDA runtime in the process")
def test_the_2d_copy_is_unavailable_without_a_cuda_runtime() -> None:
    assert not cuda_copy.available()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: 2-D copies, waits in graphs")
def test_on_cuda_a_graph_replayed_layered_load_answers_as_a_whole_one(four_layers) -> None:
    """The prefix's last block replays a captured graph whose layers wait for their slots' events."""
    pytest.importorskip("triton")
    whole, plain = load_back(four_layers, False, attention_backend="triton")
    got, llm = load_back(four_layers, True, attention_backend="triton")
    assert llm.engine.runner.graphs is not None and llm.engine.mover is not None
    assert llm.engine.mover.gate is not None  # capture kept the waits
    assert got == whole and llm.engine.runner.cache.gate.waited == [0, 1, 2, 3]
    plain.close()
    llm.close()
