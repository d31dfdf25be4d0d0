"""The MoE ops against transformers' own modules (issue 13): moe_router against each family's router
(the same router logits in, the same experts and weights out), moe_experts against its 3-D experts."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.ir import GraphBuilder, IRError, interpret, verify

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HIDDEN, TOKENS = 32, 24


def router(module_path: str, config_class: str, **fields):
    """transformers' router module for a small config, with random weights (and bias, where it has one)."""
    import importlib
    cls = getattr(importlib.import_module(f"transformers.models.{module_path.rsplit('.', 1)[0]}"),
                  module_path.rsplit(".", 1)[1])
    module = cls(getattr(transformers, config_class)(hidden_size=HIDDEN, **fields)).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=generator))
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.copy_(torch.randn(module.weight.shape[0], generator=generator) * 0.1)
    return module


def dense(weights, indices, experts) -> np.ndarray:
    out = np.zeros((weights.shape[0], experts), np.float32)
    np.put_along_axis(out, indices.numpy(), weights.float().numpy(), axis=-1)
    return out


def kiln_routing(logits: np.ndarray, bias=None, **attrs) -> np.ndarray:
    b = GraphBuilder("router")
    x = b.input("logits", ("tokens", logits.shape[1]), "float32")
    extra = [b.input("bias", (logits.shape[1],), "float32")] if bias is not None else []
    graph = verify(b.output(b.op("moe_router", x, *extra, name="w", **attrs)))
    return interpret(graph, {"logits": logits, **({"bias": bias} if bias is not None else {})}, lambda n: None)["w"]


CASES = {
    "mixtral": (("mixtral.modeling_mixtral.MixtralTopKRouter", "MixtralConfig",
                 dict(num_local_experts=8, num_experts_per_tok=2)),
                dict(scheme="softmax_topk", top_k=2, normalize=True)),
    "qwen2_moe-normalised": (("qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter", "Qwen2MoeConfig",
                              dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=True)),
                             dict(scheme="softmax_topk", top_k=3, normalize=True)),
    "qwen2_moe-raw": (("qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter", "Qwen2MoeConfig",
                       dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False)),
                      dict(scheme="softmax_topk", top_k=3, normalize=False)),
    "granite_moe": (("granitemoe.modeling_granitemoe.GraniteMoeTopKRouter", "GraniteMoeConfig",
                     dict(num_local_experts=8, num_experts_per_tok=2)),
                    dict(scheme="topk_softmax", top_k=2)),
    "deepseek_v2-greedy": (("deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter", "DeepseekV2Config",
                            dict(n_routed_experts=16, num_experts_per_tok=3, topk_method="greedy",
                                 routed_scaling_factor=2.5)),
                           dict(scheme="softmax_topk", top_k=3, scaling=2.5)),
    "deepseek_v2-group-limited": (("deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter", "DeepseekV2Config",
                                   dict(n_routed_experts=16, num_experts_per_tok=3, topk_method="group_limited_greedy",
                                        n_group=4, topk_group=2, routed_scaling_factor=2.5)),
                                  dict(scheme="softmax_group_max", top_k=3, scaling=2.5, n_group=4, topk_group=2)),
    "deepseek_v3": (("deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter", "DeepseekV3Config",
                     dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                          norm_topk_prob=True, routed_scaling_factor=2.5)),
                    dict(scheme="sigmoid_group_top2", top_k=4, normalize=True, scaling=2.5, n_group=4, topk_group=2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_routing_equals_transformers(case):
    (module_path, config_class, fields), attrs = CASES[case]
    module = router(module_path, config_class, **fields)
    hidden = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, weights, indices = module(hidden)
    experts = module.weight.shape[0]
    bias = module.e_score_correction_bias.numpy().astype(np.float32) if hasattr(module, "e_score_correction_bias") \
        else None
    got = kiln_routing(logits.float().numpy(), bias, **attrs)
    want = dense(weights, indices, experts)
    np.testing.assert_array_equal(got > 0, want > 0)                   # the same experts
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)         # with the same weights
    assert (np.count_nonzero(got, axis=1) == attrs["top_k"]).all()


def test_deepseek_v3_chooses_with_the_bias_but_weighs_without_it():
    """A large bias on one expert makes every token choose it; its weight stays its own score."""
    logits = np.random.default_rng(3).standard_normal((5, 8)).astype(np.float32)
    bias = np.zeros(8, np.float32)
    bias[6] = 10.0
    got = kiln_routing(logits, bias, scheme="sigmoid_group_top2", top_k=2, n_group=1, topk_group=1)
    np.testing.assert_allclose(got[:, 6], 1 / (1 + np.exp(-logits[:, 6])), rtol=1e-6)


@pytest.mark.parametrize("attrs,words", [
    (dict(scheme="softmax_top", top_k=2), "scheme must be one of"),
    (dict(scheme="softmax_topk", top_k=9), "top_k 9"),
    (dict(scheme="softmax_group_max", top_k=2, n_group=3), "do not split into 3 groups"),
    (dict(scheme="sigmoid_group_top2", top_k=2), "takes the score-correction bias"),
])
def test_malformed_routers_are_refused(attrs, words):
    with pytest.raises(IRError, match=words):
        kiln_routing(np.zeros((2, 8), np.float32), **attrs)


EXPERTS = {
    "mixtral": ("mixtral.modeling_mixtral.MixtralExperts", "MixtralConfig", dict(num_local_experts=8)),
    "qwen2_moe": ("qwen2_moe.modeling_qwen2_moe.Qwen2MoeExperts", "Qwen2MoeConfig",
                  dict(num_experts=8, moe_intermediate_size=24)),
    "olmoe": ("olmoe.modeling_olmoe.OlmoeExperts", "OlmoeConfig", dict(num_experts=8)),
    "deepseek_v3": ("deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts", "DeepseekV3Config",
                    dict(n_routed_experts=8, moe_intermediate_size=24)),
}


@pytest.mark.parametrize("family", sorted(EXPERTS))
def test_experts_equal_transformers(family):
    """moe_experts on transformers' own 3-D expert weights and top-k routing: the same output."""
    import importlib
    path, config_class, fields = EXPERTS[family]
    module_name, cls = path.rsplit(".", 1)
    config = getattr(transformers, config_class)(hidden_size=HIDDEN, intermediate_size=40, **fields)
    experts = getattr(importlib.import_module(f"transformers.models.{module_name}"), cls)(config).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in (experts.gate_up_proj, experts.down_proj):
            p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
        hidden = torch.randn(TOKENS, HIDDEN, generator=generator)
        routing = kiln_routing(torch.randn(TOKENS, 8, generator=generator).numpy(), scheme="softmax_topk", top_k=2)
        indices = torch.from_numpy(np.argsort(-routing, axis=-1)[:, :2].copy())
        weights = torch.from_numpy(np.take_along_axis(routing, indices.numpy(), -1))
        want = experts(hidden, indices, weights).numpy()
    b = GraphBuilder("experts")
    x, r = b.input("x", ("tokens", HIDDEN), "float32"), b.input("routing", ("tokens", 8), "float32")
    gate_up = b.param("gate_up", tuple(experts.gate_up_proj.shape), "float32")
    down = b.param("down", tuple(experts.down_proj.shape), "float32")
    graph = verify(b.output(b.op("moe_experts", x, r, gate_up, None, down, name="y", top_k=2)))
    params = {"gate_up": experts.gate_up_proj.detach().numpy(), "down": experts.down_proj.detach().numpy()}
    got = interpret(graph, {"x": hidden.numpy(), "routing": routing}, params.__getitem__)["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.abs(want).max() > 0.1


def _dequantised(mode: str, q: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """Experts' float weights from their stored form, written out here (not ir/quant.py's)."""
    if mode == "q4":
        low, high = (q & 15).astype(np.float32) - 8, (q >> 4).astype(np.float32) - 8
        values = np.stack([low, high], axis=-1).reshape(q.shape[0], q.shape[1], -1)
        return values * np.repeat(scale.astype(np.float32).transpose(0, 2, 1), group, axis=2)
    return q.astype(np.float32) * scale[:, :, None]


@pytest.mark.parametrize("mode", ["q8", "q4", "fp8"])
def test_quantised_experts_are_the_experts_of_their_dequantised_weights(mode):
    from kiln.ir import input_of, weight_loader
    from kiln.passes.quantize import Quantize
    rng = np.random.default_rng(4)
    b = GraphBuilder("experts")
    x, r = b.input("x", ("tokens", HIDDEN), "float32"), b.input("routing", ("tokens", 8), "float32")
    gate_up, down = b.param("gate_up", (8, 48, HIDDEN), "float32"), b.param("down", (8, HIDDEN, 24), "float32")
    graph = Quantize(mode, group_size=8)(b.output(b.op("moe_experts", x, r, gate_up, None, down, name="y", top_k=2)))
    [node] = graph.nodes
    assert node.op == "moe_experts" and node.attrs["format"] == mode
    floats = {"gate_up": rng.standard_normal((8, 48, HIDDEN)).astype(np.float32),
              "down": rng.standard_normal((8, HIDDEN, 24)).astype(np.float32)}
    load = weight_loader(graph, floats.__getitem__)
    parts = {name: load(input_of(node, name)) for name in ("gate_up", "gate_up_scale", "down", "down_scale")}
    dequantised = {name: _dequantised(mode, parts[name], parts[f"{name}_scale"], 8) for name in ("gate_up", "down")}
    routing = kiln_routing(rng.standard_normal((TOKENS, 8)).astype(np.float32), scheme="softmax_topk", top_k=2)
    inputs = {"x": rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32), "routing": routing}
    b = GraphBuilder("experts")
    x, r = b.input("x", ("tokens", HIDDEN), "float32"), b.input("routing", ("tokens", 8), "float32")
    plain = verify(b.output(b.op("moe_experts", x, r, b.param("gate_up", (8, 48, HIDDEN), "float32"), None,
                                 b.param("down", (8, HIDDEN, 24), "float32"), name="y", top_k=2)))
    want = interpret(plain, inputs, dequantised.__getitem__)["y"]
    np.testing.assert_allclose(interpret(graph, inputs, load)["y"], want, rtol=1e-5, atol=1e-4)
    assert np.abs(want - interpret(plain, inputs, floats.__getitem__)["y"]).max() > 0   # really quantised


def test_a_token_routed_to_more_than_top_k_experts_is_refused():
    b = GraphBuilder("experts")
    x, r = b.input("x", ("tokens", HIDDEN), "float32"), b.input("routing", ("tokens", 4), "float32")
    graph = verify(b.output(b.op("moe_experts", x, r, b.param("gate_up", (4, 8, HIDDEN), "float32"), None,
                                 b.param("down", (4, HIDDEN, 4), "float32"), name="y", top_k=1)))
    weights = {"gate_up": np.ones((4, 8, HIDDEN), np.float32), "down": np.ones((4, HIDDEN, 4), np.float32)}
    with pytest.raises(IRError, match="more than top_k=1"):
        interpret(graph, {"x": np.ones((2, HIDDEN), np.float32), "routing": np.full((2, 4), 0.25, np.float32)},
                  weights.__getitem__)
