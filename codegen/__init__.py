"""IR -> TVM IRModule: one lowering per op family, weight layouts chosen by the target."""
from .lower import LoweredModel, lower_graph

__all__ = ["LoweredModel", "lower_graph"]
