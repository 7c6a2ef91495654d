"""A step's integer metadata in one host-to-device transfer.

The model runner gathers everything a step indexes with (token ids, positions, slot block ids and
offsets, block tables, context lengths, the rows that sample, copy-on-write pairs) as Python ints,
each list ``add``-ed here for a handle (appended to one int64 ``array``, in C); ``upload`` views that
as ONE int64 host tensor and copies it to the device in one ``.to(device, non_blocking=True)``; ``get``
hands back each list as a view (a 1-D slice) of that one device tensor::

    add([5, 6, 7]) -> 0    add([]) -> 1    add([9, 9]) -> 2
    host  [5 6 7 9 9]  ──one copy──►  device [5 6 7 9 9]     get(0) = [0:3], get(1) = [3:3], get(2) = [3:5]

On CUDA the host tensor is pinned, so the copy is asynchronous: the host goes on building the step
while it runs, and the kernels that read the views queue behind it on the same stream. The pinned
buffer is allocated per step from PyTorch's caching pinned-host allocator, never reused by this class:
that allocator records the copy's CUDA event and hands the block out again only once the copy is done,
so a later step cannot overwrite bytes still in flight (no event of our own to wait on). On the CPU
nothing is pinned or copied: the packed array, seen as a tensor without a copy, is the step's, and
``get`` slices it (as fast as the separate ``torch.tensor`` calls it replaces, or faster).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import torch


class StepStaging:
    """One step's int64 lists, packed and uploaded together (``upload`` once, then ``get`` each)."""

    def __init__(self) -> None:
        self._values = array("q")  # the packed int64 values, filled in C by ``extend``
        self._spans: list[tuple[int, int]] = []  # [start, end) of each list in the packed values
        self._device_values: torch.Tensor | None = None

    def add(self, values: Iterable[int]) -> int:
        """Stage ``values`` (ints); the handle ``get`` takes after the upload."""
        if self._device_values is not None:
            raise RuntimeError("StepStaging: add after upload")
        start = len(self._values)
        self._values.extend(values)
        self._spans.append((start, len(self._values)))
        return len(self._spans) - 1

    def add_table(self, rows: Iterable[Sequence[int]], width: int) -> int:
        """Stage ``rows`` as one [rows, width] row-major table: each row's first ``width`` values, padded
        past its end with its own first value (a block table: padding is masked out, but a zero weight
        times NaN is NaN, so one request's corrupt block must never reach another's attention). An int64
        ``array`` row is appended by one memcpy: no Python int per block."""
        if self._device_values is not None:
            raise RuntimeError("StepStaging: add after upload")
        values, start = self._values, len(self._values)
        for row in rows:
            n = len(row)
            values.extend(row[:width] if n > width else row)
            if n < width:
                values.extend(row[:1] * (width - n))
        self._spans.append((start, len(values)))
        return len(self._spans) - 1

    @property
    def uploaded(self) -> bool:
        return self._device_values is not None

    def upload(self, device: torch.device | str) -> None:
        """Every staged list to ``device`` in one int64 tensor: one copy (asynchronous from pinned host
        memory on CUDA; none on the CPU)."""
        if self._device_values is not None:
            raise RuntimeError("StepStaging: uploaded twice")
        dev = device if isinstance(device, torch.device) else torch.device(device)
        if not self._values:
            self._device_values = torch.empty(0, dtype=torch.long, device=dev)
            return
        packed = torch.frombuffer(self._values, dtype=torch.long)  # no copy: it keeps the array alive
        if dev.type == "cpu":
            self._device_values = packed
        elif dev.type == "cuda":  # pinned (the caching allocator's, per step), then one async copy
            host = torch.empty(packed.shape, dtype=torch.long, pin_memory=True).copy_(packed)
            self._device_values = host.to(dev, non_blocking=True)
        else:
            self._device_values = packed.to(dev)

    def get(self, handle: int) -> torch.Tensor:
        """The list staged as ``handle``: a [n] int64 view of the uploaded tensor (n = 0 for an empty one)."""
        if self._device_values is None:
            raise RuntimeError("StepStaging: get before upload")
        start, end = self._spans[handle]
        return self._device_values[start:end]
