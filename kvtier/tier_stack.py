"""Building the tiers under the device pool from a ``TierConfig``, and wiring their byte movers.

This is where a tier is registered::

    TierConfig ──► HostTier (bookkeeping) ◄── TierMover (device↔host copies, the host buffer)
               ├─► DiskTier ◄── BlockIOWorker(disk.block_io(secret))   an ExternalLevel under the host tier
               └─► RemoteTier ◄── BlockIOWorker(RedisBlockIO)          the next one (both share a RemoteStore)
                   (a tier added later: its bookkeeping, its BlockIO, one more ExternalLevel)

The engine, the statistics and the metrics see the tiers only through ``TierCoordinator.tiers``.
"""

from __future__ import annotations

import logging

import torch

from kvtier.config import TierConfig
from kvtier.kv.retention import Retention
from kvtier.models.slot_gate import SlotGate
from kvtier.tiers.base import TierIdentity
from kvtier.tiers.coordinator import ExternalLevel, TierCoordinator
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier
from kvtier.transfer.io_worker import BlockIOWorker
from kvtier.transfer.mover import TierMover

log = logging.getLogger("kvtier.engine")


def build_tiers(
    config: TierConfig,
    identity: TierIdentity,
    device_kv: torch.Tensor,
    retention: Retention | None = None,
    gate: SlotGate | None = None,
) -> tuple[TierCoordinator | None, TierMover | None]:
    """The host tier (and the external tiers under it) with the mover that copies their bytes, or Nones;
    ``retention``: the prompt-cache retention each tier honours (kvtier/kv/retention.py); ``gate``: the
    pool's, for layered loads (kvtier/models/slot_gate.py)."""
    if config.num_host_blocks <= 0:
        return None, None
    host = HostTier(config.num_host_blocks, retention=retention)
    external: list[ExternalLevel] = []
    if config.disk_dir is not None:
        disk = DiskTier(config.disk_dir, config.disk_bytes, identity, retention=retention)
        worker = BlockIOWorker(disk.block_io(config.secret), name="kvtier-disk-io")
        external.append(ExternalLevel(disk, worker, config.store_policy))
    if config.remote_url is not None:
        from kvtier.tiers.remote import RedisBlockIO, RemoteTier
        from kvtier.tiers.remote_store import RemoteStore

        store = RemoteStore(config.remote_url, ttl_s=config.remote_ttl_s)
        remote = RemoteTier(store, identity)
        io = RedisBlockIO(store, identity, config.secret, retention)
        worker = BlockIOWorker(io, name="kvtier-remote-io")  # batches of up to 32 blocks per round trip
        external.append(ExternalLevel(remote, worker, config.remote_policy))
        log.info("remote tier: %s (%s, ttl %d s)", store.url, config.remote_policy, config.remote_ttl_s)
    coordinator = TierCoordinator(host, external, config.store_policy)
    mover = TierMover(device_kv, config.num_host_blocks, host.counters, gate)
    coordinator.host_bytes = mover
    log.info(
        "host tier: %d blocks, %.2f GiB (%d bytes pinned)",
        config.num_host_blocks,
        mover.host.nbytes / 2**30,
        mover.host.pinned_bytes,
    )
    return coordinator, mover
