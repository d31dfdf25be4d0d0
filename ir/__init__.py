"""kiln's graph IR: typed SSA dataflow at the level of LLM operators.

Plain Python + NumPy; importable without TVM.
"""
from .types import TensorType, Dim, DTYPES, IRError
from .graph import Graph, Node, Param
from .builder import GraphBuilder
from .ops import OPS, OpDef, weight_format
from .opdef import attrs_for, input_of, named_inputs
from .verify import verify
from .printer import print_graph
from .parser import parse_graph
from .serialize import graph_to_json, graph_from_json
from .interpreter import interpret
from .weights import plain_reads, weight_loader

__all__ = ["TensorType", "Dim", "DTYPES", "IRError", "Graph", "Node", "Param", "GraphBuilder",
           "OPS", "OpDef", "attrs_for", "input_of", "named_inputs", "weight_format", "verify", "print_graph", "parse_graph", "graph_to_json", "graph_from_json", "interpret", "plain_reads", "weight_loader"]
