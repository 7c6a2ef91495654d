"""One reading of an HF ``config.json`` (``kvtier.hf_config``) under its two users: the loader's
``parse_config`` (what the engine runs) and the planner's ``hf_spec`` (any decoder)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.config import ConfigError
from kvtier.hf_config import DecoderShape, decoder_shape, read_json
from kvtier.models.hf_loader import parse_config
from kvtier.planner_presets import hf_spec

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
SHAPE = DecoderShape(
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    hidden_size=64,
    intermediate_size=128,
    vocab_size=100,
    tie_word_embeddings=True,
)


def _write(tmp_path: Path, cfg: object) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_loader_and_planner_read_the_same_shape(tmp_path: Path) -> None:
    assert decoder_shape(QWEN2) == SHAPE
    model_config = parse_config(QWEN2)
    spec = hf_spec(_write(tmp_path, QWEN2))
    for name, value in dataclasses.asdict(SHAPE).items():
        assert getattr(model_config, name) == value == spec[name], name


def test_planner_and_loader_read_the_same_qwen3(tmp_path: Path) -> None:
    qwen3 = {**QWEN2, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32}
    config = parse_config(qwen3)
    assert config.family == "qwen3" and config.head_dim == 32
    spec = hf_spec(_write(tmp_path, qwen3))
    assert spec["qk_norm"] and spec["head_dim"] == 32 and spec["max_context"] == 512


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vocab_size": None}, "is missing 'vocab_size'"),
        ({"num_attention_heads": "four"}, "has an invalid value"),
        ({"num_attention_heads": 0}, "has an invalid value"),
    ],
)
def test_both_name_the_file_in_errors(tmp_path: Path, change: dict, message: str) -> None:
    cfg = {k: v for k, v in {**QWEN2, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=f"^config.json {message}"):
        parse_config(cfg)
    path = _write(tmp_path, cfg)
    with pytest.raises(ConfigError) as info:
        hf_spec(path)
    assert str(info.value).startswith(f"{path} {message}")


def test_read_json(tmp_path: Path) -> None:
    assert read_json(_write(tmp_path, {"a": 1})) == {"a": 1}
    with pytest.raises(ConfigError, match="does not hold a JSON object"):
        read_json(_write(tmp_path, [1]))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="cannot read .*bad.json"):
        read_json(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read"):
        read_json(tmp_path / "absent.json")


def test_hf_config_is_torch_free() -> None:
    code = "import sys, kvtier.hf_config, kvtier.planner_presets; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
