"""Read an ONNX decoder: the graph's nodes, its initializers (inline or in external data files, read when
asked for), its inputs and outputs with their dims, and the JSON beside it (genai_config.json as ONNX Runtime
GenAI's builder writes it, or a Hugging Face config.json). The `onnx` package reads the protobuf; it is
needed at compile time only."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kiln.errors import KilnError

OPSETS = {"": (14, 23), "com.microsoft": (1, 1)}     # the operator sets kiln raises: domain -> versions


@dataclass
class ValueInfo:
    name: str
    dims: tuple                  # ints, names of symbolic dims, or None where unknown
    elem_type: int               # onnx.TensorProto's data type number


@dataclass
class ONNXFile:
    path: Path                   # model.onnx
    graph: object                # onnx.GraphProto
    inputs: dict[str, ValueInfo]
    outputs: dict[str, ValueInfo]
    initializers: dict[str, object]            # name -> onnx.TensorProto (data not yet read)
    genai_config: dict = field(default_factory=dict)
    hf_config: dict = field(default_factory=dict)
    producer: str = ""                         # who wrote the file (producer_name and version)
    _arrays: dict = field(default_factory=dict)

    @property
    def folder(self) -> Path:
        return self.path.parent

    def array(self, name: str) -> np.ndarray:
        """An initializer's values (external data read on first use, then kept)."""
        if name not in self._arrays:
            from onnx import numpy_helper
            try:
                self._arrays[name] = numpy_helper.to_array(self.initializers[name], base_dir=str(self.folder))
            except (OSError, ValueError) as e:
                raise KilnError(f"{self.path}: initializer {name!r} cannot be read ({e})") from None
        return self._arrays[name]

    def stored_type(self, name: str) -> str:
        """An initializer's element type as ONNX names it, in lower case (float, float16, bfloat16, uint8)."""
        from onnx import TensorProto
        return TensorProto.DataType.Name(self.initializers[name].data_type).lower()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.initializers[name].dims)

    def release(self, name: str) -> None:
        """Forget an initializer's values (a weight read once, into the artifact)."""
        self._arrays.pop(name, None)


def model_path(path: str | Path) -> Path:
    """The .onnx file `path` names: the file itself, or a directory's model.onnx (or its one *.onnx)."""
    path = Path(path)
    if path.is_file():
        return path
    named = path / "model.onnx"
    if named.exists():
        return named
    found = sorted(path.glob("*.onnx"))
    if len(found) != 1:
        raise KilnError(f"{path}: {'no' if not found else 'more than one'} .onnx file; name the model's file")
    return found[0]


def is_onnx(path: str | Path) -> bool:
    """Whether `path` is an .onnx file, or a directory holding one and no Hugging Face checkpoint."""
    path = Path(path)
    if path.is_file():
        return path.suffix == ".onnx"
    return path.is_dir() and any(path.glob("*.onnx")) and not any(path.glob("*.safetensors"))


def _dims(info) -> tuple:
    t = info.type.tensor_type
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise KilnError(f"{path}: not valid JSON ({e})") from None


def open_onnx(path: str | Path) -> ONNXFile:
    """The file's graph and side files; a file ONNX cannot parse, or an operator set kiln does not raise, is
    refused here."""
    try:
        import onnx
    except ImportError:
        raise KilnError("compiling an ONNX model needs the `onnx` package (pip install onnx)") from None
    file = model_path(path)
    try:
        model = onnx.load(str(file), load_external_data=False)
    except Exception as e:      # protobuf raises its own DecodeError; a truncated file other kinds
        raise KilnError(f"{file}: not an ONNX model ({type(e).__name__}: {e})") from None
    for opset in model.opset_import:
        low, high = OPSETS.get(opset.domain, (None, None))
        if low is None:
            raise KilnError(f"{file}: operator set domain {opset.domain!r} (version {opset.version}) is not one kiln "
                            f"raises (it knows {', '.join(repr(d) for d in OPSETS)})")
        if not low <= opset.version <= high:
            raise KilnError(f"{file}: opset {opset.version} of domain {opset.domain or 'ai.onnx'!r} is outside the "
                            f"versions kiln raises ({low}..{high})")
    g = model.graph
    initializers = {t.name: t for t in g.initializer}
    inputs = {i.name: ValueInfo(i.name, _dims(i), i.type.tensor_type.elem_type) for i in g.input
              if i.name not in initializers}
    outputs = {o.name: ValueInfo(o.name, _dims(o), o.type.tensor_type.elem_type) for o in g.output}
    return ONNXFile(file, g, inputs, outputs, initializers, _read_json(file.parent / "genai_config.json"),
                    _read_json(file.parent / "config.json"), f"{model.producer_name} {model.producer_version}".strip())
