"""Which adapter each of the artifact's LoRA slots holds, and the adapters kept read in host memory.

The model's slots (`kiln compile --max-loras N`) hold adapters on the device; a running sequence
holds its adapter's slot (`acquire` when the scheduler admits it, `release` when it finishes or is
preempted). A slot no running sequence uses may take another adapter, the least recently used such
slot first; when every slot is in use, a sequence of another adapter waits. Adapters are read from
disk by `check` (before a request is queued, off the step loop) into an LRU of `max_cpu_loras`
read adapters; one evicted from it meanwhile is read again when it gets a slot.
Pure Python over a model with `lora` (its LoRALayout) and `write_lora_slot(slot, rows)`.
"""
from __future__ import annotations

import itertools
import threading
from collections import OrderedDict

from .lora import LoRAError, LoRARequest, check_adapter, read_adapter, slot_rows


class LoRASlots:
    def __init__(self, model, max_cpu_loras: int | None = None):
        self.model, self.layout = model, model.lora
        slots = self.layout.max_loras if self.layout else 0
        self.max_cpu_loras = max(max_cpu_loras or slots, 1)
        self.holds: list[int | None] = [None] * slots         # each slot's adapter id
        self.users = [0] * slots                               # running sequences on each slot
        self.used_at = [0] * slots                             # when its last user let go
        self.clock = itertools.count(1)
        self.read: OrderedDict[int, dict] = OrderedDict()     # adapter id -> its slot rows (LRU, newest last)
        self.names: dict[int, str] = {}                        # adapter id -> the name it was checked under
        self.lock = threading.Lock()          # check runs on the server's threads, acquire on the step's

    def check(self, lora: LoRARequest) -> None:
        """Read `lora` (if not read) and check it fits the slots; raises LoRAError naming what does not."""
        known = self.names.get(lora.lora_int_id)
        if known is not None and known != lora.lora_name:
            raise LoRAError(f"adapter {lora.lora_name}: lora_int_id {lora.lora_int_id} is adapter {known}'s")
        self._rows(lora)

    def _rows(self, lora: LoRARequest) -> dict:
        with self.lock:
            if lora.lora_int_id in self.read:
                self.read.move_to_end(lora.lora_int_id)
                return self.read[lora.lora_int_id]
        adapter = read_adapter(lora.lora_path, lora.lora_name)      # off the lock: reading takes a while
        check_adapter(adapter, self.layout)
        rows = slot_rows(adapter, self.layout)
        with self.lock:
            self.read[lora.lora_int_id] = rows
            self.names[lora.lora_int_id] = lora.lora_name
            while len(self.read) > self.max_cpu_loras:
                self.read.popitem(last=False)
        return rows

    def acquire(self, lora: LoRARequest) -> int | None:
        """The slot holding `lora` for one more running sequence, loading it into a free slot if no slot
        holds it; None when every slot is in use by other adapters' sequences (the sequence waits)."""
        if lora.lora_int_id in self.holds:
            slot = self.holds.index(lora.lora_int_id)
        else:
            free = [s for s in range(len(self.holds)) if self.users[s] == 0]
            if not free:
                return None
            slot = min(free, key=lambda s: (self.holds[s] is not None, self.used_at[s]))   # empty, then LRU
            self.model.write_lora_slot(slot, self._rows(lora))
            self.holds[slot] = lora.lora_int_id
        self.users[slot] += 1
        return slot

    def share(self, slot: int) -> int:
        """One more running sequence on `slot` (a sample forked from one that holds it)."""
        self.users[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        self.users[slot] -= 1
        if self.users[slot] == 0:
            self.used_at[slot] = next(self.clock)

    def unload(self, lora_int_id: int) -> None:
        """Forget an adapter: its read rows, and its slot where no running sequence uses it."""
        with self.lock:
            self.read.pop(lora_int_id, None)
            self.names.pop(lora_int_id, None)
        if lora_int_id in self.holds:
            slot = self.holds.index(lora_int_id)
            if self.users[slot] == 0:
                self.holds[slot] = None

    def running(self) -> list[int]:
        """The ids of the adapters some running sequence uses."""
        return [a for a, n in zip(self.holds, self.users) if a is not None and n > 0]
