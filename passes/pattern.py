"""Named-input patterns over the graph, and the one driver the fusions run on.

A `Pat` names an op (or several) and, for any of its inputs by name, what must feed it:
  - another `Pat`: the value's producer must match it;
  - a capture name (a str): the value is bound to it, and a name used twice must bind one value;
  - None: the optional input is left out.
`name=` binds the matched node, `sole=True` asks that its value have no other reader, `test=` is a
check on the node alone, and `either_order=True` lets a binary op (add, mul) match with its two
inputs swapped. A `Rule` is a pattern, a `where` over the whole match and a `rewrite` that edits the
graph in place; `apply_rules` runs the rules over every node once, in graph order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from kiln.ir import Graph, Node
from kiln.ir.ops import OPS

from .rewrite import users


@dataclass(frozen=True, eq=False)
class Pat:
    op: str | tuple[str, ...]
    inputs: Mapping[str, "Pat | str | None"] = field(default_factory=dict)
    name: str | None = None
    sole: bool = False
    test: Callable[[Node], bool] | None = None
    either_order: bool = False

    def accepts(self, op_name: str) -> bool:
        return op_name == self.op if isinstance(self.op, str) else op_name in self.op


@dataclass
class Match:
    nodes: dict[str, Node] = field(default_factory=dict)     # Pat.name -> node
    values: dict[str, str | None] = field(default_factory=dict)   # capture -> value name

    def __getitem__(self, key: str):
        return self.nodes[key] if key in self.nodes else self.values[key]


class GraphIndex:
    """Who produces and who reads each value, as the graph stands."""

    def __init__(self, graph: Graph):
        self.producers = {n.output: n for n in graph.nodes}
        self.readers = users(graph)


def match(pattern: Pat, node: Node | None, index: GraphIndex) -> Match | None:
    found = Match()
    return found if _match_node(pattern, node, index, found) else None


def _match_node(pat: Pat, node: Node | None, index: GraphIndex, found: Match) -> bool:
    if node is None or not pat.accepts(node.op):
        return False
    if pat.sole and len(index.readers[node.output]) != 1:
        return False
    if pat.test is not None and not pat.test(node):
        return False
    for inputs in _orders(pat, node):
        trial = Match(dict(found.nodes), dict(found.values))
        if all(_match_input(want, OPS[node.op].input_of(node, name), index, trial) for name, want in inputs.items()):
            found.nodes, found.values = trial.nodes, trial.values
            if pat.name:
                found.nodes[pat.name] = node
            return True
    return False


def _orders(pat: Pat, node: Node) -> list[Mapping]:
    if not pat.either_order:
        return [pat.inputs]
    first, second = (n.rstrip("?") for n in OPS[node.op].inputs)
    swapped = {{first: second, second: first}.get(k, k): v for k, v in pat.inputs.items()}
    return [pat.inputs, swapped]


def _match_input(want, value: str | None, index: GraphIndex, found: Match) -> bool:
    if want is None:
        return value is None
    if isinstance(want, str):
        if want in found.values:
            return found.values[want] == value
        found.values[want] = value
        return True
    return value is not None and _match_node(want, index.producers.get(value), index, found)


def always(graph: Graph, found: Match) -> bool:
    return True


@dataclass(frozen=True)
class Rule:
    pattern: Pat
    rewrite: Callable[[Graph, Match], None]          # edits the graph in place
    where: Callable[[Graph, Match], bool] = always   # what the pattern's shape alone cannot say


def apply_rules(graph: Graph, rules: list[Rule]) -> int:
    """Try the rules, first match wins, at each node in graph order; nodes a rewrite removed are
    skipped. The index is rebuilt after each rewrite, so later matches see the graph as it is.
    Returns how many rewrites ran."""
    fired = 0
    index = GraphIndex(graph)
    for node in list(graph.nodes):
        if index.producers.get(node.output) is not node:
            continue
        for rule in rules:
            found = match(rule.pattern, node, index)
            if found is not None and rule.where(graph, found):
                rule.rewrite(graph, found)
                fired += 1
                index = GraphIndex(graph)
                break
    return fired
