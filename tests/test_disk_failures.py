"""The disk tier when the disk misbehaves: a directory that cannot be created or written, a disk full
at startup or filling up mid-run, store errors sorted into retry / skip / fatal, and a tier disabled
while I/O is still in flight. The tier degrades with one log line and never loses or corrupts a block.
Helpers and the tiny block shape are test_disk_tier.py's.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from kvtier.tiers import disk as disk_module
from kvtier.transfer.mover import byte_view
from tests.test_disk_tier import IDENT, LOGGER, K, block, disk_records, disk_worker, make_tier, store


# ------------------------------------------------------------------------------------------ degraded disks
def test_directory_that_cannot_be_created_disables_the_tier(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("a regular file")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        tier = make_tier(tmp_path / "file" / "kv")
    assert tier.disabled and "cannot write" in (tier.disabled_reason or "")
    assert len(disk_records(caplog)) == 1
    assert tier.lookup([K("A")]) == 0 and not tier.contains(K("A"))
    assert tier.prepare_store([K("A")]).keys == () and tier.capacity_blocks == 0


def _run_python(
    body: str, directory: Path, *, file_size_limit: int | None = None, as_nobody: bool = False
) -> str:
    """Run ``body`` in a Python subprocess (``directory`` and logging to stdout set up); its stdout.

    ``file_size_limit``: writes past it fail with EFBIG (a full disk that even root cannot write through).
    ``as_nobody``: run as uid 65534 via ``setpriv``, for whom chmod 555 really is read-only."""
    prelude = f"""
        import logging, resource, signal, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(name)s %(message)s")
        directory = {str(directory)!r}
    """
    if file_size_limit is not None:
        prelude += f"""
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        hard_limit = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, ({file_size_limit}, hard_limit))
    """
    code = textwrap.dedent(prelude) + textwrap.dedent(body)
    cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if as_nobody else []
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(
        [*cmd, sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _disk_log_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("LOG kvtier.tiers.disk")]


_OPEN_TIER = """
    from kvtier.tiers.base import TierIdentity
    from kvtier.tiers.disk import DiskTier
    tier = DiskTier(directory, 1 << 20, TierIdentity("ab", "float32", (2, 4), 4))
    print("RESULT", tier.disabled, tier.lookup([bytes(32)]), tier.prepare_store([bytes(32)]).keys)
"""


def test_read_only_directory_disables_the_tier(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if os.geteuid() != 0:
        tmp_path.chmod(0o555)
        try:
            with caplog.at_level(logging.INFO, logger=LOGGER):
                tier = make_tier(tmp_path)
        finally:
            tmp_path.chmod(0o755)
        assert tier.disabled and len(disk_records(caplog)) == 1 and tier.prepare_store([K("A")]).keys == ()
        return
    if shutil.which("setpriv") is None:  # root writes through chmod: drop to nobody
        pytest.skip("running as root without setpriv to drop privileges")
    with tempfile.TemporaryDirectory() as parent:  # not under pytest's root-only (0700) tmp dir
        os.chmod(parent, 0o755)
        (Path(parent) / "kv").mkdir(mode=0o555)
        out = _run_python(_OPEN_TIER, Path(parent) / "kv", as_nobody=True)
    assert "RESULT True 0 ()" in out
    assert len(_disk_log_lines(out)) == 1 and "EACCES" in _disk_log_lines(out)[0]


def test_full_disk_at_startup_disables_the_tier(tmp_path: Path) -> None:
    out = _run_python(_OPEN_TIER, tmp_path / "kv", file_size_limit=0)
    assert "RESULT True 0 ()" in out
    assert len(_disk_log_lines(out)) == 1 and "EFBIG" in _disk_log_lines(out)[0]


def test_disk_filling_up_mid_run_reports_fatal_and_degrades(tmp_path: Path) -> None:
    out = _run_python(
        """
        import os, torch
        from kvtier.tiers.base import TierIdentity
        from kvtier.tiers.disk import DiskBlockIO, DiskTier
        from kvtier.transfer.io_worker import BlockIOWorker
        from kvtier.transfer.mover import byte_view
        identity = TierIdentity("ab", "float32", (2, 4), 4)
        tier, worker = DiskTier(directory, 1 << 20, identity), BlockIOWorker(DiskBlockIO(identity))
        spec = tier.prepare_store([bytes(32)])
        worker.submit_store(spec.keys[0], spec.addresses[0], byte_view(torch.ones(2, 4)))
        (result,) = worker.drain(30)
        tier.complete_store(spec.keys, result.ok)
        if result.fatal:
            tier.disable(result.error)
            tier.disable("again")  # logged once
        shard = os.path.dirname(spec.addresses[0])
        print("RESULT", result.ok, result.fatal, "EFBIG" in result.error, os.listdir(shard))
        print("AFTER", tier.lookup([bytes(32)]), tier.prepare_store([bytes(32)]).keys, worker.pending)
        worker.close()
        """,
        tmp_path / "kv",
        file_size_limit=1024,  # the 1-byte probe fits, a block file does not
    )
    assert "RESULT False True True []" in out  # fatal, and the temp file is gone
    assert "AFTER 0 () 0" in out
    assert sum("disabled" in line for line in _disk_log_lines(out)) == 1


@pytest.mark.parametrize(
    ("code", "fatal"),
    [
        (errno.ENOSPC, True),
        (errno.EROFS, True),
        (errno.EACCES, True),
        (errno.EDQUOT, True),
        (errno.EIO, False),
    ],
)
def test_store_error_classification(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, code: int, fatal: bool
) -> None:
    def failing_write(*args, **kwargs):
        raise OSError(code, os.strerror(code), "x.kvb")

    monkeypatch.setattr(disk_module, "write_block_file", failing_write)
    worker = disk_worker(IDENT)
    worker.submit_store(K("A"), str(tmp_path / "a.kvb"), byte_view(block()))
    (result,) = worker.drain(timeout=10)
    worker.close(timeout=10)
    assert not result.ok and result.fatal is fatal and errno.errorcode[code] in (result.error or "")


def test_disable_keeps_files_and_tolerates_late_completions(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    worker = disk_worker(IDENT)
    try:
        tier = make_tier(tmp_path)
        store(tier, worker, "AB")
        tier.prepare_load([K("A")])
        spec = tier.prepare_store([K("C")])
        with caplog.at_level(logging.INFO, logger=LOGGER):
            tier.disable("ENOSPC: No space left on device")
            tier.disable("ENOSPC again")
        assert len(disk_records(caplog)) == 1
        tier.complete_load([K("A")])  # completions in flight at the time are ignored
        tier.complete_store(spec.keys, ok=True)
        assert tier.keys() == [] and tier.num_used_blocks == 0 and tier.lookup([K("A")]) == 0
        assert os.path.exists(tier.path_of(K("A")))  # kept for the next run
        assert make_tier(tmp_path).lookup([K("A"), K("B")]) == 2
    finally:
        worker.close(timeout=10)
