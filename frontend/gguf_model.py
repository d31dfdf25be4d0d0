"""A GGUF model as kiln's importer sees any model: a DecoderConfig, a graph and weights by HF name,
and the tokenizer files (frontend/hf.py's interface), read from the file alone.

Weights keep the file's numbers where kiln has the format (F32/F16/BF16 as stored, Q4_0 as q4, Q8_0
as q8g, Q4_1 as q4a in groups of 32; Q4_K as q4k, its super-blocks as they are); every other type is
dequantised by llama.cpp's own dequantiser and, where the compile quantises, requantised.
`default_options` picks the kiln format nearest each tensor's type when `--quant` is not given, and
`source_record` tells the manifest (and `kiln inspect`) what each tensor got."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kiln.errors import KilnError
from kiln.ir import Graph
from kiln.ir.types import numpy_dtype

from .blocks import block_quantizers, quantiser_source
from .decoder import DecoderConfig, build_graph
from .families import parse_config
from .gguf_config import hf_config
from .gguf_file import GGUFFile, open_gguf
from .gguf_tensors import FLOAT_TYPES, GGUFBlocks, GGUFCheckpoint
from .gguf_tokenizer import write_gguf_tokenizer

# The kiln format a compile without --quant gives each file type (general.file_type's dominant linear
# type): the same numbers where kiln stores them, else the nearest format that keeps llama.cpp's quality
# (bench/gguf_peers.py measures it). q8g (int8 in groups of 32) has CPU kernels only; q4a and q4k (int4 with
# group minimums) have CUDA kernels too, not yet measured on a GPU: until they are, GPU targets get q8.
FILE_TYPE_FORMATS = {"F32": None, "F16": None, "BF16": None, "Q4_0": ("q4", 32), "Q8_0": ("q8g", 32),
                     "Q4_1": ("q4a", 32), "Q4_K": ("q4k", 32)}
REQUANTIZED_FORMAT = ("q8g", 32)
ROPE_FACTOR_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight")
PERMUTED_QK = ("llama", "granitemoe")     # the converter's LlamaModel interleaved their q/k rows for rope


@dataclass
class GGUFModel:
    path: Path
    file: GGUFFile
    config: DecoderConfig
    checkpoint: GGUFCheckpoint

    @property
    def model_dir(self) -> Path:
        return self.path

    def build_graph(self, dtype: str, page_size: int) -> Graph:
        graph = build_graph(self.config, dtype, page_size)
        computed = self.config.computed_weights()
        for name, param in graph.params.items():
            if param.recipe is None and name not in computed:
                self._check_shape(name, tuple(param.type.shape))
        return graph

    def _check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        file_name = self.checkpoint.file_name(name)[0]
        if name not in self.checkpoint:
            raise KilnError(f"{self.path}: no tensor {file_name!r}, which the metadata's "
                            f"{self.config.architecture} needs (kiln's {name})")
        stored = self.checkpoint.shape(name)
        if stored != expected:
            raise KilnError(f"{self.path}: tensor {file_name!r} is {list(stored)}, the metadata implies "
                            f"{list(expected)}")

    def weight(self, name: str, dtype: str) -> np.ndarray:
        computed = self.config.computed_weights()
        if name in computed:
            return computed[name]()
        arr = self.checkpoint.get(name)
        if isinstance(arr, GGUFBlocks):
            arr = arr.dequantize(f"to {dtype}")
        return arr.astype(numpy_dtype(dtype), copy=False)

    def weight_source(self, name: str, dtype: str):
        """`weight(name, dtype)` for a quantiser: a quantised tensor's blocks as they are (the quantiser
        repacks them exactly where it can), a float one as stored where widening it to `dtype` is exact."""
        if name in self.config.computed_weights():
            return self.weight(name, dtype)
        arr = self.checkpoint.get(name)
        return arr if isinstance(arr, GGUFBlocks) else quantiser_source(arr, dtype)

    def quantizers(self, base: dict) -> dict:
        """kiln's quantisers (`base`: scheme -> function), each given a file's blocks first (frontend/blocks.py)."""
        return block_quantizers(base, lambda w: isinstance(w, GGUFBlocks))

    def linear_types(self) -> Counter:
        """The file's types of the blocks' matrices (what general.file_type names), by count."""
        return Counter(t.type_name for name, t in self.file.tensors.items()
                       if name.startswith("blk.") and len(t.shape) >= 2)

    def _nearest(self, type_name: str, target: str) -> tuple[str, int] | None:
        """The kiln format (scheme, group size) nearest a GGUF tensor type; None for a float type."""
        quant, group = FILE_TYPE_FORMATS.get(type_name, REQUANTIZED_FORMAT) or (None, 0)
        if quant is None:
            return None
        return ("q8", 0) if quant in ("q8g", "q4a", "q4k") and target != "cpu" else (quant, group)

    def default_options(self, options):
        """`options` with the kiln format nearest the file's where the compile did not name one (--quant):
        the blocks' linears by their dominant type, the LM head and the embedding table each by its own
        (a Q4_0 file's tied table is Q8_0: kept q8g for the head, q8 for the lookup, not made 4-bit)."""
        if options.quant == "none":
            return replace(options, quant=None)
        if options.quant is not None:
            return options
        target = options.target_name
        body = self._nearest(self.linear_types().most_common(1)[0][0], target)
        if body is None:
            return options
        quant, group = body
        table = self.file.tensors.get("token_embd.weight")
        head = self.file.tensors.get("output.weight", table)
        head_fmt = self._nearest(head.type_name, target) if head is not None else body
        table_fmt = self._nearest(table.type_name, target) if table is not None else body
        return replace(options, quant=quant, group_size=group or options.group_size,
                       quant_lm_head=head_fmt is not None, lm_head_quant=head_fmt[0] if head_fmt else None,
                       quant_embedding=table_fmt is not None, embedding_quant=table_fmt[0] if table_fmt else None,
                       tensor_quant=self._tensor_formats(body, target), more_bits=False)

    def _tensor_formats(self, body: tuple[str, int], target: str) -> tuple[tuple[str, str], ...]:
        """(kiln weight, scheme) for each block matrix of a type whose nearest format is not the body's
        (Q4_K_M's Q6_K value and down projections: q8g beside the Q4_K matrices' q4a). A float matrix in
        a quantised file keeps the body's format; so does one whose group size would differ."""
        found = []
        for name, param in self.build_graph("float32", 16).params.items():
            if param.recipe is not None or len(param.type.shape) != 2 or name not in self.checkpoint:
                continue
            file_name, _ = self.checkpoint.file_name(name)
            if not file_name.startswith("blk."):
                continue
            own = self._nearest(self.file.tensors[file_name].type_name, target)
            if own is not None and own != body and own[1] in (body[1], 0):
                found.append((name, own[0]))
        return tuple(found)

    def source_record(self) -> dict:
        """The manifest's `source`: the file, its tensor types and what each tensor became."""
        kinds = Counter(treatment for _, treatment in self.checkpoint.record)
        return {"format": "gguf", "file": self.file.path.name, "architecture": self.file.architecture,
                "name": self.file.metadata.get("general.name"), "tensor_types": self.checkpoint.tensor_types(),
                "treatments": dict(kinds.most_common())}

    def write_tokenizer(self, out_dir: Path) -> list[str]:
        return write_gguf_tokenizer(self.file.path, self.file.metadata, out_dir)


def _rope_factors(gguf: GGUFFile) -> np.ndarray | None:
    name = next((n for n in ROPE_FACTOR_TENSORS if n in gguf.tensors), None)
    return None if name is None else np.asarray(gguf.tensors[name].data, np.float32).reshape(-1)


def _check_types(gguf: GGUFFile) -> None:
    """Every tensor type of the file is one llama.cpp's dequantiser reads (tried on one row of each)."""
    from gguf.quants import dequantize
    firsts = {}
    for t in gguf.tensors.values():
        firsts.setdefault(t.type_name, t)
    for name, t in firsts.items():
        if name in FLOAT_TYPES:
            continue
        try:
            dequantize(np.asarray(t.data.reshape(-1, t.data.shape[-1])[:1]), t.qtype)
        except (NotImplementedError, ValueError, KeyError) as e:
            raise KilnError(f"{gguf.path}: tensor {t.name!r} is {name}, a type kiln cannot read "
                            f"({type(e).__name__}: {e})") from None


def load_gguf_model(path: str | Path) -> GGUFModel:
    gguf = open_gguf(path)
    _check_types(gguf)
    cfg = hf_config(gguf, _rope_factors(gguf))
    config = parse_config(cfg)
    permuted = gguf.architecture in PERMUTED_QK
    permute = (config.num_heads, config.num_kv_heads) if permuted else None
    offset = 1.0 if gguf.architecture in ("gemma2", "gemma3") else 0.0
    return GGUFModel(Path(path), gguf, config, GGUFCheckpoint(gguf, permute, offset))
