"""Importers: Hugging Face model directories and GGUF files -> kiln IR."""
from .hf import HFModel, load_hf_model


def load_model(path):
    """The importer for what `path` holds: a GGUF file (or a directory with one and no config.json), or an
    HF model directory."""
    from .gguf_file import is_gguf
    if is_gguf(path):
        from .gguf_model import load_gguf_model
        return load_gguf_model(path)
    return load_hf_model(path)


__all__ = ["HFModel", "load_hf_model", "load_model"]
