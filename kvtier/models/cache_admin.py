"""``kvtier cache``: what the model cache holds on disk, and clearing it.

The cache root is ``$KVTIER_CACHE_DIR`` or ``~/.cache/kvtier/models`` (:func:`loader.default_cache_dir`)::

    <fingerprint>/             one GGUF's conversion (kvtier/models/loader.py), named by the GGUF's digest
                               (an HF directory's holds only its packed files)
        config.json, model.safetensors, tokenizer*.json, kvtier_manifest.json    the fp32 HF model
        fused-<dtype>-v<N>.safetensors    auto's fused, transposed matrices (qpack.keep_dense)
        packed-<mode>-v<N>.safetensors    gguf / int8 rows for the C kernels (qpack.load_packed)
    .tmp-* / .trash-*          what an interrupted conversion left behind
    <file>.gguf                a packaged GGUF joined from its chunk packages (``--model gemma-3-270m``);
    .<file>.gguf.tmp-*         an interrupted join
    kernels/                   the C kernels built from this checkout's sources, measured GEMV choices

``--clear`` takes one of three scopes:

* ``derived``: the fused and packed files. The next start that needs one builds it again (seconds).
* ``stale``: joined GGUFs whose packages are gone or no longer add up to them, interrupted joins;
  conversions no known GGUF has the digest of any more (the one that made it is gone or
  changed, and it is not the default model's), damaged or unfinished conversions, leftovers of
  interrupted conversions, and kernel libraries built from sources other than this installation's.
  A GGUF moved elsewhere looks gone: its next start converts it again.
* ``all``: the whole cache (every conversion, the joined GGUFs: joined again at their next use, the
  kernels and the GEMV choices).

Each conversion is removed while holding its conversion lock, so a process converting that GGUF at
the moment finishes first. A running engine keeps the files it has memory-mapped (POSIX unlink).
Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.config import ConfigError
from kvtier.models import loader

SCOPES = ("derived", "stale", "all")
KERNEL_SOURCES = ("qmatmul.c", "fused.c", "decode_program.c", "kvattn.c")


@dataclass
class Entry:
    """One conversion directory: where it came from, whether that still holds, and its files' sizes."""

    path: Path
    source: str  # the GGUF it was converted from ("" when the manifest cannot be read)
    # "ok", "hf model" (packed files only); stale: "gguf gone", "gguf changed", "damaged", "incomplete"
    status: str
    conversion_bytes: int = 0
    derived: dict[str, int] = field(default_factory=dict)  # file name -> bytes (fused-*, packed-*)

    @property
    def stale(self) -> bool:
        return self.status not in ("ok", "hf model")

    @property
    def total_bytes(self) -> int:
        return self.conversion_bytes + sum(self.derived.values())


def _is_derived(name: str) -> bool:
    return name.endswith(".safetensors") and name.startswith(("fused-", "packed-"))


def _default_fingerprint() -> str | None:
    """The embedded default model's digest (its conversion is in use whatever path converted it)."""
    try:
        return loader.fingerprint_gguf(loader.default_model_path())
    except (ValueError, OSError):
        return None


def _status(path: Path, default: str | None) -> tuple[str, str]:
    """``(source, status)`` of a cache directory. A conversion is named by its GGUF's digest, so it
    serves any file with those bytes: it is in use when the GGUF that made it (its manifest's
    ``source``) or the default model still has that digest. Without a manifest, a directory holding
    only packed files is an HF directory's (``qpack.packed_weights``): its source is not recorded."""
    try:
        source = str(json.loads((path / loader.MANIFEST).read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        names = [f.name for f in path.iterdir()]
        if names and all(_is_derived(n) for n in names):
            return "", "hf model"
        return "", "incomplete"
    if not loader.cache_is_valid(path, path.name):
        return source, "damaged"
    if path.name == default:
        return source, "ok"
    gguf = Path(source)
    try:
        if loader.fingerprint_gguf(gguf) == path.name:
            return source, "ok"
        return source, "gguf changed"
    except OSError:
        return source, "gguf gone"


def entries(root: Path) -> list[Entry]:
    """Every conversion directory under ``root`` (not the kernels, not leftovers), by name."""
    out, default = [], _default_fingerprint()
    for path in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if path.name == "kernels":
            continue
        source, status = _status(path, default)
        entry = Entry(path, source, status)
        for file in path.iterdir():
            if file.is_file():
                size = file.stat().st_size
                if _is_derived(file.name):
                    entry.derived[file.name] = size
                else:
                    entry.conversion_bytes += size
        out.append(entry)
    return out


def leftovers(root: Path) -> list[Path]:
    """Directories interrupted conversions left (``.tmp-<fingerprint>-*``, ``.trash-<fingerprint>-*``)."""
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith((".tmp-", ".trash-")))


def joined_ggufs(root: Path) -> list[tuple[Path, str]]:
    """The packaged GGUFs joined into ``root`` (``loader.packaged_gguf_path``), each with its status:
    "ok", or stale: "parts gone" (its packages were uninstalled) or "size changed" (its parts no longer
    add up to it; its next use joins it again)."""
    out = []
    for model in {m.file_name: m for m in loader.PACKAGED_MODELS.values()}.values():
        path = root / model.file_name
        if not path.is_file():
            continue
        try:
            size = sum(p.stat().st_size for p in loader.part_paths(model))
        except (ConfigError, OSError):
            out.append((path, "parts gone"))
            continue
        out.append((path, "ok" if path.stat().st_size == size else "size changed"))
    return out


def interrupted_joins(root: Path) -> list[Path]:
    """Temporary files of joins that were interrupted (``.<file>.tmp-*``)."""
    names = {m.file_name for m in loader.PACKAGED_MODELS.values()}
    return sorted(p for n in names for p in root.glob(f".{n}.tmp-*") if p.is_file())


def _clear_joined(root: Path, scope: str) -> tuple[int, int]:
    """``clear`` for the joined GGUFs (each under its join lock, so a join under way finishes first)."""
    removed = freed = 0
    for path, status in joined_ggufs(root):
        if scope == "all" or (scope == "stale" and status != "ok"):
            with loader._conversion_lock(root, path.name):
                freed += _size(path) if path.exists() else 0
                path.unlink(missing_ok=True)
            removed += 1
    if scope in ("stale", "all"):
        for path in interrupted_joins(root):
            freed += _size(path)
            path.unlink(missing_ok=True)
            removed += 1
    return removed, freed


def current_kernels() -> set[str]:
    """File names of the kernel libraries this installation's sources build."""
    from kvtier.models import qkernels

    here = Path(qkernels.__file__).parent
    return {qkernels.library_path(here / name).name for name in KERNEL_SOURCES}


def stale_kernels(root: Path) -> list[Path]:
    """Built libraries in ``root/kernels`` that no source of this installation builds any more."""
    directory = root / "kernels"
    if not directory.is_dir():
        return []
    keep = current_kernels()
    return sorted(p for p in directory.glob("*.so") if p.name not in keep)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:,.0f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:,.1f} kB"


def _remove_entry(root: Path, path: Path, files: list[str] | None = None) -> int:
    """Delete ``files`` of a cache directory (None: all of it) under its lock, and the directory once
    empty; bytes freed."""
    with loader._conversion_lock(root, path.name):
        targets = [path] if files is None else [path / name for name in files]
        freed = sum(_size(t) for t in targets if t.exists())
        for target in targets:
            if target.is_dir():
                shutil.rmtree(target, ignore_errors=True)
            else:
                target.unlink(missing_ok=True)
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    return freed


def clear(root: Path, scope: str) -> tuple[int, int]:
    """Remove what ``scope`` names; ``(paths removed, bytes freed)``."""
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}: choose one of {', '.join(SCOPES)}")
    removed = freed = 0
    for entry in entries(root):
        if scope == "derived" and entry.derived:
            freed += _remove_entry(root, entry.path, list(entry.derived))
            removed += len(entry.derived)
        elif scope == "all" or (scope == "stale" and entry.stale):
            freed += _remove_entry(root, entry.path)
            removed += 1
    if scope in ("stale", "all"):
        for path in leftovers(root):
            fingerprint = path.name.split("-")[1]
            with loader._conversion_lock(root, fingerprint):  # an interrupted one, not one under way
                freed += _size(path) if path.exists() else 0
                shutil.rmtree(path, ignore_errors=True)
            removed += 1
        every = [root / "kernels"] if (root / "kernels").is_dir() else []
        for path in every if scope == "all" else stale_kernels(root):
            freed += _size(path)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed += 1
    joined = _clear_joined(root, scope)
    return removed + joined[0], freed + joined[1]


def report(root: Path) -> list[str]:
    """The table ``kvtier cache`` prints."""
    found = entries(root)
    lines = [f"kvtier cache: {root}"]
    if found:
        lines.append(f"  {'conversion':<14} {'status':<15} {'fp32 model':>11} {'derived':>11}  source")
    for e in found:
        derived = ", ".join(
            f"{n.removesuffix('.safetensors')} {_mb(b)}" for n, b in sorted(e.derived.items())
        )
        lines.append(
            f"  {e.path.name[:12]:<14} {e.status:<15} {_mb(e.conversion_bytes):>11} "
            f"{_mb(sum(e.derived.values())):>11}  {e.source or '-'}"
        )
        if derived:
            lines.append(f"  {'':<14} {'':<15} {'':>11} {'':>11}  derived: {derived}")
    joined, joins = joined_ggufs(root), interrupted_joins(root)
    for path, status in joined:
        lines.append(f"  joined GGUF    {status:<15} {_mb(_size(path)):>11} {'':>11}  {path}")
    rest = leftovers(root) + joins
    kernels = root / "kernels"
    kernel_bytes = _size(kernels) if kernels.is_dir() else 0
    old = stale_kernels(root)
    total = sum(e.total_bytes for e in found) + sum(_size(p) for p in rest) + kernel_bytes
    total += sum(_size(path) for path, _ in joined)
    if rest:
        lines.append(f"  interrupted conversions: {len(rest)} ({_mb(sum(_size(p) for p in rest))})")
    lines.append(
        f"  kernels: {_mb(kernel_bytes)}" + (f", {len(old)} built from other sources" if old else "")
    )
    stale = [e for e in found if e.stale] + [path for path, status in joined if status != "ok"]
    lines.append(
        f"  total {_mb(total)}: derived files {_mb(sum(sum(e.derived.values()) for e in found))} "
        f"(--clear derived), stale {len(stale) + len(rest) + len(old)} (--clear stale)"
    )
    return lines


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--clear",
        choices=SCOPES,
        default=None,
        help="remove derived files (rebuilt when needed), stale entries, or all of the cache",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="the cache root (default: $KVTIER_CACHE_DIR or ~/.cache/kvtier/models)",
    )
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    root = Path(ns.cache_dir).expanduser() if ns.cache_dir else loader.default_cache_dir()
    if root.exists() and not root.is_dir():
        raise ValueError(f"the cache root {root} is not a directory")
    if not root.is_dir():
        print(f"kvtier cache: {root} holds nothing yet")
        return 0
    if ns.clear:
        removed, freed = clear(root, ns.clear)
        print(f"kvtier cache: --clear {ns.clear}: removed {removed} item(s), freed {_mb(freed)}")
    print("\n".join(report(root)))
    return 0
