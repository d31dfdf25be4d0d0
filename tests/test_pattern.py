"""The pattern matcher and rule driver the fusions run on (passes/pattern.py), on graphs read from text."""
from __future__ import annotations

from kiln.ir import parse_graph, print_graph
from kiln.passes.pattern import GraphIndex, Pat, Rule, apply_rules, match

GRAPH = parse_graph("""
    graph block(
        %x: f32[tokens, 8],
        %y: f32[tokens, 8],
    ) {
      @w: f32[8, 8]
      %a = linear(%x, @w) : f32[tokens, 8]
      %b = linear(%y, @w) : f32[tokens, 8]
      %s = silu(%a) : f32[tokens, 8]
      %m = mul(%b, %s) : f32[tokens, 8]
      %n = add(%m, %m) : f32[tokens, 8]
      return %n, %b
    }""")


def node(name):
    return next(n for n in GRAPH.nodes if n.output == name)


def test_named_inputs_bind_nodes_and_values():
    found = match(Pat("silu", {"x": Pat("linear", {"x": "input", "bias": None}, name="proj")}, name="act"),
                  node("s"), GraphIndex(GRAPH))
    assert found["act"] is node("s") and found["proj"] is node("a") and found["input"] == "x"


def test_a_capture_used_twice_must_bind_one_value():
    index = GraphIndex(GRAPH)
    assert match(Pat("add", {"a": "v", "b": "v"}), node("n"), index) is not None
    assert match(Pat("mul", {"a": "v", "b": "v"}), node("m"), index) is None


def test_either_order_tries_the_swapped_inputs():
    index = GraphIndex(GRAPH)
    act_first = {"a": Pat("silu"), "b": Pat("linear")}
    assert match(Pat("mul", act_first), node("m"), index) is None
    assert match(Pat("mul", act_first, either_order=True), node("m"), index) is not None


def test_sole_refuses_a_value_read_elsewhere():
    index = GraphIndex(GRAPH)
    assert match(Pat("silu", {"x": Pat("linear", sole=True)}), node("s"), index) is not None
    # %b is also a graph output
    assert match(Pat("mul", {"a": Pat("linear", sole=True)}), node("m"), index) is None


def test_none_asks_for_a_left_out_input_and_test_checks_the_node():
    index = GraphIndex(GRAPH)
    assert match(Pat("linear", {"bias": "bias"}), node("a"), index)["bias"] is None
    assert match(Pat("linear", {"x": None}), node("a"), index) is None
    assert match(Pat("linear", test=lambda n: n.output == "b"), node("a"), index) is None


def test_apply_rules_sees_each_rewrite_and_where_can_decline():
    graph = parse_graph(print_graph(GRAPH))
    twice = Pat("add", {"a": "v", "b": "v"}, name="add")

    def to_mul(g, found):
        found["add"].op = "mul"
    assert apply_rules(graph, [Rule(twice, to_mul, where=lambda g, found: False)]) == 0
    assert apply_rules(graph, [Rule(twice, to_mul)]) == 1
    assert [n.op for n in graph.nodes][-1] == "mul"
