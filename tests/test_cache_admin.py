"""``kvtier cache``: the model cache listed, and cleared by scope, on real conversions of tiny GGUFs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.cli import main
from kvtier.models import cache_admin, qpack
from kvtier.models.llama import LlamaModel
from kvtier.models.loader import cache_is_valid, load_model


def cache(capsys: pytest.CaptureFixture, *args: str) -> str:
    assert main(["cache", *args]) == 0
    return capsys.readouterr().out


def row(out: str, fingerprint: str) -> str:
    return next(line for line in out.splitlines() if line.strip().startswith(fingerprint[:12]))


def test_story_the_cache_is_listed_then_cleared_scope_by_scope(
    tiny_gguf: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    root = tmp_path / "cache"
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(root))
    # Act 1: three GGUFs converted; the first also keeps packed gguf rows and auto's fused matrices.
    kept, gone, changed = (tmp_path / f"{q}.gguf" for q in ("Q8_0", "Q4_1", "Q4_0"))
    for path in (kept, gone, changed):  # copies: the fixture's files are shared by the session
        shutil.copyfile(tiny_gguf(qtype=path.stem).path, path)
    loaded = [load_model(path, cache_dir=root) for path in (kept, gone, changed)]
    qpack.load_packed(loaded[0], "gguf", "float32")
    dense = LlamaModel(loaded[0].config, loaded[0].weights, torch.float32, 64).dense_groups()
    qpack.keep_dense(loaded[0], torch.float32, dense)
    home = loaded[0].converted
    derived = sorted(p.name for p in home.iterdir() if p.name.startswith(("packed-", "fused-")))
    assert derived == ["fused-float32-v1.safetensors", f"packed-gguf-v{qpack.PACK_VERSION}.safetensors"]
    # ... then one GGUF is deleted, one rewritten, a conversion was interrupted, a kernel is from old code.
    gone.unlink()
    with open(changed, "ab") as f:
        f.write(b"\0" * 64)
    (root / f".tmp-{loaded[1].fingerprint}-x1").mkdir()
    (root / f".tmp-{loaded[1].fingerprint}-x1" / "model.safetensors").write_bytes(b"half")
    (root / "kernels").mkdir(exist_ok=True)
    (root / "kernels" / "qmatmul-0000000000000000.so").write_bytes(b"old build")

    out = cache(capsys)
    assert "ok" in row(out, loaded[0].fingerprint) and str(kept) in row(out, loaded[0].fingerprint)
    assert "gguf gone" in row(out, loaded[1].fingerprint)
    assert "gguf changed" in row(out, loaded[2].fingerprint)
    assert "interrupted conversions: 1" in out and "1 built from other sources" in out
    assert "fused-float32-v1" in out and "stale 4 (--clear stale)" in out

    # Act 2: derived files go; the conversion stays valid, and the next gguf start packs again.
    out = cache(capsys, "--clear", "derived")
    assert "--clear derived: removed 2 item(s)" in out
    assert not any(p.name.startswith(("packed-", "fused-")) for p in home.iterdir())
    assert cache_is_valid(home, loaded[0].fingerprint)
    assert qpack.load_packed(load_model(kept, cache_dir=root), "gguf", "float32")[0]

    # Act 3: stale entries go (gone, changed, the leftover, the old kernel); the kept one stays.
    out = cache(capsys, "--clear", "stale")
    assert "--clear stale: removed 4 item(s)" in out
    names = sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock"))
    assert names == sorted([loaded[0].fingerprint, "kernels"])
    assert not (root / "kernels" / "qmatmul-0000000000000000.so").exists()
    assert "ok" in row(out, loaded[0].fingerprint) and "stale 0" in out

    # Act 4: all of it.
    cache(capsys, "--clear", "all")
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) == []


def test_an_hf_models_packed_rows_are_derived_not_stale(tmp_path: Path) -> None:
    """A directory with packed files only is an HF model's (its source is not recorded): kept by
    ``--clear stale``, removed with its last file by ``--clear derived``."""
    hf = tmp_path / "abc123"
    hf.mkdir()
    (hf / "packed-int8-v2.safetensors").write_bytes(b"rows")
    (entry,) = cache_admin.entries(tmp_path)
    assert (
        entry.status == "hf model" and not entry.stale and entry.derived == {"packed-int8-v2.safetensors": 4}
    )
    assert cache_admin.clear(tmp_path, "stale") == (0, 0)
    assert cache_admin.clear(tmp_path, "derived") == (1, 4) and not hf.exists()
    (tmp_path / "def456").mkdir()
    (tmp_path / "def456" / "model.safetensors").write_bytes(b"no manifest: unfinished")
    assert [e.status for e in cache_admin.entries(tmp_path)] == ["incomplete"]


def test_keep_fused_0_stores_nothing(tiny_gguf: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_model(tiny_gguf(qtype="Q8_0").path, cache_dir=tmp_path)
    dense = LlamaModel(loaded.config, loaded.weights, torch.float32, 64).dense_groups()
    monkeypatch.setenv("KVTIER_KEEP_FUSED", "0")
    qpack.keep_dense(loaded, torch.float32, dense)
    assert not list(loaded.converted.glob("fused-*"))
    monkeypatch.delenv("KVTIER_KEEP_FUSED")
    qpack.keep_dense(loaded, torch.float32, dense)
    assert [p.name for p in loaded.converted.glob("fused-*")] == ["fused-float32-v1.safetensors"]


def test_bad_cache_flags_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["cache", "--clear", "everything"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtier: error:") and "derived" in err and len(err.splitlines()) == 1
    assert main(["cache", "--cache-dir", str(tmp_path / "none")]) == 0
    assert "holds nothing yet" in capsys.readouterr().out
    (tmp_path / "file").write_text("not a directory")
    assert main(["cache", "--cache-dir", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err.strip().endswith("is not a directory")
