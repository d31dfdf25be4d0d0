"""IR -> TVM IRModule: one lowering per op family, weight layouts chosen by the target."""
from __future__ import annotations

__all__ = ["LoweredModel", "lower_graph"]


def __getattr__(name: str):
    # Loaded on first use: the GPU machine's tests import TVM-free modules of this package
    # (gemv_tuning) where TVM has only its runtime, which cannot import relax.
    if name in __all__:
        from . import lower
        return getattr(lower, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
