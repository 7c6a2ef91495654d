"""The disk directory is not trusted, and may be shared: permissions, symlinks, several engines, forgeries.

Each story reproduces a failure of the disk tier before it was hardened: files
world-readable, a symlinked shard that made the start-up scan delete files outside the directory, one
engine's scan deleting another's write in flight, two engines together over the size cap, an engine
that never finds the blocks another one wrote. Keys are one-letter names: ``K("A")`` is sha256("A").
The two-engine stories run two real processes on one directory.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
import torch

from kvtier.config import TierConfig
from kvtier.kv.manager import KVCacheManager
from kvtier.stats import Medium
from kvtier.tier_stack import build_tiers
from kvtier.tiers.base import BlockKey, TierIdentity
from kvtier.tiers.block_format import HEADER_NBYTES, decode_header, encode_header, write_block_file
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_dir import LEDGER_NAME, DirectoryLedger
from kvtier.transfer.io_worker import BlockIOWorker
from tests.tier_blocks import K

SHAPE = (2, 4, 2, 1, 8)
IDENT = TierIdentity("ab" * 32, "float32", SHAPE, 4)
FILE_NBYTES = HEADER_NBYTES + IDENT.block_bytes
LOGGER = "kvtier.tiers.disk"


def data_of(key: BlockKey, seed: int = 0) -> bytes:
    """The bytes every engine stores for ``key`` (``seed`` 1: another writer's version)."""
    return hashlib.shake_256(bytes([seed]) + key).digest(IDENT.block_bytes)


def make_tier(directory: Path, num_blocks: int = 8) -> DiskTier:
    return DiskTier(directory, num_blocks * FILE_NBYTES, IDENT)


def store(tier: DiskTier, worker: BlockIOWorker, names: str) -> tuple[BlockKey, ...]:
    """The coordinator's store: prepare, write on the worker, publish. Returns the evicted keys."""
    spec = tier.prepare_store([K(n) for n in names])
    for key, path in zip(spec.keys, spec.addresses, strict=True):
        worker.submit_store(key, path, data_of(key))
    for result in worker.drain(timeout=30):
        assert result.ok, result.error
        tier.complete_store([result.key], ok=True)
    return spec.evicted


def load(tier: DiskTier, worker: BlockIOWorker, name: str) -> bytes | None:
    """The coordinator's load of one held key: its bytes, or None (invalidated: a counted miss)."""
    key = K(name)
    spec = tier.prepare_load([key])
    out = bytearray(IDENT.block_bytes)
    worker.submit_load(key, spec.addresses[0], out)
    (result,) = worker.drain(timeout=30)
    if not result.ok:
        tier.invalidate(key, result.error or "")
    tier.complete_load([key])
    return bytes(out) if result.ok else None


def block_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("??/*.kvb"))


def ledger_count(directory: Path) -> int:
    return struct.unpack("<q", (directory / LEDGER_NAME).read_bytes())[0]


def mode(path: Path) -> int:
    return path.lstat().st_mode & 0o777


@pytest.fixture
def workers():
    made: list[BlockIOWorker] = []

    def make(tier: DiskTier, secret: bytes | None = None) -> BlockIOWorker:
        made.append(BlockIOWorker(tier.block_io(secret)))
        return made[-1]

    yield make
    for worker in made:
        worker.close(timeout=10)


# ------------------------------------------------------------------------------------------ permissions
def test_files_are_0600_and_directories_0700_under_a_permissive_umask(tmp_path: Path, workers) -> None:
    previous = os.umask(0o002)
    try:
        tier = make_tier(tmp_path / "kv")
        store(tier, workers(tier), "A")
    finally:
        os.umask(previous)
    path = Path(tier.path_of(K("A")))
    assert mode(tmp_path / "kv") == 0o700 and mode(path.parent) == 0o700
    assert mode(path) == 0o600 and mode(tmp_path / "kv" / LEDGER_NAME) == 0o600


def test_older_files_are_tightened_and_an_existing_directory_keeps_its_mode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory the user made is theirs (a warning if others may write it); the shards and block
    files in it are the tier's, tightened at start-up if an older version left them 0755/0644."""
    tmp_path.chmod(0o777)
    shard = tmp_path / K("A").hex()[:2]
    shard.mkdir(mode=0o755)
    path = shard / (K("A").hex() + ".kvb")
    write_block_file(path, K("A"), IDENT, data_of(K("A")))
    shard.chmod(0o755)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tier = make_tier(tmp_path)
    assert tier.contains(K("A"))
    assert mode(tmp_path) == 0o777 and mode(shard) == 0o700 and mode(path) == 0o600
    assert any("writable by other users" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------------ symlinks
def _name_in_shard(shard: str, avoid: str) -> str:
    return next(n for n in (f"n{i}" for i in range(10_000)) if K(n).hex()[:2] == shard and n != avoid)


def test_symlinked_shard_never_leads_to_a_deletion_outside(
    tmp_path: Path, workers, caplog: pytest.LogCaptureFixture
) -> None:
    """Shard "ab" of the cache is a symlink to a directory of someone else's files, named like ours:
    an invalid block, an old temp file, a valid block. The scan leaves all three alone; a lookup that
    reaches through the symlink is a refused read (a counted miss), and nothing outside is removed."""
    cache, outside = tmp_path / "kv", tmp_path / "outside"
    cache.mkdir()
    outside.mkdir()
    shard = K("A").hex()[:2]
    valid = _name_in_shard(shard, "A")
    invalid_file = outside / (K("A").hex() + ".kvb")
    invalid_file.write_bytes(b"someone else's file")
    temp_file = outside / (K("A").hex() + ".kvb.tmp.1.0")
    temp_file.write_bytes(b"someone else's temp file")
    os.utime(temp_file, (0, 0))
    valid_file = outside / (K(valid).hex() + ".kvb")
    write_block_file(valid_file, K(valid), IDENT, data_of(K(valid)))
    (cache / shard).symlink_to(outside, target_is_directory=True)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        tier = make_tier(cache)
    assert invalid_file.exists() and temp_file.exists() and valid_file.exists()
    assert tier.keys() == []
    assert any("symlink" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)

    assert not tier.contains(K(valid))  # the lookup does not adopt a file behind a symlinked shard
    assert valid_file.exists() and invalid_file.exists()


def test_a_shard_swapped_for_a_symlink_at_run_time_is_neither_read_nor_deleted_through(
    tmp_path: Path, workers
) -> None:
    """Held blocks A and C share a shard, which is then moved outside and replaced by a symlink to it.
    Loading A is a refused read (a counted miss) that removes nothing; evicting C forgets it and
    deletes nothing out there either."""
    cache, outside = tmp_path / "kv", tmp_path / "outside"
    tier = make_tier(cache, num_blocks=2)
    worker = workers(tier)
    other = _name_in_shard(K("A").hex()[:2], "A")
    store(tier, worker, "A")
    spec = tier.prepare_store([K(other)])
    worker.submit_store(K(other), spec.addresses[0], data_of(K(other)))
    assert all(r.ok for r in worker.drain(30))
    tier.complete_store(spec.keys)
    shard = Path(tier.path_of(K("A"))).parent
    shard.rename(outside)
    shard.symlink_to(outside, target_is_directory=True)
    assert load(tier, worker, "A") is None and tier.counters.load_failures == 1
    assert tier.prepare_store([K("B")]).evicted == (K(other),)
    assert sorted(p.name for p in outside.iterdir()) == sorted(K(n).hex() + ".kvb" for n in ("A", other))


# ------------------------------------------------------------------------------------------ temp files
def test_scan_keeps_a_live_writers_temp_file_and_removes_stale_ones(tmp_path: Path) -> None:
    """Another engine starting on the directory must not delete a write in flight (its writer, this
    process, is alive); a dead writer's temp file, or one older than ten minutes, is a leftover."""
    final = Path(make_tier(tmp_path).path_of(K("A")))
    final.parent.mkdir(mode=0o700)
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = Path(f"{final}.tmp.{os.getpid()}.0a1b2c3d.0")
    dead_writer = Path(f"{final}.tmp.{dead.pid}.0a1b2c3d.0")
    old_live = Path(f"{final}.tmp.{os.getpid()}.0a1b2c3d.1")
    for path in (live, dead_writer, old_live):
        path.write_bytes(b"half a block")
    os.utime(old_live, (time.time() - 1200,) * 2)
    make_tier(tmp_path)
    assert live.exists()
    assert not dead_writer.exists() and not old_live.exists()


# ------------------------------------------------------------------------------------------ two tiers
def test_two_tiers_on_one_directory_find_each_others_blocks_within_one_cap(tmp_path: Path, workers) -> None:
    """Both start on an empty directory (cap 4). A stores ABCD; B finds and loads them byte for byte.
    B stores EF: the directory is full, so B evicts (the oldest it holds, A's A and B) instead of going
    over the cap. A's load of the evicted A is a counted miss, and A finds B's E."""
    a, b = make_tier(tmp_path, 4), make_tier(tmp_path, 4)
    wa, wb = workers(a), workers(b)
    store(a, wa, "ABCD")
    assert b.lookup([K(n) for n in "ABCD"]) == 4
    assert all(load(b, wb, n) == data_of(K(n)) for n in "ABCD")
    assert store(b, wb, "EF") == (K("A"), K("B"))
    assert len(block_files(tmp_path)) == 4 and ledger_count(tmp_path) == 4
    assert a.contains(K("A")) and load(a, wa, "A") is None
    assert a.counters.load_failures == 1 and a.counters.blocks_loaded == 0
    assert a.lookup([K("E")]) == 1 and load(a, wa, "E") == data_of(K("E"))


def test_a_block_written_by_two_tiers_at_once_is_one_file_counted_once(tmp_path: Path, workers) -> None:
    a, b = make_tier(tmp_path), make_tier(tmp_path)
    wa, wb = workers(a), workers(b)
    spec_a, spec_b = a.prepare_store([K("A")]), b.prepare_store([K("A")])  # neither sees the other's
    assert ledger_count(tmp_path) == 2
    wa.submit_store(K("A"), spec_a.addresses[0], data_of(K("A")))
    assert [r.ok for r in wa.drain(30)] == [True]
    wb.submit_store(K("A"), spec_b.addresses[0], data_of(K("A"), seed=1))  # finds A's file: keeps it
    assert [r.ok for r in wb.drain(30)] == [True]
    a.complete_store([K("A")])
    b.complete_store([K("A")])
    assert ledger_count(tmp_path) == 1 and len(block_files(tmp_path)) == 1
    assert load(a, wa, "A") == load(b, wb, "A") == data_of(K("A"))  # the first writer's, whole


# ------------------------------------------------------------------------------------------ two processes
_ENGINE = """
    import hashlib, json, os, sys, time
    from kvtier.tiers.base import TierIdentity
    from kvtier.tiers.disk import DiskTier
    from kvtier.transfer.io_worker import BlockIOWorker

    directory, sync, me, other, cap = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    mine, theirs, rescan_every = sys.argv[6].split(","), sys.argv[7].split(","), int(sys.argv[8])
    identity = TierIdentity("ab" * 32, "float32", (2, 16, 2, 4, 64), 4)  # 64 KiB blocks
    capacity = cap * (4096 + identity.block_bytes)

    def key(name):
        return hashlib.sha256(name.encode()).digest()

    def data(k):
        return hashlib.shake_256(bytes([0]) + k).digest(identity.block_bytes)

    def meet(stage):
        open(os.path.join(sync, f"{stage}.{me}"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(sync, f"{stage}.{other}")):
            assert time.monotonic() < deadline, f"the other engine never reached {stage}"
            time.sleep(0.005)

    def num_files():
        shards = [s for s in os.scandir(directory) if s.is_dir()]
        return sum(f.name.endswith(".kvb") for s in shards for f in os.scandir(s))

    tier = DiskTier(directory, capacity, identity)
    worker = BlockIOWorker(tier.block_io(b"shared secret"))
    report = {"store_failures": [], "load_failures": [], "missing": [], "identical": 0, "max_files": 0}
    meet("ready")  # both have scanned an empty directory: the other's blocks can only be found later
    for i, name in enumerate(mine):
        k = key(name)
        if tier.contains(k):  # what the coordinator checks before writing a block down
            continue
        spec = tier.prepare_store([k])
        for kk, path in zip(spec.keys, spec.addresses):
            worker.submit_store(kk, path, data(kk))
        for r in worker.drain(30):
            tier.complete_store([r.key], r.ok)
            if not r.ok:
                report["store_failures"].append(r.error)
        report["max_files"] = max(report["max_files"], num_files())
        if rescan_every and i % rescan_every == 0:
            DiskTier(directory, capacity, identity)  # a third engine starting: its scan runs now
    meet("stored")
    for name in theirs:
        k = key(name)
        if not tier.contains(k):
            report["missing"].append(name)
            continue
        out = bytearray(identity.block_bytes)
        worker.submit_load(k, tier.prepare_load([k]).addresses[0], out)
        (r,) = worker.drain(30)
        if not r.ok:
            tier.invalidate(k, r.error)
            report["load_failures"].append(r.error)
        tier.complete_load([k])
        report["identical"] += r.ok and bytes(out) == data(k)
    worker.close()
    meet("done")
    print("REPORT", json.dumps(report))
"""


def _run_two_engines(
    tmp_path: Path, cap: int, names: tuple[list[str], list[str]], rescan_every: int = 0
) -> list[dict]:
    """Start two engine processes on one directory at once; each stores its names, then reads the
    other's. Their reports (``_ENGINE``)."""
    directory, sync = tmp_path / "kv", tmp_path / "sync"
    sync.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = []
    for me in (0, 1):
        args = [str(directory), str(sync), str(me), str(1 - me), str(cap)]
        args += [",".join(names[me]), ",".join(names[1 - me]), str(rescan_every)]
        cmd = [sys.executable, "-c", textwrap.dedent(_ENGINE), *args]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        reports.append(json.loads(out.split("REPORT ", 1)[1]))
    return reports


def test_two_engine_processes_share_a_directory_and_find_each_others_blocks(tmp_path: Path) -> None:
    """Two processes write 24 blocks each (8 more both write) at once, while a third engine starts
    (scans) every few blocks. No store fails, none is lost or torn: each reads every block of the
    other's byte for byte. One file per block, 0600, no temp files left, the ledger exact."""
    common = [f"common{i}" for i in range(8)]
    names = ([f"a{i}" for i in range(24)] + common, [f"b{i}" for i in range(24)] + common)
    reports = _run_two_engines(tmp_path, cap=200, names=names, rescan_every=4)
    for report in reports:
        assert report["store_failures"] == [] and report["load_failures"] == []
        assert report["missing"] == [] and report["identical"] == 32
    directory = tmp_path / "kv"
    files = block_files(directory)
    assert len(files) == 56 and ledger_count(directory) == 56
    assert all(mode(f) == 0o600 for f in files)
    assert [p for p in directory.rglob("*") if ".tmp." in p.name] == []


def test_an_engine_that_asked_whether_it_is_alone_is_still_seen_by_the_others(tmp_path: Path) -> None:
    """Two tiers on one directory (each its own open file, as two processes): neither is alone, however
    often they ask. flock drops a shared lock whose conversion to exclusive fails, so the first one to
    ask used to vanish, the second then believed itself alone and recounted the shared ledger without
    the first one's writes in flight: a directory over its cap (this file's test below, once in CI)."""
    first, second = DirectoryLedger(str(tmp_path)), DirectoryLedger(str(tmp_path))
    for _ in range(3):
        for ledger in (first, second):
            with ledger.update():
                assert not ledger.alone()
    del second, ledger
    gc.collect()  # its files closed: the first one is alone now
    with first.update():
        assert first.alone()
    with first.update():
        assert first.alone()  # and still holds its presence: asking changed nothing


def test_two_engine_processes_stay_within_one_size_cap(tmp_path: Path) -> None:
    """Two processes each write 30 blocks at once into a directory capped at 10: never more than 10
    block files, at the end either, and the ledger matches the files."""
    reports = _run_two_engines(
        tmp_path, cap=10, names=([f"a{i}" for i in range(30)], [f"b{i}" for i in range(30)])
    )
    assert all(r["store_failures"] == [] for r in reports)
    assert max(r["max_files"] for r in reports) <= 10
    directory = tmp_path / "kv"
    assert 0 < len(block_files(directory)) <= 10 and ledger_count(directory) == len(block_files(directory))
    assert all(r["load_failures"] == [] for r in reports)  # a block the other evicted is not found, not torn


# ------------------------------------------------------------------------------------------ forgery
BS = 4
STACK_SHAPE = (2, BS, 2, 1, 8)
PROMPT = list(range(100, 113))  # 3 full blocks + 1 slot
FILLER = list(range(200, 216))  # 4 full blocks: evicts PROMPT's blocks from the device pool


class Stack:
    """The engine's tier stack as ``build_tiers`` makes it (secret included), under a KV manager."""

    def __init__(self, directory: Path, secret: bytes | None) -> None:
        self.device_kv = torch.zeros((4, *STACK_SHAPE))
        identity = TierIdentity("fp-forge", "float32", STACK_SHAPE, 4)
        config = TierConfig(num_host_blocks=4, disk_dir=str(directory), disk_bytes=1 << 20, secret=secret)
        self.tiers, self.mover = build_tiers(config, identity, self.device_kv)
        assert self.tiers is not None and self.mover is not None
        self.disk = self.tiers.tier(Medium.DISK)
        self.kv = KVCacheManager(4, BS, True, tiers=self.tiers)

    def prefill(self, seq_id: str, tokens: list[int], seed: int = 0) -> dict[str, int]:
        computed = self.kv.get_computed_blocks(tokens, ("fp-forge", ""))
        n = computed.num_computed_tokens
        assert self.kv.allocate_slots(seq_id, tokens, n, len(tokens) - n, computed, ("fp-forge", ""))
        self.run_plan()
        gen = torch.Generator().manual_seed(seed)
        for block_id in self.kv.block_ids(seq_id)[n // BS :]:
            self.device_kv[block_id] = torch.randn(STACK_SHAPE, generator=gen)
        self.kv.cache_blocks(seq_id, tokens, len(tokens), ("fp-forge", ""))
        return computed.tokens_by_tier(BS)

    def run_plan(self) -> None:
        plan = self.kv.end_schedule_step()
        self.mover.execute(plan)
        self.tiers.complete_plan(plan)

    def disk_hit_after_reads(self) -> dict[str, int]:
        assert self.kv.get_computed_blocks(PROMPT, ("fp-forge", "")).lower.num_pending_blocks == 3
        for _ in range(100):
            if not self.tiers.has_pending_io:
                break
            self.tiers.wait(0.1)
        return self.prefill("again", PROMPT)


def forge(path: Path) -> None:
    """Zero the payload, then make every checksum agree (the MAC field is kept as it was)."""
    raw = bytearray(path.read_bytes())
    raw[HEADER_NBYTES:] = bytes(len(raw) - HEADER_NBYTES)
    header = decode_header(raw[:HEADER_NBYTES])
    identity = TierIdentity("fp-forge", "float32", STACK_SHAPE, 4)
    crc = zlib.crc32(raw[HEADER_NBYTES:])
    raw[:HEADER_NBYTES] = encode_header(header.key, identity, header.payload_nbytes, crc, header.mac)
    path.write_bytes(raw)


def test_forged_disk_blocks_are_refused_by_the_engine_stack_with_the_secret(tmp_path: Path) -> None:
    """An engine with the secret writes PROMPT's 3 blocks to disk; someone zeroes their payloads and
    fixes the CRCs. Without the secret the forgeries would be served (zeros); with it, the next engine
    counts 3 failed loads, serves nothing from disk, computes the prompt, and removes the files."""
    secret = b"shared secret"
    first = Stack(tmp_path / "kv", secret)
    first.prefill("p", PROMPT)
    first.kv.free("p")
    first.prefill("f", FILLER)
    first.run_plan()
    first.tiers.flush()
    first.tiers.close()
    files = block_files(tmp_path / "kv")
    assert len(files) == 3
    for path in files:
        forge(path)
    shutil.copytree(tmp_path / "kv", tmp_path / "copy")

    unprotected = Stack(tmp_path / "copy", None)
    assert unprotected.disk_hit_after_reads()["disk"] == 12  # the forgeries pass every checksum
    assert not unprotected.device_kv[unprotected.kv.block_ids("again")[0]].any()
    unprotected.tiers.close()

    protected = Stack(tmp_path / "kv", secret)
    assert protected.disk_hit_after_reads() == {"device": 0, "host": 0, "disk": 0, "remote": 0}
    assert protected.disk is not None
    assert protected.disk.counters.load_failures == 3 and protected.disk.counters.blocks_loaded == 0
    assert block_files(tmp_path / "kv") == []
    protected.tiers.close()


# ------------------------------------------------------------------------------------------ real model
_LLM_ENGINE = """
    import json, os, sys, time
    from kvtier.llm import LLM
    from kvtier.sampling_params import SamplingParams

    directory, sync, me = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompts = [
        "Document " + str(i) + ": " + " ".join(f"crate {i}-{j} holds {j * 3 + i} bolts." for j in range(12))
        for i in range(2)
    ]

    def signal(stage):
        open(os.path.join(sync, stage), "w").close()

    def wait(stage):
        deadline = time.monotonic() + 300
        while not os.path.exists(os.path.join(sync, stage)):
            assert time.monotonic() < deadline, f"never reached {stage}"
            time.sleep(0.01)

    def generate(prompt):
        out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))[0]
        return {"tokens": out.outputs[0].token_ids, "disk": out.cached_tokens_by_tier["disk"]}

    llm = LLM(kv_device_blocks=20, kv_host_gb=0.02, kv_disk_dir=directory)
    signal(f"ready{me}")
    wait(f"ready{1 - me}")  # both scanned an empty directory
    report = {}
    if me == 1:
        wait("written0")
        report["theirs"] = generate(prompts[0])  # engine 0's blocks, found on disk
    report["mine"] = generate(prompts[me])
    llm.engine.flush_tiers()
    signal(f"written{me}")
    if me == 0:
        wait("written1")
        report["theirs"] = generate(prompts[1])
    signal(f"done{me}")
    wait(f"done{1 - me}")
    llm.close()
    print("REPORT", json.dumps(report))
"""


@pytest.mark.slow
def test_two_real_engines_on_one_disk_dir_serve_each_others_prefixes(
    tmp_path: Path, converted_default_model: object
) -> None:
    """Two engine processes (the default model) start on one empty disk directory. Each writes one
    prompt's blocks down; the other, which never saw that prompt, serves it from disk with the writer's
    exact greedy tokens."""
    directory, sync = tmp_path / "kv", tmp_path / "sync"
    sync.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_LLM_ENGINE), str(directory), str(sync), str(me)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me in (0, 1)
    ]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        reports.append(json.loads(out.split("REPORT ", 1)[1]))
    for me in (0, 1):
        mine, theirs = reports[me]["mine"], reports[1 - me]["theirs"]
        assert mine["disk"] == 0 and theirs["disk"] >= 64  # at least 4 blocks of 16 tokens from disk
        assert theirs["tokens"] == mine["tokens"]
    assert all(mode(f) == 0o600 for f in block_files(directory))
