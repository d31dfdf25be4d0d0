"""Graph -> graph rewrites, run by the pass manager in passes/pipeline.py."""
from .pipeline import PassRecord, run_pipeline

__all__ = ["PassRecord", "run_pipeline"]
