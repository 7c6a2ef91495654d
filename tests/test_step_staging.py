"""A step's integer metadata reaches the device in one transfer (``kvtier/worker/staging.py``).

The staging class on its own (views equal the lists, empty lists, one upload), then the engine: every
``ModelRunner.execute`` uploads one ``StepStaging`` and makes no other host tensor for the device (no
``torch.tensor(..., device=...)``), copy-on-write pairs included; on CUDA, a step runs under
``torch.cuda.set_sync_debug_mode("error")``: no copy or ``.item()`` waits for the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.worker import runner as runner_module
from kvtier.worker.runner import ModelRunner
from kvtier.worker.staging import StepStaging

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_views_equal_the_staged_lists() -> None:
    stage = StepStaging()
    lists = [[5, 6, 7], [], [9, 9], list(range(40)), [2**40, -1]]
    handles = [stage.add(x) for x in lists]
    stage.add(iter([1, 2]))  # any iterable of ints
    stage.upload(torch.device("cpu"))
    for h, values in zip(handles, lists, strict=True):
        got = stage.get(h)
        assert got.dtype == torch.long and got.shape == (len(values),)
        assert got.tolist() == values
    assert stage.get(len(lists)).tolist() == [1, 2]
    # every view is a slice of the one uploaded tensor
    base = stage.get(handles[0])
    assert all(
        stage.get(h).untyped_storage().data_ptr() == base.untyped_storage().data_ptr() for h in handles
    )


def test_nothing_staged_uploads_an_empty_tensor() -> None:
    stage = StepStaging()
    empty = stage.add([])
    stage.upload("cpu")
    assert stage.get(empty).shape == (0,) and stage.get(empty).dtype == torch.long


def test_one_upload_per_staging() -> None:
    stage = StepStaging()
    h = stage.add([1])
    with pytest.raises(RuntimeError, match="before upload"):
        stage.get(h)
    stage.upload("cpu")
    assert stage.uploaded
    with pytest.raises(RuntimeError, match="twice"):
        stage.upload("cpu")
    with pytest.raises(RuntimeError, match="after upload"):
        stage.add([2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_upload_is_one_pinned_copy() -> None:
    stage = StepStaging()
    handles = [stage.add(range(n)) for n in (3, 0, 70)]
    stage.upload(torch.device("cuda"))
    assert [stage.get(h).device.type for h in handles] == ["cuda"] * 3
    assert [stage.get(h).tolist() for h in handles] == [list(range(3)), [], list(range(70))]


# ----------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_dir: Any) -> str:
    return str(tiny_llama_dir(num_heads=4, num_kv_heads=2, hidden_size=64))


@contextmanager
def counted_transfers(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[int]]]:
    """Per ``ModelRunner.execute`` call: how many ``StepStaging.upload`` calls it made and how many
    ``torch.tensor`` calls with a ``device=`` (a host list copied to the device on its own); also
    how many copy-on-write pairs each step carried."""
    counts: dict[str, list[int]] = {"uploads": [], "device_tensors": [], "copies": []}
    in_step = [False]
    real_upload, real_tensor, real_execute = StepStaging.upload, torch.tensor, ModelRunner.execute

    def upload(self: StepStaging, device: Any) -> None:
        if in_step[0]:
            counts["uploads"][-1] += 1
        real_upload(self, device)

    def tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        if in_step[0] and kwargs.get("device") is not None:
            counts["device_tensors"][-1] += 1
        return real_tensor(*args, **kwargs)

    def execute(self: ModelRunner, out: Any) -> Any:
        for key in ("uploads", "device_tensors"):
            counts[key].append(0)
        counts["copies"].append(len(out.block_copies))
        in_step[0] = True
        try:
            return real_execute(self, out)
        finally:
            in_step[0] = False

    monkeypatch.setattr(StepStaging, "upload", upload)
    monkeypatch.setattr(runner_module.torch, "tensor", tensor)  # torch itself: any module's call counts
    monkeypatch.setattr(ModelRunner, "execute", execute)
    yield counts


def test_an_engine_step_uploads_its_metadata_once(tiny_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes, chunked prefills after a prefix hit (block tables), ragged decode rows (the mask's
    lengths), sampling rows that are not every row, and a copy-on-write fork (n = 2 on a partial block):
    each step one upload, no other ``torch.tensor`` for the device."""
    llm = LLM(tiny_dir, block_size=4, kv_device_blocks=64, max_num_batched_tokens=8)
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 500, (10,), generator=gen).tolist()
    prompts = [shared + [7, 8, 9], torch.randint(3, 500, (5,), generator=gen).tolist(), shared + [11]]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    with counted_transfers(monkeypatch) as counts:
        again = llm.generate(prompts, GREEDY)
        forked = llm.generate(
            [shared + [5]], SamplingParams(n=2, temperature=0.0, max_tokens=3, ignore_eos=True)
        )
    assert [o.outputs[0].token_ids for o in again] == expected  # the prefix hits answer alike
    assert len(forked[0].outputs) == 2
    steps = len(counts["uploads"])
    assert steps > 5 and any(counts["copies"])  # the fork's copy-on-write ran inside a step
    assert counts["device_tensors"] == [0] * steps
    assert counts["uploads"] == [1] * steps


def test_copy_blocks_alone_is_one_upload(tiny_dir: str) -> None:
    llm = LLM(tiny_dir, block_size=4, kv_device_blocks=16)
    runner = llm.engine.runner
    runner.kv_cache[3] = 1.5
    runner.copy_blocks([(3, 5), (3, 6)])
    assert torch.equal(runner.kv_cache[5], runner.kv_cache[3]) and torch.equal(
        runner.kv_cache[6], runner.kv_cache[3]
    )
    runner.copy_blocks([])  # nothing to copy: no transfer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_step_never_waits_for_the_device(tiny_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``set_sync_debug_mode("error")`` every synchronizing call (a pageable host-to-device copy,
    ``.item()``, ``.tolist()``) raises: ``ModelRunner.execute`` of a dense model makes none (the
    sampler's readback after it is the step's one sync)."""
    llm = LLM(tiny_dir, block_size=4, kv_device_blocks=64, max_num_batched_tokens=8)
    assert llm.engine.runner.device.type == "cuda"
    real_execute = ModelRunner.execute

    def execute(self: ModelRunner, out: Any) -> Any:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_execute(self, out)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(ModelRunner, "execute", execute)
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 500, (10,), generator=gen).tolist()
    prompts = [shared + [7, 8, 9], torch.randint(3, 500, (5,), generator=gen).tolist(), shared + [11]]
    llm.generate(prompts[:1], GREEDY)
    outs = llm.generate(prompts, GREEDY)
    assert outs[2].num_cached_tokens > 0
