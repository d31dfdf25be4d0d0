"""Lazy access to a Hugging Face safetensors checkpoint (single file or sharded with an index).

Each tensor is read into its own array with plain reads (kiln/safetensors_io.py), not through a
memory map of the file: a map's pages stay resident while it is open, so reading a 16 GB
checkpoint through one would count all 16 GB against compile's memory."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kiln.errors import KilnError
from kiln.safetensors_io import Entry, read_header, read_tensor


class Checkpoint:
    """Maps tensor names to the shard that holds them; reads a tensor only when asked."""

    def __init__(self, model_dir: Path):
        self._headers: dict[Path, dict[str, Entry]] = {}
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

    def get(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise KilnError(f"weight {name!r} is missing from the checkpoint")
        path = self.files[name]
        if not path.exists():
            raise KilnError(f"{path}: shard named in the index is missing")
        entry = self._entries(path).get(name)
        if entry is None:
            raise KilnError(f"{path}: has no tensor {name!r}, though the index names this file")
        return read_tensor(path, entry)
