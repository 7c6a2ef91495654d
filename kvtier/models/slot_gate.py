"""``SlotGate``: a step's host→device loads, ready layer slot by layer slot (``--layered-loads``).

A block of the pool is ``[S, ...]``: one slot per layer of its KV group. A prefix loaded back from the
host tier used to be copied block by block, every slot at once, and the step's forward waited for the
last byte before its first layer. With layered loads the mover copies slot 0 of every loaded block,
then slot 1, ... (one 2-D copy per run of blocks and slot: ``cuda_copy.py``), recording one event per
slot, and each layer waits only for its own slot::

    load stream     slot 0 of every block ─ ev[0] ─ slot 1 ─ ev[1] ─ ... ─ slot S-1 ─ ev[S-1]
    compute stream            layer on slot 0: wait ev[0], attend ─ layer on slot 1: wait ev[1] ─ ...
    after the step  settle: wait ev[S-1] (every copy), disarmed

so the forward runs under the copies instead of after them (an 8k-token prefix of the 1B shape on an
H200: 4.9 ms of copies, then 2.75 ms of forward; not measured with this yet).

The waits sit in ``rope_store`` (``fused_ops.py``), where every model family's layer first touches the
pool: it writes its new K/V there, then its attention reads. A CUDA graph captures them as event-wait
nodes (the events are ``external``: a
replay waits for the records made before it was launched), so a graph-replayed hit is gated too. Every
other reader of the pool (copy-on-write copies, the canary's capture, a demote's snapshot, the next
plan's stores) calls ``settle`` first. On a CPU the copies are synchronous: the gate only notes the
slots waited for (``waited``; a graph replay notes the waits it captured), which is how tests and
``kvtier bench gpu`` check that every layer asked.
"""

from __future__ import annotations

import torch


class SlotGate:
    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.cuda = device.type == "cuda"
        self.armed = False  # a layered plan's copies are in flight (or, on a CPU, just ran)
        self.waited: list[int] = []  # the slots waited for since the last ``arm``, in order
        self._events: list[torch.cuda.Event] = []
        if self.cuda:
            self._events = [torch.cuda.Event(external=True) for _ in range(num_slots)]
            for event in self._events:  # created now: a capture only records waits on existing events
                event.record(torch.cuda.current_stream(device))

    def record(self, slot: int, stream: torch.cuda.Stream | None) -> None:
        """The mover: every copy of ``slot`` is enqueued on ``stream`` (None on a CPU: done)."""
        if stream is not None:
            self._events[slot].record(stream)

    def arm(self) -> None:
        """The mover: a plan's loads are now gated slot by slot (the compute stream did not wait)."""
        self.armed = True
        self.waited = []

    def wait(self, slot: int) -> None:
        """Before a layer on ``slot`` reads the pool: the compute stream waits for that slot's copies.
        Inside a CUDA graph capture the wait is captured whether or not a plan is armed (a replay
        waits for the latest records, long done when no load is pending)."""
        if self.cuda and torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream().wait_event(self._events[slot])
            return
        if not self.armed:
            return
        self.waited.append(slot)
        if self.cuda:
            torch.cuda.current_stream().wait_event(self._events[slot])

    def settle(self) -> None:
        """The compute stream waits for every armed copy (the last slot's event follows the others on
        the load stream); disarmed."""
        if not self.armed:
            return
        if self.cuda:
            torch.cuda.current_stream().wait_event(self._events[-1])
        self.armed = False

    def last_event(self) -> torch.cuda.Event | None:
        """The event after every armed copy (for the store stream of a later plan), None if none."""
        return self._events[-1] if self.armed and self.cuda else None
