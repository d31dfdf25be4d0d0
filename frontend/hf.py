"""Read a local Hugging Face model directory: config.json, safetensors weights, tokenizer files."""
from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.errors import KilnError
from kiln.ir import Graph
from kiln.ir.types import numpy_dtype

from .blocks import quantiser_source
from .checkpoint import Checkpoint
from .decoder import DecoderConfig, build_graph
from .families import parse_config

# Every tokenizer-side file a checkpoint may carry; the artifact gets a copy of each one present.
# The chat template lives in tokenizer_config.json (older), chat_template.jinja (transformers
# >= 4.50 saves it there) or chat_template.json (processors). tokenizer.model is a SentencePiece
# model: copied only where it is the only tokenizer, and then converted to tokenizer.json, which
# is all the runtime reads.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model")


@dataclass
class HFModel:
    model_dir: Path
    config: DecoderConfig
    checkpoint: Checkpoint

    def build_graph(self, dtype: str, page_size: int) -> Graph:
        return build_graph(self.config, dtype, page_size)

    def weight(self, name: str, dtype: str) -> np.ndarray:
        """A parameter's array in `dtype`, read from the checkpoint (or computed, for rope)."""
        computed = self.config.computed_weights()
        if name in computed:
            return computed[name]()
        arr = self.checkpoint.get(name)
        return arr.astype(numpy_dtype(dtype), copy=False)

    def weight_source(self, name: str, dtype: str) -> np.ndarray:
        """`weight(name, dtype)` for a quantiser: as stored where `dtype` would only widen it exactly
        (bfloat16 or float16 to float32), which spares a float32 copy of every tensor."""
        if name in self.config.computed_weights():
            return self.weight(name, dtype)
        return quantiser_source(self.checkpoint.get(name), dtype)

    def tokenizer_files(self) -> list[Path]:
        """The TOKENIZER_FILES present; tokenizer.model only when there is no tokenizer.json (the
        runtime never reads it, and it can be megabytes)."""
        present = [f for f in TOKENIZER_FILES if (self.model_dir / f).exists()]
        if "tokenizer.json" in present and "tokenizer.model" in present:
            present.remove("tokenizer.model")
        return [self.model_dir / f for f in present]

    def write_tokenizer(self, out_dir: Path) -> list[str]:
        """Copy the tokenizer files into `out_dir`; return the names written. A checkpoint whose only
        tokenizer is tokenizer.model gets a tokenizer.json made by transformers' converter (the
        runtime reads tokenizer.json only; transformers does the same conversion when it loads it)."""
        names = []
        for f in self.tokenizer_files():
            shutil.copy(f, out_dir / f.name)
            names.append(f.name)
        if "tokenizer.json" not in names and "tokenizer.model" in names:
            _convert_sentencepiece(self.model_dir, out_dir / "tokenizer.json")
            names.append("tokenizer.json")
        return sorted(names)

    def default_options(self, options):
        """`options` as given: the checkpoint's float weights unless --quant names a format."""
        return dataclasses.replace(options, quant=None) if options.quant == "none" else options

    def quantizers(self, base: dict) -> dict:
        return base

    def source_record(self) -> None:
        return None


def _convert_sentencepiece(model_dir: Path, out: Path) -> None:
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_dir)
        tok.backend_tokenizer.save(str(out))
    except Exception as e:   # transformers raises many kinds here (a missing sentencepiece/protobuf, ...)
        raise KilnError(f"{model_dir}: has tokenizer.model but no tokenizer.json, and converting it failed "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e


def load_hf_model(model_dir: str | Path) -> HFModel:
    model_dir = Path(model_dir)
    if model_dir.exists() and not model_dir.is_dir():
        raise KilnError(f"{model_dir} is a file; kiln compiles a Hugging Face model directory (config.json, "
                        "tokenizer.json, *.safetensors) or a GGUF file (*.gguf)")
    if not model_dir.is_dir():
        raise KilnError(f"model directory {model_dir} does not exist")
    cfg_path = model_dir / "config.json"
    if not cfg_path.exists():
        raise KilnError(f"{model_dir}: no config.json")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise KilnError(f"{cfg_path}: not valid JSON ({e})") from None
    return HFModel(model_dir, parse_config(cfg), Checkpoint(model_dir))
