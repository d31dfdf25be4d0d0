"""Lazy access to a Hugging Face safetensors checkpoint (single file or sharded with an index)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from kiln.errors import KilnError


class Checkpoint:
    """Maps tensor names to the shard that holds them; reads a tensor only when asked."""

    def __init__(self, model_dir: Path):
        index = model_dir / "model.safetensors.index.json"
        single = model_dir / "model.safetensors"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise KilnError(f"{index}: not a valid safetensors index ({e})") from None
            self.files = {name: model_dir / shard for name, shard in weight_map.items()}
        elif single.exists():
            self.files = {name: single for name in self._keys(single)}
        else:
            raise KilnError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
        self._handles: dict[Path, object] = {}

    @staticmethod
    def _keys(path: Path) -> list[str]:
        try:
            with safe_open(str(path), framework="numpy") as f:
                return list(f.keys())
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise KilnError(f"{path}: cannot read safetensors file ({e})") from None

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise KilnError(f"weight {name!r} is missing from the checkpoint")
        path = self.files[name]
        if not path.exists():
            raise KilnError(f"{path}: shard named in the index is missing")
        try:
            if path not in self._handles:
                self._handles[path] = safe_open(str(path), framework="numpy")
            return self._handles[path].get_tensor(name)
        except KilnError:
            raise
        except Exception as e:
            raise KilnError(f"{path}: cannot read tensor {name!r} ({e})") from None
