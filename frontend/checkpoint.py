"""Lazy access to a Hugging Face safetensors checkpoint (single file or sharded with an index).

Each tensor is read into its own array with plain reads (kiln/safetensors_io.py), not through a
memory map of the file: a map's pages stay resident while it is open, so reading a 16 GB
checkpoint through one would count all 16 GB against compile's memory.

Given the order tensors will be asked for (`read_ahead`), a background thread reads the next one
while the caller works on this one (file reads release the GIL), so compile's disk time overlaps its
quantising; at most one tensor is read ahead."""
from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kiln.errors import KilnError
from kiln.safetensors_io import Entry, read_header, read_tensor


class Checkpoint:
    """Maps tensor names to the shard that holds them; reads a tensor only when asked."""

    def __init__(self, model_dir: Path):
        self._headers: dict[Path, dict[str, Entry]] = {}
        self._order: list[str] = []             # names still to come, in the order they will be asked for
        self._ahead: tuple[str, Future] | None = None
        self._reader: ThreadPoolExecutor | None = None
        index = model_dir / "model.safetensors.index.json"
        single = model_dir / "model.safetensors"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise KilnError(f"{index}: not a valid safetensors index ({e})") from None
            self.files = {name: model_dir / shard for name, shard in weight_map.items()}
        elif single.exists():
            self.files = {name: single for name in self._entries(single)}
        else:
            raise KilnError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")

    def _entries(self, path: Path) -> dict[str, Entry]:
        if path not in self._headers:
            self._headers[path] = read_header(path)[0]
        return self._headers[path]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read_ahead(self, order: list[str]) -> None:
        """Tensors will be asked for in `order`: read each one while the one before is in use."""
        self._order = [name for name in order if name in self.files]
        self._start_next()

    def _start_next(self) -> None:
        if self._order:
            name = self._order.pop(0)
            self._reader = self._reader or ThreadPoolExecutor(1, thread_name_prefix="kiln-read")
            self._ahead = (name, self._reader.submit(self._read, name))

    def get(self, name: str) -> np.ndarray:
        if self._ahead is not None and self._ahead[0] == name:
            future, self._ahead = self._ahead[1], None
            self._start_next()
            return future.result()
        return self._read(name)

    def _read(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise KilnError(f"weight {name!r} is missing from the checkpoint")
        path = self.files[name]
        if not path.exists():
            raise KilnError(f"{path}: shard named in the index is missing")
        entry = self._entries(path).get(name)
        if entry is None:
            raise KilnError(f"{path}: has no tensor {name!r}, though the index names this file")
        return read_tensor(path, entry)
