"""An ONNX decoder as kiln's importer sees any model (frontend/hf.py's interface): a graph and weights by kiln
param name, the tokenizer files beside the model, and a DecoderConfig that records what the translation found
(sizes, heads, rope, special tokens) for the manifest: the graph is the file's, raised, not rebuilt from it.

Weights keep the file's numbers where kiln has the format: float initializers as stored, MatMulNBits' symmetric
4-bit blocks as q4 and blocks with zero points as q4a (frontend/onnx_weights.py). `default_options` picks that
format when `--quant` is not given, and `source_record` tells the manifest (and `kiln inspect`) what each
tensor got."""
from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kiln.ir import Graph
from kiln.ir.types import numpy_dtype

from .blocks import block_quantizers, quantiser_source
from .decoder import DecoderConfig
from .hf import TOKENIZER_FILES
from .onnx_file import ONNXFile, open_onnx
from .onnx_graph import translate
from .onnx_translation import Translation
from .onnx_weights import NBitsMatrix

CHECK_PAGE_SIZE = 16        # the page size of the translation made when the file is opened (to refuse it early)


@dataclass
class ONNXModel:
    file: ONNXFile
    config: DecoderConfig
    translation: Translation           # float32's, made when the file was opened

    @property
    def model_dir(self) -> Path:
        return self.file.folder

    def build_graph(self, dtype: str, page_size: int) -> Graph:
        self.translation = translate(self.file, dtype, page_size, self.translation.scale_dtype)
        return self.translation.graph

    @property
    def checkpoint(self) -> ONNXModel:
        return self

    def read_ahead(self, names) -> None:
        """Initializers are read when a weight asks for them (weights/convert.py's hint has nothing to do)."""

    def _source(self, name: str):
        return self.translation.weights[name]()

    def weight(self, name: str, dtype: str) -> np.ndarray:
        arr = self._source(name)
        if isinstance(arr, NBitsMatrix):
            arr = arr.dequantize(f"to {dtype}")
        return np.asarray(arr).astype(numpy_dtype(dtype), copy=False)

    def weight_source(self, name: str, dtype: str):
        """`weight(name, dtype)` for a quantiser: MatMulNBits blocks as they are (the quantiser keeps them where
        it can), a float initializer as stored where widening it to `dtype` is exact."""
        arr = self._source(name)
        return arr if isinstance(arr, NBitsMatrix) else quantiser_source(arr, dtype)

    def quantizers(self, base: dict) -> dict:
        return block_quantizers(base, lambda w: isinstance(w, NBitsMatrix))

    def default_options(self, options):
        """`options` with the file's 4-bit format where the compile names none (--quant): q4 for symmetric blocks
        (q4a, a CPU format, for blocks with zero points; GPU targets get q8 for those) in the file's most common
        block size, the LM head too when the file quantised it; the embedding table as the file keeps it; their
        float32 scales kept in float32 on CPUs unless --group-scales says; int8 activations where its blocks
        compute on them (accuracy level 4, as the builder's CPU files), float ones where they compute in float
        (its CUDA files), unless --activations says. A float file keeps its floats."""
        if options.quant == "none":
            return replace(options, quant=None)
        if not self.translation.nbits:
            return options
        # what the blocks' scales are stored in: float32 as the file's are where the target's kernels read them
        # (the CPU's; GPU kernels read float16)
        wide = options.target_name == "cpu" and any(n.scale_type == "float" for n in self.translation.nbits)
        self.translation.scale_dtype = options.scale_dtype or ("float32" if wide else "float16")
        options = replace(options, scale_dtype=self.translation.scale_dtype)
        if options.quant is not None:
            return options
        (scheme, block), _ = Counter((n.scheme, n.block) for n in self.translation.nbits).most_common(1)[0]
        if scheme == "q4a" and options.target_name != "cpu":
            scheme, block = "q8", options.group_size
        head = self._lm_head()
        head_quantised = any(n.param == head for n in self.translation.nbits)
        int8_computed = any(n.accuracy_level == 4 for n in self.translation.nbits)
        int8 = False if options.int8_activations is None and not int8_computed else options.int8_activations
        return replace(options, quant=scheme, group_size=block, quant_lm_head=head_quantised,
                       lm_head_quant=scheme if head_quantised else None, quant_embedding=False, more_bits=False,
                       int8_activations=int8)

    def _lm_head(self) -> str | None:
        graph = self.translation.graph
        node = graph.producer(graph.producer(graph.outputs[0]).inputs[0])
        return node.inputs[1] if node is not None and node.op == "linear" else None

    def source_record(self) -> dict:
        """The manifest's `source`: the file, its producer, its operator sets and what each weight became."""
        kinds = Counter(treatment for _, treatment in self.translation.record)
        model = self.file.genai_config.get("model", {})
        return {"format": "onnx", "file": self.file.path.name, "architecture": model.get("type") or "decoder",
                "name": self.file.producer, "tensor_types": dict(self.translation.tensor_types.most_common()),
                "treatments": dict(kinds.most_common())}

    def write_tokenizer(self, out_dir: Path) -> list[str]:
        names = []
        for name in TOKENIZER_FILES:
            if name != "tokenizer.model" and (self.file.folder / name).exists():
                shutil.copy(self.file.folder / name, out_dir / name)
                names.append(name)
        return sorted(names)


def _config(file: ONNXFile, t: Translation) -> DecoderConfig:
    """What the translation found, as the manifest records a model."""
    graph = t.graph
    layers = [t.layers[i] for i in sorted(t.layers)]
    embed = next(n for n in graph.nodes if n.op == "embed")
    vocab, hidden = graph.params[embed.inputs[1]].type.shape
    downs = [n for n in graph.nodes if n.op == "linear" and graph.producer(n.inputs[0]) is not None
             and graph.producer(n.inputs[0]).op in ("mul", "swiglu")]
    intermediate = graph.params[downs[0].inputs[1]].type.shape[1] if downs else 0
    model = file.genai_config.get("model", {})
    hf = file.hf_config
    rope_rows = max((rows for _, _, _, rows in t.rope.values()), default=0)
    context = model.get("context_length") or hf.get("max_position_embeddings") or rope_rows or 4096
    head = graph.producer(graph.producer(graph.outputs[0]).inputs[0])
    inv = next((t.weights[name]() for name, *_ in t.rope.values()), None)
    configured = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    theta = float(inv[1] ** -len(inv)) if inv is not None and len(inv) > 1 else float(configured)   # f_i = θ^(-i/len)
    windows = {layer.window for layer in layers}
    return DecoderConfig(
        architecture=(hf.get("architectures") or [f"onnx:{model.get('type', 'decoder')}"])[0],
        model_type=model.get("type") or hf.get("model_type") or "onnx",
        vocab_size=int(vocab), hidden_size=int(hidden), intermediate_size=int(intermediate),
        num_layers=len(layers), num_heads=layers[0].heads, num_kv_heads=layers[0].kv_heads,
        head_dim=layers[0].head_dim, rms_norm_eps=t.eps[0] if t.eps else float(hf.get("rms_norm_eps", 1e-5)),
        rope_theta=theta, rope_scaling=None,
        max_position_embeddings=int(min(context, rope_rows) if rope_rows else context),
        tie_word_embeddings=head is not None and head.inputs[1:2] == embed.inputs[1:2],
        bos_token_id=model.get("bos_token_id", hf.get("bos_token_id")),
        eos_token_id=model.get("eos_token_id", hf.get("eos_token_id")),
        sliding_window=max(windows) or None,
        layer_types=tuple("sliding_attention" if layer.window else "full_attention" for layer in layers)
        if len(windows) > 1 else ())


def load_onnx_model(path: str | Path) -> ONNXModel:
    file = open_onnx(path)
    t = translate(file, "float32", CHECK_PAGE_SIZE)
    return ONNXModel(file, _config(file, t), t)
