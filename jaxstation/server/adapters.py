"""The station's LoRA adapters by name: which slot of the engine's stacks each one holds (docs/lora.md).

Threads: `--lora-modules` load in the loading thread before the station is ready; `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` run off the event loop; requests resolve names on the event loop. All of that holds `_lock`.
Writing a slot swaps the engine's params as one reference (`Engine.write_lora`), so the decode thread's step in flight
keeps the weights it started with. A slot is written only when no job, queued or running, reads it (`in_use`): an
unloaded adapter's requests finish on its weights, and its slot is free once they are gone.

Each load gets a number of its own (`Job.lora_load`): prefix reuse keys on it, so KV computed with an adapter is never
reused by a request of another adapter, nor of a later adapter in the same slot.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable
from pathlib import Path

from jaxstation.engine.engine import Engine
from jaxstation.model.lora_files import read_adapter


class AdapterConflict(ValueError):
    """A load that cannot go ahead: the name is taken, or every slot is held."""


@dataclasses.dataclass(frozen=True)
class Resident:
    name: str
    path: str
    slot: int  # the engine's LoRA slot, 1..max_loras
    load: int  # this load's number, unique in the station's life


class Adapters:
    """name -> resident adapter, over `engine`'s `max_loras` slots. in_use: the slots queued or running jobs read."""

    def __init__(self, engine: Engine, in_use: Callable[[], set[int]]) -> None:
        self.engine, self.in_use = engine, in_use
        self._by_name: dict[str, Resident] = {}
        self._loads = itertools.count(1)
        self._lock = threading.Lock()

    def load(self, name: str, path: str) -> Resident:
        """Read the adapter at `path` and write it into a free slot under `name`. Raises AdapterError (the file does
        not fit the model) or AdapterConflict."""
        adapter = read_adapter(Path(path), self.engine.cfg, self.engine.max_lora_rank)
        with self._lock:
            if name in self._by_name:
                raise AdapterConflict(f"an adapter named {name!r} is loaded already")
            held = {r.slot for r in self._by_name.values()} | self.in_use()
            slot = next((s for s in range(1, self.engine.max_loras + 1) if s not in held), None)
            if slot is None:
                raise AdapterConflict(f"every one of the station's {self.engine.max_loras} LoRA slots (--max-loras) "
                                      "is held by a loaded adapter or by requests still running on an unloaded one")
            self.engine.write_lora(slot, adapter.slots(self.engine.cfg, self.engine.max_lora_rank))
            resident = self._by_name[name] = Resident(name, str(path), slot, next(self._loads))
            return resident

    def unload(self, name: str) -> Resident | None:
        """Forget `name` (None if no adapter has it); its requests in flight finish on its weights."""
        with self._lock:
            return self._by_name.pop(name, None)

    def get(self, name: str | None) -> Resident | None:
        with self._lock:
            return self._by_name.get(name) if name is not None else None

    def residents(self) -> list[Resident]:
        with self._lock:
            return sorted(self._by_name.values(), key=lambda r: r.slot)
