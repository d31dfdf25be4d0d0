"""Read a local Hugging Face model directory: config.json, safetensors weights, tokenizer files."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.errors import KilnError
from kiln.ir import Graph
from kiln.ir.types import numpy_dtype

from . import llama
from .checkpoint import Checkpoint
from .rope import inv_freq

# HF architecture name -> (config parser, graph builder). One registry for every family.
ARCHITECTURES = {
    "LlamaForCausalLM": (llama.parse_config, llama.build_graph),
    "MistralForCausalLM": (llama.parse_config, llama.build_graph),
    "Qwen2ForCausalLM": (llama.parse_config, llama.build_graph),
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclass
class HFModel:
    model_dir: Path
    config: llama.LlamaConfig
    checkpoint: Checkpoint

    def build_graph(self, dtype: str, page_size: int) -> Graph:
        return ARCHITECTURES[self.config.architecture][1](self.config, dtype, page_size)

    def weight(self, name: str, dtype: str) -> np.ndarray:
        """A parameter's array in `dtype`, read from the checkpoint (or computed, for rope)."""
        if name == llama.ROPE_PARAM:
            c = self.config
            return inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        arr = self.checkpoint.get(name)
        return arr.astype(numpy_dtype(dtype), copy=False)

    def tokenizer_files(self) -> list[Path]:
        return [self.model_dir / f for f in TOKENIZER_FILES if (self.model_dir / f).exists()]


def load_hf_model(model_dir: str | Path) -> HFModel:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise KilnError(f"model directory {model_dir} does not exist")
    cfg_path = model_dir / "config.json"
    if not cfg_path.exists():
        raise KilnError(f"{model_dir}: no config.json")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise KilnError(f"{cfg_path}: not valid JSON ({e})") from None
    archs = cfg.get("architectures") or []
    if not archs:
        raise KilnError(f"{cfg_path}: lacks required field 'architectures'")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise KilnError(f"architecture {arch} is not supported (supported: {', '.join(ARCHITECTURES)})")
    config = ARCHITECTURES[arch][0](cfg, arch)
    return HFModel(model_dir, config, Checkpoint(model_dir))
