"""Importers: Hugging Face model directories, GGUF files and ONNX decoders -> kiln IR."""
from .hf import HFModel, load_hf_model


def load_model(path):
    """The importer for what `path` holds: a GGUF file (or a directory with one and no config.json), an ONNX
    file (or a directory with one and no safetensors), or an HF model directory."""
    from .gguf_file import is_gguf
    from .onnx_file import is_onnx
    if is_gguf(path):
        from .gguf_model import load_gguf_model
        return load_gguf_model(path)
    if is_onnx(path):
        from .onnx_model import load_onnx_model
        return load_onnx_model(path)
    return load_hf_model(path)


__all__ = ["HFModel", "load_hf_model", "load_model"]
