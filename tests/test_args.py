"""Engine flags come from ``EngineArgs`` alone (``kvtier.args``): every field is a flag of every command
that runs an engine, with its type, choices and help taken from the field."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

from kvtier.args import add_engine_args, engine_args_from, engine_kwargs
from kvtier.cli import build_parser
from kvtier.config import ConfigError, EngineArgs
from kvtier.server.serve import ROLE_SCHEDULING, SERVE_ENGINE_DEFAULTS, serve_engine_args

PACKAGE = Path(__file__).resolve().parent.parent / "kvtier"


def test_every_field_has_help() -> None:
    for f in dataclasses.fields(EngineArgs):
        assert f.metadata.get("help"), f.name


@pytest.mark.parametrize("command", [["generate"], ["chat"], ["serve"], ["bench", "serve"]])
def test_every_engine_argument_is_a_flag(command: list[str]) -> None:
    ns = build_parser().parse_args(command)
    serve = SERVE_ENGINE_DEFAULTS if command == ["serve"] else {}  # a server's own (documented) defaults
    read = serve_engine_args if command == ["serve"] else engine_args_from
    serve = {**serve, **ROLE_SCHEDULING["both"]} if serve else {}  # --role both's
    assert read(ns) == EngineArgs(**serve)  # type: ignore[arg-type]  # every field present
    flags = [
        "--model", "m", "--dtype", "float32", "--block-size", "8", "--kv-device-blocks", "40",
        "--kv-device-gb", "0.5", "--max-num-seqs", "3", "--max-num-batched-tokens", "100",
        "--max-model-len", "64", "--no-enable-prefix-caching", "--kv-host-gb", "0.25",
        "--kv-disk-dir", "/tmp/d", "--kv-disk-gb", "2", "--kv-store-policy", "write_through",
        "--preemption-mode", "swap", "--seed", "7", "--num-threads", "2",
    ]  # fmt: skip
    args = read(build_parser().parse_args([*command, *flags]))
    assert args == EngineArgs(
        model="m",
        dtype="float32",
        block_size=8,
        kv_device_blocks=40,
        kv_device_gb=0.5,
        max_num_seqs=3,
        max_num_batched_tokens=100,
        max_model_len=64,
        enable_prefix_caching=False,
        kv_host_gb=0.25,
        kv_disk_dir="/tmp/d",
        kv_disk_gb=2.0,
        kv_store_policy="write_through",
        preemption_mode="swap",
        seed=7,
        num_threads=2,
        **serve,  # type: ignore[arg-type]
    )


def test_a_decode_replica_schedules_for_smooth_streams_unless_told_otherwise() -> None:
    def policy(*flags: str) -> tuple[str, float, float]:
        a = serve_engine_args(build_parser().parse_args(["serve", *flags]))
        return a.scheduling_policy, a.step_time_factor, a.step_time_max_factor

    assert policy() == ("legacy", 2.5, 0.0) == policy("--role", "prefill")
    assert policy("--role", "decode") == ("stall_free", 1.5, 1.5)  # short steps, never widened
    assert policy("--role", "decode", "--scheduling-policy", "legacy") == ("legacy", 1.5, 1.5)
    assert policy("--role", "decode", "--step-time-max-factor", "0") == ("stall_free", 1.5, 0.0)
    assert policy("--scheduling-policy", "stall_free", "--step-time-factor", "3") == ("stall_free", 3.0, 0.0)
    with pytest.raises(ConfigError, match="step_time_max_factor must be 0 or >= step_time_factor"):
        policy("--step-time-factor", "3", "--step-time-max-factor", "2")


def test_a_subset_with_its_own_defaults_and_notes() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(
        p, ["kv_host_gb", "num_threads"], defaults={"kv_host_gb": 0.5}, notes={"num_threads": "x"}
    )
    assert vars(p.parse_args([])) == {"kv_host_gb": 0.5, "num_threads": None}
    assert p.parse_args(["--threads", "3"]).num_threads == 3  # the alias from the field's metadata
    text = p.format_help()
    assert "(default 0.5)" in text and "torch CPU threads (x)" in text and "--block-size" not in text
    with pytest.raises(ValueError, match="not EngineArgs fields: bogus"):
        add_engine_args(argparse.ArgumentParser(), ["bogus"])


def test_engine_args_from_validates() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    with pytest.raises(ConfigError, match="power of two"):
        engine_args_from(p.parse_args(["--block-size", "6"]))


def test_engine_kwargs_round_trip() -> None:
    args = EngineArgs(model="m", kv_host_gb=1.0, seed=3)
    assert EngineArgs(model=args.model, **engine_kwargs(args)) == args
    assert "model" not in engine_kwargs(args)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype": "float64"}, "dtype must be auto, float32, bfloat16 or float16, got 'float64'"),
        ({"kv_store_policy": "later"}, "kv_store_policy must be write_back or write_through, got 'later'"),
        ({"preemption_mode": "x"}, "preemption_mode must be auto, swap or recompute, got 'x'"),
        ({"kv_host_gb": float("nan")}, "kv_host_gb must be a finite number, got nan"),
        ({"kv_device_gb": float("inf")}, "kv_device_gb must be a finite number, got inf"),
    ],
)
def test_validate_checks_choices_and_floats_from_the_annotations(change: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineArgs(**change).validate()
    assert str(info.value) == message


def test_no_module_imports_the_cli() -> None:
    """``kvtier.cli`` is the entry point: the commands it runs import ``kvtier.args``, never the CLI."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "cli.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "kvtier.cli" for n in names):
                offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == []
