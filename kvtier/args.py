"""Engine ``--flags``, made from :class:`kvtier.config.EngineArgs` (each argument is declared once, there).

::

    EngineArgs field                          --flag                                  argparse
    ─────────────────────────────────────     ───────────────────────────────────     ──────────────────────
    block_size: int = 16                      --block-size BLOCK_SIZE                 type=int
    kv_host_gb: float = 0.0                   --kv-host-gb KV_HOST_GB                 type=float
    kv_device_blocks: int | None = None       --kv-device-blocks KV_DEVICE_BLOCKS     type=int (None: unset)
    dtype: DType (a Literal)                  --dtype {auto,float32,bfloat16,float16} choices
    enable_prefix_caching: bool = True        --enable-prefix-caching / --no-...      BooleanOptionalAction

The help text is the field's ``metadata["help"]``; ``metadata["aliases"]`` adds other spellings of the
flag, ``metadata["metavar"]`` names its value in the help (``--chat-template FILE``). ``generate``,
``chat``, ``serve`` and ``bench serve`` take every engine flag; a benchmark or demo takes the few it
varies, with its own defaults. Torch-free and cheap to import (``kvtier --help``).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from kvtier.config import EngineArgs

ENGINE_GROUP = "engine (the keyword arguments of LLM(...))"


def _argparse_kwargs(hint: Any) -> dict[str, Any]:
    """``add_argument`` keywords for an annotation: bool, a Literal, int, float or str (or ``X | None``)."""
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(hint) is Literal:
        return {"choices": typing.get_args(hint)}
    kinds = [k for k in typing.get_args(hint) or (hint,) if k is not type(None)]
    if len(kinds) != 1 or kinds[0] not in (int, float, str):
        raise TypeError(f"EngineArgs field type {hint!r} has no --flag form")
    return {"type": kinds[0]}


def add_engine_args(
    parser: argparse.ArgumentParser,
    names: Iterable[str] | None = None,
    *,
    defaults: Mapping[str, Any] | None = None,
    notes: Mapping[str, str] | None = None,
) -> None:
    """Add the flags of the ``EngineArgs`` fields ``names`` (all of them when None), in field order.

    ``defaults`` replaces a field's default for this command (the help then says so); ``notes`` adds a
    command's own remark to a flag's help, in parentheses.
    """
    hints = typing.get_type_hints(EngineArgs)
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    wanted = set(fields if names is None else names)
    if unknown := wanted - set(fields):
        raise ValueError(f"not EngineArgs fields: {', '.join(sorted(unknown))}")
    defaults, notes = defaults or {}, notes or {}
    group = parser.add_argument_group(ENGINE_GROUP)
    for name, f in fields.items():
        if name not in wanted:
            continue
        help_text = f.metadata["help"]
        if name in defaults:
            help_text += f" (default {defaults[name]})"
        if name in notes:
            help_text += f" ({notes[name]})"
        flags = ["--" + name.replace("_", "-"), *f.metadata.get("aliases", ())]
        default = defaults.get(name, None if f.default is dataclasses.MISSING else f.default)
        kwargs = _argparse_kwargs(hints[name])
        if "metavar" in f.metadata:  # e.g. --chat-template FILE
            kwargs["metavar"] = f.metadata["metavar"]
        group.add_argument(*flags, dest=name, default=default, help=help_text, **kwargs)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The ``EngineArgs`` of the engine flags in ``ns`` (defaults for the others), validated: a bad flag
    value fails before anything slow starts."""
    fields = dataclasses.fields(EngineArgs)
    # None: not given and no default of the command's own (kvtier serve's role-dependent scheduling
    # flags, resolved by kvtier.server.serve.serve_engine_args first): the field's default
    given = {f.name: getattr(ns, f.name, None) for f in fields}
    args = EngineArgs(**{name: value for name, value in given.items() if value is not None})
    args.validate()
    return args


def engine_kwargs(args: EngineArgs) -> dict[str, Any]:
    """``args`` as ``LLM(args.model, **engine_kwargs(args))`` takes them."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name != "model"}
