"""kiln's compiled MoE kernels (codegen/lowering/moe.py) against the reference interpreter: every router
scheme, float and quantised experts, prefill-sized and decode-sized steps, a token routed to
fewer experts than top_k."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.ir import GraphBuilder, interpret, verify, weight_loader
from kiln.passes.quantize import Quantize

pytestmark = pytest.mark.build        # builds with TVM or runs what it built (not in make test-fast)

HIDDEN, FFN, EXPERTS = 64, 32, 8
ROUTERS = {
    "softmax_topk": dict(top_k=2, normalize=True),
    "softmax_topk-scaled": dict(top_k=3, scaling=2.5),
    "topk_softmax": dict(top_k=2),
    "softmax_group_max": dict(top_k=3, n_group=4, topk_group=2, scaling=1.5),
    "sigmoid_group_top2": dict(top_k=4, n_group=4, topk_group=2, normalize=True, scaling=2.5),
}


def moe_graph(scheme: str, attrs: dict, activation: str = "silu"):
    b = GraphBuilder("moe")
    logits = b.input("logits", ("tokens", EXPERTS), "float32")
    x = b.input("x", ("tokens", HIDDEN), "float32")
    bias = b.param("bias", (EXPERTS,), "float32") if scheme == "sigmoid_group_top2" else None
    routing = b.op("moe_router", logits, bias, scheme=scheme, **attrs)
    gate_up = b.param("gate_up", (EXPERTS, 2 * FFN, HIDDEN), "float32")
    down = b.param("down", (EXPERTS, HIDDEN, FFN), "float32")
    out = b.op("moe_experts", x, routing, gate_up, None, down, top_k=attrs["top_k"], activation=activation)
    return verify(b.output(b.op("add", out, x, name="out")))


def random_weights(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"gate_up": rng.standard_normal((EXPERTS, 2 * FFN, HIDDEN)).astype(np.float32) / HIDDEN ** 0.5,
            "down": rng.standard_normal((EXPERTS, HIDDEN, FFN)).astype(np.float32) / FFN ** 0.5,
            "bias": (rng.standard_normal(EXPERTS) * 0.1).astype(np.float32)}


def compiled(graph, load):
    """The graph built for this CPU: a function of the step inputs."""
    import tvm
    from tvm.runtime.vm import VirtualMachine

    from kiln.codegen import lower_graph
    from kiln.codegen.pipelines import relax_pipeline
    from kiln.selection.layouts import apply_layout
    from kiln.targets.cpu import CPUTarget
    from kiln.passes.select_kernels import SelectKernels
    target = CPUTarget()
    lowered = lower_graph(SelectKernels(target)(graph), target)
    with target.tvm_target(), tvm.transform.PassContext(config=target.pass_config()):
        mod = relax_pipeline(target)(lowered.module)
    vm = VirtualMachine(target.build(mod), tvm.cpu())
    weights = [tvm.runtime.tensor(apply_layout(w.layout, load(w.param)), tvm.cpu()) for w in lowered.weights]

    def run(inputs: dict) -> np.ndarray:
        args = [tvm.runtime.tensor(inputs[name], tvm.cpu()) for name in lowered.inputs]
        return vm["forward"](*args, *weights).numpy()
    return run


def steps(rng):
    """A prefill-sized step, a decode-sized one, and a step where one token's logits are -inf but
    for one expert (softmax gives the others exactly 0: routed to fewer than top_k)."""
    out = []
    for tokens in (37, 1):
        out.append({"logits": (rng.standard_normal((tokens, EXPERTS)) * 2).astype(np.float32),
                    "x": rng.standard_normal((tokens, HIDDEN)).astype(np.float32)})
    few = {"logits": (rng.standard_normal((5, EXPERTS)) * 2).astype(np.float32),
           "x": rng.standard_normal((5, HIDDEN)).astype(np.float32)}
    few["logits"][2] = -200.0
    few["logits"][2, 5] = 50.0
    out.append(few)
    return out


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_router_and_experts_kernels_equal_the_interpreter(router):
    scheme = router.split("-")[0]
    graph = moe_graph(scheme, ROUTERS[router])
    weights = random_weights()
    run = compiled(graph, weights.__getitem__)
    for step in steps(np.random.default_rng(1)):
        want = interpret(graph, step, weights.__getitem__)["out"]
        np.testing.assert_allclose(run(step), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["q8", "q4", "fp8"])
def test_quantised_experts_kernels_equal_the_interpreter_on_the_same_weights(mode):
    graph = Quantize(mode, group_size=16)(moe_graph("softmax_topk", ROUTERS["softmax_topk"], "gelu_tanh"))
    assert any(n.op == "moe_experts" and n.attrs["format"] == mode for n in graph.nodes)
    weights = random_weights(2)
    load = weight_loader(graph, weights.__getitem__)
    run = compiled(graph, load)
    for step in steps(np.random.default_rng(3)):
        want = interpret(graph, step, load)["out"]
        np.testing.assert_allclose(run(step), want, rtol=1e-5, atol=1e-5)
