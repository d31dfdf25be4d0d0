"""Importers: Hugging Face model directories -> kiln IR."""
from .hf import HFModel, load_hf_model

__all__ = ["HFModel", "load_hf_model"]
